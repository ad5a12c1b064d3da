"""The ingest writer process: validate, filter, scrub, dedupe and store batches of raw Kafka records.

Ingest runs this half of its work in a second process so that it does not share the GIL with
kafka-python's record decoding (pure Python): in one process the two took turns and ingest reached
~0.75 of a bare consumer's rate; split, the consumer keeps one core and the writer another.

The parent (`streaming/ingest.py`) owns everything Kafka: it sends `RawBatch`es down a pipe and
gets back a `WrittenBatch` once the batch's shards are durable. The child owns the replay store
(its writer lock, index and shards), so a store is never written by a process that has lost its
consumer: on Linux the child is killed with its parent (PR_SET_PDEATHSIG), and the kernel then
releases the store lock; a half-written batch is only unregistered temp files (see store.py).

With `ingest.writers` > 1 (`WriterPool`) each batch is cut into one slice per writer process and the
slices are written at once, into the store shared between them (the store's rule for several
writers: `streaming/store.py`): validation, scrub and the store's rows run in Python, one core per
writer, so one writer caps an ingest process however fast its consumer is (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sqlite3
import sys
import time
from collections import Counter as Tally
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple, cast

from dynrubric.config import IngestConfig
from dynrubric.errors import DynrubricError
from streaming.events import (
    AnyFeedback,
    AnyQueryLog,
    FeedbackEvent,
    MalformedEvent,
    QueryLogEvent,
    QueryLogRecord,
    parse_records,
)
from streaming.filters import PromptFilter, load_scrubber, scrubbed_all
from streaming.store import CommitResult, Stored, StoreWriter

QUERY_LOG_KIND, FEEDBACK_KIND = 0, 1  # RawRecord.kind: which event model the record's topic carries
MODEL_OF_KIND: dict[int, type[QueryLogEvent] | type[FeedbackEvent]] = {
    QUERY_LOG_KIND: QueryLogEvent,
    FEEDBACK_KIND: FeedbackEvent,
}
READY_TIMEOUT_S = 120  # start-up: a Python import, plus the store lock wait (added on top)


class RawRecord(NamedTuple):
    """One raw Kafka record: which event model its topic carries (`kind`), where it came from, its value."""

    kind: int
    partition: int
    offset: int
    value: bytes | None


@dataclass
class RawBatch:
    """Raw Kafka records as columns: record i is (kinds[i], partitions[i], offsets[i], values[i]).

    What crosses the pipe to a writer process: four lists pickle (and unpickle) ~4x faster than a tuple
    object per record, and the consumer fills them by extending lists, not by building records."""

    kinds: list[int] = field(default_factory=list)
    partitions: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)

    @classmethod
    def of(cls, records: Sequence[RawRecord]) -> RawBatch:
        """The batch of these records, in their order."""
        return cls([r.kind for r in records], [r.partition for r in records], [r.offset for r in records],
                   [r.value for r in records])  # fmt: skip

    def __len__(self) -> int:
        return len(self.values)

    def extend(self, kind: int, partition: int, offsets: list[int], values: list[bytes | None]) -> None:
        """Append one partition's records (in offset order) of one topic."""
        self.kinds.extend([kind] * len(offsets))
        self.partitions.extend([partition] * len(offsets))
        self.offsets.extend(offsets)
        self.values.extend(values)

    def slice(self, start: int, stop: int) -> RawBatch:
        return RawBatch(
            self.kinds[start:stop], self.partitions[start:stop], self.offsets[start:stop], self.values[start:stop]
        )


class WriterReady(NamedTuple):
    removed_orphans: int  # unregistered shard files a crashed writer left, deleted at start


class WriterFailure(NamedTuple):
    """The child could not start or write; the parent raises it as a DynrubricError."""

    problem: str
    fix: str


@dataclass
class WrittenBatch:
    """What the writer did with one batch. `dead` holds (index into the batch, reason, detail).

    Every record ends in exactly one outcome: `records == stored + duplicates + filtered + dead`.
    """

    result: CommitResult
    dead: list[tuple[int, str, str]] = field(default_factory=list)
    filtered: dict[str, int] = field(default_factory=dict)
    prepare_seconds: float = 0.0  # validate, filter, scrub
    store_seconds: float = 0.0  # dedupe, Parquet, fsync, index commit

    def accounted(self) -> int:
        return sum(self.result.written.values()) + self.result.duplicates + sum(self.filtered.values()) + len(self.dead)


# The store itself failing (disk, lock, I/O): no record is to blame, so the batch fails as a whole.
STORE_FAULTS = (OSError, sqlite3.OperationalError, DynrubricError)


class BatchWriter:
    """The child's work on one batch, in-process (the child's loop, and tests of the logic itself)."""

    def __init__(self, store_dir: Path, cfg: IngestConfig):
        self.cfg = cfg
        self.filter = PromptFilter(cfg)
        self.scrub = load_scrubber(cfg)
        self.store = StoreWriter(
            store_dir,
            dedupe_capacity=cfg.dedupe_capacity,
            lock_wait_s=cfg.store_lock_wait_s,
            shared=cfg.shared_store or cfg.writers > 1,
        )

    def close(self) -> None:
        self.store.close()

    def write(self, records: RawBatch) -> WrittenBatch:
        started = time.monotonic()
        dead: list[tuple[int, str, str]] = []
        filtered: Tally = Tally()
        kept: list[tuple[int, AnyQueryLog | AnyFeedback]] = []
        for i, event in self._parsed(records):
            if isinstance(event, MalformedEvent):
                dead.append((i, event.reason, event.detail))
                continue
            if isinstance(event, (QueryLogEvent, QueryLogRecord)):
                reason = self.filter.reason(event)
                if reason is not None:
                    filtered[reason] += 1
                    continue
            kept.append((i, event))
        if self.scrub is not None:  # the query logs' texts, all at once
            queries = [j for j, (_, e) in enumerate(kept) if isinstance(e, (QueryLogEvent, QueryLogRecord))]
            clean = scrubbed_all([cast(AnyQueryLog, kept[j][1]) for j in queries], self.scrub)
            for j, event in zip(queries, clean, strict=True):
                kept[j] = (kept[j][0], event)
        keep = [(i, Stored(event, records.partitions[i], records.offsets[i])) for i, event in kept]
        prepared = time.monotonic()
        result = self._commit_isolating(keep, dead)
        dead.sort()
        return WrittenBatch(result, dead, dict(filtered), prepared - started, time.monotonic() - prepared)

    def _parsed(self, records: RawBatch) -> list[tuple[int, AnyQueryLog | AnyFeedback | MalformedEvent]]:
        """Each record's index and its event or MalformedEvent (`parse_records` per topic's model), in order."""
        parsed: list[tuple[int, AnyQueryLog | AnyFeedback | MalformedEvent]] = []
        for kind, model in MODEL_OF_KIND.items():
            positions = [i for i, k in enumerate(records.kinds) if k == kind]
            if positions:
                values = records.values if len(positions) == len(records) else [records.values[i] for i in positions]
                events = parse_records(model, values, self.cfg.max_event_bytes, self.cfg.variants)
                parsed.extend(zip(positions, events, strict=True))
        parsed.sort(key=itemgetter(0))
        return parsed

    def _commit_isolating(self, keep: list[tuple[int, Stored]], dead: list[tuple[int, str, str]]) -> CommitResult:
        """Commit the records; if a record makes the commit fail, bisect until it is alone, dead-letter it
        (reason store_error) and commit the rest. A failed commit leaves nothing behind (store.py)."""
        try:
            return self.store.commit([s for _, s in keep])
        except STORE_FAULTS:
            raise
        except Exception as e:  # noqa: BLE001 - a value the store cannot hold: find the record
            if len(keep) == 1:
                dead.append(
                    (keep[0][0], "store_error", f"the store could not write it: {type(e).__name__}: {e}"[:1000])
                )
                return CommitResult()
        mid = len(keep) // 2
        return self._commit_isolating(keep[:mid], dead).merged(self._commit_isolating(keep[mid:], dead))


# ---------------------------------------------------------------- the child
def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(conn, store_dir: Path, cfg: IngestConfig, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the parent drains and then closes the pipe. SIGTERM stays
    # fatal: multiprocessing's exit handler terminates daemon children with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        writer = BatchWriter(store_dir, cfg)
    except DynrubricError as e:
        conn.send(WriterFailure(e.problem, e.fix))
        return
    # What start-up left (pydantic, pyarrow and the rest, ~10^5 objects) is never garbage: out of the collector's
    # reach, the full collections a batch's allocations trigger walk the batch's objects, not all of these again
    gc.collect()
    gc.freeze()
    conn.send(WriterReady(writer.store.removed_orphans))
    try:
        while (records := conn.recv()) is not None:
            conn.send(writer.write(records))
    except EOFError:
        pass  # the parent is gone
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(
            WriterFailure(
                f"the ingest writer failed: {type(e).__name__}: {e}",
                "check the disk under ingest.store_dir, then restart ingest",
            )
        )
    finally:
        writer.close()


# ---------------------------------------------------------------- the parent's handle
class WriterProcess:
    """Starts the child and hands it batches; `write` blocks until the batch is durable."""

    def __init__(self, store_dir: Path, cfg: IngestConfig):
        ctx = multiprocessing.get_context("spawn")  # not fork: the parent already runs threads
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, args=(child_conn, Path(store_dir), cfg, os.getpid()), name="ingest-writer", daemon=True
        )
        self.process.start()
        child_conn.close()
        reply = self._receive(READY_TIMEOUT_S + cfg.store_lock_wait_s)
        if isinstance(reply, WriterFailure):
            self.process.join(5)
            raise DynrubricError(reply.problem, reply.fix)
        self.removed_orphans: int = reply.removed_orphans

    def write(self, records: RawBatch) -> WrittenBatch:
        self.send(records)
        return self.written()

    def send(self, records: RawBatch) -> None:
        """Hand the child a batch (`written` then waits for it)."""
        try:
            self._conn.send(records)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died() from None

    def written(self) -> WrittenBatch:
        reply = self._receive(None)
        if isinstance(reply, WriterFailure):
            raise DynrubricError(reply.problem, reply.fix)
        return reply

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass  # already gone
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def _receive(self, timeout_s: float | None):
        try:
            if timeout_s is not None and not self._conn.poll(timeout_s):
                self.process.kill()
                raise DynrubricError(
                    f"the ingest writer process did not start within {timeout_s:.0f} s", "check the machine's load"
                )
            return self._conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._died() from None

    def _died(self) -> DynrubricError:
        self.process.join(5)
        return DynrubricError(
            f"the ingest writer process died (exit code {self.process.exitcode})",
            "look for an out-of-memory kill in the system log; restart ingest (nothing committed is lost)",
        )


class WriterPool:
    """`ingest.writers` writer processes on one store; `write` blocks until the whole batch is durable.

    A batch is cut into contiguous slices, one per writer, written at once. Its outcome is the slices'
    together, each dead record's index mapped back into the batch. A record that two slices both hold
    (a producer's retry inside one batch) is stored by the slice that registers it first and counted as
    a duplicate by the other (the store checks the keys again inside its transaction)."""

    def __init__(self, store_dir: Path, cfg: IngestConfig):
        self.writers: list[WriterProcess] = []
        try:
            for _ in range(cfg.writers):
                self.writers.append(WriterProcess(store_dir, cfg))
        except BaseException:
            self.close()
            raise
        self.removed_orphans = sum(w.removed_orphans for w in self.writers)

    def write(self, records: RawBatch) -> WrittenBatch:
        size = max(1, -(-len(records) // len(self.writers)))
        starts = list(range(0, len(records), size))
        for writer, start in zip(self.writers, starts, strict=False):  # fewer slices than writers for a tiny batch
            writer.send(records.slice(start, start + size))
        parts = [(start, writer.written()) for writer, start in zip(self.writers, starts, strict=False)]
        result = CommitResult()
        dead: list[tuple[int, str, str]] = []
        filtered: Tally[str] = Tally()
        for start, part in parts:
            result = result.merged(part.result)
            dead.extend((start + i, reason, detail) for i, reason, detail in part.dead)
            filtered.update(part.filtered)
        return WrittenBatch(
            result,
            dead,
            dict(filtered),
            sum(p.prepare_seconds for _, p in parts),
            sum(p.store_seconds for _, p in parts),
        )

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
