"""Ingest throughput: a bare consumer vs our whole pipeline on the same consumer library and topic.

Both read the same N query-log events with the same consumer settings, each in its own consumer
group, through `--client` (kafka-python, or confluent: librdkafka; `ingest.client`). "raw" only polls
and counts; "pipeline" is `streaming.ingest.Ingestor`: validate, filter,
scrub, dedupe, write Parquet shards, fsync (in its writer process), commit offsets. Rates count from
the first record read to the last record (raw) or the last offset commit (pipeline), so the group
join and the writer process's start are excluded.

    python benchmarks/ingest.py [--quick] [--events N] [--bootstrap HOST:PORT] [--client confluent] [--writers N]

The last lines are `events/s: N` (the pipeline's rate) and `ratio: X.XX` (pipeline rate / raw rate of the
same client; target >= 0.80). Before them, "validation alone" times `parse_records` on the same events in
this process, without Kafka or a store: no pipeline that validates each event can beat that rate, so its
ratio to raw (`ceiling: X.XX`) bounds the pipeline's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kafka import KafkaConsumer, KafkaProducer  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from dynrubric.config import IngestConfig, KafkaConfig  # noqa: E402
from streaming.broker import EmbeddedBroker  # noqa: E402
from streaming.events import QueryLogEvent, parse_records  # noqa: E402
from streaming.ingest import Ingestor  # noqa: E402
from streaming.kafka import Topics, connection_kwargs, ensure_topics  # noqa: E402

BATCH = IngestConfig().batch_max_records  # the pipeline's default batch; the raw consumer polls as many
SESSION_MS = 6000


def make_event(i: int) -> bytes:
    """A realistic query log: a system prompt, a question of ~200 chars, a response of ~600 chars;
    90% from the stable version, 10% from a canary (two policy versions, two shards per batch)."""
    return QueryLogEvent.model_validate(
        {
            "request_id": f"bench-{i}",
            "ts": 1795000000.0 + i,
            "user_key": f"u{i % 97}",
            "session_id": f"s{i % 31}",
            "variant": "stable" if i % 10 else "canary",
            "policy_version": "v1" if i % 10 else "v2",
            "model": "smollm2-135m",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant. Answer briefly and accurately."},
                {
                    "role": "user",
                    "content": f"Question {i}: " + "explain how tides depend on the moon and the sun, " * 4,
                },
            ],
            "response": f"Answer {i}: " + "Tides rise and fall because the moon's gravity pulls on the oceans. " * 9,
            "finish_reason": "stop",
            "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 256},
            "latency_ms": 120.0 + i % 50,
            "prompt_tokens": 60,
            "completion_tokens": 140,
        }
    ).to_bytes()


def produce(kafka: KafkaConfig, n: int) -> None:
    producer = KafkaProducer(**connection_kwargs(kafka), linger_ms=20, batch_size=256 * 1024, acks=1)
    topic = Topics.of(kafka).query_log
    for i in range(n):
        producer.send(topic, key=f"bench-{i}".encode(), value=make_event(i))
    producer.flush()
    producer.close()


def raw_rate(kafka: KafkaConfig, n: int, client: str) -> tuple[float, float]:
    if client == "confluent":
        return raw_confluent_rate(kafka, n)
    consumer = KafkaConsumer(
        Topics.of(kafka).query_log,
        **connection_kwargs(kafka),
        group_id=f"bench-raw-{uuid.uuid4().hex[:6]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=SESSION_MS,
        heartbeat_interval_ms=SESSION_MS // 3,
        max_poll_records=BATCH,
    )
    seen, first = 0, None
    while seen < n:
        polled = consumer.poll(timeout_ms=1000, max_records=BATCH)
        if polled and first is None:
            first = time.monotonic()
        seen += sum(len(records) for records in polled.values())
    assert first is not None  # seen > 0: a poll returned records
    seconds = time.monotonic() - first
    consumer.commit()
    consumer.close()
    return n / seconds, seconds


def raw_confluent_rate(kafka: KafkaConfig, n: int) -> tuple[float, float]:
    from confluent_kafka import Consumer

    from streaming.consumers import confluent_settings

    consumer = Consumer(
        {
            **confluent_settings(kafka),
            "group.id": f"bench-raw-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_MS,
            "heartbeat.interval.ms": SESSION_MS // 3,
        }
    )
    consumer.subscribe([Topics.of(kafka).query_log])
    seen, first = 0, None
    while seen < n:
        messages = consumer.consume(num_messages=BATCH, timeout=1.0)
        if messages and first is None:
            first = time.monotonic()
        seen += sum(1 for m in messages if m.error() is None)
    assert first is not None  # seen > 0: a consume returned records
    seconds = time.monotonic() - first
    consumer.commit(asynchronous=False)
    consumer.close()
    return n / seconds, seconds


def pipeline_rate(
    kafka: KafkaConfig, n: int, store: Path, client: Literal["kafka-python", "confluent"], writers: int
) -> tuple[float, float, str]:
    cfg = IngestConfig(
        group_id=f"bench-pipe-{uuid.uuid4().hex[:6]}",
        session_timeout_ms=SESSION_MS,
        batch_max_records=BATCH,
        client=client,
        writers=writers,
    )
    registry = CollectorRegistry()
    summary = Ingestor(kafka, cfg, store, registry).run(threading.Event(), until_idle_s=2.0)
    pauses = registry.get_sample_value("dynrubric_ingest_backpressure_pauses_total")
    if summary.written != n:
        raise SystemExit(f"pipeline wrote {summary.written} of {n} events")
    detail = (
        f"prepare {summary.prepare_seconds:.2f}s, store {summary.store_seconds:.2f}s, "
        f"{summary.batches} batches, {pauses:.0f} backpressure pauses"
    )
    return n / summary.busy_seconds, summary.busy_seconds, detail


def validation_rate(n: int, repeat: int) -> tuple[float, float]:
    """`parse_records` (the writer's first step: decode and check each event) over the benchmark's n events,
    in this process, best of `repeat`: the rate no pipeline that validates every event can exceed, whatever
    the client."""
    cfg = IngestConfig()
    values: list[bytes | None] = [make_event(i) for i in range(n)]
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for start in range(0, n, BATCH):
            parse_records(QueryLogEvent, values[start : start + BATCH], cfg.max_event_bytes, cfg.variants)
        best = min(best, time.perf_counter() - started)
    return n / best, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer events (CI)")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--bootstrap", default=None, help="an existing Kafka; default: start the embedded broker")
    ap.add_argument("--repeat", type=int, default=None, help="runs of each (best counts); default 2, 3 without --quick")
    ap.add_argument(
        "--client",
        choices=["kafka-python", "confluent"],
        default="kafka-python",
        help="the consumer library of both sides (ingest.client)",
    )
    ap.add_argument("--writers", type=int, default=1, help="the pipeline's writer processes (ingest.writers)")
    args = ap.parse_args()
    n = args.events or (6_000 if args.quick else 40_000)
    args.repeat = args.repeat or (2 if args.quick else 3)

    broker = None if args.bootstrap else EmbeddedBroker(port=0).start()
    raws, pipes = [], []
    try:
        kafka = KafkaConfig(
            bootstrap_servers=args.bootstrap if broker is None else broker.bootstrap_servers,
            topic_prefix=f"bench{uuid.uuid4().hex[:6]}.",
            topic_partitions=3,
        )
        ensure_topics(kafka)
        print(f"producing {n} query-log events ({len(make_event(0))} bytes each) to {kafka.bootstrap_servers}")
        produce(kafka, n)
        # alternate the two, best of `repeat` each: other processes on the machine add noise, never speed
        for i in range(args.repeat):
            raws.append(raw_rate(kafka, n, args.client))
            with tempfile.TemporaryDirectory() as tmp:
                pipes.append(pipeline_rate(kafka, n, Path(tmp) / "store", args.client, args.writers))
            print(f"run {i + 1}: raw {raws[-1][0]:.0f}/s, pipeline {pipes[-1][0]:.0f}/s ({pipes[-1][2]})")
    finally:
        if broker:
            broker.stop()
    raw, raw_s = max(raws)
    pipe, pipe_s, _ = max(pipes)
    valid, valid_s = validation_rate(n, args.repeat)  # no broker: after it stopped
    print(f"{'consumer (best of ' + str(args.repeat) + ')':<34}{'events':>8}{'seconds':>9}{'events/s':>10}")
    print(f"{'raw ' + args.client + ' poll':<34}{n:>8}{raw_s:>9.2f}{raw:>10.0f}")
    print(f"{f'pipeline ({args.writers} writer processes)':<34}{n:>8}{pipe_s:>9.2f}{pipe:>10.0f}")
    print(f"{'validation alone (parse_records)':<34}{n:>8}{valid_s:>9.2f}{valid:>10.0f}")
    print(f"ceiling: {valid / raw:.2f} (validation alone / raw: no validating pipeline's ratio can exceed it)")
    print(f"events/s: {pipe:.0f}")
    print(f"ratio: {pipe / raw:.2f}")


if __name__ == "__main__":
    main()
