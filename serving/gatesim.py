"""Rollouts simulated at the library level: how often does the gate roll back, and after how much traffic?

A population of users (`GateSimulationConfig`) is drawn once: requests-per-user shares follow a
Zipf law (share of the user of rank k proportional to k^-s: a few users send most requests), and
each user has baseline propensities to rate a response, to give a thumbs up and to regenerate
(Beta with the configured means and concentration). Each simulated rollout reshuffles the users'
places in [0, 1) (a new experiment id), walks the traffic steps and evaluates the gate after every
batch of traffic; batch sizes follow a diurnal curve. A user is on the canary when its place is
below the step's weight, as in the router. An arm changes the user's propensities by its
`ArmBehaviour` (a degraded canary shifts one metric), fails requests with its error rate, answers
with lognormal latencies, and a share of answered requests becomes a shadow pair the judge scores
(the canary is preferred with the arm's `judge_win_rate`). Errors are engine faults, drawn per request
and analysed per request, as the live gate gets them from the router's counters. A step still inconclusive after
`max_step_requests` rolls back, as the controller does when a step times out.

State is per user (the per-user rates' sums), updated only for the users of a batch, so a look costs
O(batch), not O(users).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynrubric.config import GateConfig, GateSimulationConfig
from serving.gate import ArmStats, JudgeStats, LatencySketch, UserRates, Verdict, evaluate


@dataclass(frozen=True)
class ArmBehaviour:
    """An arm's effect on the users' baselines; `ArmBehaviour()` is stable, a degraded canary changes one field."""

    positive_shift: float = 0.0  # added to each user's thumbs-up propensity
    regenerate_shift: float = 0.0  # added to each user's regenerate propensity
    error_rate: float = 0.005
    latency_median_ms: float = 400.0
    latency_p95_factor: float = 1.0  # multiplies latencies above the median: a slower tail
    judge_win_rate: float = 0.5  # canary only: the chance the judge prefers it in a shadow pair


@dataclass(frozen=True)
class SimulatedRollout:
    outcome: str  # "promoted" | "rolled_back"
    requests: int  # total requests until the decision
    canary_requests: int
    reason: str


@dataclass(frozen=True)
class Population:
    cum_share: np.ndarray  # cumulative requests-per-user shares, for inverse-CDF draws
    positive: np.ndarray
    regenerate: np.ndarray
    rated: np.ndarray

    @classmethod
    def draw(cls, sim: GateSimulationConfig, rng: np.random.Generator) -> Population:
        share = np.arange(1, sim.users + 1, dtype=float) ** -sim.zipf_s
        c = sim.concentration

        def beta(mean: float) -> np.ndarray:
            return rng.beta(mean * c, (1.0 - mean) * c, sim.users)

        return cls(
            np.cumsum(share) / share.sum(), beta(sim.positive_mean), beta(sim.regenerate_mean), beta(sim.rated_mean)
        )


class _Rates:
    """Running n, sum r_u, sum r_u^2 of per-user rates, updated for the users a batch touched."""

    def __init__(self) -> None:
        self.n, self.s, self.ss = 0, 0.0, 0.0

    def update(self, x0: np.ndarray, y0: np.ndarray, x1: np.ndarray, y1: np.ndarray) -> None:
        r0 = np.divide(y0, x0, out=np.zeros_like(y0), where=x0 > 0)
        r1 = np.divide(y1, x1, out=np.zeros_like(y1), where=x1 > 0)
        self.n += int(np.count_nonzero((x0 == 0) & (x1 > 0)))
        self.s += float(r1.sum() - r0.sum())
        self.ss += float(r1 @ r1 - r0 @ r0)

    def freeze(self) -> UserRates:
        return UserRates(self.n, self.s, self.ss)


class _Arm:
    """One arm's per-user counts (indexed by user), their ratio moments and a latency sketch."""

    FIELDS = ("requests", "errors", "answered", "rated", "positive", "regenerated")

    def __init__(self, users: int) -> None:
        self.c = {f: np.zeros(users) for f in self.FIELDS}
        self.total = dict.fromkeys(self.FIELDS, 0)
        self.seen_step = np.full(users, -1)
        self.rates = {name: _Rates() for name in ("positive", "regenerated")}
        self.users = self.step_users = self.step_requests = 0
        self.latency = LatencySketch()

    def add(self, u: np.ndarray, counts: dict[str, np.ndarray], step: int, latencies: np.ndarray) -> None:
        old = {f: self.c[f][u] for f in self.FIELDS}
        new = {f: old[f] + counts[f] for f in self.FIELDS}
        for f in self.FIELDS:
            self.c[f][u] = new[f]
            self.total[f] += int(counts[f].sum())
        self.users += int(np.count_nonzero(old["requests"] == 0))
        self.step_users += int(np.count_nonzero(self.seen_step[u] != step))
        self.seen_step[u] = step
        self.step_requests += int(counts["requests"].sum())
        for name, den in (("positive", "rated"), ("regenerated", "answered")):
            self.rates[name].update(old[den], old[name], new[den], new[name])
        self.latency.add(latencies)

    def stats(self) -> ArmStats:
        r = {k: v.freeze() for k, v in self.rates.items()}
        return ArmStats(
            step_users=self.step_users,
            step_requests=self.step_requests,
            users=self.users,
            requests=int(self.total["requests"]),
            rated=int(self.total["rated"]),
            errors=UserRates.per_request(self.total["errors"], self.total["requests"]),
            positive=r["positive"],
            regenerated=r["regenerated"],
            latency=self.latency,
        )


def _latencies(b: ArmBehaviour, n: int, rng: np.random.Generator) -> np.ndarray:
    z = rng.standard_normal(n) * 0.5
    return b.latency_median_ms * np.exp(np.where(z > 0, z * b.latency_p95_factor, z))


def _serve(
    arm: _Arm, b: ArmBehaviour, pop: Population, u: np.ndarray, k: np.ndarray, step: int, rng: np.random.Generator
) -> int:
    errors = rng.binomial(k, b.error_rate)
    answered = k - errors
    rated = rng.binomial(answered, pop.rated[u])
    positive = rng.binomial(rated, np.clip(pop.positive[u] + b.positive_shift, 0.0, 1.0))
    regenerated = rng.binomial(answered, np.clip(pop.regenerate[u] + b.regenerate_shift, 0.0, 1.0))
    total_answered = int(answered.sum())
    arm.add(
        u,
        {
            "requests": k,
            "errors": errors,
            "answered": answered,
            "rated": rated,
            "positive": positive,
            "regenerated": regenerated,
        },
        step,
        _latencies(b, total_answered, rng),
    )
    return total_answered


def simulate_rollout(
    stable: ArmBehaviour,
    canary: ArmBehaviour,
    steps: list[float],
    cfg: GateConfig,
    pop: Population,
    rng: np.random.Generator,
) -> SimulatedRollout:
    sim = cfg.simulation
    place = rng.random(len(pop.cum_share))  # this rollout's experiment: each user's place in [0, 1)
    arms = {"stable": _Arm(len(place)), "canary": _Arm(len(place))}
    judge = JudgeStats()
    total = look = 0
    for i, weight in enumerate(steps):
        step_total = 0
        for arm in arms.values():
            arm.step_users = arm.step_requests = 0
        while True:
            m = max(
                1,
                round(
                    sim.requests_per_look * (1 + sim.diurnal_amplitude * np.sin(2 * np.pi * look / sim.looks_per_day))
                ),
            )
            look += 1
            users, counts = np.unique(np.searchsorted(pop.cum_share, rng.random(m)), return_counts=True)
            on_canary = place[users] < weight
            answered = 0
            for name, b, mask in (("stable", stable, ~on_canary), ("canary", canary, on_canary)):
                answered += _serve(arms[name], b, pop, users[mask], counts[mask], i, rng)
            pairs = int(rng.binomial(answered, sim.shadow_rate))
            if pairs:
                judge = JudgeStats(
                    judge.pairs + pairs, judge.canary_score + float(rng.binomial(pairs, canary.judge_win_rate))
                )
            total += m
            step_total += m
            result = evaluate(
                arms["stable"].stats(),
                arms["canary"].stats(),
                weight,
                cfg,
                require_non_inferiority=i == len(steps) - 1,
                judge=judge,
            )
            canary_requests = arms["canary"].stats().requests
            if result.verdict is Verdict.PASS:
                break
            if result.verdict is Verdict.FAIL:
                return SimulatedRollout("rolled_back", total, canary_requests, result.reason)
            if step_total >= sim.max_step_requests:
                return SimulatedRollout("rolled_back", total, canary_requests, f"step timed out: {result.reason}")
    return SimulatedRollout("promoted", total, arms["canary"].stats().requests, "all steps passed")


def simulate_many(
    stable: ArmBehaviour, canary: ArmBehaviour, steps: list[float], cfg: GateConfig, runs: int, seed: int = 0
) -> list[SimulatedRollout]:
    """`runs` rollouts over one population (drawn from `seed`), each with its own experiment."""
    rng = np.random.default_rng(seed)
    pop = Population.draw(cfg.simulation, rng)
    return [simulate_rollout(stable, canary, steps, cfg, pop, rng) for _ in range(runs)]
