"""The pydantic event models agree with the JSON Schema files (the source of truth), field by field."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from streaming.events import (
    QUERY_LOG_TOPIC,
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
FEEDBACK = {"schema_version": 1, "request_id": "r-1", "ts": 1795000001, "user_key": "u-9f2c", "kind": "dwell", "value": 3.5}

# Values that are wrong (or right) for some type; every field of every model gets every probe.
PROBES = [None, "", "x", "v/../3", 0, -1, 1.5, True, [], [{}], {}, {"role": "user"}, "a" * 300, 2]


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
    validator = jsonschema.Draft202012Validator(schema)
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
def test_schema_and_model_have_the_same_fields(model):
    schema = load_schema(model)
    assert set(schema["properties"]) == set(model.model_fields)
    required = {name for name, f in model.model_fields.items() if f.is_required()}
    # schema_version has a default for Python callers; parse_event requires it on the wire
    assert set(schema["required"]) == required | {"schema_version"}
    assert schema["properties"]["schema_version"]["const"] == 1


def test_round_trip_is_valid_against_the_schema():
    event = QueryLogEvent.model_validate(QUERY)
    jsonschema.validate(json.loads(event.to_bytes()), load_schema(QueryLogEvent))
    fb = FeedbackEvent(request_id="r", ts=1.0, user_key="u", kind="copy")
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


def test_parse_event_by_topic():
    assert isinstance(parse_event(QueryLogEvent, json.dumps(QUERY).encode(), 10_000), QueryLogEvent)
    assert isinstance(parse_event(FeedbackEvent, json.dumps(FEEDBACK).encode(), 10_000), FeedbackEvent)
    with pytest.raises(MalformedEvent, match="schema"):
        parse_event(FeedbackEvent, json.dumps(QUERY).encode(), 10_000)


def test_dead_letter_headers_round_trip():
    err = MalformedEvent("schema", "messages: too short")
    dl = DeadLetter.of(err, raw=b"\x00raw", key=b"k", topic=QUERY_LOG_TOPIC, partition=2, offset=41)
    back = DeadLetter.from_record(b"\x00raw", b"k", dl.headers())
    assert back == dl
