"""`dynrubric score STORE --ray`: the replay store built from the shipped traffic, scored through Ray
Data on two judge actors, scored Parquet out, with progress."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dynrubric.jsonl import split_lines
from tests.unit.test_score_command import REPO, score_env

SHIPPED = REPO / "dynrubric" / "data" / "prompts.jsonl"
UNSURE = "I am not sure."


def replay_store_of_shipped_traffic(root: Path, limit: int) -> int:
    """The shipped prompt file's first `limit` lines logged twice, as `up` ingests them: version base
    answered with the line's answer, version v1 with UNSURE. Returns the number of prompts."""
    from streaming.store import Stored, StoreWriter
    from streaming.traffic_replay import events_of_line

    lines = [json.loads(line) for line in split_lines(SHIPPED.read_text()) if line.strip()][:limit]
    writer = StoreWriter(root)
    offset = 0
    for k, (version, response) in enumerate((("base", None), ("v1", UNSURE))):
        stored = []
        for n, line in enumerate(lines):
            line = {**line, "response": response} if response else line
            now = 1_790_000_000.0 + 1000 * k + n  # v1 answered after base
            for event in events_of_line(line, policy_version=version, fresh_ids=True, now=now):
                stored.append(Stored(event, 0, offset))
                offset += 1
        writer.commit(stored)
    writer.close()
    return len(lines)


@pytest.mark.slow
def test_score_a_replay_store_on_ray_data(tiny_model_dir: Path, tmp_path: Path) -> None:
    n = replay_store_of_shipped_traffic(tmp_path / "replay", limit=12)  # 12 of the 60: CI time
    out = tmp_path / "rescored.parquet"
    env = {
        **score_env(tiny_model_dir),
        "DYNRUBRIC_RAY__NUM_CPUS": "2",
        "DYNRUBRIC_RAY__JUDGES": "2",
        "DYNRUBRIC_RAY__ACTOR_CPUS": "0.5",
    }
    r = subprocess.run(
        [str(Path(sys.executable).parent / "dynrubric"), "score", str(tmp_path / "replay"), "--ray", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    rows = pq.read_table(out).to_pylist()
    assert len(rows) == n and len({row["prompt_key"] for row in rows}) == n  # one set per logged prompt
    shipped = {
        line["messages"][-1]["content"]: line.get("answer", "")
        for line in map(json.loads, split_lines(SHIPPED.read_text())[:n])
    }
    for row in rows:  # both logged responses, in the order they were logged, each with a score in [0, 1]
        assert row["responses"] == [shipped[row["prompt"]], UNSURE], row
        assert len(row["scores"]) == 2 and all(0.0 <= s <= 1.0 for s in row["scores"])
        assert len(json.loads(row["verdicts"])) == len(json.loads(row["rubric"]))
    # piped: one plain progress line per scored set
    progress = [line for line in r.stdout.splitlines() if "] sets scored " in line]
    assert [line.rsplit(" ", 1)[1] for line in progress] == [f"{k}/{n}" for k in range(n + 1)]
    assert f"{n} sets scored on 2 judge actor(s)" in r.stdout
