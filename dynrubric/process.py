"""The child processes the project runs (Tansu broker, engine fleet, vLLM server, Prometheus): started with
their output in a log file, polled until they answer, stopped with SIGTERM and then SIGKILL.

A child started in its own session (`own_group=True`, the default) leads a process group, and signals go
to the whole group: vLLM forks engine-core workers that must not outlive it.

A child started from the main thread also gets SIGTERM when its parent dies, even by SIGKILL (`setpriv
--pdeathsig`, Linux's PR_SET_PDEATHSIG), so a killed benchmark or test leaves no vLLM server behind. Only from the
main thread: the kernel sends that signal when the *thread* that forked the child ends, and a child started by a
worker thread (a supervisor's restart) must outlive that thread. A daemon that must outlive the command that
started it (`dynrubric broker start`) says so (`outlive_parent=True`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path


def spawn(
    cmd: Sequence[str],
    log_path: Path | None,
    *,
    env: Mapping[str, str] | None = None,
    own_group: bool = True,
    outlive_parent: bool = False,
) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr appended to `log_path` (discarded when None), stdin closed; it is sent
    SIGTERM when this process dies unless `outlive_parent` (module docstring)."""
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    setpriv = shutil.which("setpriv")  # util-linux
    if not outlive_parent and setpriv is not None and threading.current_thread() is threading.main_thread():
        cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]  # setpriv execs cmd: the pid and session are cmd's
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            list(cmd),
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=own_group,
        )
    finally:
        if not isinstance(log, int):  # not subprocess.DEVNULL
            log.close()  # the child holds its own descriptor


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (a child started with `own_group` leads one: it and everything it
    started that did not leave it)."""
    return [pid for pid, _ in _session_stats(sid)]


def session_cpu_seconds(sid: int) -> float:
    """User + system CPU seconds of the live processes of session `sid` (those that ended are not counted)."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(f[11]) + int(f[12])) / tick for _, f in _session_stats(sid))  # utime, stime


def _session_stats(sid: int) -> list[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command's name) of each process in session `sid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        if int(fields[3]) == sid:  # state, ppid, pgrp, session
            out.append((int(entry.name), fields))
    return out


def wait_until(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, poll_s: float) -> bool:
    """Poll `ready()` every `poll_s` until it is true (True), or the process exits or `timeout_s` passes
    (False; `proc.poll()` tells which)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if ready():
            return True
        time.sleep(poll_s)
    return False


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200."""
    import httpx  # not at module scope: the CLI imports this module and should start fast

    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def terminate(procs: subprocess.Popen | Iterable[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM every running process (its group when it leads one), wait up to `timeout_s` for all of
    them together, then SIGKILL the rest."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def log_tail(path: Path | None, lines: int = 5) -> str:
    """The last lines of a child's log, joined with ' | ' (for a one-line error)."""
    if path is None or not path.is_file():
        return ""
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


def stop_signals_interrupt() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread, so a long-running command stops
    its children in order. Set explicitly: a process started in the background by a non-interactive
    shell, or by a parent that ignores SIGINT, inherits SIGINT ignored, and Python then keeps it so."""
    if threading.current_thread() is threading.main_thread():

        def handler(*_: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
