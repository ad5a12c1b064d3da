"""`dynrubric ingest`: Kafka -> validated, filtered, scrubbed, deduplicated replay store.

One consumer in the group `ingest.group_id` (kafka-python or librdkafka's confluent-kafka, `ingest.client`;
`streaming/consumers.py`), manual commits. Several ingest processes in one group share the topics'
partitions; with `ingest.shared_store` they write one store. The main thread polls and collects
raw records into batches; a hand-off thread passes each batch to the writer process
(`streaming/writer_process.py`: validate, filter, scrub, dedupe, store; see `streaming/store.py` for
why that is exactly-once) and sends the malformed records it names to the dead-letter topic
(`streaming/dead_letters.py`: cut to a sendable size, never twice for one source record).
Offsets of a batch are committed only after its shards are durable and its dead letters
acknowledged. When the writer falls behind by `ingest.max_pending_batches`, the consumer stops polling
until it catches up.

No record stops ingest: each consumed record ends in exactly one of stored, duplicate, filtered or
dead-lettered (with a reason), `consumed == stored + duplicates + filtered + dead_lettered`. Every
finished batch is checked against it (`dynrubric_ingest_unaccounted_total` counts any record that
was not), and so is the whole run at a clean shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynrubric.config import IngestConfig, KafkaConfig
from dynrubric.errors import DynrubricError
from streaming.consumers import Fetched, Partition, make_consumer
from streaming.dead_letters import DeadLetterSender
from streaming.kafka import Topics, ensure_topics, unreachable
from streaming.store import QUERY_LOG
from streaming.writer_process import FEEDBACK_KIND, QUERY_LOG_KIND, RawBatch, WriterPool, WrittenBatch

log = logging.getLogger(__name__)
QUIET_S = 0.1  # a poll this long that returns nothing closes a batch that is at least a quarter full
COMMIT_POLL_S = 0.02  # longest poll while a batch is with the writer (offsets are committed between polls)


class IngestMetrics:
    """The ingest rows of monitoring/README.md, on the service's own registry."""

    def __init__(self, registry: CollectorRegistry):
        self.consumed = Counter(
            "dynrubric_ingest_consumed_total", "records read from Kafka", ["topic"], registry=registry
        )
        self.written = Counter(
            "dynrubric_ingest_written_total", "records written to the replay store", ["topic"], registry=registry
        )
        self.dead_lettered = Counter(
            "dynrubric_ingest_dead_lettered_total",
            "records sent to the dead-letter topic",
            ["reason"],
            registry=registry,
        )
        self.duplicates = Counter(
            "dynrubric_ingest_duplicates_total", "records dropped as duplicate request_id", registry=registry
        )
        self.filtered = Counter(
            "dynrubric_ingest_filtered_total", "records dropped by filters", ["reason"], registry=registry
        )
        self.lag = Gauge(
            "dynrubric_ingest_lag_messages",
            "high-watermark minus committed offset",
            ["topic", "partition"],
            registry=registry,
        )
        self.batch_latency = Histogram(
            "dynrubric_ingest_batch_latency_seconds",
            "time to process one batch until its commit",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.pauses = Counter(
            "dynrubric_ingest_backpressure_pauses_total",
            "times the consumer stopped polling because the writer lagged",
            registry=registry,
        )
        self.unaccounted = Counter(
            "dynrubric_ingest_unaccounted_total",
            "records of finished batches that ended in none of stored/duplicate/filtered/dead-lettered (always 0)",
            registry=registry,
        )
        self.dlq_already_sent = Counter(
            "dynrubric_ingest_dead_letters_already_sent_total",
            "dead letters not sent again: the dead-letter topic already held them (a batch redelivered after a crash)",
            registry=registry,
        )


@dataclass
class Batch:
    started: float
    records: RawBatch = field(default_factory=RawBatch)
    keys: list[bytes | None] = field(default_factory=list)  # Kafka keys, for dead letters
    topics: list[str] = field(default_factory=list)  # source topics, for dead letters
    offsets: dict[Partition, int] = field(default_factory=dict)  # next offset to consume

    @property
    def size(self) -> int:
        return len(self.records)


@dataclass
class IngestSummary:
    consumed: int = 0
    written: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    filtered: int = 0
    batches: int = 0
    prepare_seconds: float = 0.0  # writer processes (summed): validate, filter, scrub
    store_seconds: float = 0.0  # writer processes (summed): dedupe, Parquet, fsync, index commit
    first_record_at: float | None = None  # time.monotonic() of the first record read
    last_commit_at: float | None = None  # time.monotonic() of the last offset commit

    @property
    def unaccounted(self) -> int:
        """consumed - (stored + duplicates + filtered + dead_lettered): 0 once every batch is finished."""
        return self.consumed - self.written - self.duplicates - self.filtered - self.dead_lettered

    @property
    def busy_seconds(self) -> float:
        """From the first record read to the last commit: the pipeline's time, without the group join."""
        if self.first_record_at is None or self.last_commit_at is None:
            return 0.0
        return self.last_commit_at - self.first_record_at


class Ingestor:
    """The ingest loop. `run()` returns when `stop` is set, or after `until_idle_s` without records."""

    def __init__(
        self,
        kafka: KafkaConfig,
        cfg: IngestConfig,
        store_dir: Path,
        registry: CollectorRegistry,
    ):
        self.kafka = kafka
        self.cfg = cfg
        self.store_dir = Path(store_dir)
        self.topics = Topics.of(kafka)
        self.kind_of_topic = {self.topics.query_log: QUERY_LOG_KIND, self.topics.feedback: FEEDBACK_KIND}
        self.topic_of_kind = {QUERY_LOG: self.topics.query_log, "feedback": self.topics.feedback}
        self.metrics = IngestMetrics(registry)
        self.summary = IngestSummary()
        self.assigned = threading.Event()
        self.consuming = threading.Event()
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._batch: Batch | None = None  # being filled by the consumer thread
        self._in_flight = 0  # submitted to the writer, not yet committed
        self._lagging = False  # the writer lags: the loop does not poll
        self._committed: dict[Partition, int] = {}  # last committed offset

    # ------------------------------------------------------------ lifecycle
    def run(self, stop: threading.Event, until_idle_s: float | None = None) -> IngestSummary:
        from kafka.errors import NoBrokersAvailable

        ensure_topics(self.kafka)
        self.writer = WriterPool(self.store_dir, self.cfg)  # before Kafka: a standby waits here for the store
        if self.writer.removed_orphans:
            log.warning("removed %d unregistered shard files left by a crash", self.writer.removed_orphans)
        try:
            self.dlq = DeadLetterSender(self.kafka, self.cfg, self.topics.dead_letter)
            self.consumer = make_consumer(self.kafka, self.cfg)
        except NoBrokersAvailable as e:
            self.writer.close()
            raise unreachable(self.kafka, e) from None
        except BaseException:
            self.writer.close()
            raise
        self.consumer.subscribe(list(self.kind_of_topic), self._on_assigned, self._on_revoked)
        self.consuming.set()
        writer_thread = threading.Thread(target=self._write_loop, name="ingest-handoff", daemon=True)
        writer_thread.start()
        try:
            self._loop(stop, until_idle_s)
            self._drain()
        finally:
            self._todo.put(None)
            writer_thread.join(30)
            self.consumer.close()
            self.dlq.close()
            self.writer.close()
        if self.summary.unaccounted:
            s = self.summary
            raise DynrubricError(
                f"ingest lost track of {s.unaccounted} records: consumed {s.consumed} != stored {s.written} + "
                f"duplicates {s.duplicates} + filtered {s.filtered} + dead-lettered {s.dead_lettered}",
                "this is a bug in ingest; report it with the log (the offsets of those records were committed)",
            )
        return self.summary

    def _loop(self, stop: threading.Event, until_idle_s: float | None) -> None:
        wait_s = self.cfg.batch_max_wait_ms / 1000
        last_record = time.monotonic()
        while not stop.is_set():
            self._finish_done(block=False)
            if self._apply_backpressure():
                self._finish_done(block=True)  # paused: wait for the writer rather than poll for nothing
                continue
            batch = self._batch
            room = self.cfg.batch_max_records - (batch.size if batch else 0)
            timeout = wait_s if batch is None else max(0.0, batch.started + wait_s - time.monotonic())
            if batch is not None and batch.size >= self.cfg.batch_max_records // 4:
                timeout = min(timeout, QUIET_S)  # a well-filled batch closes as soon as the stream goes quiet
            if self._in_flight:
                timeout = min(timeout, COMMIT_POLL_S)  # commit a written batch promptly even when the stream is idle
            polled = self.consumer.poll(timeout, room)
            now = time.monotonic()
            if polled:
                last_record = now
                if self.summary.first_record_at is None:
                    self.summary.first_record_at = now
                self._batch = self._batch or Batch(started=now)
                self._collect(self._batch, polled)
            elif not self.assigned.is_set() or self._in_flight:
                last_record = now
            batch = self._batch
            quiet = not polled and batch is not None and batch.size >= self.cfg.batch_max_records // 4
            if batch and (quiet or batch.size >= self.cfg.batch_max_records or now - batch.started >= wait_s):
                self._submit()
            if until_idle_s is not None and self._batch is None and now - last_record >= until_idle_s:
                break

    def _drain(self) -> None:
        """Submit the open batch, then wait for every submitted batch to be written and committed."""
        if self._batch is not None:
            self._submit()
        while self._in_flight:
            self._finish_done(block=True)

    # ------------------------------------------------------------ the consumer thread
    def _collect(self, batch: Batch, polled: list[Fetched]) -> None:
        for f in polled:
            n = len(f.offsets)
            self.metrics.consumed.labels(f.topic).inc(n)
            self.summary.consumed += n
            batch.offsets[(f.topic, f.partition)] = f.offsets[-1] + 1
            kind = self.kind_of_topic[f.topic]
            batch.records.extend(kind, f.partition, f.offsets, f.values)
            batch.keys.extend(f.keys)
            batch.topics.extend([f.topic] * n)

    def _submit(self) -> None:
        self._in_flight += 1
        self._todo.put(self._batch)
        self._batch = None

    def _apply_backpressure(self) -> bool:
        """True while the writer lags by more than `ingest.max_pending_batches`: the loop stops polling.

        Not polling is the pause. The client's own prefetch buffer bounds what is read meanwhile
        (kafka-python: one fetch response per broker; librdkafka: `queued.max.messages.kbytes`). Pausing
        the partitions instead made librdkafka drop its prefetched records and fetch them again on resume,
        which cost more than the writer's work did (docs/benchmarks.md)."""
        lagging = self._in_flight > self.cfg.max_pending_batches
        if lagging and not self._lagging:  # counted once per stop
            self.metrics.pauses.inc()
        self._lagging = lagging
        return lagging

    def _finish_done(self, block: bool) -> None:
        """Commit the offsets of every batch the writer has made durable (in order)."""
        while True:
            try:
                batch, outcome = self._done.get(block=block, timeout=60 if block else None)
            except queue.Empty:
                if block:
                    raise DynrubricError(
                        "the replay-store writer made no progress for 60 s", "check the disk under ingest.store_dir"
                    ) from None
                return
            block = False
            self._in_flight -= 1
            if isinstance(outcome, BaseException):
                raise outcome
            try:
                self.consumer.commit(batch.offsets)
                self._committed.update(batch.offsets)
            except Exception as e:  # a rebalance took the partitions: the new owner re-reads, the index dedupes
                log.warning("offset commit failed (%s); records will be redelivered and deduplicated", e)
            self._account(batch, outcome)
            self.summary.last_commit_at = time.monotonic()

    def _account(self, batch: Batch, written: WrittenBatch) -> None:
        missing = batch.size - written.accounted()
        if missing:
            log.error("a batch of %d records accounted for %d", batch.size, written.accounted())
            self.metrics.unaccounted.inc(missing)
        result = written.result
        for kind, n in result.written.items():
            self.metrics.written.labels(self.topic_of_kind[kind]).inc(n)
            self.summary.written += n
        self.metrics.duplicates.inc(result.duplicates)
        self.summary.duplicates += result.duplicates
        for _, reason, _ in written.dead:
            self.metrics.dead_lettered.labels(reason).inc()
        self.summary.dead_lettered += len(written.dead)
        for reason, n in written.filtered.items():
            self.metrics.filtered.labels(reason).inc(n)
            self.summary.filtered += n
        self.summary.prepare_seconds += written.prepare_seconds
        self.summary.store_seconds += written.store_seconds
        self.summary.batches += 1
        self.metrics.batch_latency.observe(time.monotonic() - batch.started)
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None and tp in self._committed:
                self.metrics.lag.labels(tp[0], str(tp[1])).set(max(0, high - self._committed[tp]))

    # ------------------------------------------------------------ rebalances (run inside poll)
    def _on_revoked(self, revoked: list[Partition]) -> None:
        """Before partitions move to another consumer, finish and commit what was read from them."""
        self.assigned.clear()
        self._drain()

    def _on_assigned(self, assigned: list[Partition]) -> None:
        self.dlq.remember_sent(self.kind_of_topic)  # uncommitted records may come back: their letters were sent
        for tp in assigned:
            committed = self.consumer.committed(tp)
            self._committed[tp] = committed if committed is not None else 0
        self.assigned.set()

    # ------------------------------------------------------------ the hand-off thread
    def _write_loop(self) -> None:
        """Hand each batch to the writer process; dead-letter what it rejected; report to the consumer thread."""
        while True:
            batch = self._todo.get()
            if batch is None:
                return
            try:
                written = self.writer.write(batch.records)
                letters = []
                records = batch.records
                for i, reason, detail in written.dead:
                    letter = self.dlq.letter(
                        reason,
                        detail,
                        raw=records.values[i],
                        key=batch.keys[i],
                        topic=batch.topics[i],
                        partition=records.partitions[i],
                        offset=records.offsets[i],
                    )
                    letters.append((letter, records.values[i]))
                # raises when a dead letter was not delivered: nothing of the batch is committed
                self.metrics.dlq_already_sent.inc(self.dlq.send(letters))
                self._done.put((batch, written))
            except BaseException as e:
                self._done.put((batch, e))
                return


# ---------------------------------------------------------------- the service
class MetricsServer:
    """/healthz /readyz /metrics (dynrubric.service.make_app) in a background thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, ready):
        import uvicorn

        from dynrubric.service import make_app

        self.server = uvicorn.Server(
            uvicorn.Config(make_app("dynrubric ingest", registry, ready), host=host, port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, name="ingest-metrics", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise DynrubricError(
                    f"the ingest metrics server could not listen on {host}:{port}",
                    "free the port or set ingest.metrics_port (0 = a free one)",
                )
            time.sleep(0.02)
        self.host = host
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve(
    kafka: KafkaConfig, cfg: IngestConfig, store_dir: Path, *, until_idle_s: float | None = None, announce=print
) -> IngestSummary:
    """Run ingest as a service until SIGTERM/SIGINT (or idle): the entrypoint of `dynrubric ingest`."""
    import signal

    registry = CollectorRegistry()
    ingestor = Ingestor(kafka, cfg, store_dir, registry)
    stop = threading.Event()

    def on_signal(signum, _frame):
        if ingestor.consuming.is_set():
            stop.set()  # finish the open batch, commit, leave the group
        else:
            raise SystemExit(128 + signum)  # still waiting for the store lock or the broker: nothing to finish

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    metrics = MetricsServer(registry, cfg.metrics_host, cfg.metrics_port, ready=ingestor.assigned.is_set)
    announce(
        f"ingest: {kafka.bootstrap_servers} group {cfg.group_id} -> {store_dir}; "
        f"metrics at http://{metrics.host}:{metrics.port}/metrics"
    )
    try:
        return ingestor.run(stop, until_idle_s)
    finally:
        metrics.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
