"""Render a kustomization without kubectl: the subset of kustomize this repo uses, nothing more.

Supported kustomization fields (anything else is an error naming the field):
  resources (files and directories with a kustomization.yaml), namespace, labels (pairs only, without
  includeSelectors/includeTemplates), replicas, images (name/newName/newTag), configMapGenerator (files,
  literals) with generatorOptions.disableNameSuffixHash: true, patches (strategic-merge patch files:
  maps merge, `null` deletes a key, `$patch: delete` deletes the object, lists of maps merge by the first
  key that every element has among kustomize's associative keys, other lists are replaced).

tests/test_k8s.py checks that this renders exactly what `kubectl kustomize` renders wherever kubectl is
installed, so the subset stays honest.

    python k8s/tools/render.py k8s/overlays/prod > rendered.yaml
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "labels", "replicas", "images",
             "configMapGenerator", "generatorOptions", "patches"}
# the keys kustomize (kyaml) uses to merge lists of maps when it has no schema for the list
ASSOCIATIVE_KEYS = ("mountPath", "devicePath", "ip", "type", "topologyKey", "name", "containerPort")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass", "ClusterIssuer"}
REPLICA_KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"}


class RenderError(Exception):
    pass


def load_docs(path: Path) -> list[dict]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d]
    except FileNotFoundError:
        raise RenderError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise RenderError(f"{path}: invalid YAML: {e}") from None


def _key(obj: dict) -> tuple[str, str]:
    return obj.get("kind", ""), obj.get("metadata", {}).get("name", "")


def merge(base, patch):
    """Strategic-merge `patch` into `base` (kustomize's semantics for the cases this repo uses)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        items = base + patch
        if items and all(isinstance(i, dict) for i in items):
            key = next((k for k in ASSOCIATIVE_KEYS if all(k in i for i in items)), None)
            if key is not None:
                out = [copy.deepcopy(i) for i in base]
                for p in patch:
                    at = next((n for n, b in enumerate(out) if b[key] == p[key]), None)
                    if at is None:
                        out.append(copy.deepcopy(p))
                    else:
                        out[at] = merge(out[at], p)
                return out
        return copy.deepcopy(patch)
    return copy.deepcopy(patch)


def _apply_patch(objs: list[dict], patch: dict, where: Path) -> list[dict]:
    matches = [o for o in objs if _key(o) == _key(patch)]
    if not matches:
        raise RenderError(f"{where}: patch for {'/'.join(_key(patch))} matches no resource")
    if patch.get("$patch") == "delete":
        return [o for o in objs if _key(o) != _key(patch)]
    return [merge(o, patch) if _key(o) == _key(patch) else o for o in objs]


def _configmap(gen: dict, root: Path) -> dict:
    data = {}
    for f in gen.get("files", []):
        key, _, rel = f.rpartition("=") if "=" in f else (Path(f).name, "", f)
        data[key] = (root / rel).read_text()
    for lit in gen.get("literals", []):
        key, _, value = lit.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}


def _images(node, images: list[dict]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                for c in v:
                    if isinstance(c, dict) and isinstance(c.get("image"), str):
                        c["image"] = _new_image(c["image"], images)
            _images(v, images)
    elif isinstance(node, list):
        for v in node:
            _images(v, images)


def _new_image(image: str, images: list[dict]) -> str:
    name, tag = image, None
    if ":" in image.rsplit("/", 1)[-1]:
        name, tag = image.rsplit(":", 1)
    for rule in images:
        if rule["name"] == name:
            new_tag = rule.get("newTag", tag)
            return rule.get("newName", name) + (f":{new_tag}" if new_tag else "")
    return image


def build(directory: Path) -> list[dict]:
    """The objects `kustomize build directory` would print (for the supported subset)."""
    directory = Path(directory)
    kfile = directory / "kustomization.yaml"
    spec = load_docs(kfile)[0] if kfile.is_file() else None
    if spec is None:
        raise RenderError(f"{directory}: no kustomization.yaml")
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise RenderError(f"{kfile}: unsupported kustomization fields {sorted(unknown)} (see k8s/tools/render.py)")

    objs: list[dict] = []
    for res in spec.get("resources", []):
        path = directory / res
        objs += build(path) if path.is_dir() else load_docs(path)
    if spec.get("configMapGenerator"):
        if not spec.get("generatorOptions", {}).get("disableNameSuffixHash"):
            raise RenderError(f"{kfile}: set generatorOptions.disableNameSuffixHash: true (hash suffixes are not supported)")
        objs += [_configmap(g, directory) for g in spec["configMapGenerator"]]
    seen: set[tuple] = set()
    for o in objs:
        ident = (*_key(o), o.get("metadata", {}).get("namespace"))
        if ident in seen:
            raise RenderError(f"{kfile}: {'/'.join(ident[:2])} is defined twice")
        seen.add(ident)

    for p in spec.get("patches", []):
        if set(p) != {"path"}:
            raise RenderError(f"{kfile}: only `patches: [{{path: FILE}}]` is supported, got {sorted(p)}")
        docs = load_docs(directory / p["path"])
        if len(docs) > 1 and any(d.get("$patch") == "delete" for d in docs):
            raise RenderError(f"{directory / p['path']}: put each `$patch: delete` in a file of its own "
                              "(kustomize 5.5 crashes on several documents with one)")
        for doc in docs:
            objs = _apply_patch(objs, doc, directory / p["path"])
    if "namespace" in spec:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = spec["namespace"]
    for label in spec.get("labels", []):
        if set(label) - {"pairs"}:
            raise RenderError(f"{kfile}: labels support only `pairs`, got {sorted(label)}")
        for o in objs:
            o.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for r in spec.get("replicas", []):
        targets = [o for o in objs if o["kind"] in REPLICA_KINDS and o["metadata"]["name"] == r["name"]]
        if not targets:
            raise RenderError(f"{kfile}: replicas for {r['name']} matches no workload")
        for o in targets:
            o.setdefault("spec", {})["replicas"] = r["count"]
    if spec.get("images"):
        _images(objs, spec["images"])
    return objs


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        objs = build(Path(argv[0]))
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
