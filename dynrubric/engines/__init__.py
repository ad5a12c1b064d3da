"""Engines: one interface (base.Engine), an in-process and an OpenAI-compatible HTTP implementation."""

from __future__ import annotations

from typing import Literal

from dynrubric.config import Settings
from dynrubric.engines.base import Completion, Engine, GenerationRequest, SamplingParams

Role = Literal["policy", "generator", "verifier"]

__all__ = ["Completion", "Engine", "GenerationRequest", "SamplingParams", "build_engine"]


def build_engine(settings: Settings, role: Role) -> Engine:
    """The engine for a role, as configured: in-process transformers or an OpenAI-compatible server."""
    from dynrubric import modelcache

    model_dir = modelcache.resolve(settings.paths.resolved_home(), getattr(settings.models, role))
    cfg = settings.engine
    if cfg.kind == "transformers":
        from dynrubric.engines.hf import TransformersEngine

        return TransformersEngine(
            model_dir,
            dtype=cfg.dtype,
            threads=cfg.threads,
            max_batch_size=cfg.max_batch_size,
            device=cfg.device,
        )
    from dynrubric.engines.http import OpenAIHTTPEngine

    return OpenAIHTTPEngine(cfg.base_url, model_dir, api_key=cfg.api_key, timeout_s=cfg.timeout_s)
