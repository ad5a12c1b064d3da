"""EventProducer against the real embedded broker: keyed delivery, bounded buffer, counted failures."""

from __future__ import annotations

import time

from kafka import KafkaConsumer, TopicPartition
from prometheus_client import CollectorRegistry

from dynrubric.config import KafkaConfig
from streaming.broker import EmbeddedBroker, answers_kafka
from streaming.events import FEEDBACK_TOPIC, QUERY_LOG_TOPIC, FeedbackEvent, QueryLogEvent
from streaming.kafka import fetch_sizes
from streaming.producer import EventProducer


def query_event(request_id: str, **over) -> QueryLogEvent:
    fields = dict(
        request_id=request_id,
        ts=time.time(),
        user_key="u1",
        variant="stable",
        policy_version="v1",
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        response="hello",
        sampling={"temperature": 0.7, "top_p": 1.0, "max_tokens": 16},
        latency_ms=3.0,
        prompt_tokens=1,
        completion_tokens=1,
    )
    return QueryLogEvent(**{**fields, **over})


def read_all(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list:
    """Every record in `topic` up to its end at call time: reads until each partition's position reaches both
    its end offset and the high watermark the fetches report (Tansu's end_offsets can under-report, and an
    empty poll on a loaded machine is not the end), or fails after `timeout_s`."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **fetch_sizes(KafkaConfig().max_message_bytes),
    )  # the poison test's 1 MB event
    tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
    consumer.assign(tps)
    consumer.seek_to_beginning()
    end = consumer.end_offsets(tps)
    out = []
    deadline = time.monotonic() + timeout_s

    def at_end(tp) -> bool:
        high = consumer.highwater(tp)
        return high is not None and consumer.position(tp) >= max(end[tp], high)

    while not all(at_end(tp) for tp in tps):
        assert time.monotonic() < deadline, f"{topic}: read {len(out)} records, end offsets {end}"
        for records in consumer.poll(300).values():
            out.extend(records)
    consumer.close()
    return out


def test_embedded_broker_starts_answers_and_stops(tmp_path):
    with EmbeddedBroker(port=0, log_path=tmp_path / "t.log") as broker:
        host, port = broker.bootstrap_servers.split(":")
        assert answers_kafka(host, int(port))
        pid = broker.pid
    assert broker.proc.returncode is not None, "SIGTERM stopped it"
    assert not answers_kafka(host, int(port))
    assert pid and not (tmp_path / "missing").exists()


def test_events_are_delivered_keyed_by_request_id(kafka_broker):
    registry = CollectorRegistry()
    ids = [f"prod-{time.time_ns()}-{i}" for i in range(40)]
    with EventProducer(KafkaConfig(bootstrap_servers=kafka_broker), registry) as producer:
        for rid in ids:
            assert producer.send_query_log(query_event(rid))
            assert producer.send_feedback(FeedbackEvent(request_id=rid, ts=time.time(), user_key="u1", kind="copy"))
        producer.flush()
        assert producer.delivery_errors == 0 and producer.dropped == 0
    logged = [r for r in read_all(kafka_broker, QUERY_LOG_TOPIC) if r.key.decode() in ids]
    feedback = [r for r in read_all(kafka_broker, FEEDBACK_TOPIC) if r.key.decode() in ids]
    assert sorted(r.key.decode() for r in logged) == sorted(ids)
    assert all(QueryLogEvent.model_validate_json(r.value).request_id == r.key.decode() for r in logged)
    assert len(feedback) == len(ids)
    # same key, same partition (both topics have the same partition count)
    part_of = {r.key: r.partition for r in logged}
    assert all(part_of[r.key] == r.partition for r in feedback)


def test_oversized_event_is_a_counted_delivery_error(kafka_broker):
    registry = CollectorRegistry()
    with EventProducer(KafkaConfig(bootstrap_servers=kafka_broker), registry) as producer:
        assert producer.send_query_log(query_event("huge", response="x" * 2_000_000))
        producer.flush()
        assert producer.delivery_errors == 1
        assert "MessageSizeTooLarge" in producer.last_error
    assert registry.get_sample_value("dynrubric_producer_delivery_errors_total", {"topic": QUERY_LOG_TOPIC}) == 1


def test_full_buffer_drops_and_counts_instead_of_blocking(tmp_path):
    registry = CollectorRegistry()
    broker = EmbeddedBroker(port=0).start()
    cfg = KafkaConfig(
        bootstrap_servers=broker.bootstrap_servers, producer_buffer_events=2, producer_delivery_timeout_ms=2000
    )
    producer = EventProducer(cfg, registry)
    broker.stop()  # the broker goes away: the sender thread blocks, the local buffer fills
    started = time.monotonic()
    accepted = [producer.send_raw("never-seen-topic", b"k", b"v") for _ in range(100)]
    assert time.monotonic() - started < 1.0, "send must not block"
    assert accepted.count(False) >= 95
    assert producer.dropped == accepted.count(False)
    assert (
        registry.get_sample_value("dynrubric_producer_dropped_total", {"topic": "never-seen-topic"}) == producer.dropped
    )
    producer.close(timeout_s=5)
    assert producer.delivery_errors >= 1, "events that never reached the dead broker are counted as failed"
