"""One training round, top to bottom: plan -> steps (candidates, rubric scores, GRPO) -> evaluation -> guards
-> registry, resumable at every step.

Read in this order: `RoundRunner.run` retries a round when a worker dies; `_Round.run` plans the round,
runs its steps (`policy_step`, `generator_step`), publishes each, evaluates the candidate
(`evaluate_candidate`), applies the guards (`round_verdict`) and writes the summary. `RunState` answers
what the round builds on and writes its plan; `RoundModels` holds what a round trains and judges with.
Where the workers run (this process, Ray actors) is train/executor.py and train/ray_executor.py; the
losses train/grpo.py, the generator's rewards train/coevolve.py, the guards' checks train/guards.py, the
ground-truth evaluation train/policy_eval.py.

A round is a fixed plan of steps, written before the first step (`plan.json`: parent version, the
prompts taken since the last watermark, the held-out prompts, policy/generator phase of each step).
After every step the trainer state (weights, AdamW state, step history) is published as ONE atomic
directory `steps/NNNN/`; a step without its directory did not happen. A crash anywhere re-runs the
round from the newest published step with exactly the state it had, so no update is applied twice
(AdamW's own step counter, saved with it, proves it). Evaluation is saved as `eval.json`, the
checkpoint is registered under a deterministic version id (registration is idempotent), and
`summary.json` is written last: a round with a summary is complete and is never run again.

Every draw of a round has its own seed, `round_seed(train.seed, round, purpose, step, i)` (dynrubric/seeds.py):
the candidates and the anchors of each step, each judging chunk, the generator's rubrics, the held-out
evaluation. A resumed step draws exactly what the interrupted one drew.

Layout under `train.run_dir` (default `<state_dir>/train`):

    rounds/NNNN/plan.json  steps/NNNN/{policy/, generator/, history.json, collapse.json}  eval.json
                 summary.json  [policy_optimizer.pt]
    runlog.jsonl     one record per step and per round (deduplicated by key on resume)
    rollouts.jsonl   responses sampled per prompt and policy version (temporal-contrast anchors)
    collapse.json    the collapse detector's window of sets, carried from round to round
    generator/       the generator's weights between rounds (two-model mode)

A round builds on the last ACCEPTED version (promoted, or a candidate that passed the guards), its KL
penalty pulls toward the base of the lineage (or the parent: `grpo.kl_reference`), its AdamW starts fresh
(or goes on from the parent's round: `grpo.optimizer_across_rounds`, kept as
`rounds/NNNN/policy_optimizer.pt`), and the guards bound both the round's KL to its parent and the total KL to
the base. Held-out prompts are split off by prompt key and never trained on.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynrubric import atomic, modelcache
from dynrubric.config import Settings, TrainConfig
from dynrubric.engines.base import Completion, Engine, GenerationRequest, SamplingParams
from dynrubric.errors import DynrubricError
from dynrubric.registry import Checkpoint, CheckpointState, Registry
from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics, ScoredSet
from dynrubric.rubric.gaps import CollapseDetector
from dynrubric.rubric.generate import RUBRIC_SCHEMA_JSON, RUBRIC_SOURCES, GenerationCounts
from dynrubric.rubric.groundtruth import derive
from dynrubric.seeds import RoundPurpose, round_seed
from dynrubric.train import guards
from dynrubric.train.coevolve import (
    RankedAnchors,
    feedback_ranking,
    generator_groups,
    lineage_ages,
    read_anchor_file,
    sampled_response,
    temporal_anchors,
)
from dynrubric.train.executor import EngineFactory, Executor, InProcess, ScoreChunk, TrainerSpec
from dynrubric.train.prompts import (
    PromptSource,
    ResponseHistory,
    TrainPrompt,
    heldout_bucket,
    read_prompt_file,
)
from dynrubric.train.records import (
    RUNLOG,
    Collapse,
    Evaluation,
    Fallbacks,
    GeneratorStep,
    Guard,
    OpenRLHFSummary,
    PolicyStep,
    RoundSummary,
    RunLogFile,
    SetScores,
    WorkerFailureLine,
    read_record,
    read_steps,
    read_summary,
    round_line,
    step_line,
    write_record,
    write_steps,
)
from dynrubric.train.splits import trainable

EngineRole = Literal["policy", "generator", "verifier"]  # EngineConfig.url_for's roles
PLAN, SUMMARY, EVAL, COLLAPSE, HISTORY = "plan.json", "summary.json", "eval.json", "collapse.json", "history.json"
OPTIMIZER = "policy_optimizer.pt"  # an accepted round's last AdamW state (grpo.optimizer_across_rounds: carry)
GUARDED = "guard"  # metrics key: "accepted" on a candidate whose round passed the guards


# ==================================================================== the run's state and a round's plan
def is_accepted(ckpt: Checkpoint) -> bool:
    if ckpt.state in (CheckpointState.canary, CheckpointState.stable):
        return True
    return ckpt.state == CheckpointState.candidate and ckpt.metrics.get(GUARDED) == "accepted"


def run_dir_of(settings: Settings) -> Path:
    return settings.train_run_dir()


def response_history(settings: Settings) -> ResponseHistory:
    """The trainer's own log of sampled responses (the JSONL prompt source's temporal-contrast anchors)."""
    return ResponseHistory(run_dir_of(settings) / "rollouts.jsonl")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def write_json(path: Path, data: Any) -> None:
    atomic.write_text(path, json.dumps(data, indent=2, allow_nan=False, default=float))


def prompts_of(records: Sequence[dict[str, Any]]) -> list[TrainPrompt]:
    return [TrainPrompt(key=r["key"], messages=tuple((m[0], m[1]) for m in r["messages"])) for r in records]


class RunState:
    """The run's rounds on disk and in the registry: which round is next, what it builds on, its plan.
    `heldout`, when given, replaces the configured held-out prompts. Without a prompt `source` it only
    answers which round is next and registers the base version."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        source: PromptSource | None,
        heldout: Sequence[TrainPrompt] | None = None,
    ):
        self.settings = settings
        self.cfg = settings.train
        self.registry = registry
        self.source = source
        self.heldout_override = list(heldout) if heldout is not None else None
        self.run_dir = run_dir_of(settings)
        self.runlog = RunLogFile(self.run_dir / RUNLOG)
        self.rollouts = response_history(settings)

    def prompt_source(self) -> PromptSource:
        assert self.source is not None, "this run state was built without a prompt source"
        return self.source

    def round_dir(self, round_id: int) -> Path:
        return self.run_dir / "rounds" / f"{round_id:04d}"

    def completed_rounds(self) -> list[int]:
        rounds = self.run_dir / "rounds"
        if not rounds.is_dir():
            return []
        return sorted(int(d.name) for d in rounds.iterdir() if d.name.isdigit() and (d / SUMMARY).is_file())

    def last_summary(self) -> RoundSummary | OpenRLHFSummary | None:
        done = self.completed_rounds()
        return read_summary(self.round_dir(done[-1]) / SUMMARY) if done else None

    def next_round(self) -> int:
        rounds = self.run_dir / "rounds"
        started = sorted(int(d.name) for d in rounds.iterdir() if d.name.isdigit()) if rounds.is_dir() else []
        done = set(self.completed_rounds())
        unfinished = [r for r in started if r not in done]
        return unfinished[0] if unfinished else (max(done) + 1 if done else 1)

    def ensure_base(self) -> Checkpoint:
        """The registry's first version: the configured policy model, registered stable as `base`."""
        existing = self.registry.list()
        if existing:
            return existing[0]
        from dynrubric import modelcache

        model_dir = modelcache.resolve(self.settings.paths.resolved_home(), self.settings.models.policy)
        ckpt = self.registry.register(model_dir, parent=None, round=None, metrics={}, version="base")
        return self.registry.promote(ckpt.version)

    def head(self) -> Checkpoint:
        """The newest ACCEPTED version, what the next round builds on: one a person promoted (canary,
        stable), or a candidate whose round passed the guards. A candidate registered without them
        (by hand) is not built on until promoted."""
        self.ensure_base()
        accepted = [c for c in self.registry.list() if is_accepted(c)]
        if not accepted:
            raise DynrubricError(
                "the registry has no accepted checkpoint to train from (all rejected, retired or unguarded)",
                "promote a version with `dynrubric registry promote VERSION`",
            )
        return accepted[-1]

    def generator_dir(self) -> Path:
        """The generator's weights as the last accepted round left them (two-model mode)."""
        current = self.run_dir / "generator"
        if (current / "model" / "config.json").is_file():
            return current / "model"
        from dynrubric import modelcache

        return modelcache.resolve(self.settings.paths.resolved_home(), self.settings.models.generator)

    def base_of(self, ckpt: Checkpoint) -> Checkpoint:
        """The root of `ckpt`'s lineage: the model all drift is measured from."""
        seen = {ckpt.version}
        while ckpt.parent is not None and ckpt.parent not in seen:
            ckpt = self.registry.get(ckpt.parent)
            seen.add(ckpt.version)
        return ckpt

    def kl_reference(self, parent: Checkpoint) -> Checkpoint:
        """The KL penalty's reference for a round on `parent` (`grpo.kl_reference`): the lineage's base, or the
        parent itself."""
        return parent if self.cfg.grpo.kl_reference == "parent" else self.base_of(parent)

    def carried_optimizer(self, parent: Checkpoint) -> Path | None:
        """The AdamW state a round on `parent` starts from with `grpo.optimizer_across_rounds: carry`: the one the
        round that made the parent ended with (`keep_optimizer`). None: fresh (the option is off, the parent is
        the base or was registered by hand, or its round ran without carry)."""
        if self.cfg.grpo.optimizer_across_rounds != "carry" or parent.round is None:
            return None
        path = self.round_dir(parent.round) / OPTIMIZER
        return path if path.is_file() else None

    def keep_optimizer(self, round_id: int, final_step: Path, parent: Checkpoint) -> None:
        """With `grpo.optimizer_across_rounds: carry`, an accepted round keeps its last AdamW state for the round
        that builds on it. Only this round's and its parent's are kept (the parent's: if the gate rolls this one
        back, the next round builds on the parent again): each is about twice the policy's weights."""
        if self.cfg.grpo.optimizer_across_rounds != "carry":
            return
        target = self.round_dir(round_id) / OPTIMIZER
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        shutil.copyfile(final_step / "policy" / "optimizer.pt", tmp)
        tmp.replace(target)  # whole or absent: a crash never leaves half a state to carry
        for old in (self.run_dir / "rounds").glob(f"*/{OPTIMIZER}"):
            if old.parent.name not in {f"{round_id:04d}", f"{parent.round or 0:04d}"}:
                old.unlink(missing_ok=True)

    # ------------------------------------------------------------ plan
    def schedule(self, round_id: int, steps: int, refresh: bool) -> list[str]:
        """The phase of each of a round's steps: `k_alt` policy steps, then `k_alt_generator` generator steps,
        and again, counted across rounds; after a collapse, a generator phase first."""
        co = self.cfg.coevolve
        if not co.enabled:
            return ["policy"] * steps
        n_policy, n_generator = co.k_alt, co.k_alt_generator or co.k_alt

        def phase(g: int) -> str:
            return "policy" if g % (n_policy + n_generator) < n_policy else "generator"

        if refresh:  # collapse-triggered: a generator phase first, then the usual alternation
            first = min(n_generator, steps)
            return ["generator"] * first + [phase(s) for s in range(steps - first)]
        offset = (round_id - 1) * steps
        return [phase(offset + s) for s in range(steps)]

    def prompts_needed(self, sets: int) -> int:
        """The distinct new prompts a round whose policy batches hold `sets` sets needs to train on:
        `train.min_new_prompts_per_set` x `sets` (rounded up), at least 1."""
        return max(1, math.ceil(self.cfg.min_new_prompts_per_set * sets - 1e-9))

    def new_prompts(self, round_id: int, source: PromptSource | None = None) -> NewPrompts:
        """What round `round_id` would train on if planned now: the prompts `source` (default the run's) logged
        since the last round's watermark, up to `train.max_prompts_per_round`, less those not trainable and the
        held-out ones; its schedule, and how many distinct prompts it needs (`prompts_needed`)."""
        last = self.last_summary()
        watermark = last.watermark_after if last else None
        taken, watermark_after = (source or self.prompt_source()).new_prompts(watermark, self.cfg.max_prompts_per_round)
        prompts = [p for p in taken if trainable(p.key, [i.id for i in derive(p.question).instructions])]
        train, heldout = self.split_heldout(prompts)
        refresh = None
        if last and last.collapse.fired and self.cfg.coevolve.enabled:
            refresh = f"collapse detected in round {last.round}: starting with a generator phase"
        schedule = self.schedule(round_id, self.cfg.steps_per_round, refresh is not None)
        sets = self.cfg.prompts_per_step * schedule.count("policy")
        return NewPrompts(
            train,
            heldout,
            len(taken),
            len(taken) - len(prompts),
            watermark,
            watermark_after,
            schedule,
            refresh,
            sets,
            self.prompts_needed(sets),
        )

    def make_plan(self, round_id: int) -> dict[str, Any]:
        path = self.round_dir(round_id) / PLAN
        if path.is_file():
            plan: dict[str, Any] = read_json(path)
            return plan
        parent = self.head()
        new = self.new_prompts(round_id)
        if not new.taken:
            raise DynrubricError(
                f"no new prompts since watermark {new.watermark_before!r} for round {round_id}",
                "add prompts to the replay store / prompt file, then run the round again",
            )
        if not new.train:
            raise DynrubricError(
                f"round {round_id}: every new prompt is held out or in the dev/test split, none is left to train on",
                "add prompts, or set train.heldout_file to a separate held-out set",
            )
        if not new.enough:
            # refused, not waited for: here nothing would bring more prompts (the loop waits for them before a round)
            raise DynrubricError(
                f"round {round_id}: {new.distinct} distinct new prompts to train on since watermark "
                f"{new.watermark_before!r} ({new.taken} taken, {len(new.heldout)} held out, {new.not_trainable} in "
                f"the dev/test split), fewer than the {new.needed} its {new.sets} sets need "
                f"(train.min_new_prompts_per_set {self.cfg.min_new_prompts_per_set}): its steps would re-train a few "
                "prompts",
                "let more prompts arrive (`dynrubric up` waits for them), raise train.max_prompts_per_round if it is "
                "below that, or lower train.min_new_prompts_per_set",
            )
        carried = self.carried_optimizer(parent)
        plan = {
            "round": round_id,
            "parent": parent.version,
            "version": f"{self.cfg.version_prefix}{round_id}",
            # what the trainer starts from besides the parent's weights (grpo.kl_reference, optimizer_across_rounds)
            "kl_reference": self.kl_reference(parent).version,
            "optimizer_from": str(carried) if carried else None,
            "prompts": [{"key": p.key, "messages": p.messages} for p in new.train],
            "heldout": [{"key": p.key, "messages": p.messages} for p in new.heldout],
            # distinct training prompts, and how many the round needed (train.min_new_prompts_per_set)
            "new_prompts": new.distinct,
            "new_prompts_needed": new.needed,
            # dev/test prompts of the bank and prompts asking for a held-out type (train/splits.py): never trained
            "not_trainable": new.not_trainable,
            "watermark_before": new.watermark_before,
            "watermark_after": new.watermark_after,
            "schedule": new.schedule,
            "refresh": new.refresh,
            "started_at": time.time(),
        }
        write_json(path, plan)
        return plan

    def split_heldout(self, prompts: list[TrainPrompt]) -> tuple[list[TrainPrompt], list[TrainPrompt]]:
        """(training prompts, held-out prompts), disjoint. The held-out set is `train.heldout_file`, or
        the prompts whose key falls under `train.heldout_share` (a deterministic split by prompt key),
        gathered across rounds: the last round's held-out set, then this round's held-out prompts. With
        none yet, the new prompt lowest in that order is held out. Held-out prompts are never trained."""
        n = self.cfg.heldout_prompts
        if self.heldout_override is not None:
            held = self.heldout_override
        elif self.cfg.heldout_file:
            held = read_prompt_file(self.cfg.heldout_file)
        else:
            plans = [self.round_dir(r) / PLAN for r in self.completed_rounds() if (self.round_dir(r) / PLAN).is_file()]
            held = prompts_of(read_json(plans[-1])["heldout"]) if plans else []
            held += [p for p in prompts if heldout_bucket(p.key) < self.cfg.heldout_share]
            if not held and prompts:
                held = [min(prompts, key=lambda p: heldout_bucket(p.key))]
        keys = {p.key for p in held}
        unique = list({p.key: p for p in held}.values())
        return [p for p in prompts if p.key not in keys], unique[:n]


@dataclass(frozen=True)
class NewPrompts:
    """What the next round would train on (`RunState.new_prompts`)."""

    train: list[TrainPrompt]
    heldout: list[TrainPrompt]
    taken: int  # prompts taken from the source since the watermark
    not_trainable: int  # of them, in the dev/test split or asking for a held-out type
    watermark_before: str | None
    watermark_after: str | None
    schedule: list[str]
    refresh: str | None
    sets: int  # the sets its policy batches hold: prompts_per_step x its policy steps
    needed: int  # distinct training prompts the round needs

    @property
    def distinct(self) -> int:
        return len({p.key for p in self.train})

    @property
    def enough(self) -> bool:
        return self.distinct >= self.needed


def plan_line(plan: dict[str, Any]) -> str:
    """A round's plan as one line: what it builds on, the new prompts it trains on (and needed), what it starts
    from besides the parent's weights."""
    held, steps = len(plan["heldout"]), plan["schedule"]
    # plans written before these keys: the base, a fresh AdamW, no count needed
    distinct = plan.get("new_prompts", len({p["key"] for p in plan["prompts"]}))
    needed = f" (at least {plan['new_prompts_needed']})" if plan.get("new_prompts_needed") else ""
    carried = plan.get("optimizer_from")
    return (
        f"round {plan['round']}: {plan['version']} on {plan['parent']}; {distinct} distinct new prompts to train on"
        f"{needed}, {held} held out, {plan.get('not_trainable', 0)} not trainable; {steps.count('policy')} policy and "
        f"{steps.count('generator')} generator steps; KL reference {plan.get('kl_reference', 'base')}; AdamW "
        + (f"carried from {carried}" if carried else "fresh")
    )


# ==================================================================== rounds, retried when a worker dies
class Progress(Protocol):
    """What a round reports as it goes (the CLI's rich bars implement it)."""

    def start(self, phase: str, total: int) -> None: ...

    def advance(self, phase: str, n: int) -> None: ...

    def note(self, text: str) -> None:
        """A line about the round: its plan, each policy step's draws."""


class Quiet:
    """A `Progress` that reports nothing (tests, benchmarks)."""

    def start(self, phase: str, total: int) -> None:
        """Nothing to draw."""

    def advance(self, phase: str, n: int) -> None:
        """Nothing to draw."""

    def note(self, text: str) -> None:
        """Nothing to say."""


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
        for reason in ("kl", "kl_to_base", "reward_drop", "nonfinite", "heldout_regression", "kind_regression"):
            self.guard_rejections.labels(reason=reason)


class RoundRunner(RunState):
    """Runs (or resumes) rounds over the run's state (`RunState`), with engines from `engines`."""

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
        self.progress: Progress = progress or Quiet()
        self.evaluator_metrics = EvaluatorMetrics(self.metrics_registry)
        self.executor: Executor | None = None

    def run(self, round_id: int | None = None) -> RoundSummary:
        """Run (or resume) a round. When one of its workers dies (a Ray actor or node), every worker is
        dropped and the round resumes from its last published step, up to `ray.max_restarts` times;
        each such failure is a run-log record and a counted metric."""
        round_id = self.next_round() if round_id is None else round_id
        done = self.round_dir(round_id) / SUMMARY
        if done.is_file():
            summary = read_summary(done)
            if isinstance(summary, OpenRLHFSummary):
                raise DynrubricError(
                    f"round {round_id} is complete: OpenRLHF trained it ({done})",
                    "run the next round (leave out --round)",
                )
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
                        WorkerFailureLine(
                            key=f"round/{round_id}/worker-failure/{time.time_ns()}",
                            round=round_id,
                            time=time.time(),
                            error=f"{type(e).__name__}: {str(e)[:500]}",
                            resumed=failures <= self.settings.ray.max_restarts,
                        )
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


# ==================================================================== one round
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

    def run(self) -> RoundSummary:
        """The round from its newest published step (or its plan) to its summary."""
        # on the clock the stages use: time.time() can step mid-round (NTP), and the stages must add up to the round
        started = time.perf_counter()
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
                record: PolicyStep | GeneratorStep
                if phase == "policy":
                    record = self.policy_step(step)
                else:
                    record = self.generator_step(step)
                t0 = time.perf_counter()
                self.publish_step(step, record)
                self.clock["checkpoints"] += time.perf_counter() - t0
                self.log_steps()
                self.record_metrics(record)
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

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        """The round's plan (written now if new), its step history so far, its models and anchors."""
        self.plan = self.state.make_plan(self.id)
        self.progress.note(plan_line(self.plan))
        self.prompts = prompts_of(self.plan["prompts"])
        self.heldout = prompts_of(self.plan["heldout"])
        self.parent = self.state.registry.get(self.plan["parent"])
        self.version = self.plan["version"]
        self.single = self.cfg.coevolve.single_model
        latest = self.latest_step()
        self.history: list[PolicyStep | GeneratorStep] = read_steps(latest / HISTORY) if latest else []
        # plans written before these keys: the base, a fresh optimiser (what those rounds ran with)
        reference = self.state.registry.get(self.plan.get("kl_reference") or self.state.base_of(self.parent).version)
        optimizer = self.plan.get("optimizer_from")
        self.models = RoundModels(
            self.settings,
            self.executor,
            self.parent,
            reference,
            self.state.generator_dir(),
            latest,
            self.evaluator_metrics,
            Path(optimizer) if optimizer else None,
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

    def loaded(self) -> RoundModels:
        """The round's models, once `setup` has loaded them."""
        assert self.models is not None, "setup() loads the round's models first"
        return self.models

    def latest_step(self) -> Path | None:
        if not self.steps_dir.is_dir():
            return None
        done = sorted(d for d in self.steps_dir.iterdir() if d.name.isdigit())
        return done[-1] if done else None

    def close(self) -> None:
        if self.models is not None:
            self.models.close()

    # ---------------------------------------------------------------- steps
    def seed(self, purpose: RoundPurpose, step: int, i: int = 0) -> int:
        """The seed of one draw of this round (dynrubric/seeds.py)."""
        return round_seed(self.cfg.seed, self.id, purpose, step, i)

    def batch(self, step: int, n: int) -> list[TrainPrompt]:
        start = step * n
        return [self.prompts[(start + i) % len(self.prompts)] for i in range(n)]

    def policy_cursor(self, step: int) -> int:
        """Where policy step `step` starts drawing in the round's prompts: `step x prompts_per_step` (as without
        dynamic sampling), moved on by the sets earlier policy steps drew beyond their batch, so no two draws of
        a round repeat a prompt before all have been drawn. A pure function of the published history: a resumed
        step draws what the interrupted one drew."""
        n = self.cfg.prompts_per_step
        extra = sum((h.sets_drawn or n) - n for h in self.history if isinstance(h, PolicyStep) and h.step < step)
        return step * n + extra

    def draw_sets(self, step: int, draw: int, prompts: Sequence[TrainPrompt]) -> DrawnSets:
        """Draw `draw` of policy step `step`: K candidates per prompt (seed `("candidates", step, draw)`), each set
        scored under one rubric (judging chunk j with seed `("judging", step, JUDGING_SEEDS_PER_DRAW x draw + j)`;
        draw 0's seeds are those of a step without dynamic sampling)."""
        cfg, models = self.cfg, self.loaded()
        self.progress.start("score sets", len(prompts))
        t0 = time.perf_counter()
        texts, outs = sample_sets(
            self.settings, models.policy_engine, prompts, cfg.candidates, self.seed("candidates", step, draw)
        )
        t1 = time.perf_counter()
        responses = [[c.text for c in cs] for cs in outs]
        n = len(prompts)
        size = -(-n // min(cfg.judge_chunks, n))
        chunks = [
            ScoreChunk(
                [p.question for p in prompts[i : i + size]],
                responses[i : i + size],
                self.seed("judging", step, JUDGING_SEEDS_PER_DRAW * draw + j),
            )
            for j, i in enumerate(range(0, n, size))
        ]
        scored, counts, judging = models.score(chunks, self.progress)
        return DrawnSets(list(prompts), texts, outs, scored, counts, {"candidates": t1 - t0, **judging})

    def policy_step(self, step: int) -> PolicyStep:
        """One GRPO batch of the policy: candidate sets drawn (`draw_sets`), the update. With dynamic sampling
        (`train.dynamic_sampling.oversample` > 1) the step draws until `prompts_per_step` sets have a real spread
        (trusted, spread >= `min_set_spread`) or its budget of sets is spent, and trains on those sets alone;
        without, it trains on its one draw, whose tied sets give no gradient. Returns the step's record (the set
        fields cover every set drawn, the GRPO fields the batch); every sampled response goes to the rollouts log
        (the temporal-contrast anchors of later rounds)."""
        from dynrubric.train.grpo import CandidateSet, has_signal, min_set_spread

        started = time.time()
        cfg = self.cfg
        models = self.loaded()
        target, budget = cfg.prompts_per_step, sets_budget(cfg)
        min_spread = min_set_spread(self.settings.rubric.eps, cfg.grpo)
        cursor, size, draws = self.policy_cursor(step), target, 0
        drawn: list[DrawnSets] = []
        while size > 0:
            prompts = [self.prompts[(cursor + i) % len(self.prompts)] for i in range(size)]
            drawn.append(self.draw_sets(step, draws, prompts))
            cursor, draws = cursor + size, draws + 1
            kept = sum(s.trusted and has_signal(s.scores, min_spread) for d in drawn for s in d.scored)
            size = next_draw_size(target, kept, sum(len(d.scored) for d in drawn), budget) if budget > target else 0
        t2 = time.perf_counter()
        tok = models.policy_engine.tokenizer
        sets = [(text, cs, sc) for d in drawn for text, cs, sc in zip(d.texts, d.outs, d.scored, strict=True)]
        scored = [sc for _, _, sc in sets]
        signal = [sc.trusted and has_signal(sc.scores, min_spread) for sc in scored]
        # with dynamic sampling the batch is the first `target` sets with a spread; without, the one draw whole
        batch = [x for x, ok in zip(sets, signal, strict=True) if ok][:target] if budget > target else sets
        groups = []
        for text, cs, sc in batch:
            prompt_ids = tuple(tok.encode(text, add_special_tokens=False))
            # an untrusted set (a calibration answer outranks a candidate) teaches nothing: zero advantage
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
        # the mean score of every set drawn: what the policy earns on the round's prompts, not on the sets kept
        stats["reward_mean"] = sum(sum(sc.scores) / len(sc.scores) for sc in scored) / n
        kept = min(sum(signal), target) if budget > target else sum(signal)
        self.collapse_fired = self.collapse_fired or models.collapse.collapsed
        self.state.rollouts.append(
            [
                (p.key, self.parent.version, [c.text for c in cs])
                for d in drawn
                for p, cs in zip(d.prompts, d.outs, strict=True)
            ],
            origin=f"round/{self.id}/step/{step}",
        )
        seconds = {k: sum(d.seconds.get(k, 0.0) for d in drawn) for k in ("candidates", "rubrics", "verdicts")}
        self.progress.note(
            f"step {step}: {kept} of {n} sets drawn kept ({kept / n:.0%}; a real spread, trusted) in {draws} "
            f"draw(s); batch {len(groups)} sets" + (f" of {target} (budget {budget} sets)" if budget > target else "")
        )
        return PolicyStep(
            step=step,
            time=started,
            # candidates, their rubrics and verdicts (every draw), the update; rubrics + verdicts is the judging's
            stage_seconds={**seconds, "update": time.perf_counter() - t2},
            **stats,
            mean_gap=sum(s.gaps.mean_abs_gap for s in scored) / n,
            tie_rate=sum(s.gaps.tie_rate for s in scored) / n,
            nonsplit_share=sum(s.gaps.nonsplit_share for s in scored) / n,
            untrusted_sets=sum(not s.trusted for s in scored),
            # per set, the scores of candidates and calibration answers: the trust rule can be checked from the run log
            set_scores=[
                SetScores(
                    scores=s.scores,
                    calibration_scores=s.calibration_scores,
                    trusted=s.trusted,
                    overruled_items=s.overruled_items,
                )
                for s in scored
            ],
            rubric_sources={src: sum(s.rubric_source == src for s in scored) for src in RUBRIC_SOURCES},
            fallbacks=Fallbacks(
                parse_failures=sum(d.counts.parse_failures for d in drawn),
                prompt_only=sum(d.counts.prompt_only_fallbacks for d in drawn),
                generic=sum(d.counts.generic_fallbacks for d in drawn),
                hard_verdict=sum(s.hard_verdict_fallbacks for s in scored),
            ),
            collapse=models.collapse.collapsed,
            draws=draws,
            sets_drawn=n,
            sets_kept=kept,
            kept_share=kept / n,
        )

    def generator_step(self, step: int) -> GeneratorStep:
        """One GRPO batch of the rubric generator over candidate sets of the step's prompts (train/coevolve.py):
        rubrics sampled for each set, rewarded by how well they rank the set against its anchors."""
        started = time.time()
        settings, co = self.settings, self.cfg.coevolve
        models = self.loaded()
        evaluator = models.evaluator
        prompts = self.batch(step, co.sets_per_step)
        t0 = time.perf_counter()
        _, outs = sample_sets(
            settings, models.policy_engine, prompts, self.cfg.candidates, self.seed("candidates", step)
        )
        t1 = time.perf_counter()
        responses = [[c.text for c in cs] for cs in outs]
        rng = random.Random(self.seed("anchors", step))
        anchors = [self.anchors_for(p, rs, rng) for p, rs in zip(prompts, responses, strict=True)]
        groups, gstats = generator_groups(
            models.generator_engine,
            evaluator.rubric_generator.set_prompt,
            # the verdicts the evaluator scores with: checks run, verifier de-biased by the calibration answers
            lambda q, rs, rubric: evaluator.judge(q, rubric, rs).verdicts,
            evaluator.apply_rubric,
            list(zip(prompts, responses, strict=True)),
            anchors,
            co,
            settings.rubric.max_items,
            settings.rubric.generator_temperature,
            settings.rubric.eps,
            self.seed("rubrics", step),
            RUBRIC_SCHEMA_JSON if settings.rubric.constrained else None,
            settings.rubric.stated_checks_only,
        )
        t2 = time.perf_counter()
        stats = models.trainers.step("generator", groups)
        # the generator's rubrics: sampled for the candidate sets, judged and rewarded (t1..t2)
        return GeneratorStep.model_validate(
            {
                "step": step,
                "time": started,
                "stage_seconds": {"candidates": t1 - t0, "rubrics": t2 - t1, "update": time.perf_counter() - t2},
                **stats,
                **{f"gen_{k}": v for k, v in gstats.as_dict().items()},
            }
        )

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

    def publish_step(self, step: int, record: PolicyStep | GeneratorStep) -> None:
        """The step's weights, optimiser state, history and collapse window as ONE atomic directory; the
        engines then serve the published weights."""
        self.history.append(record)
        target = self.steps_dir / f"{step:04d}"
        previous = self.latest_step()
        with atomic.directory(target) as tmp:
            self.loaded().save(tmp, previous)
            write_steps(tmp / HISTORY, self.history)
            (tmp / COLLAPSE).write_text(json.dumps(self.loaded().collapse.state()))
        for old in self.steps_dir.iterdir():
            if old.name.isdigit() and old.name < target.name:
                shutil.rmtree(old, ignore_errors=True)
        self.loaded().load_published(target, self.version, step)

    def log_steps(self) -> None:
        self.state.runlog.append([step_line(self.id, h) for h in self.history])

    def record_metrics(self, record: PolicyStep | GeneratorStep) -> None:
        """A published step's gauges and counters (monitoring/README.md)."""
        if isinstance(record, PolicyStep):
            self.metrics.reward_mean.set(record.reward_mean)
            self.metrics.kl.set(record.kl)
            # sets dynamic sampling left out of the batch gave no gradient either
            self.metrics.no_gradient_sets.inc(
                record.no_gradient_sets + (record.sets_drawn or record.sets) - record.sets
            )
            if record.sampler_log_ratio is not None:  # the sampling engine returned log-probs
                self.metrics.sampler_log_ratio.set(record.sampler_log_ratio)
                self.metrics.sampler_capped.set(record.sampler_capped or 0.0)
        elif record.gen_judge_user_agreement is not None:
            self.metrics.judge_user_agreement.set(record.gen_judge_user_agreement)

    # ---------------------------------------------------------------- evaluation, guards, registration
    def unchanged(self) -> str | None:
        """Why the round has no new policy to register, or None: no policy step applied an update (every set
        tied or untrusted), or the final weights are byte for byte the parent's."""
        from dynrubric.registry import weights_sha256

        policy = [h for h in self.history if isinstance(h, PolicyStep)]
        if not any(h.updated for h in policy):
            drawn = sum(h.sets_drawn or h.sets for h in policy)
            tied = drawn - sum(h.sets - h.no_gradient_sets for h in policy)  # those dynamic sampling left out too
            return (
                f"no policy update in {len(policy)} policy step(s) ({tied} of {drawn} sets tied or untrusted): "
                "nothing to roll out"
            )
        final = self.latest_step()
        if final is not None and weights_sha256(final / "policy" / "model") == self.parent.weights_sha256:
            return "the trained weights equal the parent's (same sha256): nothing to roll out"
        return None

    def evaluate(self) -> Evaluation:
        """The guards' evidence (`evaluate_candidate`), gathered once: a round resumed after its evaluation
        reads it back from eval.json."""
        path = self.dir / EVAL
        if path.is_file():
            return read_record(path, Evaluation)
        final = self.latest_step()
        m = self.loaded()
        evaluation = evaluate_candidate(
            self.settings,
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
        write_record(path, evaluation)
        return evaluation

    def finish_unregistered(self, why: str, started: float) -> RoundSummary:
        """A round that registers nothing (`unchanged`): the next round builds on the same parent. The
        generator's step, if any, is kept as in an accepted round: it changed no served weights."""
        self.keep_generator()
        guard = Guard(accepted=False, reason="no_update", detail=why)
        return self.publish(self.summary(None, "unregistered", guard, {}, None, started))

    def finish(self, evaluation: Evaluation, started: float) -> RoundSummary:
        """The guards' verdict on the evidence; the candidate registered (candidate or rejected) with its metrics."""
        t0 = time.perf_counter()
        verdict, metrics = round_verdict(
            self.cfg,
            self.history,
            evaluation,
            self.settings.evaluation.guard,
            self.settings.evaluation.min_decided_prompts,
            self.settings.evaluation.confidence,
        )
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
        guard = Guard(accepted=verdict.accepted, reason=verdict.reason, detail=verdict.detail)
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
        guard: Guard,
        metrics: dict[str, Any],
        evaluation: Evaluation | None,
        started: float,
    ) -> RoundSummary:
        collapse = self.collapse_fired or any(isinstance(h, PolicyStep) and h.collapse for h in self.history)
        return RoundSummary(
            round=self.id,
            parent=self.parent.version,
            version=version,
            state=state,
            guard=guard,
            metrics=metrics,
            eval=evaluation,
            steps=self.history,
            phases={p: sum(h.phase == p for h in self.history) for p in ("policy", "generator")},
            refresh=self.plan["refresh"],
            collapse=Collapse(
                fired=collapse,
                note=None
                if not collapse
                else (
                    "collapse detected: the next round starts with a generator phase"
                    if self.cfg.coevolve.enabled
                    else "collapse detected; co-evolution is disabled, so no generator phase follows"
                ),
            ),
            prompts=len(self.prompts),
            prompts_needed=self.plan.get("new_prompts_needed"),
            watermark_before=self.plan["watermark_before"],
            watermark_after=self.plan["watermark_after"],
            seconds=time.perf_counter() - started,
            stage_seconds=self.stage_seconds(),
        )

    def publish(self, summary: RoundSummary) -> RoundSummary:
        """The round's summary, written last: from here on the round is complete and never runs again."""
        write_json(self.state.run_dir / COLLAPSE, self.loaded().collapse.state())
        final = self.latest_step()
        if summary.state == CheckpointState.candidate.value and final is not None:
            self.state.keep_optimizer(self.id, final, self.parent)  # before the steps go: the next round may carry it
        write_record(self.dir / SUMMARY, summary)
        self.state.runlog.append([round_line(summary)])
        shutil.rmtree(self.steps_dir, ignore_errors=True)  # the weights now live in the registry (or nowhere)
        return summary

    def stage_seconds(self) -> dict[str, float]:
        """Where the round's time went, in the order it is spent. The steps' stages cover all the round's
        steps (a resumed round's earlier ones too); setup (models, engines, actors), checkpoints (each
        step published: weights saved, engines reloaded), the held-out evaluation and the guard
        (verdict, registration) are this run's."""

        def steps(phase: str, stage: str) -> float:
            return sum((h.stage_seconds.get(stage, 0.0) for h in self.history if h.phase == phase), 0.0)

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


# ==================================================================== the round's models and judges
class RoundModels:
    """The trainers, engines and judges of one round, built by `executor` from step dir `latest`
    (None: the parent, and the AdamW state `optimizer` or a fresh one). `reference`: the KL penalty's reference.
    `collapse` is the round's collapse detector: the judges' sets update it in order, whichever judge scored
    them."""

    def __init__(
        self,
        settings: Settings,
        executor: Any,
        parent: Checkpoint,
        reference: Checkpoint,
        generator_base: Path,
        latest: Path | None,
        metrics: EvaluatorMetrics | None,
        optimizer: Path | None = None,
    ):
        self.settings = settings
        self.single = settings.train.coevolve.single_model
        self.generator_base = generator_base
        self.metrics = metrics
        r = settings.rubric
        self.collapse = CollapseDetector(r.collapse_window, r.collapse_min_mean_gap, r.collapse_max_nonsplit_share)
        self.trainers = executor.trainers(
            TrainerSpec(settings, parent.path, reference.path, generator_base, latest, optimizer)
        )
        policy_dir = latest / "policy" / "model" if latest else parent.path
        self.policy_engine = executor.engine("policy", policy_dir)
        self.generator_engine = self.policy_engine
        writer_dir = policy_dir
        if not self.single:
            writer_dir = latest / "generator" / "model" if latest else generator_base
            self.generator_engine = executor.engine("generator", writer_dir)
        verifier_dir = modelcache.resolve(settings.paths.resolved_home(), settings.models.verifier)
        self.verifier_engine = executor.engine("verifier", verifier_dir)
        # the generator step's judge (its verdicts, the calibration answers' scores); the step's sets go to the judges
        self.evaluator = Evaluator(self.generator_engine, self.verifier_engine, settings.rubric, metrics=None)
        self.judges = executor.judges(
            self.generator_engine,
            self.verifier_engine,
            "policy" if self.single else "generator",
            writer_dir,
            verifier_dir,
        )

    def score(
        self, chunks: Sequence[ScoreChunk], progress: Progress
    ) -> tuple[list[ScoredSet], GenerationCounts, dict[str, float]]:
        """Judge a step's chunks of sets (each under its own seed block), then update the collapse detector and
        the metrics with them in order. Also returns the wall time split into rubric generation and
        verification (`judge_stages`)."""
        start = time.perf_counter()
        results = self.judges.score(chunks, partial(progress.advance, "score sets"))
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

    def save(self, directory: Path, previous: Path | None = None) -> None:
        self.trainers.save(directory, previous)

    def load_published(self, step_dir: Path, version: str, step: int) -> None:
        """Point the engines (and the judges' rubric writers) at a published step's weights. Engines that take
        turns on one server reload at their next call (`use_weights`): reloading both here, each was loaded twice
        a step."""
        self.policy_engine.use_weights(step_dir / "policy" / "model", f"{version}-s{step}")
        if not self.single:
            self.generator_engine.use_weights(step_dir / "generator" / "model", f"{version}-gen-s{step}")
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


# ==================================================================== a policy step's draws
JUDGING_SEEDS_PER_DRAW = 1000  # judging chunk j of draw d has seed index 1000 d + j (train.judge_chunks < 1000)


@dataclass(frozen=True)
class DrawnSets:
    """One draw of a policy step: its prompts, their rendered texts, K completions each, the scored sets, the
    rubric ladder's counts and the seconds of its stages (candidates, rubrics, verdicts)."""

    prompts: list[TrainPrompt]
    texts: list[str]
    outs: list[list[Completion]]
    scored: list[ScoredSet]
    counts: GenerationCounts
    seconds: dict[str, float]


def sets_budget(cfg: TrainConfig) -> int:
    """The candidate sets one policy step may draw: `ceil(dynamic_sampling.oversample x prompts_per_step)`
    (`prompts_per_step` when dynamic sampling is off)."""
    return math.ceil(cfg.dynamic_sampling.oversample * cfg.prompts_per_step - 1e-9)  # 1.0 x 8 is 8, not 9


def next_draw_size(target: int, kept: int, drawn: int, budget: int) -> int:
    """How many sets a policy step under dynamic sampling draws next: none once `target` sets with a spread are
    kept or `budget` sets are drawn; else the sets still missing over the share kept so far,
    `ceil((target - kept) x drawn / kept)`, at most the budget left; with none kept yet (the share is unknown),
    `target` sets. Drawing what is expected to fill the batch, in one batch, costs fewer sets than another full
    draw and fewer engine round trips than one set at a time."""
    missing, left = target - kept, budget - drawn
    if missing <= 0 or left <= 0:
        return 0
    if kept == 0:
        return min(target, left)
    return min(left, math.ceil(missing * drawn / kept))


# ==================================================================== the candidate's evaluation
def sample_sets(
    settings: Settings, engine: Engine, prompts: Sequence[TrainPrompt], k: int, seed: int
) -> tuple[list[str], list[list[Completion]]]:
    """(rendered prompts, K completions each) at the training sampling parameters."""
    cfg = settings.train
    texts = [engine.render_chat(p.chat()) for p in prompts]
    # one seed for the whole batch: requests with equal params are generated together
    # with the engine's own log-probs of each token: the trainer's importance weight (train.grpo.tis)
    params = SamplingParams(
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        n=k,
        seed=seed,
        logprobs=cfg.grpo.tis,
    )
    return texts, engine.generate([GenerationRequest(t, params) for t in texts])


def load_frozen(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def evaluate_candidate(
    settings: Settings,
    *,
    candidate_dir: Path,
    candidate_version: str,
    candidate_model: Any | None,
    parent: Checkpoint,
    base: Checkpoint,
    heldout: Sequence[TrainPrompt],
    policy_engine: Engine,
    generator_engine: Engine | None,
    previous_generator: Path | None,
    verifier_engine: Engine,
    pad_id: int,
    seed: int,
) -> Evaluation:
    """The guards' inputs for `candidate_dir` vs `parent`. `generator_engine` None: single-model mode
    (the policy engine at the parent's weights writes the rubrics). `candidate_model`: the candidate's
    torch model when the caller holds it (else loaded from `candidate_dir`). Leaves the policy engine
    at the weights of the last version it sampled."""
    from dynrubric.train.coevolve import completion_ids
    from dynrubric.train.grpo import SampledResponse, mean_kl

    k = settings.train.candidates
    policy_engine.load_weights(candidate_dir, candidate_version)
    texts, new = sample_sets(settings, policy_engine, heldout, k, seed)
    policy_engine.load_weights(parent.path, parent.version)
    _, old = sample_sets(settings, policy_engine, heldout, k, seed)
    if generator_engine is None:
        rubric_writer = policy_engine
    else:
        rubric_writer = generator_engine
        if previous_generator is not None:
            # named after the parent: the generator as the round that accepted the parent left it
            rubric_writer.load_weights(previous_generator, parent.version)
    judge = Evaluator(rubric_writer, verifier_engine, settings.rubric, metrics=None)
    judged_by = {"generator": rubric_writer.policy_version, "verifier": verifier_engine.policy_version}
    sets = [[c.text for c in o] + [c.text for c in n] for o, n in zip(old, new, strict=True)]
    scored = judge.score_sets([p.question for p in heldout], sets)

    tok = policy_engine.tokenizer
    rollouts = [
        SampledResponse(tuple(tok.encode(t, add_special_tokens=False)), completion_ids(c, tok))
        for t, cs in zip(texts, new, strict=True)
        for c in cs
    ]
    model = candidate_model if candidate_model is not None else load_frozen(candidate_dir)
    parent_model = load_frozen(parent.path)

    def kl_to(reference: Any) -> float:
        return mean_kl(
            model,
            reference,
            rollouts,
            settings.train.temperature,
            pad_id,
            settings.train.grpo.micro_batch_size,
            settings.train.grpo.logprob_chunk_mib,
        )

    kl_parent = kl_to(parent_model)
    if base.version == parent.version:
        kl_base = kl_parent
    else:
        del parent_model
        kl_base = kl_to(load_frozen(base.path))
    from dynrubric.train.policy_eval import round_evidence

    groundtruth = round_evidence(
        settings,
        policy_engine,
        (candidate_version, candidate_dir),
        (parent.version, parent.path),
        (base.version, base.path),
    )
    return Evaluation(
        groundtruth=groundtruth,
        heldout_prompts=len(heldout),
        heldout_keys=[p.key for p in heldout],
        reward_parent=sum(sum(s.scores[:k]) / k for s in scored) / len(scored),
        reward_new=sum(sum(s.scores[k:]) / k for s in scored) / len(scored),
        kl_to_parent=kl_parent,
        kl_to_base=kl_base,
        base=base.version,
        judge=judged_by,
        mean_gap=sum(s.gaps.mean_abs_gap for s in scored) / len(scored),
    )


# ==================================================================== the guards' verdict
def check_guards(
    cfg: TrainConfig,
    evaluation: Evaluation,
    nonfinite_steps: list[int],
    truth_guard: bool,
    min_decided_prompts: int = guards.DEFAULT_MIN_DECIDED_PROMPTS,
    confidence: float = guards.DEFAULT_CONFIDENCE,
) -> guards.GuardVerdict:
    """The guards (train/guards.py) on a candidate's evidence, at the bounds of `cfg`. `truth_guard`: whether
    the dev split's ground truth decides first (in total, and per kind of at least `min_decided_prompts` prompts,
    at `confidence`); the reported test figures are never read."""
    truth = evaluation.groundtruth if truth_guard else None
    return guards.check(
        nonfinite_steps=nonfinite_steps,
        kl=evaluation.kl_to_parent,
        max_kl=cfg.max_kl,
        kl_to_base=evaluation.kl_to_base,
        max_kl_to_base=cfg.max_kl_to_base,
        reward_parent=evaluation.reward_parent,
        reward_new=evaluation.reward_new,
        max_reward_drop=cfg.max_reward_drop,
        groundtruth_vs_parent=truth.vs_parent.model_dump() if truth else None,
        groundtruth_by_kind={k: c.model_dump() for k, c in truth.vs_parent_by_kind.items()} if truth else None,
        min_decided_prompts=min_decided_prompts,
        confidence=confidence,
    )


def round_verdict(
    cfg: TrainConfig,
    history: Sequence[PolicyStep | GeneratorStep],
    evaluation: Evaluation,
    truth_guard: bool = True,
    min_decided_prompts: int = guards.DEFAULT_MIN_DECIDED_PROMPTS,
    confidence: float = guards.DEFAULT_CONFIDENCE,
) -> tuple[guards.GuardVerdict, dict[str, Any]]:
    """(the guards' verdict, the checkpoint's metrics) of a round with steps `history`. `truth_guard`:
    whether the dev split's ground truth decides first (`evaluation.guard`); `min_decided_prompts`: the fewest
    dev prompts, in total or of a kind, that decide (`evaluation.min_decided_prompts`); `confidence`: the level it
    decides at (`evaluation.confidence`)."""
    policy_steps = [h for h in history if isinstance(h, PolicyStep)]
    truth = evaluation.groundtruth
    nonfinite = [h.step for h in history if h.nonfinite]
    verdict = check_guards(cfg, evaluation, nonfinite, truth_guard, min_decided_prompts, confidence)

    def mean(values: Sequence[float]) -> float | None:
        return sum(values) / len(values) if values else None

    metrics: dict[str, Any] = {
        "reward_mean": mean([h.reward_mean for h in policy_steps]),
        "heldout_reward": evaluation.reward_new,
        "heldout_reward_parent": evaluation.reward_parent,
        "kl": evaluation.kl_to_parent,
        "kl_to_base": evaluation.kl_to_base,
        GUARDED: "accepted" if verdict.accepted else verdict.reason,
        "mean_gap": mean([h.mean_gap for h in policy_steps]),
        "tie_rate": mean([h.tie_rate for h in policy_steps]),
        "no_gradient_sets": sum(h.no_gradient_sets for h in history),
        "updates": sum(1 for h in history if h.updated),
    }
    if truth:  # the ground truth of the held-out prompts: what the run page's learning curve plots
        metrics |= {
            "heldout_pass": truth.pass_rate[truth.version],
            "heldout_pass_by_kind": truth.pass_rate_by_kind[truth.version],
            "heldout_vs_parent": truth.vs_parent.model_dump(),
            "heldout_vs_parent_by_kind": {k: c.model_dump() for k, c in truth.vs_parent_by_kind.items()},
            "heldout_vs_base": truth.vs_base.model_dump(),
            "heldout_truth_prompts": truth.prompts,
            # the five reported figures (test split, IFEval, IFBench, open quality): shown, never decided on
            "figures": {name: f.model_dump() for name, f in truth.figures.items()},
        }
    return verdict, metrics
