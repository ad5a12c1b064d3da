"""The rollout gate: may a canary take the next traffic step?

The randomisation unit is the user (the router assigns a user, not a request, to an arm), so every
rate is aggregated per user (`UserRates`: the mean over users of each user's own rate, with the
variance across users; a heavy user's requests are correlated, and treating them as independent
underestimates the variance). Checks run in order and the first decisive one wins:

1. sample-ratio mismatch: chi-square on the users assigned to each arm in the current step against
   the configured weight, compared with an always-valid boundary (a mismatch means the split
   itself is broken: fail);
2. guardrails, fail when the canary is confidently worse than stable by more than the margin:
   error rate (per request, normal-mixture confidence sequence) and p95 latency (a confidence
   sequence for each arm's p95, see `quantile_cs`), each at half of `guardrail_alpha`; an error
   rate whose observed excess is over the margin but not yet shown holds the step (inconclusive),
   so a failing canary never moves to more traffic on the few requests that cannot yet show it;
3. the judged win rate (`judge_alpha`): on shadow pairs the rubric judge scores, fail when the
   canary's win rate is confidently below 1/2 - `judge_margin` (sub-Gaussian mixture, exact);
4. minimum samples per arm (users, requests this step, rated requests; fewer: inconclusive);
5. primary online metrics, positive-feedback rate and regenerate rate, at `alpha`/2 each: fail
   when the canary is significantly worse (at any step), pass when every metric is shown within
   its non-inferiority margin (required at the last step when `promote_on` names feedback;
   earlier steps pass on no harm), inconclusive otherwise;
6. at the last step only, what `promote_on` names beyond feedback: the judged win rate shown above
   1/2 - `judge_margin` (`_judged_non_inferiority`);
7. at the last step only, the error rate shown within its margin (`_error_rate_within_margin`):
   a canary whose engine fails is never promoted on too little evidence of harm.

Harm stops at once: the checks that can show it on any amount of data (2 and 3 are valid at every
sample size) run before the minimums, so a canary shown to fail its users is rolled back at the
step where that is shown, however few rated requests the feedback rates have yet.

Every check that can fail is a confidence sequence: it holds at every look at once, so evaluating
the gate after every batch does not inflate false rollbacks, and the false-rollback probability of
an A/A rollout is at most srm_alpha + guardrail_alpha + judge_alpha + alpha (a union bound).

Everything here is pure statistics over sufficient statistics: `serving.online.OnlineMetrics`
(live) and `serving.gatesim` (simulated) build `ArmStats` incrementally; `serving.power` turns the
same formulas around into what the gate can detect with a given traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
from pydantic import BaseModel

from dynrubric.config import GateConfig


class Verdict(str, Enum):  # noqa: UP042 - StrEnum changes str() and format() of a member
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


# ---------------------------------------------------------------- sufficient statistics
@dataclass(frozen=True)
class UserRates:
    """A rate aggregated per user: each user's own rate r_u = y_u / x_u (x_u > 0), averaged over users.

    The user is the unit that was randomised, so the users' rates are independent and the mean's
    variance is s^2 / n. Weighting users equally, rather than pooling requests (sum y / sum x), keeps a
    heavy user from dominating: with Zipf-distributed traffic one user can send a tenth of the
    requests, and the pooled ratio's delta-method variance is then too large to show anything.
    Kept as n, sum r_u, sum r_u^2 (updated incrementally as a user's counts change). The variance adds
    two pseudo-users with rates 0 and 1, so it is positive when every rate is 0 (no errors yet).
    """

    n: int = 0
    s: float = 0.0
    ss: float = 0.0

    @classmethod
    def of(cls, y: np.ndarray, x: np.ndarray) -> UserRates:
        y, x = np.asarray(y, dtype=float), np.asarray(x, dtype=float)
        r = y[x > 0] / x[x > 0]
        return cls(len(r), float(r.sum()), float(r @ r))

    @classmethod
    def per_request(cls, successes: int, n: int) -> UserRates:
        """Each request its own unit (a 0/1 outcome): the binomial case."""
        return cls(n, float(successes), float(successes))

    @property
    def rate(self) -> float:
        return self.s / self.n if self.n else 0.0

    def variance(self) -> float:
        """Variance of the mean rate: s^2 / n, s^2 the sample variance with the two pseudo-users."""
        if self.n == 0:
            return math.inf
        m, s, ss = self.n + 2, self.s + 1.0, self.ss + 1.0
        return max(0.0, (ss - s * s / m) / (m - 1)) / self.n


class LatencySketch:
    """Latencies in log-spaced buckets (relative width `gamma` - 1): bounded memory, mergeable.

    Bucket k holds [lo * gamma^k, lo * gamma^(k+1)); values below lo land in bucket 0, above the
    top in the last. Ranks are exact; a value is known to within its bucket.
    """

    def __init__(self, lo_ms: float = 0.1, hi_ms: float = 1e7, gamma: float = 1.02):
        self.lo, self.gamma = lo_ms, gamma
        self.buckets = int(math.ceil(math.log(hi_ms / lo_ms) / math.log(gamma)))
        self.counts = np.zeros(self.buckets, dtype=np.int64)

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    def add(self, values_ms: np.ndarray | list[float]) -> None:
        v = np.maximum(np.asarray(values_ms, dtype=float), self.lo)
        k = np.minimum((np.log(v / self.lo) / math.log(self.gamma)).astype(np.int64), self.buckets - 1)
        self.counts += np.bincount(k, minlength=self.buckets)

    def edge(self, k: int) -> float:
        return self.lo * self.gamma**k

    def at_rank(self, rank: int, upper: bool) -> float:
        """The bucket edge that bounds the `rank`-th smallest value (1-based) from below or above."""
        k = int(np.searchsorted(np.cumsum(self.counts), rank))
        return self.edge(k + 1) if upper else self.edge(k)

    def quantile(self, q: float) -> float:
        n = self.n
        if n == 0:
            return math.nan
        k = int(np.searchsorted(np.cumsum(self.counts), max(1, math.ceil(q * n))))
        return self.lo * self.gamma ** (k + 0.5)

    def state(self) -> dict:
        return {"lo": self.lo, "gamma": self.gamma, "counts": self.counts.tolist()}

    @classmethod
    def from_state(cls, s: dict) -> LatencySketch:
        sk = cls(s["lo"], s["lo"] * s["gamma"] ** len(s["counts"]), s["gamma"])
        sk.counts = np.asarray(s["counts"], dtype=np.int64)
        return sk


@dataclass(frozen=True)
class ArmStats:
    """What one arm saw: users by assigned arm, rates as user-level ratios, cumulative over the rollout."""

    step_users: int  # distinct users assigned to the arm who sent a request in the current step (SRM)
    step_requests: int  # their requests in the current step (minimum samples)
    users: int  # distinct users assigned to the arm since the rollout began
    requests: int  # all requests since the rollout began
    rated: int  # of which thumbs-rated
    errors: UserRates  # per user: failed / requests
    positive: UserRates  # per user: thumbs up / rated requests
    regenerated: UserRates  # per user: regenerated / answered requests
    latency: LatencySketch = field(default_factory=LatencySketch)  # answered requests


@dataclass(frozen=True)
class JudgeStats:
    """Shadow pairs the rubric judge scored: each pair gives the canary 1 (preferred), 1/2 (tie) or 0."""

    pairs: int = 0
    canary_score: float = 0.0  # sum of the pairs' canary scores

    @property
    def win_rate(self) -> float:
        return self.canary_score / self.pairs if self.pairs else math.nan


Numbers = dict[str, float | int | None]  # a check's numbers, as the gate's answer shows them


class GateCheck(BaseModel):
    name: str
    verdict: Verdict
    detail: str
    numbers: Numbers


class GateResult(BaseModel):
    """The gate's answer with the numbers behind it (also the `GET /gate/{id}` body)."""

    verdict: Verdict
    reason: str
    canary_weight: float
    experiment_id: str = ""
    checks: list[GateCheck]


# ---------------------------------------------------------------- confidence sequences
def srm_p_value(stable_users: int, canary_users: int, canary_weight: float) -> float:
    """Chi-square goodness of fit (1 degree of freedom) of the observed split against the weight."""
    n = stable_users + canary_users
    if n == 0 or not 0.0 < canary_weight < 1.0:
        return 1.0
    expected = (n * (1.0 - canary_weight), n * canary_weight)
    chi2 = sum((o - e) ** 2 / e for o, e in zip((stable_users, canary_users), expected, strict=True))
    return math.erfc(math.sqrt(chi2 / 2.0))  # survival function of chi-square with 1 df


def mixture_half_width(variance: float, alpha: float, tau: float) -> float:
    """Half-width of the always-valid interval for a mean whose estimator has `variance`.

    Robbins' normal mixture (the mSPRT of Johari et al. inverted): with a N(0, tau^2) mixture over
    the effect, theta is excluded once Lambda(theta) >= 1/alpha, i.e. once |estimate - theta| >=
        sqrt(2 V (V + tau^2) / tau^2 * (log(1/alpha) + log((V + tau^2) / V) / 2)),  V = variance.
    Valid simultaneously over all sample sizes: exactly when the increments are sub-Gaussian with
    the stated variance, asymptotically when the variance is estimated (the rate checks).
    """
    if variance <= 0.0:
        return 0.0
    if math.isinf(variance):
        return math.inf
    t2 = tau * tau
    return math.sqrt(
        2.0 * variance * (variance + t2) / t2 * (math.log(1.0 / alpha) + 0.5 * math.log((variance + t2) / variance))
    )


def ratio_difference(
    worse_arm: UserRates, better_arm: UserRates, alpha: float, tau: float
) -> tuple[float, float, float]:
    """(harm, lower, upper): harm = rate(worse_arm) - rate(better_arm) with its always-valid interval.

    "worse_arm" is the arm whose higher rate counts as harm; the arms are independent (their users are).
    """
    harm = worse_arm.rate - better_arm.rate
    width = mixture_half_width(worse_arm.variance() + better_arm.variance(), alpha, tau)
    return harm, harm - width, harm + width


def bernoulli_subgaussian_variance(q: float) -> float:
    """The optimal sub-Gaussian variance proxy of a centred Bernoulli(q) (Kearns & Saul 1998).

    (1 - 2q) / (2 log((1 - q) / q)), 1/4 at q = 1/2: larger than q(1 - q) away from 1/2, which is
    what makes the quantile sequence below exact rather than asymptotic.
    """
    if abs(q - 0.5) < 1e-9:
        return 0.25
    return (1.0 - 2.0 * q) / (2.0 * math.log((1.0 - q) / q))


def quantile_cs(sketch: LatencySketch, q: float, alpha: float, tau: float) -> tuple[float, float, float]:
    """(estimate, lower, upper) of the q-quantile, a confidence sequence (valid at every n at once).

    At the true quantile Q, S_n = #{X_i <= Q} - n q is a sum of centred Bernoulli(q) increments,
    sub-Gaussian with `bernoulli_subgaussian_variance(q)`; the normal mixture bounds
    |S_n / n| < w_n for all n with probability 1 - alpha (Howard & Ramdas, "Sequential estimation
    of quantiles", the fixed-quantile case). Then Q lies between the order statistics of ranks
    floor(n (q - w_n)) and ceil(n (q + w_n)), and the sketch bounds those by their bucket edges.
    Assumes latencies independent across requests (they are the server's, not the user's).
    """
    n = sketch.n
    if n == 0:
        return math.nan, 0.0, math.inf
    w = mixture_half_width(bernoulli_subgaussian_variance(q) / n, alpha, tau)
    lo_rank, hi_rank = math.floor(n * (q - w)), math.ceil(n * (q + w))
    lower = sketch.at_rank(lo_rank, upper=False) if lo_rank >= 1 else 0.0
    upper = sketch.at_rank(hi_rank, upper=True) if hi_rank <= n else math.inf
    return sketch.quantile(q), lower, upper


def srm_chi2_boundary(n: int, canary_weight: float, alpha: float, tau: float) -> float:
    """The chi-square value (1 df) above which the split is a mismatch, valid at every look.

    chi2 = z^2 with z the standardised canary share; the fixed-n critical value would be crossed
    by chance when the gate looks after every batch, so the boundary is the normal-mixture one.
    """
    variance = canary_weight * (1.0 - canary_weight) / n
    return (mixture_half_width(variance, alpha, tau) ** 2) / variance


# ---------------------------------------------------------------- the checks
def _srm(stable: ArmStats, canary: ArmStats, weight: float, cfg: GateConfig) -> GateCheck:
    n = stable.step_users + canary.step_users
    p = srm_p_value(stable.step_users, canary.step_users, weight)
    numbers: Numbers = {
        "stable_users": stable.step_users,
        "canary_users": canary.step_users,
        "expected_canary_share": weight,
        "p_value_fixed_n": p,
    }
    if n == 0 or not 0.0 < weight < 1.0:
        return GateCheck(name="sample_ratio", verdict=Verdict.PASS, numbers=numbers, detail="nothing to compare")
    chi2 = sum(
        (o - e) ** 2 / e
        for o, e in zip((stable.step_users, canary.step_users), (n * (1 - weight), n * weight), strict=True)
    )
    boundary = srm_chi2_boundary(n, weight, cfg.srm_alpha, cfg.mixture_tau)
    numbers |= {"chi2": chi2, "chi2_boundary": boundary}
    if chi2 > boundary:
        return GateCheck(
            name="sample_ratio",
            verdict=Verdict.FAIL,
            numbers=numbers,
            detail=f"users assigned per arm do not match the weight (chi2={chi2:.1f} > {boundary:.1f}, "
            f"fixed-n p={p:.2g})",
        )
    return GateCheck(
        name="sample_ratio", verdict=Verdict.PASS, numbers=numbers, detail=f"split matches the weight (chi2={chi2:.1f})"
    )


def _min_samples(stable: ArmStats, canary: ArmStats, cfg: GateConfig) -> GateCheck:
    need = (
        ("users", "users", cfg.min_users_per_arm),
        ("step_requests", "requests this step", cfg.min_requests_per_arm),
        ("rated", "rated requests", cfg.min_rated_per_arm),
    )
    numbers: Numbers = {
        f"{arm}_{attr}": getattr(s, attr) for arm, s in (("stable", stable), ("canary", canary)) for attr, _, _ in need
    }
    short = [
        f"{arm} has {getattr(s, attr)} {what} of {n}"
        for arm, s in (("stable", stable), ("canary", canary))
        for attr, what, n in need
        if getattr(s, attr) < n
    ]
    if short:
        return GateCheck(name="min_samples", verdict=Verdict.INCONCLUSIVE, numbers=numbers, detail="; ".join(short))
    return GateCheck(name="min_samples", verdict=Verdict.PASS, numbers=numbers, detail="enough samples on both arms")


def _error_rate(stable: ArmStats, canary: ArmStats, cfg: GateConfig) -> GateCheck:
    harm, lo, hi = ratio_difference(canary.errors, stable.errors, cfg.guardrail_alpha / 2, cfg.mixture_tau)
    numbers: Numbers = {
        "stable_error_rate": stable.errors.rate,
        "canary_error_rate": canary.errors.rate,
        "difference": harm,
        "lower": lo,
        "upper": hi,
        "margin": cfg.error_rate_margin,
    }
    if lo > cfg.error_rate_margin:
        return GateCheck(
            name="error_rate",
            verdict=Verdict.FAIL,
            numbers=numbers,
            detail=f"canary error rate exceeds stable by more than {cfg.error_rate_margin} (lower bound {lo:.3f})",
        )
    # the data point to harm that the interval cannot show yet: hold the step (no more traffic) until it can
    if harm > cfg.error_rate_margin:
        return GateCheck(
            name="error_rate",
            verdict=Verdict.INCONCLUSIVE,
            numbers=numbers,
            detail=f"canary error rate {canary.errors.rate:.3f} is above stable's {stable.errors.rate:.3f} by more "
            f"than {cfg.error_rate_margin}, not yet shown (lower bound {lo:.3f}): holding the step",
        )
    return GateCheck(name="error_rate", verdict=Verdict.PASS, numbers=numbers, detail="not shown worse than the margin")


def _error_rate_within_margin(stable: ArmStats, canary: ArmStats, cfg: GateConfig) -> GateCheck:
    """Before promotion the canary's error rate must be shown within the margin, not just "not shown worse".

    A canary engine that dies just before the last look has a few failed requests (its users are
    served by stable's fallback, so its user metrics look like stable's): far too few to show harm
    at the guardrail's level, and it would be promoted. Upper bound < margin cannot hold while the
    canary's error rate exceeds stable's by the margin, however many requests it saw. Same interval
    as the error-rate guardrail (its half of `guardrail_alpha`).
    """
    harm, lo, hi = ratio_difference(canary.errors, stable.errors, cfg.guardrail_alpha / 2, cfg.mixture_tau)
    numbers: Numbers = {
        "stable_error_rate": stable.errors.rate,
        "canary_error_rate": canary.errors.rate,
        "difference": harm,
        "lower": lo,
        "upper": hi,
        "margin": cfg.error_rate_margin,
    }
    if hi >= cfg.error_rate_margin:
        return GateCheck(
            name="error_rate_non_inferiority",
            verdict=Verdict.INCONCLUSIVE,
            numbers=numbers,
            detail=f"canary error rate {canary.errors.rate:.3f} (stable {stable.errors.rate:.3f}) not yet "
            f"shown within {cfg.error_rate_margin} of stable (upper bound {hi:.3f}); required to promote",
        )
    return GateCheck(
        name="error_rate_non_inferiority",
        verdict=Verdict.PASS,
        numbers=numbers,
        detail=f"canary error rate within {cfg.error_rate_margin} of stable (upper bound {hi:.3f})",
    )


def latency_check(stable: LatencySketch, canary: LatencySketch, cfg: GateConfig) -> GateCheck:
    """The p95 guardrail: canary's lower bound above stable's upper bound times (1 + margin) fails."""
    if stable.n == 0 or canary.n == 0:
        return GateCheck(
            name="latency_p95", verdict=Verdict.PASS, numbers={}, detail="no successful requests to compare"
        )
    alpha = cfg.guardrail_alpha / 4  # half the guardrail budget, split over the two arms' sequences
    s, _, s_hi = quantile_cs(stable, 0.95, alpha, cfg.latency_tau)
    c, c_lo, _ = quantile_cs(canary, 0.95, alpha, cfg.latency_tau)
    limit = s_hi * (1.0 + cfg.latency_p95_margin)
    numbers: Numbers = {
        "stable_p95_ms": s,
        "canary_p95_ms": c,
        "stable_p95_upper_ms": s_hi if math.isfinite(s_hi) else None,
        "canary_p95_lower_ms": c_lo,
        "margin": cfg.latency_p95_margin,
    }
    if c_lo > limit:
        return GateCheck(
            name="latency_p95",
            verdict=Verdict.FAIL,
            numbers=numbers,
            detail=f"canary p95 {c:.0f} ms is worse than stable {s:.0f} ms by more than {cfg.latency_p95_margin:.0%} "
            f"(canary lower bound {c_lo:.0f} ms > {limit:.0f} ms)",
        )
    return GateCheck(
        name="latency_p95", verdict=Verdict.PASS, numbers=numbers, detail="not shown worse than the margin"
    )


def judge_interval(judge: JudgeStats, alpha: float, tau: float) -> tuple[float, float]:
    """Always-valid interval of the canary's win rate: scores in [0, 1] are sub-Gaussian with 1/4 (exact)."""
    w = mixture_half_width(0.25 / judge.pairs, alpha, tau)
    return judge.win_rate - w, judge.win_rate + w


def _judged(judge: JudgeStats, cfg: GateConfig) -> GateCheck:
    if judge.pairs == 0:
        return GateCheck(name="judged_win_rate", verdict=Verdict.PASS, numbers={"pairs": 0}, detail="no judged pairs")
    lo, hi = judge_interval(judge, cfg.judge_alpha, cfg.judge_tau)
    bar = 0.5 - cfg.judge_margin
    numbers: Numbers = {"pairs": judge.pairs, "win_rate": judge.win_rate, "lower": lo, "upper": hi, "bar": bar}
    if hi < bar:
        return GateCheck(
            name="judged_win_rate",
            verdict=Verdict.FAIL,
            numbers=numbers,
            detail=f"the rubric judge prefers stable: canary win rate {judge.win_rate:.2f} over {judge.pairs} "
            f"pairs (upper bound {hi:.3f} < {bar:.3f})",
        )
    return GateCheck(
        name="judged_win_rate",
        verdict=Verdict.PASS,
        numbers=numbers,
        detail=f"canary win rate {judge.win_rate:.2f} over {judge.pairs} pairs, bounds [{lo:.2f}, {hi:.2f}]",
    )


def _judged_non_inferiority(judge: JudgeStats, cfg: GateConfig) -> GateCheck:
    """Promotion on judged evidence: the canary's win rate shown above 1/2 - judge_margin (its lower bound),
    the same always-valid interval as the judged check's harm side (`judge_alpha`)."""
    bar = 0.5 - cfg.judge_margin
    if judge.pairs == 0:
        return GateCheck(
            name="judged_non_inferiority",
            verdict=Verdict.INCONCLUSIVE,
            numbers={"pairs": 0, "bar": bar},
            detail="no judged pairs yet; a judged win rate above the bar is required to promote (gate.promote_on)",
        )
    lo, hi = judge_interval(judge, cfg.judge_alpha, cfg.judge_tau)
    numbers: Numbers = {"pairs": judge.pairs, "win_rate": judge.win_rate, "lower": lo, "upper": hi, "bar": bar}
    if lo > bar:
        return GateCheck(
            name="judged_non_inferiority",
            verdict=Verdict.PASS,
            numbers=numbers,
            detail=f"the rubric judge finds the canary within {cfg.judge_margin} of stable: win rate "
            f"{judge.win_rate:.2f} over {judge.pairs} pairs (lower bound {lo:.3f} > {bar:.3f})",
        )
    return GateCheck(
        name="judged_non_inferiority",
        verdict=Verdict.INCONCLUSIVE,
        numbers=numbers,
        detail=f"canary win rate {judge.win_rate:.2f} over {judge.pairs} pairs not yet shown above "
        f"{bar:.3f} (lower bound {lo:.3f}); required to promote (gate.promote_on)",
    )


def _primary(stable: ArmStats, canary: ArmStats, cfg: GateConfig, require_non_inferiority: bool) -> GateCheck:
    alpha = cfg.alpha / 2  # Bonferroni over the two primary metrics
    pos_harm, pos_lo, pos_hi = ratio_difference(stable.positive, canary.positive, alpha, cfg.mixture_tau)
    reg_harm, reg_lo, reg_hi = ratio_difference(canary.regenerated, stable.regenerated, alpha, cfg.mixture_tau)
    numbers: Numbers = {
        "stable_positive_rate": stable.positive.rate,
        "canary_positive_rate": canary.positive.rate,
        "positive_rate_drop": pos_harm,
        "positive_rate_drop_lower": pos_lo,
        "positive_rate_drop_upper": pos_hi,
        "stable_regenerate_rate": stable.regenerated.rate,
        "canary_regenerate_rate": canary.regenerated.rate,
        "regenerate_rate_rise": reg_harm,
        "regenerate_rate_rise_lower": reg_lo,
        "regenerate_rate_rise_upper": reg_hi,
        "alpha_per_metric": alpha,
    }
    worse = [name for name, lo in (("positive-feedback rate", pos_lo), ("regenerate rate", reg_lo)) if lo > 0.0]
    if worse:
        return GateCheck(
            name="primary",
            verdict=Verdict.FAIL,
            numbers=numbers,
            detail=f"canary is significantly worse on {' and '.join(worse)}",
        )
    if pos_hi < cfg.positive_rate_margin and reg_hi < cfg.regenerate_rate_margin:
        return GateCheck(
            name="primary",
            verdict=Verdict.PASS,
            numbers=numbers,
            detail="canary is within the non-inferiority margins on both metrics",
        )
    if not require_non_inferiority:
        return GateCheck(
            name="primary",
            verdict=Verdict.PASS,
            numbers=numbers,
            detail="no harm shown (non-inferiority is required at the last step)",
        )
    if "feedback" not in cfg.promote_on:
        return GateCheck(
            name="primary",
            verdict=Verdict.PASS,
            numbers=numbers,
            detail="no harm shown (the feedback rates' margins are not required: gate.promote_on)",
        )
    return GateCheck(
        name="primary",
        verdict=Verdict.INCONCLUSIVE,
        numbers=numbers,
        detail="not yet shown within the margins nor worse",
    )


def evaluate(
    stable: ArmStats,
    canary: ArmStats,
    canary_weight: float,
    cfg: GateConfig,
    require_non_inferiority: bool = True,
    judge: JudgeStats = JudgeStats(),
    experiment_id: str = "",
) -> GateResult:
    """Run the checks in order; the first fail or inconclusive decides, else pass.

    `require_non_inferiority=False` (the steps before the last) passes a primary test that shows
    no harm yet: early steps guard against harm on little traffic, and the last step, with the
    most traffic, must show the canary within the margins (what `cfg.promote_on` names, and the
    error rate) before promotion. Harm fails at any step, the guardrails and the judged check
    before the minimums (module docstring).
    """
    last = require_non_inferiority
    checks: list[GateCheck] = []
    for check in (
        lambda: _srm(stable, canary, canary_weight, cfg),
        lambda: _error_rate(stable, canary, cfg),
        lambda: latency_check(stable.latency, canary.latency, cfg),
        lambda: _judged(judge, cfg),
        lambda: _min_samples(stable, canary, cfg),
        lambda: _primary(stable, canary, cfg, last),
        *([lambda: _judged_non_inferiority(judge, cfg)] if last and "judged" in cfg.promote_on else []),
        *([lambda: _error_rate_within_margin(stable, canary, cfg)] if last else []),
    ):
        result = check()
        checks.append(result)
        if result.verdict is not Verdict.PASS:
            return GateResult(
                verdict=result.verdict,
                reason=f"{result.name}: {result.detail}",
                canary_weight=canary_weight,
                experiment_id=experiment_id,
                checks=checks,
            )
    # a promotion names the evidence it rests on; an earlier step the last check it passed
    promoting = (
        [
            c
            for c in checks
            if c.name in ("judged_non_inferiority", "error_rate_non_inferiority")
            or (c.name == "primary" and "feedback" in cfg.promote_on)
        ]
        if last
        else []
    )
    reason = "; ".join(f"{c.name}: {c.detail}" for c in promoting) or checks[-1].detail
    return GateResult(
        verdict=Verdict.PASS, reason=reason, canary_weight=canary_weight, experiment_id=experiment_id, checks=checks
    )
