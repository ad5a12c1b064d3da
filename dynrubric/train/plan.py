"""Plan and state of the training run: which round is next, what it builds on, what it trains on.

A round is a fixed plan of steps, written before the first step (`plan.json`: parent version, the
prompts taken since the last watermark, the held-out prompts, policy/generator phase of each step).
`RunState` reads and writes the run-level state under `train.run_dir` (default `<state_dir>/train`):

    rounds/NNNN/plan.json  steps/NNNN/...  eval.json  summary.json
    runlog.jsonl     one record per step and per round (deduplicated by key on resume)
    rollouts.jsonl   responses sampled per prompt and policy version (temporal-contrast anchors)
    collapse.json    the collapse detector's window of sets, carried from round to round
    generator/       the generator's weights between rounds (two-model mode)

A round builds on the last ACCEPTED version (promoted, or a candidate that passed the guards), its KL
penalty pulls toward the base of the lineage. Held-out prompts are split off by prompt key and never
trained on.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.errors import DynrubricError
from dynrubric.registry import Checkpoint, CheckpointState, Registry
from dynrubric.train.prompts import PromptSource, ResponseHistory, TrainPrompt, read_prompt_file

PLAN, SUMMARY, EVAL, COLLAPSE = "plan.json", "summary.json", "eval.json", "collapse.json"
GUARDED = "guard"  # metrics key: "accepted" on a candidate whose round passed the guards


def is_accepted(ckpt: Checkpoint) -> bool:
    if ckpt.state in (CheckpointState.canary, CheckpointState.stable):
        return True
    return ckpt.state == CheckpointState.candidate and ckpt.metrics.get(GUARDED) == "accepted"


def heldout_bucket(key: str) -> float:
    """Where a prompt key falls in [0, 1): prompts below `train.heldout_share` are held out, never trained."""
    return int(key[:8], 16) / 16**8


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


class RunLogWriter:
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
        self.runlog = RunLogWriter(self.run_dir / "runlog.jsonl")
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

    def last_summary(self) -> dict[str, Any] | None:
        done = self.completed_rounds()
        return read_json(self.round_dir(done[-1]) / SUMMARY) if done else None

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

    def make_plan(self, round_id: int) -> dict[str, Any]:
        path = self.round_dir(round_id) / PLAN
        if path.is_file():
            plan: dict[str, Any] = read_json(path)
            return plan
        parent = self.head()
        last = self.last_summary()
        watermark = last["watermark_after"] if last else None
        prompts, watermark_after = self.prompt_source().new_prompts(watermark, self.cfg.max_prompts_per_round)
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
