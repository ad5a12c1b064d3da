"""`dynrubric train openrlhf`: the emitted job parses with OpenRLHF 0.11.2's own train_ppo_ray parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.train.records import read_summary
from tests.openrlhf_shim import openrlhf_dir

ROOT = Path(__file__).parents[2]


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dynrubric", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def env(tmp_path: Path, tiny_model_dir: Path) -> dict[str, str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "What is 2 + 2?"}\n{"messages": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "Name a colour."}]}\n'
    )
    return {
        "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path / "state"),
        "DYNRUBRIC_MODELS__POLICY": str(tiny_model_dir),
        "DYNRUBRIC_TRAIN__PROMPTS_FILE": str(prompts),
        "DYNRUBRIC_TRAIN__CANDIDATES": "8",
        "DYNRUBRIC_TRAIN__GRPO__CLIP_HIGH": "0.28",
        "DYNRUBRIC_TRAIN__GRPO__KL_BETA": "0.001",
        "DYNRUBRIC_REWARD_SERVER__PORT": "8123",
    }


@pytest.mark.skipif(openrlhf_dir() is None, reason="openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
def test_emitted_command_parses_with_openrlhfs_own_parser(env: dict[str, str], tmp_path: Path) -> None:
    from tests.openrlhf_shim import train_ppo_ray_parse

    proc = cli(["train", "openrlhf", "--emit"], env)
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "state" / "train" / "openrlhf" / "round-0001"
    command = json.loads((job / "command.json").read_text())
    argv = command["argv"]
    assert argv[:3] == ["python3", "-m", "openrlhf.cli.train_ppo_ray"]
    args = train_ppo_ray_parse(argv[3:])  # SystemExit on an unknown flag, AssertionError on its own checks
    assert args.algo.advantage.estimator == "group_norm"
    assert args.rollout.n_samples_per_prompt == 8
    assert args.reward.remote_url == ["http://127.0.0.1:8123/reward"]
    assert args.algo.kl.use_loss and args.algo.kl.estimator == "k3" and args.algo.kl.init_coef == 0.001
    assert tuple(args.actor.eps_clip_low_high) == (0.2, 0.28)
    assert args.critic.model_name_or_path is None  # no critic with group_norm
    assert args.data.apply_chat_template and args.data.input_key == "messages"
    assert args.ckpt.save_hf and args.ckpt.output_dir == str(job / "output")
    # grpo.tis: OpenRLHF's TIS (token ratio pi_train / pi_vllm clamped into grpo.tis_low..tis_high)
    assert (args.algo.advantage.is_correction_level, args.algo.advantage.is_correction_mode) == ("token", "clip")
    assert args.algo.advantage.is_correction_threshold == [0.5, 5.0]
    # the base model was registered and is the parent the job starts from
    assert Path(args.actor.model_name_or_path) == tmp_path / "state" / "registry" / "checkpoints" / "base"
    assert command["parent"] == "base"
    # the prompt shard holds the messages under the input key, in OpenRLHF's chat format
    lines = [json.loads(x) for x in split_lines(Path(args.data.prompt_dataset).read_text())]
    heldout = [json.loads(x) for x in split_lines((job / "heldout.jsonl").read_text())]
    # the held-out prompts (for the guards) are split off by key and never trained on
    assert len(heldout) == 1 and not {m["key"] for m in heldout} & {m["key"] for m in lines}
    assert sorted(m["messages"][-1]["content"] for m in lines + heldout) == ["Name a colour.", "What is 2 + 2?"]
    chats = {m["messages"][-1]["content"]: m["messages"] for m in lines + heldout}
    assert chats["Name a colour."][0] == {"role": "system", "content": "Be brief."}
    assert command["watermark_before"] is None and command["watermark_after"] == "2"  # taken at job start
    # the RayJob (the generator of k8s/base/trainer/rayjob.yaml, with its own Ray cluster) and the submit
    # script carry the same command; the RayJob's head then guards and registers the round's checkpoint
    from dynrubric.train.openrlhf import shell_join

    spec = yaml.safe_load((job / "rayjob.yaml").read_text())
    assert spec["kind"] == "RayJob"
    assert spec["spec"]["entrypoint"] == shell_join(argv) + " && dynrubric train openrlhf --finish 1"
    assert spec["spec"]["suspend"] is False and "clusterSelector" not in spec["spec"]
    workers = spec["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (
        workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "10"
    )  # 8 + 2 engines
    assert "ray job submit" in (job / "submit.sh").read_text()


def test_shell_join_leaves_only_env_references_to_the_shell(tmp_path: Path) -> None:
    """The reward token stays `${DYNRUBRIC_REWARD_TOKEN}` in manifests and is expanded by the job's shell;
    anything else in the argument is literal."""
    from dynrubric.train.openrlhf import shell_join

    argv = ["printf", "%s|", "http://h:1/reward?token=${TOKEN}", 'a"b`c$d\\e ${TOKEN}', "plain word"]
    out = subprocess.run(
        ["sh", "-c", shell_join(argv)],
        env={"TOKEN": "s3cret", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == 'http://h:1/reward?token=s3cret|a"b`c$d\\e s3cret|plain word|'


def test_run_without_ray_or_gpus_is_a_clear_error(env: dict[str, str]) -> None:
    proc = cli(["train", "openrlhf", "--run"], env)
    assert proc.returncode == 2
    assert "error:" in proc.stderr and ("ray" in proc.stderr.lower() or "gpu" in proc.stderr.lower())
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--emit", "--run"], "exactly one of --emit, --run and --finish"),
        (["--emit", "--in-ray-job"], "--in-ray-job goes with --run"),
        (["--finish", "3"], "round 3 was never emitted"),
    ],
)
def test_modes_are_exclusive_and_a_missing_round_is_named(env: dict[str, str], args: list[str], message: str) -> None:
    proc = cli(["train", "openrlhf", *args], env)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_inside_a_ray_job_the_round_runs_train_ppo_ray_here(tmp_path: Path) -> None:
    """`--run --in-ray-job` (a RayJob's head) starts the round's command itself, through the shell that
    expands the reward token, instead of `ray job submit` (which needs the ray CLI) and a local GPU check.
    train_ppo_ray cannot run without GPUs: a shell command that leaves a checkpoint stands in for it."""
    from dynrubric.train import openrlhf

    out = tmp_path / "output"
    argv = [
        "sh",
        "-c",
        'mkdir -p "$1" && echo "{}" > "$1/config.json" && echo "$2" > "$1/token"',
        "job",
        str(out),
        "${DYNRUBRIC_REWARD_TOKEN}",
    ]
    emitted = openrlhf.Emitted(1, tmp_path, argv, 1, None, out, [], None, None)
    os.environ["DYNRUBRIC_REWARD_TOKEN"] = "t0ken"
    try:
        openrlhf.run(emitted, in_ray_job=True)
    finally:
        del os.environ["DYNRUBRIC_REWARD_TOKEN"]
    assert (out / "token").read_text() == "t0ken\n"
    with pytest.raises(DynrubricError, match="left no HF checkpoint"):
        openrlhf.run(
            openrlhf.Emitted(1, tmp_path, ["true"], 1, None, tmp_path / "none", [], None, None), in_ray_job=True
        )


def test_parser_rejects_a_misspelt_flag() -> None:
    """The check above is meaningful: the real parser refuses flags OpenRLHF does not have."""
    if openrlhf_dir() is None:
        pytest.skip("openrlhf is not installed")
    from tests.openrlhf_shim import train_ppo_ray_parse

    with pytest.raises(SystemExit):
        train_ppo_ray_parse(["--actor.model_name_or_path", "m", "--rollout.samples_per_prompt", "4"])
    with pytest.raises(AssertionError):  # its own validation: group_norm needs n > 1
        train_ppo_ray_parse(
            [
                "--actor.model_name_or_path",
                "m",
                "--algo.advantage.estimator",
                "group_norm",
                "--reward.remote_url",
                "http://x/reward",
            ]
        )


def test_the_jobs_checkpoint_is_guarded_before_registration_and_the_watermark_is_taken_at_job_start(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The job's checkpoint (here: the parent's weights plus noise, in the output dir as OpenRLHF leaves
    it) goes through the embedded rounds' guards: too far from its parent, it is registered rejected
    and the next round builds on the parent. Prompts that arrived while the job ran are left for the
    next round."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dynrubric.train import openrlhf
    from tests.train_harness import runner, write_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    r = runner(tmp_path / "state", tiny_model_dir, prompts)
    emitted = openrlhf.emit(r.settings, r, r.source, 1, r.head(), None)
    assert emitted.heldout and emitted.prompts + len(emitted.heldout) == 8
    with prompts.open("a") as f:  # traffic that arrives during the job
        f.write('{"prompt": "A late question."}\n')
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    model.save_pretrained(emitted.output_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(emitted.output_dir)

    # what `--finish 1` (the emitted RayJob's last command) reads back from the round's directory
    again = openrlhf.emitted_round(r.settings, r, 1)
    assert again == emitted
    summary = openrlhf.finish(r.settings, r, again)
    assert summary.watermark_after == "8"
    assert summary.state == "rejected" and summary.guard.reason == "kl", summary.guard
    assert summary.eval is not None and summary.eval.judge == {"generator": "base", "verifier": "keyword-rule"}
    assert read_summary(r.round_dir(1) / "summary.json") == summary
    assert r.registry.get("r1").reason.startswith("kl: ") and r.head().version == "base"
    late, _ = r.source.new_prompts(summary.watermark_after, 10)
    assert [p.question for p in late] == ["A late question."]
