"""The gate reads the router's counters after the Kafka log (serving/rollout.py: Controller.gate); the judge works
beside it (tests/unit/test_rollout_judge.py).

The router settles a request (an error when the canary failed and stable answered instead) before it logs the
answer, so the counters hold every request the log shows only when they are read after the log. The race of
a real fleet (a failing canary's fallback answers logged between the two reads) cannot be timed on purpose,
so the router and the log here are stand-ins that play it out: the log's poll is the moment the router
settles the canary's failed requests.
"""

from __future__ import annotations

from typing import Any

from dynrubric.config import GateConfig, RolloutConfig
from serving.online import OnlineMetrics
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
