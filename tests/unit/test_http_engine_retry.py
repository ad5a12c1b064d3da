"""The HTTP engine sends a request once more when its connection breaks under it (a reset after the request went out)
and the server is still there; a server that is gone is still reported as unreachable. Both faults are made for real:
a TCP server on loopback that resets its first connection once it has read a request, and a port nobody listens on."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from dynrubric import http_clients
from dynrubric.engines.http import OpenAIHTTPEngine
from dynrubric.errors import DynrubricError
from dynrubric.ports import free_port


class ResetFirst:
    """Accepts connections on loopback: resets the first `resets` of them (SO_LINGER 0: an RST, not a FIN) after
    reading a request, and answers each later request with a JSON body."""

    def __init__(self, resets: int):
        self.resets = resets
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = conn.recv(65536)
                if not request:
                    continue
                self.requests += 1
                if self.requests <= self.resets:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with linger 0: the client reads a reset
                body = json.dumps({"data": [{"id": "policy"}]}).encode()
                head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                conn.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)

    def close(self) -> None:
        self.sock.close()


def engine_at(url: str) -> OpenAIHTTPEngine:
    """The engine's request path alone (no tokenizer or served-model lookup: those need a model and a server)."""
    engine = object.__new__(OpenAIHTTPEngine)
    engine.base_url, engine.timeout_s = url, 5.0
    engine._client = http_clients.client(base_url=url, timeout=5.0)
    return engine


def test_a_connection_reset_under_a_request_is_sent_once_more():
    server = ResetFirst(resets=1)
    try:
        engine = engine_at(f"http://127.0.0.1:{server.port}")
        assert engine._request("GET", "/v1/models") == {"data": [{"id": "policy"}]}
        assert server.requests == 2
    finally:
        server.close()


def test_a_second_reset_and_a_server_that_is_gone_are_reported_not_retried_forever():
    server = ResetFirst(resets=2)
    try:
        with pytest.raises(DynrubricError, match=r"unreachable \(ReadError\)"):
            engine_at(f"http://127.0.0.1:{server.port}")._request("GET", "/v1/models")
        assert server.requests == 2
    finally:
        server.close()
    with pytest.raises(DynrubricError, match=r"unreachable \(ConnectError\)"):
        engine_at(f"http://127.0.0.1:{free_port()}")._request("GET", "/v1/models")
