"""The router's routing policy: which arm a user is on, and which replica of an arm serves a request.

Two small interfaces, each one rule per class, with no HTTP, no Kafka and no state of their own:
the router (`serving.router.Router`) asks them and does the rest (forwarding, the failover order,
logging, shadow pairs, weights). A new assignment rule is one `ArmAssignment`; a new way of
spreading an arm's requests over its replicas is one `ReplicaChoice`. The composition root
(`serving.commands.build_router`) chooses them.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence, Set
from typing import Literal, Protocol, TypeVar

Variant = Literal["stable", "canary"]


def bucket(experiment: str, user_hash: str) -> float:
    """A user's fixed place in [0, 1) for one experiment: the first 8 bytes of sha256("experiment:user_hash"),
    big-endian, over 2**64."""
    digest = hashlib.sha256(f"{experiment}:{user_hash}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class ArmAssignment(ABC):
    """Which arm a user is on while an experiment sends `canary_weight` of its users to the canary.

    The router asks only while a canary replica can serve; with none, every user is on stable.
    """

    @abstractmethod
    def assign(self, user_hash: str, experiment: str, canary_weight: float) -> Variant:
        """The arm of the user `user_hash` in `experiment` at the canary share `canary_weight` (in [0, 1])."""


class StickyHashAssignment(ArmAssignment):
    """Canary exactly when `bucket(experiment, user_hash) < canary_weight`, else stable.

    Deterministic per user and experiment, so a user stays on one arm for a whole rollout; a growing
    share only adds users to the canary (a bucket below the old share is below the new one); a new
    experiment id reshuffles the users. Weight 0 puts every user on stable, weight 1 every user on
    the canary (a bucket is below 1).
    """

    def assign(self, user_hash: str, experiment: str, canary_weight: float) -> Variant:
        # at weight 0 no bucket can be below it: skip the hash
        if canary_weight > 0 and bucket(experiment, user_hash) < canary_weight:
            return "canary"
        return "stable"


class ReplicaState(Protocol):
    """What the replica choice reads of a replica (`serving.router.Replica` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def variant(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def drained(self) -> bool: ...
    @property
    def inflight(self) -> int: ...


ReplicaT = TypeVar("ReplicaT", bound=ReplicaState)


def serving_replicas(replicas: Sequence[ReplicaT], variant: str) -> list[ReplicaT]:
    """The replicas of `variant` that take requests: healthy and not drained, in their given order."""
    return [r for r in replicas if r.variant == variant and r.healthy and not r.drained]


class ReplicaChoice(ABC):
    """Which replica of an arm serves a request: one of the arm's serving replicas not yet tried.

    `choose` holds the part every rule shares (only serving replicas, never one already tried for
    this request); a rule is `best`, the pick among those candidates.
    """

    def choose(self, replicas: Sequence[ReplicaT], variant: str, tried: Set[str]) -> ReplicaT | None:
        """`best` of the serving replicas of `variant` whose name is not in `tried`; None when there is none."""
        candidates = [r for r in serving_replicas(replicas, variant) if r.name not in tried]
        return self.best(candidates) if candidates else None

    @abstractmethod
    def best(self, candidates: Sequence[ReplicaT]) -> ReplicaT:
        """The replica to send to, of `candidates` (never empty, in the fleet's order)."""


class LeastInflight(ReplicaChoice):
    """The candidate with the fewest requests in flight; on a tie the first in the fleet's order."""

    def best(self, candidates: Sequence[ReplicaT]) -> ReplicaT:
        return min(candidates, key=lambda r: r.inflight)  # min keeps the first of equal keys
