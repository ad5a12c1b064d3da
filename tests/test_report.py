from __future__ import annotations

import json

import pytest

from dynrubric.errors import DynrubricError
from dynrubric.report import read_runlog, render


def test_report_plots_a_run_log(tmp_path):
    log = tmp_path / "runlog.jsonl"
    records = []
    for step in range(4):
        records.append({"key": f"round/1/step/{step}", "kind": "step", "round": 1, "step": step, "phase": "policy",
                        "reward_mean": 0.4 + 0.05 * step, "kl": 0.001 * step, "mean_gap": 0.2 - 0.04 * step,
                        "tie_rate": 0.1, "nonsplit_share": 0.3, "fallbacks": {"generic": step, "parse_failures": 1}})
    records.append({"key": "round/1/step/4", "kind": "step", "round": 1, "step": 4, "phase": "generator",
                    "reward_mean": 0.1})
    records.append({"key": "round/1", "kind": "round", "round": 1, "version": "r1",
                    "guard": {"accepted": True}, "eval": {"reward_parent": 0.4, "reward_new": 0.55}})
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    parsed = read_runlog(log)
    assert (len(parsed.steps), len(parsed.generator_steps), len(parsed.rounds)) == (4, 1, 1)
    out = render(parsed, tmp_path / "report" / "run.png", 0.03, 0.8)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_or_corrupt_run_log_is_a_clear_error(tmp_path):
    with pytest.raises(DynrubricError, match="no run log"):
        read_runlog(tmp_path / "runlog.jsonl")
    (tmp_path / "runlog.jsonl").write_text('{"kind": "step"}\nnot json\n')
    with pytest.raises(DynrubricError, match="line 2"):
        read_runlog(tmp_path / "runlog.jsonl")
