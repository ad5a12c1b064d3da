"""The embedded GRPO trainer: advantages, loss and gradients (against OpenRLHF), accumulation, ties, LoRA."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from dynrubric.config import GRPOConfig, RubricConfig
from dynrubric.train.grpo import (
    CandidateSet,
    GRPOTrainer,
    SampledResponse,
    clipped_surrogate,
    collate,
    group_advantages,
    has_signal,
    k3,
    load_policy,
    load_reference,
    min_set_spread,
    response_logprobs,
    token_logprobs,
    truncated_importance_weights,
)
from tests.openrlhf_shim import openrlhf_dir

TIE = RubricConfig().eps  # the rubric's tie threshold, 0.02


def test_group_advantages_normalise_within_the_set_and_detect_ties() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6, tie_eps=TIE)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # Bessel: 0.5774
    assert adv == pytest.approx(
        [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1 + [-0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    )
    assert group_advantages([0.3, 0.3, 0.3, 0.3], 1e-6, TIE) is None
    assert group_advantages([0.5], 1e-6, TIE) is None
    assert group_advantages([0.5, float("nan"), 0.1, 0.9], 1e-6, TIE) is None


def test_a_set_that_differs_only_by_engine_noise_is_tied_and_gives_no_gradient(tiny_model_dir: Path) -> None:
    """Batched and unshared verdicts of one response differ by ~6e-6: a set whose scores differ by that
    much is a tie at the rubric's threshold, not a set to push apart with unit-size advantages."""
    noisy = (0.5, 0.5 + 6e-6, 0.5 - 4e-6, 0.5 + 1e-5)
    assert group_advantages(noisy, 1e-6, TIE) is None
    assert group_advantages((0.5, 0.5, 0.5, 0.5 + 1.5 * TIE), 1e-6, TIE) is not None  # a real tie-breaker
    trainer = make_trainer(tiny_model_dir)
    before = copy.deepcopy(trainer.model.state_dict())
    stats = trainer.step([CandidateSet(g.rollouts, noisy) for g in groups(6)])
    assert stats.no_gradient_sets == 3 and stats.samples == 0 and not stats.updated
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_the_loss_takes_log_probs_of_the_sampling_temperature(tiny_model_dir: Path) -> None:
    """Rollouts sampled at T = 0.7 are scored by log_softmax(logits / 0.7), as OpenRLHF divides the
    logits by the sampling temperature: the gradient is that of -A log p_0.7(y), not of log p_1(y)."""
    [g] = groups(7, n_sets=1)
    trainer = make_trainer(tiny_model_dir, kl_beta=0.0, micro_batch_size=64)
    trainer.accumulate([CandidateSet(g.rollouts, g.scores, temperature=0.7)])
    got = [p.grad.clone() for p in trainer.params]

    def manual(t: float) -> list[torch.Tensor]:
        model = make_trainer(tiny_model_dir, kl_beta=0.0).model
        ids, attn, mask = collate(g.rollouts, 0)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / t
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        adv = torch.tensor(group_advantages(g.scores, 1e-6, TIE)).unsqueeze(-1)
        (-(adv * logp) * mask).sum().div(mask.sum()).backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got, manual(0.7), strict=True))
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got, manual(1.0), strict=True))
    ids, attn, _ = collate(g.rollouts, 0)
    with torch.no_grad():
        assert torch.allclose(
            response_logprobs(trainer.model, ids, attn, torch.full((4,), 0.7)),
            response_logprobs(trainer.model, ids, attn, 0.7),
        )


@pytest.mark.skipif(openrlhf_dir() is None, reason="openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_loss_and_gradients_match_openrlhf(clip_high: float) -> None:
    from tests.openrlhf_shim import loss_modules

    utils, loss_mod = loss_modules()
    g = torch.Generator().manual_seed(0)
    b, t = 6, 11
    base = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    # old log-probs far enough from the new ones that both clip edges are hit
    old = base + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 0.8
    ref = base + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 0.5
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    beta = 0.04

    def ours(lp: torch.Tensor) -> torch.Tensor:
        pg, _ = clipped_surrogate(lp, old, adv, 0.2, clip_high)
        return ((pg + beta * k3(lp, ref)) * mask).sum() / mask.sum()

    def theirs(lp: torch.Tensor) -> torch.Tensor:
        policy_loss = loss_mod.PolicyLoss(clip_eps_low=0.2, clip_eps_high=clip_high, token_level_loss=True)
        pg, clip_ratio, *_ = policy_loss(lp, old, adv, action_mask=mask)
        kl = utils.compute_approx_kl(lp, ref, kl_estimator="k3")
        return pg + beta * loss_mod.aggregate_loss(kl, mask, token_level_loss=True)

    lp1 = base.clone().requires_grad_(True)
    lp2 = base.clone().requires_grad_(True)
    a, b_ = ours(lp1), theirs(lp2)
    a.backward()
    b_.backward()
    assert float(a.detach()) == pytest.approx(float(b_.detach()), rel=1e-6, abs=1e-9)
    assert torch.allclose(lp1.grad.double(), lp2.grad.double(), rtol=1e-6, atol=1e-9)
    # the clip branches were really exercised
    _, clipped = clipped_surrogate(base, old, adv, 0.2, clip_high)
    assert 0 < float((clipped * mask).sum()) < float(mask.sum())
    # the KL value alone, k3 against OpenRLHF's helper
    assert torch.allclose(k3(base, ref).double(), utils.compute_approx_kl(base, ref, kl_estimator="k3").double())


def test_k3_values_by_hand_and_its_mean_under_pi_is_the_exact_kl() -> None:
    """k3(x) = exp(-x) - 1 + x with x = log pi - log pi_ref, per token; its expectation under pi is
    KL(pi || pi_ref) exactly. pi = (0.5, 0.3, 0.2), pi_ref = (0.2, 0.5, 0.3):
    KL = 0.5 ln 2.5 + 0.3 ln 0.6 + 0.2 ln(2/3) = 0.4581454 - 0.1532477 - 0.0810930 = 0.2238047."""
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    per_token = k3(pi.log(), ref.log())
    # x = ln 2.5: 0.4 - 1 + 0.9162907; x = ln 0.6: 5/3 - 1 - 0.5108256; x = ln(2/3): 1.5 - 1 - 0.4054651
    assert per_token.tolist() == pytest.approx([0.3162907, 0.1558411, 0.0945349], abs=1e-6)
    assert float((pi * per_token).sum()) == pytest.approx(0.2238047, abs=1e-6)
    assert float(k3(pi.log(), pi.log()).abs().max()) == 0.0
    # the bound: a log-ratio of -30 is clamped to -10 and the value to 10 (exp(10) - 11 would be 22015)
    assert float(k3(torch.tensor([-30.0]), torch.tensor([0.0]))) == 10.0


def groups(seed: int, n_sets: int = 3, k: int = 4) -> list[CandidateSet]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n_sets):
        prompt = tuple(int(x) for x in torch.randint(5, 200, (5 + s,), generator=g))
        rollouts = tuple(
            SampledResponse(prompt, tuple(int(x) for x in torch.randint(5, 200, (3 + j,), generator=g)))
            for j in range(k)
        )
        scores = tuple(float(x) for x in torch.rand(k, generator=g))
        out.append(CandidateSet(rollouts, scores))
    return out


def make_trainer(model_dir: Path, **overrides) -> GRPOTrainer:
    cfg = GRPOConfig(**{"lr": 1e-3, "kl_beta": 0.05, **overrides})
    model = load_policy(model_dir, cfg)
    return GRPOTrainer(model, load_reference(model_dir, cfg), cfg, pad_token_id=0, tie_eps=TIE)


@pytest.mark.skipif(openrlhf_dir() is None, reason="openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
def test_the_second_update_clips_against_the_sampling_policy_like_openrlhf(tiny_model_dir: Path) -> None:
    """With updates_per_batch = 2 the trainer's second update is PolicyLoss(log pi, log pi_old) with
    pi_old = the weights that sampled (before update 1): the clip acts there, and the loss the trainer
    reports for that update equals OpenRLHF's on the same tensors."""
    from tests.openrlhf_shim import loss_modules

    utils, loss_mod = loss_modules()
    batch = [CandidateSet(g.rollouts, g.scores, temperature=0.8) for g in groups(8)]
    cfg = {"lr": 0.05, "kl_beta": 0.05, "micro_batch_size": 5, "clip_low": 0.2, "clip_high": 0.28}
    two = make_trainer(tiny_model_dir, updates_per_batch=2, **cfg)
    one = make_trainer(tiny_model_dir, updates_per_batch=1, **cfg)  # stops where `two` starts update 2
    rows = [(r, a) for g in batch for r, a in zip(g.rollouts, group_advantages(g.scores, 1e-6, TIE), strict=True)]
    ids, attn, mask = collate([r for r, _ in rows], 0)
    adv = torch.tensor([a for _, a in rows]).unsqueeze(-1).expand(-1, mask.size(1)).contiguous()
    with torch.no_grad():
        old = response_logprobs(one.model, ids, attn, 0.8)
        ref = response_logprobs(one.ref_model, ids, attn, 0.8)
    s_one, s_two = one.step(batch), two.step(batch)
    assert s_one.updates == 1 and s_two.updates == 2 and two.updates == 2
    assert s_one.clip_ratio == 0.0  # update 1: ratio 1, the clip cannot act
    lp = response_logprobs(one.model, ids, attn, 0.8)
    pg, clip_ratio, *_ = loss_mod.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, token_level_loss=True)(
        lp, old, adv, action_mask=mask
    )
    theirs = pg + 0.05 * loss_mod.aggregate_loss(
        utils.compute_approx_kl(lp, ref, kl_estimator="k3"), mask, token_level_loss=True
    )
    assert s_two.loss == pytest.approx(float(theirs.detach()), rel=1e-4, abs=1e-6)
    _, clipped = clipped_surrogate(lp.detach(), old, adv, 0.2, 0.28)
    assert s_two.clip_ratio == pytest.approx(float((clipped * mask).sum() / mask.sum()), abs=1e-6)
    assert s_two.clip_ratio > 0  # the clip really acted on the path the trainer runs


def test_centred_advantages_keep_the_sets_spread_and_the_trainer_takes_them_from_the_config(
    tiny_model_dir: Path,
) -> None:
    """`grpo.advantages: centred` (Dr GRPO): A = E - mean, no division by the set's std. A set whose scores spread
    by 0.03 gets advantages of +-0.015, where std normalisation makes +-0.87 of it. The trainer uses the kind its
    config names: on update 1 the ratio is 1, so the surrogate is -sum_i A_i |y_i| / sum_i |y_i|."""
    small = (0.50, 0.50, 0.53, 0.53)
    assert group_advantages(small, 1e-6, TIE, "centred") == pytest.approx([-0.015, -0.015, 0.015, 0.015])
    assert group_advantages(small, 1e-6, TIE) == pytest.approx([-0.866, -0.866, 0.866, 0.866], abs=1e-3)
    [g] = groups(9, n_sets=1)
    lengths = [len(r.response_ids) for r in g.rollouts]
    for kind in ("normalised", "centred"):
        stats = make_trainer(tiny_model_dir, kl_beta=0.0, advantages=kind).accumulate([CandidateSet(g.rollouts, small)])
        adv = group_advantages(small, 1e-6, TIE, kind)
        expected = -sum(a * n for a, n in zip(adv, lengths, strict=True)) / sum(lengths)
        assert stats.pg_loss == pytest.approx(expected, rel=1e-4, abs=1e-7), kind


def test_a_set_below_the_minimum_spread_is_tied_and_gives_no_gradient(tiny_model_dir: Path) -> None:
    """`grpo.min_spread`: a set whose scores spread by 0.05 (above the rubric's tie threshold 0.02: the judge's part of
    a set tied on ground truth) trains by default and is a counted tie at min_spread 0.1, as the round's dynamic
    sampling decides it (`has_signal` at `min_set_spread`)."""
    g1, g2 = groups(10, n_sets=2)
    narrow = CandidateSet(g1.rollouts, (0.50, 0.52, 0.55, 0.50))
    wide = CandidateSet(g2.rollouts, (0.0, 1.0, 0.5, 0.25))
    default = make_trainer(tiny_model_dir).accumulate([narrow, wide])
    assert default.no_gradient_sets == 0 and default.samples == 8
    strict = make_trainer(tiny_model_dir, min_spread=0.1)
    stats = strict.accumulate([narrow, wide])
    assert stats.no_gradient_sets == 1 and stats.samples == 4
    threshold = min_set_spread(TIE, strict.config)
    assert threshold == 0.1 and not has_signal(narrow.scores, threshold) and has_signal(wide.scores, threshold)
    assert min_set_spread(TIE, GRPOConfig(min_spread=0.01)) == TIE  # never below the rubric's tie threshold


def test_the_learning_rate_warms_up_over_adamws_first_updates_and_a_loaded_state_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`grpo.warmup_updates` N: update t (AdamW's step counter) runs at lr (t + 1) / N until N. The counter is saved
    with the state, so a state loaded into the next round's trainer (`optimizer_across_rounds: carry`) goes on at the
    full rate, and keeps its moments under the new trainer's hyperparameters."""
    trainer = make_trainer(tiny_model_dir, warmup_updates=4)
    lrs = [trainer.step(groups(11 + i)).lr for i in range(5)]
    assert lrs == pytest.approx([1e-3 / 4, 1e-3 / 2, 3e-3 / 4, 1e-3, 1e-3])
    trainer.save(tmp_path)
    carried = make_trainer(tiny_model_dir, warmup_updates=4, adam_beta2=0.9)
    carried.load_optimizer(tmp_path / "optimizer.pt")
    assert carried.updates == 5 and carried.optimizer.param_groups[0]["betas"] == (0.9, 0.9)
    first = next(iter(trainer.optimizer.state.values()))["exp_avg"]
    assert torch.equal(next(iter(carried.optimizer.state.values()))["exp_avg"], first)
    assert carried.step(groups(20)).lr == pytest.approx(1e-3) and carried.updates == 6
    fresh = make_trainer(tiny_model_dir, warmup_updates=4)
    assert fresh.step(groups(20)).lr == pytest.approx(1e-3 / 4)  # a fresh AdamW warms up again
    assert make_trainer(tiny_model_dir).step(groups(20)).lr == pytest.approx(1e-3)  # warmup_updates 0: none


def test_gradient_accumulation_equals_the_full_batch(tiny_model_dir: Path) -> None:
    batch = groups(1)
    full = make_trainer(tiny_model_dir, micro_batch_size=64)
    micro = make_trainer(tiny_model_dir, micro_batch_size=1)
    s_full, s_micro = full.accumulate(batch), micro.accumulate(batch)
    assert s_full.tokens == s_micro.tokens > 0
    assert s_full.loss == pytest.approx(s_micro.loss, rel=1e-5, abs=1e-7)
    for p, q in zip(full.model.parameters(), micro.model.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7)
    assert full.step(batch).updated and full.updates == 1


def test_bfloat16_autocast_keeps_the_loss_and_the_gradients_direction(tiny_model_dir: Path) -> None:
    """`grpo.compute_dtype: bfloat16` (the demo's `auto` on a CPU with AMX, where the update is ~2x faster) runs the
    body's matmuls in bfloat16 and keeps the weights, the head and the log-softmax in float32: the same loss to a few
    parts in a thousand, and a gradient pointing the same way."""
    batch = groups(5)
    exact, fast = make_trainer(tiny_model_dir), make_trainer(tiny_model_dir, compute_dtype="bfloat16")
    s_exact, s_fast = exact.accumulate(batch), fast.accumulate(batch)
    assert s_fast.loss == pytest.approx(s_exact.loss, rel=2e-2, abs=2e-3)
    g_exact = torch.cat([p.grad.flatten() for p in exact.model.parameters()])
    g_fast = torch.cat([p.grad.flatten() for p in fast.model.parameters()])
    assert float(torch.nn.functional.cosine_similarity(g_exact, g_fast, dim=0)) > 0.98
    assert all(p.dtype == torch.float32 for p in fast.model.parameters())
    assert fast.step(batch).updated


@pytest.mark.parametrize("native", [False, True])
def test_auto_compute_dtype_is_bfloat16_only_where_the_cpu_multiplies_it_natively(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """`grpo.compute_dtype: auto` (the demo's): bfloat16 autocast where the device has native bfloat16 matmuls, float32
    elsewhere. On an AVX2-only CPU torch's bfloat16 GEMM is a reference loop: a round's update took ~20x longer
    (benchmarks/round_time.py)."""
    import dynrubric.train.grpo as grpo

    monkeypatch.setattr(grpo, "bfloat16_native", lambda device: native)
    trainer = make_trainer(tiny_model_dir, compute_dtype="auto")
    autocast = trainer._autocast()
    assert isinstance(autocast, torch.autocast) == native
    assert grpo.compute_dtype("auto", torch.device("cpu")) == ("bfloat16" if native else "float32")
    assert grpo.compute_dtype("bfloat16", torch.device("cpu")) == "bfloat16"  # an explicit setting is kept
    assert trainer.step(groups(2)).updated


def test_tied_sets_give_no_gradient_and_are_counted(tiny_model_dir: Path) -> None:
    trainer = make_trainer(tiny_model_dir)
    before = copy.deepcopy(trainer.model.state_dict())
    tied = [CandidateSet(g.rollouts, (0.5,) * len(g.rollouts)) for g in groups(2)]
    stats = trainer.step(tied)
    assert stats.no_gradient_sets == 3 and stats.samples == 0 and not stats.updated
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    mixed = tied[:2] + groups(3, n_sets=1)
    stats = trainer.step(mixed)
    assert stats.no_gradient_sets == 2 and stats.samples == 4 and stats.updated and trainer.updates == 1


def test_nonfinite_loss_applies_no_update(tiny_model_dir: Path) -> None:
    trainer = make_trainer(tiny_model_dir)
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = math.inf
    stats = trainer.step(groups(4))
    assert stats.nonfinite and not stats.updated and trainer.updates == 0


def test_lora_trains_only_the_adapter_and_saves_a_merged_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_model_dir, lora_rank=4)
    assert trainer.ref_model is None  # the base weights under the adapter are the reference
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    stats = trainer.step(groups(5))
    # the adapter starts at zero (B = 0): the policy of the first step is its reference, KL exactly 0
    assert stats.updated and stats.kl == pytest.approx(0.0, abs=1e-7)
    assert all(torch.equal(frozen[n], p) for n, p in trainer.model.named_parameters() if n in frozen)
    second = trainer.step(groups(5))
    assert second.updated and second.kl > 1e-6  # the trained adapter has moved the policy off its base
    trainer.save(tmp_path / "ckpt")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_weights = dict(base.named_parameters())
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, base_weights[n])]
    assert changed and all(any(t in n for t in trainer.config.lora_target_modules) for n in changed)
    # the merged checkpoint is the trained policy: the same logits as the model with its adapter
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5)
        assert not torch.allclose(base(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


# ---------------------------------------------------------------- log-probs without the full distribution
def test_chunked_token_logprobs_equal_the_full_log_softmax_in_value_and_gradient() -> None:
    """Chunks of 3 rows (checkpointed under autograd) against one log_softmax over all 20 rows: the same
    log-probs and the same gradients for the hidden states and the head's weight."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, 16, generator=g)
    targets = torch.randint(0, 97, (20,), generator=g)
    temps = torch.rand(20, generator=g) + 0.5
    coeff = torch.randn(20, generator=g)

    def run(chunked: bool):
        head = torch.nn.Linear(16, 97, bias=False)
        with torch.no_grad():
            head.weight.copy_(torch.randn(97, 16, generator=torch.Generator().manual_seed(1)))
        h = hidden.clone().requires_grad_(True)
        if chunked:
            logp = token_logprobs(head, h, targets, temps, rows=3)
        else:
            logp = torch.log_softmax(head(h) / temps[:, None], -1).gather(-1, targets[:, None]).squeeze(-1)
        (coeff * logp).sum().backward()
        return logp.detach(), h.grad, head.weight.grad

    full = run(False)
    for a, b in zip(run(True), full, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the no-grad path (reference, pi_old) computes the same numbers without checkpoints
        head = torch.nn.Linear(16, 97, bias=False)
        head.weight.copy_(torch.randn(97, 16, generator=torch.Generator().manual_seed(1)))
        assert torch.allclose(token_logprobs(head, hidden, targets, temps, rows=7), full[0], atol=1e-6)


def test_response_logprobs_computes_only_the_masked_positions(tiny_model_dir: Path) -> None:
    """With a response mask the log-probs at the response tokens are those of the full forward's
    log_softmax (gradient included) and every other position is 0 (and carries no gradient)."""
    [g] = groups(11, n_sets=1)
    trainer = make_trainer(tiny_model_dir)
    ids, attn, mask = collate(g.rollouts, 0)
    got = response_logprobs(trainer.model, ids, attn, 0.9, mask)
    logits = trainer.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / 0.9
    full = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) * mask
    assert torch.allclose(got, full, rtol=1e-5, atol=1e-6) and bool((got[mask == 0] == 0).all())
    mine = torch.autograd.grad(got.sum(), trainer.params)
    theirs = torch.autograd.grad(full.sum(), trainer.params)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(mine, theirs, strict=True))


def test_a_model_whose_logits_are_not_its_head_is_refused(tmp_path: Path) -> None:
    """Gemma 2 soft-caps its logits after the head: log-probs of head(hidden) would be of other numbers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from dynrubric.errors import DynrubricError

    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=1.0,
    )
    with pytest.raises(DynrubricError, match="gemma2 model's logits are not its LM head"):
        GRPOTrainer(Gemma2ForCausalLM(config), None, GRPOConfig(kl_beta=0.0), pad_token_id=0, tie_eps=TIE)


# ---------------------------------------------------------------- truncated importance sampling
@pytest.mark.skipif(openrlhf_dir() is None, reason="openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
def test_truncated_importance_weights_match_openrlhf_tis() -> None:
    """OpenRLHF 0.11's PolicyLoss with the token-level clipped ratio correction (its TIS, band [0.5, 5]):
    same loss, same gradient, same share of truncated tokens."""
    from tests.openrlhf_shim import loss_modules

    _, loss_mod = loss_modules()
    g = torch.Generator().manual_seed(3)
    b, t = 5, 9
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    sampler = old + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 4  # some ratios leave the band
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
    mask = (torch.rand(b, t, generator=g) > 0.2).double()
    lp_ours = (old + 0.1).requires_grad_(True)
    lp_theirs = (old + 0.1).requires_grad_(True)
    pg, _ = clipped_surrogate(lp_ours, old, adv, 0.2, 0.28)
    weights, log_ratio, capped = truncated_importance_weights(old, sampler, 0.5, 5.0)
    ours = (pg * weights * mask).sum() / mask.sum()
    policy_loss = loss_mod.PolicyLoss(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        is_correction_level="token",
        is_correction_mode="clip",
        is_correction_threshold=(0.5, 5.0),
    )
    theirs, _, _, vllm_kl, filtered = policy_loss(lp_theirs, old, adv, action_mask=mask, rollout_log_probs=sampler)
    ours.backward()
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-9)
    assert torch.allclose(lp_ours.grad, lp_theirs.grad, rtol=1e-9, atol=1e-12)
    assert float((capped * mask).sum() / mask.sum()) == pytest.approx(float(filtered)) and 0 < float(filtered) < 1
    assert float((-log_ratio * mask).sum() / mask.sum()) == pytest.approx(float(vllm_kl))
    # a token without the engine's log-prob keeps weight 1 and is not counted as truncated
    w, lr, c = truncated_importance_weights(old[:1], torch.full((1, t), float("nan"), dtype=torch.float64), 0.5, 5.0)
    assert bool((w == 1).all()) and bool((lr == 0).all()) and not c.any()


def sampler_batch(trainer: GRPOTrainer, offsets: torch.Tensor) -> list[CandidateSet]:
    """groups(13) whose responses carry 'engine' log-probs: the trainer's own log-probs at T = 0.8 minus
    `offsets` (per response token, in order), as a sampler that disagrees by exactly those log ratios."""
    batch = [CandidateSet(g.rollouts, g.scores, temperature=0.8) for g in groups(13)]
    rollouts = [r for g in batch for r in g.rollouts]
    ids, attn, mask = collate(rollouts, 0)
    with torch.no_grad():
        own = response_logprobs(trainer.model, ids, attn, 0.8, mask)
    out, k = [], 0
    for g in batch:
        carried = []
        for r in g.rollouts:
            start = len(r.prompt_ids) - 1
            i = rollouts.index(r)
            lp = own[i, start : start + len(r.response_ids)] - offsets[k : k + len(r.response_ids)]
            k += len(r.response_ids)
            carried.append(SampledResponse(r.prompt_ids, r.response_ids, tuple(lp.tolist())))
        out.append(CandidateSet(tuple(carried), g.scores, temperature=0.8))
    return out


def manual_tis_gradient(model: torch.nn.Module, batch: list[CandidateSet], temperature: float) -> list[torch.Tensor]:
    """The first update's gradient by hand: per response token -A w dlog pi / tokens, w = clamp(exp(log pi -
    log mu), 0.5, 5) with mu the rollout's carried log-probs, laid out here independently of the trainer."""
    rows = [(r, a) for g in batch for r, a in zip(g.rollouts, group_advantages(g.scores, 1e-6, TIE), strict=True)]
    ids, attn, mask = collate([r for r, _ in rows], 0)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    weights = torch.zeros_like(mask)
    for i, (r, _) in enumerate(rows):
        for j, mu in enumerate(r.logprobs):
            t = len(r.prompt_ids) - 1 + j
            weights[i, t] = (logp[i, t].detach() - mu).exp().clamp(0.5, 5.0)
    adv = torch.tensor([a for _, a in rows]).unsqueeze(-1)
    (-(adv * weights * logp) * mask).sum().div(mask.sum()).backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


def test_the_surrogate_is_weighted_by_the_truncated_importance_ratio(tiny_model_dir: Path) -> None:
    """Rollouts carrying the sampling engine's log-probs: each token's surrogate is multiplied by
    clamp(exp(log pi_old - log mu), 0.5, 5); the step reports the mismatch; `tis: false` measures it
    without applying it."""
    base = make_trainer(tiny_model_dir, kl_beta=0.0, micro_batch_size=5)
    tokens = sum(len(r.response_ids) for g in groups(13) for r in g.rollouts)
    offsets = torch.linspace(-2.5, 2.5, tokens)  # log ratios from exp(-2.5) = 0.08 to exp(2.5) = 12
    batch = sampler_batch(base, offsets)
    stats = base.accumulate(batch)
    got = [p.grad.clone() for p in base.params]
    assert stats.sampler_tokens == tokens
    assert stats.sampler_log_ratio == pytest.approx(float(offsets.abs().mean()), rel=1e-4)
    truncated = (offsets.exp() < 0.5) | (offsets.exp() > 5.0)
    assert stats.sampler_capped == pytest.approx(float(truncated.float().mean()), abs=1e-6)

    manual = manual_tis_gradient(make_trainer(tiny_model_dir, kl_beta=0.0).model, batch, 0.8)
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-7) for a, b in zip(got, manual, strict=True))

    off = make_trainer(tiny_model_dir, kl_beta=0.0, micro_batch_size=5, tis=False)
    plain = make_trainer(tiny_model_dir, kl_beta=0.0, micro_batch_size=5)
    s_off = off.accumulate(sampler_batch(off, offsets))
    plain.accumulate([CandidateSet(g.rollouts, g.scores, temperature=0.8) for g in groups(13)])
    assert s_off.sampler_log_ratio == pytest.approx(stats.sampler_log_ratio)  # measured ...
    assert all(torch.allclose(p.grad, q.grad) for p, q in zip(off.params, plain.params, strict=True))  # ... not applied
    assert plain.accumulate(groups(13)).sampler_log_ratio is None  # no engine log-probs: no mismatch to report


def test_the_in_process_engine_samples_with_the_trainers_log_probs(tiny_model_dir: Path) -> None:
    """TransformersEngine returns the log-probs of the distribution it drew from (temperature applied;
    the stop token's too): against the trainer's pi_old the mismatch is float noise and nothing is
    truncated."""
    from dynrubric.engines.base import GenerationRequest, SamplingParams
    from dynrubric.engines.hf import TransformersEngine
    from dynrubric.train.coevolve import sampled_response

    engine = TransformersEngine(tiny_model_dir)
    tok = engine.tokenizer
    prompts = [engine.render_chat([{"role": "user", "content": q}]) for q in ("What is 2 + 2?", "Yes or no?")]
    params = SamplingParams(max_tokens=12, temperature=0.7, n=4, seed=5, logprobs=True)
    outs = engine.generate([GenerationRequest(p, params) for p in prompts])
    batch = [
        CandidateSet(
            tuple(sampled_response(tuple(tok.encode(p, add_special_tokens=False)), c, tok) for c in cs),
            tuple(float(i) for i in range(4)),
            temperature=0.7,
        )
        for p, cs in zip(prompts, outs, strict=True)
    ]
    assert all(len(r.logprobs) == len(r.response_ids) for g in batch for r in g.rollouts)
    stats = make_trainer(tiny_model_dir, kl_beta=0.0).accumulate(batch)
    assert stats.sampler_tokens == stats.tokens > 0
    assert stats.sampler_log_ratio < 1e-4 and stats.sampler_capped == 0.0
