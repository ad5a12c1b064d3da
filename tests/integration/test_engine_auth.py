"""An engine started with vLLM's --api-key refuses callers without the key; the router sends
serving.engine_api_key on every engine call (k8s: the Secret's vllm-api-key)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from dynrubric.config import KafkaConfig
from dynrubric.engines.hf import TransformersEngine
from dynrubric.ports import free_port
from serving.engine_server import build_app
from serving.router import Replica, Router, RouterState, Weights
from streaming.producer import EventProducer
from tests.serving_harness import ThreadServer

KEY = "engine-key"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def vllm_auth_middleware():
    """vLLM's own --api-key middleware, loaded from the installed vllm's source file: importing the vllm
    package takes seconds and a model load, and this file needs only starlette."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location(
        "vllm_authenticate", root / "entrypoints" / "serve" / "middleware" / "authenticate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AuthenticationMiddleware


def test_router_calls_a_keyed_engine_with_its_key(tiny_model_dir, kafka_broker):
    engine_app = build_app(TransformersEngine(tiny_model_dir, threads=1, policy_version="v0"), "policy")
    engine_app.add_middleware(vllm_auth_middleware(), tokens=[KEY])
    with ThreadServer(engine_app, free_port()) as engine:
        assert httpx.post(f"{engine.url}/v1/chat/completions", json=dict(CHAT, model="policy")).status_code == 401
        assert httpx.get(f"{engine.url}/health").status_code == 200  # probes need no key
        codes = {}
        for key in (None, KEY):
            metrics = CollectorRegistry()
            producer = EventProducer(KafkaConfig(bootstrap_servers=kafka_broker), metrics)
            weights = Weights("v0", str(tiny_model_dir))
            state = RouterState(
                [Replica("e", "stable", engine.url, "v0")], desired={"stable": weights, "canary": weights}
            )
            router = Router(state, producer, metrics, token=None, engine_api_key=SecretStr(key) if key else None)
            try:
                with ThreadServer(router.app, free_port()) as served:
                    codes[key] = httpx.post(f"{served.url}/v1/chat/completions", json=CHAT, timeout=120).status_code
            finally:
                producer.close()
    assert codes == {None: 401, KEY: 200}
