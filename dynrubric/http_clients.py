"""HTTP clients of the project's servers: vLLM, the router, the reward server, the engine server, the users' load.

Each of those servers is uvicorn, which closes a connection that has been idle for 5 s (`timeout_keep_alive`;
vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`). httpx keeps an idle connection for 5 s as well, so a request can go out on
a connection the server is closing that moment: httpx raises RemoteProtocolError ("Server disconnected without
sending a response") although the server is up. On busy cores the window is wide; CI saw a judge's generation fail
this way with vLLM alive, and through the router the same race counts as an engine error against a canary.

A client's idle clock starts when it has read a response, after the server's started, so dropping idle
connections at KEEPALIVE_EXPIRY_S, well inside the server's 5 s, leaves no such race.
"""

from __future__ import annotations

from typing import Any

import httpx

KEEPALIVE_EXPIRY_S = 2.0  # < uvicorn's 5 s keep-alive timeout, with room for a busy event loop
LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_S)


def client(**kwargs: Any) -> httpx.Client:
    """An httpx.Client (same arguments) that never reuses a connection the server may be closing."""
    return httpx.Client(limits=LIMITS, **kwargs)


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    """An httpx.AsyncClient (same arguments) that never reuses a connection the server may be closing."""
    return httpx.AsyncClient(limits=LIMITS, **kwargs)
