"""Ingest details: PII scrubbing (default and plugged in), filters, backpressure, the /metrics endpoint."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from kafka import KafkaProducer
from prometheus_client import CollectorRegistry

from dynrubric.config import IngestConfig
from dynrubric.errors import DynrubricError
from streaming.filters import (
    PromptFilter,
    _ascii_digits,
    _pii_candidates,
    load_scrubber,
    scrub_pii,
    scrub_texts,
    scrubbed,
    scrubbed_all,
)
from streaming.ingest import Ingestor, MetricsServer
from streaming.kafka import Topics, ensure_topics
from streaming.store import ReplayStore
from tests.integration.test_streaming_ingest import ingest_cfg, isolated
from tests.integration.test_streaming_producer import query_event


def shout(text: str) -> str:
    """A plugged-in scrubber (`ingest.pii_scrubber = "tests.integration.test_streaming_ingest_parts:shout"`)."""
    return text.upper()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("write to jane.doe+news@mail.example.org today", "write to <email> today"),
        ("call +44 20 7946 0958 or (555) 123-4567", "call <phone> or <phone>"),
        ("my number is 555-123-4567.", "my number is <phone>."),
        ("what is 1234567 * 3?", "what is 1234567 * 3?"),  # a bare number stays: it is maths, not a phone
        ("on 2026-11-29 at 10:30", "on 2026-11-29 at 10:30"),
        ("1 2 3 4 5 6", "1 2 3 4 5 6"),
    ],
)
def test_default_scrubber(text, expected):
    assert scrub_pii(text) == expected


def test_the_digit_count_that_spares_the_phone_scan_counts_ascii_digits_only():
    """`_ascii_digits` counts UTF-8 bytes; other scripts' digits, emoji and a lone surrogate must not count."""
    rng = random.Random(3)
    alphabet = "0123456789 ab@+-()\u0663\u00e9\uff10\U0001f600\ud800"
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        assert _ascii_digits(text) == sum(map(text.count, "0123456789")), text


def test_scrubbing_a_batchs_texts_at_once_is_scrubbing_each():
    """`scrub_texts` scrubs only the texts its two passes over the whole batch pick (an "@", 7+ ASCII digits):
    the same texts out as `scrub_pii` of each, for texts that scrub and texts that must stay."""
    rng = random.Random(5)
    alphabet = "0123456789 ab.@+-()\n\u0663\u00e9\uff10\U0001f600\ud800"
    pieces = ["jane.doe@mail.example.org", "+44 20 7946 0958", "555-123-4567", "1234567", "2026-11-29", "12345"]
    texts = []
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(30)))
        texts.append(text + rng.choice(pieces) + text[::-1] if rng.random() < 0.5 else text)
    assert len(_pii_candidates(texts)) < len(texts)  # the pass spared some texts the scrub
    assert scrub_texts(texts, scrub_pii) == [scrub_pii(t) for t in texts]
    with_nul = ["call 555-123-4567", "a\x00b 555 123 4567", "x@y.org"]  # a NUL in a text: each is scrubbed
    assert scrub_texts(with_nul, scrub_pii) == [scrub_pii(t) for t in with_nul]
    valid = [t for t in texts if "\ud800" not in t]  # an event's text holds no lone surrogate
    events = [
        query_event(f"r{i}", messages=[{"role": "user", "content": t}], response=valid[-1 - i])
        for i, t in enumerate(valid[:50])
    ]
    assert [e.model_dump() for e in scrubbed_all(events, scrub_pii)] == [
        scrubbed(e, scrub_pii).model_dump() for e in events
    ]


def test_scrubber_is_pluggable_and_bad_paths_are_named():
    fn = load_scrubber(IngestConfig(pii_scrubber="tests.integration.test_streaming_ingest_parts:shout"))
    event = scrubbed(query_event("r", messages=[{"role": "user", "content": "hi"}], response="ok"), fn)
    assert event.messages[0].content == "HI" and event.response == "OK"
    assert load_scrubber(IngestConfig(scrub_pii=False)) is None
    with pytest.raises(DynrubricError, match="cannot be loaded"):
        load_scrubber(IngestConfig(pii_scrubber="no.such.module:fn"))
    clean = query_event("c", messages=[{"role": "user", "content": "nothing here"}])
    assert scrubbed(clean, scrub_pii) is clean


def test_filters():
    f = PromptFilter(IngestConfig(max_prompt_chars=20, deny_patterns=[r"(?i)ignore previous"]))
    assert f.reason(query_event("a", messages=[{"role": "user", "content": "short"}])) is None
    assert (
        f.reason(query_event("b", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": " "}]))
        == "empty_prompt"
    )
    for blank in ("", "\u3000\u2003\t\n"):  # no text, or only (Unicode) whitespace: what str.strip() removes
        assert f.reason(query_event("e", messages=[{"role": "user", "content": blank}])) == "empty_prompt"
    chat = [
        {"role": "assistant", "content": "x" * 30},
        {"role": "user", "content": ""},
        {"role": "user", "content": "?"},
    ]
    assert f.reason(query_event("g", messages=chat)) is None  # an assistant turn is not prompt; one user text is
    assert f.reason(query_event("c", messages=[{"role": "user", "content": "x" * 21}])) == "too_long"
    assert f.reason(query_event("d", messages=[{"role": "user", "content": "IGNORE previous"}])) == "denied"
    assert f.reason(query_event("e", messages=[{"role": "user", "content": "short"}], shadow=True)) == "shadow"
    with pytest.raises(ValueError, match="not a valid regular expression"):
        IngestConfig(deny_patterns=["(unclosed"])


def slow_scrub(text: str) -> str:
    """A plugged-in scrubber as slow as an expensive PII model: it makes the writer process lag."""
    time.sleep(0.005)
    return text


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_slow_writer_stops_the_consumer_and_loses_nothing(kafka_broker, tmp_path, client):
    # The scrubber runs in the writer process, so a slow one is a real slow writer (no fake needed):
    # 10 records x 3 texts x 5 ms = 150 ms per batch.
    kafka = isolated(kafka_broker)
    ensure_topics(kafka)
    producer = KafkaProducer(bootstrap_servers=kafka_broker)
    for i in range(150):
        e = query_event(f"bp-{i}")
        producer.send(Topics.of(kafka).query_log, key=e.request_id.encode(), value=e.to_bytes())
    producer.close()

    registry = CollectorRegistry()
    ingestor = Ingestor(
        kafka,
        ingest_cfg(
            batch_max_records=10,
            max_pending_batches=1,
            client=client,
            pii_scrubber="tests.integration.test_streaming_ingest_parts:slow_scrub",
        ),
        tmp_path / "s",
        registry,
    )
    metrics = MetricsServer(registry, "127.0.0.1", 0, ready=ingestor.assigned.is_set)
    try:
        base = f"http://{metrics.host}:{metrics.port}"
        assert httpx.get(base + "/readyz").status_code == 503, "not ready before partitions are assigned"
        done = threading.Event()
        ready_seen = []

        def watch():
            while not done.is_set():
                if httpx.get(base + "/readyz").status_code == 200:
                    ready_seen.append(True)
                    return
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        summary = ingestor.run(threading.Event(), until_idle_s=2)
        done.set()
        watcher.join()
        assert ready_seen
        assert httpx.get(base + "/healthz").json() == {"status": "ok"}
        text = httpx.get(base + "/metrics").text
    finally:
        metrics.stop()
    assert summary.written == 150 and summary.batches >= 15
    assert registry.get_sample_value("dynrubric_ingest_backpressure_pauses_total") >= 1
    assert "dynrubric_ingest_backpressure_pauses_total" in text
    assert f'dynrubric_ingest_written_total{{topic="{Topics.of(kafka).query_log}"}} 150.0' in text
    assert sorted(ReplayStore(tmp_path / "s").table()["request_id"].to_pylist()) == sorted(
        f"bp-{i}" for i in range(150)
    )
