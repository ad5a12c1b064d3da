"""The rollout gate: may a canary take the next traffic step?

Checks run in order and the first decisive one wins:

1. sample-ratio mismatch: chi-square on the users assigned to each arm in the current step against
   the configured weight, compared with an always-valid boundary (a mismatch means the split
   itself is broken: fail);
2. minimum samples per arm in the current step (fewer: inconclusive, keep collecting);
3. guardrails, error rate and p95 latency against stable with non-inferiority margins: fail when
   the canary is confidently worse than stable by more than the margin;
4. primary online metrics, positive-feedback rate and regenerate rate, under a confidence sequence
   (the normal-mixture mSPRT of Johari et al., "Always Valid Inference", inverted into an interval):
   fail when the canary is significantly worse (at any step), pass when every metric is shown
   within its non-inferiority margin (required at the last step; earlier steps pass on no harm),
   inconclusive otherwise. The interval holds at every look at once, so
   evaluating the gate after every batch does not inflate false rollbacks.

Everything here is pure statistics over counts: the controller builds `ArmStats` from the
query-log and feedback topics joined by request_id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from statistics import NormalDist

import numpy as np
from pydantic import BaseModel

from dynrubric.config import GateConfig


class Verdict(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class ArmStats:
    """What one arm saw. Metric counts are cumulative over the rollout; `step_users` is the current step's."""

    step_users: int  # distinct users assigned to the arm since the current step began (SRM)
    step_requests: int  # requests served since the current step began (minimum samples)
    requests: int  # all requests since the rollout began
    errors: int  # of which failed on every replica tried
    rated: int  # requests that got a thumbs up or down
    positive: int  # of which thumbs up
    regenerated: int  # requests the user asked to regenerate
    latencies_ms: Sequence[float] = field(default=())  # successful requests


class Check(BaseModel):
    name: str
    verdict: Verdict
    detail: str
    numbers: dict[str, float | int | None]


class GateResult(BaseModel):
    """The gate's answer with the numbers behind it (also the `GET /gate/{id}` body)."""

    verdict: Verdict
    reason: str
    canary_weight: float
    checks: list[Check]


# ---------------------------------------------------------------- statistics
def srm_p_value(stable_users: int, canary_users: int, canary_weight: float) -> float:
    """Chi-square goodness of fit (1 degree of freedom) of the observed split against the weight."""
    n = stable_users + canary_users
    if n == 0 or not 0.0 < canary_weight < 1.0:
        return 1.0
    expected = (n * (1.0 - canary_weight), n * canary_weight)
    chi2 = sum((o - e) ** 2 / e for o, e in zip((stable_users, canary_users), expected))
    return math.erfc(math.sqrt(chi2 / 2.0))  # survival function of chi-square with 1 df


def mixture_half_width(variance: float, alpha: float, tau: float) -> float:
    """Half-width of the always-valid interval for a difference whose estimator has `variance`.

    Inverting the mSPRT with a N(0, tau^2) mixture over the effect: theta is excluded once
    Lambda(theta) >= 1/alpha, i.e. |estimate - theta| >= this width. Valid simultaneously over
    all sample sizes (asymptotically, with the variance plugged in).
    """
    if variance <= 0.0:
        return 0.0
    t2 = tau * tau
    return math.sqrt(2.0 * variance * (variance + t2) / t2 * (math.log(1.0 / alpha) + 0.5 * math.log((variance + t2) / variance)))


def _rate_variance(successes: int, n: int) -> float:
    # Agresti-Coull style shrinkage keeps the variance positive at 0/n and n/n
    p = (successes + 1.0) / (n + 2.0)
    return p * (1.0 - p) / n


def rate_difference(
    worse_arm: tuple[int, int], better_arm: tuple[int, int], alpha: float, tau: float
) -> tuple[float, float, float]:
    """(harm, lower, upper): harm = rate(worse_arm) - rate(better_arm) with its always-valid interval.

    The arguments are (successes, n); "worse_arm" is the arm whose higher rate counts as harm.
    """
    (xw, nw), (xb, nb) = worse_arm, better_arm
    harm = xw / nw - xb / nb
    width = mixture_half_width(_rate_variance(xw, nw) + _rate_variance(xb, nb), alpha, tau)
    return harm, harm - width, harm + width


def quantile_interval(values: Sequence[float], q: float, alpha: float) -> tuple[float, float, float]:
    """(estimate, lower, upper) of the q-quantile: distribution-free, from order statistics.

    The rank of the q-quantile among n draws is Binomial(n, q); the normal approximation to it
    picks the order statistics that bracket the true quantile with probability 1 - alpha.
    """
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    z = NormalDist().inv_cdf(1.0 - alpha / 2.0)
    spread = z * math.sqrt(n * q * (1.0 - q))
    lo = max(0, math.floor(n * q - spread) - 1)
    hi = min(n - 1, math.ceil(n * q + spread))
    return float(np.quantile(x, q)), float(x[lo]), float(x[hi])


# ---------------------------------------------------------------- the gate
def srm_chi2_boundary(n: int, canary_weight: float, alpha: float, tau: float) -> float:
    """The chi-square value (1 df) above which the split is a mismatch, valid at every look.

    chi2 = z^2 with z the standardised canary share; the fixed-n critical value would be crossed
    by chance when the gate looks after every batch, so the boundary is the normal-mixture one.
    """
    variance = canary_weight * (1.0 - canary_weight) / n
    return (mixture_half_width(variance, alpha, tau) ** 2) / variance


def _srm(stable: ArmStats, canary: ArmStats, weight: float, cfg: GateConfig) -> Check:
    n = stable.step_users + canary.step_users
    p = srm_p_value(stable.step_users, canary.step_users, weight)
    numbers: dict[str, float | int | None] = {
        "stable_users": stable.step_users, "canary_users": canary.step_users, "expected_canary_share": weight,
        "p_value_fixed_n": p,
    }
    if n == 0 or not 0.0 < weight < 1.0:
        return Check(name="sample_ratio", verdict=Verdict.PASS, numbers=numbers, detail="nothing to compare")
    chi2 = sum((o - e) ** 2 / e for o, e in zip((stable.step_users, canary.step_users), (n * (1 - weight), n * weight)))
    boundary = srm_chi2_boundary(n, weight, cfg.srm_alpha, cfg.mixture_tau)
    numbers |= {"chi2": chi2, "chi2_boundary": boundary}
    if chi2 > boundary:
        return Check(name="sample_ratio", verdict=Verdict.FAIL, numbers=numbers,
                     detail=f"assignment split does not match the weight (chi2={chi2:.1f} > {boundary:.1f}, "
                            f"fixed-n p={p:.2g})")
    return Check(name="sample_ratio", verdict=Verdict.PASS, numbers=numbers, detail=f"split matches the weight (chi2={chi2:.1f})")


def _min_samples(stable: ArmStats, canary: ArmStats, cfg: GateConfig) -> Check:
    need_req, need_rated = cfg.min_requests_per_arm, cfg.min_rated_per_arm
    numbers = {
        "stable_step_requests": stable.step_requests, "canary_step_requests": canary.step_requests,
        "stable_rated": stable.rated, "canary_rated": canary.rated,
        "min_requests_per_arm": need_req, "min_rated_per_arm": need_rated,
    }
    short = [
        f"{arm} has {got} {what} of {need}"
        for arm, s in (("stable", stable), ("canary", canary))
        for what, got, need in (("requests this step", s.step_requests, need_req), ("rated requests", s.rated, need_rated))
        if got < need
    ]
    if short:
        return Check(name="min_samples", verdict=Verdict.INCONCLUSIVE, numbers=numbers, detail="; ".join(short))
    return Check(name="min_samples", verdict=Verdict.PASS, numbers=numbers, detail="enough samples on both arms")


def _error_rate(stable: ArmStats, canary: ArmStats, cfg: GateConfig) -> Check:
    harm, lo, hi = rate_difference(
        (canary.errors, canary.requests), (stable.errors, stable.requests), cfg.guardrail_alpha, cfg.mixture_tau
    )
    numbers = {"stable_error_rate": stable.errors / stable.requests, "canary_error_rate": canary.errors / canary.requests,
               "difference": harm, "lower": lo, "upper": hi, "margin": cfg.error_rate_margin}
    if lo > cfg.error_rate_margin:
        return Check(name="error_rate", verdict=Verdict.FAIL, numbers=numbers,
                     detail=f"canary error rate exceeds stable by more than {cfg.error_rate_margin} (lower bound {lo:.3f})")
    return Check(name="error_rate", verdict=Verdict.PASS, numbers=numbers, detail="not shown worse than the margin")


def _latency(stable: ArmStats, canary: ArmStats, cfg: GateConfig) -> Check:
    if len(stable.latencies_ms) == 0 or len(canary.latencies_ms) == 0:
        return Check(name="latency_p95", verdict=Verdict.PASS, numbers={}, detail="no successful requests to compare")
    # two intervals, each at half the guardrail alpha
    s, s_lo, s_hi = quantile_interval(stable.latencies_ms, 0.95, cfg.guardrail_alpha / 2)
    c, c_lo, c_hi = quantile_interval(canary.latencies_ms, 0.95, cfg.guardrail_alpha / 2)
    limit = s_hi * (1.0 + cfg.latency_p95_margin)
    numbers = {"stable_p95_ms": s, "canary_p95_ms": c, "stable_p95_upper_ms": s_hi, "canary_p95_lower_ms": c_lo,
               "margin": cfg.latency_p95_margin}
    if c_lo > limit:
        return Check(name="latency_p95", verdict=Verdict.FAIL, numbers=numbers,
                     detail=f"canary p95 {c:.0f} ms is worse than stable {s:.0f} ms by more than {cfg.latency_p95_margin:.0%}")
    return Check(name="latency_p95", verdict=Verdict.PASS, numbers=numbers, detail="not shown worse than the margin")


def _primary(stable: ArmStats, canary: ArmStats, cfg: GateConfig, require_non_inferiority: bool) -> Check:
    alpha = cfg.alpha / 2  # Bonferroni over the two primary metrics
    pos_harm, pos_lo, pos_hi = rate_difference(
        (stable.positive, stable.rated), (canary.positive, canary.rated), alpha, cfg.mixture_tau
    )
    reg_harm, reg_lo, reg_hi = rate_difference(
        (canary.regenerated, canary.requests), (stable.regenerated, stable.requests), alpha, cfg.mixture_tau
    )
    numbers = {
        "stable_positive_rate": stable.positive / stable.rated, "canary_positive_rate": canary.positive / canary.rated,
        "positive_rate_drop": pos_harm, "positive_rate_drop_lower": pos_lo, "positive_rate_drop_upper": pos_hi,
        "stable_regenerate_rate": stable.regenerated / stable.requests,
        "canary_regenerate_rate": canary.regenerated / canary.requests,
        "regenerate_rate_rise": reg_harm, "regenerate_rate_rise_lower": reg_lo, "regenerate_rate_rise_upper": reg_hi,
        "alpha_per_metric": alpha,
    }
    worse = [name for name, lo in (("positive-feedback rate", pos_lo), ("regenerate rate", reg_lo)) if lo > 0.0]
    if worse:
        return Check(name="primary", verdict=Verdict.FAIL, numbers=numbers,
                     detail=f"canary is significantly worse on {' and '.join(worse)}")
    if pos_hi < cfg.positive_rate_margin and reg_hi < cfg.regenerate_rate_margin:
        return Check(name="primary", verdict=Verdict.PASS, numbers=numbers,
                     detail="canary is within the non-inferiority margins on both metrics")
    if not require_non_inferiority:
        return Check(name="primary", verdict=Verdict.PASS, numbers=numbers,
                     detail="no harm shown (non-inferiority is required at the last step)")
    return Check(name="primary", verdict=Verdict.INCONCLUSIVE, numbers=numbers,
                 detail="not yet shown within the margins nor worse")


def evaluate(stable: ArmStats, canary: ArmStats, canary_weight: float, cfg: GateConfig,
             require_non_inferiority: bool = True) -> GateResult:
    """Run the checks in order; the first fail or inconclusive decides, else pass.

    `require_non_inferiority=False` (the steps before the last) passes a primary test that shows
    no harm yet: early steps guard against harm on little traffic, and the last step, with the
    most traffic, must show the canary within the margins before promotion. Harm fails at any step.
    """
    checks: list[Check] = []
    for check in (
        lambda: _srm(stable, canary, canary_weight, cfg),
        lambda: _min_samples(stable, canary, cfg),
        lambda: _error_rate(stable, canary, cfg),
        lambda: _latency(stable, canary, cfg),
        lambda: _primary(stable, canary, cfg, require_non_inferiority),
    ):
        result = check()
        checks.append(result)
        if result.verdict is not Verdict.PASS:
            return GateResult(verdict=result.verdict, reason=f"{result.name}: {result.detail}",
                              canary_weight=canary_weight, checks=checks)
    return GateResult(verdict=Verdict.PASS, reason=checks[-1].detail, canary_weight=canary_weight, checks=checks)
