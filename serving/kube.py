"""The rollout controller restarts a variant's engine Deployment onto new weights (issue 37, defect 3).

On a cluster the engines run without vLLM's dev mode, so new weights come by restarting the pods onto the
checkpoint on the shared models volume (`serving.weights_via: restart`). With `rollout.restart: kubernetes`
the controller does the restart itself: it sets the `--model` argument of the variant's Deployment
(`rollout.deployments`) through the Kubernetes API, and Kubernetes rolls the pods; the router then checks
that every pod serves the weights. It talks to the API server as the pod's service account (RBAC: get and
patch on those Deployments only, k8s/base/rollout/rbac.yaml), with plain HTTP calls: no client library.

A Deployment that does not exist is not ours to restart (prod-argo: Argo's Rollout owns the policy pods and
restarts them): the call says so and changes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from dynrubric import http_clients
from dynrubric.errors import DynrubricError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MODEL_FLAG = "--model"


class DeploymentRestarter:
    """Sets `--model` of Deployments in one namespace (a strategic merge patch of the container's args)."""

    def __init__(self, api_url: str, namespace: str, token: str, verify: Any = True, transport: Any = None):
        self.namespace = namespace
        self._http = http_clients.client(
            base_url=api_url,
            headers={"authorization": f"Bearer {token}"},
            verify=verify,
            timeout=30.0,
            transport=transport,
        )

    @classmethod
    def in_cluster(cls) -> DeploymentRestarter:
        """The pod's own service account, namespace and the API server's Service (as client libraries do)."""
        try:
            token = (SERVICE_ACCOUNT / "token").read_text().strip()
            namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        except OSError as e:
            raise DynrubricError(
                f"rollout.restart is kubernetes, but there is no service account token here: {e}",
                "run the controller in its Job (k8s/jobs/rollout-start.yaml), or set rollout.restart: none",
            ) from None
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(f"https://{host}:{port}", namespace, token, verify=str(SERVICE_ACCOUNT / "ca.crt"))

    def _path(self, deployment: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}"

    def set_model(self, deployment: str, model_path: str) -> str:
        """Restart `deployment` onto `model_path` (its first container's `--model`); returns what was done."""
        try:
            got = self._http.get(self._path(deployment))
            if got.status_code == 404:
                return (
                    f"no Deployment {deployment} in {self.namespace}: not restarted (another controller owns the pods)"
                )
            got.raise_for_status()
            container = got.json()["spec"]["template"]["spec"]["containers"][0]
            args = list(container.get("args", []))
            if MODEL_FLAG not in args or args.index(MODEL_FLAG) + 1 >= len(args):
                raise DynrubricError(
                    f"Deployment {deployment} has no `{MODEL_FLAG} PATH` argument to set",
                    "the engine Deployments of k8s/base/fleet/vllm.yaml pass it",
                )
            i = args.index(MODEL_FLAG) + 1
            if args[i] == model_path:
                return f"{deployment} already runs {model_path}"
            args[i] = model_path
            patch = {"spec": {"template": {"spec": {"containers": [{"name": container["name"], "args": args}]}}}}
            done = self._http.patch(
                self._path(deployment),
                json=patch,
                headers={"content-type": "application/strategic-merge-patch+json"},
            )
            done.raise_for_status()
        except httpx.HTTPStatusError as e:
            raise DynrubricError(
                f"the Kubernetes API refused {e.request.method} {e.request.url.path}: HTTP {e.response.status_code}: "
                f"{e.response.text[:300]}",
                "the rollout Job's service account needs get and patch on the engine Deployments "
                "(k8s/base/rollout/rbac.yaml)",
            ) from None
        except httpx.HTTPError as e:
            raise DynrubricError(f"the Kubernetes API is unreachable: {e}", "check the cluster's API server") from None
        return f"restarting {deployment} onto {model_path}"

    def close(self) -> None:
        self._http.close()
