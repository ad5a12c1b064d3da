"""The router over two real transformers engine servers (child processes) and a real Tansu broker."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serving_harness import TOKEN, read_topic, start_stack, stop_stack


@pytest.fixture(scope="module")
def stack(kafka_broker, tiny_model_dir, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("serving-router"), kafka_broker, tiny_model_dir, "transformers",
                    health_interval_s=3.0)  # slower than the kill-then-request below
    yield s
    stop_stack(s)


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN.get_secret_value()}"}


def set_traffic(stack, weight: float, experiment: str) -> None:
    r = httpx.post(f"{stack.router_url}/control/traffic", headers=auth(),
                   json={"canary_weight": weight, "experiment": experiment})
    assert r.status_code == 200, r.text


def chat(stack, user: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0} | kw
    return httpx.post(f"{stack.router_url}/v1/chat/completions", headers={"x-user-key": user}, json=body, timeout=60)


def test_routes_sticky_logs_and_echoes(stack):
    set_traffic(stack, 0.5, "exp-sticky")
    seen: dict[str, set[str]] = {}
    ids = {}
    for i in range(3):
        for u in range(12):
            r = chat(stack, f"user-{u}")
            assert r.status_code == 200, r.text
            seen.setdefault(f"user-{u}", set()).add(r.headers["x-dynrubric-variant"])
            ids[r.headers["x-request-id"]] = r.headers["x-dynrubric-variant"]
    assert all(len(v) == 1 for v in seen.values()), seen  # sticky
    assert {v for vs in seen.values() for v in vs} == {"stable", "canary"}  # both arms used
    # the caller's request id is echoed
    r = chat(stack, "user-0", stream=False)
    r2 = httpx.post(f"{stack.router_url}/v1/completions", headers={"x-request-id": "my-id-1"},
                    json={"prompt": "abc", "max_tokens": 3}, timeout=60)
    assert r2.status_code == 200 and r2.headers["x-request-id"] == "my-id-1"
    assert r2.json()["choices"][0]["text"] is not None
    ids["my-id-1"] = r2.headers["x-dynrubric-variant"]
    stack.producer.flush()
    logged = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}
    for rid, variant in ids.items():
        assert logged[rid]["variant"] == variant
        assert logged[rid]["policy_version"] == "v0"
        assert logged[rid]["latency_ms"] > 0
    set_traffic(stack, 0.0, "exp-sticky")


def test_streaming_is_relayed_and_logged(stack):
    with httpx.stream("POST", f"{stack.router_url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True, "temperature": 0,
    }, headers={"x-request-id": "stream-1"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "stream-1"
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join((json.loads(x[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or "" for x in lines[:-1])
    stack.producer.flush()
    logged = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}
    assert logged["stream-1"]["response"] == text
    assert logged["stream-1"]["completion_tokens"] > 0


def test_feedback_is_produced_and_malformed_feedback_refused(stack):
    r = httpx.post(f"{stack.router_url}/v1/feedback", json={"request_id": "fb-1", "kind": "thumbs_up"},
                   headers={"x-user-key": "u"})
    assert r.status_code == 200
    for bad in ({"request_id": "fb-2", "kind": "love"}, {"kind": "thumbs_up"}, {"request_id": "fb-3", "kind": "dwell",
                                                                                 "value": -1}):
        r = httpx.post(f"{stack.router_url}/v1/feedback", json=bad)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"][-1] in ("kind", "request_id", "value")
    r = httpx.post(f"{stack.router_url}/v1/feedback", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    stack.producer.flush()
    feedback = read_topic(stack.bootstrap, "dynrubric.feedback")
    assert [f["kind"] for f in feedback if f["request_id"] == "fb-1"] == ["thumbs_up"]
    assert not [f for f in feedback if f["request_id"] in ("fb-2", "fb-3")]


def test_control_needs_token_and_metrics_follow_the_table(stack):
    r = httpx.post(f"{stack.router_url}/control/traffic", json={"canary_weight": 0.5, "experiment": "x"})
    assert r.status_code == 401
    assert stack.router_state()["canary_weight"] == 0.0
    r = httpx.post(f"{stack.router_url}/control/variants/canary/weights", headers=auth(),
                   json={"version": "vX", "path": "/does/not/exist"})
    assert r.status_code == 400 and "not a directory" in r.json()["detail"]
    metrics = httpx.get(f"{stack.router_url}/metrics").text
    for name in ("dynrubric_router_requests_total", "dynrubric_router_request_latency_seconds",
                 "dynrubric_router_tokens_total", "dynrubric_router_variant_weight",
                 "dynrubric_producer_dropped_total"):
        assert name in metrics


def test_a_dead_replica_is_retried_then_reloaded_when_back(stack):
    """Kill the canary engine: canary users are served by stable; the fleet restarts it, the router reloads it."""
    set_traffic(stack, 1.0, "exp-dead")
    stack.fleet.process("transformers-canary").kill()
    r = chat(stack, "someone")
    assert r.status_code == 200
    assert r.headers["x-dynrubric-variant"] == "stable"
    assert stack.router_state()["counters"]["exp-dead"]["canary"]["errors"] >= 1
    # the fleet restarts it; the router reloads its variant's weights and routes to it again
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if chat(stack, "someone").headers["x-dynrubric-variant"] == "canary":
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the restarted canary engine never served again")
    set_traffic(stack, 0.0, "exp-dead")
