"""The A/B router: OpenAI-compatible front door over the fleet, with sticky variants and event logging.

The routing policy is `serving.routing`'s, passed in: a request goes to the variant (stable or
canary) its user is assigned to (`ArmAssignment`; by default `StickyHashAssignment`, a hash of the
user key and the experiment id, so a user stays on one arm for a whole rollout and a canary share
that grows only adds users to the canary), and inside a variant to the replica a `ReplicaChoice`
picks (by default `LeastInflight`, the least-busy healthy one). This module is the proxy around
it: a failure (connection error, 5xx, or an answer that ran to its token limit without any text: a
broken model's, `_no_text`) is retried once on another replica of the same variant, and a canary
request that still fails is counted as a canary error and served by stable. Every answered request is logged to
`dynrubric.query-log` by `streaming.producer.EventProducer`, whose `send_*` only appends to a
bounded in-memory buffer (a full buffer drops and counts the event), so Kafka never adds latency.
Each event carries the experiment id and the arm the user is assigned to (the gate attributes by
them, never by time or by the arm that happened to answer).

Shadow pairs for the judged online check: while a rollout runs, a sampled share (`shadow_rate`)
of answered non-streaming requests is also sent, after the user has the answer, to one replica of
the arm that did not serve it; the shadow response is logged with `shadow: true` and the same
`pair_id` as the served one, and is never shown to anyone. At most `shadow_max_inflight` shadows run
at once (the cost cap); a sample beyond it is skipped and counted.

The state (`/v1/router/state`) also reports the traffic of the last `traffic_window_s` seconds in which traffic
flowed (requests a second and distinct users, `TrafficMeter`): what the rollout controller plans the gate's power
on.

Reads (`/v1/router/state`, `/metrics`) are open; control endpoints (traffic split, weights, drain)
need the bearer token. The router owns which weights each variant should serve, and reloads an
engine that comes back after a restart.

Several replicas (`shared`, a `serving.shared.SharedSplit`): the split a control call sets is written to the
registry's database, and every replica adopts the newest one within `sync_interval_s` (and before it
serves); each writes its counters there, and the state reports its own plus the others' (serving/shared.py).
Without `shared`, the split and the counters live in this process alone: one replica only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import socket
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from dynrubric import http_clients
from dynrubric.service import make_app, require_token
from serving.routing import ArmAssignment, LeastInflight, ReplicaChoice, StickyHashAssignment, Variant, serving_replicas
from serving.shared import Split

log = logging.getLogger(__name__)

VARIANTS: tuple[Variant, ...] = get_args(Variant)  # the arms, in the order the counters list them
REQUEST_ID_HEADER = "x-request-id"
USER_KEY_HEADER = "x-user-key"


# ---------------------------------------------------------------- state
@dataclass
class Replica:
    name: str
    variant: Variant
    base_url: str
    policy_version: str
    served_model: str = "policy"  # the engine's --served-model-name; requests are rewritten to it
    healthy: bool = True
    drained: bool = False
    inflight: int = 0
    # weights_via restart: up, but serving other weights than its variant's (a pod not restarted onto them yet,
    # or restarted onto the next version): no traffic until they match
    stale: bool = False


@dataclass
class Weights:
    """Which checkpoint a variant should serve."""

    version: str
    path: str


@dataclass
class ArmCounters:
    requests: int = 0  # routed to the arm, counted when they arrive
    errors: int = 0  # failed on the arm, counted when they fail
    # whose outcome on the arm is known (answered by it, or failed): the error rate's denominator. Requests still
    # in flight are neither errors nor successes yet; counting them as successes (requests) would dilute a
    # failing canary's rate at an early look and let the step pass on "no harm shown"
    settled: int = 0


@dataclass
class RouterState:
    replicas: list[Replica]
    canary_weight: float = 0.0
    experiment: str = ""
    desired: dict[str, Weights] = field(default_factory=dict)
    # per experiment and assigned variant: requests routed (counted when they arrive) and failed (a canary request
    # that its arm could not answer, served by stable or not; a stable request no replica answered)
    counters: dict[str, dict[str, ArmCounters]] = field(default_factory=dict)

    def arm(self, variant: str) -> ArmCounters:
        by_variant = self.counters.setdefault(self.experiment, {v: ArmCounters() for v in VARIANTS})
        return by_variant[variant]

    def routable(self) -> list[Replica]:
        """The replicas the routing policy may pick from: all but those serving the wrong weights."""
        return [r for r in self.replicas if not r.stale]

    def serving(self, variant: str) -> list[Replica]:
        return serving_replicas(self.routable(), variant)


class TrafficMeter:
    """Requests and distinct users over the last `window_s` seconds of traffic: what the gate's power is planned on.

    Requests are counted per second (at most `window_s` buckets). Each bucket stands for the time to the next one
    (or to now), but at most IDLE_S, so a pause (users paused while a round trains, a quiet night) counts IDLE_S:
    the rate is the requests over the time traffic flowed, and the window is the last `window_s` seconds in which
    it flowed. A rollout that starts after a round's pause so plans on the users who were sending before it, not
    on the one who came back first (make up, 2026-12-04: "0.38 requests/s from 1 users" over a wall-clock window
    that the 20-minute round had emptied). Users: each user's last request time, oldest first; a user leaves with
    the buckets older than their last request.
    """

    IDLE_S = 10.0

    def __init__(self, window_s: float, clock=time.time):
        self.window_s = window_s
        self.clock = clock
        self._seconds: deque[list[int]] = deque()  # [second, requests]
        self._users: OrderedDict[str, float] = OrderedDict()

    def add(self, user_hash: str) -> None:
        now = self.clock()
        second = int(now)
        self._users[user_hash] = now
        self._users.move_to_end(user_hash)
        if self._seconds and self._seconds[-1][0] == second:
            self._seconds[-1][1] += 1
        else:
            self._seconds.append([second, 1])
            self._forget(now)  # a new second: the oldest may leave (once a second, not at every request)

    def _spans(self, now: float) -> list[float]:
        """Each bucket's share of the traffic's time: to the next bucket (or to now), between 1 s and IDLE_S."""
        ends = [s for s, _ in list(self._seconds)[1:]] + [now]
        return [max(1.0, min(end - s, self.IDLE_S)) for (s, _), end in zip(self._seconds, ends, strict=False)]

    def _forget(self, now: float) -> float:
        """Drop the buckets (and users) older than the window; the seconds of traffic the rest stand for."""
        spans = self._spans(now)
        active = sum(spans)
        for span in spans[:-1]:  # the newest bucket always stays
            if active - span < self.window_s:
                break
            active -= span
            self._seconds.popleft()
        oldest = self._seconds[0][0] if self._seconds else now
        while self._users and next(iter(self._users.values())) < oldest:
            self._users.popitem(last=False)
        return active

    def snapshot(self) -> dict[str, float]:
        active = self._forget(self.clock())
        requests = sum(n for _, n in self._seconds)
        return {
            "window_s": self.window_s,
            "requests": requests,
            "users": len(self._users),
            "active_s": active,
            "rps": requests / active if active else 0.0,
        }


def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses DNS gives `host` (a headless Service: one per ready pod), sorted, without duplicates."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


def hash_user(user_key: str) -> str:
    return hashlib.sha256(user_key.encode()).hexdigest()[:32]


def _text(content: Any) -> str:
    """OpenAI content may be a list of parts; the log keeps the text."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


# ---------------------------------------------------------------- bodies
class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    kind: Literal["thumbs_up", "thumbs_down", "regenerate", "copy", "dwell"]
    value: float = Field(default=1.0, ge=0, description="dwell: seconds; others: 1")
    user: str | None = Field(default=None, max_length=500)


class TrafficBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    canary_weight: float = Field(ge=0.0, le=1.0)
    experiment: str = Field(min_length=1, max_length=200)


class WeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(min_length=1)
    path: str = Field(min_length=1)
    best_effort: bool = Field(
        default=False,
        description="a rollback: record the weights even where an engine is down; it gets them when it is back",
    )


class DrainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drained: bool = True


class EngineFailure(Exception):
    """A replica could not answer (connection error, timeout, 5xx, or an answer without text, `_no_text`)."""


class WrongWeights(EngineFailure):
    """weights_via restart: the replica answers, serving other weights than asked (it is `stale`)."""


def _no_text(data: Any, chat: bool) -> str | None:
    """Why a 200 answer is a failure: it ran to its token limit and holds no text, so every token it generated
    was a special one. A model whose logits are not finite answers so under vLLM (token 0 every step, skipped
    as special); a real answer, even an empty one, ends with a stop."""
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    if choice.get("finish_reason") == "length" and not text and tokens > 0:
        return f"{tokens} tokens generated and no text in them"
    return None


# ---------------------------------------------------------------- the app
class Router:
    def __init__(
        self,
        state: RouterState,
        producer: Any,
        metrics: CollectorRegistry,
        *,
        token: SecretStr | None,
        engine_api_key: SecretStr | None = None,
        timeout_s: float = 120.0,
        health_interval_s: float = 5.0,
        shadow_rate: float = 0.0,
        shadow_max_inflight: int = 4,
        seed: int | None = None,
        default_max_tokens: int = 256,
        traffic_window_s: float = 300.0,
        assignment: ArmAssignment | None = None,
        replica_choice: ReplicaChoice | None = None,
        shared: Any = None,
        replica_id: str = "",
        sync_interval_s: float = 1.0,
        weights_via: str = "rpc",
        discover: Sequence[tuple[str, Variant, str]] = (),
        resolve: Callable[[str, int], list[str]] | None = None,
    ):
        """`producer`: an EventProducer whose metrics are registered in `metrics` (the router's /metrics).
        `engine_api_key`: sent as a bearer token on every call to an engine (vLLM's --api-key).
        `default_max_tokens`: sent to the engine when a request names no max_tokens, so the logged
        sampling is what the engine used (engines' own defaults differ: vLLM's is the rest of the context).
        `traffic_window_s`: the window of the traffic the state reports (`TrafficMeter`).
        `assignment`, `replica_choice`: the routing policy (`serving.routing`); by default today's rules,
        `StickyHashAssignment` and `LeastInflight`.
        `shared`: a `serving.shared.SharedSplit` every router replica reads (the split and the counters of all
        replicas), synced every `sync_interval_s`; `replica_id` names this replica's counters there.
        `weights_via`: "rpc" reloads an engine through /collective_rpc (vLLM's dev mode); "restart" only checks
        that the engine serves the weights' path (/v1/models root): something else restarted it onto them.
        `discover`: (name, variant, url) of headless Services whose pods are the replicas, resolved by
        `resolve(host, port)` (DNS by default) at every health check."""
        self.state = state
        self.shared = shared
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.sync_interval_s = sync_interval_s
        self.weights_via = weights_via
        self.discover = list(discover)
        self.resolve = resolve or resolve_addresses
        self._split_seq = 0  # the shared split this replica has applied
        self._others: dict[str, dict[str, dict[str, int]]] = {}  # the other replicas' counters
        self._sync_task: asyncio.Task | None = None
        self.assignment = assignment if assignment is not None else StickyHashAssignment()
        self.replica_choice = replica_choice if replica_choice is not None else LeastInflight()
        self.traffic = TrafficMeter(traffic_window_s)
        self.shadow_rate = shadow_rate
        self.shadow_max_inflight = shadow_max_inflight
        self.default_max_tokens = default_max_tokens
        self._shadows: set[asyncio.Task] = set()
        self._rng = random.Random(seed)
        self.producer = producer
        self.token = token
        self.engine_headers = {"authorization": f"Bearer {engine_api_key.get_secret_value()}"} if engine_api_key else {}
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self.metrics = m = metrics
        self.m_requests = Counter("dynrubric_router_requests_total", "requests served", ["variant", "code"], registry=m)
        self.m_errors = Counter(
            "dynrubric_router_errors_total", "requests that failed on every replica tried", ["variant"], registry=m
        )
        self.m_latency = Histogram(
            "dynrubric_router_request_latency_seconds",
            "end-to-end request latency",
            ["variant"],
            registry=m,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160),
        )
        self.m_tokens = Counter("dynrubric_router_tokens_total", "tokens processed", ["variant", "kind"], registry=m)
        self.m_weight = Gauge(
            "dynrubric_router_variant_weight", "traffic share of each variant", ["variant"], registry=m
        )
        self.m_shadow = Counter(
            "dynrubric_router_shadow_requests_total",
            "sampled requests for the judged check: sent, skipped at the cost cap, failed",
            ["outcome"],
            registry=m,
        )
        self._set_weight_gauges()
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self._control = asyncio.Lock()
        self._checking = asyncio.Lock()  # one health check at a time (the health loop's, or a sync's)
        self.app = self._build()

    # ------------------------------------------------------------ routing
    def _set_weight_gauges(self) -> None:
        self.m_weight.labels("canary").set(self.state.canary_weight)
        self.m_weight.labels("stable").set(1.0 - self.state.canary_weight)

    def assign(self, user_hash: str) -> Variant:
        """The user's arm by the assignment rule; stable for everyone while no canary replica can serve (so a
        canary that is down gets no users, rather than users that all fall back to stable as canary errors)."""
        s = self.state
        if not s.serving("canary"):
            return "stable"
        return self.assignment.assign(user_hash, s.experiment, s.canary_weight)

    async def _post(self, replica: Replica, path: str, body: dict[str, Any], stream: bool) -> httpx.Response:
        assert self._client is not None
        req = self._client.build_request("POST", replica.base_url + path, json=dict(body, model=replica.served_model))
        try:
            resp = await self._client.send(req, stream=stream)
        except httpx.HTTPError as e:
            raise EngineFailure(f"{replica.name}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 500:
            await resp.aread()
            await resp.aclose()
            raise EngineFailure(f"{replica.name}: HTTP {resp.status_code}: {resp.text[:200]}")
        if not stream and resp.status_code == 200:
            try:
                data = resp.json()
            except ValueError:
                data = None
            if why := _no_text(data, path.endswith("chat/completions")):
                raise EngineFailure(f"{replica.name}: {why}")
        return resp

    async def _forward(
        self, variant: str, path: str, body: dict[str, Any], stream: bool
    ) -> tuple[str, Replica, str, httpx.Response]:
        """First answer from: a replica of `variant`, another one, then (for canary) stable.

        Returns the variant and replica that answered and the policy version the replica had when
        the request was sent (a weight reload may finish while it runs).
        """
        tried: set[str] = set()
        failures: list[str] = []
        plan = [variant, variant] + (["stable", "stable"] if variant == "canary" else [])
        for i, v in enumerate(plan):
            if v == "stable" and i == 2:
                self.state.arm("canary").errors += 1
                self.state.arm("canary").settled += 1
                self.m_errors.labels("canary").inc()
            replica = self.replica_choice.choose(self.state.routable(), v, tried)
            if replica is None:
                continue
            tried.add(replica.name)
            replica.inflight += 1
            version = replica.policy_version
            try:
                answer = await self._post(replica, path, body, stream)
                if i < 2:  # answered by its own arm (a canary request served by stable settled as an error above)
                    self.state.arm(variant).settled += 1
                return v, replica, version, answer
            except EngineFailure as e:
                failures.append(str(e))
            finally:
                replica.inflight -= 1
        final = "stable" if variant == "canary" else variant
        self.state.arm(final).errors += 1
        self.state.arm(final).settled += 1
        self.m_errors.labels(final).inc()
        self.m_requests.labels(final, "502").inc()
        raise HTTPException(
            502, f"no engine of variant {variant} could answer: {'; '.join(failures) or 'none healthy'}"
        )

    def _event(
        self,
        *,
        request_id: str,
        user_hash: str,
        session_id: str | None,
        variant: str,
        policy_version: str,
        model: str,
        body: dict[str, Any],
        response: str,
        finish_reason: str | None,
        latency_s: float,
        prompt_tokens: int,
        completion_tokens: int,
        experiment_id: str | None,
        assigned_variant: str,
        pair_id: str | None = None,
        shadow: bool = False,
    ) -> Any:
        from streaming.events import QueryLogEvent, escape_controls

        # control characters a model or a user wrote are logged as visible escapes (the event's text rule)
        if "messages" in body:
            messages = [
                {"role": m.get("role"), "content": escape_controls(_text(m.get("content")))} for m in body["messages"]
            ]
        else:
            messages = [{"role": "user", "content": escape_controls(_text(body.get("prompt")))}]
        return QueryLogEvent.model_validate(  # the same validation as QueryLogEvent(**fields)
            {
                "request_id": request_id,
                "ts": time.time(),
                "user_key": user_hash,
                "session_id": session_id,
                "variant": variant,
                "policy_version": policy_version,
                "model": model,
                "messages": messages,
                "response": escape_controls(response),
                "finish_reason": finish_reason or "stop",
                "sampling": {
                    "temperature": float(body.get("temperature", 1.0)),
                    "top_p": float(body.get("top_p", 1.0)),
                    "max_tokens": int(body["max_tokens"]),
                },
                "latency_ms": latency_s * 1000.0,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "experiment_id": experiment_id,
                "assigned_variant": assigned_variant,
                "pair_id": pair_id,
                "shadow": shadow,
            }
        )

    def _log(
        self,
        meta: dict[str, Any],
        response: str,
        finish_reason: str | None,
        latency_s: float,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        try:
            event = self._event(
                **meta,
                response=response,
                finish_reason=finish_reason,
                latency_s=latency_s,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )
        except ValueError as e:  # a request the engine accepted but the event schema does not (odd roles)
            log.warning("request %s not logged: %s", meta["request_id"], e)
            return
        self.producer.send_query_log(event)

    def _record(self, variant: str, latency_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.m_requests.labels(variant, "200").inc()
        self.m_latency.labels(variant).observe(latency_s)
        self.m_tokens.labels(variant, "prompt").inc(prompt_tokens)
        self.m_tokens.labels(variant, "completion").inc(completion_tokens)

    async def handle(self, request: Request, path: str, chat: bool) -> Response:
        started = time.perf_counter()
        try:
            body = await request.json()
        except json.JSONDecodeError:
            raise HTTPException(400, "request body is not JSON") from None
        if not isinstance(body, dict) or ("messages" if chat else "prompt") not in body:
            raise HTTPException(400, f"the body must be a JSON object with '{'messages' if chat else 'prompt'}'")
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        user_hash = hash_user(request.headers.get(USER_KEY_HEADER) or str(body.get("user") or request_id))
        session_id = request.headers.get("x-session-id")
        variant = self.assign(user_hash)
        # the experiment's counters follow the assignment, a request counted before it is tried: a failure
        # (counted as it happens) never outnumbers its requests in a snapshot of the counters
        self.state.arm(variant).requests += 1
        self.traffic.add(user_hash)
        stream = bool(body.get("stream"))
        if body.get("max_tokens") is None:
            body["max_tokens"] = body.get("max_completion_tokens") or self.default_max_tokens
        upstream = dict(body)
        if stream:
            upstream["stream_options"] = {"include_usage": True}
        served, replica, version, resp = await self._forward(variant, path, upstream, stream)
        headers = {REQUEST_ID_HEADER: request_id, "x-dynrubric-variant": served, "x-dynrubric-policy-version": version}
        experiment = self.state.experiment if self.state.canary_weight > 0 else None
        meta = dict(
            request_id=request_id,
            user_hash=user_hash,
            session_id=session_id,
            variant=served,
            policy_version=version,
            model=replica.served_model,
            body=body,
            experiment_id=experiment,
            assigned_variant=variant,
        )
        if resp.status_code != 200:  # 4xx: the client's mistake, passed through
            self.m_requests.labels(served, str(resp.status_code)).inc()
            return Response(
                resp.content, status_code=resp.status_code, headers=headers, media_type=resp.headers.get("content-type")
            )
        if not stream:
            data = resp.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            usage = data.get("usage") or {}
            p, c = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
            latency = time.perf_counter() - started
            self._record(served, latency, p, c)
            if experiment is not None and served == variant and self._rng.random() < self.shadow_rate:
                meta["pair_id"] = request_id
                self._shadow(meta, path, upstream, chat)
            self._log(meta, text or "", choice.get("finish_reason"), latency, p, c)
            return JSONResponse(data, headers=headers)
        return StreamingResponse(
            self._relay(resp, chat, started, meta), media_type="text/event-stream", headers=headers
        )

    async def _relay(
        self, resp: httpx.Response, chat: bool, started: float, meta: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        parts: list[str] = []
        finish: str | None = None
        p = c = 0
        try:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        parts.append(
                            (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
                        )
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        p, c = int(chunk["usage"]["prompt_tokens"]), int(chunk["usage"]["completion_tokens"])
                yield (line + "\n").encode()
        finally:
            await resp.aclose()
        latency = time.perf_counter() - started
        self._record(meta["variant"], latency, p, c)
        self._log(meta, "".join(parts), finish, latency, p, c)

    # ------------------------------------------------------------ shadow pairs
    def _shadow(self, meta: dict[str, Any], path: str, body: dict[str, Any], chat: bool) -> None:
        """Send the same request to the other arm in the background (after the user's answer), within the cap."""
        if len(self._shadows) >= self.shadow_max_inflight:
            self.m_shadow.labels("skipped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._run_shadow(dict(meta), path, body, chat))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _run_shadow(self, meta: dict[str, Any], path: str, body: dict[str, Any], chat: bool) -> None:
        other = "stable" if meta["variant"] == "canary" else "canary"
        replica = self.replica_choice.choose(self.state.routable(), other, set())
        started = time.perf_counter()
        try:
            if replica is None:
                raise EngineFailure(f"no healthy {other} replica")
            version = replica.policy_version
            resp = await self._post(replica, path, body, stream=False)
            if resp.status_code != 200:
                raise EngineFailure(f"{replica.name}: HTTP {resp.status_code}")
        except EngineFailure as e:
            self.m_shadow.labels("failed").inc()
            log.info("shadow of %s failed: %s", meta["request_id"], e)
            return
        data = resp.json()
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        self.m_shadow.labels("sent").inc()
        meta |= dict(
            request_id=f"{meta['request_id']}:shadow",
            variant=other,
            assigned_variant=other,
            policy_version=version,
            model=replica.served_model,
            shadow=True,
        )
        self._log(
            meta,
            (choice["message"]["content"] if chat else choice["text"]) or "",
            choice.get("finish_reason"),
            time.perf_counter() - started,
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
        )

    # ------------------------------------------------------------ weights and health
    async def _reload(self, replica: Replica, weights: Weights) -> None:
        assert self._client is not None
        if self.weights_via == "restart":
            try:
                await self._check_serves(replica, weights)
            except WrongWeights:
                replica.stale = True
                raise
            replica.stale = False
            return
        try:
            r = await self._client.post(
                f"{replica.base_url}/collective_rpc",
                timeout=max(self.timeout_s, 300.0),
                json={"method": "reload_weights", "kwargs": {"weights_path": weights.path}},
            )
            if r.status_code == 200:
                r = await self._client.post(f"{replica.base_url}/reset_prefix_cache")
        except httpx.HTTPError as e:
            raise EngineFailure(f"{replica.name}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise EngineFailure(f"{replica.name}: HTTP {r.status_code}: {r.text[:300]}")
        replica.policy_version = weights.version

    async def _check_serves(self, replica: Replica, weights: Weights) -> None:
        """weights_via restart: the engine was restarted onto the weights; it must say so (vLLM's /v1/models
        `root` is its --model)."""
        assert self._client is not None
        try:
            r = await self._client.get(f"{replica.base_url}/v1/models", timeout=10.0)
            models = r.json().get("data", []) if r.status_code == 200 else []
            roots = [str(m.get("root", "")).rstrip("/") for m in models]
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise EngineFailure(f"{replica.name}: /v1/models: {type(e).__name__}: {e}") from e
        if weights.path.rstrip("/") not in roots:
            raise WrongWeights(
                f"{replica.name} serves {', '.join(roots) or 'nothing'}, not {weights.path}: "
                f"its pods are not restarted onto {weights.version} yet"
            )
        replica.policy_version = weights.version

    def _pods(self, found: dict[str, list[str]]) -> None:
        """Replace each discovered Service's replicas by its pods' addresses (`found`: name -> addresses; a name
        that did not resolve keeps what it has). A new pod starts unhealthy: the health check that finds it up
        gives it its variant's weights (or checks them) before it serves."""
        for name, variant, url in self.discover:
            addresses = found.get(name)
            if not addresses:
                continue
            port = urlsplit(url).port or 80
            wanted = {f"{name}/{a}": f"http://{f'[{a}]' if ':' in a else a}:{port}" for a in addresses}
            mine = [r for r in self.state.replicas if r.name == name or r.name.startswith(name + "/")]
            keep = [r for r in mine if r.name in wanted]
            if len(keep) == len(mine) == len(wanted):
                continue
            want = self.state.desired.get(variant)
            version = want.version if want else (mine[0].policy_version if mine else "")
            added = [
                Replica(n, variant, u, version, healthy=False)
                for n, u in wanted.items()
                if n not in {r.name for r in keep}
            ]
            self.state.replicas = [r for r in self.state.replicas if r not in mine] + keep + added

    def _resolve_all(self) -> dict[str, list[str]]:
        found = {}
        for name, _, url in self.discover:
            parts = urlsplit(url)
            try:
                found[name] = self.resolve(parts.hostname or "", parts.port or 80)
            except OSError as e:  # DNS down or the Service has no ready pod: keep the replicas we have
                log.info("router: %s does not resolve: %s", url, e)
        return found

    async def load_variant(self, variant: str, weights: Weights, best_effort: bool = False) -> list[str]:
        """Load `weights` on every replica of `variant`, or on none: a failure restores the others.

        With `best_effort`, replicas that cannot be reached are marked unhealthy instead, and get
        the weights from the health loop when they answer again; returns their failures.
        """
        replicas = [r for r in self.state.replicas if r.variant == variant]
        if not replicas:
            raise HTTPException(409, f"no replica serves variant {variant}")
        previous = self.state.desired.get(variant)
        done: list[Replica] = []
        failed: list[str] = []
        for replica in replicas:
            try:
                await self._reload(replica, weights)
                done.append(replica)
            except EngineFailure as e:
                if best_effort:
                    if not isinstance(e, WrongWeights):  # a stale one is up: it gets no traffic already
                        replica.healthy = False
                    failed.append(str(e))
                    continue
                if previous is not None and self.weights_via == "rpc":  # a check changed nothing to restore
                    for r in done:
                        try:
                            await self._reload(r, previous)
                        except EngineFailure:
                            r.healthy = False  # the health loop reloads it when it answers again
                raise HTTPException(
                    502, f"loading {weights.version} on {variant} failed, no replica changed: {e}"
                ) from e
        self.state.desired[variant] = weights
        return failed

    async def check_replicas(self, moved: dict[str, Weights] | None = None) -> None:
        """One health check: the discovered Services' pods, each replica's /health, and the weights of one that came
        back or is stale (a restarted engine serves its start weights: it gets its variant's, or they are checked).

        `moved` (weights_via restart): variant -> the weights another router replica found that variant's engines
        serving (restarted onto them) and published; every replica of those variants is checked against them, not
        only one that came back or is stale."""
        assert self._client is not None
        async with self._checking:
            if self.discover:
                self._pods(await asyncio.to_thread(self._resolve_all))
            for replica in list(self.state.replicas):
                if moved is not None and replica.variant not in moved:
                    continue
                try:
                    ok = (await self._client.get(f"{replica.base_url}/health", timeout=10.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                came_back = ok and not replica.healthy
                replica.healthy = ok
                if not (ok and (came_back or replica.stale or moved is not None)):
                    continue
                try:
                    async with self._control:
                        # the weights a variant should serve, read under the lock a weights call holds: read before
                        # it, they were the old ones once the call had moved them, and a pod the call had just found
                        # on the new weights was checked against the old, held stale, and got no users meanwhile
                        want = (moved or self.state.desired).get(replica.variant)
                        if want is not None:
                            await self._reload(replica, want)
                except WrongWeights:
                    pass  # stale: up, no traffic; checked again next time
                except EngineFailure:
                    replica.healthy = False

    async def _health_loop(self) -> None:
        while True:
            await self.check_replicas()
            await asyncio.sleep(self.health_interval_s)

    # ------------------------------------------------------------ shared state (several replicas)
    def _own_counters(self) -> dict[str, dict[str, dict[str, int]]]:
        return {
            e: {v: {"requests": c.requests, "errors": c.errors, "settled": c.settled} for v, c in arms.items()}
            for e, arms in self.state.counters.items()
        }

    def _counters(self) -> dict[str, dict[str, dict[str, int]]]:
        """This replica's live counters plus the other replicas' last written ones."""
        out = self._own_counters()
        for e, arms in self._others.items():
            for v, c in arms.items():
                mine = out.setdefault(e, {}).setdefault(v, {"requests": 0, "errors": 0, "settled": 0})
                for k in mine:
                    mine[k] += c.get(k, 0)
        return out

    def _desired_json(self) -> dict[str, dict[str, str]]:
        return {v: {"version": w.version, "path": w.path} for v, w in self.state.desired.items()}

    async def _publish(self) -> None:
        """Record this replica's split for the others (after a control call changed it)."""
        if self.shared is not None:
            s = self.state
            split = await asyncio.to_thread(self.shared.write, s.experiment, s.canary_weight, self._desired_json())
            self._split_seq = split.seq

    def apply_shared(self) -> None:
        """Adopt the newest shared split, write this replica's counters, read the others' (blocking: run at start,
        before the replica serves)."""
        if self.shared is None:
            return
        self._adopt(self.shared.read())
        self._exchange_counters()

    def _adopt(self, split: Split | None) -> None:
        """Take `split` as this replica's, if it is newer than the one it has."""
        if split is None or split.seq <= self._split_seq:
            return
        s = self.state
        s.experiment, s.canary_weight = split.experiment, split.canary_weight
        s.desired = {v: Weights(w["version"], w["path"]) for v, w in split.desired.items()}
        for replica in s.replicas:  # another replica loaded them on the engines (Services shared by all)
            if replica.variant in s.desired:
                replica.policy_version = s.desired[replica.variant].version
        self._split_seq = split.seq
        self._set_weight_gauges()

    def _exchange_counters(self) -> None:
        """Write this replica's counters, read the others' (blocking)."""
        assert self.shared is not None
        self.shared.flush(self.replica_id, self._own_counters())
        self._others = self.shared.others(self.replica_id)

    async def sync_shared(self) -> None:
        """Adopt the newest shared split, then exchange counters. With weights_via restart, a split whose weights
        moved (another replica found a variant's engines restarted onto new weights: a loading or a promotion) is
        adopted only after this replica's own replicas of that variant are found and checked against them: adopted
        first, the traffic it moves went to the pods this replica knew until its next health check (gone, or still
        on the old weights), and the users of a promoted version's arm got 502 "none healthy" meanwhile.

        The split adopted is the one checked, read once: a second read could return a newer split (the promotion's
        weights, published between the two reads) and adopt it unchecked, with every stable replica still stale
        from the old weights: 502 "none healthy" for a health interval (CI of stop 42, tests/e2e/
        test_k8s_processes.py)."""
        if self.shared is None:
            return
        split = await asyncio.to_thread(self.shared.read)
        if self.weights_via == "restart" and split is not None and split.seq > self._split_seq:
            moved = {
                v: Weights(w["version"], w["path"])
                for v, w in split.desired.items()
                if self.state.desired.get(v) != Weights(w["version"], w["path"])
            }
            if moved:
                await self.check_replicas(moved)
        self._adopt(split)
        await asyncio.to_thread(self._exchange_counters)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync_shared()
            except Exception as e:  # a database hiccup: keep serving on the split we have, retry next time
                log.warning("router %s: shared state sync failed: %s", self.replica_id, e)

    def snapshot(self) -> dict[str, Any]:
        s = self.state
        return {
            "canary_weight": s.canary_weight,
            "experiment": s.experiment,
            "desired": {v: {"version": w.version, "path": w.path} for v, w in s.desired.items()},
            "replicas": [
                {
                    "name": r.name,
                    "variant": r.variant,
                    "base_url": r.base_url,
                    "policy_version": r.policy_version,
                    "healthy": r.healthy,
                    "drained": r.drained,
                    "stale": r.stale,
                    "inflight": r.inflight,
                }
                for r in s.replicas
            ],
            "counters": self._counters(),
            "traffic": self.traffic.snapshot(),
            "shadow_rate": self.shadow_rate,
        }

    # ------------------------------------------------------------ HTTP
    def ready(self) -> bool:
        """Whether users get answers here (/readyz: a pod's readiness, so whether its Service sends it anything, the
        rollout controller's calls included): a stable replica serves, or every user is on the canary and a canary
        replica serves. The second is a promotion with weights_via restart: the controller moved everyone to the
        canary and the stable pods restart onto the new version, which they serve before the router's weights call
        says it is stable's; that call reaches the router through its Service. Not ready meanwhile, no router replica
        was, the call could not arrive, and the promotion failed at `rollout.restart_wait_s` while the canary served
        every user (tests/e2e/test_k8s_processes.py)."""
        s = self.state
        return bool(s.serving("stable")) or (s.canary_weight >= 1.0 and bool(s.serving("canary")))

    def _build(self) -> FastAPI:
        app = make_app("dynrubric router", self.metrics, ready=self.ready)

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            self._client = http_clients.async_client(timeout=self.timeout_s, headers=self.engine_headers)
            await asyncio.to_thread(self.apply_shared)  # a replica started mid-rollout serves the rollout's split
            self._health_task = asyncio.create_task(self._health_loop())
            if self.shared is not None:
                self._sync_task = asyncio.create_task(self._sync_loop())
            try:
                yield
            finally:
                if self._sync_task is not None:
                    self._sync_task.cancel()
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(self.shared.flush, self.replica_id, self._own_counters())
                self._health_task.cancel()
                for task in list(self._shadows):
                    task.cancel()
                await self._client.aclose()
                await asyncio.to_thread(self.producer.flush)

        app.router.lifespan_context = lifespan

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.handle(request, "/v1/chat/completions", chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.handle(request, "/v1/completions", chat=False)

        @app.post("/v1/feedback")
        async def feedback(body: FeedbackBody, request: Request) -> dict[str, str]:
            from streaming.events import FeedbackEvent

            user = request.headers.get(USER_KEY_HEADER) or body.user or "anonymous"
            try:  # the event model is the schema: it has the last word on values (a dwell needs seconds > 0)
                event = FeedbackEvent(
                    request_id=body.request_id,
                    ts=time.time(),
                    user_key=hash_user(user),
                    kind=body.kind,
                    value=body.value,
                )
            except ValueError as e:
                raise HTTPException(422, f"feedback not accepted by the event schema: {e}") from None
            if not self.producer.send_feedback(event):
                raise HTTPException(503, "the event buffer is full; retry later")
            return {"status": "accepted", "request_id": body.request_id}

        @app.get("/v1/router/state")
        def state() -> dict[str, Any]:
            return self.snapshot()

        @app.post("/control/traffic")
        async def traffic(body: TrafficBody, request: Request) -> dict[str, Any]:
            require_token(request, self.token)
            if body.canary_weight > 0 and not self.state.serving("canary"):
                raise HTTPException(409, "no healthy canary replica; load canary weights first")
            self.state.experiment = body.experiment
            self.state.canary_weight = body.canary_weight
            self._set_weight_gauges()
            await self._publish()
            return self.snapshot()

        @app.post("/control/variants/{variant}/weights")
        async def weights(variant: Literal["stable", "canary"], body: WeightsBody, request: Request) -> dict[str, Any]:
            require_token(request, self.token)
            if not Path(body.path).is_dir():  # a vLLM engine whose reload fails stops serving: check first
                raise HTTPException(400, f"weights path {body.path} is not a directory on the router's machine")
            async with self._control:
                failed = await self.load_variant(variant, Weights(body.version, body.path), body.best_effort)
                await self._publish()
            return self.snapshot() | {"failed": failed}

        @app.post("/control/replicas/{name}/drain")
        async def drain(name: str, body: DrainBody, request: Request) -> dict[str, Any]:
            require_token(request, self.token)
            replica = next((r for r in self.state.replicas if r.name == name), None)
            if replica is None:
                raise HTTPException(404, f"no replica named {name}")
            replica.drained = body.drained
            return self.snapshot()

        return app
