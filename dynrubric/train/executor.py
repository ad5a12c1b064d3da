"""Where a round's expensive stages run: in this process (`train.executor: inprocess`) or on Ray
(`ray`, train/ray_executor.py).

The round (train/rounds.py) keeps its plan, state files, registry writes and run log in the driver
process. An executor provides the workers of its stages:

- engines by role: candidate sampling, the generator step, the held-out evaluation;
- the trainers: the policy update (and the generator's in two-model mode);
- judges: rubric generation and verdicts for chunks of candidate sets, each chunk with its own seed,
  so a chunk's scores do not depend on which judge scored it or how many judges share the work.

A step counts once the round has published it. When a worker dies (`worker_failures`), the round drops
every worker and resumes from its newest published step with the same seeds, so a retried stage never
counts a set or a step twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from dynrubric.config import Settings
from dynrubric.engines.base import Engine
from dynrubric.rubric.evaluator import Evaluator
from dynrubric.train.judging import ScoreChunk, ScoredChunk, score_chunk
from dynrubric.train.step import EngineFactory, Trainers, TrainerSpec


class Judges(Protocol):
    def score(self, chunks: Sequence[ScoreChunk], progress: Callable[[int], None]) -> list[ScoredChunk]:
        """Score the chunks in order; `progress(n)` as n more sets are judged (a step takes minutes)."""

    def load_rubric_writer(self, path: Path, version: str) -> None: ...

    def close(self) -> None: ...


class Executor(Protocol):
    #: exceptions that mean a worker died (the round resumes from its last published step)
    worker_failures: tuple[type[BaseException], ...]

    def engine(self, role: str, model_dir: Path) -> Engine: ...

    def trainers(self, spec: TrainerSpec) -> Any: ...

    def judges(
        self, writer: Engine, verifier: Engine, writer_role: str, writer_dir: Path, verifier_dir: Path
    ) -> Judges: ...

    def release(self) -> None:
        """The round is over: its workers may serve the next round."""

    def close(self) -> None: ...


class LocalJudges:
    """One evaluator over the round's own engines; chunks are scored one after another."""

    def __init__(self, settings: Settings, writer: Engine, verifier: Engine):
        self.evaluator = Evaluator(writer, verifier, settings.rubric, metrics=None)

    def score(self, chunks: Sequence[ScoreChunk], progress: Callable[[int], None]) -> list[ScoredChunk]:
        return [score_chunk(self.evaluator, c, progress) for c in chunks]

    def load_rubric_writer(self, path: Path, version: str) -> None:
        """Nothing to do: the writer is the round's own engine, which the round reloads itself."""

    def close(self) -> None:
        """The engines are the round's; it closes them."""


class InProcess:
    """Every stage in this process, on the engines `engines` builds."""

    worker_failures: tuple[type[BaseException], ...] = ()

    def __init__(self, settings: Settings, engines: EngineFactory):
        self.settings = settings
        self.factory = engines

    def engine(self, role: str, model_dir: Path) -> Engine:
        return self.factory(role, model_dir)

    def trainers(self, spec: TrainerSpec) -> Trainers:
        return Trainers(spec)

    def judges(
        self, writer: Engine, verifier: Engine, writer_role: str, writer_dir: Path, verifier_dir: Path
    ) -> Judges:
        return LocalJudges(self.settings, writer, verifier)

    def release(self) -> None:
        """Nothing outlives the round's engines."""

    def close(self) -> None:
        """Nothing outlives the round's engines."""
