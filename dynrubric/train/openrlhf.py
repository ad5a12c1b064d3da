"""A training round on a GPU Ray cluster with OpenRLHF 0.11.x `train_ppo_ray`, instead of the embedded trainer.

`emit` writes, for the next round, everything a cluster needs and nothing it has to guess:

    <run_dir>/openrlhf/round-NNNN/
        prompts.jsonl   the round's new prompts, `{"messages": [...], "key": ...}` per line
                        (`--data.input_key messages --data.apply_chat_template`)
        command.json    the exact argv of `python -m openrlhf.cli.train_ppo_ray`
        submit.sh       `ray job submit` of that argv
        rayjob.yaml     the same as a KubeRay RayJob (entrypoint = the argv)

GRPO maps onto OpenRLHF as: `--algo.advantage.estimator group_norm` (advantage (r - mean) / std within
the n samples of a prompt), `--rollout.n_samples_per_prompt K`, `--algo.kl.use_loss --algo.kl.estimator
k3 --algo.kl.init_coef beta` (KL to the reference in the loss), `--actor.eps_clip_low_high low high`,
and `--reward.remote_url` pointing at our reward server, whose group barrier scores each prompt's n
samples as one candidate set. `run` submits it (Ray and GPUs required), waits, and registers the HF
checkpoint OpenRLHF saves in `--ckpt.output_dir`.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.errors import DynrubricError
from dynrubric.registry import Checkpoint, Registry
from dynrubric.train.prompts import PromptSource, TrainPrompt


@dataclass(frozen=True)
class Emitted:
    round: int
    dir: Path
    argv: list[str]
    prompts: int
    parent: Checkpoint
    output_dir: Path


def reward_url(settings: Settings) -> str:
    if settings.train.openrlhf.reward_url:
        return settings.train.openrlhf.reward_url
    rs = settings.reward_server
    host = "127.0.0.1" if rs.host in ("0.0.0.0", "::") else rs.host
    return f"http://{host}:{rs.port}/reward"


def train_ppo_ray_argv(settings: Settings, model_path: str, prompts_path: str, output_dir: str) -> list[str]:
    """The argument list of `openrlhf.cli.train_ppo_ray` for one round (flag names of OpenRLHF 0.11.x)."""
    t, g, o = settings.train, settings.train.grpo, settings.train.openrlhf
    argv = [
        "--actor.model_name_or_path", model_path,
        "--data.prompt_dataset", prompts_path,
        "--data.input_key", "messages",
        "--data.apply_chat_template",
        "--data.max_len", str(o.max_len),
        "--rollout.max_new_tokens", str(t.max_new_tokens),
        "--rollout.n_samples_per_prompt", str(t.candidates),
        "--rollout.batch_size", str(o.rollout_batch_size),
        "--rollout.micro_batch_size", str(o.micro_batch_size),
        "--rollout.temperature", str(t.temperature),
        "--rollout.top_p", str(t.top_p),
        "--train.batch_size", str(o.train_batch_size),
        "--train.micro_batch_size", str(o.micro_batch_size),
        "--train.max_epochs", "1",
        "--train.num_episodes", "1",
        "--train.seed", str(t.seed),
        "--algo.advantage.estimator", "group_norm",
        "--reward.remote_url", reward_url(settings),
        "--actor.eps_clip_low_high", str(g.clip_low), str(g.clip_high),
        "--actor.adam.lr", str(g.lr),
        "--actor.adam.betas", str(g.adam_beta1), str(g.adam_beta2),
        "--actor.adam.weight_decay", str(g.weight_decay),
        "--actor.max_norm", str(g.max_grad_norm),
        "--actor.num_nodes", str(o.num_nodes),
        "--actor.num_gpus_per_node", str(o.gpus_per_node),
        "--ref.num_nodes", str(o.num_nodes),
        "--ref.num_gpus_per_node", str(o.gpus_per_node),
        "--train.colocate_actor_ref",
        "--vllm.num_engines", str(o.vllm_engines),
        "--vllm.tensor_parallel_size", str(o.vllm_tensor_parallel_size),
        "--ckpt.output_dir", output_dir,
        "--ckpt.save_hf",
    ]
    if g.kl_beta > 0:
        argv += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.init_coef", str(g.kl_beta)]
    else:
        argv += ["--algo.kl.init_coef", "0"]
    if g.lora_rank > 0:
        argv += ["--ds.lora.rank", str(g.lora_rank), "--ds.lora.alpha", str(g.lora_alpha),
                 "--ds.lora.target_modules", *g.lora_target_modules]
    return argv + list(o.extra_args)


def rayjob(name: str, entrypoint: list[str]) -> dict:
    """A KubeRay RayJob that runs the entrypoint on an existing cluster selected by label."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name},
        "spec": {
            "entrypoint": shlex.join(entrypoint),
            "clusterSelector": {"ray.io/cluster": "dynrubric-train"},
            "shutdownAfterJobFinishes": False,
            "submissionMode": "K8sJobMode",
        },
    }


def emit(settings: Settings, registry: Registry, source: PromptSource, round_id: int, parent: Checkpoint,
         watermark: str | None) -> Emitted:
    """Write the round's prompt shard, command line, submit script and RayJob spec (atomically)."""
    prompts, _ = source.new_prompts(watermark, settings.train.max_prompts_per_round)
    if not prompts:
        raise DynrubricError(f"no new prompts since watermark {watermark!r}", "add prompts, then emit again")
    from dynrubric.train.rounds import run_dir_of

    target = run_dir_of(settings) / "openrlhf" / f"round-{round_id:04d}"
    output_dir = target / "output"
    argv = ["python3", "-m", "openrlhf.cli.train_ppo_ray",
            *train_ppo_ray_argv(settings, str(parent.path), str(target / "prompts.jsonl"), str(output_dir))]
    if target.exists():
        shutil.rmtree(target)
    with atomic.directory(target) as tmp:
        (tmp / "prompts.jsonl").write_text("".join(_shard_line(p) for p in prompts))
        (tmp / "command.json").write_text(json.dumps({"round": round_id, "parent": parent.version,
                                                      "watermark_before": watermark, "argv": argv}, indent=2))
        address = settings.train.openrlhf.ray_address
        (tmp / "submit.sh").write_text(
            "#!/bin/sh\nset -e\n" + shlex.join(["ray", "job", "submit", "--address", address, "--", *argv]) + "\n"
        )
        (tmp / "submit.sh").chmod(0o755)
        (tmp / "rayjob.yaml").write_text(yaml.safe_dump(rayjob(f"dynrubric-round-{round_id}", argv), sort_keys=False))
    return Emitted(round_id, target, argv, len(prompts), parent, output_dir)


def _shard_line(p: TrainPrompt) -> str:
    return json.dumps({"messages": p.chat(), "key": p.key}, ensure_ascii=False) + "\n"


def check_cluster() -> None:
    """Ray and at least one GPU must be present; otherwise say what is missing."""
    if shutil.which("ray") is None:
        raise DynrubricError("`ray` is not installed here, so OpenRLHF cannot be launched",
                             "run `dynrubric train openrlhf --emit` and submit the emitted submit.sh / rayjob.yaml "
                             "on a GPU Ray cluster, or use `dynrubric train round` (embedded trainer)")
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install is the same as none
        gpus = 0
    if gpus == 0 and not shutil.which("nvidia-smi"):
        raise DynrubricError("no GPU is visible on this machine; OpenRLHF's train_ppo_ray needs GPUs",
                             "submit the emitted rayjob.yaml to a GPU cluster, or use `dynrubric train round`")


def run(settings: Settings, registry: Registry, emitted: Emitted) -> Checkpoint:
    """Submit the emitted job to Ray, wait for it, and register the checkpoint it saved."""
    check_cluster()
    proc = subprocess.run(["sh", str(emitted.dir / "submit.sh")])
    if proc.returncode != 0:
        raise DynrubricError(f"the OpenRLHF job of round {emitted.round} failed (exit {proc.returncode})",
                             f"see `ray job logs`; the job is described in {emitted.dir}")
    if not (emitted.output_dir / "config.json").is_file():
        raise DynrubricError(f"the OpenRLHF job finished but left no HF checkpoint in {emitted.output_dir}",
                             "check --ckpt.save_hf and --ckpt.output_dir in command.json")
    return registry.register(emitted.output_dir, parent=emitted.parent.version, round=emitted.round,
                             metrics={"trainer": "openrlhf", "prompts": emitted.prompts},
                             version=f"{settings.train.version_prefix}{emitted.round}")
