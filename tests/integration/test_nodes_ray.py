"""A round on a real two-node Ray cluster on this machine, with the worker node killed mid-round.

`ray start --head` and a second node (`ray start --address ... --block`, its own process group and its
own resource label) are separate processes started here. The round's actors are spread over both
nodes. Once the round has published its first step, the whole worker node (its process group, its
raylet and every worker process below it) is killed with SIGKILL. The round must notice, resume on the
head from its last published step, and finish with the summary of an undisturbed in-process run, each
step and set counted once.

The file is named to run BEFORE tests/integration/test_ray.py: after that module's local Ray (started and shut down
in the same suite, also when this test ran in a fresh interpreter) every resumed round's TrainerActor
was cancelled before it started ("all references to the actor were removed") until the resumes ran out.
Alone, or first, it passes. The cause is not found yet (Ray 2.60.0): a lead for whoever takes issue 15.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dynrubric.ports import free_port
from dynrubric.train.records import WorkerFailureLine
from tests.integration.test_ray import SMALL, comparable, differences
from tests.train_harness import runner, write_prompts

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


def ray_start(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`ray start ... --block` as its own process group (the node's raylet and workers stay in it)."""
    cmd = [RAY, "start", "--block", "--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1", *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_started(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + 180
    while "Ray runtime started" not in log.read_text():
        assert time.time() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it (Ray's workers are the raylet's children, each in its own
    session, so the node's process group alone does not hold them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node: its process group and every process below it, stopped first so that none is
    spawned or re-parented while the tree is read."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture()
def two_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    port = free_port()
    # the nodes and this driver are one trusted process tree on loopback: no token to hand around
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # the head declares a killed node dead after ~3 s of failed health checks (default: tens of seconds,
    # during which new actors may still be placed on it and die before starting)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }
    temp = Path("/tmp") / f"ray-t{os.getpid()}"  # its own session dir; a socket path must stay short
    head = ray_start(
        "--head",
        f"--port={port}",
        "--include-dashboard=false",
        f"--temp-dir={temp}",
        '--resources={"head": 1}',
        env=env,
        log=tmp_path / "head.log",
    )
    worker = None
    try:
        wait_started(head, tmp_path / "head.log")
        address = f"127.0.0.1:{port}"
        worker = ray_start(f"--address={address}", '--resources={"worker": 1}', env=env, log=tmp_path / "worker.log")
        wait_started(worker, tmp_path / "worker.log")
        ray.init(
            address=address,
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        deadline = time.time() + 120
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.time() < deadline and worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        yield worker
    finally:
        ray.shutdown()
        if worker is not None:
            kill_node(worker)
        kill_node(head)
        shutil.rmtree(temp, ignore_errors=True)


def kill_node_after_first_step(runlog: Path, worker: subprocess.Popen, killed: dict) -> None:
    deadline = time.time() + 600
    while time.time() < deadline:
        if runlog.exists() and '"kind": "step"' in runlog.read_text():
            kill_node(worker)
            killed["at"] = time.time()
            return
        time.sleep(0.1)


@pytest.mark.slow
def test_ray_round_survives_a_killed_worker_node(tmp_path: Path, tiny_model_dir: Path, two_nodes) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    # two policy steps: the step after the kill needs both judge actors, and SPREAD put one of them on the
    # worker node (with a generator step there, the rest of the round could run on the head alone and
    # never meet the dead node: seen once, "worker failures: []")
    small = {**SMALL, "coevolve": {"k_alt": 2}}
    settings = {**small, "executor": "ray"}
    # until the head declares the killed node dead, actors placed on it die before starting and each
    # counts as a failure: a busy machine can need more resumes than the default 3 (seen once in a
    # clean-clone run of the whole suite beside another job)
    cluster = runner(tmp_path / "cluster", tiny_model_dir, prompts, ray={"judges": 2, "max_restarts": 8}, **settings)
    killed: dict = {}
    killer = threading.Thread(
        target=kill_node_after_first_step, args=(cluster.runlog.path, two_nodes, killed), daemon=True
    )
    killer.start()
    disturbed = cluster.run()
    killer.join(timeout=1)
    assert "at" in killed, "the worker node was never killed"

    records = cluster.runlog.records()
    failures = [r for r in records if isinstance(r, WorkerFailureLine)]
    print("worker failures:", [(r.error[:100], r.resumed) for r in failures])
    assert failures and all(r.resumed for r in failures), records
    keys = [r.key for r in records if not isinstance(r, WorkerFailureLine)]
    assert sorted(keys) == sorted(set(keys)) == sorted(["round/1", "round/1/step/0", "round/1/step/1"])
    assert [h.step for h in disturbed.steps] == [0, 1]
    assert disturbed.steps[0].updates == 1  # AdamW's own counter: the first step's update once
    assert len([n for n in ray.nodes() if n["Alive"]]) == 1

    undisturbed = runner(tmp_path / "local", tiny_model_dir, prompts, **small).run()
    assert differences(comparable(undisturbed), comparable(disturbed)) == []
