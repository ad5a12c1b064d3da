"""Rollout records the gate tests start from."""

from __future__ import annotations

from collections.abc import Sequence

from serving.rollout import Rollout


def stepping_rollout(steps: Sequence[float] = (0.5, 1.0), at: float = 0.0) -> Rollout:
    """Rollout ro-1 of r1 over base, at its first step since `at` (no gate run yet)."""
    return Rollout(
        id="ro-1",
        version="r1",
        version_path="/r1",
        baseline="base",
        baseline_path="/base",
        steps=list(steps),
        status="stepping",
        step=0,
        step_started_at=at,
        started_at=at,
        updated_at=at,
        reason=None,
        last_gate=None,
    )
