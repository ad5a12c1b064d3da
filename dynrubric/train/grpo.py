"""The embedded GRPO trainer: group-normalised advantages, token-level clipped surrogate, k3 KL, AdamW.

One `GRPOTrainer.step(groups)` is `grpo.updates_per_batch` optimiser updates over one batch of candidate
sets:

    A_i      = (E_i - mean_C E) / (std_C E + eps)          per set C (std with Bessel's correction, as
                                                           OpenRLHF's group_norm and TRL do)
    log pi   = log_softmax(logits / T)                     T = the temperature the rollouts were sampled
                                                           at (as OpenRLHF); top_p is not applied, as in
                                                           OpenRLHF: the loss sees the tempered full
                                                           distribution, not the nucleus
    ratio_t  = exp(log pi(y_t) - log pi_old(y_t))          pi_old = the policy that sampled, its log-probs
                                                           taken once before the first update; so the
                                                           ratio is 1 on update 1 and the clip acts from
                                                           update 2 on
    pg_t     = -min(ratio_t A, clip(ratio_t, 1 - c_low, 1 + c_high) A)
    kl_t     = exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi)            (k3, Schulman)
    loss     = sum_t (pg_t + beta kl_t) / (number of response tokens in the whole batch)

The token-level mean is taken over the whole batch, so gradient accumulation over micro-batches gives
exactly the gradient of the full batch. A set whose score spread (max - min) is below the rubric's tie
threshold `rubric.eps` is a tie: two such scores are the same verdict up to engine noise, and
normalising noise by its own std would make unit-size advantages out of it. Tied sets are left out of
the batch and counted. The values and gradients of `clipped_surrogate` and `k3` match OpenRLHF's
`PolicyLoss` and `compute_approx_kl` (tested, also on the trainer's second update).
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
class SampledResponse:
    """One sampled response: the prompt's token ids (chat template applied) and the response's."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


@dataclass(frozen=True)
class CandidateSet:
    """One candidate set: K rollouts of the same prompt and their set-conditioned scores.

    `advantages`, when given, replace the group-normalised scores (the generator combines several
    normalised rewards at the advantage level); all of them zero counts as a tied set. `temperature`
    is the one the rollouts were sampled at: the loss takes log-probs of that distribution."""

    rollouts: tuple[SampledResponse, ...]
    scores: tuple[float, ...]
    advantages: tuple[float, ...] | None = None
    temperature: float = 1.0


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
    updates: int = 0  # optimiser updates applied on this batch (0 .. grpo.updates_per_batch)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_advantages(scores: Sequence[float], eps: float, tie_eps: float) -> list[float] | None:
    """`(E - mean) / (std + eps)` within one set, or None when the set is tied: its spread
    `max E - min E` is below `tie_eps` (the rubric's tie threshold), or a score is not finite."""
    s = torch.tensor(list(scores), dtype=torch.float64)
    if s.numel() < 2 or not bool(torch.isfinite(s).all()):
        return None
    if float(s.max() - s.min()) < tie_eps:
        return None
    return ((s - s.mean()) / (s.std() + eps)).tolist()  # Bessel-corrected std, as OpenRLHF's group_norm


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


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """log p_T(token_t | tokens_<t) for t = 1..T-1 (shape B x (T-1)), p_T = softmax(logits / T): the
    distribution sampled at temperature T (a float, or one per row). Float32 log-softmax."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    if isinstance(temperature, torch.Tensor):
        if bool((temperature != 1.0).any()):
            logits = logits / temperature.to(logits.dtype).view(-1, 1, 1)
    elif temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def loss_temperature(t: float) -> float:
    """The temperature the loss uses for samples drawn at `t`: `t`, except greedy decoding (t = 0),
    whose every sample is the same (a tied set, no gradient), where T = 1 keeps the division defined."""
    return t if t > 0 else 1.0


def collate(rollouts: Sequence[SampledResponse], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


@dataclass(frozen=True)
class _Micro:
    """One micro-batch, collated: ids, attention mask, response-token mask, advantages (B x 1) and the
    sampling temperature of each row."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    temps: torch.Tensor


def micro_batches(rows: Sequence[tuple[SampledResponse, float, float]], pad_id: int, size: int) -> list[_Micro]:
    """(rollout, advantage, loss temperature) rows collated into micro-batches of `size`."""
    micros = []
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        ids, attn, mask = collate([r for r, _, _ in chunk], pad_id)
        micros.append(_Micro(ids, attn, mask,
                             torch.tensor([a for _, a, _ in chunk], dtype=torch.float32).unsqueeze(-1),
                             torch.tensor([t for _, _, t in chunk], dtype=torch.float32)))
    return micros


def reference_logprobs(model: torch.nn.Module, reference: torch.nn.Module | None, m: _Micro) -> torch.Tensor:
    """The reference's response log-probs of a micro-batch, without gradient; `reference` None: the
    model's LoRA base weights (the adapter disabled) are the reference."""
    with torch.no_grad():
        if reference is not None:
            return response_logprobs(reference, m.ids, m.attn, m.temps)
        with model.disable_adapter():
            return response_logprobs(model, m.ids, m.attn, m.temps)


def masked_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token k3, its sum over the response tokens `mask` selects)."""
    kl = k3(logprobs, ref_logprobs)
    return kl, (kl.detach() * mask).sum()


def mean_kl(model: torch.nn.Module, reference: torch.nn.Module | None, rollouts: Sequence[SampledResponse],
            temperature: float, pad_id: int, micro_batch_size: int) -> float:
    """Mean per-token k3 KL(model || reference) over the response tokens of `rollouts`, log-probs at
    the loss temperature of samples drawn at `temperature` (the trainer's KL term, without gradient)."""
    rows = [(r, 0.0, loss_temperature(temperature)) for r in rollouts if r.response_ids]
    total = tokens = 0.0
    model.eval()
    with torch.no_grad():
        for m in micro_batches(rows, pad_id, micro_batch_size):
            logp = response_logprobs(model, m.ids, m.attn, m.temps)
            total += float(masked_k3(logp, reference_logprobs(model, reference, m), m.mask)[1])
            tokens += float(m.mask.sum())
    return total / tokens if tokens else 0.0


class GRPOTrainer:
    """Owns the trainable policy, the frozen reference and the AdamW state.

    `tie_eps` is the rubric's tie threshold (`rubric.eps`): a set whose score spread is below it is tied."""

    def __init__(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        config: GRPOConfig,
        pad_token_id: int,
        tie_eps: float,
    ):
        self.model = model
        self.ref_model = ref_model
        self.config = config
        self.pad_token_id = pad_token_id
        self.tie_eps = tie_eps
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

    def _batch(self, groups: Sequence[CandidateSet]) -> tuple[list[_Micro], int, int, int]:
        """(micro-batches, tied sets, samples, response tokens) of the non-tied sets."""
        cfg = self.config
        rows: list[tuple[SampledResponse, float, float]] = []
        tied = 0
        for g in groups:
            if g.advantages is not None:
                adv = list(g.advantages) if any(abs(a) > 1e-12 for a in g.advantages) else None
            else:
                adv = group_advantages(g.scores, cfg.adv_eps, self.tie_eps)
            if adv is None:
                tied += 1
                continue
            t = loss_temperature(g.temperature)
            rows.extend((r, a, t) for r, a in zip(g.rollouts, adv, strict=True) if r.response_ids)
        micros = micro_batches(rows, self.pad_token_id, cfg.micro_batch_size)
        return micros, tied, len(rows), sum(len(r.response_ids) for r, _, _ in rows)

    def _backward(
        self,
        micros: Sequence[_Micro],
        tokens: int,
        old: Sequence[torch.Tensor] | None,
        ref: Sequence[torch.Tensor] | None,
    ) -> tuple[float, float, float, float]:
        """Forward/backward of every micro-batch, leaving the batch's gradient in `.grad`.
        Returns (loss, pg_loss, summed k3 over tokens, clipped tokens)."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = pg_sum = kl_sum = clip_sum = 0.0
        self.model.train()
        for i, m in enumerate(micros):
            logp = response_logprobs(self.model, m.ids, m.attn, m.temps)
            # one update per batch: the sampling policy IS the current one (ratio 1, no extra forward)
            pg, clipped = clipped_surrogate(logp, logp.detach() if old is None else old[i], m.adv,
                                            cfg.clip_low, cfg.clip_high)
            per_token = pg
            if ref is not None:
                kl, kl_tokens = masked_k3(logp, ref[i], m.mask)
                per_token = pg + cfg.kl_beta * kl
                kl_sum += float(kl_tokens)
            loss = (per_token * m.mask).sum() / tokens
            loss.backward()
            loss_sum += float(loss.detach())
            pg_sum += float((pg.detach() * m.mask).sum()) / tokens
            clip_sum += float((clipped * m.mask).sum())
        return loss_sum, pg_sum, kl_sum, clip_sum

    def _stats(self, groups: Sequence[CandidateSet], tied: int, samples: int, tokens: int,
               sums: tuple[float, float, float, float]) -> StepStats:
        all_scores = [s for g in groups for s in g.scores]
        loss, pg, kl, clipped = sums
        return StepStats(
            loss=loss,
            pg_loss=pg,
            kl=kl / tokens if tokens else 0.0,
            clip_ratio=clipped / tokens if tokens else 0.0,
            grad_norm=0.0,
            reward_mean=sum(all_scores) / len(all_scores) if all_scores else 0.0,
            sets=len(groups),
            tied_sets=tied,
            samples=samples,
            tokens=tokens,
            updated=False,
            nonfinite=not math.isfinite(loss),
        )

    def accumulate(self, groups: Sequence[CandidateSet]) -> StepStats:
        """The gradient of the first update over the batch, summed over micro-batches into `.grad`
        (no optimiser step)."""
        micros, tied, samples, tokens = self._batch(groups)
        ref = [reference_logprobs(self.model, self.ref_model, m) for m in micros] if self.config.kl_beta > 0 and tokens else None
        sums = self._backward(micros, tokens, None, ref) if tokens else (0.0, 0.0, 0.0, 0.0)
        return self._stats(groups, tied, samples, tokens, sums)

    def step(self, groups: Sequence[CandidateSet]) -> StepStats:
        """`updates_per_batch` optimiser updates over the batch (stats of the last one); no update when
        all sets are tied, and none from the first non-finite loss or gradient norm on."""
        cfg = self.config
        micros, tied, samples, tokens = self._batch(groups)
        if not tokens:
            self.optimizer.zero_grad(set_to_none=True)
            return self._stats(groups, tied, samples, tokens, (0.0, 0.0, 0.0, 0.0))
        ref = [reference_logprobs(self.model, self.ref_model, m) for m in micros] if cfg.kl_beta > 0 else None
        old = None
        if cfg.updates_per_batch > 1:
            # pi_old: the sampling policy's log-probs, taken once before the first update and detached,
            # so that updates 2.. see ratio != 1 and the clip bounds how far the batch moves the policy
            self.model.train()  # the same mode as the gradient forward: on update 1 the ratio is exactly 1
            with torch.no_grad():
                old = [response_logprobs(self.model, m.ids, m.attn, m.temps) for m in micros]
        applied, nonfinite, grad_norm = 0, False, 0.0
        stats = self._stats(groups, tied, samples, tokens, (0.0, 0.0, 0.0, 0.0))
        for _ in range(cfg.updates_per_batch):
            stats = self._stats(groups, tied, samples, tokens, self._backward(micros, tokens, old, ref))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
            nonfinite = stats.nonfinite or not math.isfinite(grad_norm)
            if nonfinite:
                break
            self.optimizer.step()
            applied += 1
        self.optimizer.zero_grad(set_to_none=True)
        return replace(stats, grad_norm=grad_norm, nonfinite=nonfinite, updated=applied > 0, updates=applied)

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
