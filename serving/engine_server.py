"""A transformers engine behind the slice of vLLM's HTTP API that the router and fleet use.

Same paths and bodies as a vLLM server started with VLLM_SERVER_DEV_MODE=1: `/v1/completions`,
`/v1/chat/completions` (streamed or not), `/v1/models`, `/health`, `POST /collective_rpc` with
`{"method": "reload_weights", "kwargs": {"weights_path": DIR}}` and `POST /reset_prefix_cache`.
It starts in seconds, so router and rollout tests that do not need vLLM itself use it. Like a dev-mode
vLLM it has an unauthenticated `/collective_rpc`, so it listens on loopback only.

`/health` also reports the policy_version served: the model's directory name at start, then the
name of the directory last reloaded (registry checkpoints live in `<storage>/<version>/`).

Weights that yield NaN or infinite logits (a corrupt checkpoint) answer HTTP 500 "non-finite logits"
(`NonFiniteLogits`) instead of sampling arbitrary tokens, so the router fails the request over to
stable and counts it as an error of the arm the user was assigned to.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    stop: list[str] | str | None = None
    stream: bool = False


class CompletionBody(_Sampling):
    prompt: str


class ChatBody(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)


class RpcBody(BaseModel):
    method: str
    kwargs: dict[str, Any] = Field(default_factory=dict)


def build_app(engine: Any, model_name: str) -> FastAPI:
    """The HTTP app over one `Engine` (generation is serialised: the engine is not thread-safe)."""
    from dynrubric.engines.base import GenerationRequest, NonFiniteLogits, SamplingParams

    app = FastAPI(title="dynrubric transformers engine")
    lock = threading.Lock()

    def run(prompt: str, body: _Sampling) -> tuple[str, str, int, int]:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop,
            frequency_penalty=body.frequency_penalty,
        )
        with lock:
            [[completion]] = engine.generate([GenerationRequest(prompt, params)])
            prompt_tokens = len(engine.tokenizer.encode(prompt, add_special_tokens=False))
        return completion.text, completion.finish_reason, prompt_tokens, len(completion.token_ids)

    def usage(p: int, c: int) -> dict[str, int]:
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def answer(prompt: str, body: _Sampling, chat: bool) -> Any:
        try:
            text, finish, p, c = await asyncio.to_thread(run, prompt, body)
        except NonFiniteLogits as e:  # an error, not random tokens: the router retries elsewhere and counts it
            raise HTTPException(500, f"non-finite logits: {e}") from e
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.stream:
            choice = {"index": 0, "finish_reason": finish}
            choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                    "usage": usage(p, c),
                }
            )

        def chunk(delta: str | None, finish_reason: str | None, with_usage: bool = False) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
            choice |= {"delta": {"content": delta} if delta is not None else {}} if chat else {"text": delta or ""}
            data: dict[str, Any] = {
                "id": rid,
                "object": obj + ".chunk" if chat else obj,
                "created": created,
                "model": model_name,
                "choices": [choice],
            }
            if with_usage:
                data["usage"] = usage(p, c)
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            yield chunk(text, None)
            yield chunk(None, finish, with_usage=True)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "policy_version": engine.policy_version}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        return await answer(body.prompt, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> Any:
        return await answer(engine.render_chat(body.messages), body, chat=True)

    @app.post("/collective_rpc")
    async def collective_rpc(body: RpcBody) -> dict[str, Any]:
        if body.method != "reload_weights" or "weights_path" not in body.kwargs:
            raise HTTPException(400, "only {'method': 'reload_weights', 'kwargs': {'weights_path': DIR}} is served")
        path = Path(body.kwargs["weights_path"])
        if not path.is_dir():
            raise HTTPException(400, f"weights_path {path} is not a directory")

        def load() -> None:
            with lock:
                engine.load_weights(path, path.name)

        try:
            await asyncio.to_thread(load)
        except Exception as e:  # the engine keeps its previous weights
            raise HTTPException(500, f"reload_weights failed: {e}") from e
        return {"results": [None]}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    import argparse

    import uvicorn

    from dynrubric.engines.hf import TransformersEngine
    from dynrubric.engines.vllm_server import LOOPBACK

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy-version", default=None)
    parser.add_argument("--served-model-name", default="policy")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    engine = TransformersEngine(args.model, threads=args.threads, policy_version=args.policy_version or args.model.name)
    uvicorn.run(build_app(engine, args.served_model_name), host=LOOPBACK, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
