from __future__ import annotations

import json
import struct

import pytest

from dynrubric.errors import DynrubricError
from dynrubric.report import figure, read_runlog, render


def _run_log(tmp_path):
    records = []
    for step in range(4):
        records.append({"key": f"round/1/step/{step}", "kind": "step", "round": 1, "step": step, "phase": "policy",
                        "reward_mean": 0.4 + 0.05 * step, "kl": 0.001 * step, "mean_gap": 0.2 - 0.04 * step,
                        "tie_rate": 0.1, "nonsplit_share": 0.3 + 0.1 * step,
                        "fallbacks": {"generic": step, "parse_failures": 1}})
    records.append({"key": "round/1/step/4", "kind": "step", "round": 1, "step": 4, "phase": "generator",
                    "reward_mean": 0.1})
    records.append({"key": "round/1", "kind": "round", "round": 1, "version": "r1",
                    "guard": {"accepted": True}, "eval": {"reward_parent": 0.4, "reward_new": 0.55}})
    records.append({"key": "round/2", "kind": "round", "round": 2, "version": "r2",
                    "guard": {"accepted": False}, "eval": {"reward_parent": 0.55, "reward_new": 0.3}})
    log = tmp_path / "runlog.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return read_runlog(log)


def _lines(ax) -> dict[str, list[float]]:
    return {line.get_label(): [float(y) for y in line.get_ydata()] for line in ax.get_lines()}


def test_report_panels_show_the_run_logs_numbers(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    parsed = _run_log(tmp_path)
    assert (len(parsed.steps), len(parsed.generator_steps), len(parsed.rounds)) == (4, 1, 2)
    fig = figure(parsed, 0.03, 0.8)
    try:
        (reward, kl), (gaps, nonsplit), (fallbacks, rounds) = fig.axes[:2], fig.axes[2:4], fig.axes[4:6]
        assert _lines(reward)["policy: mean set reward"] == pytest.approx([0.4, 0.45, 0.5, 0.55])
        assert _lines(reward)["generator: mean reward"] == pytest.approx([0.1])
        assert list(_lines(kl).values()) == [pytest.approx([0.0, 0.001, 0.002, 0.003])]
        assert _lines(gaps)["mean |pairwise gap|"] == pytest.approx([0.2, 0.16, 0.12, 0.08])
        assert _lines(gaps)["collapse: gap < 0.03"] == pytest.approx([0.03, 0.03])  # the threshold drawn
        assert _lines(nonsplit)["non-splitting items"] == pytest.approx([0.3, 0.4, 0.5, 0.6])
        assert _lines(nonsplit)["collapse: share > 0.8"] == pytest.approx([0.8, 0.8])
        # stacked bars: one container per fallback kind, each stacked on the ones before
        generic, parse = fallbacks.containers
        assert [b.get_height() for b in generic] == [0, 1, 2, 3] and [b.get_y() for b in generic] == [0, 0, 0, 0]
        assert [b.get_height() for b in parse] == [1, 1, 1, 1] and [b.get_y() for b in parse] == [0, 1, 2, 3]
        assert _lines(rounds)["parent"] == pytest.approx([0.4, 0.55])
        assert _lines(rounds)["new checkpoint"] == pytest.approx([0.55, 0.3])
        verdicts = [(float(c.get_offsets()[0][1]), to_hex(c.get_facecolor()[0])) for c in rounds.collections]
        assert verdicts == [(0.55, to_hex("tab:green")), (0.3, to_hex("tab:red"))]  # accepted, rejected
        assert list(rounds.get_xticks()) == [1, 2]
    finally:
        plt.close(fig)
    out = render(parsed, tmp_path / "report" / "run.png", 0.03, 0.8)
    header = out.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (13 * 90, 11 * 90)  # the 13x11 in figure at 90 dpi


def test_missing_or_corrupt_run_log_is_a_clear_error(tmp_path):
    with pytest.raises(DynrubricError, match="no run log"):
        read_runlog(tmp_path / "runlog.jsonl")
    (tmp_path / "runlog.jsonl").write_text('{"kind": "step"}\nnot json\n')
    with pytest.raises(DynrubricError, match="line 2"):
        read_runlog(tmp_path / "runlog.jsonl")
