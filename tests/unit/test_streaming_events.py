"""The event models (the one definition), the JSON Schema files generated from them, and the strict
value rules: the files are fresh, and the schema and `parse_event` accept and reject the same documents."""

from __future__ import annotations

import copy
import hashlib
import json

import jsonschema
import pytest

from streaming.event_schemas import SCHEMA_DIR, schema_text
from streaming.events import (
    QUERY_LOG_TOPIC,
    SCHEMA_FILE_OF_MODEL,
    WIRE_REQUIRED,
    DeadLetter,
    FeedbackEvent,
    MalformedEvent,
    QueryLogEvent,
    load_schema,
    parse_event,
)

QUERY = {
    "schema_version": 1,
    "request_id": "r-1",
    "ts": 1795000000.25,
    "user_key": "u-9f2c",
    "session_id": "s-1",
    "variant": "stable",
    "policy_version": "v3",
    "model": "smollm2-135m",
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
    "response": "4",
    "finish_reason": "stop",
    "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 64},
    "latency_ms": 12.5,
    "prompt_tokens": 10,
    "completion_tokens": 1,
}
FEEDBACK = {
    "schema_version": 1,
    "request_id": "r-1",
    "ts": 1795000001,
    "user_key": "u-9f2c",
    "kind": "dwell",
    "value": 3.5,
}

# Values that are wrong (or right) for some type; every field of every model gets every probe.
PROBES = [
    None,
    "",
    "x",
    "v/../3",
    0,
    -1,
    1.5,
    True,
    [],
    [{}],
    {},
    {"role": "user"},
    "a" * 300,
    2,
    "a\x00b",
    "a\u200bb",
    "tool_calls",
]


def _mutations(doc: dict, path: tuple = ()):
    """Documents that each differ from `doc` in one place: a field removed, replaced, or added."""
    for key, value in doc.items():
        here = path + (key,)
        removed = copy.deepcopy(doc)
        del removed[key]
        yield here + ("<removed>",), removed
        for probe in PROBES:
            changed = copy.deepcopy(doc)
            changed[key] = probe
            yield here + (repr(probe)[:20],), changed
        if isinstance(value, dict):
            for sub_path, sub in _mutations(value, here):
                changed = copy.deepcopy(doc)
                changed[key] = sub
                yield sub_path, changed
        if isinstance(value, list) and value and isinstance(value[0], dict):
            for sub_path, sub in _mutations(value[0], here + (0,)):
                changed = copy.deepcopy(doc)
                changed[key] = [sub] + value[1:]
                yield sub_path, changed
    extra = copy.deepcopy(doc)
    extra["unexpected"] = 1
    yield path + ("<extra>",), extra


@pytest.mark.parametrize("model,doc", [(QueryLogEvent, QUERY), (FeedbackEvent, FEEDBACK)])
def test_models_accept_and_reject_what_the_schema_does(model, doc):
    """parse_event (what ingest runs: the pydantic model plus the wire checks) agrees with the JSON Schema."""
    schema = load_schema(model)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert validator.is_valid(doc)
    parse_event(model, json.dumps(doc).encode(), 10**6)
    checked = 0
    for where, mutated in _mutations(doc):
        raw = json.dumps(mutated).encode()
        schema_ok = validator.is_valid(mutated)
        try:
            parse_event(model, raw, 10**6)
            model_ok = True
        except MalformedEvent:
            model_ok = False
        assert schema_ok == model_ok, f"{model.__name__} {where}: schema says {schema_ok}, model says {model_ok}"
        checked += 1
    assert checked > 80


@pytest.mark.parametrize("model", [QueryLogEvent, FeedbackEvent])
def test_schema_files_are_generated_from_the_models(model):
    """A stale file (a model changed, the file not regenerated) fails here."""
    path = SCHEMA_DIR / SCHEMA_FILE_OF_MODEL[model]
    assert path.read_text() == schema_text(model), f"{path.name} is stale: run `python -m streaming.event_schemas`"


@pytest.mark.parametrize("model", [QueryLogEvent, FeedbackEvent])
def test_schema_and_model_have_the_same_fields(model):
    schema = load_schema(model)
    assert set(schema["properties"]) == set(model.model_fields)
    required = {name for name, f in model.model_fields.items() if f.is_required()}
    # schema_version (and a feedback's value) have defaults for Python callers; parse_event requires them on the wire
    assert set(schema["required"]) == required | set(WIRE_REQUIRED[model])
    assert schema["properties"]["schema_version"]["const"] == 1


def test_round_trip_is_valid_against_the_schema():
    event = QueryLogEvent.model_validate(QUERY)
    jsonschema.validate(json.loads(event.to_bytes()), load_schema(QueryLogEvent))
    fb = FeedbackEvent(request_id="r", ts=1795000000.0, user_key="u", kind="copy")
    jsonschema.validate(json.loads(fb.to_bytes()), load_schema(FeedbackEvent))


@pytest.mark.parametrize(
    "raw,reason",
    [
        (b"{not json", "bad_json"),
        (b"\xff\xfe", "bad_json"),
        (None, "bad_json"),
        (json.dumps({**QUERY, "schema_version": 2}).encode(), "schema_version"),
        (json.dumps({k: v for k, v in QUERY.items() if k != "schema_version"}).encode(), "schema_version"),
        (json.dumps({**QUERY, "messages": []}).encode(), "schema"),
        (json.dumps([1, 2]).encode(), "schema"),
        (json.dumps({**QUERY, "response": "x" * 5000}).encode(), "oversize"),
    ],
)
def test_parse_event_names_the_reason(raw, reason):
    with pytest.raises(MalformedEvent) as e:
        parse_event(QueryLogEvent, raw, max_bytes=4096)
    assert e.value.reason == reason
    assert e.value.detail


def _with(**over) -> bytes:
    return json.dumps({**QUERY, **over}).encode()


def _raw_replace(old: str, new: str) -> bytes:
    text = json.dumps(QUERY)
    assert old in text
    return text.replace(old, new, 1).encode()


@pytest.mark.parametrize(
    "raw,reason,says",
    [
        (b"[" * 5000 + b"]" * 5000, "too_deep", "recursion limit"),
        (_with(response=json.loads("[" * 300 + "]" * 300)), "too_deep", "recursion limit"),
        (
            _raw_replace('"schema_version": 1', '"schema_version": 2, "schema\\u005fversion": 1'),
            "duplicate_key",
            "schema_version",
        ),
        (_raw_replace('"top_p": 0.95', '"top_p": 0.95, "top_p": 0.5'), "duplicate_key", "top_p"),
        (_raw_replace('"role": "user"', '"role": "user", "role": "system"'), "duplicate_key", "role"),
        (
            _raw_replace('"schema_version": 1', '"schema_version": 2, "schema_version": 1'),
            "duplicate_key",
            "schema_version",
        ),
        (_raw_replace('"latency_ms": 12.5', '"latency_ms": NaN'), "non_finite", "finite"),
        (_raw_replace('"latency_ms": 12.5', '"latency_ms": Infinity'), "non_finite", "finite"),
        (_raw_replace('"latency_ms": 12.5', '"latency_ms": 1e400'), "non_finite", "finite"),
        (_raw_replace('"prompt_tokens": 10', '"prompt_tokens": ' + "9" * 5000), "number_range", "out of range"),
        (_raw_replace('"prompt_tokens": 10', '"prompt_tokens": ' + "9" * 40), "schema", "prompt_tokens"),
        (_raw_replace('"response": "4"', '"response": "\\ud800"'), "bad_json", "hex escape"),
        (_with(ts=1.7e12), "ts_units", "milliseconds"),
        (_with(ts=1.7e15), "ts_units", "microseconds"),
        (_with(ts=1e20), "ts_window", "outside"),
        (_with(ts=12.0), "ts_window", "outside"),
        (_with(ts="2026-02-30T00:00:00Z"), "ts_format", "not a real date"),
        (_with(ts="yesterday"), "ts_format", "RFC 3339"),
        (_with(request_id="r\x00"), "control_character", "request_id"),
        (_with(user_key="u\n1"), "control_character", "user_key"),
        (_with(latency_ms=-1), "schema", "latency_ms"),
        (_with(prompt_tokens=-3), "schema", "prompt_tokens"),
        (_with(completion_tokens=2**63), "schema", "completion_tokens"),
    ],
)
def test_strict_values_are_rejected_with_a_reason_that_says_why(raw, reason, says):
    with pytest.raises(MalformedEvent) as e:
        parse_event(QueryLogEvent, raw, max_bytes=10**6)
    assert (e.value.reason, says in e.value.detail) == (reason, True), e.value.detail


# what a hidden corpus of malformed events once got stored: each is now dead-lettered with a reason of its own
CLAIMS = [
    (QueryLogEvent, _with(ts="2026-11-30T15:13:48+25:00"), "ts_format", "+-14:00"),
    (QueryLogEvent, _with(ts="2026-11-30T15:13:48+14:01"), "ts_format", "+-14:00"),
    (QueryLogEvent, _with(ts="2026-11-30T15:13:48Z\n"), "ts_format", "RFC 3339"),
    (QueryLogEvent, _with(ts="\uff12\uff10\uff12\uff16-11-30T15:13:48Z"), "ts_format", "ASCII digits"),
    (QueryLogEvent, _with(ts="2026-11-30 15:13:48Z"), "ts_format", "RFC 3339"),
    (QueryLogEvent, _with(response="four\x00"), "control_character", "response"),
    (QueryLogEvent, _with(messages=[{"role": "user", "content": "2+2?\x1b[2J"}]), "control_character", "content"),
    (QueryLogEvent, _with(session_id="s\u200b1"), "control_character", "session_id"),
    (QueryLogEvent, _with(finish_reason="stop\u200b"), "finish_reason", "finish_reason"),
    (QueryLogEvent, _with(finish_reason="STOP"), "finish_reason", "finish_reason"),
    (QueryLogEvent, _with(finish_reason=""), "finish_reason", "finish_reason"),
    (
        FeedbackEvent,
        json.dumps({k: v for k, v in FEEDBACK.items() if k != "value"} | {"kind": "thumbs_up"}).encode(),
        "missing_value",
        "value is missing",
    ),
]


@pytest.mark.parametrize("model,raw,reason,says", CLAIMS)
def test_values_that_are_not_what_they_claim_are_rejected_each_with_its_reason(model, raw, reason, says):
    with pytest.raises(MalformedEvent) as e:
        parse_event(model, raw, max_bytes=10**6)
    assert (e.value.reason, says in e.value.detail) == (reason, True), e.value.detail


ARMS = ("stable", "canary", "replay")


@pytest.mark.parametrize(
    "field,value",
    [
        ("variant", "stable "),
        ("variant", "st\u0430ble"),
        ("variant", "control"),
        ("assigned_variant", "canary\t"),
        ("assigned_variant", ""),
    ],
)
def test_a_variant_that_is_not_an_arm_of_the_deployment_is_rejected(field, value):
    """`variant` and `assigned_variant` against the configured arms (ingest.variants), exactly: a trailing space
    or a Cyrillic look-alike is another string, and "control" is no arm here."""
    with pytest.raises(MalformedEvent) as e:
        parse_event(QueryLogEvent, _with(**{field: value}), 10**6, arms=ARMS)
    assert e.value.reason in ("unknown_variant", "control_character")
    assert e.value.reason == ("control_character" if "\t" in value else "unknown_variant"), e.value.detail
    parse_event(QueryLogEvent, _with(variant="canary", assigned_variant="canary"), 10**6, arms=ARMS)
    parse_event(QueryLogEvent, _with(variant="stable"), 10**6, arms=ARMS)  # no experiment: no assigned arm


@pytest.mark.parametrize(
    "finish_reason",
    ["stop", "length", "abort", "error", "repetition", "tool_calls", "content_filter", "function_call", None],
)
def test_real_finish_reasons_are_accepted(finish_reason):
    assert parse_event(QueryLogEvent, _with(finish_reason=finish_reason), 10**6).finish_reason == finish_reason


def test_text_keeps_tabs_and_newlines():
    event = parse_event(QueryLogEvent, _with(response="a\tb\r\nc\u200bd"), 10**6)
    assert event.response == "a\tb\r\nc\u200bd"


@pytest.mark.parametrize(
    "value,reason",
    [(None, "schema"), (0, "schema"), (-2.0, "schema"), ("NaN", "non_finite")],
)
def test_dwell_needs_positive_finite_seconds(value, reason):
    raw = (
        json.dumps({**FEEDBACK, "value": value}).encode()
        if value != "NaN"
        else json.dumps(FEEDBACK).replace("3.5", "NaN").encode()
    )
    with pytest.raises(MalformedEvent) as e:
        parse_event(FeedbackEvent, raw, 10_000)
    assert e.value.reason == reason


@pytest.mark.parametrize(
    "ts,seconds",
    [
        ("2026-11-30T15:13:48.123456Z", 1796051628.123456),
        ("2026-11-30T15:13:48Z", 1796051628.0),
        ("2026-11-30T20:43:48.5+05:30", 1796051628.5),
        ("2026-11-30T10:13:48.123456789-05:00", 1796051628.123456789),
        ("2026-11-30t15:13:48.1z", 1796051628.1),
        ("2016-12-31T23:59:60Z", 1483228800.0),  # a leap second
        ("2026-12-01T05:13:48+14:00", 1796051628.0),  # Kiribati, the furthest offset
        ("2026-11-30T03:13:48-12:00", 1796051628.0),
        (1796051628, 1796051628.0),
        (1796051628.25, 1796051628.25),
    ],
)
def test_ts_accepts_rfc3339_and_epoch_seconds(ts, seconds):
    event = parse_event(QueryLogEvent, _with(ts=ts), 10_000)
    assert event.ts == pytest.approx(seconds, abs=1e-6)
    assert json.loads(event.to_bytes())["ts"] == event.ts  # stored and re-sent as epoch seconds


def test_parse_event_by_topic():
    assert isinstance(parse_event(QueryLogEvent, json.dumps(QUERY).encode(), 10_000), QueryLogEvent)
    assert isinstance(parse_event(FeedbackEvent, json.dumps(FEEDBACK).encode(), 10_000), FeedbackEvent)
    with pytest.raises(MalformedEvent, match="schema"):
        parse_event(FeedbackEvent, json.dumps(QUERY).encode(), 10_000)


def test_dead_letter_headers_round_trip():
    dl = DeadLetter.of(
        "schema",
        "messages: too short",
        raw=b"\x00raw",
        key=b"k",
        topic=QUERY_LOG_TOPIC,
        partition=2,
        offset=41,
        max_payload_bytes=1024,
    )
    back = DeadLetter.from_record(b"\x00raw", b"k", dl.headers())
    assert back == dl and not back.truncated and back.original_length == 4


def test_dead_letter_cuts_an_oversize_payload_and_keeps_its_length_and_hash():
    raw = b"x" * 1_000_000
    dl = DeadLetter.of(
        "oversize",
        "1000000 bytes > limit 4096",
        raw=raw,
        key=b"k" * 5000,
        topic=QUERY_LOG_TOPIC,
        partition=0,
        offset=7,
        max_payload_bytes=4096,
    )
    assert len(dl.raw) == 4096 and len(dl.key) == DeadLetter.MAX_KEY_BYTES and dl.truncated
    headers = dict(dl.headers())
    assert headers["dlq.original.length"] == b"1000000"
    assert headers["dlq.original.sha256"] == hashlib.sha256(raw).hexdigest().encode()
    assert headers["dlq.truncated"] == b"true"
