"""A client that is not ours (confluent-kafka, i.e. librdkafka) produces events our ingest accepts and
reads our dead-letter topic, headers included.

Debian's kcat 1.7.1 (librdkafka 2.0.2) cannot be used: its ApiVersionRequest fails against Tansu 0.6
("Read underflow"), with or without api.version.request, measured here.
"""

from __future__ import annotations

import json

from confluent_kafka import Consumer, Producer

from streaming.kafka import Topics, ensure_topics
from streaming.store import ReplayStore
from tests.integration.test_streaming_ingest import ingest_cfg, isolated, run_ingest


def event(request_id: str) -> dict:
    """Written by hand from the JSON Schema, not by our pydantic models."""
    return {
        "schema_version": 1,
        "request_id": request_id,
        "ts": 1795000000.5,
        "user_key": "u-x",
        "session_id": None,
        "variant": "stable",
        "policy_version": "v7",
        "model": "m",
        "messages": [{"role": "user", "content": "hi " + request_id}],
        "response": "hello",
        "finish_reason": "stop",
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8},
        "latency_ms": 1.0,
        "prompt_tokens": 2,
        "completion_tokens": 1,
    }


def test_confluent_kafka_produces_events_we_accept_and_reads_our_dead_letters(kafka_broker, tmp_path):
    kafka = isolated(kafka_broker)
    topics = Topics.of(kafka)
    ensure_topics(kafka)

    producer = Producer({"bootstrap.servers": kafka_broker, "enable.idempotence": True})
    for i in range(5):
        producer.produce(topics.query_log, key=f"cf-{i}", value=json.dumps(event(f"cf-{i}")).encode())
    producer.produce(topics.query_log, key="cf-bad", value=b"not json from librdkafka")
    producer.produce(
        topics.feedback, key="cf-fb", value=json.dumps({"schema_version": 1, "request_id": "cf-0"}).encode()
    )
    producer.produce(topics.query_log, key="cf-v9", value=json.dumps({**event("cf-v9"), "schema_version": 9}).encode())
    assert producer.flush(10) == 0
    del producer

    summary, _ = run_ingest(kafka, ingest_cfg(), tmp_path / "store")
    assert summary.written == 5 and summary.dead_lettered == 3
    stored = ReplayStore(tmp_path / "store").table()["request_id"].to_pylist()
    assert sorted(stored) == ["cf-0", "cf-1", "cf-2", "cf-3", "cf-4"]

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_broker,
            "group.id": "foreign-reader",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
        }
    )
    consumer.subscribe([topics.dead_letter])
    letters = []
    for _ in range(60):
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            letters.append((msg.key(), msg.value(), dict(msg.headers() or [])))
        if len(letters) == 3:
            break
    consumer.close()
    reasons = {key: headers["dlq.reason"].decode() for key, _, headers in letters}
    assert reasons == {b"cf-bad": "bad_json", b"cf-fb": "schema", b"cf-v9": "schema_version"}
    raw = {key: value for key, value, _ in letters}
    assert raw[b"cf-bad"] == b"not json from librdkafka"
    assert all(h["dlq.source.topic"].decode() in (topics.query_log, topics.feedback) for _, _, h in letters)
