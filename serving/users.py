"""Simulated users: prompts from the shipped prompt bank through the router, feedback from the prompt's ground truth.

Each user has a fixed key (so the router's sticky assignment applies) and sends prompts drawn from
the shipped prompt bank (`dynrubric/data/prompts.jsonl`). The response is checked against the
prompt's ground truth (`streaming.prompt_bank.check`: the official IFEval checkers for the instructions it
states, the computed answer of its arithmetic; the same check the judge's derived items and the
evaluation of versions use); the user then gives a thumbs up when the check passes and a thumbs down
when it fails, flipped with probability `noise`, rates only a share of responses, and asks to
regenerate a failed answer with probability `regenerate_p`.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dynrubric import http_clients
from streaming.prompt_bank import PromptItem, check, load_prompts


def load_checkable(path: Path | None = None) -> list[PromptItem]:
    """The prompts of the shipped prompt bank (or `path`) that carry ground truth."""
    return [p for p in load_prompts(path) if p.kind != "open"]


@dataclass
class Outcome:
    request_id: str
    user: str
    variant: str
    policy_version: str
    ok: bool
    feedback: list[str]


class SimulatedUsers:
    def __init__(
        self,
        router_url: str,
        prompts: Sequence[PromptItem],
        *,
        n_users: int = 50,
        noise: float = 0.1,
        rated_share: float = 0.9,
        regenerate_p: float = 0.5,
        max_tokens: int = 48,
        seed: int = 0,
        timeout_s: float = 300.0,
    ):
        if not prompts:
            raise ValueError("simulated users need at least one checkable prompt")
        if any(p.kind == "open" for p in prompts):
            raise ValueError("open prompts have no checkable signal; use load_checkable()")
        self.router_url = router_url.rstrip("/")
        self.prompts = list(prompts)
        self.users = [f"sim-user-{seed}-{i}" for i in range(n_users)]
        self.noise = noise
        self.rated_share = rated_share
        self.regenerate_p = regenerate_p
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _draw(self) -> tuple[str, PromptItem, float, float, float]:
        with self._lock:  # one seeded stream of choices, whatever the thread interleaving
            r = self._rng
            return r.choice(self.users), r.choice(self.prompts), r.random(), r.random(), r.random()

    def one(self, client: httpx.Client) -> Outcome | None:
        user, prompt, u_rate, u_noise, u_regen = self._draw()
        resp = client.post(
            f"{self.router_url}/v1/chat/completions",
            headers={"x-user-key": user},
            json={
                "messages": [m.model_dump() for m in prompt.messages],
                "max_tokens": self.max_tokens,
                "temperature": 0.0,
            },
        )
        if resp.status_code != 200:
            return None
        rid = resp.headers["x-request-id"]
        ok = bool(check(prompt, resp.json()["choices"][0]["message"]["content"] or ""))
        feedback = []
        if u_rate < self.rated_share:
            liked = ok if u_noise >= self.noise else not ok
            feedback.append("thumbs_up" if liked else "thumbs_down")
        if not ok and u_regen < self.regenerate_p:
            feedback.append("regenerate")
        for kind in feedback:
            client.post(
                f"{self.router_url}/v1/feedback", headers={"x-user-key": user}, json={"request_id": rid, "kind": kind}
            ).raise_for_status()
        return Outcome(
            rid, user, resp.headers["x-dynrubric-variant"], resp.headers["x-dynrubric-policy-version"], ok, feedback
        )

    def run(self, requests: int, concurrency: int = 2) -> dict[str, Any]:
        """Send `requests` requests; a summary per variant (requests, checks passed, failures)."""
        with http_clients.client(timeout=self.timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda _: self.one(client), range(requests)))
        done = [o for o in outcomes if o is not None]
        by_variant: dict[str, Counter] = {}
        for o in done:
            c = by_variant.setdefault(o.variant, Counter())
            c["requests"] += 1
            c["ok"] += o.ok
        return {
            "failed_requests": len(outcomes) - len(done),
            "variants": {v: dict(c) for v, c in by_variant.items()},
            "outcomes": done,
        }
