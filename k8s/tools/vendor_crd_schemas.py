"""Extract the openAPIV3Schema of each served version from CRD YAML files into k8s/crd-schemas/.

The schemas are vendored as data so that manifest validation works offline on a fresh machine. Run it
again to refresh them from the operators' released CRDs (paths below are inside each project's repo):

    python k8s/tools/vendor_crd_schemas.py CRD.yaml [CRD.yaml ...]

Sources used (Apache-2.0): strimzi-kafka-operator packaging/install/cluster-operator/04{0,3,5}-Crd-*.yaml,
kuberay ray-operator/config/crd/bases/ray.io_rayjobs.yaml, argo-rollouts manifests/crds/
{rollout,analysis-template}-crd.yaml, prometheus-operator example/prometheus-operator-crd/
monitoring.coreos.com_{servicemonitors,prometheusrules}.yaml. Descriptions are dropped (size only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "crd-schemas"


def strip_descriptions(node):
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main(paths: list[str]) -> None:
    OUT.mkdir(exist_ok=True)
    for path in paths:
        for crd in yaml.safe_load_all(Path(path).read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served", True):
                    continue
                schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
                name = f"{group}_{version['name']}_{kind}.json"
                (OUT / name).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
                print(f"wrote {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
