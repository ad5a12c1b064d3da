"""The gate library: its statistics, its check order, and simulated rollouts (done-when 1)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from dynrubric.config import GateConfig
from serving.gate import ArmStats, Verdict, evaluate, mixture_half_width, quantile_interval, srm_p_value
from serving.gatesim import ArmBehaviour, simulate_many

STEPS = [0.05, 0.25, 0.5]


def arm(**kw) -> ArmStats:
    base = dict(step_users=500, step_requests=500, requests=500, errors=0, rated=300, positive=210,
                regenerated=50, latencies_ms=[400.0] * 500)
    return ArmStats(**{**base, **kw})


def test_srm_p_value_matches_chi_square():
    # 1000 users expected 50/50, 550/450 observed: chi2 = 10, p = 0.00157
    assert srm_p_value(550, 450, 0.5) == pytest.approx(0.001565, rel=1e-3)
    assert srm_p_value(500, 500, 0.5) == 1.0


def test_mixture_interval_shrinks_and_covers():
    widths = [mixture_half_width(0.25 / n, 0.05, 0.05) for n in (100, 1000, 10000)]
    assert widths[0] > widths[1] > widths[2] > 0
    # always valid: wider than the fixed-n 95% interval at the same n
    assert widths[1] > 1.96 * math.sqrt(0.25 / 1000)


def test_quantile_interval_brackets_the_estimate():
    values = np.random.default_rng(0).exponential(100.0, 2000)
    est, lo, hi = quantile_interval(values, 0.95, 0.01)
    assert lo < est < hi
    assert lo < 100.0 * math.log(20) < hi  # the true p95 of Exp(mean 100)


def test_checks_run_in_order_and_say_why():
    cfg = GateConfig(min_requests_per_arm=100, min_rated_per_arm=50)
    srm = evaluate(arm(step_users=900), arm(step_users=100), 0.5, cfg)
    assert srm.verdict is Verdict.FAIL and srm.reason.startswith("sample_ratio")
    few = evaluate(arm(), arm(step_requests=20), 0.5, cfg)
    assert few.verdict is Verdict.INCONCLUSIVE and "canary has 20 requests this step of 100" in few.reason
    errors = evaluate(arm(), arm(errors=100), 0.5, cfg)
    assert errors.verdict is Verdict.FAIL and errors.reason.startswith("error_rate")
    slow = evaluate(arm(), arm(latencies_ms=[900.0] * 500), 0.5, cfg)
    assert slow.verdict is Verdict.FAIL and slow.reason.startswith("latency_p95")
    worse = evaluate(arm(), arm(positive=120), 0.5, cfg)
    assert worse.verdict is Verdict.FAIL and "positive-feedback rate" in worse.reason
    assert worse.checks[-1].numbers["canary_positive_rate"] == pytest.approx(0.4)
    undecided = evaluate(arm(), arm(), 0.5, cfg)
    assert undecided.verdict is Verdict.INCONCLUSIVE  # 300 rated cannot show a 5-point margin yet
    big = dict(requests=20000, step_requests=20000, step_users=20000, rated=12000, positive=8400, regenerated=2000)
    assert evaluate(arm(**big), arm(**big), 0.5, cfg).verdict is Verdict.PASS


def _report(name: str, runs) -> tuple[int, float]:
    rolled_back = sum(r.outcome == "rolled_back" for r in runs)
    median = statistics.median(r.requests for r in runs)
    median_canary = statistics.median(r.canary_requests for r in runs)
    print(f"\n{name}: {rolled_back}/{len(runs)} rolled back; median requests to decision {median:.0f} "
          f"(canary arm {median_canary:.0f})")
    return rolled_back, median


def test_aa_rollouts_rarely_roll_back():
    runs = simulate_many(ArmBehaviour(), ArmBehaviour(), STEPS, GateConfig(), runs=100, seed=1)
    rolled_back, _ = _report("A/A", runs)
    assert rolled_back <= 5


def test_degraded_canary_is_rolled_back():
    degraded = ArmBehaviour(positive_rate=0.60)  # ten points fewer thumbs up, everything else equal
    runs = simulate_many(ArmBehaviour(), degraded, STEPS, GateConfig(), runs=100, seed=2)
    rolled_back, _ = _report("degraded", runs)
    assert rolled_back >= 95
    assert all("positive-feedback rate" in r.reason for r in runs if r.outcome == "rolled_back")
