"""Engines: one interface (base.Engine), an in-process and an OpenAI-compatible HTTP implementation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from dynrubric.config import Settings
from dynrubric.engines.base import Completion, Engine, GenerationRequest, SamplingParams

Role = Literal["policy", "generator", "verifier"]

__all__ = [
    "Completion",
    "Engine",
    "GenerationRequest",
    "SamplingParams",
    "build_engine",
    "judge_engines",
    "one_shared_server",
]


def one_shared_server(url: str, in_process: Sequence[Role] = ()) -> dict[str, Any]:
    """The `engine` settings of every role on the one vLLM server at `url`, taking turns with their own weights
    (`engine.shared_servers`), but those `in_process`: what `dynrubric up`'s rounds and the benchmarks run on."""
    return {
        "kind": "openai-http",
        "base_url": url,
        "policy_url": None,
        "generator_url": None,
        "verifier_url": None,
        "shared_servers": True,
        "in_process": list(in_process),
    }


def _placement(settings: Settings, role: Role) -> tuple[str, str]:
    """Where a role's engine runs: ("transformers", "") in process, else ("openai-http", its server's URL)."""
    cfg = settings.engine
    if cfg.kind == "transformers" or role in cfg.in_process:
        return ("transformers", "")
    return ("openai-http", cfg.url_for(role))


def build_engine(settings: Settings, role: Role) -> Engine:
    """The engine for a role, as configured: in-process transformers (`engine.kind`, or the role in
    `engine.in_process`) or the OpenAI-compatible server of the role (`engine.<role>_url`, else `base_url`)."""
    from dynrubric import modelcache

    model_dir = modelcache.resolve(settings.paths.resolved_home(), getattr(settings.models, role))
    cfg = settings.engine
    kind, url = _placement(settings, role)
    if kind == "transformers":
        from dynrubric.engines.hf import TransformersEngine

        return TransformersEngine(
            model_dir,
            dtype=cfg.dtype,
            threads=cfg.threads,
            max_batch_size=cfg.max_batch_size,
            device=cfg.device,
        )
    from dynrubric.engines.http import OpenAIHTTPEngine

    return OpenAIHTTPEngine(url, model_dir, api_key=cfg.api_key, timeout_s=cfg.timeout_s, concurrency=cfg.concurrency)


def judge_engines(settings: Settings) -> tuple[Engine, Engine]:
    """(rubric generator, verifier): one engine when both roles have the same model in the same place, else two
    (close both: `verifier is generator` says whether they are one)."""
    generator = build_engine(settings, "generator")
    same = settings.models.verifier == settings.models.generator and _placement(settings, "verifier") == _placement(
        settings, "generator"
    )
    return generator, generator if same else build_engine(settings, "verifier")
