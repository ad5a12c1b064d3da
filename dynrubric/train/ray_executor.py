"""The round's stages on Ray (`train.executor: ray`): engine actors, a pool of judge actors, a trainer actor.

    EngineActor    one per role the round samples with (policy; generator in two-model mode; verifier),
                   holding its engine; `RemoteEngine` is the driver's `Engine` over it
    JudgeActor     `ray.judges` of them, each holding its own rubric writer and verifier engines once;
                   the round's chunks of candidate sets are spread over them (`ActorPool.map`, in order)
    TrainerActor   the GRPO trainers (policy, generator): the policy update and the step's saved state

`ray.address` unset starts a local Ray on this machine (`ray.num_cpus`, no dashboard); `auto` or
`ray://host:port` joins a cluster. Actors are placed with the SPREAD strategy, so on a cluster the
judges land on different nodes. The driver keeps every state file: the trainer actor writes a step's
weights into the directory the round is about to publish atomically, which on a cluster must be on a
volume every node sees (the state dir, as for the registry). Actors are not restarted by Ray (a
restarted actor would come back with its first weights): the round drops them all and resumes from its
last published step (train/rounds.py). Between rounds the actors are kept and reset, not restarted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util import ActorPool

from dynrubric.config import Settings
from dynrubric.engines.base import Completion, Engine, GenerationRequest
from dynrubric.ray_cluster import connect, use_cores
from dynrubric.rubric.evaluator import Evaluator
from dynrubric.train.executor import (
    EngineFactory,
    Judges,
    ScoreChunk,
    ScoredChunk,
    Trainers,
    TrainerSpec,
    score_chunk,
)

#: what a dead worker looks like to the driver: its actor died or cannot be reached (actors here are
#: never restarted, so an unreachable one is gone), its node died, or its process crashed
WORKER_FAILURES: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.ObjectLostError,
)


class Worker:
    """An actor of the round: takes its cores first, then builds what `reset` builds (reset again, not
    rebuilt, when a later round reuses it)."""

    reset: Callable[..., None]  # each actor kind's own

    def __init__(self, threads: int, *args: Any):
        self.threads = use_cores(threads)
        self.reset(*args)


class EngineActor(Worker):
    engine: Engine  # set by reset()

    def reset(self, factory: EngineFactory, role: str, model_dir: Path) -> None:
        """A fresh engine in this process (a later round reuses the actor, not its engine)."""
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        self.engine = factory(role, model_dir)

    def describe(self) -> tuple[Any, str]:
        return self.engine.tokenizer, self.engine.policy_version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        return self.engine.generate(requests)

    def score_next_token(self, prompts: Sequence[str], candidates: Sequence[str]) -> list[dict[str, float]]:
        return self.engine.score_next_token(prompts, candidates)

    def load_weights(self, path: Path, version: str) -> str:
        self.engine.load_weights(path, version)
        return self.engine.policy_version

    def close(self) -> None:
        self.engine.close()


class RemoteEngine(Engine):
    """The driver's `Engine` over an EngineActor: same prompts, same results, computed there."""

    def __init__(self, actor: Any):
        self.actor = actor
        self._tokenizer, self.policy_version = ray.get(actor.describe.remote())

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        completions: list[list[Completion]] = ray.get(self.actor.generate.remote(list(requests)))
        return completions

    def score_next_token(self, prompts: Sequence[str], candidates: Sequence[str]) -> list[dict[str, float]]:
        scores: list[dict[str, float]] = ray.get(self.actor.score_next_token.remote(list(prompts), list(candidates)))
        return scores

    def load_weights(self, path: Path, version: str) -> None:
        self.policy_version = ray.get(self.actor.load_weights.remote(path, version))


class JudgeActor(Worker):
    """Rubric generation and verdicts for chunks of candidate sets, on engines built here once."""

    def reset(
        self, settings: Settings, factory: EngineFactory, writer_role: str, writer_dir: Path, verifier_dir: Path
    ) -> None:
        for engine in (getattr(self, "writer", None), getattr(self, "verifier", None)):
            if engine is not None:
                engine.close()
        self.writer = factory(writer_role, writer_dir)
        self.verifier = factory("verifier", verifier_dir)
        self.evaluator = Evaluator(self.writer, self.verifier, settings.rubric, metrics=None)

    def score(self, chunk: ScoreChunk) -> ScoredChunk:
        return score_chunk(self.evaluator, chunk)

    def load_rubric_writer(self, path: Path, version: str) -> None:
        self.writer.load_weights(path, version)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class RayJudges:
    def __init__(self, actors: list[Any]):
        self.actors = actors

    def score(self, chunks: Sequence[ScoreChunk], progress: Callable[[int], None]) -> list[ScoredChunk]:
        results = []
        for result in ActorPool(self.actors).map(lambda actor, chunk: actor.score.remote(chunk), list(chunks)):
            progress(len(result.sets))  # a chunk's sets are judged inside its actor: counted as it returns
            results.append(result)
        return results

    def load_rubric_writer(self, path: Path, version: str) -> None:
        ray.get([a.load_rubric_writer.remote(path, version) for a in self.actors])

    def close(self) -> None:
        """The executor owns the actors."""


class TrainerActor(Worker):
    def reset(self, spec: TrainerSpec) -> None:
        self.trainers: Trainers | None = None  # the last round's models go before the next ones load
        self.trainers = Trainers(spec)

    def loaded(self) -> Trainers:
        assert self.trainers is not None, "reset() loads the trainers"
        return self.trainers

    def pad_token_id(self) -> int:
        return self.loaded().pad_token_id

    def step(self, phase: str, groups: list[Any]) -> dict[str, Any]:
        return self.loaded().step(phase, groups)

    def save(self, directory: Path, previous: Path | None = None) -> None:
        self.loaded().save(directory, previous)


class RemoteTrainers:
    """The driver's view of the TrainerActor (the same methods as `Trainers`)."""

    candidate_model = None  # the evaluation loads the candidate from its published step instead

    def __init__(self, actor: Any):
        self.actor = actor
        self.pad_token_id: int = ray.get(actor.pad_token_id.remote())

    def step(self, phase: str, groups: list[Any]) -> dict[str, Any]:
        record: dict[str, Any] = ray.get(self.actor.step.remote(phase, list(groups)))
        return record

    def save(self, directory: Path, previous: Path | None = None) -> None:
        ray.get(self.actor.save.remote(directory, previous))


class RayExecutor:
    """Starts the round's actors; between rounds they wait for the next round (`release`), which resets
    them instead of paying for new processes (each imports torch and loads its model)."""

    worker_failures = WORKER_FAILURES

    def __init__(self, settings: Settings, engines: EngineFactory):
        connect(settings)
        self.settings = settings
        self.factory = engines
        self.idle: dict[str, list[Any]] = {}
        self.in_use: list[tuple[str, Any]] = []

    def _actor(self, kind: str, cls: type, *args: Any) -> Any:
        idle = self.idle.setdefault(kind, [])
        if idle:
            actor = idle.pop()
            ray.get(actor.reset.remote(*args))
        else:
            actor = (
                ray.remote(cls)
                .options(num_cpus=self.settings.ray.actor_cpus, max_restarts=0, scheduling_strategy="SPREAD")
                .remote(self.settings.engine.threads, *args)
            )
        self.in_use.append((kind, actor))
        return actor

    def engine(self, role: str, model_dir: Path) -> Engine:
        return RemoteEngine(self._actor(f"engine:{role}", EngineActor, self.factory, role, model_dir))

    def trainers(self, spec: TrainerSpec) -> RemoteTrainers:
        return RemoteTrainers(self._actor("trainer", TrainerActor, spec))

    def judges(
        self, writer: Engine, verifier: Engine, writer_role: str, writer_dir: Path, verifier_dir: Path
    ) -> Judges:
        return RayJudges(
            [
                self._actor("judge", JudgeActor, self.settings, self.factory, writer_role, writer_dir, verifier_dir)
                for _ in range(self.settings.ray.judges)
            ]
        )

    def release(self) -> None:
        for kind, actor in self.in_use:
            self.idle[kind].append(actor)
        self.in_use = []

    def close(self) -> None:
        for actor in [a for _, a in self.in_use] + [a for actors in self.idle.values() for a in actors]:
            ray.kill(actor)
        self.idle, self.in_use = {}, []
