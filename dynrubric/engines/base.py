"""The one interface everything that talks to a language model goes through.

Policy sampling, rubric generation, verification and serving all use `Engine`. Prompts are plain
text with the chat template already applied (`Engine.render_chat`), so the same prompt string means
the same tokens on every implementation.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # completions per request
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # return the logprob of each sampled token, in the distribution it was sampled from: penalties, grammar,
    # temperature and top-p applied (vLLM's processed_logprobs), what an importance weight divides by
    logprobs: bool = False
    # subtracted from a token's logit once per time the completion already holds it (OpenAI's and
    # vLLM's frequency_penalty); the prompt's tokens are not counted
    frequency_penalty: float = 0.0
    # a JSON Schema serialised as JSON text: every completion is JSON valid for it when it finishes
    # within max_tokens (finish_reason "stop"); a string keeps the params hashable
    json_schema: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or infinite logits: its weights are broken (a corrupt or diverged
    checkpoint). Sampling from such logits would return arbitrary tokens as if they were an answer."""


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Literal["stop", "length"]
    logprobs: tuple[float, ...] | None = None  # one per token in token_ids, when asked for
    # the end-of-sequence token the model sampled to stop (not in token_ids), and its logprob when asked for
    stop_token_id: int | None = None
    stop_logprob: float | None = None


class Engine(abc.ABC):
    """A language model behind `generate`, `score_next_token` and `load_weights`."""

    #: which weights the engine serves: a registry version id, or the model's name before any reload
    policy_version: str

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (chat template, token budgets)."""

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text: str = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return text

    def candidate_token_ids(self, candidates: Sequence[str]) -> dict[str, int]:
        """The first token of each candidate string (" Yes" -> its id)."""
        out: dict[str, int] = {}
        for c in candidates:
            ids = self.tokenizer.encode(c, add_special_tokens=False)
            if not ids:
                raise ValueError(f"candidate {c!r} encodes to no tokens")
            out[c] = ids[0]
        return out

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        """One list of `params.n` completions per request, in request order."""

    @abc.abstractmethod
    def score_next_token(self, prompts: Sequence[str], candidates: Sequence[str]) -> list[dict[str, float]]:
        """For each prompt, the log-probability of each candidate as the very next token.

        One batched call. Prompts that share a prefix have it computed once where the engine can.
        Each candidate is scored by its first token (`candidate_token_ids`).
        """

    @abc.abstractmethod
    def load_weights(self, path: Path, version: str) -> None:
        """Swap in the weights saved (HF safetensors) under `path`, now serving `version`."""

    def use_weights(self, path: Path, version: str) -> None:
        """Serve the weights under `path` from now on: an engine that shares its server reloads them at its next
        call (engines/http.py); the others now."""
        self.load_weights(path, version)

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing
        """Release processes, sessions and memory."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
