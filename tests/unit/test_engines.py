"""Both engine implementations against a plain forward pass, and against each other on real vLLM."""

from __future__ import annotations

import math

import pytest
import torch

from dynrubric.engines.base import GenerationRequest, SamplingParams
from dynrubric.engines.hf import TransformersEngine

CANDIDATES = [" Yes", "Yes", "yes", " No", "No", "no"]


def judge_prompts(n_responses: int = 3, n_items: int = 4) -> list[str]:
    head = "You are a strict judge. Answer Yes or No.\nQuestion: what is 7 * 6?\n"
    responses = ["The answer is 42.", "It is 48, I think.", "blue green red", "42"][:n_responses]
    items = ["States the answer", "Shows the working", "Is polite", "Uses one word"][:n_items]
    return [f"{head}Response: {r}\nCriterion: {it}\nAnswer:" for r in responses for it in items]


def reference_logprobs(engine: TransformersEngine, prompt: str) -> dict[str, float]:
    ids = torch.tensor([engine.encode(prompt)])
    with torch.no_grad():
        lp = torch.log_softmax(engine.model(ids).logits[0, -1].float(), dim=-1)
    return {c: float(lp[t]) for c, t in engine.candidate_token_ids(CANDIDATES).items()}


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return TransformersEngine(tiny_model_dir, max_batch_size=5)


def test_shared_prefix_scores_match_one_prompt_at_a_time(tiny_engine):
    prompts = judge_prompts() + ["an unrelated prompt with nothing shared"]
    tiny_engine.tokens_processed = 0
    got = tiny_engine.score_next_token(prompts, CANDIDATES)
    shared_tokens = tiny_engine.tokens_processed
    unique_tokens = sum(len(tiny_engine.encode(p)) for p in prompts)
    for prompt, row in zip(prompts, got, strict=True):
        ref = reference_logprobs(tiny_engine, prompt)
        assert row.keys() == ref.keys()
        for c in CANDIDATES:
            assert row[c] == pytest.approx(ref[c], abs=1e-4)
    # the instructions and each response are computed once, not once per item
    assert shared_tokens < 0.6 * unique_tokens


def test_unshared_batching_gives_the_same_scores(tiny_model_dir):
    prompts = judge_prompts(2, 3)
    shared = TransformersEngine(tiny_model_dir).score_next_token(prompts, CANDIDATES)
    plain = TransformersEngine(tiny_model_dir, share_prefix=False).score_next_token(prompts, CANDIDATES)
    for a, b in zip(shared, plain, strict=True):
        for c in CANDIDATES:
            assert a[c] == pytest.approx(b[c], abs=1e-4)


def test_greedy_generation_matches_transformers_generate(tiny_engine):
    prompts = ["hello there", "What is 2 + 2? The answer", "x"]
    params = SamplingParams(max_tokens=10, temperature=0)
    got = tiny_engine.generate([GenerationRequest(p, params) for p in prompts])
    for prompt, completions in zip(prompts, got, strict=True):
        ids = torch.tensor([tiny_engine.encode(prompt)])
        ref = tiny_engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)[
            0, ids.shape[1] :
        ].tolist()
        ref = [t for t in ref if t not in tiny_engine._eos_ids][: len(completions[0].token_ids)]
        assert list(completions[0].token_ids) == ref


def test_sampling_n_seeded_with_logprobs(tiny_engine):
    params = SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=7, logprobs=True)
    a = tiny_engine.generate([GenerationRequest("hello", params)])[0]
    b = tiny_engine.generate([GenerationRequest("hello", params)])[0]
    assert len(a) == 4
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({c.token_ids for c in a}) > 1  # 4 samples of a random model differ
    for c in a:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in c.logprobs)


def test_stop_strings_cut_the_text(tiny_engine):
    params = SamplingParams(max_tokens=20, temperature=0)
    full = tiny_engine.generate([GenerationRequest("hello there", params)])[0][0].text
    assert len(full) > 3
    stop = full[2:4]
    cut = tiny_engine.generate(
        [GenerationRequest("hello there", SamplingParams(max_tokens=20, temperature=0, stop=(stop,)))]
    )
    assert cut[0][0].text == full[: full.find(stop)]
    assert cut[0][0].finish_reason == "stop"


def test_frequency_penalty_stops_a_completion_repeating_its_tokens(tiny_engine):
    def greedy(penalty: float) -> tuple[int, ...]:
        params = SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=penalty)
        [[c]] = tiny_engine.generate([GenerationRequest("hello there", params)])
        return c.token_ids

    plain, penalised = greedy(0.0), greedy(1e4)
    assert len(set(plain)) < len(plain)  # the random tiny model loops without a penalty
    assert len(penalised) == 24 and len(set(penalised)) == len(penalised)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (engine.device=cuda)")
def test_a_cuda_engine_scores_and_generates_like_the_cpu_engine(tiny_model_dir):
    cpu = TransformersEngine(tiny_model_dir, max_batch_size=5)
    gpu = TransformersEngine(tiny_model_dir, max_batch_size=5, device="cuda")
    prompts = judge_prompts()
    for a, b in zip(cpu.score_next_token(prompts, CANDIDATES), gpu.score_next_token(prompts, CANDIDATES), strict=True):
        for c in CANDIDATES:
            assert a[c] == pytest.approx(b[c], abs=1e-3)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    [[a]], [[b]] = (e.generate([GenerationRequest("hello there", params)]) for e in (cpu, gpu))
    assert a.token_ids[:4] == b.token_ids[:4]  # greedy; later tokens may flip on float differences


def test_load_weights_swaps_the_model(tiny_model_dir, tmp_path):
    from tests.tinymodel import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)
    engine = TransformersEngine(tiny_model_dir)
    before = engine.score_next_token(["hello"], ["Yes"])[0]["Yes"]
    engine.load_weights(other, "v2")
    assert engine.policy_version == "v2"
    assert engine.score_next_token(["hello"], ["Yes"])[0]["Yes"] != pytest.approx(before)


def test_non_finite_weights_answer_an_error_not_random_tokens(tiny_model_dir, tmp_path):
    """The drill's damaged copy (dynrubric/app/loop.py) makes the engine raise, and its server answer 500."""
    from fastapi.testclient import TestClient

    from dynrubric.app.loop import damage_nonfinite
    from dynrubric.engines.base import NonFiniteLogits
    from serving.engine_server import build_app

    engine = TransformersEngine(tiny_model_dir)
    engine.load_weights(damage_nonfinite(tiny_model_dir, tmp_path / "r1-damaged"), "r1-damaged")
    for temperature in (0.0, 1.0):
        with pytest.raises(NonFiniteLogits, match="r1-damaged: the model's logits are NaN"):
            engine.generate([GenerationRequest("hello", SamplingParams(max_tokens=4, temperature=temperature))])
    r = TestClient(build_app(engine, "policy")).post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["detail"].startswith("non-finite logits: r1-damaged"), r.text


def test_unreachable_engine_is_one_clear_error(smollm_dir):
    from dynrubric.engines.http import OpenAIHTTPEngine
    from dynrubric.errors import DynrubricError
    from dynrubric.ports import free_port

    with pytest.raises(DynrubricError, match="unreachable") as info:
        OpenAIHTTPEngine(f"http://127.0.0.1:{free_port()}", smollm_dir, timeout_s=2)
    assert "engine.base_url" in info.value.fix


def test_a_slow_engine_is_told_apart_from_an_unreachable_one(smollm_dir):
    """A server that takes a request and answers later than `engine.timeout_s` is there: the error names the timeout
    to raise, not a base_url to fix (a rubric batch on a busy CPU outlasted the old 120 s and read as unreachable)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dynrubric.engines.base import GenerationRequest, SamplingParams
    from dynrubric.engines.http import OpenAIHTTPEngine
    from dynrubric.errors import DynrubricError

    answered = threading.Event()

    class SlowServer(BaseHTTPRequestHandler):  # a real HTTP server: lists its model, then stalls on completions
        def do_GET(self) -> None:
            body = b'{"data": [{"id": "slow"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            answered.wait(10)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = OpenAIHTTPEngine(f"http://127.0.0.1:{server.server_address[1]}", smollm_dir, timeout_s=1)
        with pytest.raises(DynrubricError, match="did not answer /v1/completions within 1 s") as info:
            engine.generate([GenerationRequest("hello", SamplingParams(max_tokens=4))])
        assert "engine.timeout_s" in info.value.fix and "base_url" not in info.value.fix
    finally:
        answered.set()
        server.shutdown()
