"""The policy step: a round's models, and one policy or generator step over them.

`RoundModels` holds what a round trains and judges with: the policy's GRPO trainer and its engine, the
rubric generator's (the same in single-model mode), the frozen verifier and the evaluator over them.
It starts from the newest published step of the round, or from the parent when none is published.

A policy step samples K candidates per prompt, scores each set under one rubric, and takes one GRPO
batch; a generator step samples rubrics for candidate sets and takes one GRPO batch of the generator
(train/coevolve.py). Neither writes anything: the round publishes what they return.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynrubric import modelcache
from dynrubric.config import Settings
from dynrubric.engines.base import Engine
from dynrubric.registry import Checkpoint
from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics, ScoredSet
from dynrubric.rubric.gaps import CollapseDetector
from dynrubric.rubric.generate import RUBRIC_SCHEMA_JSON, GenerationCounts
from dynrubric.train.coevolve import RankedAnchors, generator_groups, sampled_response
from dynrubric.train.heldout import sample_sets
from dynrubric.train.judging import ScoreChunk
from dynrubric.train.prompts import TrainPrompt

#: builds an engine for a role ("policy", "generator", "verifier") over a model dir
EngineFactory = Callable[[str, Path], Engine]
#: ranked anchors (best first) for a prompt given the current candidates, or None
AnchorSource = Callable[[TrainPrompt, Sequence[str], random.Random], "RankedAnchors | None"]


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def pad_id(tok: Any) -> int:
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


@dataclass(frozen=True)
class TrainerSpec:
    """Where a round's trainers start: step dir `latest` (None: the parent's weights, a fresh optimiser).
    `base`: the lineage's root, the KL penalty's reference; `generator_base`: the generator's weights
    before the round (two-model mode). Plain paths, so a trainer actor can build from it."""

    settings: Settings
    parent: Path
    base: Path
    generator_base: Path
    latest: Path | None


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
        # the KL penalty pulls toward the base of the lineage, not the parent, so that it bounds the drift
        # the rounds add up (with LoRA the reference is the adapter-free parent; the guard still bounds it)
        self.policy = GRPOTrainer(model, load_reference(spec.base, gcfg), gcfg, pad_id(self.tokenizer), tie_eps)
        if policy_dir:
            self.policy.load_optimizer(policy_dir / "optimizer.pt")
        self.pad_token_id = self.policy.pad_token_id
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

    def save(self, directory: Path) -> None:
        """The trainers' state (weights any engine can load, optimiser) into a step directory."""
        self.policy.save(directory / "policy")
        self.tokenizer.save_pretrained(directory / "policy" / "model")
        if not self.single:
            self.generator.save(directory / "generator")
            self.gen_tokenizer.save_pretrained(directory / "generator" / "model")


class RoundModels:
    """The trainers, engines and judges of one round, built by `executor` from step dir `latest`
    (None: the parent). `collapse` is the round's collapse detector: the judges' sets update it in
    order, whichever judge scored them."""

    def __init__(
        self,
        settings: Settings,
        executor: Any,
        parent: Checkpoint,
        base: Checkpoint,
        generator_base: Path,
        latest: Path | None,
        metrics: EvaluatorMetrics | None,
    ):
        self.settings = settings
        self.single = settings.train.coevolve.single_model
        self.generator_base = generator_base
        self.metrics = metrics
        r = settings.rubric
        self.collapse = CollapseDetector(r.collapse_window, r.collapse_min_mean_gap, r.collapse_max_nonsplit_share)
        self.trainers = executor.trainers(TrainerSpec(settings, parent.path, base.path, generator_base, latest))
        policy_dir = latest / "policy" / "model" if latest else parent.path
        self.policy_engine = executor.engine("policy", policy_dir)
        self.generator_engine = self.policy_engine
        writer_dir = policy_dir
        if not self.single:
            writer_dir = latest / "generator" / "model" if latest else generator_base
            self.generator_engine = executor.engine("generator", writer_dir)
        verifier_dir = modelcache.resolve(settings.paths.resolved_home(), settings.models.verifier)
        self.verifier_engine = executor.engine("verifier", verifier_dir)
        # the generator step's judge (its verdicts, the anchors' scores); the step's sets go to the judges
        self.evaluator = Evaluator(self.generator_engine, self.verifier_engine, settings.rubric, metrics=None)
        self.judges = executor.judges(
            self.generator_engine,
            self.verifier_engine,
            "policy" if self.single else "generator",
            writer_dir,
            verifier_dir,
        )

    def score(
        self,
        questions: Sequence[str],
        responses: Sequence[Sequence[str]],
        seed_of: Callable[[int], int],
        progress: Callable[[int], None],
    ) -> tuple[list[ScoredSet], GenerationCounts, dict[str, float]]:
        """Judge the step's sets in `train.judge_chunks` chunks (chunk j with seed block `seed_of(j)`),
        then update the collapse detector and the metrics with them in order. Also returns the wall
        time split into rubric generation and verification (`judge_stages`)."""
        start = time.perf_counter()
        n = len(questions)
        size = -(-n // min(self.settings.train.judge_chunks, n))
        chunks = [
            ScoreChunk(list(questions[i : i + size]), [list(r) for r in responses[i : i + size]], seed_of(j))
            for j, i in enumerate(range(0, n, size))
        ]
        results = self.judges.score(chunks, progress)
        wall = time.perf_counter() - start
        counts = GenerationCounts()
        scored: list[ScoredSet] = []
        for result in results:
            for field_name in ("parse_failures", "prompt_only_fallbacks", "generic_fallbacks", "dropped_checks"):
                setattr(counts, field_name, getattr(counts, field_name) + getattr(result.counts, field_name))
            scored.extend(result.sets)
        if self.metrics is not None:
            self.metrics.record_generation(counts)
        for s in scored:
            collapsed = self.collapse.update(s.gaps)
            if self.metrics is not None:
                self.metrics.record_set(s, collapsed)
        return (
            scored,
            counts,
            judge_stages(wall, sum(r.seconds for r in results), sum(s.verify_seconds for s in scored)),
        )

    def save(self, directory: Path) -> None:
        self.trainers.save(directory)

    def load_published(self, step_dir: Path, version: str, step: int) -> None:
        """Point the engines (and the judges' rubric writers) at a published step's weights."""
        self.policy_engine.load_weights(step_dir / "policy" / "model", f"{version}-s{step}")
        if not self.single:
            self.generator_engine.load_weights(step_dir / "generator" / "model", f"{version}-gen-s{step}")
        writer = step_dir / ("policy" if self.single else "generator") / "model"
        self.judges.load_rubric_writer(writer, self.generator_engine.policy_version)

    def close(self) -> None:
        self.judges.close()
        for engine in {id(e): e for e in (self.policy_engine, self.generator_engine, self.verifier_engine)}.values():
            engine.close()


def judge_stages(wall: float, busy: float, verifying: float) -> dict[str, float]:
    """The judging wall time as rubric generation and verification. The judges' own clocks (`busy`:
    their time on the chunks, `verifying`: the part spent on verdicts) say how it divides; with several
    judges working at once their times add up to more than the wall time, so the wall time is divided
    in their proportion."""
    share = min(verifying / busy, 1.0) if busy > 0 else 0.0
    return {"rubrics": wall * (1.0 - share), "verdicts": wall * share}


def policy_step(
    settings: Settings,
    models: RoundModels,
    prompts: Sequence[TrainPrompt],
    seed: int,
    seed_of: Callable[[int], int],
    progress: Callable[[int], None],
) -> tuple[dict[str, Any], list[list[str]]]:
    """One GRPO batch of the policy over `prompts`: (the step's record, the sampled responses).
    `seed`: the candidates' sampling seed; `seed_of(j)`: the j-th judging chunk's seed block."""
    from dynrubric.train.grpo import CandidateSet

    cfg = settings.train
    tok = models.policy_engine.tokenizer
    t0 = time.perf_counter()
    texts, outs = sample_sets(settings, models.policy_engine, prompts, cfg.candidates, seed)
    responses = [[c.text for c in cs] for cs in outs]
    t1 = time.perf_counter()
    scored, counts, judging = models.score([p.question for p in prompts], responses, seed_of, progress)
    t2 = time.perf_counter()
    groups = []
    for text, cs, sc in zip(texts, outs, scored, strict=True):
        prompt_ids = tuple(tok.encode(text, add_special_tokens=False))
        # an untrusted set (a known-bad anchor outranks a candidate) teaches nothing: zero advantage
        untrusted = None if sc.trusted else tuple(0.0 for _ in cs)
        groups.append(
            CandidateSet(
                tuple(sampled_response(prompt_ids, c, tok) for c in cs),
                tuple(sc.scores),
                advantages=untrusted,
                temperature=cfg.temperature,
            )
        )
    stats = models.trainers.step("policy", groups)
    n = len(scored)
    record = {
        # candidates, their rubrics and verdicts, the update; rubrics + verdicts is the judging's wall time
        "stage_seconds": {"candidates": t1 - t0, **judging, "update": time.perf_counter() - t2},
        **stats,
        "mean_gap": sum(s.gaps.mean_abs_gap for s in scored) / n,
        "tie_rate": sum(s.gaps.tie_rate for s in scored) / n,
        "nonsplit_share": sum(s.gaps.nonsplit_share for s in scored) / n,
        "untrusted_sets": sum(not s.trusted for s in scored),
        # per set, so that the trust rule can be checked from the run log: candidates' and anchors' scores
        "set_scores": [
            {
                "scores": s.scores,
                "anchor_scores": s.anchor_scores,
                "trusted": s.trusted,
                "overruled_items": s.overruled_items,
            }
            for s in scored
        ],
        "rubric_sources": {
            src: sum(s.rubric_source == src for s in scored) for src in ("set", "prompt_only", "generic")
        },
        "fallbacks": {
            "parse_failures": counts.parse_failures,
            "prompt_only": counts.prompt_only_fallbacks,
            "generic": counts.generic_fallbacks,
            "hard_verdict": sum(s.hard_verdict_fallbacks for s in scored),
        },
        "collapse": models.collapse.collapsed,
    }
    return record, responses


def generator_step(
    settings: Settings,
    models: RoundModels,
    prompts: Sequence[TrainPrompt],
    seed: int,
    anchors_for: AnchorSource,
    seed_of: Callable[[str], int],
) -> dict[str, Any]:
    """One GRPO batch of the rubric generator over candidate sets of `prompts`. `seed_of(purpose)` gives the
    step's seed for one use ("anchors", "rubrics")."""
    co = settings.train.coevolve
    evaluator = models.evaluator
    t0 = time.perf_counter()
    _, outs = sample_sets(settings, models.policy_engine, prompts, settings.train.candidates, seed)
    t1 = time.perf_counter()
    responses = [[c.text for c in cs] for cs in outs]
    rng = random.Random(seed_of("anchors"))
    anchors = [anchors_for(p, rs, rng) for p, rs in zip(prompts, responses, strict=True)]
    groups, gstats = generator_groups(
        models.generator_engine,
        evaluator.rubric_generator.set_prompt,
        # the verdicts the evaluator scores with: checks run, verifier de-biased by the anchors
        lambda q, rs, rubric: evaluator.judge(q, rubric, rs).verdicts,
        evaluator.apply_rubric,
        list(zip(prompts, responses, strict=True)),
        anchors,
        co,
        settings.rubric.max_items,
        settings.rubric.generator_temperature,
        settings.rubric.eps,
        seed_of("rubrics"),
        RUBRIC_SCHEMA_JSON if settings.rubric.constrained else None,
    )
    t2 = time.perf_counter()
    stats = models.trainers.step("generator", groups)
    updates = stats.pop("updates")
    # the generator's rubrics: sampled for the candidate sets, judged and rewarded (t1..t2)
    return {
        "stage_seconds": {"candidates": t1 - t0, "rubrics": t2 - t1, "update": time.perf_counter() - t2},
        **stats,
        **{f"gen_{k}": v for k, v in gstats.as_dict().items()},
        "updates": updates,
    }
