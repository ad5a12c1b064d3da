"""`up`'s rollout judge on the rounds' vLLM server (the session's `vllm_server` stands in for it): the trainer, another
process, reloads the server between rollouts, and the judge's engines must judge with their own weights all the same.

After a batch of the judge's, the server holds the weights of the judge's last call (the verifier's): a plain engine
that reloads nothing reads them off the server by its greedy answer ("Paris" on SmolLM2, not on a copy with its
matrices' rows shuffled). Where the judge reloaded nothing, the trainer's weights would still be there.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dynrubric.config import Settings
from dynrubric.config_loader import override
from dynrubric.engines.base import GenerationRequest, SamplingParams
from serving.online import ShadowPair

PAIR = ShadowPair(
    "p0",
    "how to estimate distance between different curves parametrizations",
    "You can use the Frechet distance.",
    "Curves are lines.",
)


def shuffled_copy(model_dir: Path, out: Path) -> Path:
    """Another model of the same shape: the same weights, every matrix's rows shuffled."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        g = torch.Generator().manual_seed(0)
        save_file(
            {k: v[torch.randperm(v.shape[0], generator=g)] if v.ndim == 2 else v for k, v in tensors.items()},
            f,
            metadata={"format": "pt"},
        )
    return out


def held_by_server(url: str, model_dir: Path) -> str:
    """The server's greedy answer as it is now (this engine reloads nothing)."""
    from dynrubric.engines.http import OpenAIHTTPEngine

    with OpenAIHTTPEngine(url, model_dir) as probe:
        question = probe.render_chat([{"role": "user", "content": "What is the capital of France?"}])
        [[answer]] = probe.generate([GenerationRequest(question, SamplingParams(max_tokens=12, temperature=0))])
    return answer.text


def trainer_settings(tmp_path: Path, url: str, verifier: Path) -> Settings:
    """The rounds' settings as `ClosedLoop._start_trainer_engine` writes them, a short rubric budget."""
    from dynrubric.engines import one_shared_server

    return override(
        Settings(),
        {
            "paths": {"state_dir": str(tmp_path / "state")},
            "engine": one_shared_server(url, in_process=["verifier"]),
            "models": {"policy": str(verifier), "generator": str(verifier), "verifier": str(verifier)},
            "rubric": {"generator_max_tokens": 48, "retries": 0, "prompt_only_retries": 0},
            "rollout": {"judge": True},
        },
    )


@pytest.mark.vllm
@pytest.mark.parametrize("coevolved", [False, True], ids=["base generator", "co-evolved generator"])
def test_the_rollout_judge_judges_with_its_own_weights_after_the_trainer_reloaded_the_server(
    vllm_server, smollm_dir, tmp_path, coevolved
):
    """base generator: the rubric writer's weights are the verifier's (no co-evolved generator yet), so the judge's
    engines believe the server holds theirs; only forgetting before the batch makes them reload. co-evolved
    generator: round 1 left one (`_roll_out` points the writer at it), the writer reloads it for its rubrics, and
    the verifier must reload the frozen weights after it."""
    from dynrubric.app.loop import ClosedLoop
    from dynrubric.engines.http import OpenAIHTTPEngine, SharedServer

    url = vllm_server.base_url
    other = shuffled_copy(smollm_dir, tmp_path / "other")
    assert "Paris" in held_by_server(url, smollm_dir)
    trainer = trainer_settings(tmp_path, url, smollm_dir)
    generator = {"dir": smollm_dir}  # the run's generator before any round: the configured model
    runner = SimpleNamespace(generator_dir=lambda: generator["dir"])
    loop = ClosedLoop(trainer, log=lambda _: None)
    judge = loop._judge_on(trainer, runner)
    writer, verifier = judge.evaluator.rubric_generator.engine, judge.evaluator.verifier.engine
    rounds = OpenAIHTTPEngine(url, smollm_dir, shared=SharedServer())  # the trainer's engine, its own process
    try:
        assert writer.weights[0] == str(smollm_dir) and verifier.weights[0] == str(smollm_dir)
        rounds.load_weights(other, "r1")  # a round trains between two rollouts
        if coevolved:  # its generator step left a generator of its own
            generator["dir"] = other
            writer.use_weights(runner.generator_dir(), "r1-generator")
        assert "Paris" not in held_by_server(url, smollm_dir)
        [score] = judge.score([PAIR])
        assert score in (0.0, 0.5, 1.0)
        assert "Paris" in held_by_server(url, smollm_dir)  # the judge's verifier judged last, on its own weights
        question = writer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
        [[rubric_writer]] = writer.generate([GenerationRequest(question, SamplingParams(max_tokens=12, temperature=0))])
        assert ("Paris" in rubric_writer.text) is not coevolved  # the writer writes with the run's generator
    finally:
        rounds.load_weights(smollm_dir, "restored")  # the session's server goes back to its own weights
        for engine in (rounds, writer, verifier):
            engine.close()
