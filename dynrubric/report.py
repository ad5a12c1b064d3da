"""The run report: the training run log as plots people look at.

Reads `runlog.jsonl` (one record per step and per round, written by train/rounds.py) and draws one
PNG: reward, KL, the score-gap diagnostics against the collapse thresholds, fallbacks, and the
per-round held-out reward with each checkpoint's verdict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynrubric import atomic
from dynrubric.errors import DynrubricError


@dataclass(frozen=True)
class RunLog:
    steps: list[dict[str, Any]]  # policy steps, in order
    generator_steps: list[dict[str, Any]]
    rounds: list[dict[str, Any]]


def read_runlog(path: Path) -> RunLog:
    if not path.is_file():
        raise DynrubricError(f"no run log at {path}", "run `dynrubric train round` (or `dynrubric up`) first")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise DynrubricError(f"{path} line {n} is not JSON", "the run log is corrupt; restore it") from None
    steps = [r for r in records if r.get("kind") == "step"]
    return RunLog(
        steps=[s for s in steps if s.get("phase", "policy") == "policy"],
        generator_steps=[s for s in steps if s.get("phase") == "generator"],
        rounds=[r for r in records if r.get("kind") == "round"],
    )


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for i, r in enumerate(records):
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(i)
            ys.append(float(value))
    return xs, ys


def figure(log: RunLog, min_mean_gap: float, max_nonsplit_share: float):
    """The report as a matplotlib Figure: 3x2 panels (reward, KL, score gaps, non-splitting items,
    fallbacks, held-out reward per round)."""
    from dynrubric.extras import require

    require("matplotlib", "report", "`dynrubric report`").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(3, 2, figsize=(13, 11))
    fig.suptitle(f"dynrubric run: {len(log.rounds)} rounds, {len(log.steps)} policy steps, "
                 f"{len(log.generator_steps)} generator steps")

    ax = axes[0][0]
    ax.plot(*_series(log.steps, "reward_mean"), marker="o", label="policy: mean set reward")
    ax.plot(*_series(log.generator_steps, "reward_mean"), marker="s", label="generator: mean reward")
    ax.set(title="reward per step", xlabel="step", ylabel="reward")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    ax.plot(*_series(log.steps, "kl"), marker="o", color="tab:red")
    ax.set(title="KL to the reference (k3) per policy step", xlabel="step", ylabel="KL")

    ax = axes[1][0]
    ax.plot(*_series(log.steps, "mean_gap"), marker="o", label="mean |pairwise gap|")
    ax.axhline(min_mean_gap, color="tab:red", linestyle="--", label=f"collapse: gap < {min_mean_gap}")
    ax.plot(*_series(log.steps, "tie_rate"), marker="^", label="tie rate")
    ax.set(title="score gaps within candidate sets", xlabel="step", ylim=(0, 1))
    ax.legend(fontsize=8)

    ax = axes[1][1]
    ax.plot(*_series(log.steps, "nonsplit_share"), marker="o", color="tab:purple", label="non-splitting items")
    ax.axhline(max_nonsplit_share, color="tab:red", linestyle="--", label=f"collapse: share > {max_nonsplit_share}")
    ax.set(title="share of rubric items that split nobody", xlabel="step", ylim=(0, 1))
    ax.legend(fontsize=8)

    ax = axes[2][0]
    kinds = sorted({k for s in log.steps for k in (s.get("fallbacks") or {})})
    bottom = [0.0] * len(log.steps)
    for kind in kinds:
        values = [float((s.get("fallbacks") or {}).get(kind, 0)) for s in log.steps]
        ax.bar(range(len(values)), values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(title="evaluator fallbacks per step", xlabel="step", ylabel="count")
    if kinds:
        ax.legend(fontsize=8)

    ax = axes[2][1]
    rounds = [r for r in log.rounds if isinstance((r.get("eval") or {}).get("reward_new"), (int, float))]
    ids = [r["round"] for r in rounds]
    ax.plot(ids, [r["eval"]["reward_parent"] for r in rounds], color="grey", marker="x", label="parent")
    ax.plot(ids, [r["eval"]["reward_new"] for r in rounds], color="tab:blue", alpha=0.5, label="new checkpoint")
    for r in rounds:
        accepted = (r.get("guard") or {}).get("accepted", True)
        ax.scatter(r["round"], r["eval"]["reward_new"], color="tab:green" if accepted else "tab:red", zorder=3)
        ax.annotate(str(r.get("version", "")), (r["round"], r["eval"]["reward_new"]), fontsize=7)
    ax.set(title="held-out reward per round (green accepted, red rejected)", xlabel="round", ylabel="reward")
    ax.legend(fontsize=8)
    rounds_axis = ax

    for ax in axes.flat:  # steps and rounds are counts: no 0.25-step ticks on short runs
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ids:
        rounds_axis.set_xticks(ids)  # one tick per round (the locator has no integer to show for a single round)
    fig.tight_layout()
    return fig


def render(log: RunLog, out: Path, min_mean_gap: float, max_nonsplit_share: float) -> Path:
    """Draw the report into `out` (PNG, written atomically) and return it."""
    import io

    import matplotlib.pyplot as plt

    fig = figure(log, min_mean_gap, max_nonsplit_share)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    atomic.write_bytes(out, buffer.getvalue())
    return out
