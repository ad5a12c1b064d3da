"""The rollout judge's seconds per open shadow pair, on each engine it can run on.

A gate poll hands the judge up to `rollout.judge_pairs_per_poll` shadow pairs; a pair whose prompt states a ground
truth is decided without a model, an open one costs a SmolLM2 rubric and its verdicts (`serving/judged.py`). This
times `PairJudge.score` on open prompts of the shipped bank (train split, as the users send them), a poll's worth of
them at a time, with the demo profile's rubric settings, on:

    in-process      the transformers engine in this process for the rubric writer and the verifier (what
                    `build_controller` builds from the default engine settings: the judge before this script)
    server          both on one vLLM server that another process also reloads (the trainer's, in `up`): the
                    judge forgets what the server holds before each batch and reloads its own weights; the
                    rubric writer's weights are a copy of the verifier's in another directory, as a co-evolved
                    generator's would be, so every batch pays both reloads
    server+local    the rubric writer on that server (reloaded before each batch), the verifier in process

The pairs' two answers are SmolLM2's at temperature 1 and the users' max_tokens (48), sampled on the server. Several
`--pairs` sizes run side by side on the same server, each on its own pairs (a size shares none with another, so the
server's prefix cache favours none): whether a bigger poll amortises a batch's fixed cost (the two reloads) and
batches the decoding.
The last line per engine and size: `ENGINE: S s per open pair (P pairs in B batches of N)`.

    python benchmarks/judge_pair_seconds.py [--pairs 4 [16 ...]] [--batches 1]
        [--engines in-process server server+local]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from dynrubric import http_clients, modelcache  # noqa: E402
from dynrubric.app.loop import TRAINER_KV_CACHE_GIB  # noqa: E402
from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings  # noqa: E402
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams  # noqa: E402
from dynrubric.engines.hf import TransformersEngine  # noqa: E402
from dynrubric.engines.http import OpenAIHTTPEngine, SharedServer  # noqa: E402
from dynrubric.engines.vllm_server import VllmServer, every_core  # noqa: E402
from dynrubric.ports import free_port  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402
from dynrubric.rubric.evaluator import Evaluator  # noqa: E402
from dynrubric.rubric.groundtruth import derive  # noqa: E402
from serving.fleet import SERVED_MODEL_NAME, EngineSpec, Fleet, spread_cores  # noqa: E402
from serving.judged import PairJudge  # noqa: E402
from serving.online import ShadowPair  # noqa: E402
from serving.users import load_served  # noqa: E402

ENGINES = ("in-process", "server", "server+local")
SERVER_ENVS = ("auto", "up", "passive", "nobind")


def open_prompts(n: int, seed: int) -> list[str]:
    """`n` open prompts the users send whose text states no ground truth: the judge's model decides their pairs."""
    texts = [p.messages[-1].content for p in load_served() if p.kind == "open"]
    return random.Random(seed).sample([t for t in texts if derive(t).empty], n)


def answers(engine: OpenAIHTTPEngine, prompts: list[str], max_tokens: int, seed: int) -> list[tuple[str, str]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, n=2, seed=seed)
    outs = engine.generate(
        [GenerationRequest(engine.render_chat([{"role": "user", "content": p}]), params) for p in prompts]
    )
    return [(o[0].text, o[1].text) for o in outs]


def server_env(name: str) -> dict[str, str]:
    """The judge's vLLM server's environment under arm `name` of `--server-envs`."""
    return {
        "auto": {},  # vLLM's own binding: what a VllmServer gets where nothing sets it
        "up": {"VLLM_CPU_OMP_THREADS_BIND": every_core()},  # `up`'s rounds' server (app/loop.py), the judge's
        "passive": {"VLLM_CPU_OMP_THREADS_BIND": every_core(), "OMP_WAIT_POLICY": "PASSIVE"},
        "nobind": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},  # OpenMP threads not pinned: the kernel places them
    }[name]


class BusyFleet:
    """`n` users' engines started as `up`'s fleet starts them (serving/fleet.py: one core each, in turn), each sent
    chat requests of the served prompts at `rps` a second (Poisson arrivals, the users' max_tokens, temperature 1):
    the load the rollout judge shares the machine with in `up` (users and their shadow requests)."""

    def __init__(self, n: int, rps: float, model: Path, settings: Settings, seed: int, log_dir: Path):
        self.specs = [
            EngineSpec(
                name=f"busy-{i}",
                variant="stable",
                server="vllm",
                port=free_port(),
                model_dir=model,
                policy_version="base",
                kv_cache_space_gib=settings.vllm.kv_cache_space_gib,
                max_model_len=settings.vllm.max_model_len,
                cpus=spread_cores(i),
            )
            for i in range(n)
        ]
        self.fleet = Fleet(self.specs, log_dir, CollectorRegistry())
        self.start_timeout_s = settings.vllm.start_timeout_s
        self.rps = rps
        self.max_tokens = settings.loop.users_max_tokens
        self.prompts = [p.messages[-1].content for p in load_served()]
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.answered = 0
        self.failed = 0
        self.lock = threading.Lock()

    def __enter__(self) -> BusyFleet:
        try:
            self.fleet.start(self.start_timeout_s)
        except BaseException:
            self.fleet.stop()  # the engines started so far
            raise
        for spec in self.specs:
            t = threading.Thread(target=self._users, args=(spec.base_url,), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _users(self, base_url: str) -> None:
        client = http_clients.client(base_url=base_url, timeout=600)
        pool: list[threading.Thread] = []
        while not self.stop_event.wait(self.rng.expovariate(self.rps)):
            prompt = self.rng.choice(self.prompts)
            t = threading.Thread(target=self._request, args=(client, prompt), daemon=True)
            t.start()
            pool = [x for x in pool if x.is_alive()] + [t]
        for t in pool:
            t.join()
        client.close()

    def _request(self, client: Any, prompt: str) -> None:
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
        }
        try:
            client.post("/v1/chat/completions", json=body).raise_for_status()
            ok = True
        except Exception:  # noqa: BLE001 (a load generator counts failures, it does not stop on them)
            ok = False
        with self.lock:
            self.answered += ok
            self.failed += not ok

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join()
        self.fleet.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pairs",
        type=int,
        nargs="+",
        default=[4],
        help="open pairs per batch (a poll's share of open pairs); several: side by side",
    )
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument(
        "--server-envs",
        nargs="+",
        choices=SERVER_ENVS,
        default=["auto"],
        help="the judge's vLLM server's environment, one server after another (see server_env)",
    )
    ap.add_argument("--busy", type=int, default=0, help="users' engines beside the judge, as `up`'s fleet runs them")
    ap.add_argument("--busy-rps", type=float, default=0.4, help="requests a second to each users' engine")
    ap.add_argument(
        "--writers",
        nargs="+",
        default=["base"],
        help="the rubric writer's weights, side by side: base (a copy of the verifier's in another directory) or a "
        "directory (a run's co-evolved generator, e.g. `up`'s train/generator/model)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", help="keep the servers' logs there (default: a temporary directory)")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    # a kill stops the servers too: SystemExit unwinds the context managers that own them (they run in their own
    # process groups, so a SIGTERM to this process alone left three vLLM servers behind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    settings = load_settings(None, {}, profile="demo")
    model = modelcache.resolve(settings.paths.resolved_home(), settings.models.verifier)
    prompts = open_prompts(sum(args.pairs) * args.batches, args.seed)
    results: dict[tuple[str, int], tuple[float, int]] = {}
    log_dir = Path(args.log_dir) if args.log_dir else None
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        logs = log_dir or Path(tmp)
        writer_dirs = {w: Path(tmp) / "generator" if w == "base" else Path(w) for w in args.writers}
        if "base" in writer_dirs:  # the co-evolved generator's weights stand-in: the verifier's, in another directory
            shutil.copytree(model, writer_dirs["base"])
        # every arm's server starts before the load, as `up` starts the rounds' server before any user
        cfg = settings.vllm.model_copy(update={"kv_cache_space_gib": TRAINER_KV_CACHE_GIB, "start_timeout_s": 900.0})
        servers = {
            name: stack.enter_context(VllmServer(model, cfg, env=server_env(name), log_path=logs / f"{name}.log"))
            for name in args.server_envs
        }
        sampler = OpenAIHTTPEngine(next(iter(servers.values())).base_url, model)
        t0 = time.perf_counter()
        sampled = answers(sampler, prompts, settings.loop.users_max_tokens, args.seed)  # every arm judges these
        pairs = [ShadowPair(f"p{i}", p, a, b) for i, (p, (a, b)) in enumerate(zip(prompts, sampled, strict=True))]
        print(f"{len(pairs)} pairs' answers sampled in {time.perf_counter() - t0:.1f} s", flush=True)
        sampler.close()
        busy = stack.enter_context(BusyFleet(args.busy, args.busy_rps, model, settings, args.seed, logs / "busy"))
        busy_t0 = time.perf_counter()
        starts = [sum(args.pairs[:i]) * args.batches for i in range(len(args.pairs))]  # each size's own pairs
        for env_name, server in servers.items():
            for name, writer, (size, start) in [
                (n, w, s) for n in args.engines for w in writer_dirs for s in zip(args.pairs, starts, strict=True)
            ]:
                arm = f"{name}[{env_name}]" + (f" writer {writer}" if len(writer_dirs) > 1 else "")
                mean = judge_seconds(name, server, model, writer_dirs[writer], settings, pairs, start, size, args, arm)
                results[(arm, size)] = (mean, size * args.batches)
        busy_s = time.perf_counter() - busy_t0
        if args.busy:
            print(
                f"busy engines: {args.busy} at {args.busy_rps} requests/s each asked; answered "
                f"{busy.answered / busy_s:.2f}/s in all ({busy.answered} answered, {busy.failed} failed, "
                f"{busy_s:.0f} s)"
            )
    for (arm, size), (sec, n) in results.items():
        print(f"{arm}: {sec:.1f} s per open pair ({n} pairs in {args.batches} batches of {size})")


def judge_seconds(
    name: str,
    server: VllmServer,
    model: Path,
    writer_dir: Path,
    settings: Settings,
    pairs: list[ShadowPair],
    start: int,
    size: int,
    args: argparse.Namespace,
    arm: str,
) -> float:
    """The judge's mean seconds per pair over `args.batches` batches of `size` pairs from `start`, engine `name`."""
    shared = SharedServer()
    local: TransformersEngine | None = None
    writer: Engine
    verifier: Engine
    if name == "in-process":
        local = TransformersEngine(model)
        writer, verifier = local, local
    else:
        writer = OpenAIHTTPEngine(server.base_url, writer_dir, shared=shared)
        writer.load_weights(writer_dir, "generator")
        if name == "server":
            verifier = OpenAIHTTPEngine(server.base_url, model, shared=shared)
            verifier.load_weights(model, "verifier")
        else:
            local = TransformersEngine(model)
            verifier = local
    evaluator = Evaluator(writer, verifier, settings.rubric)
    judge = PairJudge(evaluator, settings.rubric.eps)
    verify_items = evaluator.verifier.verify_items
    work = {"verify_s": 0.0, "read": 0, "prompts": 0, "rubrics_s": 0.0, "items": 0}

    def timed_verify_items(question: str, responses: Any, items: Any) -> Any:
        """The verifier's calls, timed and counted: what the judge's time goes to beside the rubrics."""
        t = time.perf_counter()
        out = verify_items(question, responses, items)
        work["verify_s"] += time.perf_counter() - t
        work["read"] += len(items)
        work["prompts"] += len(items) * len(responses)
        return out

    evaluator.verifier.verify_items = timed_verify_items  # type: ignore[method-assign]
    generate_many = evaluator.rubric_generator.generate_many

    def counted_generate_many(*a: Any, **kw: Any) -> Any:
        """The rubric writer's calls, timed, and their items counted."""
        t = time.perf_counter()
        generated, counts = generate_many(*a, **kw)
        work["rubrics_s"] += time.perf_counter() - t
        work["items"] += sum(len(g.rubric.items) for g in generated)
        return generated, counts

    evaluator.rubric_generator.generate_many = counted_generate_many  # type: ignore[method-assign]
    total = 0.0
    for b in range(args.batches):
        batch = pairs[start + b * size : start + (b + 1) * size]
        shared.forget()  # another process (the trainer) may have reloaded the server since
        work.update(verify_s=0.0, read=0, prompts=0, rubrics_s=0.0, items=0)
        t0 = time.perf_counter()
        scores = judge.score(batch)
        took = time.perf_counter() - t0
        total += took
        print(
            f"{arm}: batch {b}: {len(batch)} pairs in {took:.1f} s (rubrics {work['rubrics_s']:.1f} s, {work['items']} "
            f"items; the verifier {work['verify_s']:.1f} s: {work['read']} items read, {work['prompts']} (item, "
            f"answer) prompts), canary scores {scores}",
            flush=True,
        )
    for e in {id(e): e for e in (writer, verifier)}.values():
        e.close()
    del local
    return total / (size * args.batches)


if __name__ == "__main__":
    main()
