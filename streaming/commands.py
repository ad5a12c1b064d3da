"""The streaming tier's commands: `dynrubric broker start|stop|status`, `dynrubric ingest`,
`dynrubric traffic replay`. Machinery is imported inside the command bodies (fast `--help`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dynrubric.console import make_console
from dynrubric.context import settings_of

broker_app = typer.Typer(
    help="The embedded Kafka-protocol broker (Tansu, memory storage, loopback).", no_args_is_help=True
)
traffic_app = typer.Typer(help="Synthetic traffic for tests, benchmarks and demos.", no_args_is_help=True)
console = make_console()


def _pid_file(settings) -> Path:
    return settings.broker.pid_file or settings.paths.resolved_state() / "broker" / "tansu.pid"


def store_dir(settings) -> Path:
    from streaming.store import store_root

    return store_root(settings)


@broker_app.command("start")
def broker_start(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option(help="listen port (default broker.port; 0 = a free one)")] = None,
) -> None:
    """Start the broker in the background, wait until it answers, record it in the pid file."""
    from streaming.broker import start_detached

    s = settings_of(ctx)
    state = start_detached(
        _pid_file(s), s.broker.host, s.broker.port if port is None else port, s.broker.start_timeout_s
    )
    console.print(f"[green]broker running[/] pid {state.pid} at {state.bootstrap_servers} (log {state.log})")
    if state.bootstrap_servers != s.kafka.bootstrap_servers:
        console.print(f"clients: export DYNRUBRIC_KAFKA__BOOTSTRAP_SERVERS={state.bootstrap_servers}", markup=False)


@broker_app.command("stop")
def broker_stop(ctx: typer.Context) -> None:
    """Stop the recorded broker with SIGTERM (its topics are lost: memory storage)."""
    from streaming.broker import stop_detached

    state = stop_detached(_pid_file(settings_of(ctx)))
    console.print(f"stopped broker pid {state.pid}" if state else "no broker running")


@broker_app.command("status")
def broker_status(ctx: typer.Context) -> None:
    """Say whether the recorded broker runs and answers the Kafka protocol (exit 1 if not)."""
    from streaming.broker import answers_kafka, read_state

    state = read_state(_pid_file(settings_of(ctx)))
    if state is None:
        console.print("no broker running")
        raise typer.Exit(1)
    ok = answers_kafka(state.host, state.port)
    console.print(
        f"broker pid {state.pid} at {state.bootstrap_servers}: "
        + ("[green]answers[/]" if ok else "[red]not answering[/]")
    )
    if not ok:
        raise typer.Exit(1)


def ingest(
    ctx: typer.Context,
    until_idle: Annotated[
        float | None, typer.Option(help="exit after this many seconds without new records (default: run until SIGTERM)")
    ] = None,
    store: Annotated[Path | None, typer.Option(help="replay store dir (default ingest.store_dir)")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="port of /healthz /metrics (default ingest.metrics_port)")
    ] = None,
) -> None:
    """Consume query logs and feedback into the replay store (validate, dead-letter, dedupe, filter, scrub)."""
    from streaming.ingest import serve

    s = settings_of(ctx)
    cfg = s.ingest if metrics_port is None else s.ingest.model_copy(update={"metrics_port": metrics_port})
    summary = serve(
        s.kafka,
        cfg,
        store or store_dir(s),
        until_idle_s=until_idle,
        announce=lambda line: console.print(line, markup=False),
    )
    console.print(
        f"ingest stopped: consumed {summary.consumed}, written {summary.written}, duplicates {summary.duplicates}, "
        f"dead-lettered {summary.dead_lettered}, filtered {summary.filtered}, batches {summary.batches}"
    )


@traffic_app.command("replay")
def traffic_replay(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSONL: events, or prompt lines as in dynrubric/data/prompts.jsonl")],
    rate: Annotated[float, typer.Option(help="query-log events per second (0 = as fast as possible)")] = 10.0,
    policy_version: Annotated[str, typer.Option(help="policy_version of events that do not name one")] = "v0",
    repeat: Annotated[int, typer.Option(help="send the file this many times (fresh request ids)")] = 1,
    raw: Annotated[bool, typer.Option(help="send each line's bytes unchanged to the query-log topic")] = False,
) -> None:
    """Produce query-log (and feedback) events from a JSONL file at a given rate."""
    from streaming.traffic_replay import replay

    s = settings_of(ctx)
    # a live bar only in a terminal: in a log, rich's transient bar leaves an empty line and nothing else
    stats = replay(
        s.kafka, file, rate=rate, policy_version=policy_version, repeat=repeat, raw=raw, progress=console.is_terminal
    )
    console.print(
        f"sent {stats.query_logs} query-log and {stats.feedback} feedback events "
        f"({stats.raw} raw) in {stats.seconds:.1f}s; dropped {stats.dropped}, delivery errors {stats.delivery_errors}"
    )
    if stats.dropped or stats.delivery_errors:
        raise typer.Exit(1)
