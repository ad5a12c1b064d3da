"""A round's plan before any training: what it builds on, what it holds out, and the collapse window
it carries from the rounds before (fast: no step is trained)."""

from __future__ import annotations

import json
from pathlib import Path

from dynrubric.config import RubricConfig, Settings
from dynrubric.registry import CheckpointState, Registry
from dynrubric.rubric.gaps import CollapseDetector, gap_stats
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.train.prompts import JsonlPromptSource, ResponseHistory, heldout_bucket
from dynrubric.train.records import write_record
from dynrubric.train.rounds import SUMMARY, RoundRunner
from tests.run_records import round_summary
from tests.train_harness import write_prompts


def runner_at(state: Path, model_dir: Path, prompts: Path, **train) -> RoundRunner:
    settings = Settings.model_validate(
        {
            "paths": {"state_dir": str(state)},
            "models": {"policy": str(model_dir)},
            "train": {"prompts_file": str(prompts), "max_prompts_per_round": 16, "heldout_prompts": 4, **train},
        }
    )
    return RoundRunner(
        settings,
        Registry(state / "registry.sqlite", state / "checkpoints"),
        JsonlPromptSource(prompts, ResponseHistory(state / "h.jsonl")),
        None,
    )  # type: ignore[arg-type]


def complete(runner: RoundRunner, plan: dict) -> None:
    """Mark a planned round finished (its summary is all the next plan reads)."""
    summary = round_summary(plan["round"], [], watermark_after=plan["watermark_after"])
    write_record(runner.round_dir(plan["round"]) / SUMMARY, summary)


def test_held_out_prompts_are_split_off_by_key_never_trained_and_stable_across_rounds(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", 32)
    r = runner_at(tmp_path / "a", tiny_model_dir, prompts, heldout_share=0.25)
    p1 = r.make_plan(1)
    train1, held1 = {p["key"] for p in p1["prompts"]}, [p["key"] for p in p1["heldout"]]
    assert held1 and not train1 & set(held1)  # disjoint: the guard never grades on training prompts
    assert all(heldout_bucket(k) < 0.25 for k in held1) and all(heldout_bucket(k) >= 0.25 for k in train1)
    assert len(train1) + len(held1) == 16  # every prompt taken is trained or held out (heldout_prompts=4 >= 1)
    complete(r, p1)
    p2 = r.make_plan(2)
    held2 = [p["key"] for p in p2["heldout"]]
    assert held2[: len(held1)] == held1  # earlier held-out prompts stay, so rounds are compared alike
    assert not {p["key"] for p in p2["prompts"]} & set(held2)
    # deterministic: another run over the same prompts splits them the same way
    assert (
        runner_at(tmp_path / "b", tiny_model_dir, prompts, heldout_share=0.25).make_plan(1)["heldout"] == p1["heldout"]
    )


def test_a_round_builds_on_the_last_accepted_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Not on the newest version: a candidate registered by hand (no guard ran) or a rejected one is
    skipped until a person promotes it."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    r = runner_at(tmp_path / "s", tiny_model_dir, prompts)
    base = r.ensure_base()
    r.registry.register(tiny_model_dir, parent="base", round=1, metrics={"guard": "accepted"}, version="r1")
    r.registry.register(
        tiny_model_dir,
        parent="r1",
        round=2,
        metrics={"guard": "kl"},
        version="r2",
        state=CheckpointState.rejected,
        reason="kl: too far",
    )
    r.registry.register(tiny_model_dir, parent="r1", round=None, metrics={}, version="by-hand")
    assert r.head().version == "r1"
    assert r.make_plan(3)["parent"] == "r1"
    assert r.base_of(r.registry.get("by-hand")).version == base.version
    r.registry.promote("by-hand")
    assert r.head().version == "by-hand"


def test_collapse_window_counts_sets_across_rounds_and_skips_groups_of_one(tmp_path: Path) -> None:
    """The demo's rounds score 8 sets each: a detector restored from the run dir fires on the second
    round's sets when the first round's are in its window; a one-sample group changes nothing."""
    rubric = Rubric(items=[RubricItem(id="a", text="x", weight=1), RubricItem(id="b", text="y", weight=1)])
    flat = gap_stats([[0.5] * 4, [0.5] * 4], rubric, [0.5] * 4, eps=0.02)  # non-splitting share 1.0
    single = gap_stats([[0.9], [0.1]], rubric, [0.5], eps=0.02)
    cfg = RubricConfig()

    def make() -> CollapseDetector:
        return CollapseDetector(cfg.collapse_window, cfg.collapse_min_mean_gap, cfg.collapse_max_nonsplit_share)

    first = make()
    assert not any(first.update(flat) for _ in range(cfg.collapse_window - 1))  # round 1: window not full yet
    saved = json.loads(json.dumps(first.state()))
    second = make()
    second.restore(saved)  # round 2 continues the window
    assert second.update(flat) and second.collapsed
    lone = make()
    lone.restore(saved)
    assert not lone.update(single) and lone.singletons == 1 and not lone.collapsed  # a group of one is no set
    assert lone.update(flat)
