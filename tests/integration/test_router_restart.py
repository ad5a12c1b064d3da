"""New weights without vLLM's dev mode (issue 37, defect 3): `serving.weights_via: restart` and pods found
behind a headless Service (`serving.engines[].pods`).

On a cluster no engine serves `/collective_rpc`; the pods are restarted onto the version's weights (Argo's
new pods, or a patched Deployment) and the router checks that every pod serves them (`/v1/models` root),
reaching each pod, not one at random behind a Service. Engines here are an httpx mock transport: what is
tested is the router's side of it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import HTTPException
from prometheus_client import CollectorRegistry

from dynrubric.config import GateConfig, RolloutConfig
from dynrubric.errors import DynrubricError
from serving.rollout import Controller
from serving.router import Replica, Router, RouterState, Weights


class Pods:
    """Engines by address: the --model each serves; which were asked to reload through /collective_rpc."""

    def __init__(self, roots: dict[str, str]):
        self.roots = roots
        self.rpc: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "policy", "root": self.roots[host]}]})
        if request.url.path == "/health":
            return httpx.Response(200, json={})
        self.rpc.append(host)  # a cluster's vLLM has no /collective_rpc
        return httpx.Response(404, json={"detail": "Not Found"})


def router(pods: Pods, **kw: Any) -> Router:
    replicas = [Replica("vllm-canary", "canary", "http://vllm-canary:8000", "v1")]
    state = RouterState(replicas, desired={"stable": Weights("v1", "/m/v1"), "canary": Weights("v1", "/m/v1")})
    r = Router(state, None, CollectorRegistry(), token=None, weights_via="restart", **kw)
    r._client = httpx.AsyncClient(transport=httpx.MockTransport(pods.handle))
    return r


def discovering(pods: Pods) -> Router:
    return router(
        pods,
        discover=[("vllm-canary", "canary", "http://vllm-canary:8000")],
        resolve=lambda host, port: sorted(pods.roots) if host == "vllm-canary" and port == 8000 else [],
    )


def test_the_pods_behind_a_headless_service_are_the_replicas():
    pods = Pods({"10.0.0.1": "/m/v1", "10.0.0.2": "/m/v1"})
    r = discovering(pods)
    r._pods(r._resolve_all())
    assert {x.name: x.base_url for x in r.state.replicas} == {
        "vllm-canary/10.0.0.1": "http://10.0.0.1:8000",
        "vllm-canary/10.0.0.2": "http://10.0.0.2:8000",
    }
    assert not any(x.healthy for x in r.state.replicas)  # the health check that finds them up admits them
    pods.roots = {"10.0.0.2": "/m/v1", "10.0.0.3": "/m/v1"}  # a pod went, another came
    r._pods(r._resolve_all())
    assert sorted(x.name for x in r.state.replicas) == ["vllm-canary/10.0.0.2", "vllm-canary/10.0.0.3"]


def test_a_variant_takes_a_version_only_when_every_pod_serves_it():
    pods = Pods({"10.0.0.1": "/m/v2", "10.0.0.2": "/m/v1"})  # a rolling restart half way
    r = discovering(pods)
    r._pods(r._resolve_all())
    with pytest.raises(HTTPException) as refused:
        asyncio.run(r.load_variant("canary", Weights("v2", "/m/v2")))
    assert "vllm-canary/10.0.0.2 serves /m/v1, not /m/v2" in str(refused.value.detail)
    assert r.state.desired["canary"].version == "v1"
    pods.roots["10.0.0.2"] = "/m/v2/"
    assert asyncio.run(r.load_variant("canary", Weights("v2", "/m/v2"))) == []
    assert r.state.desired["canary"].version == "v2"
    assert {x.policy_version for x in r.state.replicas} == {"v2"}
    assert pods.rpc == []  # never a dev-mode call


def test_a_pod_serving_other_weights_is_up_but_takes_no_traffic_until_they_match():
    """The operator restarted the canary onto v2 before the rollout: its pods are up (the controller may start)
    but stale, with no users, until the rollout's loading makes v2 the canary's weights."""
    pods = Pods({"10.0.0.1": "/m/v2"})
    r = discovering(pods)
    r._pods(r._resolve_all())
    [pod] = r.state.replicas
    pod.healthy = True
    with pytest.raises(HTTPException):
        asyncio.run(r.load_variant("canary", Weights("v1", "/m/v1")))  # the canary's desired weights: not served
    assert pod.stale and pod.healthy and r.state.serving("canary") == [] and r.assign("user") == "stable"
    assert r.snapshot()["replicas"][0]["stale"] is True
    asyncio.run(r.load_variant("canary", Weights("v2", "/m/v2")))
    assert not pod.stale and r.state.serving("canary") == [pod]
    # a rollback to weights the pods do not serve marks them stale, not down
    assert asyncio.run(r.load_variant("canary", Weights("v1", "/m/v1"), best_effort=True))
    assert pod.stale and pod.healthy and r.state.serving("canary") == []


class Waiting:
    """The router's weights call refused until the pods were restarted (the third call)."""

    def __init__(self) -> None:
        self.calls = 0

    def load(self, variant: str, version: str, path: str, best_effort: bool = False) -> dict[str, Any]:
        self.calls += 1
        if self.calls < 3:
            raise DynrubricError("router refused: vllm-canary/10.0.0.1 serves /m/v1, not /m/v2", "wait")
        return {"failed": []}


def test_the_controller_waits_for_the_restart_within_restart_wait_s():
    live: list[str] = []
    cfg = RolloutConfig(restart_wait_s=60, poll_interval_s=0.01)
    waiting = Waiting()
    c = Controller(None, None, waiting, None, cfg, GateConfig(), progress=live.append)  # type: ignore[arg-type]
    c.sleep = lambda _: None
    c._load("canary", "v2", "/m/v2")
    assert waiting.calls == 3 and "waiting for the canary engines to serve v2" in live[0]
    impatient = Controller(None, None, Waiting(), None, RolloutConfig(), GateConfig())  # type: ignore[arg-type]
    with pytest.raises(DynrubricError, match="serves /m/v1, not /m/v2"):
        impatient._load("canary", "v2", "/m/v2")  # restart_wait_s 0 (rpc): the first refusal is final


class ApiServer:
    """The Kubernetes API's Deployments endpoint as the rollout Job's service account sees it."""

    def __init__(self, deployments: dict[str, list[str]], status: int = 200):
        self.deployments = deployments
        self.status = status
        self.patches: list[tuple[str, str, dict]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        import json

        name = request.url.path.rsplit("/", 1)[1]
        assert request.url.path == f"/apis/apps/v1/namespaces/dynrubric/deployments/{name}"
        assert request.headers["authorization"] == "Bearer sa-token"
        if self.status != 200:
            return httpx.Response(self.status, text="deployments.apps is forbidden")
        if name not in self.deployments:
            return httpx.Response(404, json={"reason": "NotFound"})
        if request.method == "GET":
            containers = [{"name": "vllm", "args": self.deployments[name]}]
            return httpx.Response(200, json={"spec": {"template": {"spec": {"containers": containers}}}})
        body = json.loads(request.content)
        self.patches.append((name, request.headers["content-type"], body))
        self.deployments[name] = body["spec"]["template"]["spec"]["containers"][0]["args"]
        return httpx.Response(200, json={})


def restarter(api: ApiServer):
    from serving.kube import DeploymentRestarter

    return DeploymentRestarter("https://api", "dynrubric", "sa-token", transport=httpx.MockTransport(api.handle))


def test_the_controller_restarts_the_variants_deployment_onto_the_weights():
    api = ApiServer({"vllm-canary": ["--model", "/m/v1", "--port", "8000"]})
    lines: list[str] = []
    waiting = Waiting()
    cfg = RolloutConfig(restart_wait_s=60, poll_interval_s=0.01)
    kube = restarter(api)
    log = lines.append
    c = Controller(None, None, waiting, None, cfg, GateConfig(), log=log, restarter=kube)  # type: ignore[arg-type]
    c.sleep = lambda _: None
    c._load("canary", "v2", "/m/v2")
    [(name, kind, patch)] = api.patches
    assert (name, kind) == ("vllm-canary", "application/strategic-merge-patch+json")
    assert patch["spec"]["template"]["spec"]["containers"] == [
        {"name": "vllm", "args": ["--model", "/m/v2", "--port", "8000"]}
    ]
    assert lines == ["canary: restarting vllm-canary onto /m/v2"] and waiting.calls == 3
    assert "already runs /m/v2" in restarter(api).set_model("vllm-canary", "/m/v2") and len(api.patches) == 1


def test_a_deployment_that_is_not_there_is_not_restarted_and_a_refusal_names_the_rbac():
    assert "not restarted" in restarter(ApiServer({})).set_model("vllm-canary", "/m/v2")  # prod-argo: Argo's pods
    with pytest.raises(DynrubricError, match="HTTP 403") as refused:
        restarter(ApiServer({}, status=403)).set_model("vllm-canary", "/m/v2")
    assert "rbac.yaml" in refused.value.fix
