"""Crash test: kill -9 the real `python -m dynrubric ingest` process 10 times while events flow.

Afterwards every produced event is in the store exactly once: nothing lost, nothing duplicated.
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaProducer

from streaming.events import FeedbackEvent
from streaming.kafka import Topics, ensure_topics
from streaming.store import FEEDBACK, ReplayStore
from tests.integration.test_streaming_ingest import isolated
from tests.integration.test_streaming_producer import query_event

REPO = Path(__file__).resolve().parents[2]


class Traffic(threading.Thread):
    """Sends query logs (and some feedback) at a steady rate; re-sends some of them, as a retrying producer would."""

    def __init__(self, bootstrap: str, topics: Topics, rate: float = 100.0):
        super().__init__(daemon=True)
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        self.topics = topics
        self.rate = rate
        self.stop = threading.Event()
        self.request_ids: list[str] = []
        self.feedback: set[tuple[str, str, float]] = set()

    def run(self) -> None:
        rng = random.Random(7)
        i = 0
        while not self.stop.is_set():
            rid = f"crash-{i}"
            e = query_event(rid, messages=[{"role": "user", "content": f"what is {i} + {i}?"}], response=str(2 * i))
            self.producer.send(self.topics.query_log, key=rid.encode(), value=e.to_bytes())
            self.request_ids.append(rid)
            if rng.random() < 0.1:  # a re-send of an earlier event
                j = rng.randrange(len(self.request_ids))
                old = query_event(
                    f"crash-{j}",
                    messages=[{"role": "user", "content": f"what is {j} + {j}?"}],
                    response=str(2 * j),
                    ts=e.ts,
                )
                self.producer.send(self.topics.query_log, key=old.request_id.encode(), value=old.to_bytes())
            if i % 5 == 0:
                fb = FeedbackEvent(request_id=rid, ts=1795000000.0 + i, user_key="u1", kind="thumbs_up", value=1.0)
                for _ in range(1 + (i % 10 == 0)):  # every second one twice
                    self.producer.send(self.topics.feedback, key=rid.encode(), value=fb.to_bytes())
                self.feedback.add((rid, fb.kind, fb.ts))
            i += 1
            time.sleep(1 / self.rate)
        self.producer.flush()
        self.producer.close()


def shard_count(store: Path) -> int:
    try:
        with sqlite3.connect(store / "index.sqlite", timeout=5) as db:
            return db.execute("SELECT COUNT(*) FROM shards").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_kill_9_ten_times_loses_and_duplicates_nothing(kafka_broker, tmp_path):
    kafka = isolated(kafka_broker)
    topics = Topics.of(kafka)
    ensure_topics(kafka)
    store = tmp_path / "store"
    env = {
        **os.environ,
        "DYNRUBRIC_KAFKA__BOOTSTRAP_SERVERS": kafka_broker,
        "DYNRUBRIC_KAFKA__TOPIC_PREFIX": kafka.topic_prefix,
        "DYNRUBRIC_INGEST__GROUP_ID": f"crash-{uuid.uuid4().hex[:6]}",
        # a killed member holds its partitions until its session expires, and a Tansu join waits half of
        # it: 3 s (not the 6 s of the other tests) makes each of the ten restarts ~6 s instead of ~15 s
        "DYNRUBRIC_INGEST__SESSION_TIMEOUT_MS": "3000",
        "DYNRUBRIC_INGEST__BATCH_MAX_RECORDS": "100",
        "DYNRUBRIC_INGEST__BATCH_MAX_WAIT_MS": "150",
        "DYNRUBRIC_INGEST__METRICS_PORT": "0",
        "PYTHONPATH": str(REPO),
    }
    command = [sys.executable, "-m", "dynrubric", "ingest", "--store", str(store)]

    def spawn(*extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            command + list(extra), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    traffic = Traffic(kafka_broker, topics)
    traffic.start()
    rng = random.Random(1234)
    # The next process is started before the current one is killed: it imports and then waits for the
    # store lock (ingest.store_lock_wait_s), so each restart costs a group join, not a Python start-up.
    env["DYNRUBRIC_INGEST__STORE_LOCK_WAIT_S"] = "120"
    proc = spawn()
    try:
        for _ in range(10):
            before = shard_count(store)
            deadline = time.monotonic() + 60
            while shard_count(store) == before and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert proc.poll() is None, f"ingest exited early: {proc.communicate()[1][-2000:]}"
            assert shard_count(store) > before, "ingest wrote nothing within 60 s"
            standby = spawn()
            time.sleep(rng.uniform(0.0, 1.0))  # a random point while batches are being written and committed
            proc.kill()
            proc.communicate()
            proc = standby
        before = shard_count(store)
        deadline = time.monotonic() + 60
        while shard_count(store) == before and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        traffic.stop.set()
        traffic.join(30)
        proc.terminate()  # SIGTERM while consuming: finish the open batch, commit, exit 0
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "ingest stopped" in out

    # drain what is left with big batches (small ones, above, give the kills more places to land)
    env["DYNRUBRIC_INGEST__BATCH_MAX_RECORDS"] = "2000"
    final = subprocess.run(
        command + ["--until-idle", "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert final.returncode == 0, final.stderr[-2000:]
    assert "ingest stopped" in final.stdout

    reader = ReplayStore(store)
    stored = reader.table()["request_id"].to_pylist()
    assert len(stored) == len(set(stored)), "no request stored twice"
    assert set(stored) == set(traffic.request_ids), "no request lost"
    fb = reader.table(FEEDBACK).to_pylist()
    assert len(fb) == len(traffic.feedback)
    assert {(r["request_id"], r["kind"], r["ts"]) for r in fb} == traffic.feedback
    assert not [p for p in store.rglob("*") if p.name.endswith(".tmp")], "no temp files left behind"
    assert len(list(store.rglob("*.parquet"))) == reader.shard_count(), "no unregistered shard files"
