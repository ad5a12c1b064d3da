"""A training round on a GPU Ray cluster with OpenRLHF 0.11.x `train_ppo_ray`, instead of the embedded trainer.

`emit` writes, for the next round, everything a cluster needs and nothing it has to guess:

    <run_dir>/openrlhf/round-NNNN/
        prompts.jsonl   the round's new prompts, `{"messages": [...], "key": ...}` per line
                        (`--data.input_key messages --data.apply_chat_template`)
        command.json    the exact argv of `python -m openrlhf.cli.train_ppo_ray`
        submit.sh       `ray job submit` of that argv
        rayjob.yaml     the same as a KubeRay RayJob with its own Ray cluster: the argv, then
                        `dynrubric train openrlhf --finish N` (guards, registration) on its head

GRPO maps onto OpenRLHF as: `--algo.advantage.estimator group_norm` (advantage (r - mean) / std within
the n samples of a prompt), `--rollout.n_samples_per_prompt K`, `--algo.kl.use_loss --algo.kl.estimator
k3 --algo.kl.init_coef beta` (KL to the reference in the loss), `--actor.eps_clip_low_high low high`,
`--train.max_epochs` = `grpo.updates_per_batch`, and `--reward.remote_url` pointing at our reward
server, whose group barrier scores each prompt's n samples as one candidate set. `grpo.tis` maps to
OpenRLHF's token-level clipped importance correction (`--algo.advantage.is_correction_level token
--algo.advantage.is_correction_mode clip --algo.advantage.is_correction_threshold low high`, its TIS),
which samples with vLLM's processed log-probs like the embedded trainer.

The round's prompts and the watermark after them are taken when the job is emitted (job start): prompts
that arrive while it runs are left for the next round, never marked consumed untrained. Held-out prompts
are split off as in the embedded rounds and left out of the shard. `run` submits the job (Ray and GPUs
required), waits, and `finish` puts the HF checkpoint OpenRLHF saves in `--ckpt.output_dir` through
the same guards as an embedded round before registering it (a candidate, or rejected with the reason).
Inside a Ray job (a KubeRay RayJob's head, `--in-ray-job`) `run` starts train_ppo_ray on that job's
own cluster instead of submitting another job. k8s/base/trainer/rayjob.yaml (`cluster_rayjob`) is a
RayJob whose head runs `dynrubric train openrlhf --run --in-ray-job`: the whole round, prompts from
the replay store to a registered (or rejected) checkpoint, as `dynrubric train round` does in process.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.registry import Checkpoint, CheckpointState, Registry
from dynrubric.seeds import round_seed
from dynrubric.train.prompts import PromptSource, TrainPrompt
from dynrubric.train.records import Collapse, Guard, OpenRLHFSummary, write_record
from dynrubric.train.rounds import RoundRunner


@dataclass(frozen=True)
class Emitted:
    round: int
    dir: Path
    argv: list[str]
    prompts: int
    parent: Checkpoint
    output_dir: Path
    heldout: list[TrainPrompt]
    watermark_before: str | None
    watermark_after: str | None


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
        "--actor.model_name_or_path",
        model_path,
        "--data.prompt_dataset",
        prompts_path,
        "--data.input_key",
        "messages",
        "--data.apply_chat_template",
        "--data.max_len",
        str(o.max_len),
        "--rollout.max_new_tokens",
        str(t.max_new_tokens),
        "--rollout.n_samples_per_prompt",
        str(t.candidates),
        "--rollout.batch_size",
        str(o.rollout_batch_size),
        "--rollout.micro_batch_size",
        str(o.micro_batch_size),
        "--rollout.temperature",
        str(t.temperature),
        "--rollout.top_p",
        str(t.top_p),
        "--train.batch_size",
        str(o.train_batch_size),
        "--train.micro_batch_size",
        str(o.micro_batch_size),
        "--train.max_epochs",
        str(g.updates_per_batch),
        "--train.num_episodes",
        "1",
        "--train.seed",
        str(t.seed),
        "--algo.advantage.estimator",
        "group_norm",
        "--reward.remote_url",
        reward_url(settings),
        "--actor.eps_clip_low_high",
        str(g.clip_low),
        str(g.clip_high),
        "--actor.adam.lr",
        str(g.lr),
        "--actor.adam.betas",
        str(g.adam_beta1),
        str(g.adam_beta2),
        "--actor.adam.weight_decay",
        str(g.weight_decay),
        "--actor.max_norm",
        str(g.max_grad_norm),
        "--actor.num_nodes",
        str(o.num_nodes),
        "--actor.num_gpus_per_node",
        str(o.gpus_per_node),
        "--ref.num_nodes",
        str(o.num_nodes),
        "--ref.num_gpus_per_node",
        str(o.gpus_per_node),
        "--train.colocate_actor_ref",
        "--vllm.num_engines",
        str(o.vllm_engines),
        "--vllm.tensor_parallel_size",
        str(o.vllm_tensor_parallel_size),
        "--ckpt.output_dir",
        output_dir,
        "--ckpt.save_hf",
    ]
    if g.kl_beta > 0:
        argv += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.init_coef", str(g.kl_beta)]
    else:
        argv += ["--algo.kl.init_coef", "0"]
    if g.lora_rank > 0:
        argv += [
            "--ds.lora.rank",
            str(g.lora_rank),
            "--ds.lora.alpha",
            str(g.lora_alpha),
            "--ds.lora.target_modules",
            *g.lora_target_modules,
        ]
    if g.tis:  # OpenRLHF's TIS: the token ratio pi_train / pi_vllm clamped into [low, high]
        argv += [
            "--algo.advantage.is_correction_level",
            "token",
            "--algo.advantage.is_correction_mode",
            "clip",
            "--algo.advantage.is_correction_threshold",
            str(g.tis_low),
            str(g.tis_high),
        ]
    return argv + list(o.extra_args)


def entrypoint(settings: Settings, model_path: str, prompts_path: str, output_dir: str) -> list[str]:
    """The command a round runs on Ray: `train_ppo_ray` with the round's flags."""
    return [
        "python3",
        "-m",
        "openrlhf.cli.train_ppo_ray",
        *train_ppo_ray_argv(settings, model_path, prompts_path, output_dir),
    ]


# `${NAME}` in an argument is left for the shell that runs the entrypoint to expand (the reward token
# from the pod's Secret-backed env), so that no secret is written into a manifest or command.json
_ENV_REF = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")


def shell_join(argv: list[str]) -> str:
    """shlex.join, except that arguments holding `${NAME}` are double-quoted with only those expanded."""

    def word(arg: str) -> str:
        if not _ENV_REF.search(arg):
            return shlex.quote(arg)

        def literal(s: str) -> str:
            return re.sub(r'([\\"`$])', r"\\\1", s)

        parts, refs = _ENV_REF.split(arg), _ENV_REF.findall(arg)
        return '"' + "".join(literal(p) + r for p, r in zip(parts, [*refs, ""], strict=True)) + '"'

    return " ".join(word(a) for a in argv)


MODELS_MOUNT = "/models"  # the dynrubric-models volume: policy, judge, registered checkpoints
CONFIG_MOUNT = "/etc/dynrubric"  # the ConfigMap dynrubric-config: the settings every dynrubric pod reads
# the reward server admits only pods with these labels (k8s/base/network/policies.yaml)
TRAINER_LABELS = {"app.kubernetes.io/name": "dynrubric-trainer", "app.kubernetes.io/component": "trainer"}
# what the head runs in the cluster: a whole round, as `dynrubric train round` runs one in process
CLUSTER_ROUND = ["dynrubric", "train", "openrlhf", "--run", "--in-ray-job"]
# the head's settings on top of the ConfigMap: the guard's held-out evaluation loads the candidate and its
# parent into an in-process engine on the head's GPU (the cluster's vLLM engines serve users and cannot
# reload weights), and the registry is the PostgreSQL database of the Secret
HEAD_ENV = {
    "DYNRUBRIC_CONFIG": f"{CONFIG_MOUNT}/dynrubric.yaml",
    "DYNRUBRIC_ENGINE__KIND": "transformers",
    "DYNRUBRIC_ENGINE__DEVICE": "cuda",
    "DYNRUBRIC_ENGINE__DTYPE": "bfloat16",
}
SECRET_ENV = {"DYNRUBRIC_REWARD_TOKEN": "reward-token", "DYNRUBRIC_REGISTRY__URL": "registry-url"}


def worker_gpus(settings: Settings) -> int:
    """GPUs of one worker pod: the actor (colocated with the reference) on `gpus_per_node`, plus this
    node's share of the vLLM engines."""
    o = settings.train.openrlhf
    return o.gpus_per_node + -(-o.vllm_engines * o.vllm_tensor_parallel_size // o.num_nodes)


def rayjob(settings: Settings, name: str, entrypoint: str, *, suspend: bool) -> dict[str, Any]:
    """The KubeRay RayJob that runs the shell command `entrypoint` on a Ray cluster of its own: a head
    (the driver: the ConfigMap's settings, the reward token and registry URL from the Secret, the
    state volume, one GPU for the guard's evaluation; no Ray GPU) and `num_nodes` GPU workers sized
    from train.openrlhf, in the image train.openrlhf.image of Ray train.openrlhf.ray_version. The one
    generator of this manifest: `emit` writes it per round, k8s/tools/generate.py writes
    k8s/base/trainer/rayjob.yaml (`cluster_rayjob`) from the k8s ConfigMap's settings."""
    o = settings.train.openrlhf
    gpus = str(worker_gpus(settings))

    # new dicts each time: YAML would otherwise write a shared one as an anchor and an alias
    def no_usage_stats() -> dict[str, str]:
        return {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}

    def models() -> dict[str, Any]:
        return {"name": "models", "persistentVolumeClaim": {"claimName": "dynrubric-models"}}

    def replay() -> dict[str, Any]:
        return {"name": "replay", "persistentVolumeClaim": {"claimName": "dynrubric-replay"}}

    def gpu_toleration() -> list[dict[str, str]]:
        return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

    # the round's prompt shard, run state and OpenRLHF's output live on the replay volume (paths.state_dir)
    def state() -> dict[str, str]:
        return {"name": "replay", "mountPath": str(settings.paths.state_dir)}

    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {
            "metadata": {"labels": dict(TRAINER_LABELS)},
            "spec": {
                "containers": [
                    {
                        "name": "ray-head",
                        "image": o.image,
                        "env": [
                            *({"name": k, "value": v} for k, v in HEAD_ENV.items()),
                            *(
                                {"name": k, "valueFrom": {"secretKeyRef": {"name": "dynrubric-secrets", "key": key}}}
                                for k, key in SECRET_ENV.items()
                            ),
                            no_usage_stats(),
                        ],
                        "ports": [
                            {"name": "gcs", "containerPort": 6379},
                            {"name": "dashboard", "containerPort": 8265},
                            {"name": "client", "containerPort": 10001},
                        ],
                        "resources": {
                            "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
                            "limits": {"memory": "64Gi", "nvidia.com/gpu": "1"},
                        },
                        "volumeMounts": [
                            {"name": "models", "mountPath": MODELS_MOUNT},
                            state(),
                            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                        ],
                    }
                ],
                "tolerations": gpu_toleration(),
                "volumes": [models(), replay(), {"name": "config", "configMap": {"name": "dynrubric-config"}}],
            },
        },
    }
    worker = {
        "groupName": "gpu",
        "replicas": o.num_nodes,
        "minReplicas": o.num_nodes,
        "maxReplicas": o.num_nodes,
        "rayStartParams": {},
        "template": {
            "metadata": {"labels": dict(TRAINER_LABELS)},
            "spec": {
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": o.image,
                        "env": [no_usage_stats()],
                        "resources": {
                            "requests": {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": gpus},
                            "limits": {"memory": "128Gi", "nvidia.com/gpu": gpus},
                        },
                        "volumeMounts": [
                            {"name": "models", "mountPath": MODELS_MOUNT},
                            state(),
                            {"name": "shm", "mountPath": "/dev/shm"},
                        ],
                    }
                ],
                "tolerations": gpu_toleration(),
                "volumes": [models(), replay(), {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}],
            },
        },
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "labels": dict(TRAINER_LABELS)},
        "spec": {
            "entrypoint": entrypoint,
            "suspend": suspend,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "activeDeadlineSeconds": 86400,
            "submissionMode": "K8sJobMode",
            "rayClusterSpec": {"rayVersion": o.ray_version, "headGroupSpec": head, "workerGroupSpecs": [worker]},
        },
    }


def cluster_rayjob(settings: Settings) -> dict[str, Any]:
    """k8s/base/trainer/rayjob.yaml: one whole round per run of the (suspended) RayJob."""
    return rayjob(settings, "dynrubric-train", shell_join(CLUSTER_ROUND), suspend=True)


def emit(
    settings: Settings,
    runner: RoundRunner,
    source: PromptSource,
    round_id: int,
    parent: Checkpoint,
    watermark: str | None,
) -> Emitted:
    """Take the round's prompts and watermark now, split off the held-out prompts, and write the
    training shard, command line, submit script and RayJob spec (atomically)."""
    prompts, watermark_after = source.new_prompts(watermark, settings.train.max_prompts_per_round)
    if not prompts:
        raise DynrubricError(f"no new prompts since watermark {watermark!r}", "add prompts, then emit again")
    prompts, heldout = runner.split_heldout(prompts)
    if not prompts:
        raise DynrubricError(
            "every new prompt is held out, none is left to train on",
            "add prompts, or set train.heldout_file to a separate held-out set",
        )
    from dynrubric.train.rounds import run_dir_of

    target = run_dir_of(settings) / "openrlhf" / f"round-{round_id:04d}"
    output_dir = target / "output"
    argv = entrypoint(settings, str(parent.path), str(target / "prompts.jsonl"), str(output_dir))
    if target.exists():
        shutil.rmtree(target)
    with atomic.directory(target) as tmp:
        (tmp / "prompts.jsonl").write_text("".join(_shard_line(p) for p in prompts))
        (tmp / "heldout.jsonl").write_text("".join(_shard_line(p) for p in heldout))
        (tmp / "command.json").write_text(
            json.dumps(
                {
                    "round": round_id,
                    "parent": parent.version,
                    "watermark_before": watermark,
                    "watermark_after": watermark_after,
                    "argv": argv,
                },
                indent=2,
            )
        )
        address = settings.train.openrlhf.ray_address
        (tmp / "submit.sh").write_text(
            "#!/bin/sh\nset -e\n" + shell_join(["ray", "job", "submit", "--address", address, "--", *argv]) + "\n"
        )
        (tmp / "submit.sh").chmod(0o755)
        finish_round = ["dynrubric", "train", "openrlhf", "--finish", str(round_id)]
        job = rayjob(
            settings, f"dynrubric-round-{round_id}", f"{shell_join(argv)} && {shell_join(finish_round)}", suspend=False
        )
        (tmp / "rayjob.yaml").write_text(yaml.safe_dump(job, sort_keys=False, width=120))
    return Emitted(round_id, target, argv, len(prompts), parent, output_dir, heldout, watermark, watermark_after)


def _shard_line(p: TrainPrompt) -> str:
    return json.dumps({"messages": p.chat(), "key": p.key}, ensure_ascii=False) + "\n"


def _from_shard_line(line: str) -> TrainPrompt:
    d = json.loads(line)
    return TrainPrompt(key=d["key"], messages=tuple((m["role"], m["content"]) for m in d["messages"]))


def emitted_round(settings: Settings, runner: RoundRunner, round_id: int) -> Emitted:
    """A round `emit` wrote earlier, read back from its directory (to finish it after its job ran)."""
    from dynrubric.train.rounds import run_dir_of

    target = run_dir_of(settings) / "openrlhf" / f"round-{round_id:04d}"
    if not (target / "command.json").is_file():
        raise DynrubricError(
            f"round {round_id} was never emitted (no {target / 'command.json'})",
            "emit it first: `dynrubric train openrlhf --emit`",
        )
    if not (target / "output" / "config.json").is_file():
        raise DynrubricError(
            f"round {round_id}'s job left no HF checkpoint in {target / 'output'}",
            "run its job first (submit.sh or rayjob.yaml); see `ray job logs` if it ran",
        )
    command = json.loads((target / "command.json").read_text())
    heldout = [_from_shard_line(line) for line in split_lines((target / "heldout.jsonl").read_text()) if line.strip()]
    prompts = sum(bool(x.strip()) for x in split_lines((target / "prompts.jsonl").read_text()))
    return Emitted(
        round_id,
        target,
        command["argv"],
        prompts,
        runner.registry.get(command["parent"]),
        target / "output",
        heldout,
        command["watermark_before"],
        command["watermark_after"],
    )


def check_cluster() -> None:
    """Ray and at least one GPU must be present; otherwise say what is missing."""
    if shutil.which("ray") is None:
        raise DynrubricError(
            "`ray` is not installed here, so OpenRLHF cannot be launched",
            "run `dynrubric train openrlhf --emit` and submit the emitted submit.sh / rayjob.yaml "
            "on a GPU Ray cluster, or use `dynrubric train round` (embedded trainer)",
        )
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install is the same as none
        gpus = 0
    if gpus == 0 and not shutil.which("nvidia-smi"):
        raise DynrubricError(
            "no GPU is visible on this machine; OpenRLHF's train_ppo_ray needs GPUs",
            "submit the emitted rayjob.yaml to a GPU cluster, or use `dynrubric train round`",
        )


def run(emitted: Emitted, *, in_ray_job: bool = False) -> None:
    """Submit the emitted job to Ray and wait for the HF checkpoint it saves. `in_ray_job`: this process
    is a Ray job's driver (a RayJob's head): train_ppo_ray runs here, on the job's own cluster."""
    if in_ray_job:
        # through the shell, like submit.sh: it expands the ${NAME} references (the reward token)
        proc = subprocess.run(["sh", "-c", shell_join(emitted.argv)])
    else:
        check_cluster()
        proc = subprocess.run(["sh", str(emitted.dir / "submit.sh")])
    if proc.returncode != 0:
        raise DynrubricError(
            f"the OpenRLHF job of round {emitted.round} failed (exit {proc.returncode})",
            f"see `ray job logs`; the job is described in {emitted.dir}",
        )
    if not (emitted.output_dir / "config.json").is_file():
        raise DynrubricError(
            f"the OpenRLHF job finished but left no HF checkpoint in {emitted.output_dir}",
            "check --ckpt.save_hf and --ckpt.output_dir in command.json",
        )


def finish(settings: Settings, runner: RoundRunner, emitted: Emitted) -> OpenRLHFSummary:
    """Guard the job's checkpoint against its parent on the held-out prompts (the embedded rounds'
    guards and evaluation), register it as a candidate or rejected, and write the round's summary
    with the watermark taken at job start."""
    from transformers import AutoTokenizer

    from dynrubric import modelcache
    from dynrubric.train.rounds import GUARDED, check_guards, evaluate_candidate

    cfg = settings.train
    registry: Registry = runner.registry
    parent = emitted.parent
    tok = AutoTokenizer.from_pretrained(parent.path)
    home = settings.paths.resolved_home()
    policy = runner.engines("policy", emitted.output_dir)
    verifier = runner.engines("verifier", modelcache.resolve(home, settings.models.verifier))
    two_models = not cfg.coevolve.single_model
    generator = runner.engines("generator", runner.generator_dir()) if two_models else None
    try:
        evaluation = evaluate_candidate(
            settings,
            candidate_dir=emitted.output_dir,
            candidate_version=f"{cfg.version_prefix}{emitted.round}",
            candidate_model=None,
            parent=parent,
            base=runner.base_of(parent),
            heldout=emitted.heldout,
            policy_engine=policy,
            generator_engine=generator,
            previous_generator=runner.generator_dir() if two_models else None,
            verifier_engine=verifier,
            pad_id=int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
            seed=round_seed(cfg.seed, emitted.round, "heldout", 0),  # the in-process round's held-out seed
        )
    finally:
        for engine in (policy, verifier, generator):
            if engine is not None:
                engine.close()
    verdict = check_guards(cfg, evaluation, nonfinite_steps=[], truth_guard=False)
    ckpt = registry.register(
        emitted.output_dir,
        parent=parent.version,
        round=emitted.round,
        metrics={
            "trainer": "openrlhf",
            "prompts": emitted.prompts,
            "heldout_reward": evaluation.reward_new,
            "heldout_reward_parent": evaluation.reward_parent,
            "kl": evaluation.kl_to_parent,
            "kl_to_base": evaluation.kl_to_base,
            GUARDED: "accepted" if verdict.accepted else verdict.reason,
        },
        version=f"{cfg.version_prefix}{emitted.round}",
        state=CheckpointState.candidate if verdict.accepted else CheckpointState.rejected,
        reason=None if verdict.accepted else f"{verdict.reason}: {verdict.detail}",
    )
    summary = OpenRLHFSummary(
        round=emitted.round,
        parent=parent.version,
        version=ckpt.version,
        state=ckpt.state.value,
        guard=Guard(accepted=verdict.accepted, reason=verdict.reason, detail=verdict.detail),
        eval=evaluation,
        refresh=None,
        collapse=Collapse(fired=False, note=None),
        watermark_before=emitted.watermark_before,
        watermark_after=emitted.watermark_after,
        prompts=emitted.prompts,
    )
    write_record(runner.round_dir(emitted.round) / "summary.json", summary)
    return summary
