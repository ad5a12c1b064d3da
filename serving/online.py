"""Online metrics of the live rollout, read incrementally from the query-log and feedback topics.

`OnlineMetrics` is a consumer-group member with manual commits. It keeps state only for the live
rollout: events are attributed by their `experiment_id` and `assigned_variant` (never by time or
by the arm that happened to answer); an event of another experiment is skipped, and tracking a new
experiment drops the old state. The state is bounded by the rollout, not by the traffic:

- per (arm, user): requests, thumbs-rated, thumbs up, regenerated, and the step the user was last
  seen in; the arm's `UserRates` sums are updated as a user's counts change;
- a window of recent requests (`feedback_window_s` of event time) to attribute feedback, which
  names only the request: feedback for a request older than the window is not counted, and
  feedback read before its request waits in a capped queue;
- a latency sketch per arm (`LatencySketch`: fixed-size log buckets);
- shadow pairs for the judged check: halves waiting for the other (capped), complete pairs waiting
  for the judge (capped), and the judge's running tally.

Restart-safety: `checkpoint()` writes the state with the consumer positions it reflects to
`state_path` (atomically), then commits the same offsets to the group. A restarted instance loads
the file and resumes from those offsets (which equal the group's committed ones unless it died
between the two writes, when the file's are the consistent ones). Without a state file it reads
from the beginning: offsets without their state would undercount.

The SRM check counts users seen in the current step; the step boundary is the only use of time:
`ts >= step_started_at`. Errors are not in the log (a failed request has no response): they come
from the router's counters by assigned arm, request-level (engine faults, not user behaviour).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynrubric import atomic
from dynrubric.config import KafkaConfig
from dynrubric.errors import DynrubricError
from serving.gate import ArmStats, JudgeStats, LatencySketch, UserRates
from streaming.kafka import fetch_sizes

ARMS = ("stable", "canary")
# per-user counts: requests, rated, positive, regenerated, last step seen
REQ, RATED, POS, REGEN, STEP = range(5)


@dataclass(frozen=True)
class ShadowPair:
    pair_id: str
    prompt: str
    stable: str
    canary: str


class _Arm:
    def __init__(self) -> None:
        self.users: dict[str, list[int]] = {}
        self.pos = [0, 0.0, 0.0]  # n, sum, sum of squares of per-user positive rates (users with a rating)
        self.regen = [0, 0.0, 0.0]
        self.requests = self.rated = self.step_users = self.step_requests = 0
        self.latency = LatencySketch()
        self.latency_buffer: list[float] = []

    @staticmethod
    def _move(acc: list, num0: int, den0: int, num1: int, den1: int) -> None:
        if den0:
            r = num0 / den0
            acc[0] -= 1
            acc[1] -= r
            acc[2] -= r * r
        if den1:
            r = num1 / den1
            acc[0] += 1
            acc[1] += r
            acc[2] += r * r

    def change(self, u: list[int], field: int, by: int) -> None:
        """Add `by` to one of a user's counts, keeping the rate sums in step."""
        before = u.copy()
        u[field] += by
        if field in (RATED, POS):
            self._move(self.pos, before[POS], before[RATED], u[POS], u[RATED])
            self.rated += u[RATED] - before[RATED]
        else:
            self._move(self.regen, before[REGEN], before[REQ], u[REGEN], u[REQ])

    def flush_latency(self) -> None:
        if self.latency_buffer:
            self.latency.add(self.latency_buffer)
            self.latency_buffer.clear()

    def stats(self, errors: int, routed: int, settled: int) -> ArmStats:
        """`errors`, `routed` and `settled` from one snapshot of the router's counters: the error rate is
        errors / settled, the requests whose outcome is known (the log counts requests later than the router, and
        only answered ones; a router restarted mid-rollout has counted fewer, a smaller sample of the same rate)."""
        self.flush_latency()
        return ArmStats(
            step_users=self.step_users,
            step_requests=self.step_requests,
            users=len(self.users),
            requests=max(routed, self.requests),
            rated=self.rated,
            errors=UserRates.per_request(min(errors, settled), settled),
            positive=UserRates(int(self.pos[0]), self.pos[1], self.pos[2]),
            regenerated=UserRates(int(self.regen[0]), self.regen[1], self.regen[2]),
            latency=self.latency,
        )

    def to_json(self) -> dict[str, Any]:
        self.flush_latency()
        return {
            "users": self.users,
            "pos": self.pos,
            "regen": self.regen,
            "requests": self.requests,
            "rated": self.rated,
            "step_users": self.step_users,
            "step_requests": self.step_requests,
            "latency": self.latency.state(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Arm:
        a = cls()
        a.users, a.pos, a.regen = d["users"], d["pos"], d["regen"]
        a.requests, a.rated, a.step_users, a.step_requests = (
            d["requests"],
            d["rated"],
            d["step_users"],
            d["step_requests"],
        )
        a.latency = LatencySketch.from_state(d["latency"])
        return a


class OnlineMetrics:
    def __init__(
        self,
        bootstrap_servers: str,
        query_log_topic: str,
        feedback_topic: str,
        *,
        group_id: str = "dynrubric-rollout-gate",
        state_path: Path | None = None,
        feedback_window_s: float = 3600.0,
        max_waiting: int = 10_000,
        max_message_bytes: int = KafkaConfig().max_message_bytes,
    ):
        self.bootstrap_servers = bootstrap_servers
        self.max_message_bytes = max_message_bytes
        self.query_log_topic = query_log_topic
        self.feedback_topic = feedback_topic
        self.group_id = group_id
        self.state_path = Path(state_path) if state_path else None
        self.feedback_window_s = feedback_window_s
        self.max_waiting = max_waiting
        # a kafka-python KafkaConsumer (untyped), connected on the first poll, so a bad rollout request fails
        # before Kafka is needed
        self._consumer: Any = None
        self._assigned: set = set()
        self._offsets: dict[str, int] = {}  # "topic:partition" -> next offset to read, as the state reflects
        self._reset(None)
        if self.state_path and self.state_path.exists():
            self._load(json.loads(self.state_path.read_text()))

    # ------------------------------------------------------------ state
    def _reset(self, experiment: str | None) -> None:
        self.experiment = experiment
        self.step, self.step_started_at = 0, 0.0
        self.arms = {a: _Arm() for a in ARMS}
        self.window: OrderedDict[str, list] = OrderedDict()  # request_id -> [arm, user, thumbs, regenerated, ts]
        self.early_feedback: OrderedDict[str, list[str]] = OrderedDict()
        self.halves: OrderedDict[str, dict[str, Any]] = (
            OrderedDict()
        )  # pair_id -> {"served"|"shadow": (arm, prompt, text)}
        self.pairs: deque[ShadowPair] = deque(maxlen=self.max_waiting)
        self.judging: list[ShadowPair] = []  # taken by the judge, not yet judged: kept in the saved state
        self.judge = JudgeStats()
        self.skipped = 0  # events of other experiments or outside any

    def track(self, experiment: str, step: int, step_started_at: float) -> None:
        """Follow `experiment` (a new one drops the old state) at `step`, which began at `step_started_at`."""
        if experiment != self.experiment:
            self._reset(experiment)
        if step != self.step or step_started_at != self.step_started_at:
            self.step, self.step_started_at = step, step_started_at
            for arm in self.arms.values():
                arm.step_users = arm.step_requests = 0

    def _load(self, d: dict[str, Any]) -> None:
        self._reset(d["experiment"])
        self.step, self.step_started_at = d["step"], d["step_started_at"]
        self.arms = {a: _Arm.from_json(d["arms"][a]) for a in ARMS}
        self.window = OrderedDict(d["window"])
        self.early_feedback = OrderedDict(d["early_feedback"])
        self.halves = OrderedDict((k, {h: tuple(v) for h, v in x.items()}) for k, x in d["halves"])
        self.pairs.extend(ShadowPair(*p) for p in d["pairs"])
        self.judge = JudgeStats(*d["judge"])
        self._offsets = d["offsets"]

    def to_json(self) -> dict[str, Any]:
        return {
            "experiment": self.experiment,
            "step": self.step,
            "step_started_at": self.step_started_at,
            "arms": {a: arm.to_json() for a, arm in self.arms.items()},
            "window": list(self.window.items()),
            "early_feedback": list(self.early_feedback.items()),
            "halves": list(self.halves.items()),
            # the pairs the judge holds first: a controller that stops mid-batch judges them again, not never
            "pairs": [[p.pair_id, p.prompt, p.stable, p.canary] for p in [*self.judging, *self.pairs]],
            "judge": [self.judge.pairs, self.judge.canary_score],
            "offsets": self._offsets,
        }

    # ------------------------------------------------------------ events
    def apply(self, topic: str, value: bytes | None) -> None:
        """Fold one record into the state (what `poll` does for each record it reads)."""
        try:
            event = json.loads(value)  # type: ignore[arg-type]  # None (a tombstone): TypeError, below
        except (ValueError, TypeError):
            return  # ingest dead-letters malformed records; the gate just skips them
        if not isinstance(event, dict):
            return
        if topic == self.query_log_topic:
            self._request(event)
        else:
            self._feedback(event.get("request_id"), event.get("kind"))

    def _request(self, e: dict[str, Any]) -> None:
        arm_name, rid = e.get("assigned_variant"), e.get("request_id")
        if self.experiment is None or e.get("experiment_id") != self.experiment or arm_name not in ARMS or not rid:
            self.skipped += 1
            return
        if e.get("pair_id"):
            self._half(e, arm_name)
            if e.get("shadow"):
                return  # never shown to the user: in no user metric
        if rid in self.window:
            return  # a re-sent event
        arm = self.arms[arm_name]
        user_key = e.get("user_key", "")
        u = arm.users.get(user_key)
        if u is None:
            u = arm.users[user_key] = [0, 0, 0, 0, -1]
        arm.change(u, REQ, 1)
        arm.requests += 1
        ts = float(e.get("ts", 0.0))
        if e.get("variant") == arm_name:  # answered by its own arm: its latency
            arm.latency_buffer.append(float(e.get("latency_ms", 0.0)))
            if len(arm.latency_buffer) >= 4096:  # into the sketch in batches (numpy per value is slow)
                arm.flush_latency()
        if ts >= self.step_started_at:
            arm.step_requests += 1
            if u[STEP] != self.step:
                u[STEP] = self.step
                arm.step_users += 1
        self.window[rid] = [arm_name, user_key, None, False, ts]
        for kind in self.early_feedback.pop(rid, ()):
            self._feedback(rid, kind)
        while self.window and next(iter(self.window.values()))[4] < ts - self.feedback_window_s:
            self.window.popitem(last=False)

    def _feedback(self, rid: Any, kind: Any) -> None:
        entry = self.window.get(rid)
        if entry is None:
            if isinstance(rid, str) and kind in ("thumbs_up", "thumbs_down", "regenerate"):
                self.early_feedback.setdefault(rid, []).append(kind)
                if len(self.early_feedback) > self.max_waiting:
                    self.early_feedback.popitem(last=False)
            return
        arm = self.arms[entry[0]]
        u = arm.users[entry[1]]
        if kind in ("thumbs_up", "thumbs_down"):
            if entry[2] is None:
                arm.change(u, RATED, 1)
                if kind == "thumbs_up":
                    arm.change(u, POS, 1)
            elif entry[2] != kind:  # the user changed their mind: the last verdict counts
                arm.change(u, POS, 1 if kind == "thumbs_up" else -1)
            entry[2] = kind
        elif kind == "regenerate" and not entry[3]:
            arm.change(u, REGEN, 1)
            entry[3] = True

    def _half(self, e: dict[str, Any], arm: str) -> None:
        messages = e.get("messages") or []
        prompt = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
        halves = self.halves.setdefault(e["pair_id"], {})
        halves["shadow" if e.get("shadow") else "served"] = (arm, prompt, e.get("response", ""))
        if len(halves) == 2:
            del self.halves[e["pair_id"]]
            texts = {a: text for a, _, text in halves.values()}
            if set(texts) == set(ARMS):
                self.pairs.append(ShadowPair(e["pair_id"], prompt, texts["stable"], texts["canary"]))
        elif len(self.halves) > self.max_waiting:
            self.halves.popitem(last=False)

    # ------------------------------------------------------------ the gate's view
    def arm_stats(self, arm: str, errors: int = 0, routed: int = 0, settled: int = 0) -> ArmStats:
        """The gate's input for one arm; `errors`, `routed` and `settled` are the router's counters for the
        experiment (serving/router.py: ArmCounters)."""
        return self.arms[arm].stats(errors, routed, settled)

    def take_pairs(self, n: int) -> list[ShadowPair]:
        """Up to `n` complete shadow pairs for the judge (oldest first); they stay in the saved state (`judging`)
        until `add_judged` or `put_back`."""
        taken = [self.pairs.popleft() for _ in range(min(n, len(self.pairs)))]
        self.judging.extend(taken)
        return taken

    def put_back(self, pairs: list[ShadowPair]) -> None:
        """Pairs taken but not judged (the judge failed): first in line again, in their order."""
        self._settle(pairs)
        self.pairs.extendleft(reversed(pairs))

    def add_judged(self, canary_scores: list[float], pairs: list[ShadowPair] | None = None) -> None:
        """The judge's canary scores of `pairs` (default: as many of the pairs taken, oldest first)."""
        self._settle(pairs if pairs is not None else self.judging[: len(canary_scores)])
        self.judge = JudgeStats(self.judge.pairs + len(canary_scores), self.judge.canary_score + sum(canary_scores))

    def _settle(self, pairs: list[ShadowPair]) -> None:
        done = {p.pair_id for p in pairs}
        self.judging = [p for p in self.judging if p.pair_id not in done]

    # ------------------------------------------------------------ Kafka
    def _connect(self) -> None:
        from kafka import KafkaConsumer, TopicPartition
        from kafka.errors import NoBrokersAvailable

        if self._consumer is None:
            try:
                self._consumer = KafkaConsumer(
                    bootstrap_servers=self.bootstrap_servers,
                    group_id=self.group_id,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    **fetch_sizes(self.max_message_bytes),
                )
            except NoBrokersAvailable:
                raise DynrubricError(
                    f"no Kafka broker answers at {self.bootstrap_servers}",
                    "start one (`dynrubric broker start`) or fix kafka.bootstrap_servers",
                ) from None
        parts = {
            TopicPartition(topic, p)
            for topic in (self.query_log_topic, self.feedback_topic)
            for p in self._consumer.partitions_for_topic(topic) or ()
        }
        new = parts - self._assigned
        if not new:
            return
        self._consumer.assign(sorted(parts))
        for tp in new:  # the state file's offsets, else the beginning (no state: nothing to resume)
            offset = self._offsets.get(f"{tp.topic}:{tp.partition}")
            if offset is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, offset)
        self._assigned = parts

    def poll(self, budget_s: float = 2.0) -> int:
        """Read what has been produced, for at most `budget_s`; returns how many records were read.

        The budget matters under steady traffic: "until a poll comes back empty" may never happen then,
        and the gate, which polls before each verdict, would never decide. What is left is read next time.
        """
        self._connect()
        n = 0
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            batch = self._consumer.poll(timeout_ms=500, max_records=5000)
            if not batch:
                break
            for tp, records in batch.items():
                for rec in records:
                    self.apply(tp.topic, rec.value)
                    self._offsets[f"{tp.topic}:{tp.partition}"] = rec.offset + 1
                    n += 1
        return n

    def checkpoint(self) -> None:
        """Write the state with its offsets, then commit those offsets to the group."""
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        if self.state_path is not None:
            atomic.write_text(self.state_path, json.dumps(self.to_json()))
        if self._consumer is not None and self._offsets:
            self._consumer.commit(
                {
                    TopicPartition(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])): OffsetAndMetadata(v, "", -1)
                    for k, v in self._offsets.items()
                }
            )

    def committed(self) -> dict[str, int]:
        """The group's committed offsets ("topic:partition" -> offset) for the assigned partitions."""
        self._connect()
        return {
            f"{tp.topic}:{tp.partition}": off
            for tp in self._assigned
            if (off := self._consumer.committed(tp)) is not None
        }

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
