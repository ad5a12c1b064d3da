"""The judging stage's unit of work: a chunk of candidate sets scored under their own seed block.

A round splits a step's sets into `train.judge_chunks` chunks; chunk j is generated with a seed derived
from the round, the step and j, so its rubrics and scores are the same whichever judge (a local
evaluator or a Ray judge actor) scores it, and however many judges share the chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dynrubric.rubric.evaluator import Evaluator, ScoredSet
from dynrubric.rubric.generate import GenerationCounts


@dataclass(frozen=True)
class ScoreChunk:
    """Candidate sets scored together: one rubric per set, generated with seed block `seed`."""

    questions: list[str]
    responses: list[list[str]]
    seed: int


@dataclass(frozen=True)
class ScoredChunk:
    sets: list[ScoredSet]
    counts: GenerationCounts = field(default_factory=GenerationCounts)  # the rubric ladder's, for this chunk
    seconds: float = 0.0  # the judge's time on the chunk: its rubrics, then the sets' verify_seconds


def score_chunk(evaluator: Evaluator, chunk: ScoreChunk, progress: Callable[[int], None] | None = None) -> ScoredChunk:
    """Score one chunk; the counts are those of this chunk alone. `progress(1)` after each set is judged."""
    before = replace(evaluator.counts)
    start = time.perf_counter()
    sets = evaluator.score_sets(chunk.questions, chunk.responses, progress=progress, seed=chunk.seed)
    seconds = time.perf_counter() - start
    after = evaluator.counts
    return ScoredChunk(
        sets,
        GenerationCounts(
            parse_failures=after.parse_failures - before.parse_failures,
            prompt_only_fallbacks=after.prompt_only_fallbacks - before.prompt_only_fallbacks,
            generic_fallbacks=after.generic_fallbacks - before.generic_fallbacks,
            dropped_checks=after.dropped_checks - before.dropped_checks,
        ),
        seconds,
    )
