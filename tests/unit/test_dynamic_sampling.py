"""Dynamic sampling of a policy step (issue 38, DAPO): the step draws candidate sets until its batch holds
`prompts_per_step` sets with a real spread, or its budget of sets is spent, and records the share it kept. The round's
own `policy_step` runs here over a scripted judge (which prompts tie is known), a scripted engine and a trainer that
records its batch: fast, and exactly the code a round runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dynrubric.engines.base import Completion
from dynrubric.rubric.evaluator import ScoredSet
from dynrubric.rubric.gaps import gap_stats
from dynrubric.rubric.generate import GenerationCounts
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.seeds import round_seed
from dynrubric.train.executor import InProcess
from dynrubric.train.prompts import make_prompt
from dynrubric.train.records import PolicyStep
from dynrubric.train.rounds import Quiet, _Round, next_draw_size, sets_budget
from tests.run_records import GRPO
from tests.train_harness import engines, runner, write_prompts

RUBRIC = Rubric(items=[RubricItem(id="a", text="x", weight=1)])
SPREAD = (0.0, 0.2, 0.4, 1.0)


def prompt(i: int, spread: bool):
    return make_prompt(f"question {i} {'spread' if spread else 'tied'}")


class Tokenizer:
    eos_token_id = 2

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % 100 for c in text[-6:]]


class Engine:
    """Renders a prompt as its question and answers K times; records each batch's seed."""

    tokenizer = Tokenizer()

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    @staticmethod
    def render_chat(messages: list[dict[str, str]]) -> str:
        return messages[-1]["content"]

    def generate(self, requests: list[Any]) -> list[list[Completion]]:
        self.seeds.append(requests[0].params.seed)
        return [[Completion(f"answer {j}", (10 + j,), "stop") for j in range(r.params.n)] for r in requests]


class Judge:
    """A set of a `spread` prompt scores SPREAD (mean 0.4); a `tied` prompt's set scores 0.5 each (a tie)."""

    def __init__(self) -> None:
        self.questions: list[str] = []

    def __call__(self, chunks: list[Any], progress: Any) -> tuple[list[ScoredSet], GenerationCounts, dict]:
        sets = []
        for c in chunks:
            for q, rs in zip(c.questions, c.responses, strict=True):
                self.questions.append(q)
                k = len(rs)
                scores = list(SPREAD[:k]) if "spread" in q else [0.5] * k
                gaps = gap_stats([scores], RUBRIC, scores, 0.02)
                sets.append(ScoredSet(q, rs, RUBRIC, "set", [scores], scores, gaps, 0, ""))
        return sets, GenerationCounts(), {"rubrics": 1.0, "verdicts": 0.5}


class Trainers:
    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def step(self, phase: str, groups: list[Any]) -> dict[str, Any]:
        self.batches.append(groups)
        stats = {k: v for k, v in GRPO.items() if k not in ("time", "stage_seconds")}  # what a trainer returns
        return {**stats, "sets": len(groups), "updated": bool(groups), "updates": len(self.batches)}


class Models:
    def __init__(self) -> None:
        self.policy_engine = Engine()
        self.score = Judge()
        self.trainers = Trainers()
        self.collapse = type("Collapse", (), {"collapsed": False})()


class Notes(Quiet):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)


def a_round(tmp_path: Path, tiny_model_dir: Path, spread: list[bool], **train: Any) -> tuple[_Round, Models, Notes]:
    """Round 1 over prompts `i` (spread[i]: whether its sets spread), with the scripted models."""
    r = runner(tmp_path / "state", tiny_model_dir, write_prompts(tmp_path / "p.jsonl", 4), candidates=4, **train)
    notes = Notes()
    rnd = _Round(r, 1, InProcess(r.settings, engines), r.metrics, r.evaluator_metrics, notes)
    models = Models()
    rnd.models = models  # type: ignore[assignment]
    rnd.prompts = [prompt(i, s) for i, s in enumerate(spread)]
    rnd.history, rnd.parent, rnd.id = [], r.ensure_base(), 1
    return rnd, models, notes


def test_a_step_draws_until_its_batch_is_full_of_sets_with_a_spread(tmp_path: Path, tiny_model_dir: Path) -> None:
    """prompts_per_step 4, oversample 3 (a budget of 12 sets), one prompt in three spreads: the step draws 4 sets (2
    kept), then 4 (1 kept: the share so far, 1/2, says 4), then 3 (the share 3/8 says 3), and trains on the 4 kept sets
    alone. The record and the step's note say how many were kept of how many drawn; the next step draws on from where
    this one stopped, and each draw has its own seed (draw 0's is a step's seed without dynamic sampling)."""
    spread = [i % 3 == 0 for i in range(30)]
    rnd, models, notes = a_round(
        tmp_path, tiny_model_dir, spread, prompts_per_step=4, dynamic_sampling={"oversample": 3.0}
    )
    record = rnd.policy_step(0)
    assert [q.split()[1] for q in models.score.questions] == [str(i) for i in range(11)]
    [batch] = models.trainers.batches
    assert len(batch) == 4 and all(g.scores == SPREAD for g in batch)
    assert (record.draws, record.sets_drawn, record.sets_kept) == (3, 11, 4)
    assert record.kept_share == pytest.approx(4 / 11) and record.sets == 4
    assert len(record.set_scores) == 11 and record.untrusted_sets == 0
    assert record.reward_mean == pytest.approx((4 * 0.4 + 7 * 0.5) / 11)  # every set drawn, not the kept ones
    assert notes.lines == [
        "step 0: 4 of 11 sets drawn kept (36%; a real spread, trusted) in 3 draw(s); batch 4 sets of 4 (budget 12 sets)"
    ]
    seed = rnd.cfg.seed
    assert models.policy_engine.seeds == [round_seed(seed, 1, "candidates", 0, d) for d in range(3)]
    rnd.history.append(record)
    models.score.questions.clear()
    rnd.policy_step(1)
    assert models.score.questions[0].split()[1] == "11"  # 1 x 4 + the 7 sets step 0 drew beyond its batch


def test_without_dynamic_sampling_a_step_trains_on_its_one_draw_and_records_the_share_with_a_spread(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """oversample 1 (the default): today's step, one draw of prompts_per_step sets, tied sets in the batch (the trainer
    gives them no gradient); the share of sets with a spread is recorded all the same."""
    rnd, models, notes = a_round(tmp_path, tiny_model_dir, [i % 3 == 0 for i in range(30)], prompts_per_step=4)
    record = rnd.policy_step(0)
    assert [q.split()[1] for q in models.score.questions] == ["0", "1", "2", "3"]
    assert len(models.trainers.batches[0]) == 4
    assert (record.draws, record.sets_drawn, record.sets_kept, record.kept_share) == (1, 4, 2, 0.5)
    assert models.policy_engine.seeds == [round_seed(rnd.cfg.seed, 1, "candidates", 0)]
    assert notes.lines == ["step 0: 2 of 4 sets drawn kept (50%; a real spread, trusted) in 1 draw(s); batch 4 sets"]


def test_a_step_stops_when_its_budget_is_spent_and_trains_on_what_it_kept(tmp_path: Path, tiny_model_dir: Path) -> None:
    rnd, models, _ = a_round(
        tmp_path, tiny_model_dir, [False] * 20, prompts_per_step=4, dynamic_sampling={"oversample": 2.5}
    )
    record = rnd.policy_step(0)
    assert sets_budget(rnd.cfg) == 10 and (record.draws, record.sets_drawn, record.sets_kept) == (3, 10, 0)
    assert models.trainers.batches == [[]] and not record.updated


def test_draw_sizes_follow_the_share_kept_and_the_budget() -> None:
    assert next_draw_size(8, 8, 8, 24) == 0  # full
    assert next_draw_size(8, 0, 8, 24) == 8  # none kept yet: another step's worth
    assert next_draw_size(8, 4, 8, 24) == 8  # half kept: 4 missing / (1/2)
    assert next_draw_size(8, 6, 8, 24) == 3  # 2 missing / (3/4) = 2.67
    assert next_draw_size(8, 2, 8, 12) == 4  # the budget left
    assert next_draw_size(8, 3, 24, 24) == 0  # spent


def test_a_record_from_before_dynamic_sampling_still_reads() -> None:
    from tests.run_records import policy_step

    old = policy_step(3).model_dump()
    for key in ("draws", "sets_drawn", "sets_kept", "kept_share", "lr"):
        old.pop(key)
    assert PolicyStep.model_validate(old).sets_drawn is None


def test_the_round_report_prints_the_sets_kept_of_the_sets_drawn_per_step(tmp_path: Path) -> None:
    from dynrubric.app.train_commands import round_report
    from tests.run_records import policy_step, round_summary

    steps = [policy_step(0, sets_drawn=11, sets_kept=4), policy_step(1, sets_drawn=9, sets_kept=4)]
    lines = round_report(round_summary(1, steps), tmp_path / "summary.json")
    assert "  sets kept (a real spread, trusted) of sets drawn, per policy step: 4/11, 4/9; 40% of 20" in lines
    older = round_report(round_summary(1, [policy_step(0)]), tmp_path / "summary.json")  # not recorded: no line
    assert not any("sets kept" in line for line in older)
