"""Validate rendered manifests offline: schemas first, then the references between objects.

Schemas
- built-in kinds: `kubernetes-validate --strict` (its bundled Kubernetes schemas; unknown fields fail);
- custom resources (RayJob, Kafka, KafkaNodePool, KafkaTopic, Rollout, AnalysisTemplate, ServiceMonitor,
  PrometheusRule): the operators' CRD openAPIV3Schema vendored in k8s/crd-schemas/ (see
  tools/vendor_crd_schemas.py), made strict the way the API server prunes: an object schema with
  `properties` rejects other keys unless it says x-kubernetes-preserve-unknown-fields. Pod templates
  embedded in custom resources are validated again as core/v1 PodTemplates.
- a kind with no schema is an error, never a silent skip.

References (what a schema cannot see): Services select some pod template; ServiceMonitors select a
Service that has the named port; ConfigMaps, PVCs, HPA targets, Argo templates and Services, the
reward URL the RayJob's round calls (train.openrlhf.reward_url of the settings ConfigMap) exist;
KafkaTopics name an existing Kafka; no Secret is inlined: no Secret objects, secret-like env vars
come from secretKeyRef to the documented Secret and keys.

Least reach: every Deployment, Rollout and other long-running workload is selected by an ingress
NetworkPolicy, and the in-namespace peers the policies admit are pods that exist.

What a real cluster would refuse or break on (issue 37), each a function below:
- `apply_problems`: no object that `kubectl apply` refuses (generateName without a name);
- `namespace_problems`: every namespaced object has a namespace (a file applied beside an overlay takes
  the overlay's, as `kubectl -n NS apply -f FILE` gives it);
- `cross_namespace_problems`: a URL called from another namespace (Argo's analysis runs in the Argo
  Rollouts controller's) names its Service fully qualified, in the object's own namespace;
- `split_problems`: one controller owns the traffic split: a canary Rollout without trafficRouting
  scales replicas by weight while the router splits by its own weights;
- `mount_problems`: every path a dynrubric container's settings use lies under one of its mounts
  (writable where the command writes);
- `state_problems`: no in-memory state behind an autoscaled Deployment: the commands that keep state in
  one process (STATEFUL_COMMANDS) are not behind an HPA or more than one replica.

    python k8s/tools/validate.py k8s/overlays/prod k8s/jobs/rollout-start.yaml
"""

from __future__ import annotations

import copy
import json
import re
import sys
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render  # noqa: E402
import yaml  # noqa: E402

try:
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError
except ImportError as e:
    sys.exit(f"error: {e.name} is not installed: {render.INSTALL_FIX}")

# kubernetes-validate re-reads its (multi-MB) definitions file on every call; read each file once.
kubernetes_validate.utils.schema_contents = cache(kubernetes_validate.utils.schema_contents)

K8S_VERSION = "1.30"
CRD_SCHEMAS = Path(__file__).resolve().parents[1] / "crd-schemas"
SECRET_NAME = "dynrubric-secrets"
CONFIG_MAP = "dynrubric-config"  # the settings every dynrubric pod reads (base/config/dynrubric.yaml)
SECRET_KEYS = {"serving-token", "reward-token", "registry-url", "vllm-api-key"}  # k8s/README.md lists them
SECRETISH = re.compile(r"TOKEN|PASSWORD|SECRET|API_KEY|CREDENTIAL|REGISTRY__URL", re.I)
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "Rollout", "ReplicaSet"}
SERVING_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Rollout", "ReplicaSet"}  # long-running: reachable
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _strict(schema):
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_validator(api_version: str, kind: str):
    group, _, version = api_version.rpartition("/")
    path = CRD_SCHEMAS / f"{group}_{version}_{kind}.json"
    if not path.is_file():
        return None
    return jsonschema.Draft7Validator(_strict(json.loads(path.read_text())))


def _name(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name') or obj.get('metadata', {}).get('generateName')}"


def _pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(where, PodTemplateSpec) of a custom resource's embedded pods."""
    spec = obj.get("spec", {})
    if obj["kind"] == "Rollout" and "template" in spec:
        return [("spec.template", spec["template"])]
    if obj["kind"] == "RayJob":
        ray = spec.get("rayClusterSpec", {})
        out = [("rayClusterSpec.headGroupSpec.template", ray.get("headGroupSpec", {}).get("template", {}))]
        out += [
            (f"rayClusterSpec.workerGroupSpecs[{g.get('groupName')}].template", g.get("template", {}))
            for g in ray.get("workerGroupSpecs", [])
        ]
        return out
    return []


def schema_problems(obj: dict) -> list[str]:
    where = _name(obj)
    if not isinstance(obj.get("apiVersion"), str) or not isinstance(obj.get("kind"), str):
        return [f"{where}: apiVersion and kind are required"]
    meta = obj.get("metadata", {})
    name = meta.get("name") or meta.get("generateName", "x")
    problems = [] if DNS_SUBDOMAIN.match(name.rstrip("-")) else [f"{where}: invalid metadata.name {name!r}"]
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return problems
    except kubernetes_validate.ValidationError as e:
        return problems + [f"{where}: {'.'.join(map(str, e.path))}: {e.message}"]
    except SchemaNotFoundError:
        pass
    validator = crd_validator(obj["apiVersion"], obj["kind"])
    if validator is None:
        return problems + [
            f"{where}: no schema for {obj['apiVersion']} {obj['kind']} (vendor its CRD into k8s/crd-schemas/)"
        ]
    for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path))):
        problems.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
    extra_meta = set(meta) - {"name", "namespace", "labels", "annotations", "generateName"}
    if extra_meta:
        problems.append(f"{where}: metadata: unexpected fields {sorted(extra_meta)}")
    for path, template in _pod_templates(obj):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "embedded"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where}: {path}.{'.'.join(map(str, list(e.path)[1:]))}: {e.message}")
    return problems


def _pod_specs(obj: dict) -> list[dict]:
    if obj["kind"] in WORKLOAD_KINDS:
        return [obj.get("spec", {}).get("template", {}).get("spec", {})]
    return [t.get("spec", {}) for _, t in _pod_templates(obj)]


def _pod_labels(objs: list[dict]) -> list[dict]:
    out = []
    for o in objs:
        if o["kind"] in WORKLOAD_KINDS:
            out.append(o.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}))
    return out


def _selects(selector: dict, labels: dict) -> bool:
    if not selector:
        return False
    if all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        for expr in selector.get("matchExpressions", []):
            if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
                return False
            if expr["operator"] == "Exists" and expr["key"] not in labels:
                return False
        return True
    return False


def network_problems(objs: list[dict]) -> list[str]:
    """Least reach: every long-running workload's pods are selected by an ingress NetworkPolicy, and every
    in-namespace peer a policy admits is some pod template (a typo there silently blocks the caller)."""
    policies = [
        o for o in objs if o["kind"] == "NetworkPolicy" and "Ingress" in o["spec"].get("policyTypes", ["Ingress"])
    ]
    pods = _pod_labels(objs) + [
        t.get("metadata", {}).get("labels", {})
        for o in objs
        for _, t in _pod_templates(o)
        if o["kind"] not in WORKLOAD_KINDS
    ]
    problems = []
    for o in objs:
        if o["kind"] in SERVING_KINDS:
            labels = o.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
            if not any(p["spec"]["podSelector"] == {} or _selects(p["spec"]["podSelector"], labels) for p in policies):
                problems.append(
                    f"{_name(o)}: no NetworkPolicy selects its pods, so any pod may call it "
                    "(add one to k8s/base/network/policies.yaml)"
                )
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if (
                    "podSelector" in peer
                    and "namespaceSelector" not in peer
                    and not any(_selects(peer["podSelector"], labels) for labels in pods)
                ):
                    problems.append(f"{_name(p)}: ingress peer {peer['podSelector']} matches no pod template")
    return problems


def reference_problems(objs: list[dict]) -> list[str]:
    problems = []
    by_kind: dict[str, dict[str, dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], {})[o["metadata"].get("name", "")] = o
    names = lambda kind: set(by_kind.get(kind, {}))  # noqa: E731
    pods = _pod_labels(objs)

    for o in objs:
        where = _name(o)
        if o["kind"] == "Secret":
            problems.append(f"{where}: Secrets are never inlined in manifests; reference {SECRET_NAME} (k8s/README.md)")
        for pod in _pod_specs(o):
            account = pod.get("serviceAccountName")
            if account and account not in names("ServiceAccount"):
                problems.append(f"{where}: serviceAccountName {account} does not exist")
            for v in pod.get("volumes", []):
                if "configMap" in v and v["configMap"]["name"] not in names("ConfigMap"):
                    problems.append(f"{where}: volume {v['name']} uses missing ConfigMap {v['configMap']['name']}")
                pvc = v.get("persistentVolumeClaim", {}).get("claimName")
                if pvc and pvc not in names("PersistentVolumeClaim"):
                    problems.append(f"{where}: volume {v['name']} uses missing PersistentVolumeClaim {pvc}")
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                missing = mounts - {v["name"] for v in pod.get("volumes", [])}
                if missing:
                    problems.append(f"{where}: container {c['name']} mounts undefined volumes {sorted(missing)}")
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref and (ref.get("name") != SECRET_NAME or ref.get("key") not in SECRET_KEYS):
                        problems.append(
                            f"{where}: env {env['name']} refers to secret {ref.get('name')}/{ref.get('key')}, "
                            f"not one of {SECRET_NAME}/{sorted(SECRET_KEYS)}"
                        )
                    if SECRETISH.search(env["name"]) and "value" in env:
                        problems.append(f"{where}: env {env['name']} inlines a secret value; use secretKeyRef")
        if o["kind"] == "Service":
            selector = o.get("spec", {}).get("selector", {})
            if not any(_selects({"matchLabels": selector}, p) for p in pods):
                problems.append(f"{where}: selector {selector} matches no pod template")
        if o["kind"] == "ServiceMonitor":
            sel = o["spec"].get("selector", {})
            services = [
                s for s in by_kind.get("Service", {}).values() if _selects(sel, s["metadata"].get("labels", {}))
            ]
            if not services:
                problems.append(f"{where}: selector matches no Service")
            for ep in o["spec"].get("endpoints", []):
                for s in services:
                    if ep.get("port") not in {p.get("name") for p in s["spec"].get("ports", [])}:
                        problems.append(f"{where}: Service {s['metadata']['name']} has no port named {ep.get('port')}")
        if o["kind"] == "HorizontalPodAutoscaler":
            ref = o["spec"]["scaleTargetRef"]
            if ref["name"] not in names(ref["kind"]):
                problems.append(f"{where}: scaleTargetRef {ref['kind']}/{ref['name']} does not exist")
        if o["kind"] in {"KafkaTopic", "KafkaNodePool"}:
            cluster = o["metadata"].get("labels", {}).get("strimzi.io/cluster")
            if cluster not in names("Kafka"):
                problems.append(f"{where}: label strimzi.io/cluster={cluster} names no Kafka")
        if o["kind"] == "Rollout":
            strategy = o["spec"].get("strategy", {})
            canary, blue_green = strategy.get("canary", {}), strategy.get("blueGreen", {})
            for spec, key in [(canary, "canaryService"), (canary, "stableService")] + [
                (blue_green, "activeService"),
                (blue_green, "previewService"),
            ]:
                if spec.get(key) and spec[key] not in names("Service"):
                    problems.append(f"{where}: {key} {spec[key]} does not exist")
            analyses = [step.get("analysis", {}) for step in canary.get("steps", [])] + [
                blue_green.get(k, {}) for k in ("prePromotionAnalysis", "postPromotionAnalysis")
            ]
            for analysis in analyses:
                for t in analysis.get("templates", []):
                    if t["templateName"] not in names("AnalysisTemplate"):
                        problems.append(f"{where}: analysis template {t['templateName']} does not exist")
        if o["kind"] == "RayJob":
            m = re.match(r"http://([a-z0-9-]+):(\d+)/", _reward_url(by_kind.get("ConfigMap", {})))
            svc = by_kind.get("Service", {}).get(m.group(1)) if m else None
            if not m or svc is None or int(m.group(2)) not in {p["port"] for p in svc["spec"]["ports"]}:
                problems.append(
                    f"{where}: train.openrlhf.reward_url in ConfigMap {CONFIG_MAP} (the job's "
                    "--reward.remote_url) must point at an existing Service and port"
                )
    return problems


def _reward_url(config_maps: dict[str, dict]) -> str:
    """train.openrlhf.reward_url of the settings ConfigMap: the URL the RayJob's train_ppo_ray calls."""
    text = config_maps.get(CONFIG_MAP, {}).get("data", {}).get("dynrubric.yaml", "")
    settings = yaml.safe_load(text) or {}
    return str(settings.get("train", {}).get("openrlhf", {}).get("reward_url", ""))


# ---------------------------------------------------------------- what a real cluster refuses or breaks on
# kinds that have no namespace (the rest of the kinds rendered here are namespaced)
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "IngressClass",
}
CLUSTER_DOMAIN = "svc.cluster.local"


def apply_problems(objs: list[dict]) -> list[str]:
    """`kubectl apply` needs a name to find the live object: it refuses generateName ("resource name may not be
    empty"); only `kubectl create` accepts it."""
    problems = []
    for o in objs:
        meta = o.get("metadata", {})
        if not meta.get("name"):
            what = "generateName without a name" if meta.get("generateName") else "no metadata.name"
            problems.append(f"{_name(o)}: {what}: `kubectl apply` refuses it (set metadata.name)")
    return problems


def namespace_problems(objs: list[dict]) -> list[str]:
    """Every namespaced object has a namespace: without one `kubectl apply` puts it in the caller's current
    namespace, apart from the Services, ConfigMaps and Secret it refers to."""
    return [
        f"{_name(o)}: no metadata.namespace: it lands in whatever namespace kubectl points at "
        "(set `namespace:` in the overlay's kustomization.yaml)"
        for o in objs
        if o["kind"] not in CLUSTER_SCOPED and not o.get("metadata", {}).get("namespace")
    ]


def _urls(value) -> list[str]:
    if isinstance(value, dict):
        return [u for v in value.values() for u in _urls(v)]
    if isinstance(value, list):
        return [u for v in value for u in _urls(v)]
    return re.findall(r"https?://[^\s\"'{}/]+", value) if isinstance(value, str) else []


def cross_namespace_problems(objs: list[dict]) -> list[str]:
    """A URL that another namespace's controller calls names its Service as SERVICE.NAMESPACE.svc.cluster.local:
    Argo Rollouts runs an AnalysisTemplate's web metric from its own namespace, where a short name resolves
    to nothing (or to another namespace's Service of that name)."""
    services = {(o["metadata"].get("namespace"), o["metadata"].get("name")) for o in objs if o["kind"] == "Service"}
    problems = []
    for o in objs:
        if o["kind"] not in {"AnalysisTemplate", "ClusterAnalysisTemplate"}:
            continue
        ns = o["metadata"].get("namespace")
        for url in _urls(o.get("spec", {})):
            host = url.split("://", 1)[1].split(":")[0]
            parts = host.split(".")
            if len(parts) == 1:
                problems.append(
                    f"{_name(o)}: {url} is a short name, resolved in the Argo Rollouts controller's namespace: "
                    f"write {host}.{ns}.{CLUSTER_DOMAIN}"
                )
            elif host.endswith(f".{CLUSTER_DOMAIN}") or host.endswith(".svc") or len(parts) == 2:
                service, namespace = parts[0], parts[1]
                if (namespace, service) not in services:
                    problems.append(f"{_name(o)}: {url} names Service {service} in namespace {namespace}: none there")
    return problems


def split_problems(objs: list[dict]) -> list[str]:
    """One controller of the traffic split. The router splits users between vllm-stable and vllm-canary by its
    own weights; a canary Rollout without trafficRouting turns each setWeight into replica counts behind
    those Services, a second split nobody reconciles with the router's."""
    problems = []
    for o in objs:
        canary = o["spec"].get("strategy", {}).get("canary") if o["kind"] == "Rollout" else None
        if canary and "trafficRouting" not in canary and any("setWeight" in s for s in canary.get("steps", [])):
            problems.append(
                f"{_name(o)}: canary setWeight without trafficRouting: Argo splits by replica counts while the "
                "router splits by its own weights (two controllers of one split; docs/ARCHITECTURE.md)"
            )
    return problems


# the dynrubric commands (the image's entrypoint is `dynrubric`) and the settings paths each uses: "registry"
# is the registry's SQLite file (without registry.url) and its weights (registry.storage_dir); `True`: written
# (for "registry": the weights are written, as `registry register` does; the database always is)
RUNTIME_PATHS: dict[str, list[tuple[str, bool]]] = {
    "registry": [("registry", True)],  # k8s/jobs/registry-register.yaml
    "serve-router": [("registry", False), ("models.policy", False)],
    "serve-reward": [("models.generator", False), ("models.verifier", False)],
    "ingest": [("paths.state_dir", True)],
    "rollout": [("registry", False), ("paths.state_dir", True)],
}
# commands whose state lives in the process's memory: they must run as one replica (docs/ARCHITECTURE.md)
STATEFUL_COMMANDS = {
    "serve-reward": "a group's requests meet in one process (the reward barrier)",
    "serve-router": "the experiment, the arm weights and the gate's counters "
    "(unless serving.shared_state with a PostgreSQL registry.url: then every replica reads them there)",
}


def _in_memory_state(command: str | None, settings) -> str | None:
    """Why `command` keeps state in its process's memory, or None."""
    if command == "serve-router" and settings.serving.shared_state and settings.registry.url is not None:
        return None  # the split and the counters are in the registry's database (serving/shared.py)
    return STATEFUL_COMMANDS.get(command or "")


# a placeholder for a secretKeyRef's value: the settings only need to know it is set
SECRET_PLACEHOLDERS = {"registry-url": "postgresql://secret@registry/dynrubric"}


def _settings(container: dict, config_maps: dict[str, dict]):
    """The settings a dynrubric container runs with: the settings ConfigMap plus its env (secrets as placeholders)."""
    from dynrubric.config_loader import load_settings

    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            env[e["name"]] = SECRET_PLACEHOLDERS.get(ref.get("key"), "secret")
    env.pop("DYNRUBRIC_CONFIG", None)
    text = config_maps.get(CONFIG_MAP, {}).get("data", {}).get("dynrubric.yaml", "")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dynrubric.yaml"
        path.write_text(text)
        return load_settings(path, environ=env)


def _used_paths(command: str, settings) -> list[tuple[str, Path, bool]]:
    out = []
    for key, written in RUNTIME_PATHS.get(command, []):
        if key == "registry":
            cfg = settings.registry
            if cfg.url is None:
                db = Path(cfg.path) if cfg.path else settings.paths.state_dir / "registry" / "registry.sqlite"
                out.append(("registry.path (SQLite; no registry.url)", db.parent, True))
                out.append(("registry.storage_dir", Path(cfg.storage_dir or db.parent / "checkpoints"), written))
            elif cfg.storage_dir is not None:  # without one the registry refuses to open (reference_problems)
                out.append(("registry.storage_dir", Path(cfg.storage_dir), written))
            continue
        section, name = key.split(".")
        value = getattr(getattr(settings, section), name)
        if str(value).startswith("/"):  # a model name from the cache is not a path
            out.append((key, Path(value), written))
    return out


def _dynrubric_command(container: dict) -> str | None:
    args = container.get("command", [])[1:] if container.get("command", [""])[0] == "dynrubric" else []
    args = args or container.get("args", [])
    return args[0] if args and "dynrubric" in container.get("image", "") else None


def mount_problems(objs: list[dict]) -> list[str]:
    """Every path a dynrubric container's settings use lies under one of its mounts, writable where written: a
    path outside every mount is the image's own filesystem (absent, or read-only as uid 1000)."""
    config_maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    problems = []
    for o in objs:
        for pod in _pod_specs(o):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for c in pod.get("containers", []):
                command = _dynrubric_command(c)
                if command not in RUNTIME_PATHS:
                    continue
                settings = _settings(c, config_maps)
                for what, path, written in _used_paths(command, settings):
                    mount = max(
                        (
                            m
                            for m in c.get("volumeMounts", [])
                            if path == Path(m["mountPath"]) or Path(m["mountPath"]) in path.parents
                        ),
                        key=lambda m: len(m["mountPath"]),
                        default=None,
                    )
                    if mount is None:
                        problems.append(f"{_name(o)}: container {c['name']} ({command}) uses {what} {path}: no mount")
                        continue
                    volume = volumes.get(mount["name"], {})
                    read_only = (
                        mount.get("readOnly")
                        or "configMap" in volume
                        or volume.get("persistentVolumeClaim", {}).get("readOnly")
                    )
                    if written and read_only:
                        problems.append(
                            f"{_name(o)}: container {c['name']} ({command}) writes {what} {path}: "
                            f"mount {mount['mountPath']} is read-only"
                        )
    return problems


def state_problems(objs: list[dict]) -> list[str]:
    """No in-memory state behind an autoscaled Deployment: a command whose state lives in one process's memory
    (STATEFUL_COMMANDS, as its settings run it) must not be the target of an HPA or run as several replicas,
    or each replica holds its own copy and a caller reaches one at random."""
    scaled = {
        o["spec"]["scaleTargetRef"]["name"]: o["spec"].get("maxReplicas", 1)
        for o in objs
        if o["kind"] == "HorizontalPodAutoscaler"
    }
    config_maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    problems = []
    for o in objs:
        if o["kind"] not in {"Deployment", "StatefulSet", "Rollout"}:
            continue
        name = o["metadata"]["name"]
        replicas = max(o["spec"].get("replicas", 1), scaled.get(name, 1))
        for c in o["spec"]["template"]["spec"].get("containers", []):
            command = _dynrubric_command(c)
            why = _in_memory_state(command, _settings(c, config_maps)) if command in STATEFUL_COMMANDS else None
            if why and replicas > 1:
                problems.append(
                    f"{_name(o)}: {replicas} replicas{' (HPA)' if name in scaled else ''} of "
                    f"`dynrubric {_dynrubric_command(c)}`, whose state is in memory: {why}"
                )
    return problems


def validate(objs: list[dict]) -> list[str]:
    objs = copy.deepcopy(objs)
    return (
        [p for o in objs for p in schema_problems(o)]
        + reference_problems(objs)
        + network_problems(objs)
        + apply_problems(objs)
        + namespace_problems(objs)
        + cross_namespace_problems(objs)
        + split_problems(objs)
        + mount_problems(objs)
        + state_problems(objs)
    )


def load(target: Path) -> list[dict]:
    return render.build(target) if target.is_dir() else render.load_docs(target)


def in_namespace(objs: list[dict], namespace: str | None) -> list[dict]:
    """`objs` as `kubectl -n NAMESPACE apply -f` creates them: namespaced objects without one get it."""
    out = copy.deepcopy(objs)
    for o in out:
        if namespace and o["kind"] not in CLUSTER_SCOPED and not o.get("metadata", {}).get("namespace"):
            o.setdefault("metadata", {})["namespace"] = namespace
    return out


def main(argv: list[str]) -> int:
    """Validate the union of the given overlays and manifest files as one deployment."""
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        overlays = [o for arg in argv if Path(arg).is_dir() for o in load(Path(arg))]
        files = [o for arg in argv if not Path(arg).is_dir() for o in load(Path(arg))]
    except render.RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # files are applied with `kubectl -n NAMESPACE apply -f`, into the overlay's namespace
    namespaces = {o["metadata"].get("namespace") for o in overlays if o["kind"] not in CLUSTER_SCOPED} - {None}
    objs = overlays + in_namespace(files, next(iter(namespaces)) if len(namespaces) == 1 else None)
    problems = validate(objs)
    for p in problems:
        print(p)
    print(f"{len(objs)} objects from {' '.join(argv)}: {f'{len(problems)} problems' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
