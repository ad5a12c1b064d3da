"""The gate reads the Kafka log after the judge, and the router's counters after the log (serving/rollout.py:
Controller.gate).

The router settles a request (an error when the canary failed and stable answered instead) before it logs the
answer, so the counters hold every request the log shows only when they are read after the log. The race of
a real fleet (a failing canary's fallback answers logged between the two reads) cannot be timed on purpose,
so the router and the log here are stand-ins that play it out: the log's poll is the moment the router
settles the canary's failed requests.
"""

from __future__ import annotations

import json
from typing import Any

from dynrubric.config import GateConfig, RolloutConfig
from serving.online import OnlineMetrics, ShadowPair
from serving.rollout import Controller
from tests.rollouts import stepping_rollout

FAILED = 8  # the canary's requests that failed and were answered by stable, counted and logged


class SettlingRouter:
    """A router whose counters show the canary's failed requests once they have been logged."""

    def __init__(self) -> None:
        self.logged = False

    def state(self) -> dict[str, Any]:
        n = FAILED if self.logged else 0
        counters = {"stable": {"errors": 0, "requests": 20, "settled": 20}}
        counters["canary"] = {"errors": n, "requests": n, "settled": n}
        return {"counters": {"ro-1": counters}, "replicas": []}


class LogAfterRouter(OnlineMetrics):
    """The query log as the gate's consumer sees it; the router counted each answer before it was logged."""

    def __init__(self, router: SettlingRouter) -> None:
        super().__init__("127.0.0.1:9", "query-log", "feedback")
        self.router = router
        self.counters_seen: dict[str, tuple[int, int]] = {}

    def poll(self, budget_s: float = 2.0) -> int:
        self.router.logged = True
        return FAILED

    def checkpoint(self) -> None:
        pass

    def arm_stats(self, arm: str, errors: int = 0, routed: int = 0, settled: int = 0):
        self.counters_seen[arm] = (errors, settled)
        return super().arm_stats(arm, errors, routed, settled)


def test_the_gate_counts_the_errors_of_every_request_the_log_shows():
    router = SettlingRouter()
    online = LogAfterRouter(router)
    controller = Controller(None, None, router, online, RolloutConfig(), GateConfig())  # type: ignore[arg-type]
    rollout = stepping_rollout([0.3, 1.0])
    controller.gate(rollout)
    # read before the poll, the canary showed 0 errors over 0 settled requests
    assert online.counters_seen["canary"] == (FAILED, FAILED)
    assert online.counters_seen["stable"] == (0, 20)


class TrafficDuringTheJudge(OnlineMetrics):
    """The query log while a slow judge works: requests the users send meanwhile are in the log once it is read."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:9", "query-log", "feedback")
        self.produced: list[bytes] = []

    def poll(self, budget_s: float = 2.0) -> int:
        n = len(self.produced)
        for value in self.produced:
            self.apply(self.query_log_topic, value)
        self.produced.clear()
        return n

    def checkpoint(self) -> None:
        pass


class SlowJudge:
    """A judge whose minutes (an open pair's rubric on a busy CPU) see each arm answer 8 requests of this step."""

    def __init__(self, log: TrafficDuringTheJudge, started_at: float) -> None:
        self.log = log
        self.started_at = started_at

    def score(self, pairs: list[ShadowPair]) -> list[float]:
        for i in range(16):
            arm = ("stable", "canary")[i % 2]
            event = {"request_id": f"r{i}", "user_key": f"u{i}", "experiment_id": "ro-1", "assigned_variant": arm}
            self.log.produced.append(json.dumps(event | {"variant": arm, "ts": self.started_at + 1.0}).encode())
        return [0.5] * len(pairs)


class Counting:
    def state(self) -> dict[str, Any]:
        arm = {"errors": 0, "requests": 8, "settled": 8}
        return {"counters": {"ro-1": {"stable": arm, "canary": arm}}, "replicas": []}


def test_the_verdict_counts_the_requests_logged_while_the_judge_worked():
    """A poll's verdict is on the log as it is after the judge's seconds: read before them, a step whose traffic
    came in while a slow judge worked showed "0 requests this step" (make up, 2026-12-03: a rollout's step timed
    out on that reason)."""
    online = TrafficDuringTheJudge()
    online.track("ro-1", 0, 1000.0)
    online.pairs.append(ShadowPair("p0", "an open question", "stable's answer", "canary's answer"))
    gate = GateConfig(min_users_per_arm=1, min_requests_per_arm=8, min_rated_per_arm=1)
    controller = Controller(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Counting(),  # type: ignore[arg-type]
        online,
        RolloutConfig(judge=True),
        gate,
        judge=SlowJudge(online, 1000.0),
    )
    rollout = stepping_rollout(at=1000.0)
    result = controller.gate(rollout)
    samples = next(c for c in result.checks if c.name == "min_samples")
    assert (samples.numbers["stable_step_requests"], samples.numbers["canary_step_requests"]) == (8, 8), result.reason
    assert online.judge.pairs == 1
