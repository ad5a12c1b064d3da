"""Real reward-server processes for tests, and OpenRLHF 0.11.2's own single-turn executor as the client.

The client side runs `openrlhf.utils.agent.SingleTurnAgentExecutor.execute`, unmodified: it tokenizes
the prompt, asks an `llm_engine` for the response, decodes prompt + response with special tokens and
POSTs one sample per request, cycling the reward URLs. Only the `llm_engine` is ours: it hands back
responses chosen (or generated) beforehand, since sampling is not what these tests are about.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from dynrubric.ports import free_port

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-reward-token"


def judge_env(model_dir: Path | str, generator_max_tokens: int = 16) -> dict[str, str]:
    """The DYNRUBRIC_* settings of a test judge: one model writes the rubrics and gives the verdicts,
    rubrics stay short and a failed one is not retried, so a small model scores a set quickly."""
    return {
        "DYNRUBRIC_MODELS__GENERATOR": str(model_dir),
        "DYNRUBRIC_MODELS__VERIFIER": str(model_dir),
        "DYNRUBRIC_RUBRIC__GENERATOR_MAX_TOKENS": str(generator_max_tokens),
        "DYNRUBRIC_RUBRIC__RETRIES": "0",
        "DYNRUBRIC_RUBRIC__PROMPT_ONLY_RETRIES": "0",
    }


@dataclass
class Replica:
    url: str
    process: subprocess.Popen
    log: Path

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)

    def metric(self, name: str, labels: str = "") -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(name + (labels and "{" + labels + "}")) and not line.startswith("#"):
                head, value = line.rsplit(" ", 1)
                if head == name + (f"{{{labels}}}" if labels else ""):
                    return float(value)
        return 0.0


@contextlib.contextmanager
def reward_replicas(
    count: int, env: dict[str, str], tmp: Path, start_timeout_s: float = 240
) -> Iterator[list[Replica]]:
    """`count` `dynrubric serve-reward` processes that know each other as replicas."""
    ports = [free_port() for _ in range(count)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas: list[Replica] = []
    try:
        for port, url in zip(ports, urls, strict=True):
            log = tmp / f"reward-{port}.log"
            full_env = {
                **os.environ,
                "DYNRUBRIC_REWARD_SERVER__TOKEN": TOKEN,
                "DYNRUBRIC_REWARD_SERVER__REPLICA_URLS": "[" + ",".join(f'"{u}"' for u in urls) + "]",
                "DYNRUBRIC_REWARD_SERVER__SELF_URL": url,
                "DYNRUBRIC_ENGINE__THREADS": "1",
                **env,
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "dynrubric", "serve-reward", "--port", str(port)],
                cwd=REPO,
                env=full_env,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
            )
            replicas.append(Replica(url, proc, log))
        deadline = time.monotonic() + start_timeout_s
        for r in replicas:
            while True:
                if r.process.poll() is not None:
                    raise RuntimeError(f"reward server exited: {r.log.read_text()[-3000:]}")
                try:
                    if httpx.get(f"{r.url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"reward server did not start: {r.log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield replicas
    finally:
        for r in replicas:
            r.process.terminate()
        for r in replicas:
            try:
                r.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait()


class CannedLLM:
    """The `llm_engine` OpenRLHF's executor awaits: returns the given response token ids per prompt."""

    def __init__(self, responses: dict[tuple[int, ...], list[list[int]]]):
        self.responses = {k: list(v) for k, v in responses.items()}

    async def generate(self, prompt_token_ids: list[int], params: Any, multi_modal_data: Any = None) -> Any:
        ids = self.responses[tuple(prompt_token_ids)].pop(0)
        out = SimpleNamespace(token_ids=ids, text="", finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[out])


def openrlhf_rollout(
    urls: list[str], tokenizer: Any, prompts: list[str], responses: list[list[str]]
) -> list[dict[str, Any]]:
    """Run OpenRLHF's SingleTurnAgentExecutor for every (prompt, response) concurrently, as its rollout
    does for the n samples of each prompt; return its outputs in input order (prompt-major)."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    executor = SingleTurnAgentExecutor(remote_rm_url=urls)
    canned: dict[tuple[int, ...], list[list[int]]] = {}
    jobs = []
    for prompt, resp in zip(prompts, responses, strict=True):
        key = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        for r in resp:
            # vLLM's token_ids end with the EOS token when a response stops
            canned.setdefault(key, []).append(tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id])
            jobs.append(prompt)
    llm = CannedLLM(canned)
    params = SimpleNamespace(max_tokens=256, logprobs=None)

    async def run() -> list[dict[str, Any]]:
        return await asyncio.gather(*(executor.execute(p, None, params, 4096, tokenizer, llm) for p in jobs))

    return asyncio.run(run())
