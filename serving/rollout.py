"""The rollout controller: a registry checkpoint -> canary -> traffic steps gated -> promoted or rolled back.

A rollout is a row in the `rollouts` table of the registry's database (SQLite or PostgreSQL, through
`Registry.transaction`) and moves through statuses; every action of a status is idempotent, so a
controller restarted at any point redoes the current status's actions and carries on (`resume`).
Rollouts an older version kept in `<state_dir>/rollout/rollouts.sqlite` are copied into the table
once by `open_rollout_store`, which then renames that file `rollouts.sqlite.migrated`.

    loading       load the version's weights on the canary replicas (all or none), mark it canary
    stepping      canary share = steps[step]; gate at every poll: pass -> next step (or promoting),
                  fail -> rolling_back, inconclusive -> hold (a step past max_step_s -> rolling_back, once
                  the judge's batch in hand is judged)
    promoting     all traffic to canary, load the version on stable replicas, canary share 0,
                  registry promote (the previous stable version becomes retired)
    rolling_back  canary share 0, canary replicas back to the baseline weights, registry rejected
                  with the gate's reason
    promoted | rolled_back | failed   final (failed: the version never took traffic)

The controller talks to the router's control endpoints (bearer token), reads online metrics from
the query-log and feedback topics (`OnlineMetrics`, tracking this rollout's experiment id), and the
router's counters for the experiment. With a `PairJudge`, a worker thread judges the shadow pairs the gate's
polls have read, `rollout.judge_pairs_per_poll` at a time, while the rollout runs (`judge_once`); each poll's
verdict is on the pairs judged so far. The judge never holds up a poll: an open pair's rubric takes seconds to
minutes on a busy CPU, and a poll that waited for it (as before 2026-12-04) left a failing canary's errors, the
step's time limit and the Argo metric endpoint waiting just as long. The judged win rate's bounds are valid at
any number of pairs (serving/gate.py), so reading them while the judge catches up decides nothing early. A step
past `max_step_s` while the judge holds a batch of its pairs waits for that batch (the judge takes no other), then
decides. A judge that fails leaves its pairs for its next batch; the pairs it holds are in the saved state until
judged. The judged win rate and its bounds are in the gate's checks and in `dynrubric_rollout_judge_*`.

At the start of each rollout the controller logs what its gate can detect (`serving.power`): the
smallest harm per metric it catches with 80 % power within a step, and when an equal canary would be
promoted, at the traffic the router measured; the plan is kept with the rollout (`plan`, the run page
shows it). Tables of older versions get the `plan` column on first use.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import SecretStr

from dynrubric import http_clients, sqlite
from dynrubric.config import GateConfig, RolloutConfig, Settings
from dynrubric.errors import DynrubricError
from dynrubric.registry import SCHEMA_LOCK, Checkpoint, CheckpointState, Registry, open_registry, weights_sha256
from serving.gate import GateResult, Verdict, evaluate, judge_interval
from serving.power import GatePlan, Population, Traffic, judged_pairs_per_s, plan

ACTIVE = ("loading", "stepping", "promoting", "rolling_back")
FINAL = ("promoted", "rolled_back", "failed")


@dataclass(frozen=True)
class Rollout:
    id: str
    version: str
    version_path: str
    baseline: str
    baseline_path: str
    steps: list[float]
    status: str
    step: int
    step_started_at: float
    started_at: float
    updated_at: float
    reason: str | None
    last_gate: dict[str, Any] | None
    plan: dict[str, Any] | None = None  # serving.power.GatePlan at the start, with its printed `lines`

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY, version TEXT NOT NULL, version_path TEXT NOT NULL, baseline TEXT NOT NULL,
    baseline_path TEXT NOT NULL, steps TEXT NOT NULL, status TEXT NOT NULL, step INTEGER NOT NULL,
    step_started_at DOUBLE PRECISION NOT NULL, started_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL, reason TEXT,
    last_gate TEXT, plan TEXT
)
"""
LEGACY_COLUMNS = (
    "id, version, version_path, baseline, baseline_path, steps, status, step, step_started_at, "
    "started_at, updated_at, reason, last_gate"
)
COLUMNS = LEGACY_COLUMNS + ", plan"


class RolloutStore:
    """The rollouts, in the registry's database (a rollout's version is a registry row)."""

    def __init__(self, registry: Registry):
        self.registry = registry
        with registry.transaction(write=True, lock=SCHEMA_LOCK) as cur:
            cur.execute(SCHEMA)
        self._add_plan_column()

    def _add_plan_column(self) -> None:
        """Tables of versions before the gate's power plan lack its column: add it."""
        with self._tx() as cur:
            cur.execute("SELECT * FROM rollouts WHERE 1 = 0")
            if "plan" not in {d[0] for d in cur.description}:
                cur.execute("ALTER TABLE rollouts ADD COLUMN plan TEXT")

    def _tx(self, write: bool = True) -> Any:
        return self.registry.transaction(write=write, lock="rollouts" if write else None)

    def migrate(self, legacy: Path) -> None:
        """Copy the rollouts of an older version's `rollouts.sqlite` into the table (ids already there are
        kept as they are)."""
        with sqlite.transaction(legacy, write=False) as old:
            old.execute(f"SELECT {LEGACY_COLUMNS} FROM rollouts")
            rows = old.fetchall()
        with self._tx() as cur:
            cur.execute("SELECT id FROM rollouts")
            known = {r[0] for r in cur.fetchall()}
            for row in rows:
                if row[0] not in known:
                    cur.execute(f"INSERT INTO rollouts ({LEGACY_COLUMNS}) VALUES ({','.join('?' * 13)})", tuple(row))

    @staticmethod
    def _row(row: tuple) -> Rollout:
        (
            rid,
            version,
            vpath,
            baseline,
            bpath,
            steps,
            status,
            step,
            step_started,
            started,
            updated,
            reason,
            gate,
            plan,
        ) = row
        return Rollout(
            rid,
            version,
            vpath,
            baseline,
            bpath,
            json.loads(steps),
            status,
            step,
            step_started,
            started,
            updated,
            reason,
            json.loads(gate) if gate else None,
            json.loads(plan) if plan else None,
        )

    def create(self, version: str, version_path: str, baseline: str, baseline_path: str, steps: list[float]) -> Rollout:
        now = time.time()
        rid = f"ro-{version}-{uuid.uuid4().hex[:8]}"
        with self._tx() as cur:
            cur.execute(f"SELECT id, version FROM rollouts WHERE status IN ({','.join('?' * len(ACTIVE))})", ACTIVE)
            active = cur.fetchone()
            if active:
                raise DynrubricError(
                    f"rollout {active[0]} of {active[1]} is still in progress",
                    "wait for it, or `dynrubric rollout resume` it if its controller stopped",
                )
            cur.execute(
                f"INSERT INTO rollouts ({COLUMNS}) VALUES ({','.join('?' * 14)})",
                (
                    rid,
                    version,
                    version_path,
                    baseline,
                    baseline_path,
                    json.dumps(steps),
                    "loading",
                    0,
                    now,
                    now,
                    now,
                    None,
                    None,
                    None,
                ),
            )
        return self.get(rid)

    def get(self, rollout_id: str) -> Rollout:
        with self._tx(write=False) as cur:
            cur.execute(f"SELECT {COLUMNS} FROM rollouts WHERE id = ?", (rollout_id,))
            row = cur.fetchone()
        if row is None:
            raise DynrubricError(f"no rollout {rollout_id!r}", "`dynrubric rollout status` lists the rollouts")
        return self._row(row)

    def list(self) -> list[Rollout]:
        with self._tx(write=False) as cur:
            cur.execute(f"SELECT {COLUMNS} FROM rollouts ORDER BY started_at")
            return [self._row(r) for r in cur.fetchall()]

    def active(self) -> Rollout | None:
        return next((r for r in self.list() if r.status in ACTIVE), None)

    def update(self, rollout_id: str, **fields: Any) -> Rollout:
        for name in ("last_gate", "plan"):
            if name in fields:
                fields[name] = json.dumps(fields[name])
        fields["updated_at"] = time.time()
        with self._tx() as cur:
            cur.execute(
                f"UPDATE rollouts SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                (*fields.values(), rollout_id),
            )
        return self.get(rollout_id)


def legacy_store_path(settings: Settings) -> Path:
    """Where versions before the move to the registry's database kept the rollouts."""
    return settings.paths.resolved_state() / "rollout" / "rollouts.sqlite"


def open_rollout_store(settings: Settings, registry: Registry | None = None) -> RolloutStore:
    """The rollouts table of the registry that `settings.registry` names, with the rollouts of a
    legacy `<state_dir>/rollout/rollouts.sqlite` migrated into it (that file then renamed `*.migrated`)."""
    store = RolloutStore(registry or open_registry(settings))
    legacy = legacy_store_path(settings)
    if legacy.is_file():
        store.migrate(legacy)
        try:
            legacy.rename(legacy.with_name(legacy.name + ".migrated"))
        except FileNotFoundError:  # another process migrated it at the same time: the ids are already in
            pass
    return store


class RouterClient:
    """The router's control and state endpoints."""

    def __init__(self, base_url: str, token: SecretStr | None, timeout_s: float = 600.0):
        headers = {"authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        self._http = http_clients.client(base_url=base_url, headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise DynrubricError(
                f"router at {self._http.base_url} unreachable: {e}", "start it with `dynrubric serve-router`"
            ) from e
        if r.status_code != 200:
            detail = (
                r.json().get("detail", r.text)
                if r.headers.get("content-type", "").startswith("application/json")
                else r.text
            )
            raise DynrubricError(
                f"router refused {method} {path}: HTTP {r.status_code}: {detail}", "check the router and engine logs"
            )
        return r.json()

    def state(self) -> dict[str, Any]:
        return self._call("GET", "/v1/router/state")

    def traffic(self, canary_weight: float, experiment: str) -> dict[str, Any]:
        return self._call("POST", "/control/traffic", json={"canary_weight": canary_weight, "experiment": experiment})

    def load(self, variant: str, version: str, path: str, best_effort: bool = False) -> dict[str, Any]:
        return self._call(
            "POST",
            f"/control/variants/{variant}/weights",
            json={"version": version, "path": path, "best_effort": best_effort},
        )

    def close(self) -> None:
        self._http.close()


def check_weights(ckpt: Checkpoint) -> None:
    """The checkpoint's directory exists and holds the weights the registry recorded."""
    if not ckpt.path.is_dir():
        raise DynrubricError(
            f"weights of {ckpt.version} are missing: {ckpt.path} does not exist", "register the checkpoint again"
        )
    sha = weights_sha256(ckpt.path)
    if sha != ckpt.weights_sha256:
        raise DynrubricError(
            f"weights of {ckpt.version} in {ckpt.path} changed since registration "
            f"(sha256 {sha[:12]} != {ckpt.weights_sha256[:12]})",
            "register the checkpoint again",
        )


class Controller:
    def __init__(
        self,
        registry: Registry,
        store: RolloutStore,
        router: RouterClient,
        online: Any,
        rollout_cfg: RolloutConfig,
        gate_cfg: GateConfig,
        metrics: CollectorRegistry | None = None,
        sleep: Callable[[float], None] = time.sleep,
        log: Callable[[str], None] = lambda _: None,
        judge: Any = None,
        progress: Callable[[str], None] | None = None,
        restarter: Any = None,
    ):
        """`log`: a line an operator reads, printed when a step's state changes (its verdict and the check that
        decided it), not at every poll. `progress`: the live status line (a terminal's spinner), told at every
        poll how long the state has held; None: the polls are counted and summed up when the state changes.
        `restarter`: a `serving.kube.DeploymentRestarter` (rollout.restart kubernetes) that restarts a variant's
        engines onto new weights before the router checks them; None: something else restarts them, or the
        router reloads them itself (serving.weights_via rpc)."""
        if "judged" in gate_cfg.promote_on and judge is None:
            raise DynrubricError(
                "gate.promote_on names judged, but the controller has no judge: no rollout could ever be promoted",
                "set rollout.judge: true (and serving.shadow_rate > 0), or drop judged from gate.promote_on",
            )
        self.registry = registry
        self.store = store
        self.router = router
        self.online = online
        self.judge = judge
        self.cfg = rollout_cfg
        self.gate_cfg = gate_cfg
        self.sleep = sleep
        self.log = log
        self.progress = progress
        self.restarter = restarter
        self._shown: tuple[str, int, str, str] | None = None  # last logged: rollout, step, verdict, check
        self._polls = 0  # polls of that state so far
        self._shown_at = 0.0
        self._last_line = ""
        m = metrics or CollectorRegistry()
        self.m_step = Gauge("dynrubric_rollout_step", "index of the current traffic step (-1 when idle)", registry=m)
        self.m_step_started = Gauge(
            "dynrubric_rollout_step_started_timestamp_seconds", "when the current step began", registry=m
        )
        self.m_verdicts = Counter("dynrubric_rollout_gate_verdicts_total", "gate evaluations", ["verdict"], registry=m)
        self.m_outcomes = Counter("dynrubric_rollout_outcomes_total", "finished rollouts", ["outcome"], registry=m)
        self.m_judge = Gauge(
            "dynrubric_rollout_judge_win_rate",
            "judged canary win rate over shadow pairs, with its always-valid bounds",
            ["bound"],
            registry=m,
        )
        self.m_judge_pairs = Gauge("dynrubric_rollout_judge_pairs", "shadow pairs the judge scored", registry=m)
        self.m_step.set(-1)
        self._online_lock = threading.Lock()
        self._judge_seconds = 0.0  # measured: the judge's time over the pairs it judged (judge_s_per_pair)
        self._judged_pairs = 0
        self._judge_failing: str | None = None  # the judge's last failure, until it answers again
        self._gate_judged = 0  # judged pairs the last gate evaluation read
        self._overtime: tuple[str, int] | None = None  # (rollout, step) past max_step_s: the judge takes no batch

    # ------------------------------------------------------------ start
    def start(self, version: str) -> Rollout:
        """Validate everything before anything changes, then record the rollout as `loading`."""
        ckpt = self.registry.get(version)
        if ckpt.state is not CheckpointState.candidate:
            raise DynrubricError(
                f"checkpoint {version} is {ckpt.state.value}; only a candidate can be rolled out",
                "register new weights as a new version",
            )
        check_weights(ckpt)
        baseline = self.registry.stable()
        if baseline is None:
            raise DynrubricError(
                "the registry has no stable version to compare the canary with",
                "promote one first: `dynrubric registry promote VERSION`",
            )
        check_weights(baseline)
        state = self.router.state()
        if not any(r["variant"] == "canary" and r["healthy"] for r in state["replicas"]):
            raise DynrubricError("the router has no healthy canary replica", "start the fleet with a canary engine")
        rollout = self.store.create(version, str(ckpt.path), baseline.version, str(baseline.path), list(self.cfg.steps))
        self.log(f"{rollout.id}: {version} against stable {baseline.version}, steps {rollout.steps}")
        power = self.power(state)
        lines = power.lines()
        for line in lines:
            self.log(f"{rollout.id}: {line}")
        return self.store.update(rollout.id, plan=power.model_dump(mode="json") | {"lines": lines})

    def power(self, router_state: dict[str, Any]) -> GatePlan:
        """What this gate can detect at the traffic the router measured (`serving.power`), the feedback rates
        assumed (`gate.simulation`): the judge's time per pair is the one measured over the pairs this controller
        judged so far, before any the one `rollout.judge_s_per_pair` assumes."""
        meter = router_state.get("traffic") or {}
        rps = float(meter.get("rps", 0.0))
        measured = self.judge_s_per_pair
        s_per_pair = self.cfg.judge_s_per_pair if measured is None else measured
        pairs = (
            0.0
            if self.judge is None
            else judged_pairs_per_s(rps, float(router_state.get("shadow_rate", 0.0)), s_per_pair)
        )
        judge_speed = (
            ""
            if self.judge is None
            else f", judge {s_per_pair:.1f} s a pair ("
            + ("assumed: rollout.judge_s_per_pair" if measured is None else f"measured over {self._judged_pairs}")
            + ")"
        )
        traffic = Traffic(
            rps=rps,
            users=int(meter.get("users", 0)),
            pairs_per_s=pairs,
            source=f"router, last {float(meter.get('window_s', 0.0)):.0f} s of traffic{judge_speed}",
        )
        return plan(traffic, Population.assumed(self.gate_cfg.simulation), self.gate_cfg, self.cfg)

    # ------------------------------------------------------------ the loop
    def run(self, rollout_id: str) -> Rollout:
        """Drive a rollout to a final status (also what a restarted controller calls)."""
        r = self.store.get(rollout_id)
        if r.status == "stepping":  # after a restart: the router may have restarted too
            self.router.traffic(r.steps[r.step], r.id)
        with self.judging():
            while r.status in ACTIVE:
                r = getattr(self, f"_{r.status}")(r)
                if r.status != "stepping":
                    self._end_report()
        self.m_step.set(-1)
        return r

    def resume(self) -> Rollout | None:
        r = self.store.active()
        return self.run(r.id) if r else None

    def _load(self, variant: str, version: str, path: str) -> dict[str, Any]:
        """The router's weights call for `variant`; with `rollout.restart_wait_s` (serving.weights_via restart:
        something else restarts the pods onto the weights, Argo or a rolling restart) retried every poll
        interval until the engines serve them or the wait is over (then the last refusal is raised)."""
        self._restart(variant, path)
        deadline = time.monotonic() + self.cfg.restart_wait_s
        while True:
            try:
                return self.router.load(variant, version, path)
            except DynrubricError as e:
                if time.monotonic() >= deadline:
                    raise
                if self.progress is not None:
                    self.progress(f"waiting for the {variant} engines to serve {version}: {e.problem}")
                self.sleep(self.cfg.poll_interval_s)

    def _restart(self, variant: str, path: str) -> None:
        """rollout.restart kubernetes: set the variant's Deployment onto the weights (Kubernetes rolls its pods)."""
        if self.restarter is not None:
            self.log(f"{variant}: {self.restarter.set_model(self.cfg.deployments[variant], path)}")

    def _loading(self, r: Rollout) -> Rollout:
        try:
            self._load("canary", r.version, r.version_path)
        except DynrubricError as e:  # all or nothing: no canary replica changed, no traffic moved
            return self.store.update(r.id, status="failed", reason=f"loading canary weights failed: {e.problem}")
        if self.registry.get(r.version).state is CheckpointState.candidate:
            self.registry.set_state(r.version, CheckpointState.canary, f"canary in {r.id}")
        self.router.traffic(r.steps[0], r.id)
        now = time.time()
        self._enter_step(0, now)
        return self.store.update(r.id, status="stepping", step=0, step_started_at=now)

    def _enter_step(self, step: int, at: float) -> None:
        self._overtime = None
        self.m_step.set(step)
        self.m_step_started.set(at)

    def gate(self, r: Rollout) -> GateResult:
        """Evaluate the gate on everything logged so far (thread-safe: the HTTP endpoint calls it too)."""
        with self._online_lock:  # one Kafka consumer and its state; the gate's callers and the judge's worker
            self.online.track(r.id, r.step, r.step_started_at)
            self.online.poll()
            # the router's counters read after the log: the router settles a request before it logs the answer,
            # so every request the log shows is in them. Read before the poll, they missed a failing canary's
            # errors while the log already held its fallback answers: step 0 passed on an error rate of 0 over 0
            # settled requests with its minimum of requests met
            counters = self.router.state()["counters"].get(r.id, {})
            arms = {
                v: self.online.arm_stats(
                    v,
                    counters.get(v, {}).get("errors", 0),
                    counters.get(v, {}).get("requests", 0),
                    counters.get(v, {}).get("settled", 0),
                )
                for v in ("stable", "canary")
            }
            judged = self.online.judge
            self._gate_judged = judged.pairs
            self.online.checkpoint()
        if judged.pairs:
            lo, hi = judge_interval(judged, self.gate_cfg.judge_alpha, self.gate_cfg.judge_tau)
            for bound, value in (("estimate", judged.win_rate), ("lower", lo), ("upper", hi)):
                self.m_judge.labels(bound).set(value)
        self.m_judge_pairs.set(judged.pairs)
        return evaluate(
            arms["stable"],
            arms["canary"],
            r.steps[r.step],
            self.gate_cfg,
            require_non_inferiority=r.step == len(r.steps) - 1,
            judge=judged,
            experiment_id=r.id,
        )

    @contextlib.contextmanager
    def judging(self) -> Iterator[None]:
        """The judge's worker while a rollout runs: batches of the pairs read so far, one after another, a poll
        interval's wait when none is waiting or the judge failed. On the way out it finishes the batch it holds (in
        `up` the judge borrows the rounds' vLLM server, which the next round needs to itself); an interrupt or exit
        does not wait for it."""
        if self.judge is None:
            yield
            return
        stop = threading.Event()

        def work() -> None:
            while not stop.is_set():
                if not self.judge_once():
                    stop.wait(self.cfg.poll_interval_s)

        worker = threading.Thread(target=work, name="rollout-judge", daemon=True)
        worker.start()
        interrupted = False
        try:
            yield
        except (KeyboardInterrupt, SystemExit):  # the process is going down: the daemon worker goes with it
            interrupted = True
            raise
        finally:
            stop.set()
            worker.join(timeout=1.0 if interrupted else None)

    def judge_once(self) -> int:
        """Judge up to `judge_pairs_per_poll` of the shadow pairs read so far, outside the gate's lock, timing the
        judge; the pairs judged (0: none waiting, or the judge failed). A judge that fails (its engine's server
        down or restarting: `up`'s judge borrows the rounds' supervised vLLM server) leaves the pairs for the next
        batch; the failure is logged once, and the recovery. Pairs of a rollout that ended meanwhile are dropped."""
        with self._online_lock:
            if self._overtime is not None:  # the step's time is up: only the batch in hand is owed a verdict
                return 0
            pairs = self.online.take_pairs(self.cfg.judge_pairs_per_poll)
            experiment = self.online.experiment
        if not pairs:
            return 0
        started = time.monotonic()
        try:
            scores = self.judge.score(pairs)
        except Exception as e:  # the worker must live on: a batch lost with it would starve the gate
            problem = e.problem if isinstance(e, DynrubricError) else f"{type(e).__name__}: {e}"
            with self._online_lock:
                if self.online.experiment == experiment:
                    self.online.put_back(pairs)
            if self._judge_failing is None:
                self.log(f"the judge failed ({problem}); its {len(pairs)} pairs wait for the next batch")
            self._judge_failing = problem
            return 0
        if self._judge_failing is not None:
            self.log(f"the judge answers again (it failed: {self._judge_failing})")
            self._judge_failing = None
        with self._online_lock:
            if self.online.experiment != experiment:
                return 0
            self.online.add_judged(scores, pairs)
        self._judge_seconds += time.monotonic() - started
        self._judged_pairs += len(pairs)
        return len(pairs)

    def _judge_owes(self) -> int:
        """Pairs the judge holds, plus those it judged since the last gate read its count (0 without a judge)."""
        with self._online_lock:
            return max(0, len(self.online.judging) + self.online.judge.pairs - self._gate_judged)

    @property
    def judge_s_per_pair(self) -> float | None:
        """The judge's measured seconds per shadow pair, over every pair it judged (ground-truth pairs cost ~0,
        open ones a rubric and its verdicts: the mean is what the traffic's mix costs); None before any."""
        return self._judge_seconds / self._judged_pairs if self._judged_pairs else None

    def _stepping(self, r: Rollout) -> Rollout:
        router_state = self.router.state()
        down = [x["name"] for x in router_state["replicas"] if x["variant"] == "canary" and not x["healthy"]]
        if down and not any(x["variant"] == "canary" and x["healthy"] for x in router_state["replicas"]):
            return self.store.update(
                r.id,
                status="rolling_back",
                reason=f"no canary engine answers at step {r.step} (down: {', '.join(down)})",
            )
        result = self.gate(r)
        self.m_verdicts.labels(result.verdict.value).inc()
        self._report(r, result)
        gate = result.model_dump(mode="json")
        if result.verdict is Verdict.FAIL:
            return self.store.update(
                r.id, status="rolling_back", reason=f"gate failed at step {r.step}: {result.reason}", last_gate=gate
            )
        if result.verdict is Verdict.PASS:
            if r.step + 1 == len(r.steps):
                return self.store.update(r.id, status="promoting", last_gate=gate)
            now = time.time()
            try:
                self.router.traffic(r.steps[r.step + 1], r.id)
            except DynrubricError as e:  # e.g. the canary died between the gate and the step
                return self.store.update(
                    r.id,
                    status="rolling_back",
                    last_gate=gate,
                    reason=f"could not move to step {r.step + 1}: {e.problem}",
                )
            self._enter_step(r.step + 1, now)
            return self.store.update(r.id, step=r.step + 1, step_started_at=now, last_gate=gate)
        overtime = time.time() - r.step_started_at > self.cfg.max_step_s
        if overtime and self._overtime != (r.id, r.step):
            # the step's time is up: the judge takes no new batch, but the pairs it holds (or judged since the gate
            # read them) are owed a verdict, so the step waits for them, not for the queue behind (while the gate's
            # poll waited for the judge, r1 was promoted at make up's poll ending 785 s into a 600 s step so)
            self._overtime = (r.id, r.step)
            if owed := self._judge_owes():
                self.log(f"{r.id} step {r.step}: past {self.cfg.max_step_s:.0f} s, the judge's {owed} pairs awaited")
        if overtime and not self._judge_owes():
            return self.store.update(
                r.id,
                status="rolling_back",
                last_gate=gate,
                reason=f"step {r.step} still inconclusive after {self.cfg.max_step_s:.0f} s: {result.reason}",
            )
        r = self.store.update(r.id, last_gate=gate)
        self.sleep(self.cfg.poll_interval_s)
        return r

    def _report(self, r: Rollout, result: GateResult) -> None:
        """Log a step's state when it changes: the step, the verdict or the check deciding it (the reason's
        name; its numbers move at every poll). A state that held over several polls is summed up, with its
        last numbers, before the next one is logged; meanwhile `progress` shows the polls live."""
        state = (r.id, r.step, result.verdict.value, result.reason.split(":", 1)[0])
        line = f"{r.id} step {r.step} ({r.steps[r.step]:.0%}): {result.verdict.value}: {result.reason}"
        now = time.monotonic()
        if state == self._shown:
            self._polls += 1
            self._last_line = line
            if self.progress is not None:
                self.progress(f"{line} [{self._polls} polls, {now - self._shown_at:.0f} s]")
            return
        self._end_report()
        self._shown, self._polls, self._shown_at, self._last_line = state, 1, now, line
        self.log(line)

    def _end_report(self) -> None:
        """The steps are over: sum up a state that held over several polls."""
        if self._shown is not None and self._polls > 1:
            self.log(f"{self._last_line} [held {self._polls} polls, {time.monotonic() - self._shown_at:.0f} s]")
        self._shown, self._polls = None, 0

    def _promoting(self, r: Rollout) -> Rollout:
        try:
            self.router.traffic(1.0, r.id)  # the canary carries everyone while stable replicas reload
            self._load("stable", r.version, r.version_path)
        except DynrubricError as e:  # e.g. the canary died after the last gate: never promote a dead arm
            return self.store.update(r.id, status="rolling_back", reason=f"promotion failed: {e.problem}")
        self.router.traffic(0.0, r.id)
        self.registry.promote(r.version)
        self.m_outcomes.labels("promoted").inc()
        self.log(f"{r.id}: promoted {r.version}")
        return self.store.update(r.id, status="promoted")

    def _rolling_back(self, r: Rollout) -> Rollout:
        state = self.router.traffic(0.0, r.id)
        failed: list[str] = []
        for variant in ("stable", "canary"):  # stable differs only after a failed promotion
            if state["desired"].get(variant, {}).get("version") != r.baseline:
                try:
                    self._restart(variant, r.baseline_path)
                except DynrubricError as e:  # the router's check below marks what still serves the version
                    failed.append(f"restart of {variant}: {e.problem}")
                failed += self.router.load(variant, r.baseline, r.baseline_path, best_effort=True)["failed"]
        if self.registry.get(r.version).state is not CheckpointState.rejected:
            self.registry.reject(r.version, r.reason or "rolled back")
        self.m_outcomes.labels("rolled_back").inc()
        note = f" (restored when back: {'; '.join(failed)})" if failed else ""
        self.log(f"{r.id}: rolled back {r.version}: {r.reason}{note}")
        return self.store.update(r.id, status="rolled_back")


def build_controller_app(controller: Controller, metrics: CollectorRegistry) -> Any:
    """/healthz, /metrics, `GET /gate/{rollout_id}` and `GET /gate/version/{version}` (Argo Rollouts' web metric
    provider reads the latter: the newest rollout of the version its new pods serve).

    An active rollout is evaluated afresh; a finished one answers its last verdict (fail when it was
    rolled back). Argo (k8s/overlays/prod-argo): `successCondition: result.status == "promoted"`,
    `failureCondition: result.verdict == "fail"`.
    """
    from fastapi import HTTPException

    from dynrubric.service import make_app

    app = make_app("dynrubric rollout controller", metrics)

    def answer(r: Rollout) -> dict[str, Any]:
        body = {
            "rollout_id": r.id,
            "version": r.version,
            "status": r.status,
            "step": r.step,
            "canary_weight": r.steps[r.step],
            "reason": r.reason,
        }
        if r.status == "stepping":
            result = controller.gate(r).model_dump(mode="json")
        elif r.status in ("rolling_back", "rolled_back", "failed"):
            result = {"verdict": "fail", "reason": r.reason, "checks": (r.last_gate or {}).get("checks", [])}
        elif r.status in ("promoting", "promoted"):
            result = {"verdict": "pass", "reason": "promoted", "checks": (r.last_gate or {}).get("checks", [])}
        else:
            result = {"verdict": "inconclusive", "reason": f"rollout is {r.status}", "checks": []}
        return body | result

    @app.get("/gate/{rollout_id}")
    def gate(rollout_id: str) -> dict[str, Any]:
        try:
            r = controller.store.get(rollout_id)
        except DynrubricError as e:
            raise HTTPException(404, str(e)) from None
        return answer(r)

    @app.get("/gate/version/{version}")
    def gate_of_version(version: str) -> dict[str, Any]:
        """The newest rollout of `version` (Argo's blue-green prePromotionAnalysis knows the version its new pods
        serve, not the id our controller gives the rollout): inconclusive while there is none yet."""
        rollouts = [r for r in controller.store.list() if r.version == version]
        if not rollouts:
            why = f"no rollout of {version} yet: `dynrubric rollout start {version}` (k8s/jobs/rollout-start.yaml)"
            return {"version": version, "status": "none", "verdict": "inconclusive", "reason": why, "checks": []}
        return answer(max(rollouts, key=lambda r: r.started_at))

    return app
