"""Seeds are named, and no two draws share one: each draw's seed starts a block of SEED_BLOCK seeds (the rubric
generator's retries add 1, 2, ... to it), so two draws collide when their blocks overlap."""

from __future__ import annotations

from typing import get_args

from dynrubric.config import RubricConfig
from dynrubric.seeds import SEED_BLOCK, RoundPurpose, derive_seed, judge_call_seed, round_seed, set_seed


def overlapping_blocks(seeds: dict[str, int]) -> list[tuple[str, str]]:
    """The pairs of named draws whose blocks [seed, seed + SEED_BLOCK) overlap."""
    ordered = sorted(seeds.items(), key=lambda kv: kv[1])
    return [(a, b) for (a, sa), (b, sb) in zip(ordered, ordered[1:], strict=False) if sb - sa < SEED_BLOCK]


def test_overlapping_blocks_are_found():
    assert overlapping_blocks({"a": 0, "b": SEED_BLOCK - 1, "c": 5 * SEED_BLOCK}) == [("a", "b")]


def test_no_two_draws_of_a_run_share_a_seed_block():
    """Every draw a run makes: each purpose of each step of several rounds (judging chunks included), the
    evaluator's calls, the real-set sampling of eval-judge. The integer offsets these replaced failed here
    (`root + 101 step + i` with judging at i = 1000 + j: chunk j of step s is index j - 10 of step s + 10)."""
    root = 0
    seeds = {
        f"round {r} {purpose} step {s} #{i}": round_seed(root, r, purpose, s, i)
        for r in range(1, 4)
        for purpose in get_args(RoundPurpose)
        for s in range(40)
        for i in range(8 if purpose == "judging" else 1)
    }
    seeds |= {f"evaluator call {n}": judge_call_seed(root, n) for n in range(500)}
    seeds |= {f"real sets {i}": derive_seed(root, "real-sets", i) for i in range(0, 400, 8)}
    assert len(seeds) == 3 * (4 * 40 + 40 * 8) + 500 + 50
    assert overlapping_blocks(seeds) == []


def test_a_draw_fits_its_block():
    """The rubric generator's tries of one draw (set-conditioned, then prompt-only) stay inside its block."""
    bounds = RubricConfig.model_fields
    most = 1 + bounds["retries"].metadata[-1].le + 1 + bounds["prompt_only_retries"].metadata[-1].le
    assert most <= SEED_BLOCK


def test_a_seed_is_a_function_of_its_name():
    assert round_seed(7, 2, "judging", 3, 1) == round_seed(7, 2, "judging", 3, 1)
    assert round_seed(7, 2, "judging", 3, 1) != round_seed(8, 2, "judging", 3, 1)
    assert 0 <= derive_seed(7, "x") < 2**62 - SEED_BLOCK


def test_the_judges_seeds_are_those_its_benchmark_numbers_were_measured_with():
    """eval-judge and `score` draw their rubrics from these blocks: a change here changes every judge number in
    docs/benchmarks.md. The values are those of the code the numbers were measured on."""
    assert [judge_call_seed(0, n) for n in range(3)] == [0, SEED_BLOCK, 2 * SEED_BLOCK]
    assert judge_call_seed(17, 4) == 17 + 4 * SEED_BLOCK
    assert set_seed(17, "What is 2+2?", ["4", "five"]) == 1266210569
