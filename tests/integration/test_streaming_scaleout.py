"""Scale-out: two `dynrubric ingest` processes in one consumer group, over a query-log topic of 4
partitions on the real broker, share the partitions and one replay store (`ingest.shared_store`), and
store every event exactly once, with librdkafka's consumer (`ingest.client: confluent`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

from dynrubric.config import KafkaConfig
from streaming.events import DeadLetter
from streaming.kafka import Topics, ensure_topics
from streaming.store import ReplayStore
from tests.integration.test_streaming_producer import query_event
from tests.integration.test_streaming_producer import read_all as read_topic

REPO = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(
    r"ingest stopped: consumed (\d+), written (\d+), duplicates (\d+), dead-lettered (\d+), "
    r"filtered (\d+)"
)


def wait_ready(proc: subprocess.Popen, lines: list[str], timeout: float = 60) -> str:
    """The metrics URL the process announced, once its /readyz says it holds partitions."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ingest exited: {proc.stderr.read()[-2000:]}"
        urls = [m.group(1) for line in lines if (m := re.search(r"metrics at (http://\S+)/metrics", line))]
        if urls:
            try:
                if httpx.get(urls[0] + "/readyz", timeout=2).status_code == 200:
                    return urls[0]
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"ingest did not get partitions within {timeout:.0f} s: {lines}")


def partitions_written(url: str, topic: str) -> set[int]:
    """The partitions of `topic` this process committed batches of (it reports their lag)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("dynrubric_ingest_lag_messages{")]
    return {int(re.search(r'partition="(\d+)"', line).group(1)) for line in lines if f'topic="{topic}"' in line}


def test_two_ingest_processes_in_one_group_store_every_event_once(kafka_broker, tmp_path):
    kafka = KafkaConfig(bootstrap_servers=kafka_broker, topic_prefix=f"t{uuid.uuid4().hex[:8]}.", topic_partitions=4)
    topics = Topics.of(kafka)
    ensure_topics(kafka)
    store = tmp_path / "store"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",  # the metrics URL line arrives while the process runs
        "COLUMNS": "1000",  # rich does not wrap the lines parsed here
        "DYNRUBRIC_KAFKA__BOOTSTRAP_SERVERS": kafka_broker,
        "DYNRUBRIC_KAFKA__TOPIC_PREFIX": kafka.topic_prefix,
        "DYNRUBRIC_KAFKA__TOPIC_PARTITIONS": "4",
        "DYNRUBRIC_INGEST__GROUP_ID": f"scale-{uuid.uuid4().hex[:6]}",
        "DYNRUBRIC_INGEST__CLIENT": "confluent",
        "DYNRUBRIC_INGEST__SHARED_STORE": "true",
        "DYNRUBRIC_INGEST__SESSION_TIMEOUT_MS": "6000",
        "DYNRUBRIC_INGEST__BATCH_MAX_RECORDS": "200",
        "DYNRUBRIC_INGEST__BATCH_MAX_WAIT_MS": "200",
        "DYNRUBRIC_INGEST__METRICS_PORT": "0",
    }
    procs, outputs = [], []
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynrubric", "ingest", "--store", str(store), "--until-idle", "8"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True).start()
        procs.append(proc)
        outputs.append(lines)
    try:
        urls = [wait_ready(p, lines) for p, lines in zip(procs, outputs, strict=True)]
        # the second member's join moved partitions: wait until the group has settled with both
        deadline = time.monotonic() + 60
        while not all(httpx.get(u + "/readyz", timeout=2).status_code == 200 for u in urls):
            assert time.monotonic() < deadline, "the group did not settle"
            time.sleep(0.2)

        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=kafka_broker, linger_ms=5)
        valid = [query_event(f"so-{i}", messages=[{"role": "user", "content": f"question {i}"}]) for i in range(3000)]
        for round_ in range(3):  # in three waves, so that both processes are busy at once
            for e in valid[round_ * 1000 : (round_ + 1) * 1000]:
                producer.send(topics.query_log, key=e.request_id.encode(), value=e.to_bytes())
            for e in valid[round_ * 1000 : round_ * 1000 + 100]:  # a producer retry: same key, same bytes
                producer.send(topics.query_log, key=e.request_id.encode(), value=e.to_bytes())
            producer.send(topics.query_log, key=f"bad-{round_}".encode(), value=b"{not json %d" % round_)
            producer.flush()
            time.sleep(1.0)
        producer.close()
        held = [partitions_written(u, topics.query_log) for u in urls]
        results = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
    assert results == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    assert sorted(map(len, held)) == [2, 2] and held[0] | held[1] == {0, 1, 2, 3}, (
        f"the group split the 4 partitions between the two processes: {held}"
    )

    summaries = [tuple(map(int, SUMMARY.search(" ".join(lines)).groups())) for lines in outputs]
    consumed, written, duplicates, dead, filtered = (sum(col) for col in zip(*summaries, strict=True))
    assert all(s[0] > 0 for s in summaries), f"both processes consumed: {summaries}"
    assert consumed == written + duplicates + filtered + dead == 3000 + 300 + 3
    assert (written, dead) == (3000, 3)

    stored = ReplayStore(store).table()["request_id"].to_pylist()
    assert len(stored) == len(set(stored)) == 3000, "every event stored, none twice"
    assert set(stored) == {e.request_id for e in valid}
    letters = [DeadLetter.from_record(r.value, r.key, r.headers) for r in read_topic(kafka_broker, topics.dead_letter)]
    assert sorted(dl.raw for dl in letters) == [b"{not json %d" % i for i in range(3)]
    assert not list((store / ".writers").glob("*.lock")), "each writer removed its own lock at exit"
