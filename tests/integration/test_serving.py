"""Router and rollout controller over two real transformers engine servers (child processes) and a real broker.

Router: sticky routing, logging, streaming, feedback, control auth, retry and reload of a dead replica.
Rollout bad input (done-when 3): an unknown version, missing weights, an engine down mid-rollout,
each with a clear error, the stable arm serving throughout and nothing half-applied; and a
controller restarted mid-rollout resumes it. One stack for the module (engine start-up dominates);
each test starts from a serving stack (`serving` below: every engine up with its variant's weights,
no traffic on the canary) and registers its own versions on whatever is stable, so any test runs
alone or in any order.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from dynrubric.config import GateConfig, RolloutConfig
from dynrubric.errors import DynrubricError
from dynrubric.registry import CheckpointState
from serving.rollout import build_controller_app
from serving.users import SimulatedUsers, load_checkable
from tests.serving_harness import TOKEN, drive, read_topic, start_stack, stop_stack, wait_for

ROLLOUT = RolloutConfig(steps=[0.3, 0.6], poll_interval_s=0.5, max_step_s=300)
# the tiny random model fails every check on both arms: an A/A test with small samples and wide margins
GATE = GateConfig(
    min_users_per_arm=3,
    min_requests_per_arm=5,
    min_rated_per_arm=5,
    positive_rate_margin=0.9,
    regenerate_rate_margin=0.9,
    mixture_tau=0.3,
    error_rate_margin=0.2,
    latency_p95_margin=3.0,
)


@pytest.fixture(scope="module")
def stack(kafka_broker, tiny_model_dir, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("serving"), kafka_broker, tiny_model_dir, "transformers", health_interval_s=3.0
    )  # slower than the kill-then-request below
    yield s
    stop_stack(s)


@pytest.fixture(autouse=True)
def serving(stack):
    """Every test starts here: all replicas healthy and serving their variant's weights, canary share 0.

    A test that kills an engine or turns restarts off leaves that behind; the fleet restarts the
    engine once restarts are back on, and the router reloads its variant's weights.
    """
    restarts = stack.fleet.max_restarts
    set_traffic(stack, 0.0, "idle")

    def ready() -> bool:
        state = stack.router_state()
        return all(
            r["healthy"] and r["policy_version"] == state["desired"][r["variant"]]["version"] for r in state["replicas"]
        )

    wait_for(ready, 180, "every engine healthy with its variant's weights")
    yield
    stack.fleet.max_restarts = restarts


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN.get_secret_value()}"}


def set_traffic(stack, weight: float, experiment: str) -> None:
    r = httpx.post(
        f"{stack.router_url}/control/traffic", headers=auth(), json={"canary_weight": weight, "experiment": experiment}
    )
    assert r.status_code == 200, r.text


def chat(stack, user: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0} | kw
    return httpx.post(f"{stack.router_url}/v1/chat/completions", headers={"x-user-key": user}, json=body, timeout=60)


def test_routes_sticky_logs_and_echoes(stack):
    set_traffic(stack, 0.5, "exp-sticky")
    version = {r["variant"]: r["policy_version"] for r in stack.router_state()["replicas"]}
    seen: dict[str, set[str]] = {}
    ids = {}
    for _ in range(3):
        for u in range(12):
            r = chat(stack, f"user-{u}")
            assert r.status_code == 200, r.text
            seen.setdefault(f"user-{u}", set()).add(r.headers["x-dynrubric-variant"])
            ids[r.headers["x-request-id"]] = r.headers["x-dynrubric-variant"]
    assert all(len(v) == 1 for v in seen.values()), seen  # sticky
    assert {v for vs in seen.values() for v in vs} == {"stable", "canary"}  # both arms used
    # the caller's request id is echoed
    r = chat(stack, "user-0", stream=False)
    r2 = httpx.post(
        f"{stack.router_url}/v1/completions",
        headers={"x-request-id": "my-id-1"},
        json={"prompt": "abc", "max_tokens": 3},
        timeout=60,
    )
    assert r2.status_code == 200 and r2.headers["x-request-id"] == "my-id-1"
    assert r2.json()["choices"][0]["text"] is not None
    ids["my-id-1"] = r2.headers["x-dynrubric-variant"]
    stack.producer.flush()
    logged = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}
    for rid, variant in ids.items():
        assert logged[rid]["variant"] == variant
        assert logged[rid]["policy_version"] == version[variant]
        assert logged[rid]["latency_ms"] > 0
    set_traffic(stack, 0.0, "exp-sticky")


def test_control_characters_are_logged_as_visible_escapes(stack):
    """A prompt (or a model's answer: the tiny model's sometimes holds them) with control characters is logged
    with each one escaped, `\\u0000`: an event ingest stores, never one it dead-letters and loses."""
    from streaming.events import QueryLogEvent, parse_event

    r = chat(stack, "ctl", messages=[{"role": "user", "content": "nul\x00 esc\x1b tab\t ok"}])
    assert r.status_code == 200, r.text
    stack.producer.flush()
    logged = read_topic(stack.bootstrap, "dynrubric.query-log")
    [raw] = [e for e in logged if e["request_id"] == r.headers["x-request-id"]]
    assert raw["messages"][-1]["content"] == "nul\\u0000 esc\\u001b tab\t ok"
    event = parse_event(QueryLogEvent, json.dumps(raw).encode(), 10**6, arms=("stable", "canary"))
    assert "\x00" not in event.response and event.messages[-1].content == raw["messages"][-1]["content"]


def test_streaming_is_relayed_and_logged(stack):
    with httpx.stream(
        "POST",
        f"{stack.router_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
            "temperature": 0,
        },
        headers={"x-request-id": "stream-1"},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "stream-1"
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join((json.loads(x[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or "" for x in lines[:-1])
    stack.producer.flush()
    logged = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}
    assert logged["stream-1"]["response"] == text
    assert logged["stream-1"]["completion_tokens"] > 0


def test_a_request_without_max_tokens_logs_what_the_engine_used(stack):
    """The router sends its default max_tokens and logs it (it used to log 16 while the engine used its own 64)."""
    r = httpx.post(
        f"{stack.router_url}/v1/chat/completions",
        headers={"x-request-id": "no-max-1"},
        timeout=120,
        json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0},
    )
    assert r.status_code == 200
    stack.producer.flush()
    logged = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}["no-max-1"]
    assert logged["sampling"]["max_tokens"] == stack.router.default_max_tokens
    assert logged["completion_tokens"] == r.json()["usage"]["completion_tokens"] <= logged["sampling"]["max_tokens"]


def test_feedback_is_produced_and_malformed_feedback_refused(stack):
    r = httpx.post(
        f"{stack.router_url}/v1/feedback", json={"request_id": "fb-1", "kind": "thumbs_up"}, headers={"x-user-key": "u"}
    )
    assert r.status_code == 200
    for bad in (
        {"request_id": "fb-2", "kind": "love"},
        {"kind": "thumbs_up"},
        {"request_id": "fb-3", "kind": "dwell", "value": -1},
    ):
        r = httpx.post(f"{stack.router_url}/v1/feedback", json=bad)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"][-1] in ("kind", "request_id", "value")
    r = httpx.post(f"{stack.router_url}/v1/feedback", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = httpx.post(f"{stack.router_url}/v1/feedback", json={"request_id": "fb-4", "kind": "dwell", "value": 0})
    assert r.status_code == 422 and "dwell" in r.json()["detail"]  # the event schema: seconds read, > 0
    stack.producer.flush()
    feedback = read_topic(stack.bootstrap, "dynrubric.feedback")
    assert [f["kind"] for f in feedback if f["request_id"] == "fb-1"] == ["thumbs_up"]
    assert not [f for f in feedback if f["request_id"] in ("fb-2", "fb-3")]


def test_control_needs_token_and_metrics_follow_the_table(stack):
    r = httpx.post(f"{stack.router_url}/control/traffic", json={"canary_weight": 0.5, "experiment": "x"})
    assert r.status_code == 401
    assert stack.router_state()["canary_weight"] == 0.0
    r = httpx.post(
        f"{stack.router_url}/control/variants/canary/weights",
        headers=auth(),
        json={"version": "vX", "path": "/does/not/exist"},
    )
    assert r.status_code == 400 and "not a directory" in r.json()["detail"]
    set_traffic(stack, 1.0, "exp-drained")
    r = httpx.post(f"{stack.router_url}/control/replicas/transformers-canary/drain", json={"drained": True})
    assert r.status_code == 401
    r = httpx.post(
        f"{stack.router_url}/control/replicas/transformers-canary/drain", headers=auth(), json={"drained": True}
    )
    assert r.status_code == 200
    assert next(x for x in r.json()["replicas"] if x["name"] == "transformers-canary")["drained"]
    assert chat(stack, "drained-user").headers["x-dynrubric-variant"] == "stable"
    httpx.post(
        f"{stack.router_url}/control/replicas/transformers-canary/drain", headers=auth(), json={"drained": False}
    ).raise_for_status()
    assert chat(stack, "drained-user").headers["x-dynrubric-variant"] == "canary"
    set_traffic(stack, 0.0, "exp-drained")
    assert httpx.post(f"{stack.router_url}/control/replicas/nope/drain", headers=auth(), json={}).status_code == 404
    metrics = httpx.get(f"{stack.router_url}/metrics").text
    for name in (
        "dynrubric_router_requests_total",
        "dynrubric_router_request_latency_seconds",
        "dynrubric_router_tokens_total",
        "dynrubric_router_variant_weight",
        "dynrubric_router_errors_total",
        "dynrubric_producer_dropped_total",
    ):
        assert name in metrics


def test_a_dead_replica_is_retried_then_reloaded_when_back(stack):
    """Kill the canary engine: canary users are served by stable; the fleet restarts it, the router reloads it.

    The router's probe (every 3 s) races the request, and both outcomes are correct: before the probe sees the
    engine dead, the user is assigned the canary, its request fails there and is answered by stable (one canary
    error); after, no canary is serving and the user is assigned stable (no error). The logged event says which
    (its assigned arm), and the counters must agree with it. The failover order itself is pinned without a race
    in tests/unit/test_routing.py."""
    set_traffic(stack, 1.0, "exp-dead")
    engine = stack.fleet.process("transformers-canary")
    engine.kill()
    engine.wait(timeout=30)
    r = chat(stack, "someone")
    assert r.status_code == 200
    assert r.headers["x-dynrubric-variant"] == "stable"
    stack.producer.flush()
    event = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}[r.headers["x-request-id"]]
    assert (event["variant"], event["experiment_id"]) == ("stable", "exp-dead")
    canary = stack.router_state()["counters"]["exp-dead"].get("canary", {"requests": 0, "errors": 0, "settled": 0})
    assigned_canary = event["assigned_variant"] == "canary"
    expected = (
        {"requests": 1, "errors": 1, "settled": 1} if assigned_canary else {"requests": 0, "errors": 0, "settled": 0}
    )
    assert canary == expected, event
    # the fleet restarts it; the router reloads its variant's weights and routes to it again
    wait_for(
        lambda: chat(stack, "someone").headers["x-dynrubric-variant"] == "canary",
        120,
        "the restarted canary engine to serve again",
        every_s=0.5,
    )
    set_traffic(stack, 0.0, "exp-dead")


def test_a_canary_with_broken_weights_fails_over_to_stable_and_counts_as_a_canary_error(stack, tmp_path):
    """NaN weights (the `up` damage drill's): the engine answers 500 "non-finite logits", the user gets the
    stable answer, and the experiment counts a canary request that failed (never a canary success); the
    logged event names both the assigned arm and the arm that served it."""
    from dynrubric.app.loop import damage_nonfinite

    desired = stack.router_state()["desired"]["canary"]
    broken = damage_nonfinite(Path(desired["path"]), tmp_path / "v-nan")
    r = httpx.post(
        f"{stack.router_url}/control/variants/canary/weights",
        headers=auth(),
        timeout=300,
        json={"version": "v-nan", "path": str(broken)},
    )
    assert r.status_code == 200, r.text
    try:
        set_traffic(stack, 1.0, "exp-nan")
        r = chat(stack, "someone", temperature=1.0)
        assert r.status_code == 200 and r.headers["x-dynrubric-variant"] == "stable", r.text
        assert stack.router_state()["counters"]["exp-nan"]["canary"] == {"requests": 1, "errors": 1, "settled": 1}
        stack.producer.flush()
        event = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}[
            r.headers["x-request-id"]
        ]
        assert (event["variant"], event["assigned_variant"], event["experiment_id"]) == ("stable", "canary", "exp-nan")
        assert event["policy_version"] == r.headers["x-dynrubric-policy-version"] != "v-nan"
    finally:
        set_traffic(stack, 0.0, "exp-nan")
        r = httpx.post(
            f"{stack.router_url}/control/variants/canary/weights",
            headers=auth(),
            timeout=300,
            json={"version": desired["version"], "path": desired["path"]},
        )
        assert r.status_code == 200, r.text


def users(stack, seed: int) -> SimulatedUsers:
    return SimulatedUsers(
        stack.router_url,
        load_checkable(),
        n_users=30,
        noise=0.1,
        rated_share=1.0,
        regenerate_p=0.3,
        max_tokens=8,
        seed=seed,
    )


def assert_untouched(stack, before: dict) -> None:
    after = stack.router_state()
    assert after["canary_weight"] == before["canary_weight"] == 0.0
    assert after["desired"] == before["desired"]
    assert [r["policy_version"] for r in after["replicas"]] == [r["policy_version"] for r in before["replicas"]]
    r = httpx.post(
        f"{stack.router_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-dynrubric-variant"] == "stable"


def test_a_canary_failing_every_request_is_rolled_back_at_step_0_under_the_demo_gate(stack, tiny_model_dir, tmp_path):
    """Harm stops at once, under the demo profile's gate (judged promotion; 5 users, 8 requests, 6 rated a arm): a
    canary whose engine fails every request (NaN weights: HTTP 500, its users served by stable) is rolled back at
    step 0 by the error-rate guardrail, the check right after the split, before any minimum is asked. The
    rollout logged and kept what its gate could detect at the traffic it started with."""
    from dynrubric.app.loop import damage_nonfinite
    from dynrubric.config_loader import load_settings
    from dynrubric.engines.hf import TransformersEngine
    from dynrubric.rubric.evaluator import Evaluator
    from serving.judged import PairJudge

    settings = load_settings(environ={}, profile="demo")
    baseline = stack.registry.stable()
    stack.registry.register(
        damage_nonfinite(baseline.path, tmp_path / "nan"), baseline.version, 3, {}, version="v-nan-demo"
    )
    logged: list[str] = []
    with TransformersEngine(tiny_model_dir) as engine:  # the demo gate promotes on the judge: it must have one
        controller = stack.controller(
            settings.rollout.model_copy(update={"poll_interval_s": 0.5}),
            settings.gate,
            judge=PairJudge(Evaluator(engine, engine, settings.rubric), settings.rubric.eps),
        )
        controller.log = logged.append
        rollout = controller.start("v-nan-demo")
        done = drive(stack, controller, rollout.id, users(stack, seed=5), batch=4)
    final = done["rollout"]
    assert final.status == "rolled_back", final.reason
    assert final.reason.startswith("gate failed at step 0: error_rate: canary error rate exceeds stable"), final.reason
    assert [c["name"] for c in final.last_gate["checks"]] == ["sample_ratio", "error_rate"]
    assert done["failed_requests"] == 0  # every user answered, by stable
    assert stack.registry.get("v-nan-demo").state is CheckpointState.rejected
    lines = final.plan["lines"]
    assert lines[0].startswith("gate power at ") and any("judged win rate" in x for x in lines), lines
    assert [f"{rollout.id}: {x}" for x in lines] == [
        x for x in logged if x.startswith(f"{rollout.id}: ") and (x[len(rollout.id) + 2 :] in lines)
    ]


def test_unknown_version_changes_nothing(stack):
    before = stack.router_state()
    controller = stack.controller(ROLLOUT, GATE)
    rollouts = controller.store.list()
    with pytest.raises(DynrubricError, match="'v404' is not in the registry"):
        controller.start("v404")
    assert controller.store.list() == rollouts
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


class ControllerDied(Exception):
    pass


def die(_: float) -> None:
    raise ControllerDied


def test_controller_restart_resumes_the_rollout(stack, tiny_model_dir):
    baseline = stack.registry.stable().version
    stack.registry.register(tiny_model_dir, baseline, 1, {}, version="v-resumed")
    # the first controller loads the canary, takes the first step, finds the gate inconclusive (no
    # traffic yet) and dies where it would wait for the next poll
    first = stack.controller(ROLLOUT, GATE, sleep=die)
    rollout = first.start("v-resumed")
    with pytest.raises(ControllerDied):
        first.run(rollout.id)
    assert first.store.get(rollout.id).status == "stepping"
    assert stack.router_state()["canary_weight"] == 0.3
    assert stack.registry.get("v-resumed").state is CheckpointState.canary

    second = stack.controller(ROLLOUT, GATE)  # a new process: same tables, nothing in memory
    assert second.store.active().id == rollout.id
    done = drive(stack, second, rollout.id, users(stack, seed=3))
    assert done["rollout"].status == "promoted", done["rollout"].reason
    assert stack.registry.get("v-resumed").state is CheckpointState.stable
    assert stack.registry.get(baseline).state is CheckpointState.retired
    state = stack.router_state()
    assert state["canary_weight"] == 0.0 and state["desired"]["stable"]["version"] == "v-resumed"
    assert {r["policy_version"] for r in state["replicas"]} == {"v-resumed"}

    app = TestClient(build_controller_app(second, CollectorRegistry()))
    gate = app.get(f"/gate/{rollout.id}").json()
    assert gate["verdict"] == "pass" and gate["status"] == "promoted"
    assert {c["name"] for c in gate["checks"]} >= {
        "sample_ratio",
        "min_samples",
        "primary",
        "error_rate_non_inferiority",
    }
    assert app.get("/gate/ro-nope").status_code == 404


def test_engine_down_mid_rollout_rolls_back_and_stable_keeps_serving(stack, tiny_model_dir):
    baseline = stack.registry.stable().version
    stack.registry.register(tiny_model_dir, baseline, 2, {}, version="v-down")
    stack.fleet.max_restarts = 0  # keep it down while the controller looks (the `serving` fixture turns them back on)
    controller = stack.controller(ROLLOUT, GATE)
    rollout = controller.start("v-down")
    sim = users(stack, seed=4)
    killed_at: dict = {}

    def kill_mid_rollout() -> None:
        # the canary has answered a few of its users, fewer than one step's minimum (5): the gate cannot have passed
        wait_for(
            lambda: stack.router_state()["counters"].get(rollout.id, {}).get("canary", {}).get("requests", 0) >= 3,
            120,
            "the canary to answer its first users",
        )
        killed_at["status"] = controller.store.get(rollout.id).status
        stack.fleet.process("transformers-canary").kill()

    threading.Thread(target=kill_mid_rollout, daemon=True).start()
    done = drive(stack, controller, rollout.id, sim, batch=4)
    final = done["rollout"]
    assert killed_at == {"status": "stepping"}  # the engine died mid-rollout
    assert final.status == "rolled_back"
    # the gate never passed the last step with the dead canary (promoting would then be refused by the router)
    assert "promotion failed" not in final.reason, final.reason
    # Which check trips first is a race: the fleet's health probe (3 s) marks the canary down, the error-rate
    # guardrail sees its failures, or - once the canary is marked down the router assigns its users to stable -
    # the sample-ratio check (users by assigned arm) sees the split drift. All three roll back.
    # A fourth outcome of the same race: the step timer fires first and the router refuses to move traffic
    # to a canary with no healthy replica.
    assert (
        "canary" in final.reason
        and ("down" in final.reason or "error_rate" in final.reason or "no healthy canary" in final.reason)
    ) or ("sample_ratio" in final.reason), final.reason
    assert done["outcomes"] and done["failed_requests"] == 0  # every request answered, by stable if need be
    assert stack.registry.get("v-down").state is CheckpointState.rejected
    assert stack.registry.stable().version == baseline
    state = stack.router_state()
    assert state["canary_weight"] == 0.0
    # the restored weights wait for the engine: the router reloads it when it is back
    # (test_a_dead_replica_is_retried_then_reloaded_when_back shows that reload)
    assert state["desired"]["canary"]["version"] == baseline
