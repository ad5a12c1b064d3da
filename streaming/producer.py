"""The producer library the router uses to log requests and feedback to Kafka without ever blocking.

`send_*` only appends to a bounded local buffer and returns at once; a background thread hands the
buffer to kafka-python. When the buffer is full the event is dropped and counted
(`dynrubric_producer_dropped_total`); failed deliveries are counted
(`dynrubric_producer_delivery_errors_total`) and the last error is kept in `last_error`.
Records are keyed by request_id, so all events of one request land on one partition in order.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from dynrubric.config import KafkaConfig
from streaming.events import FeedbackEvent, QueryLogEvent
from streaming.kafka import Topics, connection_kwargs, ensure_topics, unreachable


@dataclass(frozen=True)
class _Record:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None = None


_STOP = object()


class EventProducer:
    """Non-blocking, bounded, keyed event producer. Thread-safe; one per process is enough."""

    def __init__(
        self,
        kafka: KafkaConfig,
        registry: CollectorRegistry | None = None,
        *,
        create_topics: bool = True,
    ):
        from kafka import KafkaProducer
        from kafka.errors import NoBrokersAvailable

        self.kafka = kafka
        self.topics = Topics.of(kafka)
        if create_topics:
            ensure_topics(kafka)
        try:
            self._producer = KafkaProducer(
                **connection_kwargs(kafka),
                acks="all",
                enable_idempotence=kafka.producer_idempotence,
                linger_ms=kafka.producer_linger_ms,
                retries=5,
                delivery_timeout_ms=kafka.producer_delivery_timeout_ms,
                request_timeout_ms=min(30_000, kafka.producer_delivery_timeout_ms - kafka.producer_linger_ms),
                max_block_ms=kafka.producer_delivery_timeout_ms,
                # without idempotence a retried batch could overtake the next one; keep order per key
                max_in_flight_requests_per_connection=1 if not kafka.producer_idempotence else 5,
            )
        except NoBrokersAvailable as e:
            raise unreachable(kafka, e) from None
        registry = registry if registry is not None else CollectorRegistry()
        self._errors = Counter(
            "dynrubric_producer_delivery_errors_total", "events whose delivery failed", ["topic"], registry=registry
        )
        self._dropped = Counter(
            "dynrubric_producer_dropped_total",
            "events dropped because the local buffer was full",
            ["topic"],
            registry=registry,
        )
        self._lock = threading.Lock()
        self.delivery_errors = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._buffer: queue.Queue = queue.Queue(maxsize=kafka.producer_buffer_events)
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name="event-producer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ API
    def send_query_log(self, event: QueryLogEvent) -> bool:
        """Queue one query-log event; False (and counted) when the local buffer is full."""
        return self.send_raw(self.topics.query_log, event.request_id.encode(), event.to_bytes())

    def send_feedback(self, event: FeedbackEvent) -> bool:
        """Queue one feedback event; False (and counted) when the local buffer is full."""
        return self.send_raw(self.topics.feedback, event.request_id.encode(), event.to_bytes())

    def send_raw(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None
    ) -> bool:
        """Queue any bytes (the traffic replayer and the dead-letter path use this)."""
        if self._closed:
            raise RuntimeError("EventProducer is closed")
        try:
            self._buffer.put_nowait(_Record(topic, key, value, headers))
            return True
        except queue.Full:
            with self._lock:
                self.dropped += 1
            self._dropped.labels(topic).inc()
            return False

    def flush(self, timeout_s: float | None = 30.0) -> None:
        """Block until every queued event was handed to Kafka and acknowledged (or failed, and counted)."""
        self._buffer.join()
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        self._buffer.put(_STOP)
        self._thread.join(timeout_s)
        self._producer.close(timeout=timeout_s)

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _drain(self) -> None:
        while True:
            record = self._buffer.get()
            try:
                if record is _STOP:
                    return
                future = self._producer.send(record.topic, key=record.key, value=record.value, headers=record.headers)
                future.add_errback(self._failed, record.topic)
            except Exception as e:  # serialization / buffer timeout: the event is lost, so count it
                self._failed(record.topic, e)
            finally:
                self._buffer.task_done()

    def _failed(self, topic: str, error: Exception) -> None:
        with self._lock:
            self.delivery_errors += 1
            self.last_error = f"{topic}: {type(error).__name__}: {error}"
        self._errors.labels(topic).inc()
