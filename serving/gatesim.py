"""Rollouts simulated at the library level: how often does the gate roll back, and after how much traffic?

Each simulated rollout walks the configured traffic steps. Traffic arrives in batches; each request
lands on the canary with the step's weight, fails with the arm's error rate, gets a latency, a thumbs
verdict with some probability, and a regenerate with the arm's regenerate rate. The gate is
evaluated after every batch (peeking as often as the controller does); a step still inconclusive
after `max_step_requests` rolls back, as the controller does when a step times out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynrubric.config import GateConfig
from serving.gate import ArmStats, Verdict, evaluate


@dataclass(frozen=True)
class ArmBehaviour:
    positive_rate: float = 0.70
    regenerate_rate: float = 0.10
    error_rate: float = 0.005
    rated_share: float = 0.6
    latency_median_ms: float = 400.0


@dataclass(frozen=True)
class SimulatedRollout:
    outcome: str  # "promoted" | "rolled_back"
    requests: int  # total requests until the decision
    canary_requests: int
    reason: str


class _Arm:
    def __init__(self) -> None:
        self.requests = self.errors = self.rated = self.positive = self.regenerated = 0
        self.step_requests = 0
        self.latencies: list[np.ndarray] = []

    def add(self, n: int, b: ArmBehaviour, rng: np.random.Generator) -> None:
        errors = rng.binomial(n, b.error_rate)
        rated = rng.binomial(n - errors, b.rated_share)
        self.requests += n
        self.step_requests += n
        self.errors += errors
        self.rated += rated
        self.positive += rng.binomial(rated, b.positive_rate)
        self.regenerated += rng.binomial(n - errors, b.regenerate_rate)
        self.latencies.append(rng.lognormal(np.log(b.latency_median_ms), 0.5, n - errors))

    def stats(self) -> ArmStats:
        return ArmStats(
            step_users=self.step_requests, step_requests=self.step_requests, requests=self.requests,
            errors=self.errors, rated=self.rated, positive=self.positive, regenerated=self.regenerated,
            latencies_ms=np.concatenate(self.latencies) if self.latencies else (),
        )


def simulate_rollout(
    stable: ArmBehaviour,
    canary: ArmBehaviour,
    steps: list[float],
    cfg: GateConfig,
    rng: np.random.Generator,
    batch: int = 1000,
    max_step_requests: int = 200_000,
) -> SimulatedRollout:
    arms = {"stable": _Arm(), "canary": _Arm()}
    total = 0
    for i, weight in enumerate(steps):
        for arm in arms.values():
            arm.step_requests = 0
        while True:
            to_canary = rng.binomial(batch, weight)
            arms["stable"].add(batch - to_canary, stable, rng)
            arms["canary"].add(to_canary, canary, rng)
            total += batch
            result = evaluate(arms["stable"].stats(), arms["canary"].stats(), weight, cfg,
                              require_non_inferiority=i == len(steps) - 1)
            if result.verdict is Verdict.PASS:
                break
            if result.verdict is Verdict.FAIL:
                return SimulatedRollout("rolled_back", total, arms["canary"].requests, result.reason)
            if arms["stable"].step_requests + arms["canary"].step_requests >= max_step_requests:
                return SimulatedRollout("rolled_back", total, arms["canary"].requests, f"step timed out: {result.reason}")
    return SimulatedRollout("promoted", total, arms["canary"].requests, "all steps passed")


def simulate_many(
    stable: ArmBehaviour, canary: ArmBehaviour, steps: list[float], cfg: GateConfig, runs: int, seed: int = 0,
    **kwargs,
) -> list[SimulatedRollout]:
    rng = np.random.default_rng(seed)
    return [simulate_rollout(stable, canary, steps, cfg, rng, **kwargs) for _ in range(runs)]
