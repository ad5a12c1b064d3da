"""`GET /gate/version/{version}`: what prod-argo's blue-green prePromotionAnalysis reads (k8s/overlays/prod-argo).

Argo knows the version its new pods serve (a pod label), not the id our controller gives the rollout: the
endpoint answers the newest rollout of the version, and inconclusive while there is none."""

from __future__ import annotations

import dataclasses

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from serving.rollout import Rollout, build_controller_app

OLD = Rollout(
    id="ro-v2-old",
    version="v2",
    version_path="/v2",
    baseline="v1",
    baseline_path="/v1",
    steps=[0.05, 0.5],
    status="rolled_back",
    step=0,
    step_started_at=0.0,
    started_at=1.0,
    updated_at=1.0,
    reason="gate failed at step 0: error_rate: canary worse",
    last_gate=None,
)


class Store:
    def __init__(self, *rollouts: Rollout):
        self.rollouts = rollouts

    def list(self) -> list[Rollout]:
        return list(self.rollouts)


class Controller:
    def __init__(self, store: Store):
        self.store = store


def get(store: Store, version: str) -> dict:
    app = TestClient(build_controller_app(Controller(store), CollectorRegistry()))  # type: ignore[arg-type]
    response = app.get(f"/gate/version/{version}")
    assert response.status_code == 200
    return response.json()


def test_no_rollout_of_the_version_yet_is_inconclusive():
    body = get(Store(OLD), "v3")
    assert (body["verdict"], body["status"]) == ("inconclusive", "none") and "rollout start v3" in body["reason"]


def test_the_newest_rollout_of_the_version_answers():
    assert get(Store(OLD), "v2")["verdict"] == "fail"  # Argo's failureCondition: it aborts
    promoted = dataclasses.replace(OLD, id="ro-v2-new", status="promoted", started_at=2.0, reason=None)
    body = get(Store(OLD, promoted), "v2")
    assert (body["rollout_id"], body["status"], body["verdict"]) == ("ro-v2-new", "promoted", "pass")
