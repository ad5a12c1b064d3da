"""benchmarks/second_round.py: each arm is the one training setting it names, and the table's arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from dynrubric.config_loader import load_settings
from dynrubric.train.policy_eval import VersionOutcomes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import second_round as sr
finally:
    sys.path.pop(0)

#: what each arm changes against `shipped`, as dotted keys of the settings
CHANGES = {
    "shipped": set(),
    "centred": {"train.grpo.advantages"},
    "warmup": {"train.grpo.warmup_updates"},
    "carry": {"train.grpo.warmup_updates", "train.grpo.optimizer_across_rounds"},
    "kl_parent": {"train.grpo.kl_reference"},
    "dynamic": {"train.dynamic_sampling.oversample"},
}


def _leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _leaves(v, f"{prefix}.{k}" if prefix else k)
    return out


def test_each_arm_differs_from_the_shipped_demo_in_its_own_setting_alone(tmp_path: Path):
    """The arms are validated settings (a renamed key fails here), and an arm's run differs from `shipped`'s run
    with the same seed in exactly the keys it names, each to a value other than the shipped one."""
    base = load_settings(None, {}, profile="demo")
    prompts = tmp_path / "prompts.jsonl"

    def run(arm: str) -> dict[str, Any]:
        return _leaves(sr.arm_settings(base, arm, 3, tmp_path / "run", prompts, "http://x").model_dump(mode="json"))

    shipped = run("shipped")
    assert shipped["train.seed"] == 3 and shipped["train.prompt_source"] == "jsonl"
    assert set(CHANGES) == set(sr.ARMS)
    for arm, keys in CHANGES.items():
        mine = run(arm)
        assert {k for k in mine if mine[k] != shipped[k]} == keys, arm


def test_served_is_the_last_accepted_candidate_else_what_the_first_round_started_from():
    assert sr.served_after(["base", "r1"], ["r1", "r2"], [True, True]) == "r2"
    assert sr.served_after(["base", "r1"], ["r1", "r2"], [True, False]) == "r1"
    assert sr.served_after(["base", "base"], ["r1", "r2"], [False, True]) == "r2"
    assert sr.served_after(["base", "base"], ["r1", None], [False, False]) == "base"


def _outcomes(version: str, scores: dict[str, float]) -> VersionOutcomes:
    return VersionOutcomes(
        version=version, eval_key="k", scores=scores, kinds=dict.fromkeys(scores, "instruction"), responses={}
    )


def test_round_two_is_paired_with_each_seeds_own_parent_on_the_prompts_all_answered():
    """Seed 0's candidate passes where its parent fails; seed 1's equals its parent: the pooled delta is half of
    seed 0's, over the two prompts every run answered (the third is left out, not counted as a fail)."""
    new = [_outcomes("r2", {"a": 1, "b": 1, "c": 1}), _outcomes("r2", {"a": 0, "b": 1})]
    parents = [_outcomes("r1", {"a": 0, "b": 0, "c": 0}), _outcomes("base", {"a": 0, "b": 1})]
    delta, low, high = sr.pooled_delta(new, parents, samples=200)
    assert delta == pytest.approx(0.5)
    assert low <= delta <= high
    with pytest.raises(ValueError, match="one reference per run"):
        sr.pooled_delta(new, parents[:1])


def test_runs_recorded_by_an_earlier_invocation_are_not_trained_again(tmp_path: Path):
    """A later session adds seeds: what results.jsonl holds is skipped, the rest kept in seed-then-arm order."""
    import json

    import supervision

    record = tmp_path / "results.jsonl"
    assert supervision.pending_runs(record, range(2), ["shipped", "carry"]) == [
        (0, "shipped"),
        (0, "carry"),
        (1, "shipped"),
        (1, "carry"),
    ]
    record.write_text(json.dumps({"arm": "carry", "seed": 0}) + "\n" + json.dumps({"arm": "shipped", "seed": 7}) + "\n")
    assert supervision.pending_runs(record, range(2), ["shipped", "carry"]) == [
        (0, "shipped"),
        (1, "shipped"),
        (1, "carry"),
    ]


def test_each_seeds_round_two_is_compared_with_its_own_parent_on_dev_and_counted_where_its_ci_is_above_0():
    """Issue 38's "round 2 gains on its parent, the CI above 0, in 2 of 3 seeds" is a per-seed count: seed 0 gains
    on all 30 dev prompts, seed 1 on none, and a run without dev outcomes is shown as unmeasured."""
    keys = [f"p{i}" for i in range(30)]
    gains = sr.seeds_gaining_on_dev(
        [{"dev": _outcomes("r2", dict.fromkeys(keys, 1.0))}, {"dev": _outcomes("r2", dict.fromkeys(keys, 0.0))}, {}],
        [{"dev": _outcomes("r1", dict.fromkeys(keys, 0.0))}, {"dev": _outcomes("base", dict.fromkeys(keys, 0.0))}, {}],
    )
    assert gains[0] is not None and gains[0][0] == pytest.approx(1.0) and gains[0][1] > 0
    assert gains[1] is not None and gains[1][1] <= 0
    assert gains[2] is None
