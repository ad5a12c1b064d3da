"""The run report: the training run log as plots people look at.

Reads `runlog.jsonl` (one record per step and per round, written by train/rounds.py) and draws one
PNG: reward, KL, the score-gap diagnostics against the collapse thresholds, fallbacks, the
per-round held-out reward with each checkpoint's verdict, where each round's time went (seconds per
stage, stacked), the rollouts' rubric-judged online check (serving/judged.py): each rollout's
judged win rate with its always-valid bounds against the bar, and the decisions; and the
sampler-trainer mismatch per policy step (the engine's log-probs against the trainer's, and the
share of tokens whose importance weight was truncated).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from dynrubric import atomic
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.train.records import GeneratorStepLine, PolicyStepLine, RoundLine, parse_line


@dataclass(frozen=True)
class RunLog:
    steps: list[PolicyStepLine]  # in order
    generator_steps: list[GeneratorStepLine]
    rounds: list[RoundLine]


def read_runlog(path: Path) -> RunLog:
    """The run log's records (train/records.py), each checked: a line of another schema version, or with a
    field missing or changed, is an error naming the line and the field."""
    if not path.is_file():
        raise DynrubricError(
            f"no run log at {path}",
            "run `dynrubric up` first (it trains on the shipped prompts), or point DYNRUBRIC_PATHS__STATE_DIR "
            "at the state dir of an earlier run",
        )
    records = []
    for n, line in enumerate(split_lines(path.read_text()), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            raise DynrubricError(f"{path} line {n} is not JSON", "the run log is corrupt; restore it") from None
        records.append(parse_line(doc, f"{path} line {n}"))
    return RunLog(
        steps=[r for r in records if isinstance(r, PolicyStepLine)],
        generator_steps=[r for r in records if isinstance(r, GeneratorStepLine)],
        rounds=[r for r in records if isinstance(r, RoundLine)],
    )


def _series(records: Sequence[BaseModel], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for i, r in enumerate(records):
        value = getattr(r, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(i)
            ys.append(float(value))
    return xs, ys


@dataclass(frozen=True)
class Thresholds:
    """The lines the data is judged against (from the config the report is drawn under)."""

    collapse_min_mean_gap: float
    collapse_max_nonsplit_share: float
    collapse_window: int  # sets the collapse detector needs before it can fire
    max_kl: float  # the round guard's trust region on held-out KL(new || parent) (decides when dev cannot)
    tis_low: float  # the importance weight's truncation (grpo.tis_low, grpo.tis_high)
    tis_high: float


SOURCES = ("set", "prompt_only", "generic")
THRESHOLD = {"color": "black", "linestyle": "--", "linewidth": 1.0, "zorder": 1}
UNIT = (-0.03, 1.05)  # a 0..1 axis with room for markers drawn at 0 and at 1

# a round's stages as train/rounds.py records them (`stage_seconds`), in the order the time is spent
STAGES = {
    "setup": ("setup: models, engines, actors", "tab:gray"),
    "candidates": ("candidate generation", "tab:blue"),
    "rubrics": ("rubric generation", "tab:orange"),
    "verdicts": ("verification (verdicts)", "tab:green"),
    "policy_update": ("policy update", "tab:red"),
    "generator_rubrics": ("generator phase: rubric sampling + judging", "tab:olive"),
    "generator_update": ("generator update", "tab:brown"),
    "checkpoints": ("step checkpoints (save, reload engines)", "tab:pink"),
    "evaluate": ("held-out evaluation", "tab:purple"),
    "guard": ("guard + registration", "tab:cyan"),
}


def stage_times(rounds: list[RoundLine]) -> tuple[list[RoundLine], dict[str, list[float]]]:
    """The rounds that recorded where their time went, and each stage's seconds per such round: the
    known stages in order, then any other a round recorded, under its own name."""
    timed = [r for r in rounds if r.stage_seconds]
    names = [k for k in STAGES if any(k in r.stage_seconds for r in timed)]
    names += list(dict.fromkeys(k for r in timed for k in r.stage_seconds if k not in STAGES))
    return timed, {k: [float(r.stage_seconds.get(k, 0.0)) for r in timed] for k in names}


def draw_stage_times(ax, rounds: list[RoundLine]) -> None:
    """Per round, a bar of its stages' seconds stacked in the order they are spent, and the round's
    wall-clock time as a mark (above the bar: time no stage accounts for, such as the run log)."""
    timed, stages = stage_times(rounds)
    ax.set(title="where each round's time went (seconds per stage)", xlabel="round", ylabel="seconds")
    if not timed:
        ax.text(
            0.5,
            0.5,
            "no round recorded its stage times",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="grey",
        )
        return
    ids = [r.round for r in timed]
    bottom = [0.0] * len(ids)
    for name, values in stages.items():
        label, color = STAGES.get(name, (name, None))
        ax.bar(ids, values, bottom=bottom, color=color, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    walls = [(r.round, r.seconds) for r in timed]
    if walls:
        ax.scatter(
            [i for i, _ in walls],
            [w for _, w in walls],
            marker="_",
            s=500,
            color="black",
            zorder=3,
            label="round wall-clock time",
        )
    ax.set_xticks(ids)
    ax.set_ylim(0, max([*bottom, *(w for _, w in walls)]) * 1.6 or 1)  # headroom for the legend
    ax.legend(fontsize=8, loc="upper left", ncol=3, framealpha=0.6)


def sets_scored(steps: list[PolicyStepLine]) -> int:
    """Candidate sets the policy steps scored over the whole run: what the collapse detector saw (its
    window carries across rounds)."""
    return sum(sum(s.rubric_sources.values()) for s in steps)


@dataclass(frozen=True)
class JudgedRollout:
    """A rollout's judged online check as its last gate evaluation left it (`serving.gate._judged`'s numbers)."""

    rollout_id: str
    version: str
    status: str  # the rollout's: promoted, rolled_back, ...
    reason: str | None  # the rollout's (why it was rolled back)
    verdict: str  # the judged check's: pass or fail
    pairs: int
    win_rate: float
    lower: float
    upper: float
    bar: float  # 1/2 - judge_margin: an upper bound below it fails the canary

    def line(self) -> str:
        return (
            f"{self.rollout_id} ({self.version}): {self.status}; judged {self.verdict}: canary win rate "
            f"{self.win_rate:.2f} over {self.pairs} pairs, bounds [{max(self.lower, 0.0):.2f}, "
            f"{min(self.upper, 1.0):.2f}], fails below {self.bar:.2f}"
        )


def judged_rollouts(rollouts: Iterable[dict[str, Any]]) -> list[JudgedRollout]:
    """The rollouts (`serving.rollout.Rollout.to_json()`) whose last gate evaluation had judged pairs."""
    out = []
    for r in rollouts:
        checks = (r.get("last_gate") or {}).get("checks", [])
        check = next((c for c in checks if c.get("name") == "judged_win_rate"), None)
        n = (check or {}).get("numbers", {})
        if check is not None and n.get("pairs"):  # no check: no numbers
            out.append(
                JudgedRollout(
                    r["id"],
                    r["version"],
                    r["status"],
                    r.get("reason"),
                    check["verdict"],
                    int(n["pairs"]),
                    float(n["win_rate"]),
                    float(n["lower"]),
                    float(n["upper"]),
                    float(n["bar"]),
                )
            )
    return out


def draw_judged(plot, table, judged: Sequence[JudgedRollout]) -> None:
    """Win rate with its bounds per rollout against the bar (`plot`), and the decisions as text (`table`)."""
    plot.set(
        title="rollouts: rubric-judged canary win rate (shadow pairs)",
        xlabel="rollout",
        ylabel="canary win rate (0..1)",
        ylim=UNIT,
    )
    table.set_title("rollout decisions and the judged check")
    table.axis("off")
    if not judged:
        for ax in (plot, table):
            ax.text(
                0.5,
                0.5,
                "no rollout with judged pairs\n(serving.shadow_rate, rollout.judge)",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="grey",
            )
        return
    xs = list(range(len(judged)))
    for verdict, color in (("pass", "tab:green"), ("fail", "tab:red")):
        mine = [(x, j) for x, j in zip(xs, judged, strict=True) if j.verdict == verdict]
        if mine:  # bounds clipped to 0..1, where a win rate lives
            plot.errorbar(
                [x for x, _ in mine],
                [j.win_rate for _, j in mine],
                yerr=[
                    [j.win_rate - max(j.lower, 0.0) for _, j in mine],
                    [min(j.upper, 1.0) - j.win_rate for _, j in mine],
                ],
                fmt="o",
                capsize=4,
                color=color,
                zorder=3,
                label=f"judged check: {verdict}",
            )
    for bar in sorted({j.bar for j in judged}):
        plot.axhline(bar, label=f"fail: upper bound < {bar:.2f}", **THRESHOLD)
    plot.set_xticks(xs, [j.version for j in judged])
    plot.set_xlim(-0.5, len(judged) - 0.5)
    handles, labels = plot.get_legend_handles_labels()
    plot.legend(handles, labels, fontsize=8, loc="best", framealpha=0.6)
    table.text(
        0.0,
        1.0,
        # matplotlib's wrap=True wraps at the figure's edge, not the panel's: wrap to the panel's width by hand
        "\n".join(textwrap.fill(j.line(), width=80, subsequent_indent="    ") for j in judged),
        ha="left",
        va="top",
        transform=table.transAxes,
        fontsize=8,
    )


def draw_learning_curve(ax, rounds: list[RoundLine], line) -> list[int]:
    """Is the loop learning: per round, the held-out ground-truth pass rate (official checkers, computed
    answers; no judge) of the new checkpoint and of its parent, beside the judge's held-out reward. Returns
    the rounds drawn."""
    evaluated = [(r, r.eval) for r in rounds if r.eval is not None]
    ids = [r.round for r, _ in evaluated]
    truth = [(r, e.groundtruth) for r, e in evaluated if e.groundtruth is not None]
    if truth:
        # the parent as a ring around the new checkpoint's dot: equal rates stay visible as two marks
        line(
            ax,
            [r.round for r, _ in truth],
            [g.pass_rate[g.vs_parent.reference] for _, g in truth],
            color="grey",
            markerfacecolor="none",
            markersize=13,
            label="ground truth: parent",
        )
        for accepted, color in ((True, "tab:green"), (False, "tab:red")):
            mine = [(r, g) for r, g in truth if r.guard.accepted == accepted]
            if mine:
                ax.scatter(
                    [r.round for r, _ in mine],
                    [g.pass_rate[g.version] for _, g in mine],
                    color=color,
                    zorder=3,
                    label="ground truth: new checkpoint, " + ("accepted" if accepted else "rejected"),
                )
        last = max(r.round for r, _ in truth)
        for r, g in truth:
            # the last round's point is at the axis' right edge: its label goes to the point's left
            left = r.round == last and len(truth) > 1
            ax.annotate(
                f"{g.version} {g.vs_base.delta:+.2f} vs base",
                (r.round, g.pass_rate[g.version]),
                fontsize=7,
                xytext=(-4 if left else 4, 4),
                textcoords="offset points",
                ha="right" if left else "left",
            )
    line(
        ax,
        ids,
        [e.reward_new for _, e in evaluated],
        color="tab:blue",
        linestyle="--",
        marker="x",
        label="judge's held-out reward (not ground truth)",
    )
    ax.set(
        title="learning curve: held-out ground-truth pass rate per round",
        xlabel="round",
        ylabel="pass rate / reward (0..1)",
        ylim=UNIT,
    )
    return ids


def draw_mismatch(ratio_ax, capped_ax, steps: list[PolicyStepLine], t: Thresholds, line) -> None:
    """Per policy step, the sampler-trainer mismatch (`ratio_ax`, mean |log pi_old - log mu| per token)
    and the share of tokens whose importance weight was truncated (`capped_ax`, 0..1)."""
    import math

    xs, ratios = _series(steps, "sampler_log_ratio")
    line(ratio_ax, xs, ratios, color="tab:red", label="mean |log pi_old - log pi_sampler| per token")
    # a ratio outside the truncation band: |log ratio| beyond log(1 / tis_low) or log(tis_high)
    cap = min(-math.log(t.tis_low), math.log(t.tis_high))
    if xs:
        ratio_ax.axhline(
            cap, label=f"a token this far off is truncated (weight outside [{t.tis_low}, {t.tis_high}])", **THRESHOLD
        )
    ratio_ax.set(
        title="sampler vs trainer: log-prob mismatch per policy step",
        xlabel="policy step",
        ylabel="|log ratio| per token",
        ylim=(0, max([cap, *ratios]) * 1.25),
    )
    line(
        capped_ax,
        *_series(steps, "sampler_capped"),
        color="tab:orange",
        marker="^",
        label="tokens whose importance weight was truncated",
    )
    capped_ax.set(
        title="sampler vs trainer: truncated importance weights",
        xlabel="policy step",
        ylabel="share of tokens (0..1)",
        ylim=UNIT,
    )


def render(log: RunLog, out: Path, thresholds: Thresholds, judged: Sequence[JudgedRollout] = ()) -> Path:
    """Draw the report into `out` (PNG, written atomically) and return it."""
    import io

    fig = draw(log, thresholds, judged)
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    atomic.write_bytes(out, buffer.getvalue())
    return out


def draw(log: RunLog, thresholds: Thresholds, judged: Sequence[JudgedRollout] = ()):
    """The report's matplotlib figure: 4 x 2 panels, a full-width panel of where each round's time
    went, the rollouts' judged check, and the sampler-trainer mismatch (the last row).

    Rates and shares are drawn on a fixed 0..1 axis, so noise does not look like a trend; thresholds
    are dashed black lines named in the legend; each panel has one unit; a series of one or two points
    is drawn as markers only."""
    from dynrubric.extras import require

    require("matplotlib", "report", "`dynrubric report`").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    t = thresholds
    fig, axes = plt.subplots(7, 2, figsize=(13, 24.5))
    for ax in axes[4]:
        ax.remove()
    times = fig.add_subplot(axes[4][0].get_gridspec()[4, :])
    fig.suptitle(
        f"dynrubric run: {len(log.rounds)} rounds, {len(log.steps)} policy steps, "
        f"{len(log.generator_steps)} generator steps"
    )

    def line(ax, xs, ys, **kw):
        if not xs:
            return
        if len(xs) <= 2:
            kw["linestyle"] = "none"
        ax.plot(xs, ys, marker=kw.pop("marker", "o"), zorder=3, **kw)

    def finish(ax, empty_note: str | None = None):
        if empty_note is not None and not ax.has_data():
            ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes, color="grey")
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.6)

    ax = axes[0][0]
    line(ax, *_series(log.steps, "reward_mean"), color="tab:blue", label="mean set reward")
    ax.set(title="policy: mean set reward per step", xlabel="policy step", ylabel="reward (0..1)", ylim=UNIT)
    finish(ax, "no policy steps")

    ax = axes[0][1]
    xs, kl = _series(log.steps, "kl")
    line(ax, xs, kl, color="tab:red", label="k3 KL to the reference (training batch)")
    ax.axhline(t.max_kl, label=f"guard's trust region: held-out KL to parent {t.max_kl}", **THRESHOLD)
    top = max([t.max_kl, *kl]) * 1.15
    ax.set(
        title="KL per policy step (per token), axis from 0 to the guard",
        xlabel="policy step",
        ylabel="KL per token",
        ylim=(-0.03 * top, top),
    )
    finish(ax, "no policy steps")

    window_note = None
    sets = sets_scored(log.steps)
    if sets < t.collapse_window:
        window_note = (
            f"collapse detector: {sets} sets scored in this run,\n"
            f"it needs {t.collapse_window} in its window: too few to decide,\nso it could not fire"
        )

    ax = axes[1][0]
    line(ax, *_series(log.steps, "mean_gap"), color="tab:blue", label="mean |pairwise score gap|")
    line(ax, *_series(log.steps, "tie_rate"), color="tab:orange", marker="^", label="tie rate")
    ax.axhline(t.collapse_min_mean_gap, label=f"collapse: mean gap < {t.collapse_min_mean_gap}", **THRESHOLD)
    ax.set(title="score gaps within candidate sets", xlabel="policy step", ylabel="share / score (0..1)", ylim=UNIT)
    finish(ax, "no policy steps")

    ax = axes[1][1]
    line(ax, *_series(log.steps, "nonsplit_share"), color="tab:purple", label="non-splitting items")
    ax.axhline(t.collapse_max_nonsplit_share, label=f"collapse: share > {t.collapse_max_nonsplit_share}", **THRESHOLD)
    ax.set(title="share of rubric items that split nobody", xlabel="policy step", ylabel="share (0..1)", ylim=UNIT)
    finish(ax, "no policy steps")
    for ax in (axes[1][0], axes[1][1]):
        if window_note and log.steps:
            ax.text(
                0.98,
                0.5,
                window_note,
                ha="right",
                va="center",
                transform=ax.transAxes,
                fontsize=8,
                bbox={"facecolor": "lightyellow", "edgecolor": "grey"},
            )

    ax = axes[2][0]
    bottom = [0.0] * len(log.steps)
    colors = {"set": "tab:green", "prompt_only": "tab:orange", "generic": "tab:red"}
    for source in SOURCES:
        values = [float(s.rubric_sources.get(source, 0)) for s in log.steps]
        if any(values):
            ax.bar(range(len(values)), values, bottom=bottom, color=colors[source], label=f"rubric from: {source}")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    line(
        ax,
        *_series(log.steps, "untrusted_sets"),
        color="black",
        marker="X",
        label="untrusted: a calibration answer outranked a candidate (no advantage)",
    )
    ax.set(
        title="where each scored set's rubric came from; untrusted sets",
        xlabel="policy step",
        ylabel="sets",
        ylim=(0, max(bottom, default=0) * 1.3 or 1),
    )  # headroom for the legend
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    finish(ax, "no scored sets")

    ax = axes[2][1]
    failed = [float(s.fallbacks.parse_failures) for s in log.steps]
    if any(failed):
        ax.bar(range(len(failed)), failed, color="tab:gray", label="generator tries that gave no valid rubric")
    ax.set(
        title="failed rubric-generator tries per step",
        xlabel="policy step",
        ylabel="tries",
        ylim=(0, max(failed, default=0) * 1.3 or 1),
    )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    finish(ax, "no failed tries" if log.steps else "no policy steps")

    ax = axes[3][0]
    line(
        ax,
        *_series(log.generator_steps, "reward_mean"),
        color="tab:brown",
        marker="s",
        label="mean rubric reward (R_disc + ranking + format)",
    )
    line(
        ax,
        *_series(log.generator_steps, "gen_judge_user_agreement"),
        color="tab:cyan",
        marker="D",
        label="judge-user agreement: user-ranked pairs ordered as the users did (0..1)",
    )
    if _series(log.generator_steps, "gen_judge_user_agreement")[0]:
        ax.axhline(0.5, label="agreement of a coin flip", **THRESHOLD)
    ax.set(
        title="co-evolution: generator reward and the judge's agreement with users",
        xlabel="generator step",
        ylabel="reward / share",
    )
    finish(ax, "no generator steps in this run")

    ax = axes[3][1]
    ids = draw_learning_curve(ax, log.rounds, line)
    finish(ax, "no evaluated rounds")

    for ax in axes.flat:  # steps and rounds are counts: no 0.25-step ticks on short runs
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    draw_mismatch(axes[6][0], axes[6][1], log.steps, t, line)
    note = "no policy step carried the sampling engine's log-probs" if log.steps else "no policy steps"
    finish(axes[6][0], note)
    finish(axes[6][1], note)
    for ax in [*axes.flat[:6], *axes[6]]:  # the per-step panels share one x range, with room around the ends
        if log.steps:
            ax.set_xlim(-0.5, len(log.steps) - 0.5)
    if ids:
        axes[3][1].set_xticks(ids)  # one tick per round (the locator has no integer to show for a single round)
    generator_xs = _series(log.generator_steps, "reward_mean")[0]
    if generator_xs:  # likewise one tick per generator step, with room around the ends
        axes[3][0].set_xticks(sorted(set(generator_xs)))
        axes[3][0].set_xlim(min(generator_xs) - 0.5, max(generator_xs) + 0.5)
    draw_stage_times(times, log.rounds)
    draw_judged(axes[5][0], axes[5][1], judged)
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # the top 1.5 % of the figure is the run's title (suptitle)
    return fig
