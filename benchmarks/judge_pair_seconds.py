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

The pairs' two answers are SmolLM2's at temperature 1 and the users' max_tokens (48), sampled on the server. The
last line per engine: `ENGINE: S s per open pair (P pairs in B batches)`.

    python benchmarks/judge_pair_seconds.py [--pairs 4] [--batches 1] [--engines in-process server server+local]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynrubric import modelcache  # noqa: E402
from dynrubric.config_loader import load_settings  # noqa: E402
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams  # noqa: E402
from dynrubric.engines.hf import TransformersEngine  # noqa: E402
from dynrubric.engines.http import OpenAIHTTPEngine, SharedServer  # noqa: E402
from dynrubric.engines.vllm_server import VllmServer  # noqa: E402
from dynrubric.rubric.evaluator import Evaluator  # noqa: E402
from dynrubric.rubric.groundtruth import derive  # noqa: E402
from serving.judged import PairJudge  # noqa: E402
from serving.online import ShadowPair  # noqa: E402
from serving.users import load_served  # noqa: E402

ENGINES = ("in-process", "server", "server+local")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4, help="open pairs per batch (a poll's share of open pairs)")
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    settings = load_settings(None, {}, profile="demo")
    model = modelcache.resolve(settings.paths.resolved_home(), settings.models.verifier)
    prompts = open_prompts(args.pairs * args.batches, args.seed)
    results: dict[str, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp, VllmServer(model, settings.vllm) as server:
        writer_dir = Path(tmp) / "generator"  # the co-evolved generator's weights stand-in: another directory
        shutil.copytree(model, writer_dir)
        sampler = OpenAIHTTPEngine(server.base_url, model)
        t0 = time.perf_counter()
        pairs = [
            ShadowPair(f"p{i}", p, stable, canary)
            for i, (p, (stable, canary)) in enumerate(
                zip(prompts, answers(sampler, prompts, settings.loop.users_max_tokens, args.seed), strict=True)
            )
        ]
        print(f"{len(pairs)} pairs' answers sampled on the server in {time.perf_counter() - t0:.1f} s", flush=True)
        for name in args.engines:
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
            judge = PairJudge(Evaluator(writer, verifier, settings.rubric), settings.rubric.eps)
            total = 0.0
            for b in range(args.batches):
                batch = pairs[b * args.pairs : (b + 1) * args.pairs]
                shared.forget()  # another process (the trainer) may have reloaded the server since
                t0 = time.perf_counter()
                scores = judge.score(batch)
                took = time.perf_counter() - t0
                total += took
                print(f"{name}: batch {b}: {len(batch)} pairs in {took:.1f} s, canary scores {scores}", flush=True)
            results[name] = (total / len(pairs), len(pairs))
            for e in {id(e): e for e in (writer, verifier)}.values():
                e.close()
            del local
        sampler.close()
    for name, (s, n) in results.items():
        print(f"{name}: {s:.1f} s per open pair ({n} pairs in {args.batches} batches)")


if __name__ == "__main__":
    main()
