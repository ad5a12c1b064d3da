"""One training round, resumable: prompts -> candidate sets -> rubric scores -> GRPO -> guards -> registry.

The round's plan and the run's state are train/plan.py, a step's work train/step.py, the evaluation
and the guards' verdict train/round_verdict.py; this module runs them in order and publishes the results.

A round is a fixed plan of steps, written before the first step (`plan.json`: parent version, the
prompts taken since the last watermark, the held-out prompts, policy/generator phase of each step).
After every step the trainer state (weights, AdamW state, step history) is published as ONE atomic
directory `steps/NNNN/`; a step without its directory did not happen. A crash anywhere re-runs the
round from the newest published step with exactly the state it had, so no update is applied twice
(AdamW's own step counter, saved with it, proves it). Evaluation is saved as `eval.json`, the
checkpoint is registered under a deterministic version id (registration is idempotent), and
`summary.json` is written last: a round with a summary is complete and is never run again.

Layout under `train.run_dir` (default `<state_dir>/train`):

    rounds/NNNN/plan.json  steps/NNNN/{policy/, generator/, history.json, collapse.json}  eval.json
                 summary.json
    runlog.jsonl     one record per step and per round (deduplicated by key on resume)
    rollouts.jsonl   responses sampled per prompt and policy version (temporal-contrast anchors)
    collapse.json    the collapse detector's window of sets, carried from round to round
    generator/       the generator's weights between rounds (two-model mode)

A round builds on the last ACCEPTED version (promoted, or a candidate that passed the guards), its KL
penalty pulls toward the base of the lineage, and the guards bound both the round's KL to its parent
and the total KL to the base. Held-out prompts are split off by prompt key and never trained on.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.errors import DynrubricError
from dynrubric.registry import CheckpointState, Registry
from dynrubric.rubric.evaluator import EvaluatorMetrics
from dynrubric.train.coevolve import RankedAnchors, feedback_ranking, lineage_ages, read_anchor_file, temporal_anchors
from dynrubric.train.executor import Executor, InProcess
from dynrubric.train.plan import (
    COLLAPSE,
    EVAL,
    SUMMARY,
    RunState,
    prompts_of,
    read_json,
    write_json,
)
from dynrubric.train.prompts import PromptSource, TrainPrompt
from dynrubric.train.round_verdict import evaluate_round, round_verdict
from dynrubric.train.seeds import round_seed
from dynrubric.train.step import EngineFactory, RoundModels, generator_step, policy_step

EngineRole = Literal["policy", "generator", "verifier"]  # EngineConfig.url_for's roles


def check_frozen_judges(settings: Settings) -> None:
    """Over HTTP each role's engine is a server; publishing a step reloads the policy's (and, with two
    models, the generator's) weights. A judge on a reloaded server would judge with the weights being
    trained, so such a config is refused before anything runs, naming both keys."""
    engine = settings.engine
    if engine.kind != "openai-http" or engine.shared_servers:
        return  # in-process engines hold their own weights; engines on a shared server reload theirs before use
    remote = [r for r in ("policy", "generator", "verifier") if r not in engine.in_process]
    single = settings.train.coevolve.single_model
    trained_roles: tuple[EngineRole, ...] = ("policy",) if single else ("policy", "generator")
    judge_roles: tuple[EngineRole, ...] = ("verifier",) if single else ("verifier", "generator")
    reloaded = [r for r in trained_roles if r in remote]
    judges = [r for r in judge_roles if r in remote]
    for judge in judges:
        for trained in reloaded:
            if judge != trained and engine.url_for(judge) == engine.url_for(trained):
                raise DynrubricError(
                    f"{engine.url_key(judge)} and {engine.url_key(trained)} both point at {engine.url_for(judge)}: "
                    f"each training step reloads the {trained}'s weights there, so the {judge} would not be frozen",
                    f"give the {judge} its own server: set engine.{judge}_url (and engine.{trained}_url)",
                )


class TrainMetrics:
    """The trainer's rows of monitoring/README.md, on the caller's registry."""

    def __init__(self, registry: CollectorRegistry):
        self.rounds = Counter("dynrubric_train_rounds", "training rounds finished", ["outcome"], registry=registry)
        self.guard_rejections = Counter(
            "dynrubric_train_guard_rejections", "checkpoints rejected by a guard", ["reason"], registry=registry
        )
        self.reward_mean = Gauge(
            "dynrubric_train_reward_mean", "mean set-conditioned reward of the last step", registry=registry
        )
        self.kl = Gauge("dynrubric_train_kl", "KL to the reference policy of the last step", registry=registry)
        self.no_gradient_sets = Counter(
            "dynrubric_train_no_gradient_sets",
            "sets that gave no gradient: tied (score spread below rubric.eps) or untrusted (zero advantage)",
            registry=registry,
        )
        self.judge_user_agreement = Gauge(
            "dynrubric_train_judge_user_agreement",
            "share of user-ranked response pairs the rubrics of the last generator step ordered as the users did",
            registry=registry,
        )
        self.heldout_pass = Gauge(
            "dynrubric_train_heldout_pass",
            "held-out ground-truth pass rate of the last round's candidate",
            registry=registry,
        )
        self.sampler_log_ratio = Gauge(
            "dynrubric_train_sampler_log_ratio",
            "sampler-trainer mismatch of the last policy step: mean |log pi_old - log pi_sampler| per token",
            registry=registry,
        )
        self.sampler_capped = Gauge(
            "dynrubric_train_sampler_capped_share",
            "share of the last policy step's tokens whose truncated importance weight was capped",
            registry=registry,
        )
        self.worker_failures = Counter(
            "dynrubric_train_worker_failures",
            "round workers (Ray actors, nodes) that died; the round resumed from its last published step",
            registry=registry,
        )
        for outcome in ("completed", "failed"):
            self.rounds.labels(outcome=outcome)
        for reason in ("kl", "kl_to_base", "reward_drop", "nonfinite", "heldout_regression"):
            self.guard_rejections.labels(reason=reason)


@dataclass
class Progress:
    """What a round reports as it goes (the CLI draws rich bars from it; tests pass nothing)."""

    start: Callable[[str, int], None] = lambda phase, total: None
    advance: Callable[[str, int], None] = lambda phase, n: None


class RoundRunner(RunState):
    """Runs (or resumes) rounds over the run's state (plan.py), with engines from `engines`."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        source: PromptSource | None,
        engines: EngineFactory,
        metrics: CollectorRegistry | None = None,
        progress: Progress | None = None,
        heldout: Sequence[TrainPrompt] | None = None,
    ):
        check_frozen_judges(settings)
        super().__init__(settings, registry, source, heldout)
        self.engines = engines
        self.metrics_registry = metrics or CollectorRegistry()
        self.metrics = TrainMetrics(self.metrics_registry)
        self.progress = progress or Progress()
        self.evaluator_metrics = EvaluatorMetrics(self.metrics_registry)
        self.executor: Executor | None = None

    def run(self, round_id: int | None = None) -> dict[str, Any]:
        """Run (or resume) a round. When one of its workers dies (a Ray actor or node), every worker is
        dropped and the round resumes from its last published step, up to `ray.max_restarts` times;
        each such failure is a run-log record and a counted metric."""
        round_id = self.next_round() if round_id is None else round_id
        done = self.round_dir(round_id) / SUMMARY
        if done.is_file():
            summary: dict[str, Any] = read_json(done)
            return summary
        failures = 0
        while True:
            executor = self.executor = self.executor or make_executor(self.settings, self.engines)
            try:
                summary = _Round(self, round_id, executor, self.metrics, self.evaluator_metrics, self.progress).run()
                executor.release()
                break
            except executor.worker_failures as e:
                self.close()
                failures += 1
                self.metrics.worker_failures.inc()
                self.runlog.append(
                    [
                        {
                            "key": f"round/{round_id}/worker-failure/{time.time_ns()}",
                            "kind": "worker_failure",
                            "round": round_id,
                            "time": time.time(),
                            "error": f"{type(e).__name__}: {str(e)[:500]}",
                            "resumed": failures <= self.settings.ray.max_restarts,
                        }
                    ]
                )
                if failures > self.settings.ray.max_restarts:
                    self.metrics.rounds.labels(outcome="failed").inc()
                    raise
                time.sleep(self.settings.ray.restart_wait_s * failures)
            except Exception:
                self.close()
                self.metrics.rounds.labels(outcome="failed").inc()
                raise
        self.metrics.rounds.labels(outcome="completed").inc()
        return summary

    def close(self) -> None:
        """Stop the rounds' workers (Ray actors wait between rounds until then)."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None


def make_executor(settings: Settings, engines: EngineFactory) -> Executor:
    """The executor `train.executor` names (Ray is imported only when it is asked for)."""
    if settings.train.executor == "ray":
        from dynrubric.train.ray_executor import RayExecutor

        return RayExecutor(settings, engines)
    return InProcess(settings, engines)


class _Round:
    """One round while it runs: its plan, its models, the steps it publishes."""

    def __init__(
        self,
        state: RunState,
        round_id: int,
        executor: Executor,
        metrics: TrainMetrics,
        evaluator_metrics: EvaluatorMetrics,
        progress: Progress,
    ):
        self.state = state
        self.settings = state.settings
        self.cfg = state.cfg
        self.id = round_id
        self.executor = executor
        self.metrics = metrics
        self.evaluator_metrics = evaluator_metrics
        self.progress = progress
        self.dir = state.round_dir(round_id)
        self.steps_dir = self.dir / "steps"
        self.models: RoundModels | None = None
        self.collapse_fired = False  # a policy step's collapse detector fired this round (run() resets it)

    def loaded(self) -> RoundModels:
        """The round's models, once `setup` has loaded them."""
        assert self.models is not None, "setup() loads the round's models first"
        return self.models

    def setup(self) -> None:
        self.plan = self.state.make_plan(self.id)
        self.prompts = prompts_of(self.plan["prompts"])
        self.heldout = prompts_of(self.plan["heldout"])
        self.parent = self.state.registry.get(self.plan["parent"])
        self.version = self.plan["version"]
        self.single = self.cfg.coevolve.single_model
        latest = self.latest_step()
        self.history: list[dict[str, Any]] = read_json(latest / "history.json") if latest else []
        self.models = RoundModels(
            self.settings,
            self.executor,
            self.parent,
            self.state.base_of(self.parent),
            self.state.generator_dir(),
            latest,
            self.evaluator_metrics,
        )
        # the collapse window spans rounds: continue from this round's last step, else the last round
        window = latest / COLLAPSE if latest and (latest / COLLAPSE).is_file() else self.state.run_dir / COLLAPSE
        if window.is_file():
            self.models.collapse.restore(read_json(window))
        self.anchor_file = (
            read_anchor_file(self.cfg.coevolve.rankings_file)
            if self.cfg.coevolve.ranking_source == "file" and self.cfg.coevolve.rankings_file
            else None
        )
        if self.cfg.coevolve.ranking_source == "file" and self.anchor_file is None:
            raise DynrubricError(
                "train.coevolve.ranking_source is 'file' but rankings_file is not set",
                "set train.coevolve.rankings_file to a JSONL of ranked responses",
            )

    def latest_step(self) -> Path | None:
        if not self.steps_dir.is_dir():
            return None
        done = sorted(d for d in self.steps_dir.iterdir() if d.name.isdigit())
        return done[-1] if done else None

    def close(self) -> None:
        if self.models is not None:
            self.models.close()

    # ---------------------------------------------------------------- steps
    def seed(self, purpose: str, step: int, i: int = 0) -> int:
        return round_seed(self.cfg.seed, self.id, purpose, step, i)

    def batch(self, step: int, n: int) -> list[TrainPrompt]:
        start = step * n
        return [self.prompts[(start + i) % len(self.prompts)] for i in range(n)]

    def anchors_for(self, prompt: TrainPrompt, current: Sequence[str], rng: random.Random) -> RankedAnchors | None:
        """The ranked anchors of `train.coevolve.ranking_source` (coevolve.py) for a prompt, or None."""
        if self.anchor_file is not None:
            ranked = self.anchor_file.get(prompt.key)
            return RankedAnchors(ranked, "file") if ranked else None
        co = self.cfg.coevolve
        if co.ranking_source == "feedback" and (
            users := feedback_ranking(self.state.prompt_source().feedback_by_response(prompt.key))
        ):
            return RankedAnchors(users, "users")
        lineage = {c.version: c.parent for c in self.state.registry.list()}
        # the policy being trained is one step past its parent: the parent's samples have age 1
        ages = {v: a + 1 for v, a in lineage_ages(lineage, self.parent.version).items()}
        ranked = temporal_anchors(
            rng.choice(list(current)),
            self.state.prompt_source().responses_by_version(prompt.key),
            ages,
            co.min_age,
            co.max_age,
            rng,
        )
        return RankedAnchors(ranked, "temporal") if ranked else None

    def step(self, step: int, phase: str) -> dict[str, Any]:
        if phase == "generator":
            return generator_step(
                self.settings,
                self.loaded(),
                self.batch(step, self.cfg.coevolve.sets_per_step),
                self.seed("candidates", step),
                self.anchors_for,
                lambda purpose: self.seed(purpose, step),
            )
        prompts = self.batch(step, self.cfg.prompts_per_step)
        record, responses = policy_step(
            self.settings,
            self.loaded(),
            prompts,
            self.seed("candidates", step),
            lambda j: self.seed("judging", step, j),
            lambda n: self.progress.advance("score sets", n),
        )
        self.collapse_fired = self.collapse_fired or self.loaded().collapse.collapsed
        self.state.rollouts.append(
            [(p.key, self.parent.version, rs) for p, rs in zip(prompts, responses, strict=True)],
            origin=f"round/{self.id}/step/{step}",
        )
        return record

    def publish_step(self, step: int, record: dict[str, Any]) -> None:
        self.history.append(record)
        target = self.steps_dir / f"{step:04d}"
        with atomic.directory(target) as tmp:
            self.loaded().save(tmp)
            (tmp / "history.json").write_text(json.dumps(self.history, allow_nan=False, default=float))
            (tmp / COLLAPSE).write_text(json.dumps(self.loaded().collapse.state()))
        for old in self.steps_dir.iterdir():
            if old.name.isdigit() and old.name < target.name:
                shutil.rmtree(old, ignore_errors=True)
        self.loaded().load_published(target, self.version, step)

    def log_steps(self) -> None:
        self.state.runlog.append(
            [{"key": f"round/{self.id}/step/{h['step']}", "kind": "step", "round": self.id, **h} for h in self.history]
        )

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, Any]:
        final = self.latest_step()
        m = self.loaded()
        return evaluate_round(
            self.dir / EVAL,
            settings=self.settings,
            candidate_dir=final / "policy" / "model" if final else self.parent.path,
            candidate_version=self.version,
            candidate_model=m.trainers.candidate_model,
            parent=self.parent,
            base=self.state.base_of(self.parent),
            heldout=self.heldout,
            policy_engine=m.policy_engine,
            generator_engine=None if self.single else m.generator_engine,
            previous_generator=None if self.single else m.generator_base,
            verifier_engine=m.verifier_engine,
            pad_id=m.trainers.pad_token_id,
            seed=self.seed("heldout", 0),
        )

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        started = time.time()
        self.collapse_fired = False
        try:
            t0 = time.perf_counter()
            self.setup()
            self.clock = {"setup": time.perf_counter() - t0, "checkpoints": 0.0}
            self.log_steps()
            schedule = self.plan["schedule"]
            first = len(self.history)
            self.progress.start(f"round {self.id}", len(schedule))
            self.progress.advance(f"round {self.id}", first)
            for step in range(first, len(schedule)):
                phase = schedule[step]
                if phase == "policy":
                    self.progress.start("score sets", self.cfg.prompts_per_step)
                record = {"step": step, "phase": phase, "time": time.time(), **self.step(step, phase)}
                t0 = time.perf_counter()
                self.publish_step(step, record)
                self.clock["checkpoints"] += time.perf_counter() - t0
                self.log_steps()
                if phase == "policy":
                    self.metrics.reward_mean.set(record["reward_mean"])
                    self.metrics.kl.set(record["kl"])
                    self.metrics.no_gradient_sets.inc(record["no_gradient_sets"])
                    if record.get("sampler_log_ratio") is not None:  # the sampling engine returned log-probs
                        self.metrics.sampler_log_ratio.set(record["sampler_log_ratio"])
                        self.metrics.sampler_capped.set(record["sampler_capped"])
                elif record.get("gen_judge_user_agreement") is not None:
                    self.metrics.judge_user_agreement.set(record["gen_judge_user_agreement"])
                self.progress.advance(f"round {self.id}", 1)
            unchanged = self.unchanged()
            if unchanged is not None:  # nothing to roll out: no evaluation, no registration
                self.clock |= {"evaluate": 0.0, "guard": 0.0}
                return self.finish_unregistered(unchanged, started)
            self.progress.start("evaluate", 1)
            t0 = time.perf_counter()
            evaluation = self.evaluate()
            self.clock["evaluate"] = time.perf_counter() - t0
            self.progress.advance("evaluate", 1)
            return self.finish(evaluation, started)
        finally:
            self.close()

    def stage_seconds(self) -> dict[str, float]:
        """Where the round's time went, in the order it is spent. The steps' stages cover all the round's
        steps (a resumed round's earlier ones too); setup (models, engines, actors), checkpoints (each
        step published: weights saved, engines reloaded), the held-out evaluation and the guard
        (verdict, registration) are this run's."""

        def steps(phase: str, stage: str) -> float:
            return sum((h.get("stage_seconds", {}).get(stage, 0.0) for h in self.history if h["phase"] == phase), 0.0)

        return {
            "setup": self.clock["setup"],
            "candidates": steps("policy", "candidates") + steps("generator", "candidates"),
            "rubrics": steps("policy", "rubrics"),
            "verdicts": steps("policy", "verdicts"),
            "policy_update": steps("policy", "update"),
            "generator_rubrics": steps("generator", "rubrics"),
            "generator_update": steps("generator", "update"),
            "checkpoints": self.clock["checkpoints"],
            "evaluate": self.clock["evaluate"],
            "guard": self.clock["guard"],
        }

    def unchanged(self) -> str | None:
        """Why the round has no new policy to register, or None: no policy step applied an update (every set
        tied or untrusted), or the final weights are byte for byte the parent's."""
        from dynrubric.registry import weights_sha256

        policy = [h for h in self.history if h["phase"] == "policy"]
        if not any(h["updated"] for h in policy):
            tied = sum(h["no_gradient_sets"] for h in policy)
            return (
                f"no policy update in {len(policy)} policy step(s) ({tied} of "
                f"{sum(h['sets'] for h in policy)} sets tied or untrusted): nothing to roll out"
            )
        final = self.latest_step()
        if final is not None and weights_sha256(final / "policy" / "model") == self.parent.weights_sha256:
            return "the trained weights equal the parent's (same sha256): nothing to roll out"
        return None

    def finish_unregistered(self, why: str, started: float) -> dict[str, Any]:
        """A round that registers nothing (`unchanged`): the next round builds on the same parent. The
        generator's step, if any, is kept as in an accepted round: it changed no served weights."""
        self.keep_generator()
        guard = {"accepted": False, "reason": "no_update", "detail": why}
        return self.publish(self.summary(None, "unregistered", guard, {}, {}, started))

    def finish(self, evaluation: dict[str, Any], started: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        verdict, metrics = round_verdict(self.cfg, self.history, evaluation, self.settings.evaluation.guard)
        final = self.latest_step()
        state = CheckpointState.candidate if verdict.accepted else CheckpointState.rejected
        ckpt = self.state.registry.register(
            final / "policy" / "model" if final else self.parent.path,
            parent=self.parent.version,
            round=self.id,
            metrics=metrics,
            version=self.version,
            state=state,
            reason=None if verdict.accepted else f"{verdict.reason}: {verdict.detail}",
        )
        if not verdict.accepted:
            self.metrics.guard_rejections.labels(reason=verdict.reason).inc()
        else:
            self.keep_generator()
        if "heldout_pass" in metrics:
            self.metrics.heldout_pass.set(metrics["heldout_pass"])
        self.clock["guard"] = time.perf_counter() - t0
        guard = {"accepted": verdict.accepted, "reason": verdict.reason, "detail": verdict.detail}
        return self.publish(self.summary(ckpt.version, ckpt.state.value, guard, metrics, evaluation, started))

    def keep_generator(self) -> None:
        """Two-model mode: the generator's weights as this round left them become the next round's."""
        final = self.latest_step()
        if self.single or final is None:
            return
        gen_current = self.state.run_dir / "generator"
        shutil.rmtree(gen_current, ignore_errors=True)
        with atomic.directory(gen_current) as tmp:
            shutil.copytree(final / "generator", tmp, dirs_exist_ok=True)

    def summary(
        self,
        version: str | None,
        state: str,
        guard: dict[str, Any],
        metrics: dict[str, Any],
        evaluation: dict[str, Any],
        started: float,
    ) -> dict[str, Any]:
        collapse = self.collapse_fired or any(h.get("collapse") for h in self.history)
        return {
            "round": self.id,
            "parent": self.parent.version,
            "version": version,
            "state": state,
            "guard": guard,
            "metrics": metrics,
            "eval": evaluation,
            "steps": self.history,
            "phases": {p: sum(h["phase"] == p for h in self.history) for p in ("policy", "generator")},
            "refresh": self.plan["refresh"],
            "collapse": {
                "fired": collapse,
                "note": None
                if not collapse
                else (
                    "collapse detected: the next round starts with a generator phase"
                    if self.cfg.coevolve.enabled
                    else "collapse detected; co-evolution is disabled, so no generator phase follows"
                ),
            },
            "prompts": len(self.prompts),
            "watermark_before": self.plan["watermark_before"],
            "watermark_after": self.plan["watermark_after"],
            "seconds": time.time() - started,
            "stage_seconds": self.stage_seconds(),
        }

    def publish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The round's summary, written last: from here on the round is complete and never runs again."""
        write_json(self.state.run_dir / COLLAPSE, self.loaded().collapse.state())
        write_json(self.dir / SUMMARY, summary)
        self.state.runlog.append(
            [{"key": f"round/{self.id}", "kind": "round", **{k: v for k, v in summary.items() if k != "steps"}}]
        )
        shutil.rmtree(self.steps_dir, ignore_errors=True)  # the weights now live in the registry (or nowhere)
        return summary
