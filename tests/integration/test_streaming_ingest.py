"""Ingest against the real embedded broker: exactly the valid events stored, exactly the malformed dead-lettered."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from kafka import KafkaProducer
from prometheus_client import CollectorRegistry

from dynrubric.config import IngestConfig, KafkaConfig
from streaming.events import DeadLetter, FeedbackEvent
from streaming.ingest import Ingestor
from streaming.kafka import Topics, ensure_topics
from streaming.store import FEEDBACK, ReplayStore
from tests.integration.test_streaming_producer import query_event
from tests.integration.test_streaming_producer import read_all as read_topic


def isolated(kafka_broker: str) -> KafkaConfig:
    """Own topics on the shared session broker."""
    return KafkaConfig(bootstrap_servers=kafka_broker, topic_prefix=f"t{uuid.uuid4().hex[:8]}.")


def ingest_cfg(**over) -> IngestConfig:
    base = dict(
        session_timeout_ms=6000, batch_max_records=25, batch_max_wait_ms=200, group_id=f"g-{uuid.uuid4().hex[:6]}"
    )
    return IngestConfig(**{**base, **over})


def run_ingest(kafka: KafkaConfig, cfg: IngestConfig, store, until_idle_s: float = 2.5):
    registry = CollectorRegistry()
    summary = Ingestor(kafka, cfg, store, registry).run(threading.Event(), until_idle_s=until_idle_s)
    return summary, registry


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_valid_events_stored_exactly_once_and_malformed_dead_lettered(kafka_broker, tmp_path, client):
    """The same outcome, counts, dead letters and committed offsets whichever consumer library reads."""
    kafka = isolated(kafka_broker)
    topics = Topics.of(kafka)
    ensure_topics(kafka)
    producer = KafkaProducer(bootstrap_servers=kafka_broker)
    n_valid = 60
    valid = [query_event(f"req-{i}", messages=[{"role": "user", "content": f"question {i}"}]) for i in range(n_valid)]
    valid[0] = query_event(
        "req-0", messages=[{"role": "user", "content": "mail me at ann@example.com or +1 555 123 4567"}]
    )
    for e in valid:
        producer.send(topics.query_log, key=e.request_id.encode(), value=e.to_bytes())
    for e in valid[:15]:  # the producer re-sends: same key, same bytes
        producer.send(topics.query_log, key=e.request_id.encode(), value=e.to_bytes())
    feedback = [
        FeedbackEvent(request_id=f"req-{i}", ts=1795000000.0 + i, user_key="u1", kind="thumbs_up") for i in range(10)
    ]
    for f in feedback + feedback[:3]:
        producer.send(topics.feedback, key=f.request_id.encode(), value=f.to_bytes())

    good = json.loads(valid[1].to_bytes())
    malformed = {
        "bad_json": [b"{not json", b"\xff\xfe\x00"],
        "schema": [json.dumps({**good, "messages": []}).encode(), json.dumps({**good, "latency_ms": "fast"}).encode()],
        "schema_version": [json.dumps({**good, "request_id": "v2", "schema_version": 2}).encode()],
        "oversize": [json.dumps({**good, "request_id": "big", "response": "x" * 5000}).encode()],
    }
    for values in malformed.values():
        for v in values:
            producer.send(topics.query_log, key=b"bad", value=v)
    producer.send(
        topics.feedback, key=b"bad", value=b'{"schema_version": 1, "kind": "thumbs_up"}'
    )  # schema violation on feedback
    malformed["schema"].append(b'{"schema_version": 1, "kind": "thumbs_up"}')
    filtered = [
        query_event("empty", messages=[{"role": "user", "content": "   "}]),
        query_event("denied", messages=[{"role": "user", "content": "please print the forbidden secret"}]),
    ]
    for e in filtered:
        producer.send(topics.query_log, key=e.request_id.encode(), value=e.to_bytes())
    producer.close()

    cfg = ingest_cfg(max_event_bytes=4096, deny_patterns=["forbid+en"], client=client)
    summary, registry = run_ingest(kafka, cfg, tmp_path / "store")

    store = ReplayStore(tmp_path / "store")
    ids = store.table()["request_id"].to_pylist()
    assert sorted(ids) == sorted(e.request_id for e in valid), "exactly the N valid events, once each"
    assert len(store.table(FEEDBACK)) == len(feedback)
    row0 = next(r for r in store.table().to_pylist() if r["request_id"] == "req-0")
    assert row0["prompt_text"] == "mail me at <email> or <phone>"

    m = sum(len(v) for v in malformed.values())
    letters = [DeadLetter.from_record(r.value, r.key, r.headers) for r in read_topic(kafka_broker, topics.dead_letter)]
    assert len(letters) == m, "exactly the M malformed events"
    by_reason = {}
    sources = {t: read_topic(kafka_broker, t) for t in (topics.query_log, topics.feedback)}
    for dl in letters:
        by_reason.setdefault(dl.reason, []).append(dl.raw)
        assert dl.error
        original = next(
            r for r in sources[dl.source_topic] if r.partition == dl.source_partition and r.offset == dl.source_offset
        )
        assert original.value == dl.raw, "the raw bytes and their source position"
    assert {k: sorted(v) for k, v in by_reason.items()} == {k: sorted(v) for k, v in malformed.items()}

    assert summary.written == n_valid + len(feedback)
    assert summary.duplicates == 15 + 3
    assert summary.filtered == 2 and summary.dead_lettered == m
    sample = registry.get_sample_value
    assert sample("dynrubric_ingest_written_total", {"topic": topics.query_log}) == n_valid
    assert sample("dynrubric_ingest_consumed_total", {"topic": topics.query_log}) == n_valid + 15 + m - 1 + 2
    assert sample("dynrubric_ingest_duplicates_total") == 18
    assert sample("dynrubric_ingest_dead_lettered_total", {"reason": "oversize"}) == 1
    assert sample("dynrubric_ingest_filtered_total", {"reason": "empty_prompt"}) == 1
    assert sample("dynrubric_ingest_filtered_total", {"reason": "denied"}) == 1
    assert sample("dynrubric_ingest_batch_latency_seconds_count") == summary.batches > 1
    lags = [
        s.value
        for metric in registry.collect()
        if metric.name == "dynrubric_ingest_lag_messages"
        for s in metric.samples
    ]
    assert lags and all(v == 0 for v in lags), "everything consumed was committed"

    # the same group again: its offsets were committed, so nothing is read twice
    resumed, _ = run_ingest(kafka, cfg, tmp_path / "store", until_idle_s=1.5)
    assert resumed.consumed == 0

    # a new consumer group re-reads the topics from the start: the persistent index drops every record
    again, _ = run_ingest(
        kafka, ingest_cfg(max_event_bytes=4096, deny_patterns=["forbid+en"], client=client), tmp_path / "store"
    )
    assert again.written == 0 and again.duplicates == n_valid + 15 + len(feedback) + 3
    assert sorted(ReplayStore(tmp_path / "store").table()["request_id"].to_pylist()) == sorted(ids)
