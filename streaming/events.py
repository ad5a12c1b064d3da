"""The events on the wire: topic names, the two logged event types, parsing, and dead letters.

The pydantic models here are THE definition of the event schema. Everything else is generated from
them (`streaming/event_schemas.py`): the JSON Schema files in `streaming/schemas/` (regenerate with
`python -m streaming.event_schemas`; a test fails when a file is stale) and the replay store's Arrow schemas.

`parse_event` is what ingest runs on every record. It is bounded (size, nesting depth, number range)
and raises nothing but `MalformedEvent`, whose `reason` says which class of bad input it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import chain, compress, repeat
from operator import attrgetter, is_
from typing import Annotated, Any, Literal, cast

import jiter
import msgspec
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

SCHEMA_VERSION = 1

QUERY_LOG_TOPIC = "dynrubric.query-log"
FEEDBACK_TOPIC = "dynrubric.feedback"
DEAD_LETTER_TOPIC = "dynrubric.dead-letter"
TOPICS = (QUERY_LOG_TOPIC, FEEDBACK_TOPIC, DEAD_LETTER_TOPIC)

# ---------------------------------------------------------------- value rules
TS_MIN = 946_684_800.0  # 2000-01-01T00:00:00Z
TS_MAX = 4_102_444_800.0  # 2100-01-01T00:00:00Z
MAX_TOKENS = 10_000_000
MAX_LATENCY_MS = 86_400_000.0  # a day
MAX_FEEDBACK_VALUE = 604_800.0  # dwell: a week, in seconds
MAX_DEPTH = 200  # the JSON parser's (jiter's) recursion limit; a valid event nests 3 deep
# identifiers: no C0/C1 control character (NUL included), and none of the invisible format characters that make
# two keys look alike (zero-width space/joiners, direction marks and overrides, word joiner, byte-order mark)
_ID_FORBIDDEN = r"\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069\ufeff"
_NO_CONTROL = rf"^[^{_ID_FORBIDDEN}]*$"
_FORBIDDEN_IN_ID = re.compile(f"[{_ID_FORBIDDEN}]")
# free text (message content, response): no control character but the three that text carries, tab, LF and CR
# (JSON escapes them on the wire); a NUL is what a PostgreSQL text column refuses. A producer escapes the others
# (`escape_controls`, the router's policy for what a model writes)
_TEXT_CONTROLS = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f"
_TEXT = rf"^[^{_TEXT_CONTROLS}]*$"
_CONTROL_IN_TEXT = re.compile(f"[{_TEXT_CONTROLS}]")
# RFC 3339's date-time, strictly: ASCII digits, a "T", an offset within +-14:00 (the real ones), nothing after it.
# The same text is the JSON Schema's pattern, where "$" ends the input (ECMA-262); here it is fullmatch'ed.
RFC3339_PATTERN = (
    r"^([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]{1,32})?"
    r"([Zz]|[+-](?:0[0-9]|1[0-3]):[0-5][0-9]|[+-]14:00)$"
)
_RFC3339 = re.compile(RFC3339_PATTERN)
# what vLLM (FINISH_REASON_STRINGS) and OpenAI's API report
FinishReason = Literal[
    "stop", "length", "abort", "error", "repetition", "tool_calls", "content_filter", "function_call"
]


# identifiers: no control characters, bounded length (an empty one only where it says `0`)
Id = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=_NO_CONTROL)]
_Id0 = Annotated[str, StringConstraints(min_length=0, max_length=128, pattern=_NO_CONTROL)]
_Arm = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=_NO_CONTROL)]
_Arm0 = Annotated[str, StringConstraints(min_length=0, max_length=64, pattern=_NO_CONTROL)]
_ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=_NO_CONTROL)]
_Experiment0 = Annotated[str, StringConstraints(min_length=0, max_length=200, pattern=_NO_CONTROL)]

Text = Annotated[str, StringConstraints(pattern=_TEXT)]
_POLICY_VERSION_RE = r"[A-Za-z0-9._-]{1,64}"  # the model's pattern and the fast path's check
PolicyVersion = Annotated[str, StringConstraints(pattern=rf"^{_POLICY_VERSION_RE}$")]
FeedbackKind = Literal["thumbs_up", "thumbs_down", "regenerate", "copy", "dwell"]


def escape_controls(text: str) -> str:
    """`text` as an event may hold it: each control character the text rule refuses written as its visible escape,
    `\\u0000`. The logging policy for what a model or a user writes: kept, legible, never the reason an event
    is lost."""
    return _CONTROL_IN_TEXT.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def rfc3339_seconds(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp (any fraction digits, an offset within +-14:00, Z)."""
    m = _RFC3339.fullmatch(text)
    if m is None:
        raise ValueError(
            f"ts {text[:40]!r} is neither epoch seconds nor an RFC 3339 timestamp (ASCII digits, "
            f"YYYY-MM-DDThh:mm:ss[.frac] then Z or an offset within +-14:00)"
        )
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    leap = s == 60  # RFC 3339 allows a leap second; datetime does not
    try:
        base = datetime(y, mo, d, h, mi, 59 if leap else s, tzinfo=UTC).timestamp()
    except ValueError as e:
        raise ValueError(f"ts {text!r} is not a real date and time: {e}") from None
    offset = m.group(8)
    shift = (
        0
        if offset in ("Z", "z")
        else (1 if offset[0] == "+" else -1) * (int(offset[1:3]) * 3600 + int(offset[4:6]) * 60)
    )
    return base + leap + float("0" + (m.group(7) or "")) - shift


def _epoch_seconds(value: Any) -> float:
    """`ts` as epoch seconds: a JSON number, or an RFC 3339 string. Out of [2000, 2100) is rejected,
    with a reason of its own when the number is in the window once read as milli/micro/nanoseconds."""
    if isinstance(value, str):
        try:
            seconds = rfc3339_seconds(value)
        except ValueError as e:
            raise PydanticCustomError("ts_format", "{detail}", {"detail": str(e)}) from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise PydanticCustomError("ts_format", "ts must be epoch seconds (a number) or an RFC 3339 string")
    if not math.isfinite(seconds):
        raise PydanticCustomError("finite_number", "ts must be a finite number")
    if TS_MIN <= seconds < TS_MAX:
        return seconds
    for unit, factor in (("milliseconds", 1e3), ("microseconds", 1e6), ("nanoseconds", 1e9)):
        if TS_MIN <= seconds / factor < TS_MAX:
            raise PydanticCustomError(
                "ts_units",
                "ts {ts} looks like epoch {unit}; send seconds since the epoch",
                {"ts": repr(value), "unit": unit},
            )
    raise PydanticCustomError("ts_window", "ts {ts} is outside 2000-01-01..2100-01-01", {"ts": repr(value)[:40]})


EpochSeconds = Annotated[
    float,
    BeforeValidator(_epoch_seconds),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": TS_MIN, "exclusiveMaximum": TS_MAX},
                {"type": "string", "format": "date-time", "maxLength": 64, "pattern": RFC3339_PATTERN},
            ],
            "description": "seconds since the Unix epoch, or an RFC 3339 timestamp; 2000-01-01 <= ts < 2100-01-01",
        }
    ),
]


def _finite(**field: Any) -> Any:
    """A pydantic Field of a finite number, with `field`'s bounds, default and description."""
    return Field(allow_inf_nan=False, **field)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _Versioned(_Strict):
    """schema_version is required on the wire (`parse_event` checks it); Python code gets the current one."""

    schema_version: int = Field(
        default=SCHEMA_VERSION, ge=SCHEMA_VERSION, le=SCHEMA_VERSION, description="version of this schema"
    )

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text


class Sampling(_Strict):
    temperature: float = _finite(ge=0, le=100)
    top_p: float = _finite(gt=0, le=1)
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)


class QueryLogEvent(_Versioned):
    """One served request and its response, as the router logs it to the topic dynrubric.query-log
    (key = request_id). Unknown fields are rejected: a new field means a new schema_version."""

    request_id: Id = Field(description="unique per request; the Kafka key and the dedupe key")
    ts: EpochSeconds = Field(description="when the response finished")
    user_key: Id = Field(description="hashed user id, never the raw id")
    session_id: _Id0 | None = None
    variant: _Arm = Field(
        description="A/B variant that served the request: an arm of the deployment "
        "(ingest.variants: stable, canary, replay)"
    )
    policy_version: PolicyVersion = Field(
        description="checkpoint version that produced the response (path-safe: the replay store partitions by it)"
    )
    model: _ModelName
    messages: list[ChatMessage] = Field(
        min_length=1, description="the chat prompt as sent to the model, without the response"
    )
    response: Text
    finish_reason: FinishReason | None = Field(
        default=None, description="as the engine reports it: vLLM's and OpenAI's values"
    )
    sampling: Sampling
    latency_ms: float = _finite(ge=0, le=MAX_LATENCY_MS)
    prompt_tokens: int = Field(ge=0, le=MAX_TOKENS)
    completion_tokens: int = Field(ge=0, le=MAX_TOKENS)
    # the rollout gate's attribution (serving/online.py) and the judged check's shadow pairs
    experiment_id: _Experiment0 | None = Field(default=None, description="the rollout this request belongs to")
    assigned_variant: _Arm0 | None = Field(
        default=None, description="the arm the user is assigned to (SRM, attribution)"
    )
    pair_id: _Id0 | None = Field(default=None, description="links a served answer and its shadow (judged check)")
    shadow: bool = Field(
        default=False, description="a shadow answer to the arm that did not serve: never shown, never trained on"
    )


_DWELL_NEEDS_SECONDS: dict[str, Any] = {
    "if": {"properties": {"kind": {"const": "dwell"}}, "required": ["kind"]},
    "then": {"properties": {"value": {"type": "number", "exclusiveMinimum": 0}}, "required": ["value"]},
}


class FeedbackEvent(_Versioned):
    """A user's signal about one served response, on the topic dynrubric.feedback (key = request_id of
    the request it is about). Unknown fields are rejected: a new field means a new schema_version."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_DWELL_NEEDS_SECONDS]})

    request_id: Id = Field(description="the request this feedback is about")
    ts: EpochSeconds = Field(description="when the user gave it")
    user_key: Id = Field(description="hashed user id, never the raw id")
    kind: FeedbackKind
    value: float | None = _finite(
        default=None,
        ge=0,
        le=MAX_FEEDBACK_VALUE,
        description="dwell: seconds spent reading (> 0); the other kinds: 1 or null",
    )

    @model_validator(mode="after")
    def _dwell_has_seconds(self) -> FeedbackEvent:
        if self.kind == "dwell" and not (self.value is not None and self.value > 0):
            raise PydanticCustomError("dwell_seconds", "a dwell event needs value = seconds spent reading, > 0")
        return self

    def dedupe_key(self) -> str:
        return feedback_dedupe_key(self.request_id, self.kind, self.ts)


def feedback_dedupe_key(request_id: str, kind: str, ts: float) -> str:
    # One request gets several feedback events; a re-sent event repeats all three fields.
    return f"{request_id}\x1f{kind}\x1f{ts!r}"


Event = QueryLogEvent | FeedbackEvent
SCHEMA_FILE_OF_MODEL: dict[type[QueryLogEvent] | type[FeedbackEvent], str] = {
    QueryLogEvent: "query-log.v1.json",
    FeedbackEvent: "feedback.v1.json",
}


def load_schema(model: type[QueryLogEvent] | type[FeedbackEvent]) -> dict[str, Any]:
    """The JSON Schema file of an event model (generated from the model by `streaming/event_schemas.py`)."""
    from importlib import resources

    text = resources.files("streaming").joinpath("schemas", SCHEMA_FILE_OF_MODEL[model]).read_text()
    return json.loads(text)


# ---------------------------------------------------------------- malformed records
DeadLetterReason = Literal[
    "bad_json",  # not JSON, not UTF-8, or a tombstone
    "too_deep",  # nested deeper than MAX_DEPTH
    "duplicate_key",  # an object names a key twice
    "non_finite",  # NaN, Infinity, or a number that overflows a double
    "number_range",  # a number beyond what the JSON parser holds
    "oversize",  # more bytes than ingest.max_event_bytes
    "schema",  # a field missing, unknown, of the wrong type or out of its range
    "schema_version",  # missing or another version
    "ts_units",  # ts in the window only when read as milli/micro/nanoseconds
    "ts_window",  # ts outside 2000..2100
    "ts_format",  # a ts string that is not strictly RFC 3339 (offset beyond +-14:00, non-ASCII digits, a newline)
    "control_character",  # a control character in a text field (NUL...), or an invisible one in an identifier
    "finish_reason",  # not one of vLLM's and OpenAI's finish reasons
    "unknown_variant",  # variant or assigned_variant not an arm of this deployment (ingest.variants)
    "missing_value",  # a feedback event without `value` (null is fine, absent is not)
    "store_error",  # valid, but the store could not write it (isolated from its batch)
]
_REASON_OF_ERROR = {
    "ts_units": "ts_units",
    "ts_window": "ts_window",
    "ts_format": "ts_format",
    "finite_number": "non_finite",
}
# fields Python callers may leave to their default, which the wire must name, and the reason of a record without
WIRE_REQUIRED: dict[type, dict[str, DeadLetterReason]] = {
    QueryLogEvent: {"schema_version": "schema_version"},
    FeedbackEvent: {"schema_version": "schema_version", "value": "missing_value"},
}


class MalformedEvent(ValueError):
    """A record that cannot be ingested; `reason` is the metric label, `detail` the human message."""

    def __init__(self, reason: DeadLetterReason, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


_JSON_ERRORS: tuple[tuple[str, DeadLetterReason], ...] = (
    ("recursion limit exceeded", "too_deep"),
    ("number out of range", "number_range"),
    ("duplicate key", "duplicate_key"),
)


def parse_event(
    model: type[QueryLogEvent] | type[FeedbackEvent],
    raw: bytes | None,
    max_bytes: int,
    arms: Collection[str] | None = None,
) -> Event:
    """Validate one record's bytes as a `model` event; raise MalformedEvent (and only that) saying why not.

    Bounded: at most `max_bytes`; the JSON parser (jiter, pydantic's own) stops at MAX_DEPTH levels of
    nesting and at numbers beyond its range, and rejects duplicate keys, lone UTF-16 surrogates and
    invalid UTF-8; NaN/Infinity parse, and the models' finite check rejects them where a number goes.
    With `arms` (ingest.variants: a deployment's, not the schema's), a query-log event's `variant` and
    `assigned_variant` must be one of them, exactly."""
    return _validated(model, _decoded(raw, max_bytes), arms)


def _decoded(raw: bytes | None, max_bytes: int) -> dict[str, Any]:
    """The record's JSON object, after the checks that come before the model's."""
    if raw is None:
        raise MalformedEvent("bad_json", "record has no value (tombstone)")
    if len(raw) > max_bytes:
        raise MalformedEvent("oversize", f"{len(raw)} bytes > limit {max_bytes}")
    try:
        doc = jiter.from_json(raw, catch_duplicate_keys=True)
    except ValueError as e:
        reason: DeadLetterReason = next((r for text, r in _JSON_ERRORS if text in str(e)), "bad_json")
        raise MalformedEvent(reason, f"not valid JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict):
        raise MalformedEvent("schema", f"expected a JSON object, got {type(doc).__name__}")
    # the models default these for Python callers; on the wire they are required (the version before all else)
    if "schema_version" not in doc:
        raise MalformedEvent("schema_version", f"schema_version is missing (expected {SCHEMA_VERSION})")
    return doc


def _validated(
    model: type[QueryLogEvent] | type[FeedbackEvent], doc: dict[str, Any], arms: Collection[str] | None
) -> Event:
    try:
        event = model.model_validate(doc)
    except ValidationError as e:
        raise _classified(e) from None
    missing = sorted(WIRE_REQUIRED[model].keys() - doc.keys())
    if missing:
        raise MalformedEvent(
            WIRE_REQUIRED[model][missing[0]], f"{missing[0]} is missing (null where there is nothing to say)"
        )
    if arms is not None and isinstance(event, QueryLogEvent):
        for name in ("variant", "assigned_variant"):
            value = getattr(event, name)
            if value is not None and value not in arms:
                raise MalformedEvent(
                    "unknown_variant",
                    f"{name} {value!r} is not an arm of this deployment (ingest.variants: {', '.join(arms)})",
                )
    return event


def _reason(err: Any) -> DeadLetterReason:
    """The dead-letter reason of one pydantic error: its own where the rule has one, else `schema`."""
    if err["type"] == "string_pattern_mismatch" and (err.get("ctx") or {}).get("pattern") in (_NO_CONTROL, _TEXT):
        return "control_character"
    if err["loc"][:1] == ("finish_reason",) and err["type"] == "literal_error":
        return "finish_reason"
    return _REASON_OF_ERROR.get(err["type"], "schema")  # type: ignore[return-value]


def _classified(e: ValidationError) -> MalformedEvent:
    errors = e.errors(include_url=False, include_input=False)
    detail = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in errors[:5])[:1000]
    if any(err["loc"][:1] == ("schema_version",) for err in errors):
        return MalformedEvent("schema_version", f"expected schema_version {SCHEMA_VERSION}: {detail}")
    reasons = {_reason(err) for err in errors}
    return MalformedEvent(reasons.pop() if len(reasons) == 1 else "schema", detail)


# ---------------------------------------------------------------- the fast path (ingest's writer)
# msgspec mirrors of the models, for `parse_record`. Their types and bounds are the models' (a test compares the
# two on valid and malformed events); the rules msgspec cannot state are checked in `_rules_kept`. gc=False: the
# collector does not track them (a frozen record of strings, numbers and such records is never in a cycle), which
# spares it a batch's thousands of records.


class ChatMessageRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class SamplingRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)]
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]


_RId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_RId0 = Annotated[str, msgspec.Meta(max_length=128)]
_RArm = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_RArm0 = Annotated[str, msgspec.Meta(max_length=64)]


class QueryLogRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    """A `QueryLogEvent` as `parse_record` returns it: the same fields and values, not re-validated."""

    schema_version: Annotated[int, msgspec.Meta(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]  # no default: required
    request_id: _RId
    ts: float  # an RFC 3339 string is left to the model
    user_key: _RId
    variant: _RArm
    policy_version: str
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    messages: Annotated[list[ChatMessageRecord], msgspec.Meta(min_length=1)]
    response: str
    sampling: SamplingRecord
    latency_ms: Annotated[float, msgspec.Meta(ge=0, le=MAX_LATENCY_MS)]
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
    completion_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
    session_id: _RId0 | None = None
    finish_reason: FinishReason | None = None
    experiment_id: Annotated[str, msgspec.Meta(max_length=200)] | None = None
    assigned_variant: _RArm0 | None = None
    pair_id: _RId0 | None = None
    shadow: bool = False


class FeedbackRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    """A `FeedbackEvent` as `parse_record` returns it: the same fields and values, not re-validated."""

    schema_version: Annotated[int, msgspec.Meta(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]
    request_id: _RId
    ts: float
    user_key: _RId
    kind: FeedbackKind
    value: Annotated[float, msgspec.Meta(ge=0, le=MAX_FEEDBACK_VALUE)] | None  # no default: required on the wire

    def dedupe_key(self) -> str:
        return feedback_dedupe_key(self.request_id, self.kind, self.ts)


AnyQueryLog = QueryLogEvent | QueryLogRecord
AnyFeedback = FeedbackEvent | FeedbackRecord
RECORD_OF_MODEL: dict[type[QueryLogEvent] | type[FeedbackEvent], type[QueryLogRecord] | type[FeedbackRecord]] = {
    QueryLogEvent: QueryLogRecord,
    FeedbackEvent: FeedbackRecord,
}
_POLICY_VERSION = re.compile(_POLICY_VERSION_RE)


def parse_record(
    model: type[QueryLogEvent] | type[FeedbackEvent],
    raw: bytes | None,
    max_bytes: int,
    arms: Collection[str] | None = None,
) -> AnyQueryLog | AnyFeedback:
    """`parse_event`'s decision on one record, faster for a valid one: a `QueryLogRecord`/`FeedbackRecord`
    (msgspec) where the record passes the fast checks, else what `parse_event` returns or raises.

    The JSON is read as parse_event reads it (jiter, duplicate keys rejected). The fast checks accept a
    subset of what the model accepts, never more: anything they doubt (an RFC 3339 ts, an error of any
    kind) goes to the model, so every dead-letter reason and detail is the model's."""
    doc = _decoded(raw, max_bytes)
    try:
        record = msgspec.convert(doc, RECORD_OF_MODEL[model])  # strict: no bool for int, no float for int
    except msgspec.ValidationError:
        return _validated(model, doc, arms)
    if _rules_kept([record], arms):  # jiter has refused duplicate keys
        return record
    return _validated(model, doc, arms)


# ---------------------------------------------------------------- the batch path (ingest's writer)
_DECODER_OF_MODEL: dict[type[QueryLogEvent] | type[FeedbackEvent], msgspec.json.Decoder] = {
    QueryLogEvent: msgspec.json.Decoder(QueryLogRecord),
    FeedbackEvent: msgspec.json.Decoder(FeedbackRecord),
}
_QUERY_FIELDS = msgspec.structs.fields(QueryLogRecord)
# the keys a query-log object holds at least (its required fields and the sampling object's three), and the
# optional fields, each with its default and its key as it is written on the wire without escapes
_QUERY_REQUIRED_KEYS = sum(f.required for f in _QUERY_FIELDS) + len(SamplingRecord.__struct_fields__)
_QUERY_OPTIONAL = tuple((f.name, f.default, f'"{f.name}":'.encode()) for f in _QUERY_FIELDS if not f.required)
_MESSAGE_KEYS = len(ChatMessageRecord.__struct_fields__)
_FEEDBACK_KEYS = len(FeedbackRecord.__struct_fields__)  # all required on the wire
_QUERY_IDS = attrgetter("request_id", "user_key", "variant", "model", "policy_version")
_QUERY_OPTIONAL_IDS = attrgetter("session_id", "experiment_id", "assigned_variant", "pair_id")
_FEEDBACK_IDS = attrgetter("request_id", "user_key")
_RESPONSE = attrgetter("response")
# the ASCII characters of _FORBIDDEN_IN_ID's and _CONTROL_IN_TEXT's classes (C0 but tab, LF and CR; DEL)
_ASCII_ID_FORBIDDEN = bytes([*range(0x20), 0x7F])
_ASCII_TEXT_CONTROLS = bytes([*(c for c in range(0x20) if c not in b"\t\n\r"), 0x7F])


def parse_records(
    model: type[QueryLogEvent] | type[FeedbackEvent],
    raws: Sequence[bytes | None],
    max_bytes: int,
    arms: Collection[str] | None = None,
) -> list[AnyQueryLog | AnyFeedback | MalformedEvent]:
    """`parse_record`'s decision on each of a batch's records: its event, or the MalformedEvent it raises.

    A batch of valid events costs a few C calls per event: msgspec decodes each straight into its record
    (no dict between), and the rules the records' types do not state (`_rules_kept`) are checked once over
    the whole batch. msgspec keeps the last of two equal keys where jiter refuses them, so the decoded keys
    are counted against the JSON's keys (`_keys_counted`). A batch that fails a check is checked record by
    record; a record that fails one, or does not decode, takes `parse_record` (jiter, then the model): the
    same decisions, values, reasons and details, only cheaper for the records the fast checks accept."""
    decoder = _DECODER_OF_MODEL[model]
    out: list[AnyQueryLog | AnyFeedback | MalformedEvent | None] = [None] * len(raws)
    positions: list[int] = []
    decoded: list[QueryLogRecord | FeedbackRecord] = []
    decoded_raws: list[bytes] = []
    for i, raw in enumerate(raws):
        if raw is not None and len(raw) <= max_bytes:
            try:
                decoded.append(decoder.decode(raw))
            except msgspec.DecodeError:  # ValidationError too: parse_record decides, with the model's reason
                continue
            positions.append(i)
            decoded_raws.append(raw)
    if decoded and _batch_accepted(decoded, decoded_raws, arms):
        for i, record in zip(positions, decoded, strict=True):
            out[i] = record
    else:
        for i, record, raw in zip(positions, decoded, decoded_raws, strict=True):
            if _batch_accepted([record], [raw], arms):
                out[i] = record
    for i, event in enumerate(out):
        if event is None:
            try:
                out[i] = parse_record(model, raws[i], max_bytes, arms)
            except MalformedEvent as e:
                out[i] = e
    return cast(list[AnyQueryLog | AnyFeedback | MalformedEvent], out)


def _batch_accepted(
    records: Sequence[QueryLogRecord | FeedbackRecord], raws: list[bytes], arms: Collection[str] | None
) -> bool:
    """True when every record keeps the rules (`_rules_kept`) and no record's JSON holds a key twice."""
    strings = _rules_kept(records, arms)
    if not strings:
        return False
    if isinstance(records[0], FeedbackRecord):
        keys = len(records) * _FEEDBACK_KEYS
    else:
        queries = cast(list[QueryLogRecord], records)
        messages = sum(len(r.messages) for r in queries)
        keys = len(queries) * _QUERY_REQUIRED_KEYS + _MESSAGE_KEYS * messages + _present_optional(queries, raws)
    # no key spans a newline: the joined bytes' counts are the sums of the records' counts
    return _keys_counted(b"\n".join(raws), keys, strings)


def _rules_kept(records: Sequence[QueryLogRecord | FeedbackRecord], arms: Collection[str] | None) -> list[str]:
    """The rules of the models that the records' types do not state, over a batch at once: ts in its window
    (by min and max), no forbidden character in identifiers or text (one search over each, joined by a
    character both rules allow), each distinct policy version's characters, the dwell rule, the deployment's
    arms. (The other numbers are finite: msgspec's bounds reject NaN and the infinities.) None when a rule
    is broken by any record, else the records' decoded strings, joined in a few strings (every string value but
    the literals'), for the key count: [] when a rule is broken."""
    ts = [r.ts for r in records]
    if not (TS_MIN <= min(ts) and max(ts) < TS_MAX):  # False for NaN too
        return []
    if isinstance(records[0], FeedbackRecord):
        feedback = cast(list[FeedbackRecord], records)
        if any(r.kind == "dwell" and not (r.value is not None and r.value > 0) for r in feedback):
            return []
        ids = " ".join(chain.from_iterable(map(_FEEDBACK_IDS, feedback)))
        return [] if _has_forbidden(ids, _FORBIDDEN_IN_ID, _ASCII_ID_FORBIDDEN) else [ids]
    queries = cast(list[QueryLogRecord], records)
    if not all(_POLICY_VERSION.fullmatch(v) for v in {r.policy_version for r in queries}):
        return []
    ids = " ".join(
        chain(
            chain.from_iterable(map(_QUERY_IDS, queries)),
            filter(None, chain.from_iterable(map(_QUERY_OPTIONAL_IDS, queries))),  # None and "" add nothing
        )
    )
    if _has_forbidden(ids, _FORBIDDEN_IN_ID, _ASCII_ID_FORBIDDEN):
        return []
    contents = "\n".join([m.content for r in queries for m in r.messages])
    responses = "\n".join(map(_RESPONSE, queries))
    if any(_has_forbidden(t, _CONTROL_IN_TEXT, _ASCII_TEXT_CONTROLS) for t in (contents, responses)):
        return []
    if arms is not None:
        assigned = {r.assigned_variant for r in queries} - {None}
        if not ({r.variant for r in queries} <= set(arms) and assigned <= set(arms)):
            return []
    return [ids, contents, responses]


def _present_optional(records: list[QueryLogRecord], raws: list[bytes]) -> int:
    """How many optional fields the records' JSON surely holds: those not at their default, and those whose
    key is written plainly (`"name":` occurs only as that key in JSON that decoded into the record: inside a
    string a quote is escaped, and a key that ends in one is an unknown field). C loops (map), not Python's;
    searched from the end, where a serialiser writes optional fields (4x less to read than from the start)."""
    present = 0
    for name, default, key in _QUERY_OPTIONAL:
        at_default = list(map(is_, map(attrgetter(name), records), repeat(default)))
        searched = list(compress(raws, at_default))
        present += at_default.count(False) + len(searched) - list(map(bytes.rfind, searched, repeat(key))).count(-1)
    return present


def _has_forbidden(text: str, pattern: re.Pattern[str], ascii_forbidden: bytes) -> bool:
    """Whether `pattern` (a character class) finds a character in `text`; ASCII text by deleting the class's
    ASCII characters from its bytes (one C pass, several times the regex's speed)."""
    if text.isascii():
        data = text.encode("ascii")
        return len(data.translate(None, ascii_forbidden)) != len(data)
    return pattern.search(text) is not None


def _keys_counted(raw: bytes, keys: int, strings: list[str]) -> bool:
    """True when the JSON holds exactly `keys` keys, at most the distinct keys its records were decoded from:
    then no key is there twice. A JSON colon outside a string follows a key, so the keys are the colons of
    the bytes less those of the decoded strings, unless an escape wrote a colon (\\u003a: then False)."""
    if b"\\u003" in raw:
        return False
    return raw.count(b":") - sum(s.count(":") for s in strings) == keys


@dataclass(frozen=True)
class DeadLetter:
    """A malformed record as written to `dynrubric.dead-letter`.

    The Kafka value is the raw bytes as received, cut to `ingest.dlq_max_payload_bytes` when longer
    (the key likewise to MAX_DLQ_KEY_BYTES); the context travels in headers, the convention Kafka
    Connect uses, so any client (kcat -f '%h') can read it: `dlq.original.length` and
    `dlq.original.sha256` describe the value before any cut, `dlq.truncated` says whether it was cut.
    """

    raw: bytes | None
    key: bytes | None
    source_topic: str
    source_partition: int
    source_offset: int
    reason: str
    error: str
    ts: float
    original_length: int | None = None  # of the value before a cut; None for a tombstone
    original_sha256: str | None = None
    truncated: bool = False

    HEADER_PREFIX = "dlq."
    MAX_ERROR_CHARS = 1000
    MAX_KEY_BYTES = 1024

    def headers(self) -> list[tuple[str, bytes]]:
        p = self.HEADER_PREFIX
        headers = [
            (p + "reason", self.reason.encode()),
            (p + "error", self.error[: self.MAX_ERROR_CHARS].encode("utf-8", "replace")),
            (p + "source.topic", self.source_topic.encode()),
            (p + "source.partition", str(self.source_partition).encode()),
            (p + "source.offset", str(self.source_offset).encode()),
            (p + "ts", repr(self.ts).encode()),
            (p + "truncated", b"true" if self.truncated else b"false"),
        ]
        if self.original_length is not None:
            headers.append((p + "original.length", str(self.original_length).encode()))
            headers.append((p + "original.sha256", (self.original_sha256 or "").encode()))
        return headers

    @classmethod
    def of(cls, reason: str, detail: str, *, raw, key, topic, partition, offset, max_payload_bytes: int) -> DeadLetter:
        """The dead letter of one record, its value cut to `max_payload_bytes` so that it is always sendable."""
        length = sha = None
        cut = False
        if raw is not None:
            length, sha = len(raw), hashlib.sha256(raw).hexdigest()
            if len(raw) > max_payload_bytes:
                raw, cut = raw[:max_payload_bytes], True
        if key is not None and len(key) > cls.MAX_KEY_BYTES:
            key, cut = key[: cls.MAX_KEY_BYTES], True
        return cls(raw, key, topic, partition, offset, reason, detail, time.time(), length, sha, cut)

    @classmethod
    def from_record(cls, value: bytes | None, key: bytes | None, headers) -> DeadLetter:
        """Read one back from a consumed dead-letter record (headers as (name, bytes) pairs)."""
        h = {
            name[len(cls.HEADER_PREFIX) :]: v.decode()
            for name, v in headers or ()
            if name.startswith(cls.HEADER_PREFIX)
        }
        length = h.get("original.length")
        return cls(
            value,
            key,
            h["source.topic"],
            int(h["source.partition"]),
            int(h["source.offset"]),
            h["reason"],
            h["error"],
            float(h["ts"]),
            int(length) if length is not None else None,
            h.get("original.sha256"),
            h.get("truncated") == "true",
        )
