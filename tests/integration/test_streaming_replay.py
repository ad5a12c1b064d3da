"""The shipped prompt file, its checkers, the traffic replayer and the broker CLI, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streaming.prompt_bank import PromptItem, check, default_path, load_prompts
from streaming.store import FEEDBACK, ReplayStore
from streaming.traffic_replay import replay
from tests.integration.test_streaming_ingest import ingest_cfg, isolated, run_ingest

REPO = Path(__file__).resolve().parents[2]


def test_shipped_prompts_are_hundreds_of_distinct_checkable_prompts():
    items = load_prompts()
    assert len(items) >= 500 and len({i.id for i in items}) == len(items)
    assert len({i.question for i in items}) == len(items)
    kinds = {k: [i for i in items if i.kind == k] for k in ("arithmetic", "instruction")}
    assert all(len(v) >= 100 for v in kinds.values())
    # built from the official instruction descriptions: many instruction ids, and the file states exactly what
    # the text asks (PromptItem's validator re-derives it from the question)
    ids = {ins.id for i in kinds["instruction"] for ins in i.instructions}
    assert len(ids) >= 15 and all(i.instructions for i in kinds["instruction"])
    arith = kinds["arithmetic"][0]
    answer = f"{arith.answer:g}"
    assert check(arith, answer) and check(arith, f"So the answer is {answer}.")
    assert not check(arith, "I do not know") and not check(arith, str(int(arith.answer) + 1))


def test_a_prompt_line_cannot_claim_a_ground_truth_its_text_does_not_state():
    def item(content, **fields):
        return PromptItem(id="x", messages=[{"role": "user", "content": content}], **fields)

    assert item("What is 2 + 3?", kind="arithmetic", answer=5).answer == 5
    with pytest.raises(ValueError, match="computes to"):
        item("What is 2 + 3?", kind="arithmetic", answer=6)
    with pytest.raises(ValueError, match="instructions"):
        item("Describe a cat.", kind="instruction", instructions=[{"id": "punctuation:no_comma", "kwargs": {}}])
    with pytest.raises(ValueError, match="checkable instruction"):
        item("Describe a cat.", kind="instruction")
    assert check(item("Describe a cat.", kind="open"), "anything") is None


def test_replay_the_prompt_file_into_the_store(kafka_broker, tmp_path):
    kafka = isolated(kafka_broker)
    extra = tmp_path / "extra.jsonl"
    extra.write_text(
        '{"prompt": "What is 2 + 2?", "response": "4", "request_id": "fixed-1", "feedback": ["thumbs_up", "copy"]}\n'
        '{"kind": "dwell", "request_id": "fixed-1", "value": 4.5}\n'
    )
    stats = replay(kafka, default_path(), rate=0, policy_version="v2", repeat=2)
    assert stats.query_logs == 2 * len(load_prompts()) and stats.dropped == 0 and stats.delivery_errors == 0
    stats = replay(kafka, extra, rate=200)
    assert (stats.query_logs, stats.feedback) == (1, 3)
    summary, _ = run_ingest(kafka, ingest_cfg(), tmp_path / "store")
    store = ReplayStore(tmp_path / "store")
    assert len(store.table()) == 2 * len(load_prompts()) + 1
    assert len(store.table(FEEDBACK)) == 3
    prompts, _ = store.new_prompts(0)
    assert len(prompts) == len(load_prompts()) + 1, "repeated prompts share a prompt key"
    fixed = next(p for p in prompts if p.request_id == "fixed-1")
    [response] = store.responses_by_version(fixed.prompt_key)["v0"]
    assert sorted(f.kind for f in response.feedback) == ["copy", "dwell", "thumbs_up"]


def test_broker_cli_start_status_stop(tmp_path):
    env = {**os.environ, "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path), "DYNRUBRIC_BROKER__PORT": "0"}

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "dynrubric", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )

    assert cli("broker", "status").returncode == 1
    started = cli("broker", "start")
    assert started.returncode == 0, started.stderr
    assert (tmp_path / "broker" / "tansu.pid").exists()
    again = cli("broker", "start")
    assert again.returncode == 2 and "already running" in again.stderr
    status = cli("broker", "status")
    assert status.returncode == 0 and "answers" in status.stdout
    pid = int((tmp_path / "broker" / "tansu.pid").read_text())
    stopped = cli("broker", "stop")
    assert stopped.returncode == 0 and f"stopped broker pid {pid}" in stopped.stdout
    assert not Path(f"/proc/{pid}").exists() or b"tansu" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert cli("broker", "status").returncode == 1
