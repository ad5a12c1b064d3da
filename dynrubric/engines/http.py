"""Engine over any OpenAI-compatible server, first of all vLLM (`/v1/completions`).

Prompts are sent as token ids, tokenized locally with the model's own tokenizer, so both engines
see exactly the same tokens. Next-token scores come from the top-`top_logprobs` list of one batched
one-token completion. A candidate outside that list has a probability below the k-th token's and is
scored -inf, unless `exact_missing`: then one more request per missing (prompt, candidate) appends it
to the prompt and reads its `prompt_logprobs`. That is exact but costly on vLLM, which neither
prefix-caches nor batches prompt_logprobs requests well (measured: a judge's 48 prompts x 4 missing
spellings queued 100k prompt tokens), so the verifier leaves it off.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import SecretStr

from dynrubric import http_clients
from dynrubric.config import EngineConfig
from dynrubric.engines.base import Completion, Engine, GenerationRequest
from dynrubric.errors import DynrubricError


class SharedServer:
    """One server that several engines take turns on: before its calls, an engine whose weights the server does
    not hold reloads them (`OpenAIHTTPEngine.load_weights`), so a policy and a rubric generator can share one
    vLLM server and neither ever generates with the other's weights.

    What the server holds is known only to the engines of this object, in this process. Where another process
    reloads the server too (the rounds' trainer, whose server `up`'s rollout judge borrows between rounds), or the
    server may have restarted onto its `--model`, `forget` before a batch of calls: the next engine to call then
    reloads its own weights."""

    def __init__(self) -> None:
        self.holder: tuple[str, str] | None = None  # (weights dir, version) the server holds now

    def forget(self) -> None:
        """The server may hold any weights now: every engine reloads its own before its next call."""
        self.holder = None


# a connection that broke after it was made (reset or closed under a request) while the server may well be up: in
# `make up` at b41a8a6 one request of a round's evaluation failed with ReadError, the vLLM server alive and its log
# clean, and the round failed with it (cause not found). Every call here is safe to send twice: seeded generations,
# log-probs, a reload of the same weights, a prefix cache reset.
DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class OpenAIHTTPEngine(Engine):
    def __init__(
        self,
        base_url: str,
        model_dir: Path,
        *,
        api_key: SecretStr | None = None,
        timeout_s: float = EngineConfig.model_fields["timeout_s"].default,  # one default: the schema's
        top_logprobs: int = 20,
        exact_missing: bool = False,
        concurrency: int = EngineConfig.model_fields["concurrency"].default,
        policy_version: str | None = None,
        shared: SharedServer | None = None,
    ):
        from transformers import AutoTokenizer, GenerationConfig

        self.base_url = base_url.rstrip("/")
        self.model_dir = Path(model_dir)
        self.top_logprobs = top_logprobs
        self.exact_missing = exact_missing
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
        self._client = http_clients.client(base_url=self.base_url, timeout=timeout_s, headers=headers)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._eos_ids = {self._tokenizer.eos_token_id} - {None}
        if (self.model_dir / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            self._eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.model_name = self._served_model()
        self.policy_version = policy_version or self.model_name
        self.shared = shared
        self.weights: tuple[str, str] | None = None  # (dir, version) this engine last loaded

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            try:
                response = self._client.request(method, path, **kwargs)
            except DROPPED:  # the connection, not the server, failed: sent once more on a new one
                response = self._client.request(method, path, **kwargs)
        except httpx.ReadTimeout:  # connected and sent: the server is there, but slower than the timeout
            raise DynrubricError(
                f"engine at {self.base_url} did not answer {path} within {self.timeout_s:.0f} s",
                "raise engine.timeout_s (a batch of rubrics under a grammar takes minutes on a busy CPU), "
                "or give the server more cores",
            ) from None
        except httpx.TransportError as e:
            raise DynrubricError(
                f"engine at {self.base_url} is unreachable ({type(e).__name__})",
                "start the server (`dynrubric fleet up`) or fix engine.base_url",
            ) from None
        if response.status_code >= 400:
            raise DynrubricError(
                f"engine at {self.base_url} answered {response.status_code} to {path}: {response.text[:300]}",
                "check the request parameters against the server's limits (max_model_len, max_logprobs)",
            )
        return response.json() if response.content else None

    def _served_model(self) -> str:
        models = self._request("GET", "/v1/models")["data"]
        if not models:
            raise DynrubricError(f"engine at {self.base_url} serves no model", "start it with a --model")
        served: str = models[0]["id"]
        return served

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids

    # ------------------------------------------------------------------ generation
    def _complete(self, request: GenerationRequest) -> list[Completion]:
        p = request.params
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": self.encode(request.prompt),
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "n": p.n,
            "stop": list(p.stop) or None,
            "return_token_ids": True,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if p.frequency_penalty:
            body["frequency_penalty"] = p.frequency_penalty
        if p.logprobs:
            body["logprobs"] = 0  # the sampled token's own logprob
        if p.json_schema is not None:
            # vLLM's structured outputs; compact JSON (as the in-process engine) when the server runs
            # with disable_any_whitespace, as `VllmServer` starts it
            body["structured_outputs"] = {"json": json.loads(p.json_schema)}
        choices = sorted(self._request("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            ids = list(c.get("token_ids") or self.encode(c["text"]))
            logprobs = None
            if p.logprobs and c.get("logprobs"):
                logprobs = tuple(float(x) for x in c["logprobs"]["token_logprobs"])
            stop_id = stop_logprob = None
            if ids and ids[-1] in self._eos_ids:  # like the in-process engine: the stop token is not output
                stop_id, ids = ids[-1], ids[:-1]
                if logprobs is not None:
                    stop_logprob, logprobs = logprobs[len(ids)], logprobs[: len(ids)]
            finish: Literal["stop", "length"] = "length" if c.get("finish_reason") == "length" else "stop"
            out.append(
                Completion(
                    text=c["text"],
                    token_ids=tuple(ids),
                    finish_reason=finish,
                    logprobs=logprobs,
                    stop_token_id=stop_id,
                    stop_logprob=stop_logprob,
                )
            )
        return out

    def _take_turn(self) -> None:
        """On a shared server: make it hold this engine's weights before this engine's calls."""
        if self.shared is not None and self.weights is not None and self.shared.holder != self.weights:
            self.load_weights(Path(self.weights[0]), self.weights[1])

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        self._take_turn()
        # vLLM batches concurrent requests itself; sending them at once is what fills its batch
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._complete, requests))

    # ------------------------------------------------------------------ scoring
    def score_next_token(self, prompts: Sequence[str], candidates: Sequence[str]) -> list[dict[str, float]]:
        self._take_turn()
        token_of = self.candidate_token_ids(candidates)
        encoded = [self.encode(p) for p in prompts]
        body = {
            "model": self.model_name,
            "prompt": encoded,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": self.top_logprobs,
            "return_tokens_as_token_ids": True,
        }
        choices = sorted(self._request("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"])
        scores: list[dict[str, float]] = []
        missing: list[tuple[int, str]] = []
        for i, choice in enumerate(choices):
            top = choice["logprobs"]["top_logprobs"][0]
            by_id = {int(k.split(":", 1)[1]): float(v) for k, v in top.items()}
            row = {}
            for cand, tid in token_of.items():
                if tid in by_id:
                    row[cand] = by_id[tid]
                elif self.exact_missing:
                    missing.append((i, cand))
                else:
                    row[cand] = -math.inf
            scores.append(row)
        if missing:
            exact = self._exact_logprobs([encoded[i] + [token_of[c]] for i, c in missing])
            for (i, cand), lp in zip(missing, exact, strict=True):
                scores[i][cand] = lp
        return scores

    def _exact_logprobs(self, sequences: list[list[int]]) -> list[float]:
        """The logprob of each sequence's last token given the rest, from prompt_logprobs."""
        body = {
            "model": self.model_name,
            "prompt": sequences,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        choices = sorted(self._request("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"])
        out = []
        for seq, choice in zip(sequences, choices, strict=True):
            last = choice["prompt_logprobs"][-1] or {}
            entry = last.get(str(seq[-1]))
            out.append(float(entry["logprob"]) if entry else -math.inf)
        return out

    # ------------------------------------------------------------------ weights
    def use_weights(self, path: Path, version: str) -> None:
        """Serve the weights under `path` from now on: on a shared server they are reloaded at this engine's next
        call (its turn), not now; elsewhere `load_weights` reloads them now."""
        if self.shared is None:
            self.load_weights(path, version)
            return
        self.weights = (str(path), version)
        self.policy_version = version

    def load_weights(self, path: Path, version: str) -> None:
        self._request(
            "POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        )
        self._request("POST", "/reset_prefix_cache")
        self.policy_version = version
        self.weights = (str(path), version)
        if self.shared is not None:
            self.shared.holder = self.weights
