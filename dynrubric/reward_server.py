"""The OpenRLHF remote-reward server: set-conditioned rewards behind a per-prompt group barrier.

OpenRLHF 0.11.2 (`openrlhf/utils/agent.py`, SingleTurnAgentExecutor) POSTs ONE sample per request,
`{"query": [prompt + response decoded with special tokens], "prompts": [prompt], "labels": [label]}`,
while it generates the n samples of a prompt concurrently, cycling its reward URLs per request. A
set-conditioned reward needs the whole set, so:

- each sample joins the open group of its prompt (the group key); a group closes when it holds
  `group_size` samples (`train.candidates`, OpenRLHF's n_samples_per_prompt; the same prompt twice in
  a batch = two groups, split by arrival), or
  when its deadline, fixed at its FIRST arrival, passes (a partial group, counted); retries re-enter
  the barrier and can never extend a deadline;
- a retry is the same sample again (same prompt, same response text) after its first request went
  away (OpenRLHF retries a request that timed out): it takes over the sample's existing slot, in the
  open group, the group being scored, or a group scored in the last RETRY_MEMORY_S (answered at once
  from its score), so no sample is a member twice and no set is scored twice. The same text while the
  first request still waits is a genuine second sample (short answers repeat), a member of its own;
- a request whose client disconnects is cancelled (its slot stays in the group for a retry);
- `group_timeout_s + scoring_time_s` must fit the client's timeout (`client_timeout_s`, OpenRLHF: 180 s):
  the server refuses to start otherwise;
- a closed group gets one rubric, one batched verification, and every held request its own score;
- with several replicas, each prompt has ONE owner replica (sha256 of the prompt over the configured
  `replica_urls`); a replica that is not the owner forwards the sample there, so a group's samples
  meet whichever replica the client picked;
- the reply is always `{"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}` with
  finite floats: OpenRLHF reads a missing or null reward as None and crashes its training step;
- an untrusted set (a calibration answer outranked a candidate: the judge cannot tell them from
  garbage) gets the set's mean as every reward, so OpenRLHF's group normalisation gives it zero
  advantage; `scores` keep the judge's scores and `rubric_untrusted` says which sets these were.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynrubric import http_clients
from dynrubric.config import RewardServerConfig
from dynrubric.errors import DynrubricError
from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics, ScoredSet
from dynrubric.service import make_app, require_token

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-dynrubric-forwarded"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
_CHATML_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)
_ASSISTANT_OPEN = "<|im_start|>assistant\n"


# ---------------------------------------------------------------- request bodies
class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


class SetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    responses: list[str] = Field(min_length=1, max_length=64)


class ScoreSetsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sets: list[SetIn] = Field(min_length=1, max_length=256)


class BadRequest(Exception):
    def __init__(self, status: int, field: str, message: str):
        self.status, self.field, self.message = status, field, message


async def read_json(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    """The body validated as `model`; 413 over `max_bytes`, 422 naming the field that is wrong."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(413, "body", f"request body of {declared} bytes is over the {max_bytes}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise BadRequest(413, "body", f"request body is over the {max_bytes}-byte limit")
    try:
        data = json.loads(bytes(body))
    except (ValueError, RecursionError) as e:
        raise BadRequest(422, "body", f"body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise BadRequest(422, where, f"field '{where}': {err['msg']}") from None


# ---------------------------------------------------------------- OpenRLHF's query -> (question, response)
def split_query(query: str, prompt: str | None, special_tokens: Sequence[str]) -> tuple[str, str]:
    """(group key = the prompt string, response text) from one OpenRLHF sample."""
    if prompt is not None and query.startswith(prompt):
        key, response = prompt, query[len(prompt) :]
    elif _ASSISTANT_OPEN in query:
        cut = query.rindex(_ASSISTANT_OPEN) + len(_ASSISTANT_OPEN)
        key, response = (prompt if prompt is not None else query[:cut]), query[cut:]
    else:
        key, response = (prompt if prompt is not None else ""), query
    return key, strip_special(response, special_tokens)


def strip_special(text: str, special_tokens: Sequence[str]) -> str:
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for tok in special_tokens:
            if tok and text.endswith(tok):
                text = text[: -len(tok)].rstrip()
                changed = True
    return text


def question_of(prompt: str, special_tokens: Sequence[str]) -> str:
    """The raw user question inside a chat-templated prompt (the last user turn of ChatML)."""
    turns = _CHATML_USER.findall(prompt)
    if turns:
        return turns[-1].strip()
    for tok in special_tokens:
        if tok:
            prompt = prompt.replace(tok, " ")
    return prompt.strip()


def owner_of(key: str, replicas: Sequence[str]) -> str:
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return replicas[int.from_bytes(digest[:8], "big") % len(replicas)]


# ---------------------------------------------------------------- the barrier
@dataclass
class SampleResult:
    reward: float  # what training sees: the set's mean for every sample of an untrusted set
    score: float  # the judge's score
    logs: dict[str, float]


@dataclass
class Slot:
    """One sample of a group, and the requests waiting for its reward (more than one after a retry)."""

    response: str
    waiters: list[asyncio.Future[SampleResult]] = field(default_factory=list)

    def orphaned(self) -> bool:
        """No request waits for it any more: its client went away, a retry may take it over."""
        return all(w.done() for w in self.waiters)


@dataclass
class Group:
    key: str
    question: str
    slots: list[Slot] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    closed: bool = False
    partial: bool = False
    closed_at: float = 0.0
    answers: list[SampleResult] | None = None  # once scored, per slot

    @property
    def responses(self) -> list[str]:
        return [slot.response for slot in self.slots]

    def orphan_slot(self, response: str) -> int | None:
        return next((i for i, s in enumerate(self.slots) if s.response == response and s.orphaned()), None)


RETRY_MEMORY_S = 900.0  # scored groups kept for late retries: OpenRLHF retries 5 times, each up to its timeout


def check_fits_client_timeout(config: RewardServerConfig) -> None:
    """Refuse a barrier whose worst-case wait (a group's deadline, then its scoring) the client would not wait for."""
    worst = config.group_timeout_s + config.scoring_time_s
    if worst >= config.client_timeout_s:
        raise DynrubricError(
            f"reward_server.group_timeout_s ({config.group_timeout_s:g} s) + reward_server.scoring_time_s "
            f"({config.scoring_time_s:g} s) = {worst:g} s does not fit the client's request timeout "
            f"reward_server.client_timeout_s ({config.client_timeout_s:g} s; OpenRLHF's is 180 s): a partial "
            "group would be answered after its client gave up, and every retry would score it again",
            "lower reward_server.group_timeout_s, or make scoring faster (smaller rubric.generator_max_tokens, "
            "fewer rubric.retries; measure with benchmarks/reward_group.py) and set reward_server.scoring_time_s",
        )


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("dynrubric_reward_requests", "reward requests answered", ["outcome"], registry=registry)
        for outcome in ("ok", "error", "rejected"):
            self.requests.labels(outcome=outcome)
        self.partial_groups = Counter(
            "dynrubric_reward_partial_groups",
            "groups scored at the timeout before n samples arrived",
            registry=registry,
        )
        self.singleton_groups = Counter(
            "dynrubric_reward_singleton_groups",
            "groups of one sample (timeouts, retries): no gap to measure, kept out of the collapse window",
            registry=registry,
        )
        self.verdict_latency = Histogram(
            "dynrubric_reward_verdict_latency_seconds",
            "time to verify one set",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.retries = Counter(
            "dynrubric_reward_retried_samples",
            "samples that arrived again and took over their existing slot",
            registry=registry,
        )
        self.cancelled = Counter(
            "dynrubric_reward_cancelled_requests",
            "requests cancelled because their client went away",
            registry=registry,
        )
        self.batch_seconds = Histogram(
            "dynrubric_reward_scoring_seconds",
            "time to score one batch of closed groups (compare reward_server.scoring_time_s)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


def finite(x: float) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else 0.0


class GroupBarrier:
    """Holds samples per prompt until a group of n is complete or its deadline passes, then scores it."""

    def __init__(self, evaluator: Evaluator, n: int, timeout_s: float, metrics: ServerMetrics, linger_s: float = 0.0):
        self.evaluator = evaluator
        self.n = n
        self.timeout_s = timeout_s
        self.linger_s = linger_s
        self.metrics = metrics
        self.open: dict[str, Group] = {}
        #: the last scored groups, for operators (GET /groups): rubric, verdicts, scores, gaps
        self.recent: deque[dict[str, Any]] = deque(maxlen=64)
        # engines are not thread-safe: every model call runs on this one worker thread
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluator")
        self._ready: list[Group] = []
        self._scorer: asyncio.Task[None] | None = None
        #: closed groups, oldest first, kept RETRY_MEMORY_S for retries of their samples (and by key)
        self.closed: deque[Group] = deque()
        self.closed_by_key: dict[str, list[Group]] = {}

    def add(self, key: str, question: str, response: str) -> asyncio.Future[SampleResult]:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[SampleResult] = loop.create_future()
        retried = self._retry_slot(key, response)
        if retried is not None:
            retried_group, i = retried
            self.metrics.retries.inc()
            if retried_group.answers is not None:
                waiter.set_result(retried_group.answers[i])
            else:
                retried_group.slots[i].waiters.append(waiter)
            return waiter
        group = self.open.get(key)
        if group is None:
            group = Group(key=key, question=question)
            group.timer = loop.call_later(self.timeout_s, self._close, group, True)
            self.open[key] = group
        group.slots.append(Slot(response, [waiter]))
        if len(group.slots) >= self.n:
            self._close(group, False)
        return waiter

    def _retry_slot(self, key: str, response: str) -> tuple[Group, int] | None:
        """The slot a retried sample takes over: same prompt, same text, nobody waiting for it."""
        now = time.monotonic()
        while self.closed and now - self.closed[0].closed_at > RETRY_MEMORY_S:
            self._forget(self.closed.popleft())
        candidates = [self.open[key]] if key in self.open else []
        candidates += self.closed_by_key.get(key, [])
        for group in candidates:
            i = group.orphan_slot(response)
            if i is not None:
                return group, i
        return None

    def _forget(self, group: Group) -> None:
        same = self.closed_by_key.get(group.key, [])
        if group in same:
            same.remove(group)
        if not same:
            self.closed_by_key.pop(group.key, None)

    def _close(self, group: Group, timed_out: bool) -> None:
        if group.closed:
            return
        group.closed = True
        group.closed_at = time.monotonic()
        if group.timer is not None:
            group.timer.cancel()
        if self.open.get(group.key) is group:
            del self.open[group.key]
        self.closed.append(group)
        self.closed_by_key.setdefault(group.key, []).append(group)
        group.partial = timed_out and len(group.slots) < self.n
        if group.partial:
            self.metrics.partial_groups.inc()
        if len(group.responses) < 2:
            self.metrics.singleton_groups.inc()  # the collapse detector skips it too (rubric/gaps.py)
        self._ready.append(group)
        if self._scorer is None or self._scorer.done():
            self._scorer = asyncio.get_running_loop().create_task(self._drain())

    async def score_sets(self, questions: list[str], sets: list[list[str]]) -> list[ScoredSet]:
        loop = asyncio.get_running_loop()
        scored = await loop.run_in_executor(self.worker, self.evaluator.score_sets, questions, sets)
        for s in scored:
            self.metrics.verdict_latency.observe(s.verify_seconds)
        return scored

    async def _drain(self) -> None:
        """Score every closed group; groups that close within `linger_s` of the first, or while a batch is
        scored, form one batch, so rubric generation for concurrent groups is one batched engine call."""
        while self._ready:
            # OpenRLHF sends a whole batch of prompts at once, but their groups close one HTTP request at a
            # time: without a short wait the first group alone would take a whole generation pass
            deadline = time.monotonic() + self.linger_s
            while self.open and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            batch, self._ready = self._ready, []
            started = time.monotonic()
            try:
                scored = await self.score_sets([g.question for g in batch], [g.responses for g in batch])
            except Exception as e:  # the engine failed: every held request gets an error, OpenRLHF retries
                log.exception("scoring %d group(s) failed", len(batch))
                for g in batch:
                    self.closed.remove(g)  # not answerable: its retries form a new group
                    self._forget(g)
                    for slot in g.slots:
                        for w in slot.waiters:
                            if not w.done():
                                w.set_exception(e)
                continue
            self.metrics.batch_seconds.observe(time.monotonic() - started)
            for group, s in zip(batch, scored, strict=True):
                self._answer(group, s)

    def _answer(self, group: Group, scored: ScoredSet) -> None:
        logs = {
            "rubric_mean_gap": finite(scored.gaps.mean_abs_gap),
            "rubric_items": float(len(scored.rubric.items)),
            "rubric_generic": 1.0 if scored.rubric_source == "generic" else 0.0,
            "rubric_group_size": float(len(group.slots)),
            "rubric_partial_group": 1.0 if group.partial else 0.0,
            "rubric_collapse": 1.0 if self.evaluator.collapse.collapsed else 0.0,
            "rubric_untrusted": 0.0 if scored.trusted else 1.0,
        }
        self.recent.append({"key": group.key, "partial": group.partial, **scored.as_dict()})
        mean = sum(scored.scores) / len(scored.scores)
        rewards = scored.scores if scored.trusted else [mean] * len(scored.scores)
        group.answers = [
            SampleResult(reward=finite(r), score=finite(s), logs=logs)
            for r, s in zip(rewards, scored.scores, strict=True)
        ]
        for slot, answer in zip(group.slots, group.answers, strict=True):
            for w in slot.waiters:
                if not w.done():
                    w.set_result(answer)

    def close(self) -> None:
        for group in list(self.open.values()):
            if group.timer is not None:
                group.timer.cancel()
        self.worker.shutdown(wait=False, cancel_futures=True)


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------- the app
def create_app(
    evaluator: Evaluator,
    config: RewardServerConfig,
    registry: CollectorRegistry,
    special_tokens: Sequence[str],
    group_size: int,
) -> FastAPI:
    """The reward server over an evaluator whose metrics are registered on `registry`; a group closes
    at `group_size` samples."""
    if config.replica_urls and config.self_url not in config.replica_urls:
        raise ValueError("reward_server.self_url must be one of reward_server.replica_urls")
    check_fits_client_timeout(config)
    metrics = ServerMetrics(registry)
    barrier = GroupBarrier(evaluator, group_size, config.group_timeout_s, metrics, config.batch_linger_s)
    app = make_app("dynrubric reward server", registry)
    replicas = [u.rstrip("/") for u in config.replica_urls]
    self_url = (config.self_url or "").rstrip("/")
    token = config.token

    def authorize(request: Request) -> None:
        try:
            require_token(request, token)
        except HTTPException:
            metrics.requests.labels(outcome="rejected").inc()
            raise

    def reject(e: BadRequest) -> JSONResponse:
        metrics.requests.labels(outcome="rejected").inc()
        return JSONResponse({"detail": e.message, "field": e.field}, status_code=e.status)

    async def forward(owner: str, sample: dict[str, Any]) -> dict[str, Any]:
        headers = {FORWARDED_HEADER: "1"}
        if token is not None:
            headers["authorization"] = f"Bearer {token.get_secret_value()}"
        r = await app.state.forward_client.post(f"{owner}/reward", json=sample, headers=headers)
        r.raise_for_status()
        return r.json()

    async def one_sample(query: str, prompt: str | None, label: Any, forwarded: bool) -> SampleResult:
        key, response = split_query(query, prompt, special_tokens)
        if replicas and not forwarded:
            owner = owner_of(key, replicas)
            if owner != self_url:
                try:
                    body = await forward(owner, {"query": [query], "prompts": [key], "labels": [label]})
                    return SampleResult(
                        reward=finite(body["rewards"][0]),
                        score=finite(body.get("scores", body["rewards"])[0]),
                        logs={k: finite(v[0]) for k, v in body.get("extra_logs", {}).items()},
                    )
                except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
                    # the owner is down: score here rather than fail the training step; the
                    # group will be partial on this replica and is counted as such
                    log.warning("forward to owner replica %s failed (%s); scoring locally", owner, type(e).__name__)
        return await barrier.add(key, question_of(key, special_tokens), response)

    async def reward(request: Request) -> JSONResponse:
        authorize(request)
        try:
            body: RewardRequest = await read_json(request, RewardRequest, config.max_body_bytes)
            prompts = body.prompts
            if prompts is not None and len(prompts) != len(body.query):
                raise BadRequest(
                    422, "prompts", f"field 'prompts' has {len(prompts)} entries for {len(body.query)} queries"
                )
        except BadRequest as e:
            return reject(e)
        labels = (
            body.labels if body.labels is not None and len(body.labels) == len(body.query) else [None] * len(body.query)
        )
        forwarded = request.headers.get(FORWARDED_HEADER) == "1"
        work = asyncio.ensure_future(
            asyncio.gather(
                *(
                    one_sample(q, prompts[i] if prompts is not None else None, labels[i], forwarded)
                    for i, q in enumerate(body.query)
                )
            )
        )
        gone = asyncio.ensure_future(client_gone(request))
        started = time.monotonic()
        either: set[asyncio.Future[Any]] = {work, gone}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: stop waiting (its samples' slots stay for a retry)
            work.cancel()
            # a cancelled gather keeps its CancelledError as an exception: taken here, asyncio prints no
            # "_GatheringFuture exception was never retrieved" traceback when the future is collected
            work.add_done_callback(lambda f: f.cancelled() or f.exception())
            metrics.cancelled.inc()
            log.info(
                "cancelled a reward request for %d sample(s) after %.1f s: its client disconnected (a client "
                "timeout; the samples keep their slots for its retry)",
                len(body.query),
                time.monotonic() - started,
            )
            return JSONResponse({"detail": "client disconnected"}, status_code=499)
        gone.cancel()
        try:
            results = work.result()
        except Exception as e:
            metrics.requests.labels(outcome="error").inc()
            return JSONResponse({"detail": f"scoring failed: {type(e).__name__}: {e}"}, status_code=503)
        metrics.requests.labels(outcome="ok").inc()
        names = sorted({k for r in results for k in r.logs})
        return JSONResponse(
            {
                "rewards": [r.reward for r in results],
                "scores": [r.score for r in results],
                "extra_logs": {k: [r.logs.get(k, 0.0) for r in results] for k in names},
            }
        )

    # OpenRLHF calls whatever URL it is given; /get_reward is the path of its own serve_rm
    app.add_api_route("/reward", reward, methods=["POST"])
    app.add_api_route("/get_reward", reward, methods=["POST"])

    @app.post("/score_sets")
    async def score_sets(request: Request) -> JSONResponse:
        """Whole candidate sets at once: `{"sets": [{"prompt", "responses"}]}` -> scored sets."""
        authorize(request)
        try:
            body: ScoreSetsRequest = await read_json(request, ScoreSetsRequest, config.max_body_bytes)
        except BadRequest as e:
            return reject(e)
        try:
            scored = await barrier.score_sets([s.prompt for s in body.sets], [s.responses for s in body.sets])
        except Exception as e:
            metrics.requests.labels(outcome="error").inc()
            return JSONResponse({"detail": f"scoring failed: {type(e).__name__}: {e}"}, status_code=503)
        metrics.requests.labels(outcome="ok").inc()
        return JSONResponse({"sets": [s.as_dict() for s in scored]})

    @app.get("/groups")
    async def groups(request: Request) -> JSONResponse:
        """The last scored groups (newest last): key, partial flag, rubric, verdicts, scores, gaps."""
        require_token(request, token)
        return JSONResponse({"groups": list(barrier.recent)})

    async def open_forward_client() -> None:  # one pooled client for every forward while the app runs
        app.state.forward_client = http_clients.async_client(timeout=config.forward_timeout_s)

    async def close_forward_client() -> None:
        await app.state.forward_client.aclose()

    app.router.on_startup.append(open_forward_client)
    app.router.on_shutdown.append(close_forward_client)
    app.router.on_shutdown.append(barrier.close)
    app.state.barrier = barrier
    return app


def log_to_stderr() -> None:
    """This module's lines (cancellations, failed forwards and scorings) on stderr with time and level, INFO up;
    other libraries keep their own levels (httpx logs every request at INFO)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def build_app(settings: Any) -> FastAPI:
    """The server as `dynrubric serve-reward` runs it: engines from the settings, a fresh registry."""
    from dynrubric.engines import judge_engines

    check_fits_client_timeout(settings.reward_server)  # before the models load: fail in a second, not a minute
    generator, verifier = judge_engines(settings)
    registry = CollectorRegistry()
    evaluator = Evaluator(generator, verifier, settings.rubric, EvaluatorMetrics(registry))
    specials = [t for t in generator.tokenizer.all_special_tokens if t]
    return create_app(evaluator, settings.reward_server, registry, specials, settings.train.candidates)
