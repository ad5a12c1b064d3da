"""`dynrubric`: the command line and the composition root that wires the three tiers together.

Dependency direction: this module imports the tiers' command modules; they import `settings_of` from
dynrubric/context.py and never this module. Commands import their machinery (torch, engines) inside
their bodies so that `dynrubric --help` stays fast. Every error a user can cause, usage errors
included, prints one line naming the problem and the fix and exits 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer._click.exceptions import NoArgsIsHelpError, UsageError
from typer.exceptions import Abort, Exit, TyperException

from dynrubric.app import rubric_commands
from dynrubric.app.monitor import app as monitor_app
from dynrubric.app.train_commands import eval_policy, registry_app, train_app
from dynrubric.config import Settings
from dynrubric.config_loader import DEFAULT_PROFILE, override
from dynrubric.console import heading, make_console
from dynrubric.context import Context, settings_of
from dynrubric.errors import DynrubricError
from dynrubric.progress import quiet_model_loading, status
from serving.commands import register as register_serving
from streaming.commands import broker_app, ingest, traffic_app

if TYPE_CHECKING:  # `up` imports the loop inside its body: the other commands start without it
    from dynrubric.app.loop import ClosedLoop

app = typer.Typer(
    name="dynrubric",
    help="Continuous LLM post-training from production traffic with co-evolving rubrics.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="The local model cache.", no_args_is_help=True)
config_app = typer.Typer(help="The validated configuration.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(config_app, name="config")
app.add_typer(monitor_app, name="monitor")
app.command("score")(rubric_commands.score)
app.command("eval-judge")(rubric_commands.eval_judge)
app.command("serve-reward")(rubric_commands.serve_reward)
app.command("eval-policy")(eval_policy)
app.add_typer(train_app, name="train")
app.add_typer(registry_app, name="registry")
app.add_typer(broker_app, name="broker")
app.add_typer(traffic_app, name="traffic")
app.command("ingest")(ingest)
register_serving(app)

console = make_console()
err_console = make_console(stderr=True)

ConfigOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML config file over the command's profile; repeat it to layer files, later ones winning "
        "(default: $DYNRUBRIC_CONFIG); DYNRUBRIC_* variables win over all files",
    ),
]


@app.callback()
def root(
    ctx: typer.Context,
    config: ConfigOpt = None,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    ctx.obj = Context(config or [])


# ---------------------------------------------------------------- config, models, doctor
@config_app.command("show")
def config_show(
    ctx: typer.Context,
    fmt: Annotated[str, typer.Option("--format", help="yaml | json")] = "yaml",
    profile: Annotated[
        str,
        typer.Option(help="the profile under the -c files: production (the schema defaults) or demo (`up`'s default)"),
    ] = DEFAULT_PROFILE,
) -> None:
    """Print the effective configuration (secrets masked): schema defaults < profile < -c files < DYNRUBRIC_*
    variables; valid YAML (or JSON) that `-c` reads back."""
    import yaml

    from dynrubric.config_loader import masked_dump

    if fmt not in ("yaml", "json"):
        raise DynrubricError(f"unknown --format {fmt!r}", "use --format yaml or --format json")
    data = masked_dump(settings_of(ctx, profile))
    # plain stdout, never rich: rich wraps long strings at the console width, which breaks the YAML
    if fmt == "json":
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, width=float("inf")))


@models_app.command("prepare")
def models_prepare(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="model to build into the cache")] = "smollm2-135m",
    quiet: Annotated[bool, typer.Option("--quiet", help="print nothing when already prepared")] = False,
) -> None:
    """Build a model into the local cache from its shipped GGUF (once; atomic)."""
    from dynrubric import modelcache

    home = settings_of(ctx).paths.resolved_home()
    target = modelcache.models_dir(home) / name
    if modelcache.is_ready(target):
        if not quiet:
            console.print(f"[green]ready[/] {name} at {target}")
        return
    with status(console, f"building {name} into {target} (about a minute)"):
        path = modelcache.prepare(home, name)
    console.print(f"[green]prepared[/] {name} at {path}")


@app.command()
def doctor(ctx: typer.Context) -> None:
    """Check everything the embedded defaults need; print what is missing and the command that fixes it."""
    from rich.table import Table

    from dynrubric.app.doctor import check_of, run_checks
    from streaming.broker import tansu_binary

    results = run_checks(settings_of(ctx), [check_of("broker (tansu)", tansu_binary)])
    table = Table(title="dynrubric doctor")
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col)
    for r in results:
        table.add_row(r.name, "[green]ok[/]" if r.ok else "[red]missing[/]", r.detail, "" if r.ok else r.fix)
    console.print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command()
def generate(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="a user message")],
    max_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    n: Annotated[int, typer.Option(help="completions")] = 1,
) -> None:
    """Answer one prompt with the configured policy engine (a quick end-to-end check of an engine)."""
    from dynrubric.engines import GenerationRequest, SamplingParams, build_engine

    with build_engine(settings_of(ctx), "policy") as engine:
        rendered = engine.render_chat([{"role": "user", "content": prompt}])
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n)
        for completion in engine.generate([GenerationRequest(rendered, params)])[0]:
            console.print(completion.text, markup=False, highlight=False)


# ---------------------------------------------------------------- the loop on one machine
@app.command()
def up(
    ctx: typer.Context,
    cycles: Annotated[int, typer.Option(help="cycles to run: train a round, roll its candidate out, gate, decide")] = 2,
    forever: Annotated[bool, typer.Option("--forever", help="run cycles until Ctrl-C (a standing deployment)")] = False,
    minutes: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            help="time budget: start no cycle that the last cycle's length says would "
            "end after this many minutes (with --forever: as many as fit)",
        ),
    ] = None,
    engine_server: Annotated[
        str | None,
        typer.Option(help="vllm | transformers: the server program of every fleet engine (serving.engines[].server)"),
    ] = None,
    prometheus: Annotated[
        bool, typer.Option(help="start Debian's Prometheus scraping the run's services with the shipped rules")
    ] = True,
    profile: Annotated[
        str,
        typer.Option(
            help="the profile under the -c files: demo (the default: small rounds and a small-traffic gate sized "
            "for a 2-core CPU, deciding rollouts on the judged shadow check) or production (the schema defaults); "
            "`dynrubric config show --profile demo` prints what the loop runs with"
        ),
    ] = "demo",
    drill_cycle: Annotated[
        int | None,
        typer.Option(
            help="damage drill: roll out a copy of this cycle's candidate with NaN weights "
            "instead of it; the gate must roll it back (loop.drill_cycle)"
        ),
    ] = None,
) -> None:
    """The main job, the closed loop on embedded defaults: broker, ingest, engine fleet (stable + canary),
    router, simulated users; each cycle trains a round on the new logged prompts, rolls the candidate out
    to the canary in place, gates it on live online metrics and promotes it or rolls it back."""
    from dynrubric.app.loop import ClosedLoop

    settings = settings_of(ctx, profile)
    if engine_server is not None:
        if engine_server not in ("vllm", "transformers"):
            raise DynrubricError(
                f"unknown --engine-server {engine_server!r}", "use --engine-server vllm or transformers"
            )
        engines = [e.model_dump() | {"server": engine_server} for e in settings.serving.engines]
        settings = override(settings, {"serving": {"engines": engines}})
    if cycles < 1:
        raise DynrubricError(f"--cycles {cycles} runs nothing", "pass --cycles 1 or more, or --forever")
    if drill_cycle is not None:
        settings = override(settings, {"loop": {"drill_cycle": drill_cycle}})
    if not forever and settings.loop.drill_cycle is not None and settings.loop.drill_cycle > cycles:
        raise DynrubricError(
            f"loop.drill_cycle {settings.loop.drill_cycle} is after the last of {cycles} cycle(s)",
            f"pass --cycles {settings.loop.drill_cycle} or more, or a smaller --drill-cycle",
        )
    loop = ClosedLoop(settings, log=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
    try:
        loop.run(
            None if forever else cycles,
            prometheus=prometheus,
            deadline=None if minutes is None else time.monotonic() + 60.0 * minutes,
        )
    except (DynrubricError, KeyboardInterrupt):
        _summarise_up(settings, loop, stopped=True)  # the cycles that ran still get their report and run page
        raise
    _summarise_up(settings, loop, stopped=False)


def _summarise_up(settings: Settings, loop: ClosedLoop, stopped: bool) -> None:
    """The cycles' lines, the restarts and the users' count, the report and the run page of `up`. After an
    error or Ctrl-C (`stopped`) they cover the cycles that ran, and what cannot be written is only printed:
    the error that stopped the loop is the one to show. A round killed before its first step leaves no run
    log: then there is no report to draw, and the run page still shows the cycles."""
    from dynrubric.app.loop import write_run_page
    from dynrubric.train.records import RUNLOG

    if stopped and not loop.results:
        return  # stopped before a cycle ended: nothing to report
    _print_up(loop)
    with _shown_after_stop(stopped):
        if stopped and not (settings.train_run_dir() / RUNLOG).is_file():
            console.print("report: none drawn, no round has logged a step yet", markup=False, highlight=False)
        else:
            _report(settings, out=None)
    with _shown_after_stop(stopped):
        page = write_run_page(settings, loop.results)
        console.print(f"run page: {page}", markup=False, highlight=False, soft_wrap=True)


@contextmanager
def _shown_after_stop(stopped: bool) -> Iterator[None]:
    """After a stop, an error of the block is printed and dropped (the stop's own error follows); else it raises."""
    try:
        yield
    except Exception as e:
        if not stopped:
            raise
        console.print(f"not written: {type(e).__name__}: {e}", markup=False, highlight=False, soft_wrap=True)


def _print_up(loop: ClosedLoop) -> None:
    results = loop.results
    heading(console, f"{len(results)} cycle(s)")
    for r in results:
        took = "" if r.registered_to_canary_s is None else f"; registered -> canary {r.registered_to_canary_s:.1f} s"
        console.print(
            f"cycle {r.cycle}: round {r.round} {r.version} {r.round_state}; rollout {r.decision}; "
            f"serving {r.serving}{took}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    restarts = ", ".join(f"{k} {v}" for k, v in sorted(loop.supervisor.restart_counts().items())) or "none"
    assert loop.traffic is not None, "a cycle ended, so the loop's run started the users' traffic"
    console.print(
        f"restarts: {restarts}; user requests answered {loop.traffic.answered}, failed {loop.traffic.failed}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def report(
    ctx: typer.Context,
    out: Annotated[Path | None, typer.Option(help="PNG to write (default <state_dir>/report/run.png)")] = None,
) -> None:
    """Plot the training run log (reward, KL, score gaps vs the collapse thresholds, fallbacks, rounds) and
    the rollouts' rubric-judged online check."""
    _report(settings_of(ctx), out)


def _report(settings: Settings, out: Path | None) -> None:
    from dynrubric.app.report import Thresholds, judged_rollouts, read_runlog, render
    from dynrubric.train.records import RUNLOG

    log = read_runlog(settings.train_run_dir() / RUNLOG)
    out = out or settings.paths.resolved_state() / "report" / "run.png"
    r = settings.rubric
    judged = judged_rollouts(rollout_rows(settings))
    g = settings.train.grpo
    render(
        log,
        out,
        Thresholds(
            r.collapse_min_mean_gap,
            r.collapse_max_nonsplit_share,
            r.collapse_window,
            settings.train.max_kl,
            g.tis_low,
            g.tis_high,
        ),
        judged,
    )
    console.print(
        f"report: {out} ({len(log.rounds)} rounds, {len(log.steps)} policy steps, "
        f"{len(judged)} rollouts with judged pairs)"
    )
    for j in judged:
        console.print(f"  {j.line()}")


def rollout_rows(settings) -> list[dict]:
    """The rollouts recorded in the registry's database (none when there is no registry yet)."""
    from dynrubric.registry import sqlite_path
    from serving.rollout import legacy_store_path, open_rollout_store

    path = sqlite_path(settings)
    if path is not None and not path.is_file() and not legacy_store_path(settings).is_file():
        return []  # reading must not create an empty registry
    return [r.to_json() for r in open_rollout_store(settings).list()]


def main() -> None:
    quiet_model_loading()
    debug = "--debug" in sys.argv[1:]
    try:
        # with standalone_mode=False the command returns typer.Exit's code instead of exiting
        rc = typer.main.get_command(app)(args=sys.argv[1:], prog_name="dynrubric", standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except NoArgsIsHelpError as e:  # `dynrubric train`: the group's help, as asked
        e.show()
        sys.exit(e.exit_code)
    except (DynrubricError, UsageError) as e:
        if debug:
            err_console.print_exception()
        err_console.print(f"error: {_one_line(e)}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except (Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exit as e:
        sys.exit(e.exit_code)
    except TyperException as e:  # a click error that is not a usage error (e.g. a file that cannot be opened)
        if debug:
            err_console.print_exception()
        err_console.print(f"error: {e.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)


def _one_line(e: Exception) -> str:
    """The problem and the fix, on one line, for the errors a user can cause."""
    if isinstance(e, UsageError):
        command = e.ctx.command_path if e.ctx is not None else "dynrubric"
        message = " ".join(e.format_message().split())
        return f"{message} -> see `{command} --help`"
    return " ".join(str(e).split())
