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
    k3,
    load_policy,
    load_reference,
    response_logprobs,
)
from tests.openrlhf_shim import openrlhf_dir


TIE = RubricConfig().eps  # the rubric's tie threshold, 0.02


def test_group_advantages_normalise_within_the_set_and_detect_ties() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6, tie_eps=TIE)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # Bessel: 0.5774
    assert adv == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1 + [-0.5 / (std + 1e-6), 0.5 / (std + 1e-6)])
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
    assert stats.tied_sets == 3 and stats.samples == 0 and not stats.updated
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
        assert torch.allclose(response_logprobs(trainer.model, ids, attn, torch.full((4,), 0.7)),
                              response_logprobs(trainer.model, ids, attn, 0.7))


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


def groups(seed: int, n_sets: int = 3, k: int = 4) -> list[CandidateSet]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n_sets):
        prompt = tuple(int(x) for x in torch.randint(5, 200, (5 + s,), generator=g))
        rollouts = tuple(
            SampledResponse(prompt, tuple(int(x) for x in torch.randint(5, 200, (3 + j,), generator=g))) for j in range(k)
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
        lp, old, adv, action_mask=mask)
    theirs = pg + 0.05 * loss_mod.aggregate_loss(utils.compute_approx_kl(lp, ref, kl_estimator="k3"), mask,
                                                 token_level_loss=True)
    assert s_two.loss == pytest.approx(float(theirs.detach()), rel=1e-4, abs=1e-6)
    _, clipped = clipped_surrogate(lp.detach(), old, adv, 0.2, 0.28)
    assert s_two.clip_ratio == pytest.approx(float((clipped * mask).sum() / mask.sum()), abs=1e-6)
    assert s_two.clip_ratio > 0  # the clip really acted on the path the trainer runs


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


def test_tied_sets_give_no_gradient_and_are_counted(tiny_model_dir: Path) -> None:
    trainer = make_trainer(tiny_model_dir)
    before = copy.deepcopy(trainer.model.state_dict())
    tied = [CandidateSet(g.rollouts, (0.5,) * len(g.rollouts)) for g in groups(2)]
    stats = trainer.step(tied)
    assert stats.tied_sets == 3 and stats.samples == 0 and not stats.updated
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    mixed = tied[:2] + groups(3, n_sets=1)
    stats = trainer.step(mixed)
    assert stats.tied_sets == 2 and stats.samples == 4 and stats.updated and trainer.updates == 1


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
    assert stats.updated and stats.kl >= 0
    assert all(torch.equal(frozen[n], p) for n, p in trainer.model.named_parameters() if n in frozen)
    trainer.save(tmp_path / "ckpt")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert not any("lora" in n for n, _ in merged.named_parameters())
