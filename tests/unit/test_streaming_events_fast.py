"""The writer's fast path (`parse_record`, msgspec) against the models (`parse_event`, pydantic): on valid and
malformed events both come to the same decision, the same values, and the same dead-letter reason and detail."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from streaming.events import (
    RECORD_OF_MODEL,
    ChatMessage,
    ChatMessageRecord,
    FeedbackEvent,
    MalformedEvent,
    QueryLogEvent,
    Sampling,
    SamplingRecord,
    _batch_accepted,
    parse_event,
    parse_record,
    parse_records,
)
from tests.unit.test_streaming_events import ARMS, CLAIMS, FEEDBACK, QUERY, _mutations
from tests.unit.test_streaming_fuzz import mutate, valid_feedback, valid_query

MAX_BYTES = 8192


def _outcome(parse, model, raw: bytes | None, arms) -> tuple:
    """("ok", the event's values as JSON, with int and float told apart) or ("dead", reason, detail)."""
    try:
        event = parse(model, raw, MAX_BYTES, arms)
    except MalformedEvent as e:
        return ("dead", e.reason, e.detail)
    values = event.model_dump() if hasattr(event, "model_dump") else msgspec.to_builtins(event)
    return ("ok", type(event).__name__.removesuffix("Event").removesuffix("Record"), json.dumps(values, sort_keys=True))


def _corpus() -> list[tuple[type, bytes | None]]:
    rng = random.Random(27)
    out: list[tuple[type, bytes | None]] = [(model, raw) for model, raw, _, _ in CLAIMS]
    for model, doc in ((QueryLogEvent, QUERY), (FeedbackEvent, FEEDBACK)):
        out += [(model, json.dumps(d).encode()) for _, d in _mutations(doc)]
    for i in range(3000):
        kind = rng.random() < 0.7
        doc = valid_query(rng, i) if kind else valid_feedback(rng, i)
        model = QueryLogEvent if kind else FeedbackEvent
        out.append((model, json.dumps(doc).encode()))  # valid (a few filtered later, but valid here)
        out.append((model, mutate(doc, rng)))
    # numbers as ints where the model has floats, the edges of every window, and the arms
    edges = [
        {"ts": 946684800},
        {"ts": 946684799.999},
        {"ts": 4102444800.0},
        {"ts": 4102444799.5},
        {"latency_ms": 0},
        {"latency_ms": 86_400_000},
        {"latency_ms": 86_400_000.5},
        {"sampling": {"temperature": 100, "top_p": 1, "max_tokens": 1}},
        {"sampling": {"temperature": 0, "top_p": 0, "max_tokens": 10_000_000}},
        {"sampling": {"temperature": 0.5, "top_p": 0.5, "max_tokens": 10_000_001}},
        {"prompt_tokens": 10_000_000, "completion_tokens": 0},
        {"policy_version": "a" * 64},
        {"policy_version": "a" * 65},
        {"policy_version": "v1\n"},
        {"request_id": "r" * 128},
        {"request_id": "r" * 129},
        {"request_id": "r\n"},
        {"model": "m" * 257},
        {"session_id": ""},
        {"experiment_id": "e" * 200, "assigned_variant": "canary", "pair_id": "p"},
        {"experiment_id": "e" * 201},
        {"assigned_variant": "canary\u200b"},
        {"variant": "control"},
        {"assigned_variant": "control"},
        {"shadow": True},
        {"shadow": 1},
        {"finish_reason": None},
        {"response": "tab\tnewline\ncr\r"},
        {"response": "\x85"},
        {"messages": [{"role": "user", "content": ""}]},
    ]
    out += [(QueryLogEvent, json.dumps({**QUERY, **edge}).encode()) for edge in edges]
    feedback_edges = [
        {"value": None, "kind": "copy"},
        {"value": 0, "kind": "dwell"},
        {"value": 1, "kind": "copy"},
        {"value": 604_800, "kind": "dwell"},
        {"value": 604_800.5, "kind": "dwell"},
        {"ts": "2026-11-30T15:13:48Z"},
    ]
    out += [(FeedbackEvent, json.dumps({**FEEDBACK, **edge}).encode()) for edge in feedback_edges]
    return out


CORPUS = _corpus()


@pytest.mark.parametrize("arms", [None, ARMS])
def test_the_fast_path_decides_as_the_models_do(arms):
    fast_accepted = 0
    for model, raw in CORPUS:
        slow = _outcome(parse_event, model, raw, arms)
        fast = _outcome(parse_record, model, raw, arms)
        assert fast == slow, raw
        try:
            fast_accepted += isinstance(parse_record(model, raw, MAX_BYTES, arms), tuple(RECORD_OF_MODEL.values()))
        except MalformedEvent:
            pass
    # the fast path itself decided most valid events (not only the models behind it)
    assert fast_accepted >= 3000


@pytest.mark.parametrize(
    "model,record",
    [
        (QueryLogEvent, RECORD_OF_MODEL[QueryLogEvent]),
        (FeedbackEvent, RECORD_OF_MODEL[FeedbackEvent]),
        (ChatMessage, ChatMessageRecord),
        (Sampling, SamplingRecord),
    ],
)
def test_the_records_have_the_fields_of_the_models(model, record):
    assert set(record.__struct_fields__) == set(model.model_fields)


def _batch_outcomes(model, raws: list[bytes | None], arms) -> list[tuple]:
    """`_outcome` of each record as `parse_records` decides it in one batch."""
    out = []
    for event in parse_records(model, raws, MAX_BYTES, arms):
        if isinstance(event, MalformedEvent):
            out.append(("dead", event.reason, event.detail))
        else:
            values = event.model_dump() if hasattr(event, "model_dump") else msgspec.to_builtins(event)
            name = type(event).__name__.removesuffix("Event").removesuffix("Record")
            out.append(("ok", name, json.dumps(values, sort_keys=True)))
    return out


def _twice(doc: dict, key: str, value, *, spelled: str | None = None, space: str = "") -> bytes:
    """`doc`'s JSON with `key` written a second time (first, before the real one), as `spelled` if given."""
    body = json.dumps(doc)[1:]
    return ("{" + json.dumps(spelled or key) + space + ":" + json.dumps(value) + ", " + body).encode()


def _renamed(raw: bytes, key: str, to: str) -> bytes:
    return raw.replace(json.dumps(key).encode(), json.dumps(to).encode())


_QUERY_NULLS = {**QUERY, "session_id": None, "experiment_id": None, "pair_id": None, "shadow": False}
# keys written twice: each level, escaped keys, a space before the colon, colons in strings, explicit nulls
DUPLICATES: list[tuple[type, bytes]] = [
    (QueryLogEvent, _twice(QUERY, "request_id", "other")),
    (QueryLogEvent, _twice(QUERY, "response", "a: b: c")),
    (QueryLogEvent, _twice(_QUERY_NULLS, "session_id", None)),
    (QueryLogEvent, _twice(_QUERY_NULLS, "shadow", False)),
    (QueryLogEvent, _twice({**QUERY, "pair_id": "p:1"}, "pair_id", "p:2")),
    (QueryLogEvent, _twice(QUERY, "request_id", "x", spelled="request\u005fid")),
    (QueryLogEvent, _twice(QUERY, "user_key", "u:2", space=" ")),
    (QueryLogEvent, _twice({**QUERY, "response": 'ends in a quote: "pair_id'}, "ts", 1795000001.0)),
    (QueryLogEvent, json.dumps(QUERY).replace('"role": "user"', '"role": "user", "role": "user"').encode()),
    (QueryLogEvent, json.dumps(QUERY).replace('"top_p"', '"top_p": 0.5, "top_p"').encode()),
    (QueryLogEvent, json.dumps({**QUERY, "response": "a:b"}).replace("a:b", "a\\u003ab").encode()),  # not twice
    (
        QueryLogEvent,
        _renamed(_twice(QUERY, "request_id", "r:9"), "session_id", "pair_id"),
    ),
    (QueryLogEvent, _twice({**QUERY, "response": "a:b"}, "request_id", "x").replace(b"a:b", b"a\\u003ab")),
    (FeedbackEvent, _twice(FEEDBACK, "kind", "copy")),
    (FeedbackEvent, _twice(FEEDBACK, "value", 3.0, space="\n")),
]


@pytest.mark.parametrize("arms", [None, ARMS])
def test_a_batch_decides_each_record_as_the_models_do(arms):
    for model in (QueryLogEvent, FeedbackEvent):
        raws = [raw for m, raw in CORPUS + DUPLICATES if m is model]
        valid = [raw for raw in raws if _outcome(parse_event, model, raw, arms)[0] == "ok"]
        # the whole corpus (records fail the batch's checks: each record on its own), its valid records alone
        # (one check over the batch), and each duplicate slipped into a batch of valid ones
        for batch in [raws, valid] + [valid[:50] + [raw] + valid[50:100] for m, raw in DUPLICATES if m is model]:
            assert _batch_outcomes(model, batch, arms) == [_outcome(parse_event, model, raw, arms) for raw in batch]


def test_the_batch_path_itself_accepts_a_batch_of_valid_events():
    raws = [json.dumps({**_QUERY_NULLS, "request_id": f"r{i}", "response": f"a: {i}"}).encode() for i in range(20)]
    decoded = parse_records(QueryLogEvent, raws, MAX_BYTES, ARMS)
    assert all(isinstance(e, RECORD_OF_MODEL[QueryLogEvent]) for e in decoded)
    assert _batch_accepted(decoded, raws, ARMS)
    twice = _twice({**_QUERY_NULLS, "request_id": "r19", "response": "a: 19"}, "shadow", False)
    assert msgspec.json.decode(twice, type=RECORD_OF_MODEL[QueryLogEvent]) == decoded[19]  # msgspec keeps one
    assert not _batch_accepted(decoded, raws[:19] + [twice], ARMS)
