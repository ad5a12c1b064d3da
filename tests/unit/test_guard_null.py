"""benchmarks/guard_null.py: its null draws keep what the two versions share and give each differing prompt to
either, and the two rules it compares are the guard's with and without the counts."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from dynrubric.config import EvaluationConfig
from dynrubric.train.policy_eval import VersionOutcomes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import guard_null as gn
finally:
    sys.path.pop(0)


def outcomes(version: str, scores: list[float], kinds: list[str]) -> VersionOutcomes:
    keys = [f"p{i:03d}" for i in range(len(scores))]
    return VersionOutcomes(
        version=version,
        eval_key="k",
        scores=dict(zip(keys, scores, strict=True)),
        kinds=dict(zip(keys, kinds, strict=True)),
        responses={},
    )


def test_a_null_draw_swaps_only_the_differing_prompts_and_each_about_half_the_time() -> None:
    parent = outcomes("r1", [1.0] * 20 + [0.0] * 20 + [1.0] * 10, ["instruction"] * 50)
    candidate = outcomes("r2", [1.0] * 20 + [0.0] * 20 + [0.0] * 10, ["instruction"] * 50)  # lost the last 10
    rng = random.Random(0)
    won = 0
    for _ in range(200):
        ours, theirs = gn.null_draw(candidate, parent, rng)
        for key in list(parent.scores)[:40]:  # the prompts both pass or both fail: untouched
            assert ours.scores[key] == candidate.scores[key] and theirs.scores[key] == parent.scores[key]
        for key in list(parent.scores)[40:]:  # a differing prompt: one version has each score
            assert {ours.scores[key], theirs.scores[key]} == {0.0, 1.0}
            won += ours.scores[key] > theirs.scores[key]
    assert 0.4 < won / 2000 < 0.6


def test_two_lost_and_none_won_on_a_kind_is_worse_only_by_the_ci_rule() -> None:
    # seed 1's round 3 on its 30 arithmetic prompts: 2 lost, none won; 3 instruction prompts won, so the total is not
    kinds = ["arithmetic"] * 30 + ["instruction"] * 170
    parent = outcomes("r1", [1.0] * 2 + [0.0] * 198, kinds)
    candidate = outcomes("r3", [0.0] * 30 + [1.0] * 3 + [0.0] * 167, kinds)
    signed, ci_alone = gn.verdicts(candidate, parent, EvaluationConfig())
    assert (signed, ci_alone) == (None, "kind_regression")
