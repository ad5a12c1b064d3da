"""What the gate can detect (`serving.power`): its claims checked against the gate's own checks on simulated
arms, and `dynrubric gate plan`'s table; the router's traffic meter that each rollout's plan starts from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dynrubric.config import GateConfig, RolloutConfig, Settings
from serving.gate import JudgeStats, UserRates, judge_interval, ratio_difference
from serving.power import Population, Traffic, judged_pairs_per_s, plan
from serving.router import TrafficMeter

SCRIPT = Path(sys.executable).parent / "dynrubric"
TRIALS = 400


def simulated_arm(
    rng, users: int, requests_each: float, rated_share: float, propensity: np.ndarray
) -> tuple[UserRates, UserRates]:
    """(positive, regenerate) per-user rates of one arm: Poisson requests a user, a user's propensities its own."""
    requests = rng.poisson(requests_each, users)
    rated = rng.binomial(requests, rated_share)
    up = rng.binomial(rated, np.clip(propensity[0], 0, 1))
    regenerated = rng.binomial(requests, np.clip(propensity[1], 0, 1))
    return UserRates.of(up, rated), UserRates.of(regenerated, requests)


def test_the_smallest_harm_it_names_is_caught_four_times_in_five():
    """At 10 requests/s from 1,000 users, one step of 600 s at 50 %: a canary worse by the plan's detectable
    difference on one metric is caught by the gate's own interval about 80 % of the time (the plan is built
    from expected counts, the simulation draws them), and an equal canary almost never."""
    gate = GateConfig()
    sim = gate.simulation
    rollout = RolloutConfig(steps=[0.5], max_step_s=600)
    traffic = Traffic(rps=10, users=1000, pairs_per_s=0.5, source="test")
    p = plan(traffic, Population.assumed(sim), gate, rollout)
    detectable = {m.metric: m.detectable[0] for m in p.metrics}
    rng = np.random.default_rng(5)
    c = sim.concentration
    per_arm = 500
    requests_each = traffic.rps * rollout.max_step_s / traffic.users

    def caught(metric: str, shift: float) -> float:
        hits = 0
        for _ in range(TRIALS):
            arms = []
            for harm in (0.0, shift):
                pos = rng.beta(sim.positive_mean * c, (1 - sim.positive_mean) * c, per_arm)
                reg = rng.beta(sim.regenerate_mean * c, (1 - sim.regenerate_mean) * c, per_arm)
                shifted = (pos - harm, reg) if metric == "positive-feedback rate" else (pos, reg + harm)
                arms.append(simulated_arm(rng, per_arm, requests_each, sim.rated_mean, np.array(shifted)))
            (s_pos, s_reg), (c_pos, c_reg) = arms
            worse, better = (s_pos, c_pos) if metric == "positive-feedback rate" else (c_reg, s_reg)
            hits += ratio_difference(worse, better, gate.alpha / 2, gate.mixture_tau)[1] > 0
        return hits / TRIALS

    for metric in ("positive-feedback rate", "regenerate rate"):
        d = detectable[metric]
        assert d is not None and 0.01 < d < 0.2, (metric, d)
        at_d, at_0 = caught(metric, d), caught(metric, 0.0)
        print(f"\n{metric}: detectable {d:.3f}: caught {at_d:.2f} of trials; equal arms {at_0:.3f}")
        assert 0.72 <= at_d <= 0.95 and at_0 <= 0.02, (metric, at_d, at_0)

    # the judged win rate: P pairs, a canary worse by the plan's number below 1/2 - judge_margin is failed
    pairs = round(traffic.pairs_per_s * rollout.max_step_s)
    d = detectable["judged win rate"]
    bar = 0.5 - gate.judge_margin
    failed = (
        sum(
            judge_interval(JudgeStats(pairs, float(rng.binomial(pairs, 0.5 - d))), gate.judge_alpha, gate.judge_tau)[1]
            < bar
            for _ in range(TRIALS)
        )
        / TRIALS
    )
    assert failed >= 0.8, failed  # Bernoulli pairs have sd below the 1/2 the plan allows for: at least 80 %


def test_the_plan_says_what_holds_a_decision_at_small_traffic():
    """The defaults at one machine's traffic: nothing can pass step 0 (too few users for the minimums);
    the demo's gate decides in minutes on judged pairs."""
    settings = Settings()
    small = Traffic(rps=1, users=40, pairs_per_s=0.5, source="test")
    default = plan(
        small.model_copy(update={"pairs_per_s": 0.0}),
        Population.assumed(settings.gate.simulation),
        settings.gate,
        settings.rollout,
    )
    assert default.decision_s is None and "users per arm (0 of 100)" in default.held_by
    assert "rolls back at its timeout" in default.decision()
    from dynrubric.config_loader import load_settings

    settings = load_settings(environ={}, profile="demo")
    demo = plan(small, Population.assumed(settings.gate.simulation), settings.gate, settings.rollout)
    assert demo.decision_s is not None and demo.decision_s < settings.rollout.max_step_s
    judged = next(m for m in demo.metrics if m.metric == "judged win rate")
    assert judged.promote_margin == settings.gate.judge_margin
    assert [m.promote_margin for m in demo.metrics if m.metric.endswith("feedback rate")] == [None]
    lines = demo.lines()
    assert lines[0].startswith("gate power at 1.00 requests/s from 40 users, 0.50 judged pairs/s")
    assert lines[-1].strip().startswith("an equal canary is promoted after about")


def test_gate_plan_prints_a_table_for_each_traffic():
    run = subprocess.run(
        [
            str(SCRIPT),
            "gate",
            "plan",
            "--rps",
            "1",
            "--rps",
            "10",
            "--rps",
            "100",
            "--users",
            "40",
            "--users",
            "1000",
            "--users",
            "20000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for rate, users in (("1", "40"), ("10", "1000"), ("100", "20000")):
        assert f"{rate} req/s, {users} users: " in out
    assert out.count("positive-feedback rate: a drop") == 3 and "step 50%" in out
    assert "100 req/s, 20000 users: an equal canary is promoted after about" in out
    bad = subprocess.run(
        [str(SCRIPT), "gate", "plan", "--rps", "1", "--rps", "2", "--users", "1", "--users", "2", "--users", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "3 --users for 2 --rps" in bad.stderr


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_traffic_meter_rates_the_time_traffic_flowed():
    """Two requests a second for 60 s from 10 users, a 20-minute pause (users paused while a round trains), then 30 s
    from 5 of them: the rate is still about two a second and the window still holds the 10 users. A rollout starts
    there, and planned on a wall-clock window it saw 60 requests from 5 users (in make up, "from 1 users")."""
    clock = Clock()
    meter = TrafficMeter(window_s=300, clock=clock)

    def send(seconds: int, users: int) -> None:
        for i in range(seconds * 2):
            meter.add(f"u{i % users}")
            clock.now += 0.5

    send(60, 10)
    clock.now += 1200
    send(30, 5)
    snap = meter.snapshot()
    assert snap["requests"] == 180 and snap["users"] == 10
    assert snap["rps"] == pytest.approx(2.0, rel=0.15), snap
    clock.now += 400  # nothing for longer than the window: it keeps the last traffic
    assert meter.snapshot()["requests"] == 180 and meter.snapshot()["users"] == 10
    send(300, 5)  # 300 s more from u0..u4: the first minute and its users u5..u9 leave the window
    snap = meter.snapshot()
    assert snap["users"] == 5 and 580 <= snap["requests"] <= 620, snap
    assert snap["active_s"] == pytest.approx(300, abs=2) and snap["rps"] == pytest.approx(2.0, rel=0.05)


def test_gate_plan_counts_the_judges_time_per_pair():
    """`gate plan --profile demo` plans with the judge's seconds per shadow pair that the demo assumes
    (`rollout.judge_s_per_pair`): judged pairs come at what the judge gets through, not at the shadow rate."""
    from dynrubric.config_loader import load_settings

    r = load_settings(environ={}, profile="demo").rollout
    assert r.judge_s_per_pair > 0
    pairs = judged_pairs_per_s(1.0, 0.5, r.judge_s_per_pair)
    assert pairs < 0.5
    run = subprocess.run(
        [str(SCRIPT), "gate", "plan", "--profile", "demo", "--rps", "1", "--users", "40"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr
    assert f"judge {r.judge_s_per_pair:g} s a shadow pair (rollout.judge_s_per_pair)" in run.stdout
    assert f"│ {pairs:.2f}    │" in run.stdout
