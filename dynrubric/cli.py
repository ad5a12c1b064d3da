"""`dynrubric`: the command line and the composition root that wires the three tiers together.

Commands import their machinery lazily so that `dynrubric --help` stays fast. Errors a user can
act on (DynrubricError) print one line and exit non-zero; `--debug` shows the traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from dynrubric.errors import DynrubricError
from dynrubric.monitor import app as monitor_app

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

console = Console()
err_console = Console(stderr=True)


class Context:
    """What every command gets: the config source, loaded on first use."""

    def __init__(self, config_path: Path | None):
        self.config_path = config_path
        self._settings = None

    @property
    def settings(self):
        if self._settings is None:
            from dynrubric.config import load_settings

            self._settings = load_settings(self.config_path)
        return self._settings


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config file (default: $DYNRUBRIC_CONFIG, else built-in defaults)"),
]


@app.callback()
def root(
    ctx: typer.Context,
    config: ConfigOpt = None,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    ctx.obj = Context(config)


def settings_of(ctx: typer.Context):
    return ctx.find_root().obj.settings


# ---------------------------------------------------------------- config, models, doctor
@config_app.command("show")
def config_show(ctx: typer.Context) -> None:
    """Print the effective configuration (secrets masked)."""
    import yaml

    from dynrubric.config import masked_dump

    console.print(yaml.safe_dump(masked_dump(settings_of(ctx)), sort_keys=False), end="", markup=False)


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
    with console.status(f"building {name} into {target} (about a minute)"):
        path = modelcache.prepare(home, name)
    console.print(f"[green]prepared[/] {name} at {path}")


@app.command()
def doctor(ctx: typer.Context) -> None:
    """Check everything the embedded defaults need; print what is missing and the command that fixes it."""
    from rich.table import Table

    from dynrubric.doctor import check_of, run_checks
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


# ---------------------------------------------------------------- the tiers' commands
# The CLI is the composition root: it alone wires the tiers in. Their command modules import their
# machinery inside the command bodies, so registering them here costs little at start-up.
from dynrubric.rubric import commands as rubric_commands  # noqa: E402
from dynrubric.train.commands import registry_app, train_app  # noqa: E402
from serving.commands import register as register_serving  # noqa: E402
from streaming.commands import broker_app, ingest, traffic_app  # noqa: E402

app.command("score")(rubric_commands.score)
app.command("eval-judge")(rubric_commands.eval_judge)
app.command("serve-reward")(rubric_commands.serve_reward)
app.add_typer(train_app, name="train")
app.add_typer(registry_app, name="registry")
app.add_typer(broker_app, name="broker")
app.add_typer(traffic_app, name="traffic")
app.command("ingest")(ingest)
register_serving(app)


# ---------------------------------------------------------------- the loop on one machine
@app.command()
def up(
    ctx: typer.Context,
    rounds: Annotated[int, typer.Option(help="training rounds to run")] = 1,
    traffic: Annotated[
        Path | None, typer.Option(help="JSONL traffic to replay (default: the shipped prompt file)")
    ] = None,
    demo: Annotated[
        bool, typer.Option(help="small rounds sized for a 2-core CPU (off: the configured train.*/rubric.* sizes)")
    ] = True,
) -> None:
    """The main job on embedded defaults: broker, traffic -> Kafka, ingest -> replay store, training
    rounds (set-conditioned rubrics, GRPO, guards, registry), then the run report."""
    from importlib.resources import files

    from streaming.broker import EmbeddedBroker
    from streaming.commands import traffic_replay

    settings = settings_of(ctx)
    traffic = traffic or Path(str(files("dynrubric") / "data" / "prompts.jsonl"))
    if demo:  # caps, so a config that asks for less keeps it
        caps = {"steps_per_round": 2, "prompts_per_step": 4, "candidates": 4, "max_new_tokens": 48,
                "heldout_prompts": 4}
        for key, cap in caps.items():
            setattr(settings.train, key, min(getattr(settings.train, key), cap))
        for key, cap in {"generator_max_tokens": 256, "retries": 1, "prompt_only_retries": 0}.items():
            setattr(settings.rubric, key, min(getattr(settings.rubric, key), cap))
    settings.train.prompt_source = "replay"
    state = settings.paths.resolved_state()
    state.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker(port=0, log_path=state / "broker.log") as broker:
        settings.kafka.bootstrap_servers = broker.bootstrap_servers
        settings.ingest.metrics_port = 0
        console.rule(f"1/4 traffic -> Kafka at {broker.bootstrap_servers}")
        traffic_replay(ctx, traffic, rate=0.0, policy_version="base", repeat=1, raw=False)
        console.rule("2/4 ingest -> replay store")
        ingest(ctx, until_idle=5.0, store=None, metrics_port=None)
    console.rule(f"3/4 training: {rounds} round(s)")
    from dynrubric.train.commands import train_round

    train_round(ctx, round_id=None, rounds=rounds, metrics_port=None)
    console.rule("4/4 run report")
    report(ctx, out=None)


@app.command()
def report(
    ctx: typer.Context,
    out: Annotated[Path | None, typer.Option(help="PNG to write (default <state_dir>/report/run.png)")] = None,
) -> None:
    """Plot the training run log: reward, KL, score gaps vs the collapse thresholds, fallbacks, rounds."""
    from dynrubric.report import read_runlog, render
    from dynrubric.train.rounds import run_dir_of

    settings = settings_of(ctx)
    log = read_runlog(run_dir_of(settings) / "runlog.jsonl")
    out = out or settings.paths.resolved_state() / "report" / "run.png"
    render(log, out, settings.rubric.collapse_min_mean_gap, settings.rubric.collapse_max_nonsplit_share)
    console.print(f"report: {out} ({len(log.rounds)} rounds, {len(log.steps)} policy steps)")


def main() -> None:
    import click

    debug = "--debug" in sys.argv[1:]
    try:
        # with standalone_mode=False click returns the code of typer.Exit instead of exiting
        rc = typer.main.get_command(app)(args=sys.argv[1:], prog_name="dynrubric", standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except DynrubricError as e:
        if debug:
            err_console.print_exception()
        err_console.print("[red]error:[/] ", end="")
        err_console.print(str(e), markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
