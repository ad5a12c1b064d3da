"""`dynrubric fleet up`, `serve-router`, `rollout ...`, `gate simulate`, `users run`: the serving tier's commands.

Machinery is imported inside command bodies so `dynrubric --help` stays fast.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from dynrubric.config_loader import DEFAULT_PROFILE
from dynrubric.console import make_console
from dynrubric.context import settings_of
from dynrubric.errors import DynrubricError
from dynrubric.progress import status

console = make_console()
fleet_app = typer.Typer(help="Engine servers as local child processes.", no_args_is_help=True)
rollout_app = typer.Typer(help="Canary rollouts gated by online metrics.", no_args_is_help=True)
gate_app = typer.Typer(help="The rollout gate's statistics.", no_args_is_help=True)
users_app = typer.Typer(help="Simulated users for tests and demos.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
    app.add_typer(rollout_app, name="rollout")
    app.add_typer(gate_app, name="gate")
    app.add_typer(users_app, name="users")
    app.command("serve-router")(serve_router)


def _stable_weights(settings) -> tuple[str, Path]:
    """The registry's stable version and its weights, else the configured policy model."""
    from dynrubric import modelcache
    from dynrubric.registry import open_registry

    stable = open_registry(settings).stable()
    if stable is not None:
        return stable.version, stable.path
    name = settings.models.policy
    path = Path(name) if Path(name).is_dir() else modelcache.resolve(settings.paths.resolved_home(), name)
    return path.name, path


def _router_url(settings) -> str:
    s = settings.serving
    return s.router_url or f"http://{s.host}:{s.port}"


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


# ---------------------------------------------------------------- fleet
@fleet_app.command("up")
def fleet_up(ctx: typer.Context) -> None:
    """Start every engine of `serving.engines` on the stable weights; restart any that dies; until Ctrl-C."""
    from prometheus_client import CollectorRegistry

    from dynrubric.service import make_app, serve
    from serving.fleet import Fleet, specs_from_settings

    settings = settings_of(ctx)
    version, path = _stable_weights(settings)
    metrics = CollectorRegistry()
    specs = specs_from_settings(settings, path, version)
    fleet = Fleet(
        specs,
        settings.paths.resolved_state() / "fleet",
        metrics,
        settings.serving.health_interval_s,
        settings.serving.max_restarts,
    )
    with fleet:
        with status(console, f"starting {len(specs)} engine(s) on {version}"):
            fleet.start(settings.vllm.start_timeout_s)
        for s in specs:
            console.print(f"[green]up[/] {s.name} ({s.server}, {s.variant}) at {s.base_url}")
        console.print(f"fleet /metrics on :{settings.serving.fleet_port}")
        serve(make_app("dynrubric fleet", metrics), settings.serving.host, settings.serving.fleet_port)


# ---------------------------------------------------------------- router
def build_router(settings, producer, metrics):
    from serving.router import Replica, Router, RouterState, Weights
    from serving.routing import LeastInflight, StickyHashAssignment

    version, path = _stable_weights(settings)
    # a local fleet's loopback port, or a Kubernetes Service by its DNS name (serving.engines[].url)
    replicas = [Replica(e.name, e.variant, e.base_url, version) for e in settings.serving.engines]
    weights = Weights(version, str(path))
    state = RouterState(replicas, desired={"stable": weights, "canary": weights})
    s = settings.serving
    return Router(
        state,
        producer,
        metrics,
        token=s.token,
        engine_api_key=s.engine_api_key,
        timeout_s=s.request_timeout_s,
        health_interval_s=s.health_interval_s,
        shadow_rate=s.shadow_rate,
        shadow_max_inflight=s.shadow_max_inflight,
        default_max_tokens=s.default_max_tokens,
        traffic_window_s=s.traffic_window_s,
        assignment=StickyHashAssignment(),
        replica_choice=LeastInflight(),
        shared=_shared_split(settings),
        replica_id=os.environ.get("HOSTNAME", ""),  # the pod's name in k8s
        sync_interval_s=s.sync_interval_s,
        weights_via=s.weights_via,
        # headless Services: every pod behind one is a replica (a weights call reaches each)
        discover=[(e.name, e.variant, e.base_url) for e in s.engines if e.pods],
    )


def _shared_split(settings):
    """The split every router replica reads (serving.shared_state), in the registry's database."""
    if not settings.serving.shared_state:
        return None
    from dynrubric.registry import open_registry
    from serving.shared import SharedSplit

    return SharedSplit(open_registry(settings))


def serve_router(ctx: typer.Context) -> None:
    """The A/B router over the fleet, logging to Kafka (`serving.host`:`serving.port`)."""
    from prometheus_client import CollectorRegistry

    from dynrubric.service import serve
    from streaming.producer import EventProducer

    settings = settings_of(ctx)
    metrics = CollectorRegistry()
    router = build_router(settings, EventProducer(settings.kafka, metrics), metrics)
    console.print(f"router on {_router_url(settings)} over {[r.name for r in router.state.replicas]}")
    serve(router.app, settings.serving.host, settings.serving.port)


# ---------------------------------------------------------------- rollout
def build_controller(settings, log=console.print, judge=None):
    """The rollout controller and its metrics registry. `judge`: the judged check's `serving.judged.PairJudge`
    (`dynrubric up` passes one on the rounds' vLLM server); None: with `rollout.judge`, one on the engines that
    `settings.engine` and `settings.models` configure."""
    from prometheus_client import CollectorRegistry

    from dynrubric.registry import open_registry
    from serving.online import OnlineMetrics
    from serving.rollout import Controller, RouterClient, open_rollout_store
    from streaming.events import FEEDBACK_TOPIC, QUERY_LOG_TOPIC

    metrics = CollectorRegistry()
    r = settings.rollout
    if "judged" in settings.gate.promote_on and settings.serving.shadow_rate == 0:
        raise DynrubricError(
            "gate.promote_on names judged, but serving.shadow_rate is 0: the router makes no shadow pairs to judge",
            "set serving.shadow_rate (0.5 in the demo), or drop judged from gate.promote_on",
        )
    online = OnlineMetrics(
        settings.kafka.bootstrap_servers,
        QUERY_LOG_TOPIC,
        FEEDBACK_TOPIC,
        group_id=r.consumer_group,
        state_path=settings.paths.resolved_state() / "rollout" / f"online-{r.consumer_group}.json",
        feedback_window_s=r.feedback_window_s,
        max_message_bytes=settings.kafka.max_message_bytes,
    )
    if not r.judge:
        judge = None
    elif judge is None:
        from dynrubric.engines import judge_engines
        from dynrubric.rubric.evaluator import Evaluator
        from serving.judged import PairJudge

        generator, verifier = judge_engines(settings)
        judge = PairJudge(
            Evaluator(generator, verifier, settings.rubric), settings.rubric.eps, ground_truth=r.judge_ground_truth
        )
    registry = open_registry(settings)
    restarter = None
    if r.restart == "kubernetes":
        from serving.kube import DeploymentRestarter

        restarter = DeploymentRestarter.in_cluster()
    controller = Controller(
        registry,
        open_rollout_store(settings, registry),
        RouterClient(_router_url(settings), settings.serving.token),
        online,
        r,
        settings.gate,
        metrics=metrics,
        log=log,
        judge=judge,
        restarter=restarter,
    )
    return controller, metrics


def _run_with_gate_endpoint(settings, controller, metrics, fn):
    import uvicorn

    from serving.rollout import build_controller_app

    server = uvicorn.Server(
        uvicorn.Config(
            build_controller_app(controller, metrics),
            host=settings.serving.host,
            port=settings.rollout.port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        return fn()
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _run_live(settings, controller, metrics, fn):
    """Run with the gate endpoint; in a terminal a live status line shows each poll of a step whose state holds
    (the log prints a state when it changes)."""
    if not console.is_terminal:
        return _run_with_gate_endpoint(settings, controller, metrics, fn)
    with console.status("rollout: starting") as live:
        controller.progress = live.update
        return _run_with_gate_endpoint(settings, controller, metrics, fn)


@rollout_app.command("start")
def rollout_start(
    ctx: typer.Context, version: Annotated[str, typer.Argument(help="registry version to roll out")]
) -> None:
    """Canary VERSION through the traffic steps; promote or roll back. Serves GET /gate/{id} meanwhile."""
    settings = settings_of(ctx)
    controller, metrics = build_controller(settings)
    rollout = controller.start(version)
    console.print(f"gate: http://{settings.serving.host}:{settings.rollout.port}/gate/{rollout.id}")
    final = _run_live(settings, controller, metrics, lambda: controller.run(rollout.id))
    console.print(f"{final.id}: [bold]{final.status}[/] {final.reason or ''}")
    if final.status != "promoted":
        raise typer.Exit(1)


@rollout_app.command("resume")
def rollout_resume(ctx: typer.Context) -> None:
    """Carry on the rollout a stopped controller left in progress."""
    settings = settings_of(ctx)
    controller, metrics = build_controller(settings)
    final = _run_live(settings, controller, metrics, controller.resume)
    if final is None:
        console.print("no rollout in progress")
        return
    console.print(f"{final.id}: [bold]{final.status}[/] {final.reason or ''}")


@rollout_app.command("status")
def rollout_status(
    ctx: typer.Context,
    rollout_id: Annotated[str | None, typer.Argument(help="one rollout (default: all)")] = None,
) -> None:
    """Rollouts with their status, step and last gate verdict (JSON lines)."""
    from dynrubric.registry import sqlite_path
    from serving.rollout import legacy_store_path, open_rollout_store

    settings = settings_of(ctx)
    path = sqlite_path(settings)
    if path is not None and not path.is_file() and not legacy_store_path(settings).is_file():
        # reading must not create an empty registry in the wrong state dir
        raise DynrubricError(
            f"no rollouts recorded: no registry database at {path}",
            "start one with `dynrubric rollout start VERSION`, or point DYNRUBRIC_PATHS__STATE_DIR "
            "(or registry.path / registry.url) at the registry the controller uses",
        )
    store = open_rollout_store(settings)
    for r in [store.get(rollout_id)] if rollout_id else store.list():
        gate = r.last_gate or {}
        print(
            json.dumps(
                {
                    "id": r.id,
                    "version": r.version,
                    "baseline": r.baseline,
                    "status": r.status,
                    "step": r.step,
                    "canary_weight": r.steps[r.step],
                    "reason": r.reason,
                    "last_verdict": gate.get("verdict"),
                    "last_gate_reason": gate.get("reason"),
                }
            )
        )


# ---------------------------------------------------------------- gate
@gate_app.command("simulate")
def gate_simulate(
    ctx: typer.Context,
    runs: Annotated[int, typer.Option(help="rollouts per scenario")] = 100,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Simulated rollouts at the library level (population: `gate.simulation`): A/A, then one degraded metric each."""
    import statistics

    from serving.gatesim import ArmBehaviour, simulate_many

    settings = settings_of(ctx)
    scenarios = {
        "A/A": ArmBehaviour(),
        "positive-feedback rate -0.10": ArmBehaviour(positive_shift=-0.10),
        "regenerate rate +0.10": ArmBehaviour(regenerate_shift=0.10),
        "error rate 0.06": ArmBehaviour(error_rate=0.06),
        "p95 latency x2 tail": ArmBehaviour(latency_p95_factor=2.0),
        "judged win rate 0.3": ArmBehaviour(judge_win_rate=0.3),
    }
    for name, canary in scenarios.items():
        results = simulate_many(ArmBehaviour(), canary, list(settings.rollout.steps), settings.gate, runs, seed)
        back = sum(r.outcome == "rolled_back" for r in results)
        console.print(
            f"{name}: {back}/{runs} rolled back; median requests to decision "
            f"{statistics.median(r.requests for r in results):.0f} "
            f"(canary arm {statistics.median(r.canary_requests for r in results):.0f})"
        )


@gate_app.command("plan")
def gate_plan(
    ctx: typer.Context,
    rps: Annotated[list[float], typer.Option(help="requests a second of a planned deployment (repeat for several)")],
    users: Annotated[list[int], typer.Option(help="distinct users sending them (one for all --rps, or one each)")],
    profile: Annotated[
        str, typer.Option(help="the profile under the -c files: production (the default) or demo (the gate `up` runs)")
    ] = DEFAULT_PROFILE,
) -> None:
    """What the configured gate can detect at each traffic: the smallest harm per metric caught with 80% power
    within rollout.max_step_s at each step, and when an equal canary is promoted (the line every rollout logs)."""
    from rich.table import Table

    from serving.power import Population, Traffic, judged_pairs_per_s, plan

    if len(users) not in (1, len(rps)):
        raise DynrubricError(f"{len(users)} --users for {len(rps)} --rps", "give one --users, or one per --rps")
    if any(x <= 0 for x in rps) or any(u < 1 for u in users):
        raise DynrubricError("--rps must be > 0 and --users >= 1", "e.g. --rps 1 --rps 10 --users 40 --users 1000")
    settings = settings_of(ctx, profile)
    g, r = settings.gate, settings.rollout
    plans = []
    for rate, n in zip(rps, users * len(rps) if len(users) == 1 else users, strict=True):
        pairs = judged_pairs_per_s(rate, settings.serving.shadow_rate, r.judge_s_per_pair) if r.judge else 0.0
        plans.append(
            plan(
                Traffic(rps=rate, users=n, pairs_per_s=pairs, source="planned"), Population.assumed(g.simulation), g, r
            )
        )
    judge = f"; judge {r.judge_s_per_pair:g} s a shadow pair (rollout.judge_s_per_pair)" if r.judge else ""
    table = Table(
        title=f"gate plan: smallest harm caught with 80% power within one step of {r.max_step_s:.0f} s; "
        f"promote on {' + '.join(g.promote_on)}{judge}; {plans[0].population}"
    )
    for col in (
        "req/s",
        "users",
        "pairs/s",
        "metric",
        "baseline",
        *(f"step {w:.0%}" for w in r.steps),
        "promote within",
    ):
        table.add_column(col)
    for p in plans:
        t = p.traffic
        for i, m in enumerate(p.metrics):
            first = i == 0
            table.add_row(
                f"{t.rps:g}" if first else "",
                f"{t.users}" if first else "",
                f"{t.pairs_per_s:.2f}" if first else "",
                f"{m.metric}: {m.harm}",
                f"{m.baseline:.3f}",
                *("-" if d is None else f"{d:.3f}" for d in m.detectable),
                "not required" if m.promote_margin is None else f"{m.promote_margin:g}",
                end_section=i == len(p.metrics) - 1,
            )
    console.print(table)
    for p in plans:
        console.print(
            f"{p.traffic.rps:g} req/s, {p.traffic.users} users: {p.decision()}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


# ---------------------------------------------------------------- users
@users_app.command("run")
def users_run(
    ctx: typer.Context,
    requests: Annotated[int, typer.Option(help="requests to send")] = 100,
    users: Annotated[int, typer.Option(help="distinct simulated users")] = 50,
    concurrency: Annotated[int, typer.Option()] = 2,
    seed: Annotated[int, typer.Option()] = 0,
    prompts: Annotated[Path | None, typer.Option(help="prompt file (default: the shipped one)")] = None,
) -> None:
    """Send the bank's train prompts through the router; feedback from the users' preference (serving/users.py)."""
    from serving.users import SimulatedUsers, load_served

    settings = settings_of(ctx)
    sim = SimulatedUsers(_router_url(settings), load_served(prompts), n_users=users, seed=seed)
    summary = sim.run(requests, concurrency=concurrency)
    summary.pop("outcomes")
    console.print(json.dumps(summary, indent=2))
