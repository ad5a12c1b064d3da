"""One training round, resumable: prompts -> candidate sets -> rubric scores -> GRPO -> guards -> registry.

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
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.engines.base import Engine
from dynrubric.errors import DynrubricError
from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics
from dynrubric.rubric.generate import RUBRIC_SCHEMA_JSON
from dynrubric.registry import Checkpoint, CheckpointState, Registry
from dynrubric.train import guards
from dynrubric.train.coevolve import (
    completion_ids,
    generator_groups,
    lineage_ages,
    read_anchor_file,
    temporal_anchors,
)
from dynrubric.train.prompts import PromptSource, RolloutHistory, TrainPrompt, read_prompt_file

PLAN, SUMMARY, EVAL, COLLAPSE = "plan.json", "summary.json", "eval.json", "collapse.json"
GUARDED = "guard"  # metrics key: "accepted" on a candidate whose round passed the guards


def is_accepted(ckpt: Checkpoint) -> bool:
    if ckpt.state in (CheckpointState.canary, CheckpointState.stable):
        return True
    return ckpt.state == CheckpointState.candidate and ckpt.metrics.get(GUARDED) == "accepted"


def heldout_bucket(key: str) -> float:
    """Where a prompt key falls in [0, 1): prompts below `train.heldout_share` are held out, never trained."""
    return int(key[:8], 16) / 16**8

#: builds an engine for a role ("policy", "generator", "verifier") over a model dir
EngineFactory = Callable[[str, Path], Engine]


def run_dir_of(settings: Settings) -> Path:
    return settings.train_run_dir()


def check_frozen_judges(settings: Settings) -> None:
    """Over HTTP each role's engine is a server; publishing a step reloads the policy's (and, with two
    models, the generator's) weights. A judge on a reloaded server would judge with the weights being
    trained, so such a config is refused before anything runs, naming both keys."""
    engine = settings.engine
    if engine.kind != "openai-http":
        return  # in-process engines: every role holds its own weights
    reloaded = ["policy"] if settings.train.coevolve.single_model else ["policy", "generator"]
    judges = ["verifier"] if settings.train.coevolve.single_model else ["verifier", "generator"]
    for judge in judges:
        for trained in reloaded:
            if judge != trained and engine.url_for(judge) == engine.url_for(trained):
                raise DynrubricError(
                    f"{engine.url_key(judge)} and {engine.url_key(trained)} both point at {engine.url_for(judge)}: "
                    f"each training step reloads the {trained}'s weights there, so the {judge} would not be frozen",
                    f"give the {judge} its own server: set engine.{judge}_url (and engine.{trained}_url)",
                )


def rollout_history(settings: Settings) -> RolloutHistory:
    """The trainer's own log of sampled responses (the JSONL prompt source's temporal-contrast anchors)."""
    return RolloutHistory(run_dir_of(settings) / "rollouts.jsonl")


class TrainMetrics:
    """The trainer's rows of monitoring/README.md, on the caller's registry."""

    def __init__(self, registry: CollectorRegistry):
        self.rounds = Counter("dynrubric_train_rounds", "training rounds finished", ["outcome"], registry=registry)
        self.guard_rejections = Counter(
            "dynrubric_train_guard_rejections", "checkpoints rejected by a guard", ["reason"], registry=registry
        )
        self.reward_mean = Gauge("dynrubric_train_reward_mean", "mean set-conditioned reward of the last step",
                                 registry=registry)
        self.kl = Gauge("dynrubric_train_kl", "KL to the reference policy of the last step", registry=registry)
        self.tied_sets = Counter("dynrubric_train_tied_sets", "sets whose scores were all tied (no gradient)",
                                 registry=registry)
        for outcome in ("completed", "failed"):
            self.rounds.labels(outcome=outcome)
        for reason in ("kl", "kl_to_base", "reward_drop", "nonfinite"):
            self.guard_rejections.labels(reason=reason)


def _read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def _write_json(path: Path, data: Any) -> None:
    atomic.write_text(path, json.dumps(data, indent=2, allow_nan=False, default=float))


class RunLog:
    """Append-only JSONL of step and round records; `append` skips keys already present, so a
    resumed round never logs a step twice."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def keys(self) -> set[str]:
        if not self.path.exists():
            return set()
        out = set()
        for line in self.path.read_text().splitlines():
            try:
                out.add(json.loads(line)["key"])
            except (json.JSONDecodeError, KeyError):  # a torn last line after a crash
                continue
        return out

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        import os

        known = self.keys()
        new = [r for r in records if r["key"] not in known]
        if not new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for r in new:
                f.write(json.dumps(r, allow_nan=False, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


@dataclass
class Progress:
    """What a round reports as it goes (the CLI draws rich bars from it; tests pass nothing)."""

    start: Callable[[str, int], None] = lambda phase, total: None
    advance: Callable[[str, int], None] = lambda phase, n: None


class RoundRunner:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        source: PromptSource,
        engines: EngineFactory,
        metrics: CollectorRegistry | None = None,
        progress: Progress | None = None,
        heldout: Sequence[TrainPrompt] | None = None,
    ):
        check_frozen_judges(settings)
        self.settings = settings
        self.cfg = settings.train
        self.registry = registry
        self.source = source
        self.engines = engines
        self.metrics_registry = metrics or CollectorRegistry()
        self.metrics = TrainMetrics(self.metrics_registry)
        self.progress = progress or Progress()
        self.heldout_override = list(heldout) if heldout is not None else None
        self.run_dir = run_dir_of(settings)
        self.runlog = RunLog(self.run_dir / "runlog.jsonl")
        self.rollouts = rollout_history(settings)
        self.evaluator_metrics = EvaluatorMetrics(self.metrics_registry)

    # ------------------------------------------------------------ run-level state
    def round_dir(self, round_id: int) -> Path:
        return self.run_dir / "rounds" / f"{round_id:04d}"

    def completed_rounds(self) -> list[int]:
        rounds = self.run_dir / "rounds"
        if not rounds.is_dir():
            return []
        return sorted(int(d.name) for d in rounds.iterdir() if d.name.isdigit() and (d / SUMMARY).is_file())

    def last_summary(self) -> dict[str, Any] | None:
        done = self.completed_rounds()
        return _read_json(self.round_dir(done[-1]) / SUMMARY) if done else None

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

    # ------------------------------------------------------------ plan
    def schedule(self, round_id: int, steps: int, refresh: bool) -> list[str]:
        co = self.cfg.coevolve
        if not co.enabled:
            return ["policy"] * steps
        offset = (round_id - 1) * steps
        phases = ["policy" if ((offset + s) // co.k_alt) % 2 == 0 else "generator" for s in range(steps)]
        if refresh:  # collapse-triggered: a generator phase first, then the usual alternation
            first = min(co.k_alt, steps)
            phases = ["generator"] * first + ["policy" if (s // co.k_alt) % 2 == 0 else "generator"
                                              for s in range(steps - first)]
        return phases

    def make_plan(self, round_id: int) -> dict[str, Any]:
        path = self.round_dir(round_id) / PLAN
        if path.is_file():
            return _read_json(path)
        parent = self.head()
        last = self.last_summary()
        watermark = last["watermark_after"] if last else None
        prompts, watermark_after = self.source.new_prompts(watermark, self.cfg.max_prompts_per_round)
        if not prompts:
            raise DynrubricError(
                f"no new prompts since watermark {watermark!r} for round {round_id}",
                "add prompts to the replay store / prompt file, then run the round again",
            )
        prompts, heldout = self.split_heldout(prompts)
        if not prompts:
            raise DynrubricError(
                f"round {round_id}: every new prompt is held out, none is left to train on",
                "add prompts, or set train.heldout_file to a separate held-out set",
            )
        refresh = None
        if last and last.get("collapse", {}).get("fired") and self.cfg.coevolve.enabled:
            refresh = f"collapse detected in round {last['round']}: starting with a generator phase"
        plan = {
            "round": round_id,
            "parent": parent.version,
            "version": f"{self.cfg.version_prefix}{round_id}",
            "prompts": [{"key": p.key, "messages": p.messages} for p in prompts],
            "heldout": [{"key": p.key, "messages": p.messages} for p in heldout],
            "watermark_before": watermark,
            "watermark_after": watermark_after,
            "schedule": self.schedule(round_id, self.cfg.steps_per_round, refresh is not None),
            "refresh": refresh,
            "started_at": time.time(),
        }
        _write_json(path, plan)
        return plan

    def split_heldout(self, prompts: list[TrainPrompt]) -> tuple[list[TrainPrompt], list[TrainPrompt]]:
        """(training prompts, held-out prompts), disjoint. The held-out set is `train.heldout_file`, or
        the prompts whose key falls under `train.heldout_share` (a deterministic split by prompt key),
        gathered across rounds: the last round's held-out set, then this round's held-out prompts. With
        none yet, the new prompt lowest in that order is held out. Held-out prompts are never trained."""
        n = self.cfg.heldout_prompts
        if self.heldout_override is not None or self.cfg.heldout_file:
            held = self.heldout_override if self.heldout_override is not None else read_prompt_file(self.cfg.heldout_file)
        else:
            plans = [self.round_dir(r) / PLAN for r in self.completed_rounds() if (self.round_dir(r) / PLAN).is_file()]
            held = _prompts_of(_read_json(plans[-1])["heldout"]) if plans else []
            held += [p for p in prompts if heldout_bucket(p.key) < self.cfg.heldout_share]
            if not held and prompts:
                held = [min(prompts, key=lambda p: heldout_bucket(p.key))]
        keys = {p.key for p in held}
        unique = list({p.key: p for p in held}.values())
        return [p for p in prompts if p.key not in keys], unique[:n]

    # ------------------------------------------------------------ the round
    def run(self, round_id: int | None = None) -> dict[str, Any]:
        round_id = self.next_round() if round_id is None else round_id
        done = self.round_dir(round_id) / SUMMARY
        if done.is_file():
            return _read_json(done)
        try:
            summary = _Round(self, round_id).run()
        except Exception:
            self.metrics.rounds.labels(outcome="failed").inc()
            raise
        self.metrics.rounds.labels(outcome="completed").inc()
        return summary


def _prompts_of(records: Sequence[dict[str, Any]]) -> list[TrainPrompt]:
    return [TrainPrompt(key=r["key"], messages=tuple((m[0], m[1]) for m in r["messages"])) for r in records]


class _Round:
    """The state of one round while it runs (engines, trainers, evaluator)."""

    def __init__(self, runner: RoundRunner, round_id: int):
        self.r = runner
        self.cfg = runner.cfg
        self.id = round_id
        self.dir = runner.round_dir(round_id)
        self.steps_dir = self.dir / "steps"

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        from dynrubric.train.grpo import GRPOTrainer, load_policy, load_reference

        self.plan = self.r.make_plan(self.id)
        self.prompts = _prompts_of(self.plan["prompts"])
        self.heldout = _prompts_of(self.plan["heldout"])
        self.parent = self.r.registry.get(self.plan["parent"])
        self.version = self.plan["version"]
        self.single = self.cfg.coevolve.single_model
        latest = self.latest_step()
        self.history: list[dict[str, Any]] = _read_json(latest / "history.json") if latest else []

        gcfg = self.cfg.grpo
        policy_dir = latest / "policy" if latest else None
        adapter = policy_dir / "adapter" if policy_dir and gcfg.lora_rank > 0 else None
        model = load_policy(
            policy_dir / "model" if policy_dir and adapter is None else self.parent.path, gcfg, adapter
        )
        self.tokenizer = self.load_tokenizer(self.parent.path)
        tie_eps = self.r.settings.rubric.eps
        # the KL penalty pulls toward the base of the lineage, not the parent, so that it bounds the drift
        # the rounds add up (with LoRA the reference is the adapter-free parent; the guard still bounds it)
        self.policy = GRPOTrainer(model, load_reference(self.r.base_of(self.parent).path, gcfg), gcfg,
                                  self.pad_id(self.tokenizer), tie_eps)
        if policy_dir:
            self.policy.load_optimizer(policy_dir / "optimizer.pt")
        self.policy_engine = self.r.engines("policy", policy_dir / "model" if policy_dir else self.parent.path)

        self.generator = self.policy
        self.generator_engine = self.policy_engine
        if not self.single:
            gen_base = self.generator_base()
            gen_dir = latest / "generator" if latest else None
            gen_cfg = gcfg.model_copy(update={"lr": self.cfg.coevolve.generator_lr or gcfg.lr})
            gadapter = gen_dir / "adapter" if gen_dir and gcfg.lora_rank > 0 else None
            gmodel = load_policy(gen_dir / "model" if gen_dir and gadapter is None else gen_base, gen_cfg, gadapter)
            self.gen_tokenizer = self.load_tokenizer(gen_base)
            self.generator = GRPOTrainer(gmodel, load_reference(gen_base, gen_cfg), gen_cfg,
                                         self.pad_id(self.gen_tokenizer), tie_eps)
            if gen_dir:
                self.generator.load_optimizer(gen_dir / "optimizer.pt")
            self.generator_engine = self.r.engines("generator", gen_dir / "model" if gen_dir else gen_base)
        from dynrubric import modelcache

        verifier_dir = modelcache.resolve(self.r.settings.paths.resolved_home(), self.r.settings.models.verifier)
        self.verifier_engine = self.r.engines("verifier", verifier_dir)
        self.evaluator = Evaluator(
            self.generator_engine, self.verifier_engine, self.r.settings.rubric, self.r.evaluator_metrics
        )
        # the collapse window spans rounds: continue from this round's last step, else the last round
        window = latest / COLLAPSE if latest and (latest / COLLAPSE).is_file() else self.r.run_dir / COLLAPSE
        if window.is_file():
            self.evaluator.collapse.restore(_read_json(window))
        self.anchor_file = (
            read_anchor_file(self.cfg.coevolve.anchors_file)
            if self.cfg.coevolve.anchors == "file" and self.cfg.coevolve.anchors_file
            else None
        )
        if self.cfg.coevolve.anchors == "file" and self.anchor_file is None:
            raise DynrubricError("train.coevolve.anchors is 'file' but anchors_file is not set",
                                 "set train.coevolve.anchors_file to a JSONL of ranked responses")

    def generator_base(self) -> Path:
        return self.r.generator_dir()

    @staticmethod
    def load_tokenizer(model_dir: Path) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    @staticmethod
    def pad_id(tok: Any) -> int:
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def latest_step(self) -> Path | None:
        if not self.steps_dir.is_dir():
            return None
        done = sorted(d for d in self.steps_dir.iterdir() if d.name.isdigit())
        return done[-1] if done else None

    def close(self) -> None:
        for name in ("policy_engine", "generator_engine", "verifier_engine"):
            engine = getattr(self, name, None)
            if engine is not None:
                engine.close()

    # ---------------------------------------------------------------- steps
    def seed(self, step: int, i: int = 0) -> int:
        return (self.cfg.seed * 1_000_003 + self.id * 10_007 + step * 101 + i) % (2**31)

    def batch(self, step: int, n: int) -> list[TrainPrompt]:
        start = step * n
        return [self.prompts[(start + i) % len(self.prompts)] for i in range(n)]

    def sample_sets(self, engine: Engine, prompts: Sequence[TrainPrompt], k: int, seed: int):
        from dynrubric.train.heldout import sample_sets

        return sample_sets(self.r.settings, engine, prompts, k, seed)

    def policy_step(self, step: int) -> dict[str, Any]:
        from dynrubric.train.grpo import Group, Rollout

        prompts = self.batch(step, self.cfg.prompts_per_step)
        tok = self.policy_engine.tokenizer
        texts, outs = self.sample_sets(self.policy_engine, prompts, self.cfg.candidates, self.seed(step))
        responses = [[c.text for c in cs] for cs in outs]
        counts_before = dict(self.evaluator.counts.__dict__)
        scored = self.evaluator.score_sets([p.question for p in prompts], responses,
                                           progress=lambda n: self.r.progress.advance("score sets", n))
        self.collapse_fired = self.collapse_fired or self.evaluator.collapse.collapsed
        groups = []
        for text, cs, sc in zip(texts, outs, scored, strict=True):
            prompt_ids = tuple(tok.encode(text, add_special_tokens=False))
            # an untrusted set (a known-bad anchor outranks a candidate) teaches nothing: zero advantage
            untrusted = None if sc.trusted else tuple(0.0 for _ in cs)
            groups.append(Group(tuple(Rollout(prompt_ids, completion_ids(c, tok)) for c in cs), tuple(sc.scores),
                                advantages=untrusted, temperature=self.cfg.temperature))
        stats = self.policy.step(groups)
        self.r.rollouts.append([(p.key, self.parent.version, rs) for p, rs in zip(prompts, responses, strict=True)])
        n = len(scored)
        return {
            **stats.as_dict(),
            "mean_gap": sum(s.gaps.mean_abs_gap for s in scored) / n,
            "tie_rate": sum(s.gaps.tie_rate for s in scored) / n,
            "nonsplit_share": sum(s.gaps.nonsplit_share for s in scored) / n,
            "untrusted_sets": sum(not s.trusted for s in scored),
            "rubric_sources": {src: sum(s.rubric_source == src for s in scored) for src in ("set", "prompt_only", "generic")},
            "fallbacks": {
                "parse_failures": self.evaluator.counts.parse_failures - counts_before["parse_failures"],
                "prompt_only": self.evaluator.counts.prompt_only_fallbacks - counts_before["prompt_only_fallbacks"],
                "generic": self.evaluator.counts.generic_fallbacks - counts_before["generic_fallbacks"],
                "hard_verdict": sum(s.hard_verdict_fallbacks for s in scored),
            },
            "collapse": self.evaluator.collapse.collapsed,
            "updates": self.policy.updates,
        }

    def anchors_for(self, prompt: TrainPrompt, current: Sequence[str], rng: random.Random) -> list[str] | None:
        if self.anchor_file is not None:
            return self.anchor_file.get(prompt.key)
        co = self.cfg.coevolve
        lineage = {c.version: c.parent for c in self.r.registry.list()}
        # the policy being trained is one step past its parent: the parent's samples have age 1
        ages = {v: a + 1 for v, a in lineage_ages(lineage, self.parent.version).items()}
        return temporal_anchors(rng.choice(list(current)), self.r.source.responses_by_version(prompt.key), ages,
                                co.min_age, co.max_age, rng)

    def generator_step(self, step: int) -> dict[str, Any]:
        co = self.cfg.coevolve
        prompts = self.batch(step, co.sets_per_step)
        _, outs = self.sample_sets(self.policy_engine, prompts, self.cfg.candidates, self.seed(step))
        responses = [[c.text for c in cs] for cs in outs]
        rng = random.Random(self.seed(step, 7))
        anchors = [self.anchors_for(p, rs, rng) for p, rs in zip(prompts, responses, strict=True)]
        groups, gstats = generator_groups(
            self.generator_engine,
            self.evaluator.rubric_generator.set_prompt,
            # the verdicts the evaluator scores with: checks run, verifier de-biased by the anchors
            lambda q, rs, rubric: self.evaluator.judge(q, rubric, rs).verdicts,
            self.evaluator.apply_rubric,
            list(zip(prompts, responses, strict=True)),
            anchors,
            co,
            self.r.settings.rubric.max_items,
            self.r.settings.rubric.generator_temperature,
            self.r.settings.rubric.eps,
            self.seed(step, 13),
            RUBRIC_SCHEMA_JSON if self.r.settings.rubric.constrained else None,
        )
        stats = self.generator.step(groups)
        return {**stats.as_dict(), **{f"gen_{k}": v for k, v in gstats.as_dict().items()},
                "updates": self.generator.updates}

    def publish_step(self, step: int, record: dict[str, Any]) -> None:
        self.history.append(record)
        target = self.steps_dir / f"{step:04d}"
        with atomic.directory(target) as tmp:
            self.policy.save(tmp / "policy")
            self.tokenizer.save_pretrained(tmp / "policy" / "model")  # a checkpoint any engine can load
            if not self.single:
                self.generator.save(tmp / "generator")
                self.gen_tokenizer.save_pretrained(tmp / "generator" / "model")
            (tmp / "history.json").write_text(json.dumps(self.history, allow_nan=False, default=float))
            (tmp / COLLAPSE).write_text(json.dumps(self.evaluator.collapse.state()))
        for old in self.steps_dir.iterdir():
            if old.name.isdigit() and old.name < target.name:
                shutil.rmtree(old, ignore_errors=True)
        self.policy_engine.load_weights(target / "policy" / "model", f"{self.version}-s{step}")
        if not self.single:
            self.generator_engine.load_weights(target / "generator" / "model", f"{self.version}-gen-s{step}")

    def log_steps(self) -> None:
        self.r.runlog.append([{"key": f"round/{self.id}/step/{h['step']}", "kind": "step", "round": self.id, **h}
                              for h in self.history])

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, Any]:
        path = self.dir / EVAL
        if path.is_file():
            return _read_json(path)
        from dynrubric.train.heldout import evaluate_candidate

        final = self.latest_step()
        result = evaluate_candidate(
            self.r.settings,
            candidate_dir=final / "policy" / "model" if final else self.parent.path,
            candidate_version=self.version,
            candidate_model=self.policy.model,
            parent=self.parent,
            base=self.r.base_of(self.parent),
            heldout=self.heldout,
            policy_engine=self.policy_engine,
            generator_engine=None if self.single else self.generator_engine,
            previous_generator=None if self.single else self.generator_base(),
            verifier_engine=self.verifier_engine,
            pad_id=self.policy.pad_token_id,
            seed=self.seed(10_000),
        )
        _write_json(path, result)
        return result

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        started = time.time()
        self.collapse_fired = False
        try:
            self.setup()
            self.log_steps()
            schedule = self.plan["schedule"]
            first = len(self.history)
            self.r.progress.start(f"round {self.id}", len(schedule))
            self.r.progress.advance(f"round {self.id}", first)
            for step in range(first, len(schedule)):
                phase = schedule[step]
                if phase == "policy":
                    self.r.progress.start("score sets", self.cfg.prompts_per_step)
                record = self.policy_step(step) if phase == "policy" else self.generator_step(step)
                record = {"step": step, "phase": phase, "time": time.time(), **record}
                self.publish_step(step, record)
                self.log_steps()
                if phase == "policy":
                    self.r.metrics.reward_mean.set(record["reward_mean"])
                    self.r.metrics.kl.set(record["kl"])
                    self.r.metrics.tied_sets.inc(record["tied_sets"])
                self.r.progress.advance(f"round {self.id}", 1)
            self.r.progress.start("evaluate", 1)
            evaluation = self.evaluate()
            self.r.progress.advance("evaluate", 1)
            return self.finish(evaluation, started)
        finally:
            self.close()

    def finish(self, evaluation: dict[str, Any], started: float) -> dict[str, Any]:
        policy_steps = [h for h in self.history if h["phase"] == "policy"]
        verdict = guards.check(
            nonfinite_steps=[h["step"] for h in self.history if h["nonfinite"]],
            kl=evaluation["kl_to_parent"],
            max_kl=self.cfg.max_kl,
            kl_to_base=evaluation["kl_to_base"],
            max_kl_to_base=self.cfg.max_kl_to_base,
            reward_parent=evaluation["reward_parent"],
            reward_new=evaluation["reward_new"],
            max_reward_drop=self.cfg.max_reward_drop,
        )
        final = self.latest_step()
        collapse = self.collapse_fired or any(h.get("collapse") for h in self.history)
        metrics = {
            "reward_mean": (sum(h["reward_mean"] for h in policy_steps) / len(policy_steps)) if policy_steps else None,
            "heldout_reward": evaluation["reward_new"],
            "heldout_reward_parent": evaluation["reward_parent"],
            "kl": evaluation["kl_to_parent"],
            "kl_to_base": evaluation["kl_to_base"],
            GUARDED: "accepted" if verdict.accepted else verdict.reason,
            "mean_gap": (sum(h["mean_gap"] for h in policy_steps) / len(policy_steps)) if policy_steps else None,
            "tie_rate": (sum(h["tie_rate"] for h in policy_steps) / len(policy_steps)) if policy_steps else None,
            "tied_sets": sum(h["tied_sets"] for h in self.history),
            "updates": sum(1 for h in self.history if h["updated"]),
        }
        state = CheckpointState.candidate if verdict.accepted else CheckpointState.rejected
        ckpt = self.r.registry.register(
            final / "policy" / "model" if final else self.parent.path,
            parent=self.parent.version, round=self.id, metrics=metrics, version=self.version,
            state=state, reason=None if verdict.accepted else f"{verdict.reason}: {verdict.detail}",
        )
        if not verdict.accepted:
            self.r.metrics.guard_rejections.labels(reason=verdict.reason).inc()
        if not self.single and final is not None and verdict.accepted:
            gen_current = self.r.run_dir / "generator"
            shutil.rmtree(gen_current, ignore_errors=True)
            with atomic.directory(gen_current) as tmp:
                shutil.copytree(final / "generator", tmp, dirs_exist_ok=True)
        _write_json(self.r.run_dir / COLLAPSE, self.evaluator.collapse.state())
        summary = {
            "round": self.id,
            "parent": self.parent.version,
            "version": ckpt.version,
            "state": ckpt.state.value,
            "guard": {"accepted": verdict.accepted, "reason": verdict.reason, "detail": verdict.detail},
            "metrics": metrics,
            "eval": evaluation,
            "steps": self.history,
            "phases": {p: sum(h["phase"] == p for h in self.history) for p in ("policy", "generator")},
            "refresh": self.plan["refresh"],
            "collapse": {
                "fired": collapse,
                "note": None if not collapse else (
                    "collapse detected: the next round starts with a generator phase" if self.cfg.coevolve.enabled
                    else "collapse detected; co-evolution is disabled, so no generator phase follows"),
            },
            "prompts": len(self.prompts),
            "watermark_before": self.plan["watermark_before"],
            "watermark_after": self.plan["watermark_after"],
            "seconds": time.time() - started,
        }
        _write_json(self.dir / SUMMARY, summary)
        self.r.runlog.append([{"key": f"round/{self.id}", "kind": "round", **{k: v for k, v in summary.items()
                                                                             if k != "steps"}}])
        shutil.rmtree(self.steps_dir, ignore_errors=True)  # the weights now live in the registry
        return summary
