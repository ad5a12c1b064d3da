"""Online metrics per arm: the query-log and feedback topics joined by request_id.

`OnlineMetrics` reads both topics from the beginning with its own consumer (no group: it never
commits, so it disturbs no one) and keeps, per request, the arm that served it, its user, time
and latency, and the feedback it got. `arm_stats` turns that into the gate's `ArmStats` for one
rollout (requests since it started) and its current step (users and requests since the step began).
Errors come from the router's counters: a failed request has no response to log.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from dynrubric.errors import DynrubricError
from serving.gate import ArmStats


@dataclass
class _Request:
    variant: str
    user_key: str
    ts: float
    latency_ms: float
    thumbs: str | None = None  # the last thumbs verdict
    regenerated: bool = False


@dataclass
class OnlineMetrics:
    bootstrap_servers: str
    query_log_topic: str
    feedback_topic: str
    requests: dict[str, _Request] = field(default_factory=dict)
    # feedback can arrive (or be read) before its query-log event
    pending: dict[str, list[dict]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._consumer = None  # connected on the first poll, so a bad rollout request fails before Kafka is needed
        self._assigned: set = set()

    def _assign(self) -> None:
        """Pick up partitions (a topic may not exist until its first event); new ones start at the beginning."""
        from kafka import KafkaConsumer, TopicPartition
        from kafka.errors import NoBrokersAvailable

        if self._consumer is None:
            try:
                self._consumer = KafkaConsumer(bootstrap_servers=self.bootstrap_servers, enable_auto_commit=False,
                                               group_id=None, auto_offset_reset="earliest")
            except NoBrokersAvailable:
                raise DynrubricError(f"no Kafka broker answers at {self.bootstrap_servers}",
                                     "start one (`dynrubric broker start`) or fix kafka.bootstrap_servers") from None

        parts = {
            TopicPartition(topic, p)
            for topic in (self.query_log_topic, self.feedback_topic)
            for p in self._consumer.partitions_for_topic(topic) or ()
        }
        if parts - self._assigned:
            self._consumer.assign(sorted(parts))
            self._consumer.seek_to_beginning(*(parts - self._assigned))
            self._assigned = parts

    def poll(self, budget_s: float = 2.0) -> int:
        """Read what has been produced, for at most `budget_s`; returns how many records were read.

        The budget matters under steady traffic: "until a poll comes back empty" may never happen then,
        and the gate, which polls before each verdict, would never decide. What is left is read next time.
        """
        self._assign()
        n = 0
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            batch = self._consumer.poll(timeout_ms=500, max_records=5000)
            if not batch:
                return n
            for tp, records in batch.items():
                for rec in records:
                    n += 1
                    try:
                        event = json.loads(rec.value)
                    except (ValueError, TypeError):
                        continue  # ingest dead-letters malformed records; the gate just skips them
                    if tp.topic == self.query_log_topic:
                        self._add_request(event)
                    else:
                        self._add_feedback(event)
        return n

    def _add_request(self, e: dict) -> None:
        rid = e.get("request_id")
        if not rid or rid in self.requests:
            return
        self.requests[rid] = _Request(variant=e.get("variant", ""), user_key=e.get("user_key", ""),
                                      ts=float(e.get("ts", 0.0)), latency_ms=float(e.get("latency_ms", 0.0)))
        for fb in self.pending.pop(rid, []):
            self._add_feedback(fb)

    def _add_feedback(self, e: dict) -> None:
        rid = e.get("request_id")
        req = self.requests.get(rid)
        if req is None:
            self.pending.setdefault(rid, []).append(e)
            return
        if e.get("kind") in ("thumbs_up", "thumbs_down"):
            req.thumbs = e["kind"]
        elif e.get("kind") == "regenerate":
            req.regenerated = True

    def arm_stats(self, variant: str, since: float, step_since: float, errors: int) -> ArmStats:
        mine = [r for r in self.requests.values() if r.variant == variant and r.ts >= since]
        step = [r for r in mine if r.ts >= step_since]
        rated = [r for r in mine if r.thumbs is not None]
        return ArmStats(
            step_users=len({r.user_key for r in step}), step_requests=len(step), requests=len(mine) + errors,
            errors=errors, rated=len(rated), positive=sum(r.thumbs == "thumbs_up" for r in rated),
            regenerated=sum(r.regenerated for r in mine), latencies_ms=[r.latency_ms for r in mine],
        )

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
