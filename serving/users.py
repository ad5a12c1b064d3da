"""Simulated users: prompts from the shipped prompt file through the router, feedback from a checkable signal.

Each user has a fixed key (so the router's sticky assignment applies) and sends prompts drawn from
the shipped prompt file. The response is checked against the prompt's checkable field (the answer
of an arithmetic question, a word a constrained answer must contain); the user then gives a thumbs
up when the check passes and a thumbs down when it fails, flipped with probability `noise`, rates
only a share of responses, and asks to regenerate a failed answer with probability `regenerate_p`.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dynrubric.errors import DynrubricError


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    text: str
    answer: str | None = None  # arithmetic: the number the response must state
    must_include: tuple[str, ...] = ()  # constraint: words the response must contain

    def check(self, response: str) -> bool:
        """The checkable signal: is this response right, as far as a program can tell?"""
        text = response.lower()
        if self.answer is not None:
            numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
            if self.answer.lower() not in numbers:
                return False
        return all(w.lower() in text for w in self.must_include)


def load_prompts(path: Path) -> list[Prompt]:
    """The prompts of a JSONL prompt file that carry a checkable field (`answer` or `must_include`)."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            p = Prompt(id=str(d["id"]), kind=str(d.get("kind", "")), text=str(d["prompt"]),
                       answer=None if d.get("answer") is None else str(d["answer"]),
                       must_include=tuple(d.get("must_include") or ()))
        except (ValueError, KeyError, TypeError) as e:
            raise DynrubricError(f"{path} line {n} is not a prompt record: {e}",
                                 "each line: {\"id\", \"kind\", \"prompt\", \"answer\" or \"must_include\"}") from None
        if p.answer is not None or p.must_include:
            prompts.append(p)
    return prompts


@dataclass
class Outcome:
    request_id: str
    user: str
    variant: str
    policy_version: str
    ok: bool
    feedback: list[str]


class SimulatedUsers:
    def __init__(self, router_url: str, prompts: Sequence[Prompt], *, n_users: int = 50, noise: float = 0.1,
                 rated_share: float = 0.9, regenerate_p: float = 0.5, max_tokens: int = 48, seed: int = 0,
                 timeout_s: float = 300.0):
        if not prompts:
            raise ValueError("simulated users need at least one checkable prompt")
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

    def _draw(self) -> tuple[str, Prompt, float, float, float]:
        with self._lock:  # one seeded stream of choices, whatever the thread interleaving
            r = self._rng
            return r.choice(self.users), r.choice(self.prompts), r.random(), r.random(), r.random()

    def one(self, client: httpx.Client) -> Outcome | None:
        user, prompt, u_rate, u_noise, u_regen = self._draw()
        resp = client.post(f"{self.router_url}/v1/chat/completions", headers={"x-user-key": user}, json={
            "messages": [{"role": "user", "content": prompt.text}], "max_tokens": self.max_tokens,
            "temperature": 0.0,
        })
        if resp.status_code != 200:
            return None
        rid = resp.headers["x-request-id"]
        ok = prompt.check(resp.json()["choices"][0]["message"]["content"] or "")
        feedback = []
        if u_rate < self.rated_share:
            liked = ok if u_noise >= self.noise else not ok
            feedback.append("thumbs_up" if liked else "thumbs_down")
        if not ok and u_regen < self.regenerate_p:
            feedback.append("regenerate")
        for kind in feedback:
            client.post(f"{self.router_url}/v1/feedback", headers={"x-user-key": user},
                        json={"request_id": rid, "kind": kind}).raise_for_status()
        return Outcome(rid, user, resp.headers["x-dynrubric-variant"], resp.headers["x-dynrubric-policy-version"], ok,
                       feedback)

    def run(self, requests: int, concurrency: int = 2) -> dict[str, Any]:
        """Send `requests` requests; a summary per variant (requests, checks passed, failures)."""
        with httpx.Client(timeout=self.timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda _: self.one(client), range(requests)))
        done = [o for o in outcomes if o is not None]
        by_variant: dict[str, Counter] = {}
        for o in done:
            c = by_variant.setdefault(o.variant, Counter())
            c["requests"] += 1
            c["ok"] += o.ok
        return {"failed_requests": len(outcomes) - len(done),
                "variants": {v: dict(c) for v, c in by_variant.items()}, "outcomes": done}
