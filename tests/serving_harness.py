"""What the serving tests share: a fleet + router + controller stack on real processes and a real broker."""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from dynrubric.config import GateConfig, KafkaConfig, RolloutConfig
from dynrubric.ports import free_port
from dynrubric.registry import Registry
from serving.fleet import EngineSpec, Fleet, spread_cores
from serving.online import OnlineMetrics
from serving.rollout import Controller, RolloutStore, RouterClient
from serving.router import Replica, Router, RouterState, Weights
from streaming.events import FEEDBACK_TOPIC, QUERY_LOG_TOPIC, ChatMessage
from streaming.producer import EventProducer
from streaming.prompt_bank import PromptItem

TOKEN = SecretStr("test-token")

# Checkable prompts SmolLM2-135M answers right about half the time at temperature 0 and damaged weights never:
# enough signal for a rollout test that ends in minutes. Their ground truth is what the text states (a computed
# answer, a required word), checked as users, the judge and the evaluation all check it.
SIGNAL_PROMPTS = [
    ("add-7-5", "arithmetic", "What is 7 + 5? Answer with the number only."),
    ("mul-3-4", "arithmetic", "What is 3 * 4?"),
    ("add-2-2", "arithmetic", "What is 2 + 2?"),
    ("capital-fr", "instruction", "Name the capital of France. Include the word 'Paris'."),
    ("sky", "instruction", "What color is the sky? Include the word 'blue'."),
    ("add-12-30", "arithmetic", "What is 12 + 30?"),
]


def signal_prompts() -> list[PromptItem]:
    return [
        PromptItem(id=i, kind=kind, messages=[ChatMessage(role="user", content=text)])
        for i, kind, text in SIGNAL_PROMPTS
    ]


def wait_for(condition, timeout_s: float, what: str, every_s: float = 0.2):
    """Poll `condition` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class ThreadServer:
    """A uvicorn server for an app, in a thread of the test process."""

    def __init__(self, app, port: int):
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def damage(model_dir: Path, out: Path, scale: float = 2.0) -> Path:
    """A copy of a model whose matrices drown in noise: it answers with garbage."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    for f in out.glob("*.safetensors"):
        sd = load_file(f)
        g = torch.Generator().manual_seed(0)
        sd = {
            k: (v + torch.randn(v.shape, generator=g) * v.float().std() * scale).to(v.dtype) if v.ndim == 2 else v
            for k, v in sd.items()
        }
        save_file(sd, f, metadata={"format": "pt"})
    return out


@dataclass
class Stack:
    registry: Registry
    fleet: Fleet
    router: Router
    router_server: ThreadServer
    producer: EventProducer
    bootstrap: str
    state_dir: Path

    @property
    def router_url(self) -> str:
        return self.router_server.url

    def controller(
        self,
        rollout: RolloutConfig,
        gate: GateConfig,
        sleep=time.sleep,
        judge=None,
        metrics: CollectorRegistry | None = None,
    ) -> Controller:
        """A controller as a new process would build it: its online metrics resume from the stack's state file."""
        online = OnlineMetrics(
            self.bootstrap,
            QUERY_LOG_TOPIC,
            FEEDBACK_TOPIC,
            group_id=f"gate-{self.state_dir.name}",
            state_path=self.state_dir / "online.json",
        )
        return Controller(
            self.registry,
            RolloutStore(self.registry),
            RouterClient(self.router_url, TOKEN),
            online,
            rollout,
            gate,
            metrics=metrics,
            sleep=sleep,
            log=print,
            judge=judge,
        )

    def router_state(self) -> dict:
        return httpx.get(f"{self.router_url}/v1/router/state").json()


def start_stack(
    tmp: Path,
    bootstrap: str,
    base_model: Path,
    kind: str,
    health_interval_s: float = 1.0,
    max_restarts: int = 5,
    stable_server=None,
    shadow_rate: float = 0.0,
) -> Stack:
    """Registry with v0 stable, a two-engine fleet (stable + canary) on v0, the router in-process.

    `stable_server` (the session's `vllm_server`, serving `base_model`) stands in for the fleet's
    stable engine, so a module starts one vLLM engine instead of two. Only its weights are reloaded
    (with a copy of the same weights on promotion), so other tests still see the model they expect.
    """
    registry = Registry(tmp / "registry" / "registry.sqlite")
    v0 = registry.register(base_model, None, 0, {}, version="v0")
    registry.promote("v0")
    variants = ("canary",) if stable_server is not None else ("stable", "canary")
    specs = [
        EngineSpec(f"{kind}-{variant}", variant, kind, free_port(), v0.path, "v0", cpus=spread_cores(i + 1))
        for i, variant in enumerate(variants)
    ]
    fleet = Fleet(
        specs, tmp / "fleet", CollectorRegistry(), health_interval_s=health_interval_s, max_restarts=max_restarts
    )
    try:
        fleet.start(timeout_s=600)
    except BaseException:
        fleet.stop()
        raise
    metrics = CollectorRegistry()
    producer = EventProducer(KafkaConfig(bootstrap_servers=bootstrap), metrics)
    weights = Weights("v0", str(v0.path))
    replicas = [Replica(s.name, s.variant, s.base_url, "v0") for s in specs]
    if stable_server is not None:
        replicas.insert(
            0,
            Replica(
                "vllm-session-stable",
                "stable",
                stable_server.base_url,
                "v0",
                served_model=stable_server.served_model_name,
            ),
        )
    state = RouterState(replicas, desired={"stable": weights, "canary": weights})
    router = Router(
        state,
        producer,
        metrics,
        token=TOKEN,
        timeout_s=120,
        health_interval_s=health_interval_s,
        shadow_rate=shadow_rate,
        seed=0,
    )
    server = ThreadServer(router.app, free_port()).__enter__()
    return Stack(registry, fleet, router, server, producer, bootstrap, tmp)


def stop_stack(stack: Stack) -> None:
    stack.router_server.__exit__(None, None, None)
    stack.fleet.stop()
    stack.producer.close()


def read_topic(bootstrap: str, topic: str) -> list[dict]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    end = consumer.end_offsets(parts)
    out: list[dict] = []
    while any(consumer.position(tp) < end[tp] for tp in parts):
        for records in consumer.poll(timeout_ms=1000).values():
            out.extend(json.loads(r.value) for r in records)
    consumer.close()
    return out


def drive(stack: Stack, controller: Controller, rollout_id: str, users, batch: int = 8, timeout_s: float = 900) -> dict:
    """Run the controller in a thread while simulated users send traffic; return the final rollout and outcomes."""
    result: dict = {}

    def run() -> None:
        try:
            result["rollout"] = controller.run(rollout_id)
        except BaseException as e:  # surfaced by the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcomes = []
    failed = 0
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        summary = users.run(batch, concurrency=2)
        outcomes += summary["outcomes"]
        failed += summary["failed_requests"]
    thread.join(timeout=60)
    if "error" in result:
        raise result["error"]
    if "rollout" not in result:
        raise AssertionError(f"rollout {rollout_id} did not finish in {timeout_s} s")
    stack.producer.flush()
    return {"rollout": result["rollout"], "outcomes": outcomes, "failed_requests": failed}
