"""Does the closed loop make the served model better? Ground truth on held-out prompts, base vs final.

Runs `dynrubric up` (the demo's embedded parts: Tansu, ingest, a vLLM stable and canary engine, the router,
simulated users, rounds, canary rollouts behind the gate) for as many cycles as fit in `--minutes`
(`up --minutes`: no cycle starts that the last one's length says would not end in time), leaving the
registry under `DIR/registry/checkpoints/<version>/` (HF model directories). Then it evaluates the base
and the final served version on the held-out prompts with ground truth (`dynrubric eval-policy`: greedy,
the users' max_tokens, the official IFEval checkers and computed answers; no judge) and prints

    heldout_pass[base]: X
    heldout_pass[final]: Y
    delta: D (95% CI lo..hi)
    final_version: V

and the learning curve, one line per cycle (each round's candidate and parent on the same prompts).

    python benchmarks/learning.py --state-dir DIR [--minutes M] [--engine-server vllm|transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install


def run_loop(state: Path, minutes: float, extra: list[str], env: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", "dynrubric", "up", "--forever", "--minutes", str(minutes), *extra]
    print(f"$ {' '.join(cmd)}  (state dir {state})", flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=45.0, help="time budget of the closed loop")
    ap.add_argument(
        "--engine-server",
        choices=["vllm", "transformers"],
        default=None,
        help="the serving engines (default: the config's, vLLM)",
    )
    ap.add_argument("--config", type=Path, default=None, help="a config file for `dynrubric -c`")
    args = ap.parse_args()
    state = args.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    # the registry lives under the state dir by default: DIR/registry/registry.sqlite, DIR/registry/checkpoints/
    env = {**os.environ, "DYNRUBRIC_PATHS__STATE_DIR": str(state)}
    if args.config is not None:
        env["DYNRUBRIC_CONFIG"] = str(args.config.resolve())
    extra = [] if args.engine_server is None else ["--engine-server", args.engine_server]
    started = time.monotonic()
    rc = run_loop(state, args.minutes, extra, env)
    loop_s = time.monotonic() - started
    if rc != 0:
        raise SystemExit(f"dynrubric up failed (exit {rc})")

    from dynrubric.config_loader import load_settings
    from dynrubric.registry import open_registry

    settings = load_settings(args.config, env, profile="demo")  # the profile `up` ran with
    registry = open_registry(settings)
    final = registry.stable()
    versions = ["base"] + ([final.version] if final and final.version != "base" else [])
    subprocess.run([sys.executable, "-m", "dynrubric", "eval-policy", *versions], env=env, cwd=ROOT, check=True)

    from dynrubric.train.policy_eval import compare, decode_params, eval_key, heldout_prompts, outcome_store

    key = eval_key(heldout_prompts(settings), decode_params(settings))
    store = outcome_store(settings)
    base = store.get("base", key)
    last = store.get(versions[-1], key)
    assert base is not None and last is not None, "eval-policy has just stored both"
    e = settings.evaluation
    c = compare(last, base, e.bootstrap_samples, e.confidence)
    print("learning curve (each round's candidate and its parent on the held-out prompts):")
    for ckpt in registry.list():
        truth = ckpt.metrics.get("heldout_vs_parent")
        if truth is not None:
            print(
                f"  round {ckpt.round} {ckpt.version} ({ckpt.state.value}): pass {ckpt.metrics['heldout_pass']:.3f}, "
                f"{truth['delta']:+.3f} vs {ckpt.parent} (95% CI {truth['low']:+.3f}..{truth['high']:+.3f})"
            )
    print(f"closed loop: {loop_s / 60:.1f} min; held-out prompts: {c.prompts}")
    print(f"heldout_pass[base]: {base.pass_rate():.3f}")
    print(f"heldout_pass[final]: {last.pass_rate():.3f}")
    print(f"delta: {c.delta:+.3f} (95% CI {c.low:+.3f}..{c.high:+.3f})")
    print(f"final_version: {versions[-1]}")
    print(json.dumps({"by_kind": {"base": base.by_kind(), "final": last.by_kind()}}))


if __name__ == "__main__":
    main()
