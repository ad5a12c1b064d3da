"""Simulated users: train prompts of the shipped prompt bank through the router, feedback from what they prefer.

Each user has a fixed key (so the router's sticky assignment applies) and sends prompts drawn from the
shipped prompt bank (`dynrubric/data/prompts.jsonl`), only its `split == "train"` lines (a line without a
split, from a bank that predates it, counts as train): dev and test prompts are never served, so never
logged, so never trained on. A request goes to an open prompt with probability `open_share` (0.5) when the
bank has both kinds, so the traffic is half open whatever the sources yield. Users rate only a share of
responses (`rated_share`) and ask to regenerate an answer they did not like with probability `regenerate_p`.
What they like depends on the prompt:

- a checkable prompt (instruction, arithmetic): the response is checked against the prompt's ground truth
  (`streaming.prompt_bank.check`: the official IFEval checkers for the instructions it states, the computed
  answer of its arithmetic; the same check the judge's derived items and the evaluation of versions use);
  thumbs up when the check passes, down when it fails, flipped with probability `noise` (10 %);
- an open prompt (Arena-Hard, WritingBench, HealthBench; no checker): the user's preference is the answer's
  closeness to what strong models and experts wrote for that prompt, with noise:

      q     = open_quality(conversation, answer, references[:40 words each], criteria)  (rubric/open_quality.py)
      thumb = up  if  q + open_sigma * z > open_threshold,  z ~ N(0, 1),  else down

  with `open_sigma` = 0.05 and `open_threshold` = 0.045 (`OPEN_SIGMA`, `OPEN_THRESHOLD`): an answer at
  quality 0 gets a thumbs up 18 % of the time, one at 0.1 86 %, one at 0.2 or more always (> 99.9 %). The
  threshold makes the mean P(thumbs up) 0.50 over base SmolLM2-135M's own answers (greedy, 48 tokens, the
  served chat template) to 32 train-split open prompts (20 Arena-Hard, 8 WritingBench, 4 HealthBench, drawn
  with random.Random(0)): 18 of them score exactly 0 (nothing in common with the strong answers' first 40
  words), the others 0.065 to 0.5. `z` is the same seeded uniform draw that flips a checkable prompt's thumb,
  through the normal quantile, so the draws of a seed are unchanged.

What any reward arm can see of this preference: only the thumbs (and regenerates) on train prompts, which
feed the generator's anchor rankings (R_anchor) and the judge-vs-users agreement; never the references or
criteria themselves, which live only in the bank line and here. No reward reads open_quality.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import httpx

from dynrubric import http_clients
from streaming.prompt_bank import PromptItem, check, load_prompts

#: noise on an open prompt's quality before the threshold (module docstring)
OPEN_SIGMA = 0.05
#: mean P(thumbs up) 0.50 on base SmolLM2-135M's answers to 32 train-split open prompts (module docstring)
OPEN_THRESHOLD = 0.045
#: production traffic is mostly open: half the requests go to open prompts when the bank has both kinds
OPEN_SHARE = 0.5


def served(p: PromptItem) -> bool:
    """A prompt the users may send: a train line of the bank (a line without a split counts as train)."""
    return p.split in (None, "train")


def load_checkable(path: Path | None = None) -> list[PromptItem]:
    """The train prompts of the shipped prompt bank (or `path`) that carry ground truth."""
    return [p for p in load_prompts(path) if p.kind != "open" and served(p)]


def load_served(path: Path | None = None) -> list[PromptItem]:
    """Every train prompt of the shipped prompt bank (or `path`): checkable and open."""
    return [p for p in load_prompts(path) if served(p)]


def open_thumb(quality: float, u: float, sigma: float = OPEN_SIGMA, threshold: float = OPEN_THRESHOLD) -> bool:
    """An open prompt's thumb: up when quality + sigma * z > threshold, z the standard normal quantile of the
    uniform draw `u` in [0, 1)."""
    z = NormalDist().inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
    return quality + sigma * z > threshold


@dataclass
class Outcome:
    request_id: str
    user: str
    variant: str
    policy_version: str
    ok: bool | None  # the ground truth's verdict; None on an open prompt (no checker)
    feedback: list[str]
    quality: float | None = None  # open_quality of the answer on an open prompt


class SimulatedUsers:
    def __init__(
        self,
        router_url: str,
        prompts: Sequence[PromptItem],
        *,
        n_users: int = 50,
        noise: float = 0.1,
        open_sigma: float = OPEN_SIGMA,
        open_threshold: float = OPEN_THRESHOLD,
        rated_share: float = 0.9,
        regenerate_p: float = 0.5,
        max_tokens: int = 48,
        seed: int = 0,
        timeout_s: float = 300.0,
        open_share: float = OPEN_SHARE,
    ):
        if not prompts:
            raise ValueError("simulated users need at least one prompt")
        if not all(served(p) for p in prompts):
            raise ValueError("simulated users send only train prompts of the bank (dev and test are never served)")
        if open_sigma < 0:
            raise ValueError("open_sigma must be >= 0")
        if not 0 <= open_share <= 1:
            raise ValueError("open_share must be in [0, 1]")
        self.router_url = router_url.rstrip("/")
        self.prompts = list(prompts)
        # the traffic's mix: a request goes to an open prompt with probability open_share when the bank has both
        # kinds (the bank's own counts would make the mix whatever the sources yield)
        self.open_prompts = [p for p in self.prompts if p.kind == "open"]
        self.checkable_prompts = [p for p in self.prompts if p.kind != "open"]
        self.open_share = open_share
        self.users = [f"sim-user-{seed}-{i}" for i in range(n_users)]
        self.noise = noise
        self.open_sigma = open_sigma
        self.open_threshold = open_threshold
        self.rated_share = rated_share
        self.regenerate_p = regenerate_p
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _draw(self) -> tuple[str, PromptItem, float, float, float]:
        with self._lock:  # one seeded stream of choices, whatever the thread interleaving
            r = self._rng
            user = r.choice(self.users)
            if self.open_prompts and self.checkable_prompts:
                prompt = r.choice(self.open_prompts if r.random() < self.open_share else self.checkable_prompts)
            else:
                prompt = r.choice(self.prompts)
            return user, prompt, r.random(), r.random(), r.random()

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
        answer = resp.json()["choices"][0]["message"]["content"] or ""
        ok, quality, liked = self.judge(prompt, answer, u_noise)
        feedback = []
        if u_rate < self.rated_share:
            feedback.append("thumbs_up" if liked else "thumbs_down")
        if not (ok if ok is not None else liked) and u_regen < self.regenerate_p:
            feedback.append("regenerate")
        for kind in feedback:
            client.post(
                f"{self.router_url}/v1/feedback", headers={"x-user-key": user}, json={"request_id": rid, "kind": kind}
            ).raise_for_status()
        return Outcome(
            rid,
            user,
            resp.headers["x-dynrubric-variant"],
            resp.headers["x-dynrubric-policy-version"],
            ok,
            feedback,
            quality,
        )

    def judge(self, prompt: PromptItem, answer: str, u_noise: float) -> tuple[bool | None, float | None, bool]:
        """(the check's verdict or None, open_quality or None, whether the user likes the answer) for the
        uniform draw `u_noise` (module docstring)."""
        if prompt.kind == "open":
            quality = prompt.open_quality(answer)
            return None, quality, open_thumb(quality, u_noise, self.open_sigma, self.open_threshold)
        ok = bool(check(prompt, answer))
        return ok, None, ok if u_noise >= self.noise else not ok

    def run(self, requests: int, concurrency: int = 2) -> dict[str, Any]:
        """Send `requests` requests; a summary per variant (requests, checks passed, open prompts), failures."""
        with http_clients.client(timeout=self.timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda _: self.one(client), range(requests)))
        done = [o for o in outcomes if o is not None]
        by_variant: dict[str, Counter] = {}
        for o in done:
            c = by_variant.setdefault(o.variant, Counter())
            c["requests"] += 1
            c["ok"] += o.ok is True
            c["open"] += o.ok is None
        return {
            "failed_requests": len(outcomes) - len(done),
            "variants": {v: dict(c) for v, c in by_variant.items()},
            "outcomes": done,
        }
