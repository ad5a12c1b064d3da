"""The replay store: every ingested request and feedback event, as Parquet shards plus one SQLite index.

Layout under the store root:

    index.sqlite                                  manifest of shards + dedupe index (+ lookup tables)
    query_log/date=YYYY-MM-DD/policy_version=V/part-<uuid>.parquet
    feedback/date=YYYY-MM-DD/part-<uuid>.parquet

Exactly-once: a batch's shards are written to temp files, fsynced and renamed first; then ONE SQLite
transaction registers them in the manifest and records their dedupe keys. That commit is the moment
a batch exists. A crash before it leaves only unregistered files, which the next writer deletes (and
Kafka redelivers the records, since offsets are committed after it). A crash after it but before the
Kafka offset commit makes Kafka redeliver records whose keys are already in the index: dropped as
duplicates. Readers only ever see shards the manifest lists.

One writer per store at a time (an exclusive lock file), or, with `ingest.shared_store`, any number
of writers at once (the ingest processes of one consumer group): each holds the store lock shared and a
lock of its own, `.writers/<writer id>.lock`, and names its shard files after itself, so that a writer
that starts removes only the unregistered files of writers that are gone. Partitions move between
writers at rebalances, and a record may come back to another writer: the dedupe keys are checked again
inside the index transaction, and a batch that raced another writer's is rewritten without the keys
that writer registered first. Any number of readers.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import sqlite3
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from typing import cast

import pyarrow as pa
import pyarrow.parquet as pq

from dynrubric.atomic import fsync_dir
from dynrubric.config import Settings
from dynrubric.errors import DynrubricError
from dynrubric.prompt_key import prompt_key
from dynrubric.train.prompts import TrainPrompt
from streaming.event_schemas import arrow_fields
from streaming.events import AnyFeedback, AnyQueryLog, FeedbackEvent, QueryLogEvent, QueryLogRecord

INDEX = "index.sqlite"
LOCK = ".writer.lock"
WRITERS = ".writers"  # shared stores: one lock file per live writer
QUERY_LOG, FEEDBACK = "query_log", "feedback"

# generated from the event models (streaming/event_schemas.py), then the store's own columns
QUERY_LOG_SCHEMA = pa.schema(
    [
        *arrow_fields(QueryLogEvent, flatten=("sampling",)),
        ("prompt_key", pa.string()),
        ("prompt_text", pa.string()),
        ("source_partition", pa.int32()),
        ("source_offset", pa.int64()),
    ]
)
FEEDBACK_SCHEMA = pa.schema(
    [
        *arrow_fields(FeedbackEvent),
        ("source_partition", pa.int32()),
        ("source_offset", pa.int64()),
    ]
)

_DDL = """
CREATE TABLE IF NOT EXISTS shards (
    shard_id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the watermark readers page by
    kind TEXT NOT NULL, path TEXT NOT NULL UNIQUE, date TEXT NOT NULL, policy_version TEXT,
    rows INTEGER NOT NULL, min_ts REAL NOT NULL, max_ts REAL NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS seen (  -- seq grows: eviction deletes the oldest, never the newest
    seq INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, shard_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS prompt_shards (
    prompt_key TEXT NOT NULL, shard_id INTEGER NOT NULL, PRIMARY KEY (prompt_key, shard_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS feedback_shards (
    request_id TEXT NOT NULL, shard_id INTEGER NOT NULL, PRIMARY KEY (request_id, shard_id)) WITHOUT ROWID;
"""


def dedupe_key(event: AnyQueryLog | AnyFeedback) -> str:
    if isinstance(event, (QueryLogEvent, QueryLogRecord)):
        return "q\x1f" + event.request_id
    return "f\x1f" + event.dedupe_key()


def _date(ts: float) -> str:
    """The UTC date of `ts`, YYYY-MM-DD (a shard's `date=` partition).

    A Unix day is 86,400 s (no leap seconds), so day = ts // 86,400; a batch holds a few days at most, so
    the string is cached per day. Within a second of midnight datetime's own rounding (to microseconds)
    decides, as it always did."""
    day = ts // 86_400
    if 1 <= ts - day * 86_400 <= 86_399:
        return _date_of_day(int(day))
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d")


@functools.lru_cache(maxsize=1024)
def _date_of_day(day: int) -> str:
    return datetime.fromtimestamp(day * 86_400, UTC).strftime("%Y-%m-%d")


def _connect(root: Path) -> sqlite3.Connection:
    # check_same_thread=False: ingest opens the writer in one thread and commits from its writer thread
    db = sqlite3.connect(root / INDEX, timeout=30, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(_DDL)
    return db


# ---------------------------------------------------------------- writing
@dataclass(frozen=True)
class Stored:
    """A validated, scrubbed event (a model, or parse_record's record of one) with where it came from."""

    event: AnyQueryLog | AnyFeedback
    partition: int
    offset: int


@dataclass
class CommitResult:
    written: dict[str, int] = field(default_factory=dict)  # kind -> rows
    duplicates: int = 0
    shard_ids: list[int] = field(default_factory=list)

    def merged(self, other: CommitResult) -> CommitResult:
        written = dict(self.written)
        for kind, n in other.written.items():
            written[kind] = written.get(kind, 0) + n
        return CommitResult(written, self.duplicates + other.duplicates, self.shard_ids + other.shard_ids)


class StoreRace(Exception):
    """Another writer registered some of a batch's keys between its dedupe check and its transaction."""


class StoreWriter:
    """Appends batches to the store exactly once (see the module docstring). One per store, or several
    with `shared`."""

    def __init__(self, root: Path, *, dedupe_capacity: int = 5_000_000, lock_wait_s: float = 0.0, shared: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.dedupe_capacity = dedupe_capacity
        self.writer_id = uuid.uuid4().hex[:12]
        self._lock_fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + lock_wait_s
        while not _try_lock(self._lock_fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX):
            if time.monotonic() >= deadline:
                os.close(self._lock_fd)
                raise DynrubricError(
                    f"replay store {self.root} is in use by another writer"
                    + (" that does not share it" if shared else ""),
                    "run one ingest per store dir (stop the other, or set ingest.store_dir), let this one wait "
                    "as a standby (ingest.store_lock_wait_s), or set ingest.shared_store on every ingest of "
                    "the consumer group",
                ) from None
            time.sleep(0.05)
        self.shared = shared
        self._own_fd: int | None = None
        if shared:
            (self.root / WRITERS).mkdir(exist_ok=True)
            # locked before it has its name: a writer that starts never sees it unlocked and takes it for dead
            tmp = self.root / WRITERS / f".{self.writer_id}.tmp"
            self._own_fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._own_fd, fcntl.LOCK_EX)
            os.rename(tmp, self.root / WRITERS / f"{self.writer_id}.lock")
        self.db = _connect(self.root)
        self.removed_orphans = self._remove_orphans()
        # pyarrow imports pandas (a slow import) on its first conversion of Python lists: pay it at start, not
        # inside the first batch
        pa.Table.from_pydict({name: [] for name in QUERY_LOG_SCHEMA.names}, schema=QUERY_LOG_SCHEMA)

    def close(self) -> None:
        self.db.close()
        if self._own_fd is not None:
            (self.root / WRITERS / f"{self.writer_id}.lock").unlink(missing_ok=True)
            os.close(self._own_fd)
        os.close(self._lock_fd)

    def _live_writers(self) -> set[str]:
        """Ids of the other writers that hold their own lock now (shared stores); a dead one's lock is removed."""
        live = set()
        for path in (self.root / WRITERS).glob("*.lock") if (self.root / WRITERS).exists() else ():
            if path.stem == self.writer_id:
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                if _try_lock(fd, fcntl.LOCK_EX):
                    path.unlink(missing_ok=True)
                else:
                    live.add(path.stem)
            finally:
                os.close(fd)
        return live

    def _remove_orphans(self) -> int:
        """Delete shard files a crashed writer left unregistered, and its temp files (in a shared store,
        only those of writers that are gone: a live one's are its batch in flight)."""
        registered = {row[0] for row in self.db.execute("SELECT path FROM shards")}
        live = self._live_writers()
        removed = 0
        for kind in (QUERY_LOG, FEEDBACK):
            for f in (self.root / kind).rglob("*") if (self.root / kind).exists() else ():
                if (
                    f.is_file()
                    and f.relative_to(self.root).as_posix() not in registered
                    and _writer_of(f.name) not in live
                ):
                    f.unlink()
                    removed += 1
        return removed

    def commit(self, records: Sequence[Stored]) -> CommitResult:
        """Store the records not stored before; return what was written and how many were duplicates."""
        while True:
            try:
                return self._commit(records)
            except StoreRace:  # another writer stored some of these first: their keys are known now
                continue

    def _commit(self, records: Sequence[Stored]) -> CommitResult:
        result = CommitResult()
        fresh: dict[str, Stored] = {}
        for r in records:
            fresh.setdefault(dedupe_key(r.event), r)
        known = self._known(list(fresh))
        result.duplicates = len(records) - len(fresh) + len(known)
        for key in known:
            del fresh[key]
        if not fresh:
            return result

        groups: dict[tuple[str, str, str | None], list[tuple[str, Stored]]] = defaultdict(list)
        for key, r in fresh.items():
            if isinstance(r.event, (QueryLogEvent, QueryLogRecord)):
                groups[(QUERY_LOG, _date(r.event.ts), r.event.policy_version)].append((key, r))
            else:
                groups[(FEEDBACK, _date(r.event.ts), None)].append((key, r))
        shards = [
            Shard(*group, [key for key, _ in items], _columns(group[0], [r for _, r in items]))
            for group, items in groups.items()
        ]
        paths: list[str] = []
        try:
            for shard in shards:
                paths.append(self._write_shard(shard.kind, shard.date, shard.version, shard.columns))
            self._register(shards, paths, result)
        except BaseException:
            # nothing of a failed commit stays behind: the caller may retry the records without the bad one
            for path in paths:
                (self.root / path).unlink(missing_ok=True)
            raise
        return result

    def _register(self, shards: list[Shard], paths: list[str], result: CommitResult) -> None:
        """ONE SQLite transaction: the shards enter the manifest and their keys the dedupe index."""
        now = time.time()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            # checked again under the write lock: another writer of a shared store may have come first
            if self.shared and self._known([key for shard in shards for key in shard.keys]):
                raise StoreRace
            for shard, path in zip(shards, paths, strict=True):
                tss = shard.columns["ts"]
                rows = len(shard.keys)
                cur = self.db.execute(
                    "INSERT INTO shards (kind, path, date, policy_version, rows, min_ts, max_ts, created_at)"
                    " VALUES (?,?,?,?,?,?,?,?)",
                    (shard.kind, path, shard.date, shard.version, rows, min(tss), max(tss), now),
                )
                shard_id = cur.lastrowid
                assert shard_id is not None, "an INSERT sets lastrowid"
                result.shard_ids.append(shard_id)
                result.written[shard.kind] = result.written.get(shard.kind, 0) + rows
                # one statement per table (json_each), not one per row: every SQLite step releases and
                # re-takes the GIL, which the busy consumer thread makes slow
                self.db.execute(
                    "INSERT INTO seen (key, shard_id) SELECT value, ? FROM json_each(?)",
                    (shard_id, json.dumps(shard.keys)),
                )
                lookup = "prompt_shards" if shard.kind == QUERY_LOG else "feedback_shards"
                column = "prompt_key" if shard.kind == QUERY_LOG else "request_id"
                values = set(shard.columns[column])
                self.db.execute(
                    f"INSERT INTO {lookup} SELECT value, ? FROM json_each(?)", (shard_id, json.dumps(sorted(values)))
                )
            self.db.execute("DELETE FROM seen WHERE seq <= (SELECT MAX(seq) FROM seen) - ?", (self.dedupe_capacity,))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def _known(self, keys: list[str]) -> set[str]:
        rows = self.db.execute(
            "SELECT key FROM seen WHERE key IN (SELECT value FROM json_each(?))", (json.dumps(keys),)
        )
        return {row[0] for row in rows}

    def _write_shard(self, kind: str, date: str, version: str | None, columns: dict[str, list]) -> str:
        schema = QUERY_LOG_SCHEMA if kind == QUERY_LOG else FEEDBACK_SCHEMA
        # column by column: Arrow converts a list per column ~20x faster than a dict per row (from_pylist)
        # columns[name], not .get: a column the rows do not fill is a KeyError here, never a column of silent nulls
        table = pa.Table.from_pydict({name: columns[name] for name in schema.names}, schema=schema)
        if kind == QUERY_LOG:
            rel = Path(kind, f"date={date}", f"policy_version={version}")
        else:
            rel = Path(kind, f"date={date}")
        directory = self.root / rel
        directory.mkdir(parents=True, exist_ok=True)
        name = f"part-{self.writer_id}-{uuid.uuid4().hex}.parquet"
        tmp = directory / f".{name}.tmp"
        try:
            # a path, not a Python file object: Arrow then writes natively instead of calling back into Python
            pq.write_table(table, str(tmp), compression="zstd", use_dictionary=_DICTIONARY_COLUMNS[kind])
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, directory / name)
        fsync_dir(directory)
        return (rel / name).as_posix()


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _writer_of(name: str) -> str | None:
    """The writer id in a shard file's name (`part-<writer>-<uuid>.parquet`, or its `.tmp`); None for
    files of stores written before writers had ids."""
    parts = name.lstrip(".").split("-")
    return parts[1] if len(parts) == 3 and parts[0] == "part" else None


@dataclass(frozen=True)
class Shard:
    """One shard of a batch: its partition, the dedupe keys of its rows, and the rows as Arrow's columns."""

    kind: str
    date: str
    version: str | None
    keys: list[str]
    columns: dict[str, list]


# the columns that are the event's own fields, as they are named on it
_QUERY_FIELDS = (
    "request_id", "ts", "user_key", "session_id", "variant", "policy_version", "model", "response", "finish_reason",
    "latency_ms", "prompt_tokens", "completion_tokens", "experiment_id", "assigned_variant", "pair_id", "shadow",
)  # fmt: skip
_FEEDBACK_FIELDS = ("request_id", "ts", "user_key", "kind", "value")
_SAMPLING_FIELDS = ("temperature", "top_p", "max_tokens")
_ROLE_CONTENT = attrgetter("role", "content")
# Parquet dictionary-encodes these columns only: their values repeat (users, arms, versions, models). Tried on the
# others (texts, ids, numbers) a dictionary is built and thrown away, which cost ~15% of the shard's write.
_DICTIONARY_COLUMNS = {
    QUERY_LOG: [
        "user_key", "session_id", "variant", "policy_version", "model", "finish_reason", "experiment_id",
        "assigned_variant",
    ],
    FEEDBACK: ["user_key", "kind"],
}  # fmt: skip


def _columns(kind: str, stored: list[Stored]) -> dict[str, list]:
    """The stored records as the columns of their kind's shard (a list per column: Arrow's fast input).

    Each column is read by one C loop over the events (attrgetter of every field at once, then one transpose);
    the messages are (role, content) pairs, which Arrow takes for its struct as it takes dicts."""
    events = [s.event for s in stored]
    names = _QUERY_FIELDS if kind == QUERY_LOG else _FEEDBACK_FIELDS
    columns = dict(zip(names, map(list, zip(*map(attrgetter(*names), events), strict=True)), strict=True))
    columns["source_partition"] = [s.partition for s in stored]
    columns["source_offset"] = [s.offset for s in stored]
    if kind == QUERY_LOG:
        queries = cast(list[AnyQueryLog], events)
        samplings = map(attrgetter(*_SAMPLING_FIELDS), map(attrgetter("sampling"), queries))
        columns.update(zip(_SAMPLING_FIELDS, map(list, zip(*samplings, strict=True)), strict=True))
        messages = [list(map(_ROLE_CONTENT, e.messages)) for e in queries]
        columns["messages"] = messages
        columns["prompt_key"] = list(map(prompt_key, messages))
        columns["prompt_text"] = [next((c for role, c in reversed(ms) if role == "user"), "") for ms in messages]
    return columns


# ---------------------------------------------------------------- reading (the trainer's side)
@dataclass(frozen=True)
class Feedback:
    kind: str
    value: float | None
    ts: float


@dataclass(frozen=True)
class LoggedPrompt:
    """A prompt users sent, as the trainer needs it. `messages` is the chat prompt (PII scrubbed)."""

    prompt_key: str
    messages: tuple[dict[str, str], ...]
    text: str  # the last user message
    request_id: str  # the first logged request that carried it
    policy_version: str
    ts: float


@dataclass(frozen=True)
class LoggedResponse:
    request_id: str
    policy_version: str
    response: str
    finish_reason: str | None
    ts: float
    feedback: tuple[Feedback, ...]


class ReplayStore:
    """Read-only view for the trainer. Watermarks are manifest shard ids: opaque, increasing ints."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / INDEX).exists():
            raise DynrubricError(
                f"no replay store at {self.root} (missing {INDEX})",
                "run `dynrubric ingest` first, or point ingest.store_dir at the store",
            )
        self.db = _connect(self.root)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> ReplayStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def watermark(self) -> int:
        """The newest shard id; `new_prompts(store.watermark())` returns nothing until more arrives."""
        return self.db.execute("SELECT COALESCE(MAX(shard_id), 0) FROM shards").fetchone()[0]

    def new_prompts(self, since_watermark: int = 0, limit: int | None = None) -> tuple[list[LoggedPrompt], int]:
        """Distinct prompts logged after `since_watermark`, oldest first, and the watermark to pass next.

        With `limit`, reading stops after the shard in which the limit was reached (whole shards, so the
        next call misses nothing); the list may then hold a little more than `limit`.
        """
        rows = self.db.execute(
            "SELECT shard_id, path FROM shards WHERE kind = ? AND shard_id > ? ORDER BY shard_id",
            (QUERY_LOG, since_watermark),
        ).fetchall()
        prompts: dict[str, LoggedPrompt] = {}
        watermark = since_watermark
        for shard_id, path in rows:
            if limit is not None and len(prompts) >= limit:
                break
            table = pq.read_table(
                self.root / path,
                columns=["prompt_key", "messages", "prompt_text", "request_id", "policy_version", "ts"],
            )
            for r in table.to_pylist():
                if r["prompt_key"] not in prompts:
                    prompts[r["prompt_key"]] = LoggedPrompt(
                        r["prompt_key"],
                        tuple(r["messages"]),
                        r["prompt_text"],
                        r["request_id"],
                        r["policy_version"],
                        r["ts"],
                    )
            watermark = shard_id
        return list(prompts.values()), watermark

    def responses_by_version(self, prompt_key: str) -> dict[str, list[LoggedResponse]]:
        """Every logged response to one prompt, grouped by the policy version that wrote it (oldest first)."""
        paths = [
            row[0]
            for row in self.db.execute(
                "SELECT s.path FROM prompt_shards p JOIN shards s USING (shard_id) WHERE p.prompt_key = ?"
                " ORDER BY s.shard_id",
                (prompt_key,),
            )
        ]
        rows = []
        for path in paths:
            table = pq.read_table(
                self.root / path,
                columns=["prompt_key", "request_id", "policy_version", "response", "finish_reason", "ts"],
                filters=[("prompt_key", "=", prompt_key)],
            )
            rows.extend(table.to_pylist())
        feedback = self.feedback_for([r["request_id"] for r in rows])
        out: dict[str, list[LoggedResponse]] = defaultdict(list)
        for r in sorted(rows, key=lambda r: r["ts"]):
            out[r["policy_version"]].append(
                LoggedResponse(
                    r["request_id"],
                    r["policy_version"],
                    r["response"],
                    r["finish_reason"],
                    r["ts"],
                    tuple(feedback.get(r["request_id"], ())),
                )
            )
        return dict(out)

    def feedback_for(self, request_ids: Sequence[str]) -> dict[str, list[Feedback]]:
        """Feedback events joined to their requests by request_id, oldest first."""
        wanted = set(request_ids)
        paths: set[str] = set()
        ids = list(wanted)
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            paths.update(
                row[0]
                for row in self.db.execute(
                    "SELECT s.path FROM feedback_shards f JOIN shards s USING (shard_id) "
                    f"WHERE f.request_id IN ({marks})",
                    chunk,
                )
            )
        out: dict[str, list[Feedback]] = defaultdict(list)
        for path in sorted(paths):
            for r in pq.read_table(self.root / path, columns=["request_id", "kind", "value", "ts"]).to_pylist():
                if r["request_id"] in wanted:
                    out[r["request_id"]].append(Feedback(r["kind"], r["value"], r["ts"]))
        for items in out.values():
            items.sort(key=lambda f: f.ts)
        return dict(out)

    def shard_paths(self, kind: str = QUERY_LOG) -> list[Path]:
        """The shards of one kind the manifest lists (readers must not see any other file), oldest first."""
        return [
            self.root / row[0]
            for row in self.db.execute("SELECT path FROM shards WHERE kind = ? ORDER BY shard_id", (kind,))
        ]

    def table(self, kind: str = QUERY_LOG) -> pa.Table:
        """Everything of one kind the manifest lists, as one Arrow table (analysis, tests, export)."""
        paths = self.shard_paths(kind)
        schema = QUERY_LOG_SCHEMA if kind == QUERY_LOG else FEEDBACK_SCHEMA
        if not paths:
            return schema.empty_table()
        return pa.concat_tables(pq.read_table(p, schema=schema) for p in paths)

    def shard_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM shards").fetchone()[0]


class ReplayPromptSource:
    """The trainer's `PromptSource` (dynrubric/train/prompts.py) over the replay store.

    A prompt's key is the store's prompt_key, so `responses_by_version` finds every response ever
    logged for it (the temporal-contrast rankings). The trainer's watermark string is the shard id.
    """

    def __init__(self, root: Path):
        self.store = ReplayStore(root)

    def new_prompts(self, since_watermark: str | None, limit: int) -> tuple[list[TrainPrompt], str | None]:
        logged, watermark = self.store.new_prompts(int(since_watermark or 0), limit)
        prompts = [
            TrainPrompt(key=p.prompt_key, messages=tuple((m["role"], m["content"]) for m in p.messages)) for p in logged
        ]
        return prompts, str(watermark) if logged else since_watermark

    def responses_by_version(self, prompt_key: str) -> dict[str, list[str]]:
        return {v: [r.response for r in rs] for v, rs in self.store.responses_by_version(prompt_key).items()}

    def feedback_by_response(self, prompt_key: str) -> list[tuple[str, list[str]]]:
        return [
            (r.response, [f.kind for f in r.feedback])
            for rs in self.store.responses_by_version(prompt_key).values()
            for r in rs
        ]


def store_root(settings: Settings) -> Path:
    """Where the replay store lives: ingest.store_dir, else <paths.state_dir>/replay."""
    return settings.ingest.store_dir or settings.paths.resolved_state() / "replay"


def replay_prompt_source(settings: Settings) -> ReplayPromptSource:
    return ReplayPromptSource(store_root(settings))
