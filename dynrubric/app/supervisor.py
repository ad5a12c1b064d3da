"""Supervision of the main job's child processes: started, health-checked, restarted when they die.

Two kinds of child:
- a service (ingest): runs until stopped; a watcher thread restarts it when it exits, or when its
  health URL fails `unhealthy_after` checks in a row (then it is killed first);
- a job (a training round): runs to completion; when a signal killed it (kill -9, OOM killer) it is
  started again (the round resumes from its last published step); any other non-zero exit is an error.

Every restart, including those other supervisors report through `record_restart` (the engine fleet),
is logged with its reason and counted in `dynrubric_restarts_total{component}`. A child past
`max_restarts` is left down and reported: a crash loop must not hide behind restarts.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from dynrubric import atomic
from dynrubric.errors import DynrubricError
from dynrubric.process import http_ok, log_tail, spawn, terminate, wait_until


@dataclass(frozen=True)
class ChildSpec:
    name: str
    command: Sequence[str]
    env: Mapping[str, str] | None = None
    health_url: str | None = None
    start_timeout_s: float = 120.0


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen
    restarts: int = 0
    failed_checks: int = 0
    given_up: bool = False
    history: list[str] = field(default_factory=list)
    # a (re)started service answers /health only once it has loaded (a vLLM server: a minute or more): until
    # then its failed checks do not count, but it gets no longer than its start_timeout_s
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(
        self,
        log_dir: Path,
        metrics: CollectorRegistry,
        log: Callable[[str], None],
        health_interval_s: float = 2.0,
        max_restarts: int = 5,
        unhealthy_after: int = 3,
    ):
        self.log_dir = log_dir
        self.log = log
        self.health_interval_s = health_interval_s
        self.max_restarts = max_restarts
        self.unhealthy_after = unhealthy_after
        self.restarts = Counter(
            "dynrubric_restarts_total",
            "child processes of the main job restarted after dying or failing their health checks",
            ["component"],
            registry=metrics,
        )
        self._children: dict[str, _Child] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def record_restart(self, component: str, reason: str) -> None:
        self.restarts.labels(component).inc()
        self.log(f"restart: {component} ({reason})")

    def record_pid(self, name: str, pid: int) -> None:
        """`<log_dir>/<name>.pid`: what an operator, or a fault test, signals."""
        atomic.write_text(self.log_dir / f"{name}.pid", f"{pid}\n")

    def restart_counts(self) -> dict[str, int]:
        return {
            s.labels["component"]: int(s.value)
            for m in self.restarts.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }

    # ------------------------------------------------------------ services
    def start(self, spec: ChildSpec) -> None:
        """Start a service and wait until its health URL answers (or it has started, without one)."""
        child = _Child(spec, self._spawn(spec))
        with self._lock:
            self._children[spec.name] = child
        self._wait_ready(child)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)
            self._watcher.start()

    def _spawn(self, spec: ChildSpec) -> subprocess.Popen:
        proc = spawn(spec.command, self.log_path(spec.name), env=spec.env)
        self.record_pid(spec.name, proc.pid)
        return proc

    def _wait_ready(self, child: _Child) -> None:
        spec = child.spec
        url = spec.health_url
        if url is None:
            return
        if wait_until(child.proc, lambda: http_ok(url, 2.0), spec.start_timeout_s, 0.3):
            child.ready = True
            return
        raise DynrubricError(
            f"{spec.name} did not become healthy within {spec.start_timeout_s:.0f} s "
            f"(exit code {child.proc.poll()}): {log_tail(self.log_path(spec.name))}",
            f"read {self.log_path(spec.name)}",
        )

    def process(self, name: str) -> subprocess.Popen:
        return self._children[name].proc

    def wait_ready(self, name: str) -> None:
        """Return once service `name` answers its health URL (at once when it does): a job that needs the service
        must not start while the watcher restarts it. Raises when it is given up on, or is not healthy within its
        start timeout plus two of the watcher's intervals (the time to notice a death and restart it)."""
        child = self._children[name]
        url = child.spec.health_url
        deadline = time.monotonic() + child.spec.start_timeout_s + 2 * self.health_interval_s
        while True:
            self.check_alive()
            # the watcher swaps `proc` on a restart, and sets `ready` once the new one answers
            if child.ready and child.proc.poll() is None and (url is None or http_ok(url, 2.0)):
                return
            if time.monotonic() > deadline:
                raise DynrubricError(
                    f"{name} is not healthy {child.spec.start_timeout_s:.0f} s after it was needed: "
                    f"{log_tail(self.log_path(name))}",
                    f"read {self.log_path(name)}",
                )
            time.sleep(0.3)

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            with self._lock:
                children = list(self._children.values())
            for child in children:
                if self._stop.is_set() or child.given_up:
                    continue
                reason = None
                if child.proc.poll() is not None:
                    reason = f"exited with code {child.proc.returncode}"
                elif child.spec.health_url is not None and not http_ok(child.spec.health_url, 2.0):
                    if not child.ready:  # still starting: only its start timeout counts
                        if time.monotonic() - child.started_at <= child.spec.start_timeout_s:
                            continue
                        reason = f"not healthy {child.spec.start_timeout_s:.0f} s after its start"
                    else:
                        child.failed_checks += 1
                        if child.failed_checks >= self.unhealthy_after:
                            reason = f"failed {child.failed_checks} health checks in a row"
                    if reason is not None:
                        terminate(child.proc, timeout_s=10)
                else:
                    child.failed_checks, child.ready = 0, True
                if reason is not None:
                    self._restart(child, reason)

    def _restart(self, child: _Child, reason: str) -> None:
        if child.restarts >= self.max_restarts:
            child.given_up = True
            self.log(
                f"giving up on {child.spec.name}: {reason}, after {child.restarts} restarts "
                f"(log {self.log_path(child.spec.name)})"
            )
            return
        child.restarts += 1
        child.failed_checks = 0
        self.record_restart(child.spec.name, reason)
        child.proc = self._spawn(child.spec)
        child.ready, child.started_at = False, time.monotonic()

    def check_alive(self) -> None:
        """Raise when a service was given up on (the main job cannot go on without it)."""
        for child in self._children.values():
            if child.given_up:
                raise DynrubricError(
                    f"{child.spec.name} keeps dying ({child.restarts} restarts)",
                    f"read {self.log_path(child.spec.name)}",
                )

    # ------------------------------------------------------------ jobs
    def run_job(self, spec: ChildSpec) -> None:
        """Run `spec` to a zero exit; start it again when a signal killed it; raise on any other exit.

        Ctrl-C while waiting stops the job (SIGTERM, then SIGKILL) before it propagates."""
        restarts = 0
        while True:
            proc = self._spawn(spec)
            try:
                rc = proc.wait()
            except BaseException:
                terminate(proc, timeout_s=30)
                raise
            if rc == 0:
                return
            if rc < 0 and not self._stop.is_set() and restarts < self.max_restarts:
                restarts += 1
                self.record_restart(spec.name, f"killed by signal {-rc}")
                continue
            raise DynrubricError(
                f"{spec.name} failed with exit code {rc}: {log_tail(self.log_path(spec.name))}",
                f"read {self.log_path(spec.name)}",
            )

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=30)
        terminate([c.proc for c in self._children.values()], timeout_s=30)
