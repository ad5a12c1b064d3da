"""The events on the wire: topic names, the two logged event types, and dead letters.

The JSON Schema files in `streaming/schemas/` are the source of truth; the pydantic models here mirror
them (strict, unknown fields forbidden) and `tests/test_streaming_events.py` checks that both accept
and reject the same documents. Ingest validates with the pydantic models because they are fast.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

SCHEMA_VERSION = 1

QUERY_LOG_TOPIC = "dynrubric.query-log"
FEEDBACK_TOPIC = "dynrubric.feedback"
DEAD_LETTER_TOPIC = "dynrubric.dead-letter"
TOPICS = (QUERY_LOG_TOPIC, FEEDBACK_TOPIC, DEAD_LETTER_TOPIC)

Id = Annotated[str, StringConstraints(min_length=1, max_length=128)]
PolicyVersion = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
FeedbackKind = Literal["thumbs_up", "thumbs_down", "regenerate", "copy", "dwell"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _Versioned(_Strict):
    """schema_version is required on the wire (`parse_event` checks it); Python code gets the current one."""

    schema_version: int = Field(default=SCHEMA_VERSION, ge=SCHEMA_VERSION, le=SCHEMA_VERSION)  # strict: true != 1

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Sampling(_Strict):
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    max_tokens: int = Field(ge=1)


class QueryLogEvent(_Versioned):
    """One served request and its response (schema `query-log.v1.json`, topic `dynrubric.query-log`)."""

    request_id: Id
    ts: float = Field(ge=0, description="seconds since the Unix epoch")
    user_key: Id
    session_id: Annotated[str, StringConstraints(max_length=128)] | None = None
    variant: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    policy_version: PolicyVersion
    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    messages: list[ChatMessage] = Field(min_length=1)
    response: str
    finish_reason: Annotated[str, StringConstraints(max_length=32)] | None = None
    sampling: Sampling
    latency_ms: float = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    # the rollout gate's attribution (serving/online.py) and the judged check's shadow pairs
    experiment_id: Annotated[str, StringConstraints(max_length=200)] | None = None
    assigned_variant: Annotated[str, StringConstraints(max_length=64)] | None = None
    pair_id: Annotated[str, StringConstraints(max_length=128)] | None = None
    shadow: bool = False


class FeedbackEvent(_Versioned):
    """A user's signal about one response (schema `feedback.v1.json`, topic `dynrubric.feedback`)."""

    request_id: Id
    ts: float = Field(ge=0, description="seconds since the Unix epoch")
    user_key: Id
    kind: FeedbackKind
    value: float | None = None

    def dedupe_key(self) -> str:
        # One request gets several feedback events; a re-sent event repeats all three fields.
        return f"{self.request_id}\x1f{self.kind}\x1f{self.ts!r}"


Event = QueryLogEvent | FeedbackEvent
SCHEMA_FILE_OF_MODEL = {QueryLogEvent: "query-log.v1.json", FeedbackEvent: "feedback.v1.json"}


def load_schema(model: type[QueryLogEvent] | type[FeedbackEvent]) -> dict[str, Any]:
    """The JSON Schema (source of truth) of an event model."""
    text = resources.files("streaming").joinpath("schemas", SCHEMA_FILE_OF_MODEL[model]).read_text()
    return json.loads(text)


# ---------------------------------------------------------------- malformed records
DeadLetterReason = Literal["bad_json", "schema", "schema_version", "oversize"]


class MalformedEvent(ValueError):
    """A record that cannot be ingested; `reason` is the metric label, `detail` the human message."""

    def __init__(self, reason: DeadLetterReason, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def parse_event(model: type[QueryLogEvent] | type[FeedbackEvent], raw: bytes | None, max_bytes: int) -> Event:
    """Validate one record's bytes as a `model` event; raise MalformedEvent saying why not."""
    if raw is None:
        raise MalformedEvent("bad_json", "record has no value (tombstone)")
    if len(raw) > max_bytes:
        raise MalformedEvent("oversize", f"{len(raw)} bytes > limit {max_bytes}")
    # The models default schema_version for Python callers; on the wire it is required. A byte search is
    # 100x cheaper than a validator (inside a JSON string the quotes would be escaped, so it finds the key).
    if b'"schema_version"' not in raw:
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise MalformedEvent("bad_json", f"not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise MalformedEvent("schema", f"expected a JSON object, got {type(doc).__name__}")
        raise MalformedEvent("schema_version", f"schema_version is missing (expected {SCHEMA_VERSION})")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise MalformedEvent("bad_json", f"not valid JSON: {first['msg']}") from None
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in errors[:5]
        )
        if any(err["loc"][:1] == ("schema_version",) for err in errors):
            raise MalformedEvent("schema_version", f"expected schema_version {SCHEMA_VERSION}: {detail}") from None
        raise MalformedEvent("schema", detail) from None


@dataclass(frozen=True)
class DeadLetter:
    """A malformed record as written to `dynrubric.dead-letter`.

    The Kafka value is the raw bytes exactly as received (key kept too); the context travels in
    headers, the convention Kafka Connect uses, so any client (kcat -f '%h') can read it.
    """

    raw: bytes | None
    key: bytes | None
    source_topic: str
    source_partition: int
    source_offset: int
    reason: str
    error: str
    ts: float

    HEADER_PREFIX = "dlq."

    def headers(self) -> list[tuple[str, bytes]]:
        p = self.HEADER_PREFIX
        return [
            (p + "reason", self.reason.encode()),
            (p + "error", self.error.encode()),
            (p + "source.topic", self.source_topic.encode()),
            (p + "source.partition", str(self.source_partition).encode()),
            (p + "source.offset", str(self.source_offset).encode()),
            (p + "ts", repr(self.ts).encode()),
        ]

    @classmethod
    def of(cls, error: MalformedEvent, *, raw, key, topic, partition, offset) -> DeadLetter:
        return cls(raw, key, topic, partition, offset, error.reason, error.detail, time.time())

    @classmethod
    def from_record(cls, value: bytes | None, key: bytes | None, headers) -> DeadLetter:
        """Read one back from a consumed dead-letter record (headers as (name, bytes) pairs)."""
        h = {name[len(cls.HEADER_PREFIX):]: v.decode() for name, v in headers or () if name.startswith(cls.HEADER_PREFIX)}
        return cls(
            value, key, h["source.topic"], int(h["source.partition"]), int(h["source.offset"]),
            h["reason"], h["error"], float(h["ts"]),
        )
