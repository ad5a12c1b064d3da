"""What the gate can detect with a given traffic: `dynrubric gate plan`, and the start of every rollout.

The gate's checks turned around. A metric's estimated difference between the arms has variance V
after some traffic; a check that fails once its always-valid bound clears a margin m (0 for the
feedback rates, `error_rate_margin` for the error rate, `judge_margin` below 1/2 for the judged win
rate) catches a true difference d with probability >= 80 % at that look when

    d >= m + w(V) + z_0.8 sqrt(V),    w = mixture_half_width(V, alpha, tau),  z_0.8 = 0.84

(the estimate then lands above m + w four times in five; looking more often only catches it
sooner), V taken with the canary worse by d (a fixed point: a rate moved towards 1/2 is noisier).
The smallest such d after one step of `rollout.max_step_s` at a step's canary share, on that
step's traffic alone, is the *detectable difference* shown per metric and step. The same bound
shows an equal canary within a non-inferiority margin m four times in five once
w(V) + z_0.8 sqrt(V) < m.

Traffic: `rps` requests a second from `users` users, each sending rps / users a second, a user on
the canary when its place is below the step's share. After t seconds an arm with request share s
has N = s rps t requests from its s users users, each a Poisson number with mean
lambda = rps t / users, n = s users (1 - exp(-lambda)) of them seen.

Per-user rates (positive-feedback, regenerate): a user's propensity has mean m and variance b
between users (b = m (1 - m) / (concentration + 1) with `gate.simulation`'s Beta population, the
assumption `gate simulate` makes too; the live gate measures its own). One user's rate over k
events has variance

    sigma^2 = b + (m (1 - m) - b) E[1/k],   E[1/k] over the users seen (a Poisson count, k >= 1),

the arm's mean sigma^2 / n (`UserRates.variance`, with its two pseudo-users). A share q of answered
requests is rated: a user's ratings are Poisson with mean q lambda, s users (1 - exp(-q lambda)) of
them rate. The error rate is per request: e (1 - e) / N (`UserRates.per_request`). The judged win
rate over P pairs: the gate's bound uses the exact sub-Gaussian variance 1/4 / P; the estimate's
noise is sd / sqrt(P), sd <= 1/2 (a pair scores 0, 1/2 or 1). Pairs come at `pairs_per_s`: the
router's shadow share of the answered requests, capped by what the judge scores per poll.

Time to a decision, for an equal canary, four times in five: each step needs its minimums (users and
ratings since the rollout began, requests this step), and the last step also the non-inferiority that
`gate.promote_on` names and the error-rate margin; the data of earlier steps counts where the gate
counts it. A step that needs more than `rollout.max_step_s` rolls back at its timeout: the plan says
which condition holds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from pydantic import BaseModel

from dynrubric.config import GateConfig, GateSimulationConfig, RolloutConfig
from serving.gate import UserRates, mixture_half_width

POWER = 0.8
Z_POWER = NormalDist().inv_cdf(POWER)
SEARCH_POINTS = 160  # times tried per step, geometric from 1 s to max_step_s


@dataclass(frozen=True)
class Rate:
    """A per-user rate: its mean and its variance between users."""

    mean: float
    between: float

    @classmethod
    def beta(cls, mean: float, concentration: float) -> Rate:
        return cls(mean, mean * (1.0 - mean) / (concentration + 1.0))

    def of_users(self, assigned: float, events_each: float) -> UserRates:
        """The `UserRates` of `assigned` users with a Poisson number of events each (mean `events_each`), of
        whom those with at least one count, at this rate's mean and spread."""
        n = max(1, round(assigned * -math.expm1(-events_each)))
        within = self.mean * (1.0 - self.mean)
        var = self.between + (within - self.between) * mean_inverse_count(events_each)
        return UserRates(n, n * self.mean, n * (var + self.mean * self.mean))


def mean_inverse_count(lam: float) -> float:
    """E[1/K | K >= 1] for K Poisson with mean `lam` (1 at lam -> 0): a seen user's rate is over K events."""
    if lam < 1e-9:
        return 1.0
    top = int(lam + 12.0 * math.sqrt(lam) + 30.0)
    total = sum(math.exp(k * math.log(lam) - lam - math.lgamma(k + 1)) / k for k in range(1, top))
    return total / -math.expm1(-lam)


@dataclass(frozen=True)
class Population:
    """What stable's users do, as the plan assumes it."""

    positive: Rate
    regenerate: Rate
    rated_share: float
    error_rate: float
    source: str

    @classmethod
    def assumed(cls, sim: GateSimulationConfig) -> Population:
        return cls(
            Rate.beta(sim.positive_mean, sim.concentration),
            Rate.beta(sim.regenerate_mean, sim.concentration),
            sim.rated_mean,
            0.0,
            "assumed: gate.simulation's population, no errors",
        )


class Traffic(BaseModel):
    rps: float  # requests a second, both arms
    users: int  # distinct users sending them
    pairs_per_s: float  # judged shadow pairs a second (0: no judged check)
    source: str  # where the numbers come from


@dataclass(frozen=True)
class _Arm:
    requests: float
    assigned: float  # users assigned to the arm, seen or not
    step_requests: float

    @property
    def users(self) -> float:
        return self.assigned * -math.expm1(-self.requests / self.assigned) if self.assigned else 0.0


def _arms(traffic: Traffic, history: list[tuple[float, float]]) -> tuple[_Arm, _Arm]:
    """(stable, canary) expected after the steps of `history` [(canary share, seconds)], the last one current."""
    elapsed = sum(t for _, t in history)
    arms = []
    for share_of in (lambda w: 1.0 - w, lambda w: w):
        requests = traffic.rps * sum(share_of(w) * t for w, t in history)
        share = requests / (traffic.rps * elapsed) if elapsed and traffic.rps else 0.0
        w_now, t_now = history[-1]
        arms.append(_Arm(requests, share * traffic.users, traffic.rps * share_of(w_now) * t_now))
    return arms[0], arms[1]


def _reach(variance: float, alpha: float, tau: float) -> float:
    """w(V) + z_0.8 sqrt(V): how far beyond its bound a difference must lie to be caught four times in five."""
    return mixture_half_width(variance, alpha, tau) + Z_POWER * math.sqrt(variance)


class _Reach:
    """For one arm pair's expected traffic: each metric's reach, the canary's rate moved by `harm` (the
    variance of a worse canary is not the stable arm's), and the detectable difference (module docstring)."""

    FIXED_POINT_STEPS = 8  # d = m + reach(V(d)) settles in a few rounds: V changes little with d

    def __init__(self, stable: _Arm, canary: _Arm, pop: Population, pairs: float, cfg: GateConfig):
        self.stable, self.canary, self.pop, self.pairs, self.cfg = stable, canary, pop, pairs, cfg

    def _rate_variance(self, rate: Rate, share: float, harm: float) -> float:
        """Both arms' per-user rate variances, `share` of the requests counted (the rated ones, or all)."""
        worse = Rate(min(max(rate.mean + harm, 0.0), 1.0), rate.between)
        return sum(
            r.of_users(arm.assigned, share * arm.requests / arm.assigned).variance() if arm.assigned else math.inf
            for r, arm in ((rate, self.stable), (worse, self.canary))
        )

    def positive(self, harm: float = 0.0) -> float:
        return _reach(
            self._rate_variance(self.pop.positive, self.pop.rated_share, -harm),
            self.cfg.alpha / 2,
            self.cfg.mixture_tau,
        )

    def regenerate(self, harm: float = 0.0) -> float:
        return _reach(self._rate_variance(self.pop.regenerate, 1.0, harm), self.cfg.alpha / 2, self.cfg.mixture_tau)

    def errors(self, harm: float = 0.0) -> float:
        variance = sum(
            UserRates.per_request(round(min(e, 1.0) * arm.requests), max(1, round(arm.requests))).variance()
            for e, arm in ((self.pop.error_rate, self.stable), (self.pop.error_rate + harm, self.canary))
        )
        return _reach(variance, self.cfg.guardrail_alpha / 2, self.cfg.mixture_tau)

    def judged(self, harm: float = 0.0) -> float:
        """The exact bound's width plus the noise of P pairs at sd 1/2 (the most a pair's score can have)."""
        if self.pairs < 1:
            return math.inf
        w = mixture_half_width(0.25 / self.pairs, self.cfg.judge_alpha, self.cfg.judge_tau)
        return w + Z_POWER * 0.5 / math.sqrt(self.pairs)

    def detectable(self, reach: Callable[[float], float], margin: float) -> float:
        """The smallest d with d >= margin + reach(d): a canary worse by d is caught four times in five."""
        d = margin
        for _ in range(self.FIXED_POINT_STEPS):
            d = margin + reach(d)
            if not math.isfinite(d) or d > 1.0:
                return math.inf
        return d

    def rated(self, arm: _Arm) -> float:
        return self.pop.rated_share * arm.requests


class MetricPlan(BaseModel):
    metric: str
    baseline: float
    harm: str  # what the detectable difference is: "drop", "rise", "below 1/2 by"
    detectable: list[float | None]  # per step: smallest harmful difference caught at 80 % within max_step_s
    promote_margin: float | None  # the margin the last step must show it within; None: not required


class GatePlan(BaseModel):
    """What the gate can detect and how long it takes to decide, for one traffic."""

    traffic: Traffic
    population: str
    steps: list[float]
    max_step_s: float
    metrics: list[MetricPlan]
    step_seconds: list[float | None]  # an equal canary passes each step after this long (80 %); None: not in max_step_s
    held_by: str | None  # when a step cannot pass within max_step_s: what holds it

    @property
    def decision_s(self) -> float | None:
        return None if None in self.step_seconds else sum(s for s in self.step_seconds if s is not None)

    def decision(self) -> str:
        steps = ", ".join(f"step {i} {'-' if s is None else f'{s:.0f} s'}" for i, s in enumerate(self.step_seconds))
        if self.decision_s is None:
            stuck = self.step_seconds.index(None)
            return (
                f"no decision for an equal canary within max_step_s {self.max_step_s:.0f} s: step {stuck} is "
                f"held by {self.held_by} and rolls back at its timeout ({steps})"
            )
        return f"an equal canary is promoted after about {self.decision_s:.0f} s ({steps})"

    def lines(self) -> list[str]:
        t = self.traffic
        judged = f", {t.pairs_per_s:.2f} judged pairs/s" if t.pairs_per_s else ""
        out = [
            f"gate power at {t.rps:.2f} requests/s from {t.users} users{judged} ({t.source}; {self.population}): "
            f"smallest harm caught with 80% power within max_step_s {self.max_step_s:.0f} s"
        ]
        shares = " / ".join(f"{w:.0%}" for w in self.steps)
        for m in self.metrics:
            per_step = " / ".join("-" if d is None else f"{d:.3f}" for d in m.detectable)
            need = (
                f"; promotion needs it within {m.promote_margin:g}"
                if m.promote_margin is not None
                else "; not required to promote"
            )
            out.append(f"  {m.metric} ({m.baseline:.3f}): {m.harm} of {per_step} at steps {shares}{need}")
        out.append(f"  {self.decision()}")
        return out


def _cap(x: float, most: float) -> float | None:
    """A detectable difference, or None when it is beyond what the metric can move (a drop below 0 ...)."""
    return round(x, 4) if math.isfinite(x) and x <= most else None


def plan(traffic: Traffic, pop: Population, gate: GateConfig, rollout: RolloutConfig) -> GatePlan:
    """What `gate` can detect at `traffic` over `rollout.steps` (module docstring)."""
    steps, T = list(rollout.steps), rollout.max_step_s
    alone = [_Reach(*_arms(traffic, [(w, T)]), pop, traffic.pairs_per_s * T, gate) for w in steps]
    feedback = "feedback" in gate.promote_on
    metrics = [
        MetricPlan(
            metric="positive-feedback rate",
            baseline=pop.positive.mean,
            harm="a drop",
            detectable=[_cap(r.detectable(r.positive, 0.0), pop.positive.mean) for r in alone],
            promote_margin=gate.positive_rate_margin if feedback else None,
        ),
        MetricPlan(
            metric="regenerate rate",
            baseline=pop.regenerate.mean,
            harm="a rise",
            detectable=[_cap(r.detectable(r.regenerate, 0.0), 1.0 - pop.regenerate.mean) for r in alone],
            promote_margin=gate.regenerate_rate_margin if feedback else None,
        ),
        MetricPlan(
            metric="error rate",
            baseline=pop.error_rate,
            harm="a rise",
            detectable=[_cap(r.detectable(r.errors, gate.error_rate_margin), 1.0 - pop.error_rate) for r in alone],
            promote_margin=gate.error_rate_margin,
        ),
    ]
    if traffic.pairs_per_s > 0 or "judged" in gate.promote_on:
        metrics.append(
            MetricPlan(
                metric="judged win rate",
                baseline=0.5,
                harm="a fall below 1/2",
                detectable=[_cap(r.detectable(r.judged, gate.judge_margin), 0.5) for r in alone],
                promote_margin=gate.judge_margin if "judged" in gate.promote_on else None,
            )
        )
    step_seconds, held_by = _decision_times(traffic, pop, gate, steps, T)
    return GatePlan(
        traffic=traffic,
        population=pop.source,
        steps=steps,
        max_step_s=T,
        metrics=metrics,
        step_seconds=step_seconds,
        held_by=held_by,
    )


def _holding(reach: _Reach, gate: GateConfig, last: bool) -> list[str]:
    """The conditions an equal canary does not yet meet four times in five with this traffic."""
    held = [
        f"{name} ({have:.0f} of {need})"
        for name, have, need in (
            ("users per arm", min(reach.stable.users, reach.canary.users), gate.min_users_per_arm),
            (
                "requests this step per arm",
                min(reach.stable.step_requests, reach.canary.step_requests),
                gate.min_requests_per_arm,
            ),
            (
                "rated requests per arm",
                min(reach.rated(reach.stable), reach.rated(reach.canary)),
                gate.min_rated_per_arm,
            ),
        )
        if have < need
    ]
    if not last:
        return held
    wanted = [("error rate within its margin", reach.errors(), gate.error_rate_margin)]
    if "feedback" in gate.promote_on:
        wanted += [
            ("positive-feedback rate within its margin", reach.positive(), gate.positive_rate_margin),
            ("regenerate rate within its margin", reach.regenerate(), gate.regenerate_rate_margin),
        ]
    if "judged" in gate.promote_on:
        wanted.append(
            (f"judged win rate within its margin ({reach.pairs:.0f} pairs)", reach.judged(), gate.judge_margin)
        )
    return held + [f"{name} (needs {margin:g}, shows {r:.3f})" for name, r, margin in wanted if not r < margin]


def _decision_times(
    traffic: Traffic, pop: Population, gate: GateConfig, steps: list[float], T: float
) -> tuple[list[float | None], str | None]:
    times: list[float | None] = []
    history: list[tuple[float, float]] = []
    grid = [T ** (i / (SEARCH_POINTS - 1)) for i in range(SEARCH_POINTS)]  # 1 s .. T
    for i, w in enumerate(steps):
        last = i == len(steps) - 1

        def reach_at(t: float, w: float = w) -> _Reach:  # w: this step's weight, bound now
            h = [*history, (w, t)]
            return _Reach(*_arms(traffic, h), pop, traffic.pairs_per_s * sum(x for _, x in h), gate)

        t = next((t for t in grid if traffic.rps > 0 and not _holding(reach_at(t), gate, last)), None)
        times.append(t)
        if t is None:
            return times + [None] * (len(steps) - i - 1), "; ".join(_holding(reach_at(T), gate, last))
        history.append((w, t))
    return times, None


def judged_pairs_per_s(rps: float, shadow_rate: float, judge_s_per_pair: float | None) -> float:
    """Judged pairs a second: the router's shadows of the answered requests, at most what the controller's judge
    gets through working back to back (serving/rollout.py: its worker waits only when no pair is waiting), one
    pair every `judge_s_per_pair` seconds (unknown: the judge keeps up)."""
    shadows = rps * shadow_rate
    return shadows if not judge_s_per_pair else min(shadows, 1.0 / judge_s_per_pair)
