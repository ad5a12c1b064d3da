"""The ingest writer process: what it does with a batch, and how its faults reach the parent.

Every fault here is real: a second writer holding the store, the writer process killed with
SIGKILL, its parent killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynrubric.config import IngestConfig
from dynrubric.errors import DynrubricError
from streaming.store import ReplayStore, StoreWriter
from streaming.writer_process import (
    FEEDBACK_KIND,
    QUERY_LOG_KIND,
    BatchWriter,
    RawBatch,
    RawRecord,
    WriterPool,
    WriterProcess,
)
from tests.integration.test_streaming_producer import query_event

REPO = Path(__file__).resolve().parents[2]


def raw(rid: str, **over) -> bytes:
    return query_event(rid, **over).to_bytes()


def test_batch_writer_sorts_a_batch_into_stored_dead_and_filtered(tmp_path):
    writer = BatchWriter(tmp_path, IngestConfig(deny_patterns=["(?i)forbidden"]))
    try:
        written = writer.write(
            RawBatch.of(
                [
                    RawRecord(QUERY_LOG_KIND, 0, 0, raw("a")),
                    RawRecord(QUERY_LOG_KIND, 0, 1, b"{not json"),
                    RawRecord(
                        QUERY_LOG_KIND, 0, 2, raw("b", messages=[{"role": "user", "content": "a Forbidden topic"}])
                    ),
                    RawRecord(FEEDBACK_KIND, 1, 7, raw("c")),  # a query log on the feedback topic: the wrong schema
                    RawRecord(QUERY_LOG_KIND, 0, 3, raw("a")),  # a re-send
                    RawRecord(
                        QUERY_LOG_KIND, 0, 4, raw("d", messages=[{"role": "user", "content": "mail jo@example.org"}])
                    ),
                ]
            )
        )
    finally:
        writer.close()
    assert [(i, reason) for i, reason, _ in written.dead] == [(1, "bad_json"), (3, "schema")]
    assert written.filtered == {"denied": 1}
    assert written.result.written == {"query_log": 2} and written.result.duplicates == 1
    table = ReplayStore(tmp_path).table().to_pylist()
    assert sorted(r["request_id"] for r in table) == ["a", "d"]
    assert next(r for r in table if r["request_id"] == "d")["prompt_text"] == "mail <email>"


def test_a_pool_of_writers_gives_the_batch_the_outcome_one_writer_gives(tmp_path):
    """ingest.writers = 3: the batch is cut in three slices written at once into one store. The outcome
    is one writer's: dead records at their index in the batch, filtered ones counted, a record resent in
    another slice (and stored at once by both) stored once and counted a duplicate."""
    records = [RawRecord(QUERY_LOG_KIND, 0, i, raw(f"r{i}")) for i in range(12)]
    records[2] = RawRecord(QUERY_LOG_KIND, 0, 2, b"{not json")
    records[9] = RawRecord(QUERY_LOG_KIND, 0, 9, raw("r0"))  # r0 again, in the third slice
    records[10] = RawRecord(QUERY_LOG_KIND, 0, 10, raw("x", messages=[{"role": "user", "content": "forbidden"}]))
    records[7] = RawRecord(FEEDBACK_KIND, 1, 7, raw("f"))  # the wrong schema for the feedback topic
    cfg = IngestConfig(deny_patterns=["forbidden"])
    pool = WriterPool(tmp_path / "pooled", cfg.model_copy(update={"writers": 3}))
    try:
        pooled = pool.write(RawBatch.of(records))
    finally:
        pool.close()
    single = BatchWriter(tmp_path / "single", cfg)
    try:
        alone = single.write(RawBatch.of(records))
    finally:
        single.close()
    assert [(i, r) for i, r, _ in pooled.dead] == [(i, r) for i, r, _ in alone.dead] == [(2, "bad_json"), (7, "schema")]
    assert pooled.filtered == alone.filtered == {"denied": 1}
    assert pooled.result.written == alone.result.written == {"query_log": 8}
    assert pooled.result.duplicates == alone.result.duplicates == 1
    assert pooled.accounted() == len(records)
    stored = ReplayStore(tmp_path / "pooled").table()["request_id"].to_pylist()
    assert sorted(stored) == sorted(ReplayStore(tmp_path / "single").table()["request_id"].to_pylist())
    assert len(stored) == len(set(stored)) == 8

    def origins(store: str) -> list[tuple]:  # each row's Kafka origin, as its slice carried it (r0: either slice's)
        rows = ReplayStore(tmp_path / store).table().to_pylist()
        return sorted(
            (r["request_id"], r["source_partition"], r["source_offset"]) for r in rows if r["request_id"] != "r0"
        )

    assert origins("pooled") == origins("single") and ("r11", 0, 11) in origins("pooled")


def test_a_store_held_by_another_writer_is_reported_by_the_parent(tmp_path):
    holder = StoreWriter(tmp_path)
    try:
        with pytest.raises(DynrubricError, match="in use by another writer"):
            WriterProcess(tmp_path, IngestConfig())
    finally:
        holder.close()


def test_a_killed_writer_process_is_a_named_error_and_commits_nothing(tmp_path):
    writer = WriterProcess(tmp_path, IngestConfig())
    try:
        assert writer.write(RawBatch.of([RawRecord(QUERY_LOG_KIND, 0, 0, raw("a"))])).result.written == {"query_log": 1}
        os.kill(writer.process.pid, signal.SIGKILL)
        writer.process.join(10)
        with pytest.raises(DynrubricError, match=r"writer process died \(exit code -9\)"):
            writer.write(RawBatch.of([RawRecord(QUERY_LOG_KIND, 0, 1, raw("b"))]))
    finally:
        writer.close()
    assert ReplayStore(tmp_path).table()["request_id"].to_pylist() == ["a"]


def broken_scrub(text: str) -> str:
    raise ValueError("scrubber bug")


def test_a_failing_plugged_in_scrubber_is_a_named_error_and_stores_nothing(tmp_path):
    writer = WriterProcess(tmp_path, IngestConfig(pii_scrubber="tests.unit.test_streaming_writer_process:broken_scrub"))
    try:
        with pytest.raises(DynrubricError, match="ingest writer failed: ValueError: scrubber bug"):
            writer.write(RawBatch.of([RawRecord(QUERY_LOG_KIND, 0, 0, raw("a"))]))
    finally:
        writer.close()
    assert ReplayStore(tmp_path).table().num_rows == 0


PARENT = """
import sys, time
from pathlib import Path
from dynrubric.config import IngestConfig
from streaming.writer_process import WriterProcess
w = WriterProcess(Path(sys.argv[1]), IngestConfig())
print(w.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_the_writer_dies_with_its_parent_and_frees_the_store(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child_pid = int(parent.stdout.readline())
    parent.kill()  # kill -9: no clean-up code runs in the parent
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid), "the writer process outlived its parent"
    # the lock is free for the next ingest once the child's last thread has exited (its thread-group
    # leader shows as a zombie a few ms before that)
    StoreWriter(tmp_path, lock_wait_s=10).close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie is dead, waiting for its reaper
    except FileNotFoundError:
        return False
