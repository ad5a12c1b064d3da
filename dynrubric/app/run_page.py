"""The run report as one self-contained HTML page (the PNGs embedded as data URIs, and written beside it).

What a person checks after `dynrubric up`: per cycle the round and the rollout decision with its reason;
the training panels of `report.py` (reward and score gaps against the collapse thresholds, rubric-source
mix, KL, where each round's time went per stage); each rollout's gate power (what it could detect at the
traffic it started with, `serving.power`) and canary share of answered requests over time with the gate's
verdicts; latency
and feedback rates per arm and policy version; the alerts Prometheus fired during the run; the lineage
of policy versions. The page takes plain data (the composition root gathers it), so this module imports
no tier. No script runs in the page.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynrubric import atomic

VERDICT_COLOURS = {"pass": "tab:green", "fail": "tab:red", "inconclusive": "tab:gray"}


@dataclass
class RunPage:
    cycles: list[dict[str, Any]] = field(default_factory=list)  # loop.CycleResult as dicts
    rollouts: list[dict[str, Any]] = field(
        default_factory=list
    )  # id, version, baseline, status, reason, steps, started_at, updated_at
    gate_log: list[dict[str, Any]] = field(default_factory=list)  # {"ts", "rollout", "step", "verdict", "line"}
    lineage: list[dict[str, Any]] = field(default_factory=list)  # registry checkpoints as JSON
    requests: list[dict[str, Any]] = field(
        default_factory=list
    )  # {"ts", "request_id", "variant", "policy_version", "latency_ms", "shadow"}
    feedback: list[dict[str, Any]] = field(default_factory=list)  # {"request_id", "kind"}
    alerts: list[dict[str, Any]] = field(default_factory=list)  # {"alertname", "severity", "first", "last"}
    training_png: Path | None = None


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def rollout_figure(rollout: dict[str, Any], requests: list[dict[str, Any]], gates: list[dict[str, Any]]) -> bytes:
    """Canary share of the answered requests per time bin during the rollout, the configured steps, and
    each gate evaluation as a marker coloured by its verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end = rollout["started_at"], max(rollout["updated_at"], rollout["started_at"] + 1.0)
    rows = [r for r in requests if start <= r["ts"] <= end and not r.get("shadow")]
    width = max(2.0, (end - start) / 20)
    bins: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        b = bins[int((r["ts"] - start) // width)]
        b[0] += r["variant"] == "canary"
        b[1] += 1
    fig, ax = plt.subplots(figsize=(8, 3))
    if bins:
        xs = sorted(bins)
        ax.plot([(x + 0.5) * width for x in xs], [bins[x][0] / bins[x][1] for x in xs], "o-", label="canary share")
    for step, share in enumerate(rollout["steps"]):
        ax.axhline(share, color="black", linestyle="--", linewidth=0.8, label="configured steps" if step == 0 else None)
    for verdict, colour in VERDICT_COLOURS.items():
        points = [g for g in gates if g["verdict"] == verdict]
        if points:
            ax.scatter(
                [g["ts"] - start for g in points],
                [rollout["steps"][g["step"]] for g in points],
                color=colour,
                marker="s",
                zorder=3,
                label=f"gate: {verdict}",
            )
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds since the rollout started")
    ax.set_ylabel("share of requests (0..1)")
    ax.set_title(f"{rollout['id']}: {rollout['version']} vs {rollout['baseline']} -> {rollout['status']}")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    return _png(fig)


def arm_rows(requests: list[dict[str, Any]], feedback: list[dict[str, Any]]) -> list[list[str]]:
    """Per arm and policy version: requests, p50/p95 latency, thumbs-up share of rated, regenerate rate."""
    kinds: dict[str, set[str]] = defaultdict(set)
    for f in feedback:
        kinds[f["request_id"]].add(f["kind"])
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in requests:
        if not r.get("shadow"):
            groups[(r["variant"], r["policy_version"])].append(r)
    out = []
    for (variant, version), rs in sorted(groups.items()):
        latency = sorted(r["latency_ms"] for r in rs)
        p95 = latency[min(len(latency) - 1, int(0.95 * len(latency)))]
        rated = [r for r in rs if kinds[r["request_id"]] & {"thumbs_up", "thumbs_down"}]
        up = sum("thumbs_up" in kinds[r["request_id"]] for r in rated)
        regen = sum("regenerate" in kinds[r["request_id"]] for r in rs)
        out.append(
            [
                variant,
                version,
                str(len(rs)),
                f"{statistics.median(latency):.0f}",
                f"{p95:.0f}",
                f"{up / len(rated):.2f} of {len(rated)}" if rated else "-",
                f"{regen / len(rs):.2f}",
            ]
        )
    return out


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>" if rows else "<p>none</p>"


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


STYLE = """body{font-family:sans-serif;margin:24px;max-width:1100px;color:#222;background:#fff}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #bbb;padding:3px 8px;font-size:13px;
text-align:left}th{background:#eee}img{max-width:100%;border:1px solid #ddd;margin:6px 0}
.promoted{color:#161}.rolled_back,.failed{color:#a11}pre.plan{font-size:12px;background:#f6f6f6;padding:6px;
white-space:pre-wrap}"""


def figures_table(lineage: list[dict[str, Any]]) -> str:
    """Each evaluated candidate's five reported figures (its checkpoint's `figures` metric): the score of the
    candidate, its parent and the base, and the paired differences with their 95% CIs."""

    from dynrubric.train.policy_eval import FIGURE_TITLES

    def delta(c: dict[str, Any]) -> str:
        return f"{c['delta']:+.3f} ({c['low']:+.3f}..{c['high']:+.3f})"

    rows: list[list[str]] = []
    for ckpt in lineage:
        for name, f in ((ckpt.get("metrics") or {}).get("figures") or {}).items():
            v = ckpt["version"]
            rows.append(
                [
                    v,
                    FIGURE_TITLES.get(name, name),
                    str(f["prompts"]),
                    f"{f['score'][v]:.3f}",
                    f"{f['vs_parent']['reference']}: {delta(f['vs_parent'])}",
                    f"{f['vs_base']['reference']}: {delta(f['vs_base'])}",
                ]
            )
    if not rows:
        return "<p>no version evaluated on the test split yet</p>"
    return _table(["version", "figure", "prompts", "score", "vs parent (95% CI)", "vs base (95% CI)"], rows)


def render_html(page: RunPage, out: Path) -> Path:
    """Write `out` (run.html) and the PNGs it embeds beside it (`rollout-<id>.png`)."""
    parts = [
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>dynrubric run report</title>"
        f"<style>{STYLE}</style></head><body><h1>dynrubric run report</h1>"
    ]
    parts.append("<h2>Cycles</h2>")
    parts.append(
        _table(
            [
                "cycle",
                "round",
                "version",
                "round result",
                "rollout decision",
                "reason",
                "serving after",
                "registered -> canary serving",
            ],
            [
                [
                    c["cycle"],
                    c["round"],
                    c["version"],
                    c["round_state"],
                    c["decision"],
                    c["reason"],
                    c["serving"],
                    "-" if c["registered_to_canary_s"] is None else f"{c['registered_to_canary_s']:.1f} s",
                ]
                for c in page.cycles
            ],
        )
    )
    parts.append("<h2>Ground truth per version</h2>")
    parts.append(figures_table(page.lineage))
    parts.append("<h2>Training</h2>")
    if page.training_png is not None and page.training_png.is_file():
        parts.append(
            "<p>Reward, KL against the guard's limit, score gaps and non-splitting items against the "
            "collapse thresholds, rubric sources, generator reward, held-out reward per round.</p>"
        )
        parts.append(_img(page.training_png.read_bytes(), "training panels"))
    else:
        parts.append("<p>no training run log yet</p>")
    parts.append("<h2>Rollouts</h2>")
    for r in page.rollouts:
        gates = [g for g in page.gate_log if g["rollout"] == r["id"]]
        png = rollout_figure(r, page.requests, gates)
        atomic.write_bytes(out.parent / f"rollout-{r['id']}.png", png)
        parts.append(f"<h3 class={html.escape(r['status'])}>{html.escape(r['id'])}: {html.escape(r['status'])}</h3>")
        parts.append(f"<p>{html.escape(r.get('reason') or '')}</p>")
        plan = (r.get("plan") or {}).get("lines")
        parts.append(
            f"<pre class=plan>{html.escape(chr(10).join(plan))}</pre>"
            if plan
            else "<p>no gate power plan recorded (a rollout of an older version)</p>"
        )
        parts.append(_img(png, f"traffic share of {r['id']}"))
        parts.append(
            _table(["time", "gate evaluation"], [[f"{g['ts'] - r['started_at']:.0f} s", g["line"]] for g in gates])
        )
    if not page.rollouts:
        parts.append("<p>none</p>")
    parts.append("<h2>Arms: latency and feedback</h2>")
    parts.append(
        _table(
            [
                "arm",
                "policy version",
                "requests",
                "p50 latency ms",
                "p95 latency ms",
                "thumbs-up rate",
                "regenerate rate",
            ],
            arm_rows(page.requests, page.feedback),
        )
    )
    parts.append("<h2>Alerts Prometheus fired</h2>")
    parts.append(
        _table(
            ["alert", "severity", "first firing", "last firing"],
            [[a["alertname"], a.get("severity", ""), a["first"], a["last"]] for a in page.alerts],
        )
    )
    parts.append("<h2>Lineage of policy versions</h2>")
    parts.append(
        _table(
            ["version", "parent", "round", "state", "reason"],
            [
                [
                    c["version"],
                    c["parent"] or "-",
                    "-" if c["round"] is None else c["round"],
                    c["state"],
                    c.get("reason") or "",
                ]
                for c in page.lineage
            ],
        )
    )
    parts.append("</body></html>")
    atomic.write_text(out, "".join(parts))
    return out
