"""Poison messages against the real embedded broker: ingest stores exactly the valid events, dead-letters
exactly the poison with a reason each, keeps running, and never sends a dead letter twice.

The one fault that cannot come from outside (a record the store cannot write, since validation rejects
every such value) is made by a plugged-in scrubber (tests/unit/test_streaming_fuzz.py: poison_scrubber).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter

from kafka import KafkaProducer
from prometheus_client import CollectorRegistry

from streaming.events import DeadLetter
from streaming.ingest import Ingestor
from streaming.kafka import Topics, ensure_topics
from streaming.store import FEEDBACK, ReplayStore
from tests.integration.test_streaming_ingest import ingest_cfg, isolated
from tests.integration.test_streaming_producer import query_event
from tests.integration.test_streaming_producer import read_all as read_topic
from tests.unit.test_streaming_fuzz import STORE_POISON

MAX_EVENT_BYTES = 65_536
DLQ_PAYLOAD = 4096


def _query(rid: str, **over) -> dict:
    return {**json.loads(query_event("valid").to_bytes()), "request_id": rid, **over}


def _feedback(rid: str, **over) -> dict:
    return {
        "schema_version": 1,
        "request_id": rid,
        "ts": 1795000000.5,
        "user_key": "u1",
        "kind": "dwell",
        "value": 2.5,
        **over,
    }


def _text(doc: dict, old: str, new: str) -> bytes:
    text = json.dumps(doc)
    assert old in text
    return text.replace(old, new, 1).encode()


def poison() -> list[tuple[str, str, bytes | None]]:
    """(topic: q or f, expected reason, value) for every class of bad input the issue names."""
    big = json.dumps(_query("big", response="x" * 1_000_000)).encode()
    return [
        ("q", "too_deep", b"[" * 5000 + b"]" * 5000),
        ("q", "too_deep", json.dumps(_query("deep", response="@@")).replace('"@@"', "[" * 3000 + "]" * 3000).encode()),
        ("q", "ts_window", json.dumps(_query("ts-huge", ts=1e20)).encode()),
        ("q", "non_finite", _text(_query("ts-inf", ts=1.5), "1.5", "Infinity")),
        ("q", "ts_units", json.dumps(_query("ts-ms", ts=1.7e12)).encode()),
        ("q", "ts_window", json.dumps(_query("ts-2150", ts="2150-01-01T00:00:00Z")).encode()),
        ("q", "oversize", big),
        ("q", "non_finite", _text(_query("nan", latency_ms=1.5), "1.5", "NaN")),
        ("f", "non_finite", _text(_feedback("f-inf", value=1.5), "1.5", "Infinity")),
        ("q", "control_character", json.dumps(_query("nul\u0000id")).encode()),
        ("q", "control_character", json.dumps(_query("nul-user", user_key="u\u00001")).encode()),
        # values that are not what they claim (once stored): each with a reason of its own
        ("q", "ts_format", json.dumps(_query("ts-25h", ts="2026-11-30T15:13:48+25:00")).encode()),
        ("q", "ts_format", json.dumps(_query("ts-newline", ts="2026-11-30T15:13:48Z\n")).encode()),
        ("q", "ts_format", json.dumps(_query("ts-wide", ts="\uff12\uff10\uff12\uff16-11-30T15:13:48Z")).encode()),
        ("q", "control_character", json.dumps(_query("nul-response", response="four\u0000")).encode()),
        (
            "f",
            "missing_value",
            json.dumps({k: v for k, v in _feedback("no-value", kind="thumbs_up").items() if k != "value"}).encode(),
        ),
        ("q", "unknown_variant", json.dumps(_query("arm-space", variant="stable ")).encode()),
        ("q", "unknown_variant", json.dumps(_query("arm-cyrillic", variant="st\u0430ble")).encode()),
        ("q", "unknown_variant", json.dumps(_query("arm-control", variant="control")).encode()),
        ("q", "finish_reason", json.dumps(_query("finish-zwsp", finish_reason="stop\u200b")).encode()),
        ("q", "duplicate_key", _text(_query("dup"), '"schema_version": 1', '"schema_version": 2, "schema_version": 1')),
        ("q", "schema", json.dumps(_query("neg", latency_ms=-5.0)).encode()),
        ("q", "schema", json.dumps(_query("neg-tok", completion_tokens=-1)).encode()),
        ("f", "schema", json.dumps(_feedback("dwell-0", value=0)).encode()),
        (
            "q",
            "number_range",
            _text(_query("int", prompt_tokens=7), '"prompt_tokens": 7', '"prompt_tokens": ' + "9" * 5000),
        ),
        ("q", "bad_json", _text(_query("surrogate", response="R"), '"R"', '"\\ud800"')),
        ("q", "bad_json", b"\xff\xfe{not json"),
        ("q", "bad_json", None),
        ("q", "store_error", json.dumps(_query("store-poison", response=f"{STORE_POISON}")).encode()),
    ]


def valid() -> list[tuple[str, str, bytes]]:
    """(topic, request_id, value): plain events and the timestamps real producers write."""
    out = [("q", f"ok-{i}", query_event(f"ok-{i}").to_bytes()) for i in range(20)]
    for i, ts in enumerate(
        [
            "2026-11-30T15:13:48.123456Z",
            "2026-11-30T20:43:48+05:30",
            "2026-11-30T15:13:48.123456789Z",
            "2026-11-30T10:13:48.5-05:00",
            1796051628,
        ]
    ):
        out.append(("q", f"ts-{i}", json.dumps(_query(f"ts-{i}", ts=ts)).encode()))
    out += [("f", f"ok-{i}", json.dumps(_feedback(f"ok-{i}", ts="2026-11-30T15:13:48Z")).encode()) for i in range(3)]
    out += [
        ("q", f"finish-{r}", json.dumps(_query(f"finish-{r}", finish_reason=r)).encode())
        for r in ("tool_calls", "content_filter", "length")
    ]  # real finish reasons stay accepted
    out.append(("f", "null-value", json.dumps(_feedback("null-value", kind="thumbs_up", value=None)).encode()))
    return out


def test_poison_of_every_class_is_dead_lettered_once_and_ingest_keeps_running(kafka_broker, tmp_path, caplog):
    kafka = isolated(kafka_broker)
    topics = Topics.of(kafka)
    topic_of = {"q": topics.query_log, "f": topics.feedback}
    ensure_topics(kafka)
    producer = KafkaProducer(bootstrap_servers=kafka_broker, max_request_size=2_000_000)
    good, bad = valid(), poison()
    # valid and poison interleaved, so that every batch holds both
    for i in range(max(len(good), len(bad))):
        for items in (good, bad):
            if i < len(items):
                topic, key, value = items[i]
                producer.send(topic_of[topic], key=key.encode(), value=value)
    producer.flush()

    cfg = ingest_cfg(
        max_event_bytes=MAX_EVENT_BYTES,
        dlq_max_payload_bytes=DLQ_PAYLOAD,
        dlq_quarantine_dir=tmp_path / "quarantine",
        pii_scrubber="tests.unit.test_streaming_fuzz:poison_scrubber",
    )
    registry = CollectorRegistry()
    ingestor = Ingestor(kafka, cfg, tmp_path / "store", registry)
    stop = threading.Event()
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(ingestor.run(stop)), daemon=True)
    thread.start()
    sample = registry.get_sample_value

    def consumed() -> float:
        return sum(sample("dynrubric_ingest_consumed_total", {"topic": t}) or 0 for t in topic_of.values())

    def settled(n: int) -> bool:
        return ingestor.summary.consumed >= n and ingestor.summary.unaccounted == 0

    deadline = time.monotonic() + 120
    while not settled(len(good) + len(bad)) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert thread.is_alive(), f"ingest stopped: {outcome}"
    # still alive after every class of poison: one more valid event goes through
    producer.send(topics.query_log, key=b"after", value=query_event("after").to_bytes())
    producer.close()
    while not settled(len(good) + len(bad) + 1) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert thread.is_alive()
    stop.set()
    thread.join(60)
    [summary] = outcome

    store = ReplayStore(tmp_path / "store")
    stored = sorted(store.table()["request_id"].to_pylist())
    assert stored == sorted([k for t, k, _ in good if t == "q"] + ["after"]), "exactly the N valid events"
    assert sorted(store.table(FEEDBACK)["request_id"].to_pylist()) == sorted(k for t, k, _ in good if t == "f")
    ts = dict(zip(store.table()["request_id"].to_pylist(), store.table()["ts"].to_pylist(), strict=True))
    expected = {
        "ts-0": 1796051628.123456,
        "ts-1": 1796051628.0,
        "ts-2": 1796051628.123456789,
        "ts-3": 1796051628.5,
        "ts-4": 1796051628.0,
    }
    assert all(abs(ts[k] - v) < 1e-6 for k, v in expected.items()), ts

    letters = [DeadLetter.from_record(r.value, r.key, r.headers) for r in read_topic(kafka_broker, topics.dead_letter)]
    sources = {t: {(r.partition, r.offset): r.value for r in read_topic(kafka_broker, t)} for t in topic_of.values()}

    def source(dl: DeadLetter) -> bytes | None:
        return sources[dl.source_topic][(dl.source_partition, dl.source_offset)]

    got = sorted((dl.source_topic, dl.reason, source(dl) or b"") for dl in letters)
    want = sorted((topic_of[t], reason, value or b"") for t, reason, value in bad)
    missing, extra = Counter(want) - Counter(got), Counter(got) - Counter(want)
    shown = {"missing": [(t, r, v[:80]) for t, r, v in missing], "extra": [(t, r, v[:80]) for t, r, v in extra]}
    assert got == want, f"exactly the M poison, each with its reason: {shown}"
    assert len({(dl.source_topic, dl.source_partition, dl.source_offset) for dl in letters}) == len(bad)
    for dl in letters:
        original = source(dl)
        assert dl.error and dl.truncated == (len(original or b"") > DLQ_PAYLOAD)
        if original is not None:
            assert dl.original_length == len(original) and dl.original_sha256 == hashlib.sha256(original).hexdigest()
            assert dl.raw == original[:DLQ_PAYLOAD]
        if dl.truncated:
            kept = (
                tmp_path / "quarantine" / dl.source_topic / f"{dl.source_partition}-{dl.source_offset}.bin"
            ).read_bytes()
            assert kept == original, "the full bytes of a cut letter are in the quarantine"
    assert any(dl.truncated and dl.original_length > 1_000_000 for dl in letters), "the 1 MB one, cut"
    # fetched whole: the consumer never dropped its connection on a frame larger than kafka-python's default limit
    dropped = [r.getMessage() for r in caplog.records if "InvalidReceiveError" in r.getMessage()]
    assert not dropped, dropped

    total = len(good) + len(bad) + 1
    assert summary.consumed == total == consumed()
    assert summary.written + summary.duplicates + summary.filtered + summary.dead_lettered == total
    assert summary.dead_lettered == len(bad) and sample("dynrubric_ingest_unaccounted_total") == 0
    print(f"poison e2e: consumed {summary.consumed}, stored {summary.written}, dead-lettered {summary.dead_lettered}")

    # a new group re-reads everything (as after a crash before the offset commit): no letter is sent twice
    again_registry = CollectorRegistry()
    rereader = Ingestor(
        kafka,
        ingest_cfg(
            **{
                k: getattr(cfg, k)
                for k in ("max_event_bytes", "dlq_max_payload_bytes", "dlq_quarantine_dir", "pii_scrubber")
            }
        ),
        tmp_path / "store",
        again_registry,
    )
    stop_again = threading.Event()
    outcome.clear()
    thread = threading.Thread(target=lambda: outcome.append(rereader.run(stop_again)), daemon=True)
    thread.start()
    # stopped once it has re-read everything, not after an idle pause (a loaded machine pauses too)
    deadline = time.monotonic() + 120
    while not (rereader.summary.consumed >= total and rereader.summary.unaccounted == 0) and thread.is_alive():
        assert time.monotonic() < deadline, rereader.summary
        time.sleep(0.2)
    stop_again.set()
    thread.join(60)
    [again] = outcome
    assert again.written == 0 and again.duplicates == total - len(bad) and again.dead_lettered == len(bad)
    assert again_registry.get_sample_value("dynrubric_ingest_dead_letters_already_sent_total") == len(bad)
    assert len(read_topic(kafka_broker, topics.dead_letter)) == len(bad)
