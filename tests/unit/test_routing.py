"""The routing policy (serving/routing.py) on its own, and the router's use of it: no server, no Kafka."""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass

import pytest
from fastapi import HTTPException
from prometheus_client import CollectorRegistry

from serving.router import EngineFailure, Replica, Router, RouterState, hash_user
from serving.routing import ArmAssignment, LeastInflight, StickyHashAssignment, Variant

USERS = [hash_user(f"user-{i}") for i in range(10_000)]
WEIGHTS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.9, 1.0)

# Recorded from `Router.assign` before the policy left serving/router.py (a serving canary, these
# USERS): per experiment and canary weight, the number of canary users and the sha256 of the arms in
# USERS order ("c" canary, "s" stable).
RECORDED = {
    ("rollout-25", 0.0): (0, "8bee8fea52f079704e4de56a89d19f3842e14cdf1e1effdbe2267db94f0ef457"),
    ("rollout-25", 0.01): (108, "d61aa0bf78fd9861ff7bbf2410180f5b8142327a4a642b48e952f9ed6abca9a1"),
    ("rollout-25", 0.05): (511, "b21b099d0cb63a30b5b8feb5616ff5c2d97901cb6e7d72b900ce778d594d8222"),
    ("rollout-25", 0.1): (1012, "2c308c3ef6b25aa266bc6fda58541bd81aed25ef29f46f5215a64a3357a52f4f"),
    ("rollout-25", 0.25): (2461, "c157a174437c76158331b2bb39da273b04fc2065db60ce1502422f58f36d54f1"),
    ("rollout-25", 0.5): (4922, "6dc1d020f4edfaaa3c94f7fb07166cf46419c4a95b9b91aadb938ffd8719cf1d"),
    ("rollout-25", 0.9): (8947, "eb1e09732ddaee62f7382f34827a6cee7695bbc1ab1c0d24bd65f3abb2bf409b"),
    ("rollout-25", 1.0): (10000, "3147e82943e54c7ee6f0051d7e224d2312e29f2a8b77a443a2fa0732a78781d2"),
    ("rollout-26", 0.0): (0, "8bee8fea52f079704e4de56a89d19f3842e14cdf1e1effdbe2267db94f0ef457"),
    ("rollout-26", 0.01): (82, "fc61a30d70cd5c3272aa3f05eb81196fd6bba42216f3a864bc98e785d493bca8"),
    ("rollout-26", 0.05): (507, "58cbc510c15e3c87c3d05350e0814c3749e6d6a2c411cc5ea71ce8957a4b18e3"),
    ("rollout-26", 0.1): (978, "a2098948cddbcf74ca15fafd55e4affdd9c143d19a6e25949424a1886b258990"),
    ("rollout-26", 0.25): (2483, "0773095579e6059175f7479bc977904095b20b8a3fea1a3f3b611f930e810461"),
    ("rollout-26", 0.5): (4972, "d2f89c9c6b6e639274d956c92cb54dc3c44109db4e62d69ec0cd43fe0a55659b"),
    ("rollout-26", 0.9): (8985, "4301007309d3ce3da81307401dfbb6fa1f20a65c857c9131befc01122e4cfc63"),
    ("rollout-26", 1.0): (10000, "3147e82943e54c7ee6f0051d7e224d2312e29f2a8b77a443a2fa0732a78781d2"),
}


def arms(experiment: str, weight: float) -> str:
    policy = StickyHashAssignment()
    return "".join("c" if policy.assign(u, experiment, weight) == "canary" else "s" for u in USERS)


def make_router(replicas: list[Replica], **policy) -> Router:
    return Router(RouterState(replicas), producer=None, metrics=CollectorRegistry(), token=None, **policy)


FLEET = (("s0", "stable"), ("s1", "stable"), ("c0", "canary"), ("c1", "canary"))


def fleet() -> list[Replica]:
    return [Replica(name, variant, "http://unused", "v0") for name, variant in FLEET]


@pytest.mark.parametrize(("experiment", "weight"), list(RECORDED))
def test_sticky_hash_assignment_is_the_router_s_assignment_before_the_split(experiment, weight):
    got = arms(experiment, weight)
    assert (got.count("c"), hashlib.sha256(got.encode()).hexdigest()) == RECORDED[experiment, weight]


@pytest.mark.parametrize("weight", [0.05, 0.5])
def test_the_router_by_default_assigns_as_before_the_split(weight):
    router = make_router(fleet())
    router.state.experiment, router.state.canary_weight = "rollout-25", weight
    got = "".join("c" if router.assign(u) == "canary" else "s" for u in USERS)
    assert (got.count("c"), hashlib.sha256(got.encode()).hexdigest()) == RECORDED["rollout-25", weight]


@pytest.mark.parametrize("weight", [0.01, 0.05, 0.25, 0.5, 0.9])
def test_canary_share_is_the_weight_within_a_binomial_bound(weight):
    n = len(USERS)
    for experiment in ("rollout-25", "rollout-26", "another"):
        canary = arms(experiment, weight).count("c")
        # a user's bucket is uniform on [0, 1): the canary count is Binomial(n, weight); 4 sd is 1 in 15,000
        assert abs(canary - n * weight) <= 4 * math.sqrt(n * weight * (1 - weight)), (experiment, canary)


def test_assignment_is_sticky_per_user_and_a_growing_share_only_adds_canary_users():
    policy = StickyHashAssignment()
    for user in USERS[:200]:
        assert len({policy.assign(user, "rollout-25", 0.3) for _ in range(5)}) == 1
    previous = set()
    for weight in WEIGHTS:
        canary = {u for u in USERS if policy.assign(u, "rollout-25", weight) == "canary"}
        assert previous <= canary, weight
        previous = canary
    # a new experiment reshuffles: about half of one half stays, not all of it
    first, second = arms("rollout-25", 0.5), arms("rollout-26", 0.5)
    kept = sum(a == b == "c" for a, b in zip(first, second, strict=True))
    assert 0.2 * len(USERS) < kept < 0.3 * len(USERS)


def test_weight_zero_puts_every_user_on_stable_and_weight_one_on_canary():
    assert set(arms("rollout-25", 0.0)) == {"s"}
    assert set(arms("rollout-25", 1.0)) == {"c"}


@dataclass
class FakeReplica:
    name: str
    variant: str
    inflight: int = 0
    healthy: bool = True
    drained: bool = False


def test_replica_choice_takes_the_least_busy_serving_replica_not_yet_tried():
    fleet = [
        FakeReplica("s-down", "stable", inflight=0, healthy=False),
        FakeReplica("s-drained", "stable", inflight=0, drained=True),
        FakeReplica("s-busy", "stable", inflight=5),
        FakeReplica("s-idle", "stable", inflight=1),
        FakeReplica("s-idle-too", "stable", inflight=1),
        FakeReplica("c-idle", "canary", inflight=0),
    ]
    choice = LeastInflight()
    assert choice.choose(fleet, "stable", set()).name == "s-idle"  # fewest in flight, first of a tie
    assert choice.choose(fleet, "stable", {"s-idle"}).name == "s-idle-too"
    assert choice.choose(fleet, "stable", {"s-idle", "s-idle-too"}).name == "s-busy"
    assert choice.choose(fleet, "stable", {"s-idle", "s-idle-too", "s-busy"}) is None
    assert choice.choose(fleet, "canary", set()).name == "c-idle"
    assert choice.choose(fleet, "canary", {"c-idle"}) is None
    assert choice.choose([], "stable", set()) is None


class EveryoneOnCanary(ArmAssignment):
    """A new assignment rule is one class."""

    def assign(self, user_hash: str, experiment: str, canary_weight: float) -> Variant:
        return "canary"


def test_the_router_asks_the_rule_it_is_given_while_a_canary_replica_serves():
    router = make_router(fleet(), assignment=EveryoneOnCanary())
    assert router.assign(USERS[0]) == "canary"  # at canary weight 0: the rule decides, not the router
    for r in router.state.replicas:
        r.healthy = r.variant == "stable"
    assert router.assign(USERS[0]) == "stable"  # no canary replica serves: nobody is on the canary


def forward(router: Router, variant: str, down: set[str]) -> tuple[list[str], str]:
    """`Router._forward` with engines answering by name (those in `down` fail): the replicas tried, in order,
    and the variant that answered (or the router's HTTP error when none did)."""
    tried: list[str] = []

    async def post(replica, path, body, stream):
        tried.append(replica.name)
        if replica.name in down:
            raise EngineFailure(f"{replica.name}: down")
        return "answer"

    router._post = post
    try:
        served, replica, _, _ = asyncio.run(router._forward(variant, "/v1/completions", {}, stream=False))
    except HTTPException as e:
        return tried, f"HTTP {e.status_code}"
    assert replica.name == tried[-1]
    return tried, served


def test_failover_tries_two_replicas_of_the_arm_then_stable_for_a_canary_request():
    router = make_router(fleet())
    router.state.replicas[0].inflight = 3  # s0 busy: the least busy stable replica is s1
    assert forward(router, "canary", set()) == (["c0"], "canary")
    assert forward(router, "canary", {"c0"}) == (["c0", "c1"], "canary")
    assert router.state.arm("canary").errors == 0
    assert forward(router, "canary", {"c0", "c1"}) == (["c0", "c1", "s1"], "stable")
    assert router.state.arm("canary").errors == 1
    assert forward(router, "stable", {"s1"}) == (["s1", "s0"], "stable")
    everyone = {name for name, _ in FLEET}
    assert forward(router, "canary", everyone) == (["c0", "c1", "s1", "s0"], "HTTP 502")
    assert (router.state.arm("canary").errors, router.state.arm("stable").errors) == (2, 1)
    assert [r.inflight for r in router.state.replicas] == [3, 0, 0, 0]  # every try gave its slot back


def test_a_request_in_flight_is_not_yet_a_success_of_its_arm():
    """The gate's error rate is errors / settled: a canary request still in flight is routed but neither an error
    nor a success. Counting it as a success (errors / routed) let a canary that fails every request pass step 0
    while its failures were in flight (CI: the demo gate's NaN canary, rolled back only at step 1)."""
    router = make_router(fleet())
    release = asyncio.Event()
    snapshots: list[tuple[int, int, int]] = []

    async def post(replica, path, body, stream):
        if replica.variant == "canary":
            await release.wait()
            raise EngineFailure(f"{replica.name}: non-finite logits")
        return "answer"

    async def run() -> str:
        router._post = post
        router.state.arm("canary").requests += 1  # as `handle` counts it on arrival
        request = asyncio.create_task(router._forward("canary", "/v1/completions", {}, stream=False))
        await asyncio.sleep(0)
        c = router.state.arm("canary")
        snapshots.append((c.requests, c.errors, c.settled))  # in flight: routed, not settled
        release.set()
        served, _, _, _ = await request
        return served

    assert asyncio.run(run()) == "stable"  # its user is served by stable
    c = router.state.arm("canary")
    assert snapshots == [(1, 0, 0)] and (c.requests, c.errors, c.settled) == (1, 1, 1)
    assert forward(router, "stable", set()) == (["s0"], "stable")
    assert (router.state.arm("stable").errors, router.state.arm("stable").settled) == (0, 1)
    assert forward(router, "canary", set()) == (["c0"], "canary")  # answered by its own arm: settled, no error
    assert (c.errors, c.settled) == (1, 2)
