"""Several router replicas share one split and their counters through the registry database (serving/shared.py;
issue 37, defect 4): the controller's POST reaches one pod, its state read another, and a pod may start or
die mid-rollout. Here Router objects over one registry database (SQLite, and a real PostgreSQL server as in a
cluster) stand for the pods."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dynrubric.registry import Registry
from serving.router import Replica, Router, RouterState, Weights
from serving.shared import SharedSplit
from tests.integration.test_registry import postgres  # noqa: F401  (the fixture)


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The registry database every router pod connects to."""
    if request.param == "sqlite":
        return str(tmp_path / "registry.sqlite")
    import psycopg

    base = request.getfixturevalue("postgres")
    name = f"router_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**9}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{base}/{name}"


def pod(db: str, name: str, tmp_path: Path) -> Router:
    replicas = [
        Replica("vllm-stable", "stable", "http://vllm-stable:8000", "v1"),
        Replica("vllm-canary", "canary", "http://vllm-canary:8000", "v1"),
    ]
    state = RouterState(replicas, desired={"stable": Weights("v1", "/m/v1"), "canary": Weights("v1", "/m/v1")})
    shared = SharedSplit(Registry(db, storage_dir=tmp_path / "weights"))  # each pod its own connection
    return Router(state, None, CollectorRegistry(), token=None, shared=shared, replica_id=name)


def control(router: Router, experiment: str, weight: float, canary: Weights | None = None) -> None:
    """What /control/traffic and /control/variants/canary/weights do to the replica the call reaches."""
    router.state.experiment, router.state.canary_weight = experiment, weight
    if canary is not None:
        router.state.desired["canary"] = canary
        router.state.replicas[1].policy_version = canary.version
    asyncio.run(router._publish())


def test_every_replica_serves_the_split_one_replica_was_told(db, tmp_path):
    a, b = pod(db, "router-a", tmp_path), pod(db, "router-b", tmp_path)
    control(a, "ro-v2", 0.25, Weights("v2", "/m/v2"))
    b.apply_shared()
    state = b.snapshot()
    assert (state["experiment"], state["canary_weight"]) == ("ro-v2", 0.25)
    assert state["desired"]["canary"] == {"version": "v2", "path": "/m/v2"}
    assert {r["name"]: r["policy_version"] for r in state["replicas"]} == {"vllm-stable": "v1", "vllm-canary": "v2"}
    # users get the same arm on both pods (assignment is a hash of the user and the experiment)
    assert all(a.assign(f"user-{i}") == b.assign(f"user-{i}") for i in range(200))
    control(b, "ro-v2", 0.5)  # the next step reaches the other pod
    a.apply_shared()
    assert a.state.canary_weight == 0.5
    # a pod started mid-rollout adopts the rollout's split before it serves
    c = pod(db, "router-c", tmp_path)
    c.apply_shared()
    assert (c.state.experiment, c.state.canary_weight, c.state.desired["canary"].version) == ("ro-v2", 0.5, "v2")


def test_the_state_reports_the_counters_of_every_replica(db, tmp_path):
    a, b = pod(db, "router-a", tmp_path), pod(db, "router-b", tmp_path)
    control(a, "ro-v2", 0.5)
    b.apply_shared()
    for router, n in ((a, 3), (b, 2)):
        router.state.arm("canary").requests += n
        router.state.arm("canary").settled += n
        router.state.arm("canary").errors += 1
    for router in (a, b, a):
        router.apply_shared()
    for router in (a, b):
        assert router.snapshot()["counters"]["ro-v2"]["canary"] == {"requests": 5, "errors": 2, "settled": 5}
    # a pod that dies keeps its last written counters: what it counted stays counted
    b.shared = None
    a.apply_shared()
    assert a.snapshot()["counters"]["ro-v2"]["canary"]["requests"] == 5


def test_router_pods_starting_together_create_the_shared_tables_once(request, tmp_path):
    """The router Deployment starts its replicas together on a fresh database: each creates the registry's, the
    split's and the counters' tables (`CREATE TABLE IF NOT EXISTS`), which PostgreSQL does not serialise: one of two
    pods died with `duplicate key value violates unique constraint "pg_type_typname_nsp_index"` (found by
    tests/e2e/test_k8s_processes.py). Here eight at once, each with its own connections."""
    import threading

    import psycopg

    base = request.getfixturevalue("postgres")
    errors: list[BaseException] = []
    for attempt in range(3):
        name = f"race_{os.getpid()}_{attempt}"
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        barrier = threading.Barrier(8)

        def start(i: int, db: str = f"{base}/{name}", barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                SharedSplit(Registry(db, storage_dir=tmp_path / f"weights-{i}")).read()
            except BaseException as e:  # collected: the test names them
                errors.append(e)

        threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors


def test_a_replica_checks_the_pods_another_restarted_before_it_routes_to_them(tmp_path):
    """weights_via restart: the controller's weights call reaches replica A, which finds the stable Service's pods
    restarted onto v2 and publishes the split. Replica B knew the old pod, now gone; adopting the split alone, it
    routed stable users to that pod until its next health check, and to none once it saw the old one down: 502
    "no engine of variant stable could answer: none healthy" after every promotion (tests/e2e/
    test_k8s_processes.py). B finds the pods and checks them against the published weights before it adopts."""
    import httpx

    db = str(tmp_path / "registry.sqlite")
    pods = {"vllm-stable": ["10.0.0.1"]}  # what the headless Service resolves to

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.1":  # the old pod: gone
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "policy", "root": "/m/v2"}]})
        return httpx.Response(200)

    def router(name: str) -> Router:
        weights = Weights("v1", "/m/v1")
        state = RouterState([], desired={"stable": weights, "canary": weights})
        shared = SharedSplit(Registry(db, storage_dir=tmp_path / "weights"))
        return Router(
            state,
            None,
            CollectorRegistry(),
            token=None,
            shared=shared,
            replica_id=name,
            weights_via="restart",
            discover=[("vllm-stable", "stable", "http://vllm-stable:8000")],
            resolve=lambda host, port: pods[host],
        )

    a, b = router("router-a"), router("router-b")
    b._pods({"vllm-stable": ["10.0.0.1"]})
    b.state.replicas[0].healthy = True  # it served v1 until the restart
    b.apply_shared()
    pods["vllm-stable"] = ["10.0.0.2"]  # the Deployment rolled: a new pod on v2, the old one gone
    a.state.desired["stable"] = Weights("v2", "/m/v2")
    asyncio.run(a._publish())

    async def sync() -> None:
        b._client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        try:
            await b.sync_shared()
        finally:
            await b._client.aclose()

    asyncio.run(sync())
    assert b.state.desired["stable"] == Weights("v2", "/m/v2")
    assert [(r.name, r.policy_version) for r in b.state.serving("stable")] == [("vllm-stable/10.0.0.2", "v2")]


def test_a_router_whose_stable_pods_restart_during_a_promotion_stays_ready(tmp_path):
    """A promotion with weights_via restart: everyone on the canary, the stable pods restarted onto the new version
    serve other weights than the router's stable ones (stale) until the controller's weights call, which reaches the
    router through its Service. /readyz said 503 meanwhile, on every replica: the Service had no pod, the call could
    not arrive, and the promotion failed after rollout.restart_wait_s (tests/e2e/test_k8s_processes.py)."""
    from fastapi.testclient import TestClient

    replicas = [
        Replica("vllm-stable/10.0.0.2", "stable", "http://10.0.0.2:8000", "v1", stale=True),
        Replica("vllm-canary/10.0.0.3", "canary", "http://10.0.0.3:8000", "v2"),
    ]
    state = RouterState(replicas, desired={"stable": Weights("v1", "/m/v1"), "canary": Weights("v2", "/m/v2")})
    router = Router(state, None, CollectorRegistry(), token=None, weights_via="restart")
    probe = TestClient(router.app)  # no lifespan: no health loop
    state.experiment, state.canary_weight = "ro-v2", 1.0
    assert probe.get("/readyz").status_code == 200
    state.canary_weight = 0.5  # stable users would find no engine: not ready
    assert probe.get("/readyz").status_code == 503
    replicas[0].stale = False
    assert probe.get("/readyz").status_code == 200


def test_a_replica_adopts_the_split_it_checked_not_a_newer_one(tmp_path):
    """weights_via restart, a promotion: everyone on the canary (v2), B's stable pod restarted onto v2 and stale to
    B (checked against v1). A publishes stable v2, then the canary share 0. B read the split, found no weights moved,
    and read it again to adopt it: the second read returned A's newer split, adopted unchecked, and B sent every user
    to a stable pod it still held stale: 502 "none healthy" until its next health check (CI of stop 42,
    tests/e2e/test_k8s_processes.py). B adopts the split it read and checked, and the newer one at its next sync."""
    import httpx

    db = str(tmp_path / "registry.sqlite")

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":  # the restarted stable pod serves v2
            return httpx.Response(200, json={"data": [{"id": "policy", "root": "/m/v2"}]})
        return httpx.Response(200)

    def router(name: str) -> Router:
        state = RouterState([], desired={"stable": Weights("v1", "/m/v1"), "canary": Weights("v2", "/m/v2")})
        return Router(
            state,
            None,
            CollectorRegistry(),
            token=None,
            shared=SharedSplit(Registry(db, storage_dir=tmp_path / "weights")),
            replica_id=name,
            weights_via="restart",
            discover=[("vllm-stable", "stable", "http://vllm-stable:8000")],
            resolve=lambda host, port: ["10.0.0.2"],
        )

    a, b = router("router-a"), router("router-b")
    a.state.experiment, a.state.canary_weight = "ro-v2", 1.0  # the promotion's first call: the canary carries all
    asyncio.run(a._publish())
    b.apply_shared()
    b._pods({"vllm-stable": ["10.0.0.2"]})
    [pod] = b.state.replicas
    pod.healthy, pod.stale = True, True  # up, and found serving v2 while B's stable is v1
    read_before_a_published = b.shared.read()
    a.state.desired["stable"] = Weights("v2", "/m/v2")  # A's weights call found the stable pods on v2
    asyncio.run(a._publish())
    a.state.canary_weight = 0.0  # and the controller moves everyone back to stable
    asyncio.run(a._publish())
    real_read = b.shared.read
    reads = iter([read_before_a_published])
    b.shared.read = lambda: next(reads, None) or real_read()  # B's first read came before A's two writes

    async def sync() -> None:
        b._client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        try:
            await b.sync_shared()
            # every user of B has an engine: the canary's, or a stable pod it may route to
            assert b.state.canary_weight == 1.0 or b.state.serving("stable"), b.snapshot()
            await b.sync_shared()
        finally:
            await b._client.aclose()

    asyncio.run(sync())
    assert (b.state.canary_weight, b.state.desired["stable"]) == (0.0, Weights("v2", "/m/v2"))
    assert [(r.name, r.policy_version) for r in b.state.serving("stable")] == [("vllm-stable/10.0.0.2", "v2")]


def test_a_pod_found_during_a_weights_call_is_checked_against_the_weights_the_call_set(tmp_path):
    """weights_via restart, a promotion on the replica the controller's calls reach: its health check found the
    restarted stable pod (new to it, so checked for weights) while the controller's weights call for v2 was checking
    the same pod. The health check had read the weights to check before the call moved them (v1), waited for the
    call, then found the pod on v2 and held it stale: with everyone moved back to stable next, 502 "none healthy"
    until the health check after. It reads the weights under the call's lock, and checks the pod against v2."""
    import httpx

    health_asked, health_answer = asyncio.Event(), asyncio.Event()
    models_asked, models_answer = asyncio.Event(), asyncio.Event()

    async def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            health_asked.set()
            await health_answer.wait()
            return httpx.Response(200)
        if request.url.path == "/v1/models" and not models_answer.is_set():  # the weights call's check, held
            models_asked.set()
            await models_answer.wait()
        return httpx.Response(200, json={"data": [{"id": "policy", "root": "/m/v2"}]})

    state = RouterState([], desired={"stable": Weights("v1", "/m/v1"), "canary": Weights("v2", "/m/v2")})
    router = Router(
        state,
        None,
        CollectorRegistry(),
        token=None,
        weights_via="restart",
        discover=[("vllm-stable", "stable", "http://vllm-stable:8000")],
        resolve=lambda host, port: ["10.0.0.2"],  # the stable pod restarted onto v2 (the old one gone)
    )

    async def promotion() -> None:
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        try:
            health = asyncio.create_task(router.check_replicas())  # finds the pod, asks its /health
            await health_asked.wait()
            async with router._control:  # the controller's weights call, as /control/variants/stable/weights
                call = asyncio.create_task(router.load_variant("stable", Weights("v2", "/m/v2")))
                await models_asked.wait()
                health_answer.set()  # the health check goes on while the call checks the pod
                await asyncio.sleep(0.05)
                models_answer.set()
                await call
            await health
        finally:
            await router._client.aclose()

    asyncio.run(promotion())
    assert state.desired["stable"] == Weights("v2", "/m/v2")
    assert [(r.name, r.policy_version) for r in state.serving("stable")] == [("vllm-stable/10.0.0.2", "v2")]
