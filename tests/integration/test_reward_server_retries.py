"""OpenRLHF's own client retrying against two real reward-server replicas (tiny model).

OpenRLHF 0.11.2 gives a reward request 180 s and retries it (5 tries, 1 s apart) when it times out.
Here its timeout is cut to a few seconds (the `aiohttp.ClientTimeout` its code builds, nothing else
changed) and the samples of each prompt arrive seconds apart, so the first samples' requests time out,
are abandoned by the client and sent again, to the other replica, while their group is still open
or already being scored. Every group must still be complete, every sample scored once, and every
reward the score of the client's own response; each replica prints where it listens, and each cancelled
request is one log line with its reason, never a traceback.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reward_servers import REPO, TOKEN, CannedLLM, judge_env, openrlhf_rollout, reward_replicas

N = 4
CLIENT_TIMEOUT_S = 3.0
STAGGER_S = 2.0  # sample k of a prompt is generated k * STAGGER_S late: the group fills after the timeout
QUESTIONS = ["What is 7 * 6?", "Name a primary colour."]
RESPONSES = {
    "What is 7 * 6?": ["42", "It is 42.", "42", "Seven times six is forty-two."],  # the same text twice: two members
    "Name a primary colour.": ["Red.", "green", "Blue is one.", "I like purple."],
}


@pytest.fixture
def staggered(monkeypatch):
    """OpenRLHF's executor, with its reward timeout cut short and its samples arriving STAGGER_S apart."""
    import aiohttp
    from openrlhf.utils import agent

    real_timeout = aiohttp.ClientTimeout
    monkeypatch.setattr(agent.aiohttp, "ClientTimeout", lambda total: real_timeout(total=CLIENT_TIMEOUT_S))
    served: dict[tuple[int, ...], int] = {}
    real_generate = CannedLLM.generate

    async def generate(self, prompt_token_ids, params, multi_modal_data=None):
        k = served.get(tuple(prompt_token_ids), 0)
        served[tuple(prompt_token_ids)] = k + 1
        await asyncio.sleep(k * STAGGER_S)
        return await real_generate(self, prompt_token_ids, params, multi_modal_data)

    monkeypatch.setattr(CannedLLM, "generate", generate)


@pytest.mark.slow
def test_openrlhf_retries_join_their_slot_and_every_sample_is_scored_once(tiny_model_dir: Path, tmp_path, staggered):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = {
        **judge_env(tiny_model_dir),
        "DYNRUBRIC_ENGINE__KIND": "transformers",
        "DYNRUBRIC_TRAIN__CANDIDATES": str(N),
        "DYNRUBRIC_REWARD_SERVER__GROUP_TIMEOUT_S": "30",
    }
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    responses = [RESPONSES[q] for q in QUESTIONS]
    with reward_replicas(2, env, tmp_path) as replicas:
        urls = [f"{r.url}/get_reward?token={TOKEN}" for r in replicas]
        outputs = openrlhf_rollout(urls, tokenizer, prompts, responses)
        groups = [g for r in replicas for g in r.get("/groups").json()["groups"]]
        total = {
            name: sum(r.metric(name) for r in replicas)
            for name in (
                "dynrubric_rubric_sets_total",
                "dynrubric_reward_retried_samples_total",
                "dynrubric_reward_cancelled_requests_total",
                "dynrubric_reward_partial_groups_total",
            )
        }

    print("reward retries:", total)
    assert total["dynrubric_reward_retried_samples_total"] > 0, "the short timeout forced retries"
    assert total["dynrubric_reward_cancelled_requests_total"] > 0, "abandoned requests were cancelled"
    # each replica says where it listens; each cancelled request is one line with its reason, no traceback
    logs = [r.log.read_text() for r in replicas]
    for r, text in zip(replicas, logs, strict=True):
        assert f"reward server on {r.url} (POST /reward, /get_reward, /score_sets): group size {N}" in text, text
        assert "Traceback" not in text and "never retrieved" not in text, text
    cancelled = [line for text in logs for line in text.splitlines() if "cancelled a reward request" in line]
    assert len(cancelled) == total["dynrubric_reward_cancelled_requests_total"], logs
    assert all("its client disconnected" in line for line in cancelled), cancelled
    assert total["dynrubric_rubric_sets_total"] == len(QUESTIONS) == len(groups), "each set scored once"
    assert total["dynrubric_reward_partial_groups_total"] == 0
    by_prompt = {g["prompt"]: g for g in groups}
    for q in QUESTIONS:
        assert sorted(by_prompt[q]["responses"]) == sorted(RESPONSES[q]), "complete, no sample twice"
    for i, out in enumerate(outputs):
        assert out["reward"] is not None, "OpenRLHF got a reward within its retries"
        group = by_prompt[QUESTIONS[i // N]]
        response = responses[i // N][i % N]
        expected = [s for r, s in zip(group["responses"], group["scores"], strict=True) if r == response]
        assert out["reward"][0] == pytest.approx(expected[0], abs=1e-6)
        assert out["extra_logs"]["rubric_group_size"] == [float(N)]


def test_a_barrier_that_cannot_answer_inside_the_client_timeout_is_refused_at_start(tmp_path):
    env = {
        **os.environ,
        "DYNRUBRIC_REWARD_SERVER__GROUP_TIMEOUT_S": "150",
        "DYNRUBRIC_REWARD_SERVER__SCORING_TIME_S": "45",
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dynrubric"), "serve-reward", "--port", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    message = done.stdout + done.stderr
    assert "group_timeout_s (150 s)" in message and "scoring_time_s (45 s)" in message
    assert "client_timeout_s (180 s" in message
