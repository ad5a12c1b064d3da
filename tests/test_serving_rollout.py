"""The rollout controller over two real transformers engine servers, the router and a real broker.

Bad input (done-when 3): an unknown version, missing weights, an engine down mid-rollout, each
with a clear error, the stable arm serving throughout and nothing half-applied; and a controller
restarted mid-rollout resumes it.
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from dynrubric.config import GateConfig, RolloutConfig
from dynrubric.errors import DynrubricError
from dynrubric.registry import CheckpointState
from serving.rollout import build_controller_app
from serving.users import SimulatedUsers
from tests.serving_harness import drive, prompt_objects, start_stack, stop_stack

ROLLOUT = RolloutConfig(steps=[0.3, 0.6], poll_interval_s=0.5, max_step_s=300)
# the tiny random model fails every check on both arms: an A/A test with small samples and wide margins
GATE = GateConfig(min_requests_per_arm=5, min_rated_per_arm=5, positive_rate_margin=0.9, regenerate_rate_margin=0.9,
                  mixture_tau=0.3, error_rate_margin=0.2, latency_p95_margin=3.0)


@pytest.fixture(scope="module")
def stack(kafka_broker, tiny_model_dir, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("serving-rollout"), kafka_broker, tiny_model_dir, "transformers",
                    health_interval_s=1.0)
    yield s
    stop_stack(s)


def users(stack, seed: int) -> SimulatedUsers:
    return SimulatedUsers(stack.router_url, prompt_objects(), n_users=30, noise=0.1, rated_share=1.0,
                          regenerate_p=0.3, max_tokens=8, seed=seed)


def assert_untouched(stack, before: dict) -> None:
    after = stack.router_state()
    assert after["canary_weight"] == before["canary_weight"] == 0.0
    assert after["desired"] == before["desired"]
    assert [r["policy_version"] for r in after["replicas"]] == [r["policy_version"] for r in before["replicas"]]
    r = httpx.post(f"{stack.router_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                     "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-dynrubric-variant"] == "stable"


def test_unknown_version_changes_nothing(stack):
    before = stack.router_state()
    controller = stack.controller(ROLLOUT, GATE)
    with pytest.raises(DynrubricError, match="'v404' is not in the registry"):
        controller.start("v404")
    assert controller.store.list() == []
    assert_untouched(stack, before)


def test_missing_weights_change_nothing(stack, tiny_model_dir):
    ckpt = stack.registry.register(tiny_model_dir, "v0", 1, {}, version="v-gone")
    shutil.rmtree(ckpt.path)
    before = stack.registry.list()
    router_before = stack.router_state()
    controller = stack.controller(ROLLOUT, GATE)
    with pytest.raises(DynrubricError, match="weights of v-gone are missing"):
        controller.start("v-gone")
    assert controller.store.active() is None
    assert stack.registry.list() == before  # still a candidate, nothing else moved
    assert_untouched(stack, router_before)


def test_controller_restart_resumes_the_rollout(stack, tiny_model_dir):
    stack.registry.register(tiny_model_dir, "v0", 1, {}, version="v1")
    first = stack.controller(ROLLOUT, GATE)
    rollout = first.start("v1")
    first._loading(first.store.get(rollout.id))  # the first controller dies right after loading the canary
    assert first.store.get(rollout.id).status == "stepping"
    assert stack.router_state()["canary_weight"] == 0.3
    assert stack.registry.get("v1").state is CheckpointState.canary

    second = stack.controller(ROLLOUT, GATE)  # a new process: same tables, nothing in memory
    assert second.store.active().id == rollout.id
    done = drive(stack, second, rollout.id, users(stack, seed=3))
    assert done["rollout"].status == "promoted", done["rollout"].reason
    assert stack.registry.get("v1").state is CheckpointState.stable
    assert stack.registry.get("v0").state is CheckpointState.retired
    state = stack.router_state()
    assert state["canary_weight"] == 0.0 and state["desired"]["stable"]["version"] == "v1"
    assert {r["policy_version"] for r in state["replicas"]} == {"v1"}

    app = TestClient(build_controller_app(second, CollectorRegistry()))
    gate = app.get(f"/gate/{rollout.id}").json()
    assert gate["verdict"] == "pass" and gate["status"] == "promoted"
    assert {c["name"] for c in gate["checks"]} >= {"sample_ratio", "min_samples", "primary"}
    assert app.get("/gate/ro-nope").status_code == 404


def test_engine_down_mid_rollout_rolls_back_and_stable_keeps_serving(stack, tiny_model_dir):
    stack.registry.register(tiny_model_dir, "v1", 2, {}, version="v2")
    baseline = stack.registry.stable().version
    stack.fleet.max_restarts = 0  # keep it down while the controller looks
    controller = stack.controller(ROLLOUT, GATE)
    rollout = controller.start("v2")
    sim = users(stack, seed=4)

    def kill_soon() -> None:
        time.sleep(2.0)
        stack.fleet.process("transformers-canary").kill()

    import threading

    threading.Thread(target=kill_soon, daemon=True).start()
    done = drive(stack, controller, rollout.id, sim, batch=4)
    final = done["rollout"]
    assert final.status == "rolled_back"
    assert "canary" in final.reason and ("down" in final.reason or "error_rate" in final.reason), final.reason
    assert done["outcomes"] and done["failed_requests"] == 0  # every request answered, by stable if need be
    assert stack.registry.get("v2").state is CheckpointState.rejected
    assert stack.registry.stable().version == baseline
    state = stack.router_state()
    assert state["canary_weight"] == 0.0
    assert state["desired"]["canary"]["version"] == baseline  # restored weights wait for the engine

    stack.fleet.max_restarts = 5  # the fleet restarts it; the router gives it the baseline weights
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        canary = next(r for r in stack.router_state()["replicas"] if r["variant"] == "canary")
        if canary["healthy"] and canary["policy_version"] == baseline:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"canary replica not restored: {canary}")
