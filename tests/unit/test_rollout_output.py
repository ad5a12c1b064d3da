"""What `dynrubric rollout start` prints while a step polls its gate (issue 37: in `make up` one rollout printed
the same `inconclusive: min_samples ...` line 62 times, 62 of the run's 191 lines).

A step's state (its verdict and the check that decided it) is printed when it changes; the polls in between
are counted and summed up, with the last numbers, when it changes; a live status line (`progress`) sees
every poll."""

from __future__ import annotations

import dataclasses
from typing import Any

from dynrubric.config import GateConfig, RolloutConfig
from serving.gate import GateResult, Verdict
from serving.rollout import Controller, Rollout


class Router:
    def state(self) -> dict[str, Any]:
        return {"replicas": [{"name": "c", "variant": "canary", "healthy": True}], "counters": {}}

    def traffic(self, canary_weight: float, experiment: str) -> dict[str, Any]:
        return {}


class Store:
    def __init__(self, rollout: Rollout):
        self.rollout = rollout

    def update(self, rollout_id: str, **fields: Any) -> Rollout:
        self.rollout = dataclasses.replace(self.rollout, **fields)
        return self.rollout


class ScriptedGate(Controller):
    def __init__(self, results: list[GateResult], **kw: Any):
        self.results = list(results)
        self.store_ = Store(ROLLOUT)
        cfg = RolloutConfig(steps=[0.05, 0.5])
        super().__init__(None, self.store_, Router(), None, cfg, GateConfig(), **kw)  # type: ignore[arg-type]
        self.sleep = lambda _: None

    def gate(self, r: Rollout) -> GateResult:
        return self.results.pop(0)


ROLLOUT = Rollout(
    id="ro-v2",
    version="v2",
    version_path="/v2",
    baseline="v1",
    baseline_path="/v1",
    steps=[0.05, 0.5],
    status="stepping",
    step=0,
    step_started_at=1e12,  # never past max_step_s
    started_at=0.0,
    updated_at=0.0,
    reason=None,
    last_gate=None,
)


def result(verdict: Verdict, reason: str) -> GateResult:
    return GateResult(verdict=verdict, reason=reason, canary_weight=0.05, checks=[])


def script() -> list[GateResult]:
    waiting = [
        result(Verdict.INCONCLUSIVE, f"min_samples: canary has {i} users of 100") for i in range(62)
    ]  # the numbers move at every poll; the state does not
    return [*waiting, result(Verdict.PASS, "enough samples on both arms"), result(Verdict.INCONCLUSIVE, "primary: x")]


def run(controller: ScriptedGate) -> None:
    r = ROLLOUT
    for _ in range(64):
        r = controller._stepping(r)


def test_a_step_state_is_printed_when_it_changes_not_at_every_poll():
    lines: list[str] = []
    controller = ScriptedGate(script(), log=lines.append)
    run(controller)
    waiting = [line for line in lines if "inconclusive: min_samples" in line]
    assert len(waiting) == 2, f"{len(waiting)} lines of one inconclusive state:\n" + "\n".join(lines[:5])
    assert waiting[0].endswith("canary has 0 users of 100")
    assert "canary has 61 users of 100 [held 62 polls" in waiting[1]  # the last numbers, and the count
    assert [line.split(": ")[1] for line in lines] == ["inconclusive", "inconclusive", "pass", "inconclusive"]


def test_a_live_status_line_sees_every_poll():
    lines: list[str] = []
    live: list[str] = []
    controller = ScriptedGate(script(), log=lines.append, progress=live.append)
    run(controller)
    assert len(live) == 61 and live[-1].startswith("ro-v2 step 0 (5%): inconclusive: min_samples: canary has 61")
    assert "[62 polls" in live[-1]
    assert len(lines) == 4
