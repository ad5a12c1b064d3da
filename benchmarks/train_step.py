"""One GRPO optimiser step: our embedded trainer vs TRL's GRPOTrainer, same model, batch and group size.

Both sides get the same batch (P prompts x G completions of fixed token ids, random rewards), compute the
reference log-probs (beta > 0), the token-level clipped surrogate + k3 KL, backward, clip the gradient
norm and take an AdamW step. Generation is not timed on either side (it is the engine's job). TRL's step
is its own code: `_get_per_token_logps_and_entropies` on its reference model, `compute_loss` with
`loss_type="bnpo"` (token mean over the batch, like ours), then the accelerator's backward and the
trainer's own optimizer.

TRL lives in its own environment, `benchmarks/.venv-trl`, created on first use: a venv whose `.pth` file
puts the shared venv's site-packages on its path, so TRL runs against the very same torch and
transformers; `pip install -c constraints.txt trl` then adds only TRL and its missing dependencies to
the benchmark venv and cannot change the shared one.

    python benchmarks/train_step.py --quick     # tiny model, small batch (seconds)
    python benchmarks/train_step.py            # SmolLM2-135M from the model cache

The last line is `ratio: X.XX` = our median step time / TRL's median step time (below 1: we are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / "benchmarks" / ".venv-trl"
CONSTRAINTS = ROOT / "constraints.txt"


def make_batch(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(5, vocab - 1, (prompts, prompt_len), generator=g)
    completion_ids = torch.randint(5, vocab - 1, (prompts * group, completion_len), generator=g)
    rewards = torch.rand(prompts, group, generator=g)
    return prompt_ids, completion_ids, rewards


def time_ours(model_dir: Path, batch, group: int, steps: int, lr: float, beta: float) -> list[float]:
    from dynrubric.config import GRPOConfig, RubricConfig
    from dynrubric.train.grpo import CandidateSet, GRPOTrainer, SampledResponse, load_policy, load_reference

    prompt_ids, completion_ids, rewards = batch
    cfg = GRPOConfig(lr=lr, kl_beta=beta, micro_batch_size=completion_ids.size(0), clip_high=0.2)
    trainer = GRPOTrainer(
        load_policy(model_dir, cfg), load_reference(model_dir, cfg), cfg, pad_token_id=0, tie_eps=RubricConfig().eps
    )
    groups = []
    for p in range(prompt_ids.size(0)):
        rows = range(p * group, (p + 1) * group)
        groups.append(
            CandidateSet(
                tuple(SampledResponse(tuple(prompt_ids[p].tolist()), tuple(completion_ids[r].tolist())) for r in rows),
                tuple(rewards[p].tolist()),
            )
        )
    times = []
    for _ in range(steps + 1):  # the first step warms up allocators and is dropped
        t0 = time.perf_counter()
        stats = trainer.step(groups)
        times.append(time.perf_counter() - t0)
        assert stats.updated, stats
    return times[1:]


def time_trl(model_dir: Path, batch, group: int, steps: int, lr: float, beta: float) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    prompt_ids, completion_ids, rewards = batch
    n = completion_ids.size(0)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=n,
        num_generations=group,
        gradient_accumulation_steps=1,
        learning_rate=lr,
        beta=beta,
        epsilon=0.2,
        loss_type="bnpo",
        max_completion_length=completion_ids.size(1),
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        max_grad_norm=1.0,
        adam_beta2=0.95,
        weight_decay=0.0,
        lr_scheduler_type="constant",
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * n}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop, which we do not run
    model = trainer.model
    model.train()
    adv = rewards - rewards.mean(-1, keepdim=True)
    adv = (adv / (rewards.std(-1, keepdim=True) + 1e-6)).reshape(-1)
    prompts = prompt_ids.repeat_interleave(group, dim=0)
    inputs = {
        "prompt_ids": prompts,
        "prompt_mask": torch.ones_like(prompts),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones_like(completion_ids),
        "advantages": adv,
        "num_items_in_batch": torch.tensor(float(completion_ids.numel())),
    }
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        if beta != 0.0:
            with torch.no_grad():
                ids = torch.cat([prompts, completion_ids], dim=1)
                ref, _, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.ref_model, ids, torch.ones_like(ids), completion_ids.size(1)
                )
            inputs["ref_per_token_logps"] = ref
        loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    print(f"creating {TRL_VENV} (TRL in its own environment, over the shared torch/transformers)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", TRL_VENV], check=True)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "shared-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, "trl"], check=True)
    return python


def build_model(quick: bool, model: str | None) -> Path:
    if model:
        return Path(model)
    if quick:
        sys.path.insert(0, str(ROOT))
        from tests.tinymodel import build_tiny_model

        return build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")))
    from dynrubric import modelcache
    from dynrubric.config_loader import load_settings

    return modelcache.resolve(load_settings().paths.resolved_home(), "smollm2-135m")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, small batch")
    ap.add_argument("--model", help="HF model dir (default: SmolLM2-135M, or the tiny model with --quick)")
    ap.add_argument("--prompts", type=int, help="prompts per step (default 4; 2 with --quick)")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default 64; 32 with --quick)")
    ap.add_argument("--completion-len", type=int, help="completion tokens (default 64; 16 with --quick)")
    ap.add_argument("--steps", type=int, help="timed steps per side (default 5; 3 with --quick)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: torch's default)")
    ap.add_argument("--beta", type=float, default=0.04, help="KL weight on both sides")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)  # internal: JSON job for the TRL side
    a = ap.parse_args()

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.trl_worker:
        job = json.loads(a.trl_worker)
        batch = make_batch(job["vocab"], job["prompts"], job["group"], job["prompt_len"], job["completion_len"], 0)
        times = time_trl(Path(job["model"]), batch, job["group"], job["steps"], 1e-6, job["beta"])
        print(json.dumps({"times": times}))
        return

    sys.path.insert(0, str(ROOT))
    model_dir = build_model(a.quick, a.model)
    from transformers import AutoConfig

    job = {
        "model": str(model_dir),
        "vocab": AutoConfig.from_pretrained(model_dir).vocab_size,
        "prompts": a.prompts or (2 if a.quick else 4),
        "group": a.group,
        "prompt_len": a.prompt_len or (32 if a.quick else 64),
        "completion_len": a.completion_len or (16 if a.quick else 64),
        "steps": a.steps or (3 if a.quick else 5),
        "beta": a.beta,
    }
    batch = make_batch(job["vocab"], job["prompts"], job["group"], job["prompt_len"], job["completion_len"], 0)
    ours = time_ours(model_dir, batch, job["group"], job["steps"], 1e-6, job["beta"])
    python = ensure_trl_venv()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd: list[str | Path] = [python, __file__, "--trl-worker", json.dumps(job)]
    cmd += ["--threads", str(a.threads)] if a.threads else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"TRL side failed:\n{proc.stderr[-3000:]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])["times"]
    ours_med, trl_med = statistics.median(ours), statistics.median(theirs)
    print(
        f"model {model_dir.name}: {job['prompts']} prompts x G={job['group']}, prompt {job['prompt_len']} + "
        f"completion {job['completion_len']} tokens, beta {job['beta']}, {job['steps']} timed steps, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'':18}{'median s/step':>15}{'min':>10}{'max':>10}")
    print(f"{'dynrubric GRPO':18}{ours_med:>15.4f}{min(ours):>10.4f}{max(ours):>10.4f}")
    print(f"{'TRL GRPOTrainer':18}{trl_med:>15.4f}{min(theirs):>10.4f}{max(theirs):>10.4f}")
    print(f"ratio: {ours_med / trl_med:.2f}")


if __name__ == "__main__":
    main()
