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
    parse_event,
    parse_record,
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
