"""Evaluator commands: `dynrubric score SETS.jsonl`, `dynrubric eval-judge SETS.jsonl`, `dynrubric serve-reward`."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from dynrubric.config_loader import override
from dynrubric.console import make_console
from dynrubric.context import settings_of
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import jsonl_lines
from dynrubric.progress import Bars, status

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dynrubric.config import Settings
    from dynrubric.engines.base import Completion, Engine, GenerationRequest
    from dynrubric.rubric.evaluator import Evaluator, ScoredSet

console = make_console()


def read_sets(path: Path) -> list[tuple[str, list[str]]]:
    """(prompt, responses) per line of a JSONL file; a bad line is an error naming its number."""
    sets = []
    for n, obj in jsonl_lines(path, "sets file", "pass a JSONL file of {prompt, responses}"):
        prompt, responses = (obj.get("prompt"), obj.get("responses")) if isinstance(obj, dict) else (None, None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise DynrubricError(f"{path}:{n} field 'prompt' must be a non-empty string", "fix that line")
        if not isinstance(responses, list) or not responses or not all(isinstance(r, str) for r in responses):
            raise DynrubricError(f"{path}:{n} field 'responses' must be a non-empty list of strings", "fix that line")
        sets.append((prompt, responses))
    if not sets:
        raise DynrubricError(f"sets file {path} holds no sets", "write one {prompt, responses} object per line")
    return sets


class _ReportingEngine:
    """An engine that says what each call is for before making it: one set can take minutes on a CPU
    (a rubric try generates up to rubric.generator_max_tokens tokens), so progress per set alone is not
    enough to show that work goes on."""

    def __init__(self, engine: Engine, note: Callable[[str], None], max_tokens: int):
        self._engine = engine
        self._note = note
        self._max_tokens = max_tokens
        self._tries = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        self._tries += 1
        self._note(f"rubric try {self._tries} (up to {self._max_tokens} tokens)")
        return self._engine.generate(requests)

    def score_next_token(self, prompts: Sequence[str], candidates: Sequence[str]) -> list[dict[str, float]]:
        self._note(f"verdicts: {len(prompts)} item x response prompts")
        return self._engine.score_next_token(prompts, candidates)

    def next_set(self) -> None:
        self._tries = 0


def score(
    ctx: typer.Context,
    sets_file: Annotated[Path, typer.Argument(help='JSONL: one {"prompt", "responses": [...]} per line')],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="scored sets as JSONL (default: ./<SETS stem>.scored.jsonl)")
    ] = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="transformers | openai-http (default: engine.kind of the config)")
    ] = None,
    mode: Annotated[
        str | None, typer.Option("--mode", help="set | prompt_only rubric generation (default: rubric.mode)")
    ] = None,
    on_ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="score on Ray Data with ray.judges judge actors; SETS may also be Parquet "
            "({prompt, responses}) or a replay store directory; writes Parquet",
        ),
    ] = False,
) -> None:
    """Score candidate sets with set-conditioned rubrics; write rubrics, verdicts, scores and gaps."""
    from rich.table import Table

    from dynrubric import atomic
    from dynrubric.rubric.evaluator import Evaluator

    options = {"engine": {"kind": engine}} if engine is not None else {}
    if mode is not None:
        options["rubric"] = {"mode": mode}
    try:
        settings = override(settings_of(ctx), options)
    except DynrubricError as e:  # the override is validated like a config file
        raise DynrubricError(
            f"bad option: {e.problem}", "use --engine transformers|openai-http, --mode set|prompt_only"
        ) from None
    if on_ray:
        score_on_ray(settings, sets_file, out)
        return
    if sets_file.suffix != ".jsonl" and (sets_file.is_dir() or sets_file.suffix == ".parquet"):
        raise DynrubricError(
            f"{sets_file} is Parquet or a directory; without --ray, score reads JSONL sets",
            f"dynrubric score {sets_file} --ray",
        )
    sets = read_sets(sets_file)
    out = out or Path(sets_file.stem + ".scored.jsonl")  # in the working directory, not beside the input
    generator, verifier = _judge_engines(settings)
    scored = []
    # one set per call, so progress moves per set (a rubric, then its verdicts) instead of once after
    # the batched rubric generation of every set; the collapse detector still sees every set in order
    with Bars(console) as bars:
        reporting = _ReportingEngine(generator, bars.note, settings.rubric.generator_max_tokens)
        judge = reporting if verifier is generator else _ReportingEngine(verifier, bars.note, 0)
        # the proxies delegate everything else to the engines they wrap
        evaluator = Evaluator(cast("Engine", reporting), cast("Engine", judge), settings.rubric)
        bars.start("sets scored", len(sets))
        for prompt, responses in sets:
            reporting.next_set()
            scored += evaluator.score_sets([prompt], [responses])
            bars.advance("sets scored", 1)
    atomic.write_text(out, "".join(json.dumps(s.as_dict(), ensure_ascii=False) + "\n" for s in scored))

    table = Table(title=f"{len(scored)} sets scored -> {out}")
    for col in ("#", "prompt", "K", "M", "rubric", "scores", "mean gap", "spread", "ties", "non-split"):
        table.add_column(col)
    for n, s in enumerate(scored, 1):
        table.add_row(
            str(n),
            s.prompt[:40],
            str(len(s.responses)),
            str(len(s.rubric.items)),
            s.rubric_source,
            " ".join(f"{x:.2f}" for x in s.scores),
            f"{s.gaps.mean_abs_gap:.3f}",
            f"{s.gaps.spread:.3f}",
            f"{s.gaps.tie_rate:.2f}",
            f"{s.gaps.nonsplit_share:.2f}",
        )
    console.print(table)
    c = evaluator.counts
    hard = sum(s.hard_verdict_fallbacks for s in scored)
    sources = Counter(s.rubric_source for s in scored)
    console.print(
        "rubric sources: "
        + ", ".join(f"{k} {v}" for k, v in sorted(sources.items()))
        + f"; parse failures {c.parse_failures}, prompt-only fallbacks {c.prompt_only_fallbacks}, "
        f"generic fallbacks {c.generic_fallbacks}, hard verdicts {hard}, "
        f"collapse {'FIRING' if evaluator.collapse.collapsed else 'no'}",
        markup=False,
    )
    generator.close()
    if verifier is not generator:
        verifier.close()


def score_on_ray(settings: Settings, source: Path, out: Path | None) -> None:
    """`dynrubric score --ray`: the sets of `source` through Ray Data and a pool of judge actors (rubric/bulk.py)."""
    import ray

    from dynrubric.ray_cluster import connect
    from dynrubric.rubric import bulk

    if not source.exists():
        raise DynrubricError(
            f"{source} does not exist", "pass a JSONL or Parquet sets file, or a replay store directory"
        )
    out = out or Path(source.name.removesuffix(source.suffix) + ".scored.parquet")
    with status(console, "starting Ray" if settings.ray.address is None else f"joining Ray at {settings.ray.address}"):
        connect(settings)
        ray.data.DataContext.get_current().enable_progress_bars = False  # ours below, one line per set when piped
    if (source / "index.sqlite").is_file():
        try:
            from streaming.store import QUERY_LOG, ReplayStore
        except ImportError:
            raise DynrubricError(
                "reading a replay store needs the streaming tier, which is not installed",
                "export the sets as Parquet {prompt, responses}",
            ) from None
        with ReplayStore(source) as store:
            shards = store.shard_paths(QUERY_LOG)
        if not shards:
            raise DynrubricError(f"the replay store {source} holds no query-log shards", "ingest traffic first")
        sets = bulk.replay_sets(shards)
    else:
        sets = bulk.file_sets(source, read_sets)
    with status(console, "reading the sets"):
        sets = sets.materialize()
        total = sets.count()
    with Bars(console) as bars:
        bars.start("sets scored", total)
        rows = list(bulk.score_dataset(settings, sets, lambda n: bars.advance("sets scored", n)))
    bulk.write_scored(out, rows)
    sources = Counter(r["rubric_source"] for r in rows)
    console.print(
        f"{len(rows)} sets scored on {settings.ray.judges} judge actor(s) -> {out}; rubric sources: "
        + ", ".join(f"{k} {v}" for k, v in sorted(sources.items())),
        markup=False,
    )


MODES = ("set", "prompt_only", "generic")
EVAL_CHUNK = 8  # sets per evaluator call: rubric generation stays batched and the progress bar moves


def shipped(name: str) -> Path:
    from importlib import resources

    return Path(str(resources.files("dynrubric").joinpath("data", name)))


def eval_judge(
    ctx: typer.Context,
    sets_file: Annotated[
        Path | None,
        typer.Argument(
            help="JSONL of ordered ({prompt, responses, order, kind}) and "
            "equal-quality ({..., collapsed: true}) sets; with --real, of "
            "{prompt, responses, passed}; with --open, of {prompt, responses, passed, source[, rubric]} "
            "(default: the shipped file)"
        ),
    ] = None,
    modes: Annotated[str, typer.Option("--modes", help="comma-separated rubric modes to compare")] = ",".join(MODES),
    out: Annotated[Path, typer.Option("--out", "-o", help="directory for eval_judge.json and eval_judge.png")] = Path(
        "eval-judge"
    ),
    limit: Annotated[
        int | None,
        typer.Option("--limit", min=1, help="only the first N sets of each kind and quality (--open: of each source)"),
    ] = None,
    batch: Annotated[
        int,
        typer.Option(
            "--batch",
            min=1,
            help="sets per evaluator call (their rubrics are generated as one batch: more is faster on a GPU)",
        ),
    ] = EVAL_CHUNK,
    real: Annotated[
        bool,
        typer.Option("--real", help="judge real policy output graded by the official checkers instead of ordered sets"),
    ] = False,
    sample: Annotated[
        int | None,
        typer.Option(
            "--sample",
            min=1,
            help="with --real: first sample the policy on N held-out instruction prompts and write SETS_FILE",
        ),
    ] = None,
    open_prompts: Annotated[
        bool,
        typer.Option(
            "--open",
            help="judge open prompts (Arena-Hard, HealthBench test split): a strong model's answer beside K policy "
            "answers, against the length-only baseline; HealthBench also under the physicians' rubric",
        ),
    ] = False,
) -> None:
    """Measure the judge on sets with a known order: pairwise accuracy, Kendall tau, gaps, collapse alarms; with
    --real, on the policy's own answers to held-out prompts, ordered by the official checkers; with --open, on open
    prompts where a far stronger model's answer should rank above the policy's."""
    import time

    from rich.table import Table

    from dynrubric import atomic
    from dynrubric.rubric.benchmark import plot, read_judge_sets, summarise_mode
    from dynrubric.rubric.evaluator import Evaluator

    wanted = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in MODES]
    if unknown or not wanted:
        raise DynrubricError(f"unknown mode(s) {unknown or modes!r}", f"use --modes with any of {','.join(MODES)}")
    settings = settings_of(ctx)
    if sample is not None and not real:
        raise DynrubricError("--sample writes real policy output", "pass --real with --sample")
    if real and open_prompts:
        raise DynrubricError("--real and --open judge different sets", "pass one of them")
    if open_prompts:
        _eval_judge_open(settings, sets_file or shipped("judge_open.jsonl"), wanted, out, batch, limit)
        return
    if real:
        _eval_judge_real(settings, sets_file or shipped("judge_real.jsonl"), wanted, out, batch, sample)
        return
    sets_file = sets_file or shipped("judge_benchmark.jsonl")
    sets = read_judge_sets(sets_file)
    if limit is not None:
        seen: dict[tuple[str, bool], int] = {}
        kept = []
        for s in sets:
            key = (s.kind, s.collapsed)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= limit:
                kept.append(s)
        sets = kept
    generator, verifier = _judge_engines(settings)
    results, per_set = [], []
    with Bars(console) as bars:
        for mode in wanted:
            config = settings.rubric.model_copy(update={"mode": mode})
            evaluator = Evaluator(generator, verifier, config)
            phase = f"sets judged ({mode})"
            bars.start(phase, len(sets))
            start = time.perf_counter()
            scored = _score_in_batches(evaluator, sets, batch, partial(bars.advance, phase))
            c = evaluator.counts
            sources = {src: sum(s.rubric_source == src for s in scored) for src in MODES}
            generated = sources["set"] + sources["prompt_only"] if mode != "generic" else 0
            results.append(
                summarise_mode(
                    mode,
                    sets,
                    [s.scores for s in scored],
                    [s.gaps for s in scored],
                    [s.trusted for s in scored],
                    eps=config.eps,
                    window=config.collapse_window,
                    min_mean_gap=config.collapse_min_mean_gap,
                    max_nonsplit=config.collapse_max_nonsplit_share,
                    rubric_sources=sources,
                    parse_failures=c.parse_failures,
                    generation_tries=c.parse_failures + generated,
                    prompt_only_fallbacks=c.prompt_only_fallbacks,
                    generic_fallbacks=c.generic_fallbacks,
                    dropped_checks=c.dropped_checks,
                    hard_verdicts=sum(s.hard_verdict_fallbacks for s in scored),
                    seconds=time.perf_counter() - start,
                )
            )
            per_set += [
                {"mode": mode, "kind": js.kind, "order": js.order, **s.as_dict()}
                for js, s in zip(sets, scored, strict=True)
            ]
    generator.close()
    if verifier is not generator:
        verifier.close()

    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(
        out / "eval_judge.json", json.dumps({"results": [r.as_dict() for r in results], "sets": per_set}, indent=1)
    )
    plot(results, out / "eval_judge.png")
    table = Table(
        title=f"judge benchmark: {sets_file} ({sum(not s.collapsed for s in sets)} ordered, "
        f"{sum(s.collapsed for s in sets)} equal-quality sets)"
    )
    for col in (
        "mode",
        "kind",
        "sets",
        "pairwise acc",
        "as trained",
        "kendall tau",
        "ordered gap",
        "empty top",
        "all tied",
        "untrusted",
    ):
        table.add_column(col)
    for r in results:
        for kind, k in r.by_kind.items():
            table.add_row(
                r.mode,
                kind,
                str(k.sets),
                f"{k.pairwise_accuracy:.3f}",
                f"{k.trained_pairwise_accuracy:.3f}",
                f"{k.kendall_tau:.3f}",
                f"{k.ordered_gap:.3f}",
                str(k.empty_top),
                str(k.all_tied),
                str(k.untrusted),
            )
    console.print(table)
    table = Table(title="generation, verdicts and the collapse detector")
    for col in (
        "mode",
        "rubric sources",
        "parse failures",
        "fallbacks p/g",
        "dropped checks",
        "hard verdicts",
        "score~length r",
        "alarm (equal)",
        "false alarm (ordered)",
        "seconds",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            r.mode,
            " ".join(f"{k}={v}" for k, v in r.rubric_sources.items() if v),
            f"{r.parse_failures}/{r.generation_tries}",
            f"{r.prompt_only_fallbacks}/{r.generic_fallbacks}",
            str(r.dropped_checks),
            str(r.hard_verdicts),
            f"{r.score_length_r:+.2f}",
            f"{r.collapse_alarm_rate:.2f} of {r.collapse_decisions[0]}",
            f"{r.collapse_false_alarm_rate:.2f} of {r.collapse_decisions[1]}",
            f"{r.seconds:.0f}",
        )
    console.print(table)
    console.print(f"wrote {out / 'eval_judge.json'} and {out / 'eval_judge.png'}", markup=False)
    for r in results:
        print(
            f"pairwise_accuracy[{r.mode}]: {r.by_kind['all'].pairwise_accuracy:.3f}"
            if "all" in r.by_kind
            else f"pairwise_accuracy[{r.mode}]: n/a (no ordered sets)"
        )
        if "all" in r.by_kind:  # the untrusted sets' pairs at 1/2: the ranking the trainer's advantages carry
            print(f"trained_pairwise_accuracy[{r.mode}]: {r.by_kind['all'].trained_pairwise_accuracy:.3f}")


def _eval_judge_real(
    settings: Settings, path: Path, modes: list[str], out: Path, batch: int, sample: int | None
) -> None:
    """`eval-judge --real`: the judge on real policy answers, the official checkers' verdicts as the order."""
    from rich.table import Table

    from dynrubric import atomic
    from dynrubric.rubric.benchmark import read_real_sets, summarise_real
    from dynrubric.rubric.evaluator import Evaluator
    from dynrubric.train.grpo import group_advantages

    if sample is not None:
        _sample_real_sets(settings, path, sample)
    sets = read_real_sets(path)
    judged_sets = [s for s in sets if s.separated]  # the others have no order to recover: not judged
    generator, verifier = _judge_engines(settings)
    results, per_set = {}, []
    with Bars(console) as bars:
        for mode in modes:
            config = settings.rubric.model_copy(update={"mode": mode})
            evaluator = Evaluator(generator, verifier, config)
            phase = f"sets judged ({mode})"
            bars.start(phase, len(judged_sets))
            scored = _score_in_batches(evaluator, judged_sets, batch, partial(bars.advance, phase))
            result = summarise_real(
                judged_sets,
                [s.scores for s in scored],
                [s.trusted for s in scored],
                partial(group_advantages, eps=settings.train.grpo.adv_eps, tie_eps=config.eps),
                config.eps,
            )
            results[mode] = dataclasses.replace(result, sets=len(sets))
            per_set += [
                {"mode": mode, "passed": rs.passed, **s.as_dict()} for rs, s in zip(judged_sets, scored, strict=True)
            ]
    generator.close()
    if verifier is not generator:
        verifier.close()
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(
        out / "eval_judge_real.json",
        json.dumps({"results": {m: r.as_dict() for m, r in results.items()}, "sets": per_set}, indent=1),
    )
    table = Table(title=f"judge on real policy output: {path} ({len(sets)} sets; order = the official checkers)")
    for col in ("mode", "separated sets", "pairs", "pairwise acc", "trains right", "trains wrong", "no advantage"):
        table.add_column(col)
    for mode, r in results.items():
        table.add_row(
            mode,
            str(r.separated_sets),
            str(r.separated_pairs),
            f"{r.pairwise_accuracy:.3f}",
            str(r.trains_right),
            str(r.trains_wrong),
            str(r.no_advantage),
        )
    console.print(table)
    console.print(f"wrote {out / 'eval_judge_real.json'}", markup=False)
    for mode, r in results.items():
        share = r.trains_right / r.separated_sets if r.separated_sets else 0.0
        print(f"pairwise_accuracy_real[{mode}]: {r.pairwise_accuracy:.3f}")
        print(f"trains_right_share_real[{mode}]: {share:.3f} ({r.trains_right} of {r.separated_sets} separated sets)")


def _eval_judge_open(
    settings: Settings, path: Path, modes: list[str], out: Path, batch: int, limit: int | None
) -> None:
    """`eval-judge --open`: the judge on open prompts, where the strong answer of each set should outrank the K policy
    answers (the pairs are strong-vs-policy only); beside it the length-only judge on the same pairs, the sets the
    judge ties, and how many generated items the verifier reads at all. Sets that carry a physicians' rubric
    (HealthBench) are scored under that rubric by the verifier instead: is the ideal completion first?"""
    import time

    from rich.table import Table

    from dynrubric import atomic
    from dynrubric.rubric.benchmark import (
        combine_scores,
        physician_rubrics,
        read_open_sets,
        summarise_open,
        summarise_physician,
    )
    from dynrubric.rubric.evaluator import Evaluator, generated_items_read

    sets = read_open_sets(path)
    if limit is not None:
        seen: Counter[str] = Counter()
        kept = []
        for s in sets:
            seen[s.source] += 1
            if seen[s.source] <= limit:
                kept.append(s)
        sets = kept
    judged = [s for s in sets if not s.rubric]  # ranked by the judge's own rubrics
    physician = [s for s in sets if s.rubric]  # ranked under the physicians' rubric
    generator, verifier = _judge_engines(settings)
    results, per_set, seconds = {}, [], {}
    physician_scores: list[list[float]] = []
    with Bars(console) as bars:
        for mode in modes if judged else []:
            config = settings.rubric.model_copy(update={"mode": mode})
            evaluator = Evaluator(generator, verifier, config)
            phase = f"sets judged ({mode})"
            bars.start(phase, len(judged))
            start = time.perf_counter()
            scored = _score_in_batches(evaluator, judged, batch, partial(bars.advance, phase))
            seconds[mode] = time.perf_counter() - start
            results[mode] = summarise_open(
                judged,
                [s.scores for s in scored],
                [s.trusted for s in scored],
                [generated_items_read(s.rubric, config.check_weight) for s in scored],
                [s.rubric_source for s in scored],
                config.eps,
            )
            per_set += [
                {"mode": mode, "source": js.source, "id": js.id, "passed": js.passed, **s.as_dict()}
                for js, s in zip(judged, scored, strict=True)
            ]
        if physician:
            evaluator = Evaluator(generator, verifier, settings.rubric)
            phase = "sets under the physicians' rubric"
            bars.start(phase, len(physician))
            start = time.perf_counter()
            for s in physician:
                parts = [(evaluator.apply_rubric(s.prompt, r, s.responses), w) for r, w in physician_rubrics(s.rubric)]
                physician_scores.append(combine_scores(parts))
                bars.advance(phase, 1)
            seconds["physician"] = time.perf_counter() - start
            per_set += [
                {
                    "mode": "physician",
                    "source": s.source,
                    "id": s.id,
                    "passed": s.passed,
                    "prompt": s.prompt,
                    "responses": s.responses,
                    "scores": x,
                }
                for s, x in zip(physician, physician_scores, strict=True)
            ]
    generator.close()
    if verifier is not generator:
        verifier.close()
    physician_result = summarise_physician(physician, physician_scores, settings.rubric.eps) if physician else None

    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(
        out / "eval_judge_open.json",
        json.dumps(
            {
                "sets_file": str(path),
                "results": {m: r.as_dict() for m, r in results.items()},
                "physician": physician_result.as_dict() if physician_result else None,
                "seconds": seconds,
                "sets": per_set,
            },
            indent=1,
        ),
    )
    sources = ", ".join(f"{n} {src}" for src, n in sorted(Counter(s.source for s in sets).items()))
    if results:
        table = Table(
            title=f"judge on open prompts: {path} ({sources}; pairs = strong answer vs each policy answer, "
            f"ties within {settings.rubric.eps:g} = 1/2, CI = 95% bootstrap over sets)"
        )
        for col in (
            "mode",
            "sets",
            "pairs",
            "pairwise acc [CI]",
            "length only [CI]",
            "strong first",
            "tied sets",
            "untrusted",
            "generated items read",
            "rubric sources",
            "seconds",
        ):
            table.add_column(col)
        for mode, r in results.items():
            table.add_row(
                mode,
                str(r.sets),
                str(r.pairs),
                f"{r.pairwise_accuracy:.3f} [{r.accuracy_ci[0]:.3f}, {r.accuracy_ci[1]:.3f}]",
                f"{r.length_baseline:.3f} [{r.length_ci[0]:.3f}, {r.length_ci[1]:.3f}]",
                str(r.strong_first),
                f"{r.tied_sets} ({r.tied_share:.2f})",
                str(r.untrusted_sets),
                f"{r.items_read}/{r.generated_items} ({r.items_read_share:.2f})",
                " ".join(f"{k}={v}" for k, v in r.rubric_sources.items()),
                f"{seconds[mode]:.0f}",
            )
        console.print(table)
    if physician_result is not None:
        p = physician_result
        table = Table(
            title="the verifier under the physicians' rubric (HealthBench): ideal completion vs policy answers"
        )
        for col in ("sets", "criteria", "ideal first [CI]", "pairwise acc [CI]", "length only", "tied sets", "seconds"):
            table.add_column(col)
        table.add_row(
            str(p.sets),
            str(p.items),
            f"{p.ideal_first} ({p.ideal_first_rate:.3f}) [{p.ideal_first_ci[0]:.3f}, {p.ideal_first_ci[1]:.3f}]",
            f"{p.pairwise_accuracy:.3f} [{p.accuracy_ci[0]:.3f}, {p.accuracy_ci[1]:.3f}]",
            f"{p.length_baseline:.3f}",
            str(p.tied_sets),
            f"{seconds['physician']:.0f}",
        )
        console.print(table)
    console.print(f"wrote {out / 'eval_judge_open.json'}", markup=False)
    for mode, r in results.items():
        print(
            f"pairwise_accuracy_open[{mode}]: {r.pairwise_accuracy:.3f} "
            f"(95% CI {r.accuracy_ci[0]:.3f}-{r.accuracy_ci[1]:.3f}; {r.sets} sets, {r.pairs} pairs)"
        )
        print(
            f"length_baseline_open[{mode}]: {r.length_baseline:.3f} "
            f"(95% CI {r.length_ci[0]:.3f}-{r.length_ci[1]:.3f}; the same pairs)"
        )
        print(f"tied_share_open[{mode}]: {r.tied_share:.3f} ({r.tied_sets} of {r.sets} sets)")
        print(
            f"items_read_share_open[{mode}]: {r.items_read_share:.3f} "
            f"({r.items_read} of {r.generated_items} generated items)"
        )
    if physician_result is not None:
        p = physician_result
        print(
            f"ideal_first_rate_physician: {p.ideal_first_rate:.3f} "
            f"(95% CI {p.ideal_first_ci[0]:.3f}-{p.ideal_first_ci[1]:.3f}; {p.ideal_first} of {p.sets} sets)"
        )


def _sample_real_sets(settings: Settings, path: Path, n: int) -> None:
    """K answers of the policy per held-out instruction prompt (the training sampling settings), each graded by
    the prompt's ground truth, written to `path`."""
    from dynrubric import atomic
    from dynrubric.engines import build_engine
    from dynrubric.seeds import derive_seed
    from dynrubric.train.policy_eval import CheckGrader, heldout_prompts
    from dynrubric.train.rounds import sample_sets

    chosen = [
        p
        for p in heldout_prompts(
            settings.model_copy(update={"evaluation": settings.evaluation.model_copy(update={"max_prompts": 10**9})})
        )
        if isinstance(p.grader, CheckGrader) and p.grader.truth.instructions
    ][:n]
    with status(console, f"loading the {settings.engine.kind} policy engine"):
        engine = build_engine(settings, "policy")
    lines = []
    with Bars(console) as bars:
        bars.start("prompts sampled", len(chosen))
        for i in range(0, len(chosen), 8):
            chunk = chosen[i : i + 8]
            _, outs = sample_sets(
                settings,
                engine,
                [p.prompt for p in chunk],
                settings.train.candidates,
                derive_seed(settings.train.seed, "real-sets", i),
            )
            for p, completions in zip(chunk, outs, strict=True):
                responses = [c.text for c in completions]
                lines.append(
                    json.dumps(
                        {
                            "prompt": p.prompt.question,
                            "responses": responses,
                            "passed": [p.grader.score(r) == 1.0 for r in responses],
                        }
                    )
                )
            bars.advance("prompts sampled", len(chunk))
    engine.close()
    atomic.write_text(path, "\n".join(lines) + "\n")
    console.print(f"wrote {len(lines)} sets of {settings.train.candidates} answers to {path}", markup=False)


def serve_reward(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option("--host", help="default: reward_server.host")] = None,
    port: Annotated[int | None, typer.Option("--port", help="default: reward_server.port")] = None,
) -> None:
    """Serve set-conditioned rewards to OpenRLHF (remote reward protocol, per-prompt group barrier)."""
    from dynrubric.ports import free_port
    from dynrubric.reward_server import build_app, log_to_stderr
    from dynrubric.service import serve

    settings = settings_of(ctx)
    cfg = settings.reward_server
    app = build_app(settings)
    log_to_stderr()
    host, port = host or cfg.host, cfg.port if port is None else port
    port = port or free_port()  # port 0: pick one here, so the line below names where it listens
    console.print(
        f"reward server on http://{host}:{port} (POST /reward, /get_reward, /score_sets): group size "
        f"{settings.train.candidates} (train.candidates = OpenRLHF's n_samples_per_prompt), group timeout "
        f"{cfg.group_timeout_s:g} s",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    serve(app, host, port)


def _judge_engines(settings: Settings) -> tuple[Engine, Engine]:
    """(rubric generator, verifier): one engine when both roles use the same model."""
    from dynrubric.engines import judge_engines

    with status(console, f"loading the {settings.engine.kind} engine"):
        return judge_engines(settings)


def _score_in_batches(
    evaluator: Evaluator, sets: Sequence[Any], batch: int, progress: Callable[[int], None]
) -> list[ScoredSet]:
    """`evaluator.score_sets` over `sets` (each with `prompt` and `responses`), `batch` sets a call."""
    scored: list[ScoredSet] = []
    for i in range(0, len(sets), batch):
        chunk = sets[i : i + batch]
        scored += evaluator.score_sets([s.prompt for s in chunk], [s.responses for s in chunk], progress=progress)
    return scored
