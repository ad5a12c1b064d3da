"""The rollout controller's judge (serving/rollout.py): what a failing judge leaves the gate, the judge's time per
pair that the gate's power plan reads (serving/power.py), measured and assumed, and a gate that never waits for
the judge."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import pytest

from dynrubric.config import GateConfig, RolloutConfig
from dynrubric.errors import DynrubricError
from serving.online import OnlineMetrics, ShadowPair
from serving.power import judged_pairs_per_s
from serving.rollout import Controller, Rollout
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
    assert c.judge_once() == 0
    assert c.gate(ROLLOUT).verdict is not None and online.judge.pairs == 0
    assert c.judge_once() == 4  # the judge answers again: the pairs it failed on first
    assert [p.pair_id for p in online.pairs] == ["p4", "p5"] and online.judge.pairs == 4
    assert c.judge_once() == 2
    assert online.judge.pairs == 6 and not online.pairs and not online.judging
    assert [line.split(" (")[0] for line in lines] == ["the judge failed", "the judge answers again"]
    assert c.judge_s_per_pair is not None  # the failed call is not timed


def test_the_plan_reads_the_judges_time_over_every_pair_and_assumes_one_before():
    """Before the controller judged anything the plan assumes `rollout.judge_s_per_pair`, not an instant judge;
    then the judge's time over every pair so far, not the last poll's (a poll of ground-truth pairs costs ~0)."""
    judge, online, lines = Judge(), QuietLog(pairs=8), []
    c = controller(judge, online, lines, judge_s_per_pair=3.5, poll_interval_s=2.0)
    before = c.power(Router().state())
    assert before.traffic.pairs_per_s == pytest.approx(judged_pairs_per_s(1.0, 0.5, 3.5))
    assert before.traffic.pairs_per_s < 0.5  # an instant judge would keep up with the shadows
    assert "judge 3.5 s a pair (assumed: rollout.judge_s_per_pair)" in before.traffic.source
    judge.seconds = [0.8, 0.0]  # four open pairs, then four decided by ground truth
    c.judge_once()
    c.judge_once()
    assert c.judge_s_per_pair is not None and 0.1 <= c.judge_s_per_pair < 0.5
    after = c.power(Router().state())
    assert "measured over 8" in after.traffic.source
    assert after.traffic.pairs_per_s == pytest.approx(judged_pairs_per_s(1.0, 0.5, c.judge_s_per_pair))


class HeldJudge:
    """A judge whose batch takes as long as the test says (an open pair's rubric on a busy CPU takes minutes)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def score(self, pairs: list[ShadowPair]) -> list[float]:
        self.started.set()
        assert self.release.wait(30)
        return [1.0] * len(pairs)


def test_the_gate_decides_while_the_judge_works_and_the_pairs_it_holds_are_saved(tmp_path):
    """A poll reads the log and the counters and decides without waiting for the judge's batch (make up, 2026-12-04:
    batches of 32 shadow pairs took minutes, and each held the gate's poll, a failing canary's rollback and the
    step's time limit as long). The pairs the judge holds stay in the saved state: a controller restarted mid-batch
    judges them again."""
    judge, online, lines = HeldJudge(), QuietLog(pairs=5), []  # a batch of 4 held, 1 pair waiting
    c = controller(judge, online, lines)
    with c.judging():
        assert judge.started.wait(10)
        polled: list[Any] = []
        poll = threading.Thread(target=lambda: polled.append(c.gate(ROLLOUT)))
        poll.start()
        poll.join(timeout=10)
        assert polled, "the gate's poll waited for the judge"
        assert online.judge.pairs == 0 and [p.pair_id for p in online.pairs] == ["p4"]
        saved = tmp_path / "online.json"
        saved.write_text(json.dumps(online.to_json()))
        judge.release.set()
    # the rollout's end waited for the batch in hand, and started no other
    assert online.judge.pairs == 4 and online.judge.win_rate == 1.0 and not online.judging
    assert [p.pair_id for p in online.pairs] == ["p4"]
    restarted = OnlineMetrics("127.0.0.1:9", "query-log", "feedback", state_path=saved)
    assert [p.pair_id for p in restarted.pairs] == ["p0", "p1", "p2", "p3", "p4"] and restarted.judge.pairs == 0


def test_pairs_of_a_rollout_that_ended_while_the_judge_worked_are_dropped():
    """The worker's batch outlives its rollout when the gate decides first: its scores must not count for the next."""
    online, lines = QuietLog(pairs=2), []

    class NextRolloutStarts:
        def score(self, pairs: list[ShadowPair]) -> list[float]:
            online.track("ro-2", 0, 0.0)
            return [1.0] * len(pairs)

    c = controller(NextRolloutStarts(), online, lines)  # type: ignore[arg-type]
    assert c.judge_once() == 0
    assert online.experiment == "ro-2" and online.judge.pairs == 0 and not online.pairs and not online.judging


class Store:
    """The rollout's row (serving/rollout.py RolloutStore) as the controller updates it."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    def update(self, rollout_id: str, **fields: Any) -> Rollout:
        self.rollout = dataclasses.replace(self.rollout, **fields)
        return self.rollout


def test_a_step_past_its_time_waits_for_the_judges_batch_in_hand_not_the_queue():
    """With the judge beside the gate, a step that runs out of time while the judge holds a batch of its pairs gets
    their verdicts first (before, the poll itself waited: make up promoted r1 on a poll that ended 785 s into a
    600 s step); the judge takes no new batch meanwhile, so the step does not run on with the traffic."""
    judge, online, lines = HeldJudge(), QuietLog(pairs=5), []
    c = controller(judge, online, lines, max_step_s=60.0, poll_interval_s=0.01)
    rollout = stepping_rollout(at=time.time() - 120.0)
    c.store = Store(rollout)  # type: ignore[assignment]
    with c.judging():
        assert judge.started.wait(10)  # a batch of 4 in hand, 1 pair waiting
        rollout = c._stepping(rollout)
        assert rollout.status == "stepping", rollout.reason
        assert lines[-1] == "ro-1 step 0: past 60 s, the judge's 4 pairs awaited"
        judge.release.set()
        deadline = time.monotonic() + 10
        while online.judge.pairs < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        rollout = c._stepping(rollout)  # the gate reads the batch's verdicts: nothing is owed any more
        assert rollout.status == "rolling_back"
        assert rollout.reason is not None and rollout.reason.startswith("step 0 still inconclusive after 60 s")
        assert rollout.last_gate is not None
    assert online.judge.pairs == 4 and [p.pair_id for p in online.pairs] == ["p4"]


def test_an_interrupt_does_not_wait_for_the_judges_batch():
    """Ctrl-C (or a SIGTERM turned into an exit) during a rollout ends it now, not after the judge's batch."""
    judge, online, lines = HeldJudge(), QuietLog(pairs=2), []
    c = controller(judge, online, lines)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), c.judging():
        assert judge.started.wait(10)
        raise KeyboardInterrupt
    assert time.monotonic() - started < 5
    judge.release.set()
