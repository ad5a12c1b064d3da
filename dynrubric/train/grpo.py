"""The embedded GRPO trainer: group-normalised advantages, token-level clipped surrogate, k3 KL, AdamW.

One `GRPOTrainer.step(groups)` is one optimiser update over a batch of candidate sets:

    A_i      = (E_i - mean_C E) / (std_C E + eps)          per set C (std with Bessel's correction, as
                                                           OpenRLHF's group_norm and TRL do)
    ratio_t  = exp(log pi(y_t) - log pi_old(y_t))          pi_old = the policy that sampled (one update per
                                                           batch, so pi_old = pi detached)
    pg_t     = -min(ratio_t A, clip(ratio_t, 1 - c_low, 1 + c_high) A)
    kl_t     = exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi)            (k3, Schulman)
    loss     = sum_t (pg_t + beta kl_t) / (number of response tokens in the whole batch)

The token-level mean is taken over the whole batch, so gradient accumulation over micro-batches gives
exactly the gradient of the full batch. Sets whose scores are all tied (std below `tie_eps`) have no
advantage signal: they are left out of the batch entirely and counted. The values and gradients of
`clipped_surrogate` and `k3` match OpenRLHF's `PolicyLoss` and `compute_approx_kl` (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dynrubric.config import GRPOConfig


@dataclass(frozen=True)
class Rollout:
    """One sampled response: the prompt's token ids (chat template applied) and the response's."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


@dataclass(frozen=True)
class Group:
    """One candidate set: K rollouts of the same prompt and their set-conditioned scores.

    `advantages`, when given, replace the group-normalised scores (the generator combines several
    normalised rewards at the advantage level); all of them below `tie_eps` counts as a tied set."""

    rollouts: tuple[Rollout, ...]
    scores: tuple[float, ...]
    advantages: tuple[float, ...] | None = None


@dataclass(frozen=True)
class StepStats:
    loss: float
    pg_loss: float
    kl: float  # mean per-token k3 to the reference over the trained tokens
    clip_ratio: float  # share of tokens where the clipped branch was taken
    grad_norm: float
    reward_mean: float  # mean score over ALL sets of the batch (tied ones included)
    sets: int
    tied_sets: int
    samples: int  # responses that contributed gradient
    tokens: int
    updated: bool  # False when every set was tied or the loss was not finite (no optimiser step)
    nonfinite: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_advantages(scores: Sequence[float], eps: float, tie_eps: float) -> list[float] | None:
    """`(E - mean) / (std + eps)` within one set, or None when the set is tied (no signal)."""
    s = torch.tensor(list(scores), dtype=torch.float64)
    if s.numel() < 2:
        return None
    std = s.std()  # Bessel-corrected, as OpenRLHF's group_norm
    if not torch.isfinite(std) or std < tie_eps:
        return None
    return ((s - s.mean()) / (std + eps)).tolist()


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss `-min(r A, clip(r) A)` and a 0/1 tensor of where clipping was active."""
    ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0).exp()  # clamp as OpenRLHF: no overflow
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.min(surr1, surr2), (surr2 < surr1).float()


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref); bounded like OpenRLHF's so one outlier token
    cannot overflow the gradient."""
    log_ratio = (logprobs.float() - ref_logprobs.float()).clamp(min=-10.0)
    return ((-log_ratio).exp() - 1.0 + log_ratio).clamp(-10.0, 10.0)


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t = 1..T-1 (shape B x (T-1)); float32 log-softmax."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def collate(rollouts: Sequence[Rollout], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and the response-token mask aligned with `response_logprobs`."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    ids = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rollouts), width), dtype=torch.long)
    resp = torch.zeros((len(rollouts), width - 1), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        seq = list(r.prompt_ids) + list(r.response_ids)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        # position t-1 of the shifted log-probs predicts token t: response tokens start at len(prompt)
        resp[i, len(r.prompt_ids) - 1 : len(seq) - 1] = 1.0
    return ids, attn, resp


class GRPOTrainer:
    """Owns the trainable policy, the frozen reference and the AdamW state."""

    def __init__(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        config: GRPOConfig,
        pad_token_id: int,
    ):
        self.model = model
        self.ref_model = ref_model
        self.config = config
        self.pad_token_id = pad_token_id
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the policy has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )

    @property
    def updates(self) -> int:
        """Optimiser updates applied so far (AdamW's own step counter, saved with its state)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state and "step" in state:
                    return int(state["step"])
        return 0

    def _ref_logprobs(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.ref_model is not None:
                return response_logprobs(self.ref_model, ids, attn)
            with self.model.disable_adapter():  # LoRA: the base weights are the reference
                return response_logprobs(self.model, ids, attn)

    def accumulate(self, groups: Sequence[Group]) -> StepStats:
        """Forward/backward over the batch in micro-batches, leaving the summed gradient in `.grad`
        (no optimiser step). `step` is this plus clipping and the update."""
        cfg = self.config
        all_scores = [s for g in groups for s in g.scores]
        reward_mean = sum(all_scores) / len(all_scores) if all_scores else 0.0
        batch: list[tuple[Rollout, float]] = []
        tied = 0
        for g in groups:
            if g.advantages is not None:
                adv = list(g.advantages) if any(abs(a) >= max(cfg.tie_eps, 1e-12) for a in g.advantages) else None
            else:
                adv = group_advantages(g.scores, cfg.adv_eps, cfg.tie_eps)
            if adv is None:
                tied += 1
                continue
            batch.extend((r, a) for r, a in zip(g.rollouts, adv, strict=True) if r.response_ids)
        tokens = sum(len(r.response_ids) for r, _ in batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = pg_sum = kl_sum = clip_sum = 0.0
        self.model.train()
        for start in range(0, len(batch) if tokens else 0, cfg.micro_batch_size):
            micro = batch[start : start + cfg.micro_batch_size]
            ids, attn, mask = collate([r for r, _ in micro], self.pad_token_id)
            adv = torch.tensor([a for _, a in micro], dtype=torch.float32).unsqueeze(-1)
            logp = response_logprobs(self.model, ids, attn)
            pg, clipped = clipped_surrogate(logp, logp.detach(), adv, cfg.clip_low, cfg.clip_high)
            per_token = pg
            if cfg.kl_beta > 0:
                kl = k3(logp, self._ref_logprobs(ids, attn))
                per_token = pg + cfg.kl_beta * kl
                kl_sum += float((kl.detach() * mask).sum())
            loss = (per_token * mask).sum() / tokens
            loss.backward()
            loss_sum += float(loss.detach())
            pg_sum += float((pg.detach() * mask).sum()) / tokens
            clip_sum += float((clipped * mask).sum())
        return StepStats(
            loss=loss_sum,
            pg_loss=pg_sum,
            kl=kl_sum / tokens if tokens else 0.0,
            clip_ratio=clip_sum / tokens if tokens else 0.0,
            grad_norm=0.0,
            reward_mean=reward_mean,
            sets=len(groups),
            tied_sets=tied,
            samples=len(batch),
            tokens=tokens,
            updated=False,
            nonfinite=not math.isfinite(loss_sum),
        )

    def step(self, groups: Sequence[Group]) -> StepStats:
        """One optimiser update over the batch; no update when all sets are tied or anything is NaN/inf."""
        stats = self.accumulate(groups)
        if stats.tokens == 0:
            return stats
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm))
        nonfinite = stats.nonfinite or not math.isfinite(grad_norm)
        if not nonfinite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return replace(stats, grad_norm=grad_norm, nonfinite=nonfinite, updated=not nonfinite)

    # ------------------------------------------------------------ persistence
    def save(self, directory: Path) -> None:
        """Weights (HF safetensors, merged when LoRA) under `model/`, optimiser state in `optimizer.pt`."""
        directory = Path(directory)
        save_policy(self.model, directory / "model")
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        if is_lora(self.model):
            self.model.save_pretrained(directory / "adapter")

    def load_optimizer(self, path: Path) -> None:
        self.optimizer.load_state_dict(torch.load(path, weights_only=True))


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_and_unload")


def save_policy(model: torch.nn.Module, directory: Path) -> None:
    """A plain HF checkpoint any engine can load: LoRA adapters are merged into a copy first."""
    if is_lora(model):
        import copy

        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(directory)
    else:
        model.save_pretrained(directory)


def load_policy(model_dir: Path, config: GRPOConfig, adapter_dir: Path | None = None) -> torch.nn.Module:
    """The trainable policy from an HF dir (float32 on CPU), wrapped in LoRA when configured."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if config.lora_rank > 0:
        from dynrubric.extras import require

        require("peft", "lora", "LoRA (train.grpo.lora_rank > 0)")
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter_dir is not None:
            return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0,
            target_modules=config.lora_target_modules,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, lora)
    return model


def load_reference(model_dir: Path, config: GRPOConfig) -> torch.nn.Module | None:
    """The frozen reference: a separate copy, or None with LoRA (the base weights under the adapter)
    or when the KL term is off."""
    if config.kl_beta <= 0 or config.lora_rank > 0:
        return None
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
