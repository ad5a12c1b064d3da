"""The replay store on its own: exactly-once commits, orphan clean-up, the trainer's reader."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from dynrubric.errors import DynrubricError
from streaming.events import FeedbackEvent
from streaming.store import FEEDBACK, ReplayStore, Stored, StoreWriter, _columns, _date
from tests.integration.test_streaming_producer import query_event


def q(rid, version="v1", prompt="2+2?", ts=1795000000.0, response="4"):
    return Stored(
        query_event(
            rid, policy_version=version, ts=ts, response=response, messages=[{"role": "user", "content": prompt}]
        ),
        0,
        0,
    )


def fb(rid, kind="thumbs_up", ts=1795000001.0):
    return Stored(FeedbackEvent(request_id=rid, ts=ts, user_key="u", kind=kind, value=1.0), 0, 0)


def test_commit_is_exactly_once_across_batches_and_restarts(tmp_path):
    w = StoreWriter(tmp_path)
    r1 = w.commit([q("a"), q("b"), q("a"), fb("a"), fb("a")])
    assert r1.written == {"query_log": 2, "feedback": 1} and r1.duplicates == 2
    w.close()
    w = StoreWriter(tmp_path)  # a restart: the index on disk still knows a and b
    r2 = w.commit([q("a"), q("c"), fb("a"), fb("a", kind="copy")])
    assert r2.written == {"query_log": 1, "feedback": 1} and r2.duplicates == 2
    w.close()
    store = ReplayStore(tmp_path)
    assert sorted(store.table()["request_id"].to_pylist()) == ["a", "b", "c"]
    assert len(store.table(FEEDBACK)) == 2


def test_one_writer_per_store(tmp_path):
    w = StoreWriter(tmp_path)
    with pytest.raises(DynrubricError, match="in use by another writer"):
        StoreWriter(tmp_path)
    w.close()
    StoreWriter(tmp_path).close()


def test_shared_writers_write_one_store_and_keep_exactly_once(tmp_path):
    """ingest.shared_store: two writers at once; an exclusive writer cannot join them; a key both commit
    is stored once."""
    a, b = StoreWriter(tmp_path, shared=True), StoreWriter(tmp_path, shared=True)
    with pytest.raises(DynrubricError, match="in use by another writer"):
        StoreWriter(tmp_path)
    assert a.commit([q("x"), q("y")]).written == {"query_log": 2}
    r = b.commit([q("y"), q("z")])
    assert r.written == {"query_log": 1} and r.duplicates == 1
    a.close()
    b.close()
    assert sorted(ReplayStore(tmp_path).table()["request_id"].to_pylist()) == ["x", "y", "z"]
    assert not list((tmp_path / ".writers").glob("*.lock"))


def test_a_batch_that_raced_another_writer_is_rewritten_without_its_keys(tmp_path, monkeypatch):
    """Writer b registers "y" between writer a's dedupe check and a's transaction. That interleaving
    cannot be produced on demand, so a's first check is made to miss it (a fake for a race); a's
    transaction checks again, drops its attempt (no shard of it stays), and stores the rest once."""
    a, b = StoreWriter(tmp_path, shared=True), StoreWriter(tmp_path, shared=True)
    b.commit([q("y")])
    checks = []
    real = a._known

    def first_check_misses(keys):
        checks.append(keys)
        return set() if len(checks) == 1 else real(keys)

    monkeypatch.setattr(a, "_known", first_check_misses)
    r = a.commit([q("x"), q("y")])
    # the missed check, the transaction's that caught y, then the retry's two (y known, x alone in the transaction)
    assert r.written == {"query_log": 1} and r.duplicates == 1 and [len(k) for k in checks] == [2, 2, 2, 1]
    a.close()
    b.close()
    assert sorted(ReplayStore(tmp_path).table()["request_id"].to_pylist()) == ["x", "y"]
    assert len(list(tmp_path.rglob("*.parquet"))) == 2  # b's shard and a's second attempt


def test_a_starting_shared_writer_keeps_a_live_writers_files_and_removes_a_dead_ones(tmp_path):
    live, dead = StoreWriter(tmp_path, shared=True), StoreWriter(tmp_path, shared=True)
    live._write_shard(
        "query_log", "2026-11-29", "v1", _columns("query_log", [q("in-flight")])
    )  # written, not registered yet
    dead._write_shard("query_log", "2026-11-29", "v1", _columns("query_log", [q("orphan")]))
    dead.db.close()
    import os

    os.close(dead._own_fd)  # a writer killed without closing: its own lock is released by the kernel
    os.close(dead._lock_fd)
    starting = StoreWriter(tmp_path, shared=True)
    assert starting.removed_orphans == 1
    names = [p.name for p in tmp_path.rglob("*.parquet")]
    assert len(names) == 1 and live.writer_id in names[0]
    starting.close()
    live.close()


def test_unregistered_shards_are_removed_and_never_read(tmp_path):
    w = StoreWriter(tmp_path)
    w.commit([q("a")])
    # what a crash between the shard rename and the index commit leaves behind
    w._write_shard("query_log", "2026-11-29", "v1", _columns("query_log", [q("ghost")]))
    w.close()
    assert len(list(tmp_path.rglob("*.parquet"))) == 2
    assert ReplayStore(tmp_path).table()["request_id"].to_pylist() == ["a"]
    w = StoreWriter(tmp_path)
    assert w.removed_orphans == 1 and len(list(tmp_path.rglob("*.parquet"))) == 1
    w.close()


def test_shards_are_partitioned_by_date_and_policy_version(tmp_path):
    w = StoreWriter(tmp_path)
    w.commit([q("a", "v1", ts=1795000000.0), q("b", "v2", ts=1795000000.0), q("c", "v2", ts=1795100000.0)])
    w.close()
    dirs = sorted(p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.parquet"))
    assert dirs == [
        "query_log/date=2026-11-18/policy_version=v1",
        "query_log/date=2026-11-18/policy_version=v2",
        "query_log/date=2026-11-19/policy_version=v2",
    ]


def test_new_prompts_pages_by_watermark(tmp_path):
    w = StoreWriter(tmp_path)
    store = ReplayStore(tmp_path)
    assert store.new_prompts(0) == ([], 0)
    w.commit([q("a", prompt="p1"), q("b", prompt="p2"), q("c", prompt="p1")])
    prompts, mark = store.new_prompts(0)
    assert sorted(p.text for p in prompts) == ["p1", "p2"] and mark > 0
    assert store.new_prompts(mark) == ([], mark)
    w.commit([q("d", prompt="p3")])
    prompts, mark2 = store.new_prompts(mark)
    assert [p.text for p in prompts] == ["p3"] and mark2 > mark
    assert prompts[0].messages == ({"role": "user", "content": "p3"},)
    w.close()


def test_responses_by_version_with_feedback_joined(tmp_path):
    w = StoreWriter(tmp_path)
    w.commit([q("a", "v1", prompt="same", response="old", ts=1795000000.0), q("x", "v1", prompt="other")])
    w.commit(
        [
            q("b", "v2", prompt="same", response="new", ts=1795000100.0),
            fb("b", "thumbs_up"),
            fb("b", "copy", ts=1795000200.0),
        ]
    )
    w.commit([fb("a", "thumbs_down")])  # feedback arriving in a later batch than its request
    w.close()
    store = ReplayStore(tmp_path)
    key = next(p.prompt_key for p in store.new_prompts(0)[0] if p.text == "same")
    by_version = store.responses_by_version(key)
    assert set(by_version) == {"v1", "v2"}
    assert [r.response for r in by_version["v1"]] == ["old"]
    assert [f.kind for f in by_version["v1"][0].feedback] == ["thumbs_down"]
    assert [f.kind for f in by_version["v2"][0].feedback] == ["thumbs_up", "copy"]


def test_dedupe_index_is_bounded(tmp_path):
    w = StoreWriter(tmp_path, dedupe_capacity=3)
    w.commit([q(f"r{i}") for i in range(5)])
    assert w.db.execute("SELECT COUNT(*) FROM seen").fetchone()[0] == 3
    assert w.commit([q("r4")]).duplicates == 1  # recent ids are still remembered
    w.close()


def test_the_cached_date_is_datetimes_date_also_around_midnight():
    """`_date` caches the string per day; next to midnight datetime's rounding to microseconds decides."""
    rng = random.Random(5)
    days = [rng.randrange(10_957, 47_482) for _ in range(50)]
    around = [-1.0, -4e-7, -6e-7, -1e-9, 0.0, 4e-7, 0.5, 1.0, 86_399.0, 86_399.5, 86_399.9999994, 86_399.9999996]
    values = [day * 86_400 + delta for day in days for delta in around]
    values += [rng.uniform(946_684_800.0, 4_102_444_800.0) for _ in range(5000)]
    for ts in values:
        assert _date(ts) == datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d"), ts


def test_every_column_of_a_query_log_shard_holds_its_event_field(tmp_path):
    """A rollout's attribution reaches the replay store: experiment, assigned arm and pair id are stored, as every
    other field of the event (the shard's columns are generated from the event model; none may stay null)."""
    import pyarrow.parquet as pq

    from streaming.store import QUERY_LOG_SCHEMA

    event = query_event(
        "r-attr",
        ts=1795000000.0,
        session_id="s1",
        finish_reason="stop",
        experiment_id="ro-v2-1",
        assigned_variant="canary",
        pair_id="p-1",
    )
    writer = StoreWriter(tmp_path)
    writer.commit([Stored(event, 3, 17)])
    writer.close()
    [shard] = list(tmp_path.glob("query_log/**/*.parquet"))
    [row] = pq.read_table(shard).to_pylist()
    assert {name for name, value in row.items() if value is None} == set(), row
    assert (row["experiment_id"], row["assigned_variant"], row["pair_id"], row["shadow"]) == (
        "ro-v2-1",
        "canary",
        "p-1",
        False,
    )
    assert (row["source_partition"], row["source_offset"]) == (3, 17) and set(row) == set(QUERY_LOG_SCHEMA.names)


def test_each_stored_row_is_its_events_values_whichever_parser_made_the_event(tmp_path):
    """The shard's columns are built column by column (store._columns); row by row they must hold each event's
    own values: its fields (sampling flattened), its prompt's key and last user message, where it came from."""
    import msgspec

    from dynrubric.prompt_key import prompt_key
    from streaming.events import QueryLogEvent, QueryLogRecord, parse_records

    chats = [
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "2nd"},
        ],
        [{"role": "system", "content": "only a system prompt"}],
        [{"role": "user", "content": "x: y"}],
    ]
    models = [
        query_event(
            f"m{i}", messages=chat, session_id=None if i else "s", pair_id="p" if i == 1 else None, shadow=i == 2
        )
        for i, chat in enumerate(chats)
    ]
    raws = [e.to_bytes().replace(b'"request_id":"m', b'"request_id":"r') for e in models]
    records = parse_records(QueryLogEvent, raws, 1 << 20)
    assert all(isinstance(r, QueryLogRecord) for r in records)  # the batch path's records, not the models
    feedback = [
        FeedbackEvent(request_id=f"f{i}", ts=1795000001.0 + i, user_key="u", kind="copy", value=None) for i in range(2)
    ]
    events = [*models, *records, *feedback]
    writer = StoreWriter(tmp_path)
    writer.commit([Stored(e, i % 3, 100 + i) for i, e in enumerate(events)])  # type: ignore[arg-type]
    writer.close()
    store = ReplayStore(tmp_path)
    rows = {r["request_id"]: r for kind in ("query_log", FEEDBACK) for r in store.table(kind).to_pylist()}
    assert len(rows) == len(events)
    for i, event in enumerate(events):
        values = msgspec.to_builtins(event) if isinstance(event, msgspec.Struct) else event.model_dump()
        values.pop("schema_version")
        values.update(values.pop("sampling", {}))
        if "messages" in values:
            users = [m["content"] for m in values["messages"] if m["role"] == "user"]
            values["prompt_key"] = prompt_key((m["role"], m["content"]) for m in values["messages"])
            values["prompt_text"] = users[-1] if users else ""
        values.update(source_partition=i % 3, source_offset=100 + i)
        assert rows[values["request_id"]] == values


def test_a_prompts_key_is_the_stores_original_digest():
    """Replay stores written before keep their keys: blake2b-128 of role US content, the pairs joined by RS."""
    import hashlib

    from dynrubric.prompt_key import prompt_key

    expected = hashlib.blake2b(b"system\x1fbe brief\x1euser\x1f2+2?", digest_size=16).hexdigest()
    assert prompt_key([("system", "be brief"), ("user", "2+2?")]) == expected
