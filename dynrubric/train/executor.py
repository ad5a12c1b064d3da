"""What a round's workers run, and where: in this process (`train.executor: inprocess`) or on Ray (`ray`,
train/ray_executor.py). Everything here crosses the actor boundary: a trainer actor builds `Trainers` from a
`TrainerSpec`, a judge actor scores `ScoreChunk`s with `score_chunk`.

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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.engines.base import Engine
from dynrubric.rubric.evaluator import Evaluator, ScoredSet
from dynrubric.rubric.generate import GenerationCounts

#: builds an engine for a role ("policy", "generator", "verifier") over a model dir
EngineFactory = Callable[[str, Path], Engine]


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def pad_id(tok: Any) -> int:
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


@dataclass(frozen=True)
class TrainerSpec:
    """Where a round's trainers start: step dir `latest` (None: the parent's weights, and the AdamW state
    `optimizer`, or a fresh one when that is None). `reference`: the KL penalty's reference (the lineage's base,
    or the parent: `grpo.kl_reference`); `generator_base`: the generator's weights before the round (two-model
    mode). Plain paths, so a trainer actor can build from it."""

    settings: Settings
    parent: Path
    reference: Path
    generator_base: Path
    latest: Path | None
    optimizer: Path | None = None  # grpo.optimizer_across_rounds: carry: the state the parent's round ended with


class Trainers:
    """The policy's GRPO trainer, and the generator's in two-model mode (else the policy's)."""

    def __init__(self, spec: TrainerSpec):
        from dynrubric.train.grpo import GRPOTrainer, load_policy, load_reference

        settings, latest = spec.settings, spec.latest
        cfg = settings.train
        gcfg = cfg.grpo
        self.single = cfg.coevolve.single_model
        tie_eps = settings.rubric.eps
        policy_dir = latest / "policy" if latest else None
        adapter = policy_dir / "adapter" if policy_dir and gcfg.lora_rank > 0 else None
        model = load_policy(policy_dir / "model" if policy_dir and adapter is None else spec.parent, gcfg, adapter)
        self.tokenizer = load_tokenizer(spec.parent)
        # the KL penalty pulls toward the reference the round planned (grpo.kl_reference): by default the base of
        # the lineage, so that it bounds the drift the rounds add up; or the parent, a trust region per round
        # (with LoRA the reference is the adapter-free parent either way; the guard still bounds the drift)
        self.policy = GRPOTrainer(model, load_reference(spec.reference, gcfg), gcfg, pad_id(self.tokenizer), tie_eps)
        if policy_dir:
            self.policy.load_optimizer(policy_dir / "optimizer.pt")
        elif spec.optimizer is not None:  # optimizer_across_rounds carry: AdamW goes on from the parent's round
            self.policy.load_optimizer(spec.optimizer)
        self.pad_token_id = self.policy.pad_token_id
        self._saved: dict[str, int] = {}  # trainer -> its updates when this object last saved it (`save`)
        self.generator = self.policy
        if not self.single:
            gen_dir = latest / "generator" if latest else None
            gen_cfg = gcfg.model_copy(update={"lr": cfg.coevolve.generator_lr or gcfg.lr})
            gadapter = gen_dir / "adapter" if gen_dir and gcfg.lora_rank > 0 else None
            gmodel = load_policy(
                gen_dir / "model" if gen_dir and gadapter is None else spec.generator_base, gen_cfg, gadapter
            )
            self.gen_tokenizer = load_tokenizer(spec.generator_base)
            self.generator = GRPOTrainer(
                gmodel, load_reference(spec.generator_base, gen_cfg), gen_cfg, pad_id(self.gen_tokenizer), tie_eps
            )
            if gen_dir:
                self.generator.load_optimizer(gen_dir / "optimizer.pt")

    @property
    def candidate_model(self) -> Any:
        """The policy being trained (the evaluation's KL uses it instead of loading the saved copy)."""
        return self.policy.model

    def step(self, phase: str, groups: Sequence[Any]) -> dict[str, Any]:
        """One GRPO batch of the policy ("policy") or the generator: its stats, `updates` the trainer's
        total so far."""
        trainer = self.policy if phase == "policy" else self.generator
        stats = trainer.step(groups)
        return {**stats.as_dict(), "updates": trainer.updates}

    def save(self, directory: Path, previous: Path | None = None) -> None:
        """The trainers' state (weights any engine can load, optimiser) into a step directory. A trainer that made
        no update since this object saved it into `previous` (the last published step: a policy step leaves the
        generator as it was, a generator step the policy) has its files hard-linked from there instead of written
        again: for SmolLM2-135M, 1.6 GB of weights and AdamW state a step, each file fsynced on publishing."""
        parts = [("policy", self.policy, self.tokenizer)]
        if not self.single:
            parts.append(("generator", self.generator, self.gen_tokenizer))
        for name, trainer, tokenizer in parts:
            if previous is not None and self._saved.get(name) == trainer.updates and (previous / name).is_dir():
                atomic.link_tree(previous / name, directory / name)
                continue
            trainer.save(directory / name)
            tokenizer.save_pretrained(directory / name / "model")
            self._saved[name] = trainer.updates


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
