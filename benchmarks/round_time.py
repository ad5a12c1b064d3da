"""How long one round of `dynrubric up` takes, today against the round issue 38 found, side by side.

One round of the demo profile from base (its ten policy steps of 8 sets x 4 candidates, one generator step, the
held-out evaluation with the dev split and the five reported figures), run once per arm on the same training prompts
and seed, as `up` runs its rounds: the loop's own round code (`RoundRunner`) on one vLLM server that the policy and
the rubric generator take turns on, with the verifier in process (`engine.one_shared_server`, the server started as
`up` starts it). Each arm starts from a fresh state directory, so each decodes base on the dev split and the figures
inside its round, as `up`'s first round does.

    after    this checkout: its code and its demo profile as shipped
    filed    the round as issue 38 found it: the code and the demo profile of commit `FILED` (01cc34f, the
             commit the issue's numbers were taken at), unpacked from git (`git archive`) into the output
             directory and run by this same file in a child process (`--checkout`), with its own vLLM server
    before   this checkout's code with the demo's speed settings of `FILED` (`BEFORE`): the trainer under bfloat16
             autocast whatever the CPU, micro-batches of 4, 16 requests in flight per engine, the evaluation's
             prompts sent 32 at a time. It isolates what the settings alone give (docs/benchmarks.md: 0.52 on an
             AVX2-only CPU, 0.80 on one with AVX512-BF16)

`ratio: X` is after / filed: the new round's time over the round of the issue, the same steps, prompts and seed, on
the same machine. With `before` also run, `settings ratio: X` is after / before. The arms run in the order given
(`--arms`; the default runs `after` first, so that the trainer's peak memory printed after it is its own).

It prints each stage's seconds (the round's `stage_seconds`, as `dynrubric report` shows them) for each arm and their
totals.

    python benchmarks/round_time.py [--out DIR] [--arms after filed before] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def checkout_root(argv: list[str]) -> Path:
    """The checkout whose code this process runs: `--checkout DIR` (the child that times `filed`), else this file's
    own. Read before the imports below, which must come from it."""
    if "--checkout" in argv:
        return Path(argv[argv.index("--checkout") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


ROOT = checkout_root(sys.argv)
sys.path.insert(0, str(ROOT))  # the checkout timed, not another install
sys.path.insert(0, str(ROOT / "benchmarks"))  # its supervision.py: the training prompts and round runner

# Only names that every timed checkout has (FILED's too): the child imports them from an older tree.
from supervision import deep_merge, train_run, training_prompts  # noqa: E402

from dynrubric import modelcache  # noqa: E402
from dynrubric.app.loop import TRAINER_KV_CACHE_GIB  # noqa: E402
from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings, override  # noqa: E402
from dynrubric.engines import one_shared_server  # noqa: E402
from dynrubric.engines.vllm_server import VllmServer  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402
from dynrubric.train.records import RoundSummary, read_summary  # noqa: E402
from dynrubric.train.rounds import SUMMARY, run_dir_of  # noqa: E402

#: the commit whose round issue 38 measured ("793-846 s in today's fresh-clone make up")
FILED = "01cc34f"
#: the settings each arm puts over its checkout's demo profile
BEFORE: dict[str, Any] = {
    "train": {"grpo": {"compute_dtype": "bfloat16", "micro_batch_size": 4}},
    "engine": {"concurrency": 16},
    "evaluation": {"decode_batch": 32},
}
ARMS: dict[str, dict[str, Any]] = {"after": {}, "filed": {}, "before": BEFORE}
QUICK: dict[str, Any] = {
    "train": {"steps_per_round": 3, "coevolve": {"k_alt": 2, "k_alt_generator": 1}},
    "evaluation": {"max_prompts": 10, "report_prompts": 12},
}


def arm_settings(base: Settings, arm: str, run: Path, prompts_file: Path, url: str) -> Settings:
    # as `up`'s rounds: the policy and the generator on the one server, the verifier in process (loop.py)
    engine = one_shared_server(url, in_process=["verifier"]) | ARMS[arm].get("engine", {})
    return override(
        base,
        deep_merge(
            ARMS[arm],
            {
                "paths": {"state_dir": str(run)},
                "train": {"prompt_source": "jsonl", "prompts_file": str(prompts_file)},
                "engine": engine,
            },
        ),
    )


def filed_command(checkout: Path, out: Path, prompts_file: Path, quick: bool) -> list[str]:
    """The child that times `filed`: this file run on `checkout`'s code, its one arm `after` (that checkout's demo
    as shipped), on the parent's prompts."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--checkout", str(checkout), "--arms", "after"]
    cmd += ["--out", str(out), "--prompts-file", str(prompts_file)]
    return cmd + (["--quick"] if quick else [])


def time_filed(out: Path, prompts_file: Path, quick: bool) -> dict[str, Any]:
    """Unpack `FILED` into `out`/checkout, time its round in a child process, return the child's results."""
    checkout = out / "checkout"
    shutil.rmtree(checkout, ignore_errors=True)
    checkout.mkdir(parents=True)
    here = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(here), "archive", FILED], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True)
    # anything the child spawns (its vLLM server) imports the old tree too, not the installed checkout
    env = os.environ | {"PYTHONPATH": str(checkout)}
    subprocess.run(filed_command(checkout, out, prompts_file, quick), check=True, env=env)
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/dynrubric-round-time"))
    ap.add_argument("--arms", nargs="+", default=["after", "filed"], choices=list(ARMS))
    ap.add_argument("--quick", action="store_true", help="a tiny round: does it run end to end")
    ap.add_argument("--checkout", type=Path, help=argparse.SUPPRESS)  # the child: the code it times (read above)
    ap.add_argument("--prompts-file", type=Path, help=argparse.SUPPRESS)  # the child: the parent's prompts
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    base = load_settings(None, env, profile="demo")
    if args.quick:
        base = override(base, QUICK)
    per_round = base.train.prompts_per_step * base.train.coevolve.k_alt
    prompts_file = args.prompts_file or out / "prompts.jsonl"
    if args.prompts_file is None:
        prompts_file.write_text("".join(json.dumps(p) + "\n" for p in training_prompts(per_round)))
    print(
        f"{ROOT}: one round of {base.train.coevolve.k_alt} policy steps x {base.train.prompts_per_step} sets x "
        f"{base.train.candidates} candidates and {base.train.coevolve.k_alt_generator} generator step(s), "
        f"{per_round} training prompts; figures {', '.join(base.evaluation.figures)}",
        flush=True,
    )

    # as `up` binds its rounds' server, over every core (`every_core`; FILED's VllmServer reads it from os.environ)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    model = modelcache.resolve(base.paths.resolved_home(), base.models.verifier)
    cfg = base.vllm.model_copy(update={"kv_cache_space_gib": TRAINER_KV_CACHE_GIB})
    stages: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}

    def time_here(arm: str, server_url: str) -> None:
        run = out / arm
        shutil.rmtree(run, ignore_errors=True)
        settings = arm_settings(base, arm, run, prompts_file, server_url)
        print(f"{arm}: training one round in {run}", flush=True)
        t0 = time.monotonic()
        train_run(settings, 1)
        wall = time.monotonic() - t0
        summary = read_summary(sorted((run_dir_of(settings) / "rounds").iterdir())[-1] / SUMMARY)
        assert isinstance(summary, RoundSummary)  # the embedded trainer's round, not OpenRLHF's
        stages[arm] = dict(summary.stage_seconds)
        totals[arm] = float(summary.seconds)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"{arm}: round {summary.seconds:.0f}s (wall {wall:.0f}s); peak RSS so far {peak:.1f} GiB", flush=True)

    for arm in args.arms:
        if arm == "filed":  # its own process and vLLM server, on its own code
            filed = time_filed(out / "filed", prompts_file, args.quick)
            stages["filed"], totals["filed"] = filed["stages"]["after"], filed["totals"]["after"]
            print(f"filed: round {totals['filed']:.0f}s ({FILED})", flush=True)
        else:  # a server of this checkout's, as `up` starts it
            with VllmServer(model, cfg) as server:
                time_here(arm, server.base_url)

    (out / "results.json").write_text(json.dumps({"stages": stages, "totals": totals}, indent=1))
    print("\n".join(stage_table(stages, totals)))


def stage_table(stages: dict[str, dict[str, float]], totals: dict[str, float]) -> list[str]:
    """Each stage's seconds per arm, the rounds' totals, and the ratios of the arms that ran."""
    names = list(dict.fromkeys(k for arm in stages for k in stages[arm]))
    lines = [f"\n{'stage':20} " + " ".join(f"{a:>9}" for a in stages)]
    lines += [f"{name:20} " + " ".join(f"{stages[a].get(name, 0.0):>9.1f}" for a in stages) for name in names]
    lines.append(f"{'round':20} " + " ".join(f"{totals[a]:>9.1f}" for a in stages))
    if "after" in totals and "before" in totals:
        lines.append(f"settings ratio: {totals['after'] / totals['before']:.2f} (after / before)")
    if "after" in totals and "filed" in totals:
        lines.append(f"ratio: {totals['after'] / totals['filed']:.2f} (after / filed, {FILED})")
    return lines


if __name__ == "__main__":
    main()
