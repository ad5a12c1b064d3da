"""Sending dead letters: always sendable, never twice for the same source record.

- A letter's value is cut to `ingest.dlq_max_payload_bytes` (headers keep the original length and
  sha256, `DeadLetter.of`), so a record the broker accepted once is never too large to dead-letter.
  With `ingest.dlq_quarantine_dir` set, the full bytes of every cut letter are kept there first, in
  `<source topic>/<partition>-<offset>.bin` (written, fsynced, renamed).
- Ingest sends a batch's dead letters, waits for every ack, and only then commits the batch's
  offsets. A crash between the two redelivers the batch, whose letters were already sent. So before
  it consumes (at every partition assignment) ingest reads the tail of the dead-letter topic, the
  last `window` records of each partition, and skips any letter whose source record is already
  there. The window covers every letter sent after the last commit as long as no more than `window`
  letters per partition were sent since (ingest keeps at most max_pending_batches + 1 batches of
  batch_max_records uncommitted; the default window is four times that).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from dynrubric.config import IngestConfig, KafkaConfig
from streaming.events import DeadLetter
from streaming.kafka import connection_kwargs, consumer_kwargs

log = logging.getLogger(__name__)
Source = tuple[str, int, int]  # (topic, partition, offset) of the record a letter is about
SCAN_TIMEOUT_S = 60.0  # the longest the tail scan of the dead-letter topic may take before ingest goes on


def scan_window(cfg: IngestConfig) -> int:
    return 4 * (cfg.max_pending_batches + 1) * cfg.batch_max_records


class DeadLetterSender:
    def __init__(self, kafka: KafkaConfig, cfg: IngestConfig, topic: str):
        from kafka import KafkaProducer

        self.kafka = kafka
        self.cfg = cfg
        self.topic = topic
        self.producer = KafkaProducer(
            **connection_kwargs(kafka),
            acks="all",
            retries=5,
            linger_ms=5,
            max_request_size=max(1_048_576, 2 * cfg.dlq_max_payload_bytes),
        )
        self._sent: set[Source] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        self.producer.close(timeout=10)

    def letter(self, reason: str, detail: str, *, raw, key, topic: str, partition: int, offset: int) -> DeadLetter:
        return DeadLetter.of(
            reason,
            detail,
            raw=raw,
            key=key,
            topic=topic,
            partition=partition,
            offset=offset,
            max_payload_bytes=self.cfg.dlq_max_payload_bytes,
        )

    def send(self, letters: list[tuple[DeadLetter, bytes | None]]) -> int:
        """Send (letter, full value) pairs and wait for every ack; return how many were skipped because
        the dead-letter topic already holds them. Raises when one was not delivered."""
        with self._lock:
            todo = [
                (dl, full)
                for dl, full in letters
                if (dl.source_topic, dl.source_partition, dl.source_offset) not in self._sent
            ]
        for dl, full in todo:
            if dl.truncated and self.cfg.dlq_quarantine_dir is not None and full is not None:
                self._quarantine(dl, full)
        futures = [self.producer.send(self.topic, key=dl.key, value=dl.raw, headers=dl.headers()) for dl, _ in todo]
        for future in futures:
            future.get(timeout=30)
        return len(letters) - len(todo)

    def _quarantine(self, dl: DeadLetter, full: bytes) -> None:
        root = self.cfg.dlq_quarantine_dir
        assert root is not None, "send() quarantines only with ingest.dlq_quarantine_dir set"
        directory = Path(root) / dl.source_topic
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"{dl.source_partition}-{dl.source_offset}.bin"
        tmp = directory / f".{final.name}.tmp"
        with open(tmp, "wb") as f:
            f.write(full)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)

    def remember_sent(self, sources: Iterable[str]) -> None:
        """Read the tail of the dead-letter topic: letters about records of `sources` topics are not sent again."""
        from kafka import KafkaConsumer, TopicPartition

        wanted = set(sources)
        consumer = KafkaConsumer(**consumer_kwargs(self.kafka), enable_auto_commit=False, group_id=None)
        found: set[Source] = set()
        try:
            partitions = consumer.partitions_for_topic(self.topic) or set()
            tps = [TopicPartition(self.topic, p) for p in partitions]
            if not tps:
                return
            consumer.assign(tps)
            window = scan_window(self.cfg)
            # end_offsets can under-report on Tansu: that only starts the scan earlier (reads more); the
            # scan ends at the high watermarks the fetches report
            for tp, end in consumer.end_offsets(tps).items():
                consumer.seek(tp, max(0, end - window))
            # the end is the high watermark each fetch response reports (empty ones too): an empty poll on a
            # loaded machine is not the end, and stopping early would send a redelivered batch's letters twice
            deadline = time.monotonic() + SCAN_TIMEOUT_S
            while True:
                for records in consumer.poll(timeout_ms=300).values():
                    for r in records:
                        h = dict(r.headers or ())
                        topic = h.get("dlq.source.topic", b"").decode("utf-8", "replace")
                        if topic in wanted:
                            found.add((topic, int(h["dlq.source.partition"]), int(h["dlq.source.offset"])))
                high = [consumer.highwater(tp) for tp in tps]
                if None not in high and all(consumer.position(tp) >= h for tp, h in zip(tps, high, strict=True)):
                    break  # read up to the end of every partition
                if time.monotonic() > deadline:
                    log.warning(
                        "%s: the scan for sent dead letters did not reach the end in %.0f s; a letter of a "
                        "redelivered batch may be sent twice",
                        self.topic,
                        SCAN_TIMEOUT_S,
                    )
                    break
        finally:
            consumer.close(autocommit=False)
            with self._lock:
                self._sent = found  # a batch is only redelivered across an assignment, which scans again
        if found:
            log.info("%d dead letters already in %s will not be sent again", len(found), self.topic)
