"""`dynrubric up`, the README's main job, end to end on the tiny model: a real broker, real ingest into
the replay store, a real training round reading prompts from that store, the registry, the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_up_runs_the_loop_from_traffic_to_checkpoint_and_report(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    env.update({
        "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path / "var"),
        "DYNRUBRIC_MODELS__POLICY": str(tiny_model_dir),
        "DYNRUBRIC_MODELS__GENERATOR": str(tiny_model_dir),
        "DYNRUBRIC_MODELS__VERIFIER": str(tiny_model_dir),
        "DYNRUBRIC_RUBRIC__GENERATOR_MAX_TOKENS": "24",
        "DYNRUBRIC_RUBRIC__RETRIES": "0",
        "DYNRUBRIC_RUBRIC__PROMPT_ONLY_RETRIES": "0",
        "COLUMNS": "200",
    })
    run = subprocess.run([sys.executable, "-m", "dynrubric", "up", "--rounds", "1"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "written 60" in run.stdout  # every shipped prompt went through Kafka into the store

    listed = subprocess.run([sys.executable, "-m", "dynrubric", "registry", "list", "--json"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    versions = {c["version"]: c for c in map(json.loads, listed.stdout.splitlines())}
    assert set(versions) == {"base", "r1"}
    assert versions["r1"]["parent"] == "base"

    summary = json.loads((tmp_path / "var" / "train" / "rounds" / "0001" / "summary.json").read_text())
    assert summary["prompts"] > 0 and summary["watermark_after"] not in (None, "0")
    # the demo round co-evolves: one policy step, then one generator step
    assert summary["phases"] == {"policy": 1, "generator": 1}
    steps = [json.loads(line) for line in (tmp_path / "var" / "train" / "runlog.jsonl").read_text().splitlines()]
    [policy] = [s for s in steps if s.get("kind") == "step" and s.get("phase") == "policy"]
    # a set whose anchors outrank a candidate contributes no advantage: it is counted among the tied sets
    assert 0 <= policy["untrusted_sets"] <= policy["tied_sets"]
    assert (tmp_path / "var" / "report" / "run.png").read_bytes()[:4] == b"\x89PNG"
