"""Fuzzing the ingest writer path: parse -> filter -> scrub -> store, in-process (no Kafka needed).

A mutation fuzzer over valid events (byte flips, truncation, deep nesting, huge and non-finite
numbers, odd Unicode, duplicate keys, oversize, field swaps, timestamps of every shape) and hypothesis
strategies (arbitrary JSON in every field) feed the real `BatchWriter` and a real replay store.
Each batch must come back (0 crashes), every record must end in exactly one outcome, and every row in
the store must satisfy the value rules, checked here independently of the pydantic models.

Records that make the store itself fail cannot be produced from outside any more (validation rejects
every value the store cannot hold), so a plugged-in scrubber (`poison_scrubber`, a real plug-in point)
turns a marked text into a lone surrogate, which Parquet cannot encode: a real store failure.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from datetime import UTC, datetime, timedelta, timezone

import hypothesis.strategies as st
import pyarrow as pa
from hypothesis import HealthCheck, given, settings

from dynrubric.config import IngestConfig
from streaming.events import MAX_FEEDBACK_VALUE, MAX_LATENCY_MS, MAX_TOKENS, TS_MAX, TS_MIN
from streaming.store import FEEDBACK, QUERY_LOG, ReplayStore
from streaming.writer_process import FEEDBACK_KIND, QUERY_LOG_KIND, BatchWriter, RawBatch, RawRecord

STORE_POISON = "STORE-POISON"
MAX_EVENT_BYTES = 8192
MUTATED = 20_000
BATCH = 2000
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def poison_scrubber(text: str) -> str:
    """`ingest.pii_scrubber` for these tests: a marked text becomes one the store cannot encode."""
    return text.replace(STORE_POISON, "\ud800") if STORE_POISON in text else text


def fuzz_cfg() -> IngestConfig:
    return IngestConfig(max_event_bytes=MAX_EVENT_BYTES, pii_scrubber="tests.unit.test_streaming_fuzz:poison_scrubber")


def valid_query(rng: random.Random, i: int) -> dict:
    return {
        "schema_version": 1,
        "request_id": f"q-{i}",
        "ts": 1795000000.0 + rng.random() * 3600,
        "user_key": f"u{rng.randrange(50)}",
        "session_id": rng.choice([None, f"s{i}"]),
        "variant": "stable",
        "policy_version": rng.choice(["v1", "v2.0", "ckpt_7"]),
        "model": "smollm2-135m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"question {i}?" if i % 50 else "  "},
        ],
        "response": f"answer {i}",
        "finish_reason": "stop",
        "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 64},
        "latency_ms": rng.random() * 1000,
        "prompt_tokens": rng.randrange(1, 100),
        "completion_tokens": rng.randrange(100),
    }


def valid_feedback(rng: random.Random, i: int) -> dict:
    kind = rng.choice(["thumbs_up", "thumbs_down", "regenerate", "copy", "dwell"])
    return {
        "schema_version": 1,
        "request_id": f"q-{i}",
        "ts": 1795000000.0 + i,
        "user_key": "u1",
        "kind": kind,
        "value": rng.uniform(0.5, 100) if kind == "dwell" else rng.choice([None, 1.0]),
    }


ODD_TEXT = [
    "\u0000",
    "\u202e",
    "\ufeff",
    "\U0001f600",
    "\ud83d\ude00",
    "e\u0301",
    "\u2028",
    "\x85",
    "\x7f",
    "\u200b",
    "🙂" * 50,
]
ODD_NUMBERS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "1e308",
    "9" * 40,
    "9" * 5000,
    "-0",
    "0.0",
    "1e20",
    "1.7e12",
    "-5",
    "3.5",
    "17e-400",
    "2e9",
]
RFC3339 = [
    "2026-11-30T15:13:48.123456789Z",
    "2026-11-30T15:13:48+05:30",
    "2026-11-30T15:13:48.1-00:00",
    "2026-11-30 15:13:48Z",
    "2026-02-30T00:00:00Z",
    "2026-11-30T15:13:48",
    "1999-12-31T23:59:59Z",
    "2100-01-01T00:00:00Z",
    "2016-12-31T23:59:60Z",
    "2026-11-30T25:00:00Z",
    "",
]


def _set_field(doc: dict, rng: random.Random, value) -> dict:
    doc = json.loads(json.dumps(doc))
    target = doc
    if rng.random() < 0.3 and "sampling" in doc:
        target = doc["sampling"]
    elif rng.random() < 0.3 and "messages" in doc:
        target = doc["messages"][0]
    target[rng.choice(list(target))] = value
    return doc


def mutate(doc: dict, rng: random.Random) -> bytes:
    """One mutated record of a valid event `doc` (some mutations keep it valid)."""
    raw = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
    op = rng.randrange(13)
    if op == 0:  # byte flips
        b = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if op == 1:  # truncation
        return raw[: rng.randrange(len(raw))]
    if op == 2:  # deep nesting, in a field or as the whole record
        depth = rng.choice([5, 199, 201, 3000, 100_000])
        nest = "[" * depth + "1" + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
        if rng.random() < 0.3:
            return nest.encode()
        return json.dumps(_set_field(doc, rng, "@@")).replace('"@@"', nest).encode()
    if op == 3:  # huge, tiny and non-finite numbers written as JSON literals
        return json.dumps(_set_field(doc, rng, "@@")).replace('"@@"', rng.choice(ODD_NUMBERS)).encode()
    if op == 4:  # odd Unicode in a field: control characters, bidi marks, lone and paired surrogates
        text = "".join(rng.choice(ODD_TEXT) for _ in range(rng.randrange(1, 4)))
        out = json.dumps(_set_field(doc, rng, "x" + text + "x"))
        if rng.random() < 0.3:
            out = out.replace("x\\u", "x\\ud800\\u", 1)  # a lone high surrogate as a JSON escape
        return out.encode()
    if op == 5:  # invalid UTF-8 bytes inside a string
        return raw.replace(b'"stable"', b'"st\xc0\xafble"').replace(b'"u1"', b'"\xed\xa0\x80"')
    if op == 6:  # duplicate keys
        key = rng.choice(list(doc))
        return raw.replace(b"{", b'{"%s": %s, ' % (key.encode(), json.dumps(doc[key]).encode()), 1)
    if op == 7:  # oversize
        return (
            json.dumps({**doc, "pad": "x"})
            .replace('"x"', '"' + "x" * (MAX_EVENT_BYTES + rng.randrange(5000)) + '"')
            .encode()
        )
    if op == 8:  # timestamps of every shape
        return json.dumps(
            {**doc, "ts": rng.choice(RFC3339 + [1.7e12, 1.7e15, 1.7e18, 0, -1, 1e20, True, "1795000000"])}
        ).encode()
    if op == 9:  # a field removed, or an unknown one added
        d = dict(doc)
        if rng.random() < 0.5:
            d.pop(rng.choice(list(d)))
        else:
            d["extra"] = 1
        return json.dumps(d).encode()
    if op == 10:  # a field replaced by a value of another type
        return json.dumps(
            _set_field(doc, rng, rng.choice([None, "", 0, -1, 1.5, True, [], {}, "a" * 300, 2**63]))
        ).encode()
    if op == 11:  # valid, with a timestamp as a real producer writes it
        offset = timezone(timedelta(minutes=rng.choice([0, 330, -300, 45])))
        when = datetime.fromtimestamp(1795000000 + rng.randrange(3600), UTC).astimezone(offset)
        return json.dumps({**doc, "ts": when.isoformat()}).encode()
    return raw  # unchanged: a re-send, stored once


def assert_row_is_valid(row: dict, kind: str) -> None:
    """The value rules, checked without the models."""
    assert TS_MIN <= row["ts"] < TS_MAX and math.isfinite(row["ts"])
    for name in ("request_id", "user_key") + (("variant", "model", "policy_version") if kind == QUERY_LOG else ()):
        assert row[name] and not CONTROL.search(row[name]), (name, row[name])
    for value in row.values():
        if isinstance(value, float):
            assert math.isfinite(value)
    if kind == QUERY_LOG:
        assert 0 <= row["latency_ms"] <= MAX_LATENCY_MS
        assert 0 <= row["prompt_tokens"] <= MAX_TOKENS and 0 <= row["completion_tokens"] <= MAX_TOKENS
        assert 1 <= row["max_tokens"] <= MAX_TOKENS and 0 < row["top_p"] <= 1 and row["temperature"] >= 0
        assert row["messages"] and re.fullmatch(r"[A-Za-z0-9._-]{1,64}", row["policy_version"])
    else:
        assert row["value"] is None or 0 <= row["value"] <= MAX_FEEDBACK_VALUE
        assert row["kind"] != "dwell" or (row["value"] or 0) > 0


class Run:
    """Feeds batches to one BatchWriter and keeps the tallies."""

    def __init__(self, store_dir):
        self.writer = BatchWriter(store_dir, fuzz_cfg())
        self.store_dir = store_dir
        self.tally: Counter = Counter()
        self.reasons: Counter = Counter()
        self.offset = 0

    def feed(self, records: list[tuple[int, bytes | None]]) -> None:
        batch = RawBatch.of([RawRecord(kind, 0, self.offset + i, value) for i, (kind, value) in enumerate(records)])
        self.offset += len(batch)
        try:
            written = self.writer.write(batch)
        except Exception as e:  # noqa: BLE001 - counted, and the test fails on any
            self.tally["crashes"] += 1
            self.reasons[f"crash: {type(e).__name__}: {e}"[:200]] += 1
            return
        self.tally["messages"] += len(batch)
        self.tally["stored"] += sum(written.result.written.values())
        self.tally["duplicates"] += written.result.duplicates
        self.tally["filtered"] += sum(written.filtered.values())
        self.tally["dead_lettered"] += len(written.dead)
        self.tally["unaccounted"] += len(batch) - written.accounted()
        self.reasons.update(reason for _, reason, _ in written.dead)

    def check_store(self) -> None:
        self.writer.close()
        store = ReplayStore(self.store_dir)
        rows = 0
        for kind in (QUERY_LOG, FEEDBACK):
            table: pa.Table = store.table(kind)
            for row in table.to_pylist():
                assert_row_is_valid(row, kind)
                rows += 1
        store.close()
        assert rows == self.tally["stored"]


def test_fuzz_mutated_events_never_crash_the_writer_and_store_nothing_invalid(tmp_path):
    rng = random.Random(13)
    run = Run(tmp_path / "store")
    produced = mutated = 0  # mutated: messages whose bytes differ from the valid event they came from
    while mutated < MUTATED:
        records = []
        for j in range(BATCH):
            i = produced + j
            if rng.random() < 0.8:
                kind, doc = QUERY_LOG_KIND, valid_query(rng, i % 3000)
                if j == 7:  # one record per batch the store cannot write
                    doc["response"] = f"{STORE_POISON} {i}"
            else:
                kind, doc = FEEDBACK_KIND, valid_feedback(rng, i % 3000)
            if j == 7:
                value = json.dumps(doc).encode()
            else:  # a tombstone now and then
                value = mutate(doc, rng) if rng.random() < 0.995 else None
                unchanged = {json.dumps(doc, ensure_ascii=a).encode() for a in (True, False)}
                mutated += value is not None and value not in unchanged
            records.append((kind, value))
        run.feed(records)
        produced += BATCH
    print("fuzz:", dict(run.tally), "mutated:", mutated, "reasons:", dict(run.reasons))
    assert run.tally["crashes"] == 0, run.reasons
    assert run.tally["messages"] == produced and mutated >= 20_000
    assert run.tally["unaccounted"] == 0
    # every class of bad input reached its own reason, and valid ones were stored
    assert {
        "bad_json",
        "too_deep",
        "duplicate_key",
        "non_finite",
        "number_range",
        "oversize",
        "schema",
        "schema_version",
        "ts_units",
        "ts_window",
        "store_error",
    } <= set(run.reasons)
    assert run.tally["stored"] > 1000 and run.tally["duplicates"] > 0
    run.check_store()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
QUERY_FIELDS = list(valid_query(random.Random(0), 0))


@st.composite
def query_docs(draw) -> bytes:
    doc = valid_query(random.Random(draw(st.integers(0, 2**16))), draw(st.integers(0, 10**6)))
    for name in draw(st.lists(st.sampled_from(QUERY_FIELDS), max_size=3, unique=True)):
        doc[name] = draw(JSON | st.text() | st.floats(min_value=0, max_value=1e13) | st.integers(-(2**70), 2**70))
    return json.dumps(doc, allow_nan=True).encode()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(batch=st.lists(query_docs() | st.binary(max_size=200), min_size=1, max_size=40))
def test_fuzz_hypothesis_documents_end_in_exactly_one_outcome(tmp_path_factory, batch):
    run = Run(tmp_path_factory.mktemp("hyp"))
    run.feed([(QUERY_LOG_KIND, raw) for raw in batch])
    assert run.tally["crashes"] == 0, run.reasons
    assert run.tally["unaccounted"] == 0
    run.check_store()
