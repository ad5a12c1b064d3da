"""The embedded GRPO trainer: advantages, loss and gradients (against OpenRLHF), accumulation, ties, LoRA."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from dynrubric.config import GRPOConfig
from dynrubric.train.grpo import (
    GRPOTrainer,
    Group,
    Rollout,
    clipped_surrogate,
    group_advantages,
    k3,
    load_policy,
    load_reference,
)
from tests.openrlhf_shim import openrlhf_dir


def test_group_advantages_normalise_within_the_set_and_detect_ties() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6, tie_eps=1e-6)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # Bessel: 0.5774
    assert adv == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1 + [-0.5 / (std + 1e-6), 0.5 / (std + 1e-6)])
    assert group_advantages([0.3, 0.3, 0.3, 0.3], 1e-6, 1e-6) is None
    assert group_advantages([0.5], 1e-6, 1e-6) is None


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


def groups(seed: int, n_sets: int = 3, k: int = 4) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n_sets):
        prompt = tuple(int(x) for x in torch.randint(5, 200, (5 + s,), generator=g))
        rollouts = tuple(
            Rollout(prompt, tuple(int(x) for x in torch.randint(5, 200, (3 + j,), generator=g))) for j in range(k)
        )
        scores = tuple(float(x) for x in torch.rand(k, generator=g))
        out.append(Group(rollouts, scores))
    return out


def make_trainer(model_dir: Path, **overrides) -> GRPOTrainer:
    cfg = GRPOConfig(lr=1e-3, kl_beta=0.05, **overrides)
    model = load_policy(model_dir, cfg)
    return GRPOTrainer(model, load_reference(model_dir, cfg), cfg, pad_token_id=0)


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
    tied = [Group(g.rollouts, (0.5,) * len(g.rollouts)) for g in groups(2)]
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
