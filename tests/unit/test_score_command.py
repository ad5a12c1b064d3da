"""`dynrubric score SETS.jsonl` end to end on the tiny model, and its errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dynrubric.jsonl import split_lines
from tests.reward_servers import judge_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "dynrubric" / "data" / "example_sets.jsonl"


def score_env(tiny_model_dir: Path) -> dict[str, str]:
    """The environment of a `dynrubric score` process judging with the tiny model."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        **judge_env(tiny_model_dir),
        "DYNRUBRIC_RUBRIC__CONSTRAINED": "false",  # unconstrained, the tiny random model writes noise
        "COLUMNS": "200",
    }


def run(args: list[str], tiny_model_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dynrubric", *args],
        cwd=cwd,
        env=score_env(tiny_model_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_score_writes_rubrics_verdicts_scores_and_gaps(tiny_model_dir, tmp_path):
    out = tmp_path / "scored.jsonl"
    r = run(["score", str(EXAMPLE), "--out", str(out)], tiny_model_dir, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in split_lines(out.read_text())]
    expected = [json.loads(line) for line in split_lines(EXAMPLE.read_text())]
    assert [x["prompt"] for x in lines] == [e["prompt"] for e in expected]
    for x in lines:
        k, m = len(x["responses"]), len(x["rubric"])
        assert len(x["scores"]) == k and len(x["verdicts"]) == m and all(len(row) == k for row in x["verdicts"])
        assert set(x["gaps"]) == {"mean_abs_gap", "spread", "std", "tie_rate", "item_split", "nonsplit_share"}
        assert x["rubric_source"] == "generic"  # the tiny random model never writes a valid rubric
    assert f"{len(expected)} sets scored" in r.stdout and "generic fallbacks 5" in r.stdout
    # piped: progress is one plain line per set as it happens, and no model-loading bars
    progress = [line for line in r.stdout.splitlines() if "] sets scored " in line]
    assert [line.rsplit(" ", 1)[1] for line in progress] == [f"{n}/{len(expected)}" for n in range(len(expected) + 1)]
    assert "Loading weights" not in r.stdout + r.stderr and "\r" not in r.stdout + r.stderr


def test_score_names_the_bad_line(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "responses": ["a"]}\n{"prompt": "x", "responses": "not a list"}\n')
    r = run(["score", str(bad)], tiny_model_dir, tmp_path)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "'responses'" in r.stderr
    r = run(["score", str(tmp_path / "missing.jsonl")], tiny_model_dir, tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr
