"""Two real reward-server replicas (uvicorn processes, tiny model) behind OpenRLHF's own client.

OpenRLHF sends one sample per request and alternates between reward URLs, so the n samples of a
prompt land on both replicas; the barrier must still score each prompt's group as ONE set.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from tests.reward_servers import TOKEN, judge_env, openrlhf_rollout, reward_replicas

N = 4
QUESTIONS = ["What is 7 * 6?", "Name a primary colour.", "Say hello."]
RESPONSES = {
    "What is 7 * 6?": ["42", "It is 42.", "The answer is 13.", "Seven times six is forty-two."],
    "Name a primary colour.": ["Red.", "green", "Blue is one.", "I like purple."],
    "Say hello.": ["Hello!", "hi", "Goodbye.", "Hello there, how are you?"],
}


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory):
    env = {
        **judge_env(tiny_model_dir),
        "DYNRUBRIC_ENGINE__KIND": "transformers",
        "DYNRUBRIC_TRAIN__CANDIDATES": str(N),
        "DYNRUBRIC_REWARD_SERVER__GROUP_TIMEOUT_S": "20",
        "DYNRUBRIC_REWARD_SERVER__MAX_BODY_BYTES": "4096",
        # OpenRLHF's requests of one batch reach a busy test machine over a second or two
        "DYNRUBRIC_REWARD_SERVER__BATCH_LINGER_S": "5",
    }
    with reward_replicas(2, env, tmp_path_factory.mktemp("reward")) as r:
        yield r


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_openrlhf_client_gets_set_conditioned_rewards_across_two_replicas(replicas, tokenizer):
    urls = [f"{r.url}/get_reward?token={TOKEN}" for r in replicas]
    # the first question twice, as when a batch holds the same prompt twice: 2n requests, two groups
    questions = QUESTIONS + QUESTIONS[:1]
    responses = [RESPONSES[q] for q in QUESTIONS] + [list(reversed(RESPONSES[QUESTIONS[0]]))]
    outputs = openrlhf_rollout(urls, tokenizer, [chat(tokenizer, q) for q in questions], responses)

    assert len(outputs) == N * len(questions)
    for out in outputs:
        assert isinstance(out["reward"], list) and len(out["reward"]) == 1
        assert math.isfinite(out["reward"][0]) and 0.0 <= out["reward"][0] <= 1.0
        assert out["extra_logs"]["rubric_group_size"] == [float(N)]
        assert out["extra_logs"]["rubric_partial_group"] == [0.0]

    groups = [g for r in replicas for g in r.get("/groups").json()["groups"]]
    assert len(groups) == len(questions)  # one rubric and one set per group of n, no more
    assert sum(r.metric("dynrubric_rubric_sets_total") for r in replicas) == len(questions)
    # each replica owns whole prompts: the two groups of the repeated prompt are on one replica
    owners = {
        q: [n for n, r in enumerate(replicas) for g in r.get("/groups").json()["groups"] if g["prompt"] == q]
        for q in QUESTIONS
    }
    assert len(owners[QUESTIONS[0]]) == 2 and len(set(owners[QUESTIONS[0]])) == 1
    # every request got the score of its own response inside its group's set
    by_question: dict[str, list[dict]] = {}
    for g in groups:
        by_question.setdefault(g["prompt"], []).append(g)
    for i, out in enumerate(outputs):
        question = questions[i // N]
        response = responses[i // N][i % N]
        matches = [
            g["scores"][g["responses"].index(response)]
            for g in by_question[question]
            if sorted(g["responses"]) == sorted(responses[i // N])
        ]
        assert matches and out["reward"][0] == pytest.approx(matches[0], abs=1e-6)
    assert sum(r.metric("dynrubric_reward_partial_groups_total") for r in replicas) == 0
    # the groups a replica owns closed together and were judged in ONE batch (one generation pass):
    # scored one at a time, SmolLM2 took 314 s for a 4 x 4 batch and OpenRLHF retried every request
    batches = {n: r.metric("dynrubric_reward_scoring_seconds_count") for n, r in enumerate(replicas)}
    assert batches == {n: (1.0 if any(n in o for o in owners.values()) else 0.0) for n in range(len(replicas))}


def test_partial_group_is_scored_at_the_deadline_and_counted(replicas, tokenizer):
    """Two partial groups close at their deadline: one of two samples, and one of a single sample,
    which is also counted apart as a singleton (no gap to measure, not a collapsed set)."""
    urls = [f"{r.url}/get_reward?token={TOKEN}" for r in replicas]
    metric = lambda name: sum(r.metric(name) for r in replicas)  # noqa: E731
    before = metric("dynrubric_reward_partial_groups_total")
    singles = metric("dynrubric_reward_singleton_groups_total")
    outputs = openrlhf_rollout(
        urls,
        tokenizer,
        [chat(tokenizer, "Count to three."), chat(tokenizer, "Say one word.")],
        [["1 2 3", "one two"], ["word"]],
    )
    for out in outputs:
        assert out["reward"] is not None and math.isfinite(out["reward"][0])
        assert out["extra_logs"]["rubric_partial_group"] == [1.0]
    assert sorted(out["extra_logs"]["rubric_group_size"][0] for out in outputs) == [1.0, 2.0, 2.0]
    assert metric("dynrubric_reward_partial_groups_total") == before + 2
    assert metric("dynrubric_reward_singleton_groups_total") == singles + 1


def test_auth_limits_and_malformed_bodies(replicas):
    url = replicas[0].url
    body = {"query": ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>"], "prompts": ["solo"]}
    assert httpx.post(f"{url}/reward", json=body, timeout=30).status_code == 401
    assert httpx.post(f"{url}/reward?token=wrong", json=body, timeout=30).status_code == 401
    assert httpx.get(f"{url}/healthz").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200

    big = httpx.post(f"{url}/reward?token={TOKEN}", content=b'{"query": ["' + b"x" * 5000 + b'"]}', timeout=30)
    assert big.status_code == 413
    bad = httpx.post(f"{url}/reward?token={TOKEN}", content=b'{"query": [', timeout=30)
    assert bad.status_code == 422 and bad.json()["field"] == "body"
    wrong = httpx.post(f"{url}/reward?token={TOKEN}", json={"query": "not a list"}, timeout=30)
    assert wrong.status_code == 422 and wrong.json()["field"] == "query"
    mismatch = httpx.post(f"{url}/reward?token={TOKEN}", json={"query": ["a", "b"], "prompts": ["a"]}, timeout=30)
    assert mismatch.status_code == 422 and mismatch.json()["field"] == "prompts"
    empty = httpx.post(f"{url}/reward?token={TOKEN}", json={"query": [], "prompts": [], "labels": []}, timeout=30)
    assert empty.status_code == 200 and empty.json() == {"rewards": [], "scores": [], "extra_logs": {}}
    assert replicas[0].metric("dynrubric_reward_requests_total", 'outcome="rejected"') == 6  # 2 x 401, 413, 3 x 422


def test_bearer_header_and_batch_endpoint(replicas):
    url = replicas[1].url
    sets = {"sets": [{"prompt": "What is 2 + 2?", "responses": ["4", "5", "four"]}]}
    r = httpx.post(f"{url}/score_sets", json=sets, headers={"authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert r.status_code == 200
    [scored] = r.json()["sets"]
    assert len(scored["scores"]) == 3 and all(0 <= s <= 1 for s in scored["scores"])
    assert len(scored["verdicts"]) == len(scored["rubric"]) and json.dumps(scored)
    assert (
        httpx.post(f"{url}/score_sets", json={"sets": []}, headers={"authorization": f"Bearer {TOKEN}"}).json()["field"]
        == "sets"
    )


def test_token_is_never_logged(replicas):
    for r in replicas:
        assert TOKEN not in r.log.read_text()
