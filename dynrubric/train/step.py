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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dynrubric import modelcache
from dynrubric.config import Settings
from dynrubric.engines.base import Engine
from dynrubric.registry import Checkpoint
from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics
from dynrubric.rubric.generate import RUBRIC_SCHEMA_JSON
from dynrubric.train.coevolve import completion_ids, generator_groups
from dynrubric.train.heldout import sample_sets
from dynrubric.train.prompts import TrainPrompt

#: builds an engine for a role ("policy", "generator", "verifier") over a model dir
EngineFactory = Callable[[str, Path], Engine]
#: ranked anchors (best first) for a prompt given the current candidates, or None
AnchorSource = Callable[[TrainPrompt, Sequence[str], random.Random], "list[str] | None"]


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def pad_id(tok: Any) -> int:
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


class RoundModels:
    """The trainers, engines and evaluator of one round, loaded from step dir `latest` (None: the
    parent's weights and a fresh optimiser). `generator_base`: the generator's weights before the round
    (two-model mode); `base`: the lineage's root, the KL penalty's reference."""

    def __init__(self, settings: Settings, engines: EngineFactory, parent: Checkpoint, base: Checkpoint,
                 generator_base: Path, latest: Path | None, evaluator_metrics: EvaluatorMetrics | None):
        from dynrubric.train.grpo import GRPOTrainer, load_policy, load_reference

        cfg = settings.train
        gcfg = cfg.grpo
        self.single = cfg.coevolve.single_model
        self.generator_base = generator_base
        tie_eps = settings.rubric.eps
        policy_dir = latest / "policy" if latest else None
        adapter = policy_dir / "adapter" if policy_dir and gcfg.lora_rank > 0 else None
        model = load_policy(policy_dir / "model" if policy_dir and adapter is None else parent.path, gcfg, adapter)
        self.tokenizer = load_tokenizer(parent.path)
        # the KL penalty pulls toward the base of the lineage, not the parent, so that it bounds the drift
        # the rounds add up (with LoRA the reference is the adapter-free parent; the guard still bounds it)
        self.policy = GRPOTrainer(model, load_reference(base.path, gcfg), gcfg, pad_id(self.tokenizer), tie_eps)
        if policy_dir:
            self.policy.load_optimizer(policy_dir / "optimizer.pt")
        self.policy_engine = engines("policy", policy_dir / "model" if policy_dir else parent.path)

        self.generator = self.policy
        self.generator_engine = self.policy_engine
        if not self.single:
            gen_dir = latest / "generator" if latest else None
            gen_cfg = gcfg.model_copy(update={"lr": cfg.coevolve.generator_lr or gcfg.lr})
            gadapter = gen_dir / "adapter" if gen_dir and gcfg.lora_rank > 0 else None
            gmodel = load_policy(gen_dir / "model" if gen_dir and gadapter is None else generator_base, gen_cfg,
                                 gadapter)
            self.gen_tokenizer = load_tokenizer(generator_base)
            self.generator = GRPOTrainer(gmodel, load_reference(generator_base, gen_cfg), gen_cfg,
                                         pad_id(self.gen_tokenizer), tie_eps)
            if gen_dir:
                self.generator.load_optimizer(gen_dir / "optimizer.pt")
            self.generator_engine = engines("generator", gen_dir / "model" if gen_dir else generator_base)
        verifier_dir = modelcache.resolve(settings.paths.resolved_home(), settings.models.verifier)
        self.verifier_engine = engines("verifier", verifier_dir)
        self.evaluator = Evaluator(self.generator_engine, self.verifier_engine, settings.rubric, evaluator_metrics)

    def save(self, directory: Path) -> None:
        """The trainers' state (weights any engine can load, optimiser) into a step directory."""
        self.policy.save(directory / "policy")
        self.tokenizer.save_pretrained(directory / "policy" / "model")
        if not self.single:
            self.generator.save(directory / "generator")
            self.gen_tokenizer.save_pretrained(directory / "generator" / "model")

    def load_published(self, step_dir: Path, version: str, step: int) -> None:
        """Point the engines at a published step's weights."""
        self.policy_engine.load_weights(step_dir / "policy" / "model", f"{version}-s{step}")
        if not self.single:
            self.generator_engine.load_weights(step_dir / "generator" / "model", f"{version}-gen-s{step}")

    def close(self) -> None:
        for engine in {id(e): e for e in (self.policy_engine, self.generator_engine, self.verifier_engine)}.values():
            engine.close()


def policy_step(settings: Settings, models: RoundModels, prompts: Sequence[TrainPrompt], seed: int,
                progress: Callable[[int], None]) -> tuple[dict[str, Any], list[list[str]]]:
    """One GRPO batch of the policy over `prompts`: (the step's record, the sampled responses)."""
    from dynrubric.train.grpo import Group, Rollout

    cfg = settings.train
    evaluator = models.evaluator
    tok = models.policy_engine.tokenizer
    texts, outs = sample_sets(settings, models.policy_engine, prompts, cfg.candidates, seed)
    responses = [[c.text for c in cs] for cs in outs]
    counts_before = dict(evaluator.counts.__dict__)
    scored = evaluator.score_sets([p.question for p in prompts], responses, progress=progress)
    groups = []
    for text, cs, sc in zip(texts, outs, scored, strict=True):
        prompt_ids = tuple(tok.encode(text, add_special_tokens=False))
        # an untrusted set (a known-bad anchor outranks a candidate) teaches nothing: zero advantage
        untrusted = None if sc.trusted else tuple(0.0 for _ in cs)
        groups.append(Group(tuple(Rollout(prompt_ids, completion_ids(c, tok)) for c in cs), tuple(sc.scores),
                            advantages=untrusted, temperature=cfg.temperature))
    stats = models.policy.step(groups)
    n = len(scored)
    record = {
        **stats.as_dict(),
        "mean_gap": sum(s.gaps.mean_abs_gap for s in scored) / n,
        "tie_rate": sum(s.gaps.tie_rate for s in scored) / n,
        "nonsplit_share": sum(s.gaps.nonsplit_share for s in scored) / n,
        "untrusted_sets": sum(not s.trusted for s in scored),
        "rubric_sources": {src: sum(s.rubric_source == src for s in scored) for src in ("set", "prompt_only", "generic")},
        "fallbacks": {
            "parse_failures": evaluator.counts.parse_failures - counts_before["parse_failures"],
            "prompt_only": evaluator.counts.prompt_only_fallbacks - counts_before["prompt_only_fallbacks"],
            "generic": evaluator.counts.generic_fallbacks - counts_before["generic_fallbacks"],
            "hard_verdict": sum(s.hard_verdict_fallbacks for s in scored),
        },
        "collapse": evaluator.collapse.collapsed,
        "updates": models.policy.updates,
    }
    return record, responses


def generator_step(settings: Settings, models: RoundModels, prompts: Sequence[TrainPrompt], seed: int,
                   anchors_for: AnchorSource, seed_of: Callable[[int], int]) -> dict[str, Any]:
    """One GRPO batch of the rubric generator over candidate sets of `prompts`. `seed_of(i)` gives the
    step's i-th derived seed."""
    co = settings.train.coevolve
    evaluator = models.evaluator
    _, outs = sample_sets(settings, models.policy_engine, prompts, settings.train.candidates, seed)
    responses = [[c.text for c in cs] for cs in outs]
    rng = random.Random(seed_of(7))
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
        seed_of(13),
        RUBRIC_SCHEMA_JSON if settings.rubric.constrained else None,
    )
    stats = models.generator.step(groups)
    return {**stats.as_dict(), **{f"gen_{k}": v for k, v in gstats.as_dict().items()},
            "updates": models.generator.updates}
