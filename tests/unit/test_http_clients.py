"""Our HTTP clients drop an idle connection before a uvicorn server (5 s keep-alive) closes it, so no request goes
out on a connection the server is closing: that race failed a judge's generation in CI with vLLM up
(RemoteProtocolError). The race itself needs the server's close and the client's send to meet within a
millisecond, which no test can arrange on purpose; what the tests check is the rule that rules it out."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dynrubric import http_clients

ROOT = Path(__file__).resolve().parents[2]
UVICORN_KEEP_ALIVE_S = 5  # uvicorn's timeout_keep_alive default; vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE


class KeepAliveServer(ThreadingHTTPServer):
    """A real HTTP/1.1 server that keeps connections open and counts the ones it accepted."""

    daemon_threads = True
    accepted = 0

    def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
        self.accepted += 1
        super().process_request(request, client_address)


class Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_an_idle_connection_is_dropped_well_before_the_servers_keep_alive_ends():
    assert http_clients.KEEPALIVE_EXPIRY_S < UVICORN_KEEP_ALIVE_S / 2
    server = KeepAliveServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with http_clients.client(base_url=f"http://127.0.0.1:{server.server_address[1]}", timeout=5) as client:
            assert client.get("/").text == "ok" and client.get("/").text == "ok"
            assert server.accepted == 1  # back to back: the connection is kept and reused
            time.sleep(http_clients.KEEPALIVE_EXPIRY_S + 0.5)
            assert client.get("/").text == "ok"
            assert server.accepted == 2  # idle past the expiry: a fresh connection, not the one the server may close
    finally:
        server.shutdown()
        server.server_close()


def test_no_module_builds_an_httpx_client_of_its_own():
    tracked = subprocess.run(
        ["git", "ls-files", "dynrubric/*.py", "serving/*.py", "streaming/*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(tracked) > 50
    direct = re.compile(r"httpx\.(Async)?Client\(")
    offenders = [
        f"{path}:{n}"
        for path in tracked
        if path != "dynrubric/http_clients.py" and (ROOT / path).is_file()
        for n, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert offenders == [], "build clients with dynrubric.http_clients.client / async_client"
