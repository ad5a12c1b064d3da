"""The rollout controller's judge (serving/rollout.py): what a failing judge leaves the gate, and the judge's time
per pair that the gate's power plan reads (serving/power.py), measured and assumed."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dynrubric.config import GateConfig, RolloutConfig
from dynrubric.errors import DynrubricError
from serving.online import OnlineMetrics, ShadowPair
from serving.power import judged_pairs_per_s
from serving.rollout import Controller
from tests.rollouts import stepping_rollout

ROLLOUT = stepping_rollout()


class QuietLog(OnlineMetrics):
    """The topics, read: nothing more comes in."""

    def __init__(self, pairs: int) -> None:
        super().__init__("127.0.0.1:9", "query-log", "feedback")
        self.track("ro-1", 0, 0.0)
        self.pairs.extend(ShadowPair(f"p{i}", "an open question", "a", "b") for i in range(pairs))

    def poll(self, budget_s: float = 2.0) -> int:
        return 0

    def checkpoint(self) -> None:
        pass


class Router:
    def state(self) -> dict[str, Any]:
        return {"counters": {}, "replicas": [], "shadow_rate": 0.5, "traffic": {"rps": 1.0, "users": 40}}


class Judge:
    """Scores every pair 1/2; `fail`: the next call raises as an HTTP engine whose server is down does; `seconds`:
    how long each of the next calls takes."""

    def __init__(self) -> None:
        self.fail = False
        self.seconds: list[float] = []

    def score(self, pairs: list[ShadowPair]) -> list[float]:
        if self.fail:
            self.fail = False
            raise DynrubricError("engine at http://127.0.0.1:1 is unreachable (ConnectError)", "start the server")
        time.sleep(self.seconds.pop(0) if self.seconds else 0.0)
        return [0.5] * len(pairs)


def controller(judge: Judge, online: OnlineMetrics, lines: list[str], **rollout: Any) -> Controller:
    return Controller(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Router(),  # type: ignore[arg-type]
        online,
        RolloutConfig(judge=True, judge_pairs_per_poll=4, **rollout),
        GateConfig(),
        log=lines.append,
        judge=judge,
    )


def test_a_failing_judge_leaves_its_pairs_for_the_next_poll_and_the_gate_going():
    """`up`'s judge borrows the rounds' supervised vLLM server, which can be down or restarting: the poll still
    ends in a verdict, the pairs are judged once the judge answers again, and the log says both once."""
    judge, online, lines = Judge(), QuietLog(pairs=6), []
    c = controller(judge, online, lines)
    judge.fail = True
    c.gate(ROLLOUT)
    c.gate(ROLLOUT)  # the judge answers again: the pairs it failed on first
    assert [p.pair_id for p in online.pairs] == ["p4", "p5"] and online.judge.pairs == 4
    c.gate(ROLLOUT)
    assert online.judge.pairs == 6 and not online.pairs
    assert [line.split(" (")[0] for line in lines] == ["the judge failed", "the judge answers again"]
    assert c.judge_s_per_pair is not None  # the failed call is not timed


def test_the_plan_reads_the_judges_time_over_every_pair_and_assumes_one_before():
    """Before the controller judged anything the plan assumes `rollout.judge_s_per_pair`, not an instant judge;
    then the judge's time over every pair so far, not the last poll's (a poll of ground-truth pairs costs ~0)."""
    judge, online, lines = Judge(), QuietLog(pairs=8), []
    c = controller(judge, online, lines, judge_s_per_pair=3.5, poll_interval_s=2.0)
    before = c.power(Router().state())
    assert before.traffic.pairs_per_s == pytest.approx(judged_pairs_per_s(1.0, 0.5, c.cfg, 3.5))
    assert before.traffic.pairs_per_s < 0.5  # an instant judge would keep up with the shadows
    assert "judge 3.5 s a pair (assumed: rollout.judge_s_per_pair)" in before.traffic.source
    judge.seconds = [0.8, 0.0]  # four open pairs, then four decided by ground truth
    c.gate(ROLLOUT)
    c.gate(ROLLOUT)
    assert c.judge_s_per_pair is not None and 0.1 <= c.judge_s_per_pair < 0.5
    after = c.power(Router().state())
    assert "measured over 8" in after.traffic.source
    assert after.traffic.pairs_per_s == pytest.approx(judged_pairs_per_s(1.0, 0.5, c.cfg, c.judge_s_per_pair))
