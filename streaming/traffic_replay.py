"""The traffic replayer (`dynrubric traffic replay FILE --rate R`): JSONL lines -> Kafka events.

Each line is a JSON object, one of:
- a query-log event, complete or partial: `messages` (or `prompt`, a string) plus optional `response`
  (else the line's `answer`, else ""); missing fields are filled in (a fresh request_id, ts = now,
  user_key, variant "replay", `--policy-version`, default sampling, token counts by whitespace).
  Lines of the shipped prompt file (dynrubric/data/prompts.jsonl) are of this kind.
- a feedback event: a line whose `kind` is a feedback kind (thumbs_up, thumbs_down, regenerate, copy,
  dwell) and that has no `messages`/`prompt`; `request_id` is required.
- a line may carry `"feedback": "thumbs_up"` (or a list of kinds): feedback events for that request
  are sent right after it.
With `raw`, each line's bytes go unchanged to the query-log topic (for malformed-input tests).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from dynrubric.config import KafkaConfig
from dynrubric.errors import DynrubricError
from streaming.events import FeedbackEvent, FeedbackKind, QueryLogEvent

FEEDBACK_KINDS = set(get_args(FeedbackKind))
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 256}


@dataclass
class ReplayStats:
    query_logs: int = 0
    feedback: int = 0
    raw: int = 0
    dropped: int = 0
    delivery_errors: int = 0
    seconds: float = 0.0


def events_of_line(
    line: dict, *, policy_version: str, fresh_ids: bool, now: float
) -> list[QueryLogEvent | FeedbackEvent]:
    """The events one JSONL line stands for (a query-log event and its feedback, or one feedback event)."""
    if line.get("kind") in FEEDBACK_KINDS and "messages" not in line and "prompt" not in line:
        fields = {"ts": now, "user_key": "replay-user", **line}
        return [FeedbackEvent(**{k: fields[k] for k in FeedbackEvent.model_fields if k in fields})]
    if "messages" in line:
        messages = line["messages"]
    elif "prompt" in line:
        messages = [{"role": "user", "content": line["prompt"]}]
    else:
        raise ValueError("a line needs `messages`, `prompt`, or a feedback `kind` with `request_id`")
    response = line.get("response", line.get("answer", "")) or ""
    request_id = line["request_id"] if not fresh_ids and line.get("request_id") else uuid.uuid4().hex
    event = QueryLogEvent(
        request_id=request_id,
        ts=line.get("ts", now),
        user_key=line.get("user_key", "replay-user"),
        session_id=line.get("session_id"),
        variant=line.get("variant", "replay"),
        policy_version=str(line.get("policy_version", policy_version)),
        model=line.get("model", "replay"),
        messages=messages,
        response=str(response),
        finish_reason=line.get("finish_reason", "stop"),
        sampling=line.get("sampling", DEFAULT_SAMPLING),
        latency_ms=line.get("latency_ms", 0.0),
        prompt_tokens=line.get("prompt_tokens", sum(len(m["content"].split()) for m in messages)),
        completion_tokens=line.get("completion_tokens", len(str(response).split())),
    )
    kinds = line.get("feedback") or []
    kinds = [kinds] if isinstance(kinds, str) else kinds
    feedback = [
        FeedbackEvent(request_id=request_id, ts=now, user_key=event.user_key, kind=kind, value=1.0) for kind in kinds
    ]
    return [event, *feedback]


def replay(
    kafka: KafkaConfig,
    file: Path,
    *,
    rate: float = 10.0,
    policy_version: str = "v0",
    repeat: int = 1,
    raw: bool = False,
    progress: bool = False,
) -> ReplayStats:
    """Send the file's events at `rate` query-log events per second (0 = unthrottled); wait for delivery."""
    from rich.progress import Progress

    from streaming.producer import EventProducer

    try:
        lines = [ln for ln in Path(file).read_bytes().splitlines() if ln.strip()]
    except OSError as e:
        raise DynrubricError(f"cannot read traffic file {file}: {e.strerror}", "pass an existing JSONL file") from None
    parsed: list[dict] = []
    if not raw:
        for n, ln in enumerate(lines, 1):
            try:
                obj = json.loads(ln)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
                parsed.append(obj)
            except ValueError as e:
                raise DynrubricError(
                    f"{file}:{n} is not a JSON object ({e})", "fix the line, or pass --raw to send lines unchecked"
                ) from None

    stats = ReplayStats()
    total = len(lines) * repeat
    producer = EventProducer(kafka.model_copy(update={"producer_buffer_events": max(10_000, total * 2)}))
    started = time.monotonic()
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"replaying {Path(file).name}", total=total)
        for round_ in range(repeat):
            for i in range(len(lines)):
                if rate > 0:
                    due = started + (round_ * len(lines) + i) / rate
                    if (delay := due - time.monotonic()) > 0:
                        time.sleep(delay)
                if raw:
                    producer.send_raw(producer.topics.query_log, None, lines[i])
                    stats.raw += 1
                else:
                    try:
                        events = events_of_line(
                            parsed[i], policy_version=policy_version, fresh_ids=repeat > 1, now=time.time()
                        )
                    except (ValueError, TypeError) as e:
                        raise DynrubricError(f"{file}:{i + 1}: {e}", "fix the line, or pass --raw") from None
                    for event in events:
                        if isinstance(event, QueryLogEvent):
                            producer.send_query_log(event)
                            stats.query_logs += 1
                        else:
                            producer.send_feedback(event)
                            stats.feedback += 1
                bar.advance(task)
    producer.close()
    stats.seconds = time.monotonic() - started
    stats.dropped = producer.dropped
    stats.delivery_errors = producer.delivery_errors
    return stats
