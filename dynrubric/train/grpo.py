"""The embedded GRPO trainer: group-normalised advantages, token-level clipped surrogate, k3 KL, AdamW.

One `GRPOTrainer.step(groups)` is `grpo.updates_per_batch` optimiser updates over one batch of candidate
sets:

    A_i      = (E_i - mean_C E) / (std_C E + eps)          per set C (std with Bessel's correction, as
                                                           OpenRLHF's group_norm and TRL do): grpo.advantages
                                                           `normalised`, the default
    A_i      = E_i - mean_C E                              `centred` (Dr GRPO, OpenRLHF's dr_grpo): no
                                                           division by the set's std
    log pi   = log_softmax(logits / T)                     T = the temperature the rollouts were sampled
                                                           at (as OpenRLHF); top_p is not applied, as in
                                                           OpenRLHF: the loss sees the tempered full
                                                           distribution, not the nucleus
    ratio_t  = exp(log pi(y_t) - log pi_old(y_t))          pi_old = the policy that sampled, its log-probs
                                                           taken once before the first update; so the
                                                           ratio is 1 on update 1 and the clip acts from
                                                           update 2 on
    pg_t     = -min(ratio_t A, clip(ratio_t, 1 - c_low, 1 + c_high) A)
    w_t      = clamp(exp(log pi_old - log mu), lo, hi)     mu = the engine that sampled, by its own log-probs
                                                           (vLLM's bf16 kernels, another attention path):
                                                           the truncated importance weight, OpenRLHF's TIS
                                                           (grpo.tis_low/high); 1 without log-probs
    kl_t     = exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi)            (k3, Schulman)
    loss     = sum_t (w_t pg_t + beta kl_t) / (number of response tokens in the whole batch)

The token-level mean is taken over the whole batch, so gradient accumulation over micro-batches gives
exactly the gradient of the full batch. Log-probs come from the LM head a chunk of tokens at a time
(`response_logprobs`), never from a whole B x T x V distribution. A set whose score spread
(max - min) is below the rubric's tie threshold `rubric.eps` (or `grpo.min_spread`, the higher) is a
tie: two such scores are the same verdict up to engine noise, and normalising noise by its own std
would make unit-size advantages out of it. Tied sets are left out of the batch and counted. The
learning rate warms up linearly over AdamW's first `grpo.warmup_updates` updates (its own step
counter, so a state carried across rounds does not warm up again). The values and gradients of
`clipped_surrogate`, `truncated_importance_weights` and `k3` match OpenRLHF's `PolicyLoss` (its TIS
too) and `compute_approx_kl` (tested, also on the trainer's second update).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeGuard, cast

import torch

from dynrubric.config import GRPOConfig


@dataclass(frozen=True)
class SampledResponse:
    """One sampled response: the prompt's token ids (chat template applied) and the response's, and the
    sampling engine's log-probs of the response tokens when it returned them (one per response id, of the
    distribution it sampled from), for the truncated importance correction."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None


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
    no_gradient_sets: int  # tied (spread below tie_eps) or given all-zero advantages (an untrusted set)
    samples: int  # responses that contributed gradient
    tokens: int
    updated: bool  # False when every set was tied or the loss was not finite (no optimiser step)
    nonfinite: bool
    updates: int = 0  # optimiser updates applied on this batch (0 .. grpo.updates_per_batch)
    # sampler-trainer mismatch over the response tokens that carry the sampling engine's log-prob (None: none did)
    sampler_tokens: int = 0
    sampler_log_ratio: float | None = None  # mean |log pi_old - log mu| per token
    sampler_capped: float | None = None  # share of those tokens whose importance weight was truncated
    lr: float | None = None  # the learning rate of the batch's last update (None: no update was applied)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


AdvantageKind = Literal["normalised", "centred"]  # grpo.advantages


def min_set_spread(tie_eps: float, config: GRPOConfig) -> float:
    """The score spread a set needs to give a gradient: the rubric's tie threshold, or `grpo.min_spread` when
    that is higher (the trainer and the round's dynamic sampling decide with the same number)."""
    return max(tie_eps, config.min_spread)


def has_signal(scores: Sequence[float], min_spread: float) -> bool:
    """Whether a set gives a gradient: at least two scores, all finite, spread `max E - min E >= min_spread`."""
    if len(scores) < 2 or not all(math.isfinite(x) for x in scores):
        return False
    return max(scores) - min(scores) >= min_spread


def normalised_advantages(scores: Sequence[float], eps: float) -> list[float]:
    """`A_i = (E_i - mean E) / (std E + eps)`, std with Bessel's correction (GRPO; OpenRLHF's group_norm)."""
    s = torch.tensor(list(scores), dtype=torch.float64)
    return ((s - s.mean()) / (s.std() + eps)).tolist()


def centred_advantages(scores: Sequence[float]) -> list[float]:
    """`A_i = E_i - mean E` (Dr GRPO; OpenRLHF's dr_grpo): the set's spread is kept, so a set whose scores
    differ by judge noise gives a gradient of that size, not a unit-size one."""
    s = torch.tensor(list(scores), dtype=torch.float64)
    return (s - s.mean()).tolist()


def group_advantages(
    scores: Sequence[float], eps: float, tie_eps: float, kind: AdvantageKind = "normalised"
) -> list[float] | None:
    """The advantages of one set (`normalised_advantages` or `centred_advantages`), or None when the set is
    tied: its spread `max E - min E` is below `tie_eps` (`min_set_spread`), or a score is not finite."""
    if not has_signal(scores, tie_eps):
        return None
    return centred_advantages(scores) if kind == "centred" else normalised_advantages(scores, eps)


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


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token truncated importance weight of the trainer's pi_old against the engine that sampled:
    `w = clamp(exp(log pi_old - log mu), low, high)`, detached (it reweights the surrogate, as
    OpenRLHF 0.11's PolicyLoss with its token-level clipped correction, TIS). A token without the
    engine's log-prob (NaN) has weight 1. Returns (w, log pi_old - log mu (0 where unknown), 0/1 where
    w was truncated)."""
    known = ~torch.isnan(sampler_logprobs)
    log_ratio = torch.where(known, old_logprobs.detach() - sampler_logprobs, 0.0)
    ratio = log_ratio.clamp(-20.0, 20.0).exp()  # clamp as the surrogate's ratio: no overflow
    capped = known & ((ratio < low) | (ratio > high))
    return ratio.clamp(low, high).masked_fill(~known, 1.0), log_ratio, capped.float()


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref); bounded like OpenRLHF's so one outlier token
    cannot overflow the gradient."""
    log_ratio = (logprobs.float() - ref_logprobs.float()).clamp(min=-10.0)
    return ((-log_ratio).exp() - 1.0 + log_ratio).clamp(-10.0, 10.0)


def supervised_nll(logprobs: torch.Tensor, mask: torch.Tensor, tokens: int) -> torch.Tensor:
    """`-sum_t mask_t log p(y_t | y_<t, x) / tokens`: a target's negative log-likelihood over `tokens`, the target
    tokens of the whole batch, so that the micro-batches' losses add up to the batch's mean per token (the
    generator's warm start, generator_warmstart.py)."""
    return -(logprobs * mask).sum() / max(tokens, 1)


def verdict_log_odds(logits: torch.Tensor, yes_ids: torch.Tensor, no_ids: torch.Tensor) -> torch.Tensor:
    """`z = logsumexp(logits[Yes]) - logsumexp(logits[No])` per row: the log-odds of the verifier's verdict, whose
    P(yes) / (P(yes) + P(no)) is sigmoid(z) (the softmax's normaliser cancels)."""
    return logits[:, yes_ids].logsumexp(-1) - logits[:, no_ids].logsumexp(-1)


def pairwise_verdict_loss(
    better: torch.Tensor, worse: torch.Tensor, polarity: torch.Tensor, pairs: int
) -> torch.Tensor:
    """`sum softplus(-polarity * (z_better - z_worse)) / pairs`: Bradley-Terry on one item's verdict log-odds for
    the preferred answer and another, over the `pairs` of the whole batch (the verifier's training,
    verifier_training.py)."""
    return torch.nn.functional.softplus(-polarity * (better - worse)).sum() / max(pairs, 1)


class CausalLM(Protocol):
    """What the trainer calls on a policy beyond `torch.nn.Module`: a transformers causal LM, or a peft
    wrapper of one."""

    def get_decoder(self) -> torch.nn.Module: ...
    def get_output_embeddings(self) -> torch.nn.Module: ...
    def save_pretrained(self, save_directory: Path) -> None: ...


class LoraPolicy(CausalLM, Protocol):
    """A peft-wrapped policy (`is_lora`)."""

    def disable_adapter(self) -> contextlib.AbstractContextManager[None]: ...
    def merge_and_unload(self) -> CausalLM: ...


def lm_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model without its LM head, the head): `model(x).logits == head(body(x).last_hidden_state)` for
    the causal LMs this trainer runs (Llama, Qwen, Mistral, SmolLM...); `check_lm_head` verifies it.
    Through a peft wrapper both resolve to the wrapped model's modules, adapters included."""
    lm = cast(CausalLM, model)
    return lm.get_decoder(), lm.get_output_embeddings()


def check_lm_head(model: torch.nn.Module) -> None:
    """Refuse a model whose logits are not its head applied to the last hidden state (a logit soft-cap or
    scale, as Gemma 2 and Cohere apply): `response_logprobs` would take log-probs of other numbers."""
    from dynrubric.errors import DynrubricError

    body, head = lm_head(model)
    ids = torch.arange(1, 5).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
        mine = head(body(input_ids=ids, use_cache=False).last_hidden_state).float()
    if not torch.allclose(logits, mine, rtol=1e-4, atol=1e-4):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise DynrubricError(
            f"the {kind} model's logits are not its LM head applied to the last hidden state (max difference "
            f"{float((logits - mine).abs().max()):.3g}): the trainer's log-probs would be wrong",
            "train a causal LM with a plain linear head (Llama, Qwen, Mistral, SmolLM families)",
        )


def chunk_rows(vocab_size: int, chunk_mib: int) -> int:
    """Rows of float32 logits that fit in `chunk_mib` MiB (at least one)."""
    return max(1, chunk_mib * 2**20 // (4 * vocab_size))


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    # the head and the log-softmax in float32 even under the trainer's bfloat16 autocast (grpo.compute_dtype):
    # bfloat16 logits would lose the small log-prob differences the ratio and the KL measure
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logits = head(hidden.float()).float() / temperature.unsqueeze(-1)
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor, rows: int
) -> torch.Tensor:
    """`log_softmax(head(hidden) / T)[target]` per row of `hidden` (N x d), `rows` rows at a time: never
    more than one chunk's N_c x V logits exist. Under autograd each chunk is checkpointed: its forward
    keeps only its input, and the backward recomputes its logits, so the backward too holds one chunk
    at a time. Values and gradients are those of the whole-batch log_softmax (the same formula per row)."""
    from torch.utils.checkpoint import checkpoint

    track = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    pieces = []
    for start in range(0, hidden.size(0), rows):
        part = (hidden[start : start + rows], targets[start : start + rows], temperature[start : start + rows])
        if track:
            pieces.append(checkpoint(_chunk_logprobs, head, *part, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(head, *part))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_mib: int = GRPOConfig.model_fields["logprob_chunk_mib"].default,
) -> torch.Tensor:
    """log p_T(token_t | tokens_<t) for t = 1..T-1 (shape B x (T-1)), p_T = softmax(logits / T): the
    distribution sampled at temperature T (a float, or one per row). Float32 log-softmax.

    Only the positions `mask` (B x (T-1)) selects are computed (the others hold 0; default: all), and the
    LM head runs over at most `chunk_mib` MiB of float32 logits at a time (`token_logprobs`): the full
    B x T x V distribution is never materialised (~40 GB at 7B, V = 152k, 64 x 1024 tokens)."""
    body, head = lm_head(model)
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state[:, :-1]
    b, t = hidden.shape[:2]
    temps = temperature.float() if isinstance(temperature, torch.Tensor) else torch.full((b,), float(temperature))
    where = (mask > 0) if mask is not None else torch.ones((b, t), dtype=torch.bool)
    rows, cols = where.nonzero(as_tuple=True)
    values = token_logprobs(
        head,
        hidden[rows, cols],
        input_ids[:, 1:][rows, cols],
        temps[rows],
        chunk_rows(cast(torch.Tensor, head.weight).size(0), chunk_mib),
    )
    return values.new_zeros((b, t)).index_put((rows, cols), values)


def loss_temperature(t: float) -> float:
    """The temperature the loss uses for samples drawn at `t`: `t`, except greedy decoding (t = 0),
    whose every sample is the same (a tied set, no gradient), where T = 1 keeps the division defined."""
    return t if t > 0 else 1.0


def sampler_logprobs(rollouts: Sequence[SampledResponse], width: int) -> torch.Tensor | None:
    """The engine's log-probs aligned with `collate`'s response mask (B x (width - 1)), NaN where a
    token has none; None when no rollout carries them."""
    if all(r.logprobs is None for r in rollouts):
        return None
    out = torch.full((len(rollouts), width - 1), float("nan"))
    for i, r in enumerate(rollouts):
        if r.logprobs is not None:
            if len(r.logprobs) != len(r.response_ids):
                raise ValueError(f"{len(r.logprobs)} sampler log-probs for {len(r.response_ids)} response tokens")
            start = len(r.prompt_ids) - 1
            out[i, start : start + len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    return out


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
    """One micro-batch, collated: ids, attention mask, response-token mask, advantages (B x 1), the
    sampling temperature of each row and the sampling engine's log-probs (`sampler_logprobs`)."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    temps: torch.Tensor
    sampler: torch.Tensor | None


def micro_batches(rows: Sequence[tuple[SampledResponse, float, float]], pad_id: int, size: int) -> list[_Micro]:
    """(rollout, advantage, loss temperature) rows collated into micro-batches of `size`."""
    micros = []
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        ids, attn, mask = collate([r for r, _, _ in chunk], pad_id)
        micros.append(
            _Micro(
                ids,
                attn,
                mask,
                torch.tensor([a for _, a, _ in chunk], dtype=torch.float32).unsqueeze(-1),
                torch.tensor([t for _, _, t in chunk], dtype=torch.float32),
                sampler_logprobs([r for r, _, _ in chunk], ids.size(1)),
            )
        )
    return micros


def micro_logprobs(model: torch.nn.Module, m: _Micro, chunk_mib: int) -> torch.Tensor:
    """`response_logprobs` of a micro-batch's response tokens at its rows' temperatures."""
    return response_logprobs(model, m.ids, m.attn, m.temps, m.mask, chunk_mib)


def reference_logprobs(
    model: torch.nn.Module, reference: torch.nn.Module | None, m: _Micro, chunk_mib: int
) -> torch.Tensor:
    """The reference's response log-probs of a micro-batch, without gradient; `reference` None: the
    model's LoRA base weights (the adapter disabled) are the reference."""
    with torch.no_grad():
        if reference is not None:
            return micro_logprobs(reference, m, chunk_mib)
        with cast(LoraPolicy, model).disable_adapter():
            return micro_logprobs(model, m, chunk_mib)


def masked_k3(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token k3, its sum over the response tokens `mask` selects)."""
    kl = k3(logprobs, ref_logprobs)
    return kl, (kl.detach() * mask).sum()


def mean_kl(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    rollouts: Sequence[SampledResponse],
    temperature: float,
    pad_id: int,
    micro_batch_size: int,
    chunk_mib: int,
) -> float:
    """Mean per-token k3 KL(model || reference) over the response tokens of `rollouts`, log-probs at
    the loss temperature of samples drawn at `temperature` (the trainer's KL term, without gradient)."""
    rows = [(r, 0.0, loss_temperature(temperature)) for r in rollouts if r.response_ids]
    total = tokens = 0.0
    model.eval()
    with torch.no_grad():
        for m in micro_batches(rows, pad_id, micro_batch_size):
            logp = micro_logprobs(model, m, chunk_mib)
            total += float(masked_k3(logp, reference_logprobs(model, reference, m, chunk_mib), m.mask)[1])
            tokens += float(m.mask.sum())
    return total / tokens if tokens else 0.0


@dataclass
class _Sums:
    """One update's sums over the batch's micro-batches: loss and pg loss (already divided by the batch's
    tokens), k3 and clipped tokens, and the sampler mismatch over the tokens with the engine's log-prob."""

    loss: float = 0.0
    pg: float = 0.0
    kl: float = 0.0
    clipped: float = 0.0
    sampler_tokens: int = 0
    sampler_abs_log_ratio: float = 0.0
    sampler_capped: float = 0.0


@functools.cache
def bfloat16_native(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 in hardware: a GPU that supports it; a CPU with AVX512-BF16 or AMX
    (oneDNN's own test). Elsewhere torch falls back to a reference GEMM: on a 2-core AVX2 EPYC, a forward and
    backward of 4 x 300 tokens of SmolLM2-135M took 290 s under bfloat16 autocast against 11 s in float32."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def compute_dtype(setting: str, device: torch.device) -> str:
    """`grpo.compute_dtype` on `device`: auto is bfloat16 where it is native (`bfloat16_native`), else float32."""
    if setting == "auto":
        return "bfloat16" if bfloat16_native(device) else "float32"
    return setting


def autocast(setting: str, device: torch.device) -> Any:
    """The precision of a trainer's forward and backward passes (`grpo.compute_dtype` on `device`): bfloat16 autocast
    runs the transformer body's matmuls in bfloat16 (AMX on a recent Xeon, tensor cores on a GPU); the weights, the
    optimiser, the LM head and the log-softmax stay float32."""
    if compute_dtype(setting, device) == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class GRPOTrainer:
    """Owns the trainable policy, the frozen reference and the AdamW state.

    `tie_eps` is the rubric's tie threshold (`rubric.eps`): a set whose score spread is below it (or below
    `grpo.min_spread`, the higher of the two) is tied."""

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
        self.min_spread = min_set_spread(tie_eps, config)
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        check_lm_head(model)
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

    def learning_rate(self) -> float:
        """The next update's learning rate: `lr_t = lr min(1, (t + 1) / N)`, N = `grpo.warmup_updates`, t = the
        updates applied so far (AdamW's step counter, saved with its state: a resumed or carried optimiser goes on
        where it was)."""
        n = self.config.warmup_updates
        return self.config.lr if n <= 0 else self.config.lr * min(1.0, (self.updates + 1) / n)

    def _batch(self, groups: Sequence[CandidateSet]) -> tuple[list[_Micro], int, int, int]:
        """(micro-batches, tied sets, samples, response tokens) of the non-tied sets."""
        cfg = self.config
        rows: list[tuple[SampledResponse, float, float]] = []
        tied = 0
        for g in groups:
            if g.advantages is not None:
                adv = list(g.advantages) if any(abs(a) > 1e-12 for a in g.advantages) else None
            else:
                adv = group_advantages(g.scores, cfg.adv_eps, self.min_spread, cfg.advantages)
            if adv is None:
                tied += 1
                continue
            t = loss_temperature(g.temperature)
            rows.extend((r, a, t) for r, a in zip(g.rollouts, adv, strict=True) if r.response_ids)
        micros = micro_batches(rows, self.pad_token_id, cfg.micro_batch_size)
        return micros, tied, len(rows), sum(len(r.response_ids) for r, _, _ in rows)

    def _autocast(self) -> Any:
        return autocast(self.config.compute_dtype, next(self.model.parameters()).device)

    def _backward(
        self,
        micros: Sequence[_Micro],
        tokens: int,
        old: Sequence[torch.Tensor] | None,
        ref: Sequence[torch.Tensor] | None,
    ) -> _Sums:
        """Forward/backward of every micro-batch, leaving the batch's gradient in `.grad`."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        sums = _Sums()
        self.model.train()
        for i, m in enumerate(micros):
            with self._autocast():
                logp = micro_logprobs(self.model, m, cfg.logprob_chunk_mib)
            # one update per batch: the sampling policy IS the current one (ratio 1, no extra forward)
            pi_old = logp.detach() if old is None else old[i]
            pg, clipped = clipped_surrogate(logp, pi_old, m.adv, cfg.clip_low, cfg.clip_high)
            if m.sampler is not None:
                weights, log_ratio, capped = truncated_importance_weights(pi_old, m.sampler, cfg.tis_low, cfg.tis_high)
                if cfg.tis:
                    pg = pg * weights
                known = m.mask * (~torch.isnan(m.sampler)).float()
                sums.sampler_tokens += int(known.sum())
                sums.sampler_abs_log_ratio += float((log_ratio.abs() * known).sum())
                sums.sampler_capped += float((capped * known).sum())
            per_token = pg
            if ref is not None:
                kl, kl_tokens = masked_k3(logp, ref[i], m.mask)
                per_token = pg + cfg.kl_beta * kl
                sums.kl += float(kl_tokens)
            loss = (per_token * m.mask).sum() / tokens
            loss.backward()
            sums.loss += float(loss.detach())
            sums.pg += float((pg.detach() * m.mask).sum()) / tokens
            sums.clipped += float((clipped * m.mask).sum())
        return sums

    def _stats(self, groups: Sequence[CandidateSet], tied: int, samples: int, tokens: int, sums: _Sums) -> StepStats:
        all_scores = [s for g in groups for s in g.scores]
        seen = sums.sampler_tokens
        return StepStats(
            loss=sums.loss,
            pg_loss=sums.pg,
            kl=sums.kl / tokens if tokens else 0.0,
            clip_ratio=sums.clipped / tokens if tokens else 0.0,
            grad_norm=0.0,
            reward_mean=sum(all_scores) / len(all_scores) if all_scores else 0.0,
            sets=len(groups),
            no_gradient_sets=tied,
            samples=samples,
            tokens=tokens,
            updated=False,
            nonfinite=not math.isfinite(sums.loss),
            sampler_tokens=seen,
            sampler_log_ratio=sums.sampler_abs_log_ratio / seen if seen else None,
            sampler_capped=sums.sampler_capped / seen if seen else None,
        )

    def accumulate(self, groups: Sequence[CandidateSet]) -> StepStats:
        """The gradient of the first update over the batch, summed over micro-batches into `.grad`
        (no optimiser step)."""
        micros, tied, samples, tokens = self._batch(groups)
        chunk = self.config.logprob_chunk_mib
        with self._autocast():
            ref = (
                [reference_logprobs(self.model, self.ref_model, m, chunk) for m in micros]
                if self.config.kl_beta > 0 and tokens
                else None
            )
        sums = self._backward(micros, tokens, None, ref) if tokens else _Sums()
        return self._stats(groups, tied, samples, tokens, sums)

    def step(self, groups: Sequence[CandidateSet]) -> StepStats:
        """`updates_per_batch` optimiser updates over the batch (stats of the last one); no update when
        all sets are tied, and none from the first non-finite loss or gradient norm on."""
        cfg = self.config
        micros, tied, samples, tokens = self._batch(groups)
        if not tokens:
            self.optimizer.zero_grad(set_to_none=True)
            return self._stats(groups, tied, samples, tokens, _Sums())
        with self._autocast():
            ref = (
                [reference_logprobs(self.model, self.ref_model, m, cfg.logprob_chunk_mib) for m in micros]
                if cfg.kl_beta > 0
                else None
            )
        old = None
        if cfg.updates_per_batch > 1:
            # pi_old: the sampling policy's log-probs, taken once before the first update and detached,
            # so that updates 2.. see ratio != 1 and the clip bounds how far the batch moves the policy
            self.model.train()  # the same mode as the gradient forward: on update 1 the ratio is exactly 1
            with torch.no_grad(), self._autocast():
                old = [micro_logprobs(self.model, m, cfg.logprob_chunk_mib) for m in micros]
        applied, nonfinite, grad_norm, lr = 0, False, 0.0, None
        stats = self._stats(groups, tied, samples, tokens, _Sums())
        for _ in range(cfg.updates_per_batch):
            stats = self._stats(groups, tied, samples, tokens, self._backward(micros, tokens, old, ref))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
            nonfinite = stats.nonfinite or not math.isfinite(grad_norm)
            if nonfinite:
                break
            lr = self.learning_rate()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            applied += 1
        self.optimizer.zero_grad(set_to_none=True)
        return replace(stats, grad_norm=grad_norm, nonfinite=nonfinite, updated=applied > 0, updates=applied, lr=lr)

    # ------------------------------------------------------------ persistence
    def save(self, directory: Path) -> None:
        """Weights (HF safetensors, merged when LoRA) under `model/`, optimiser state in `optimizer.pt`."""
        directory = Path(directory)
        save_policy(self.model, directory / "model")
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        if is_lora(self.model):
            self.model.save_pretrained(directory / "adapter")

    def load_optimizer(self, path: Path) -> None:
        """AdamW's state (moments, step counter) from `path`: a resumed round's last step, or the round that made
        the parent (`grpo.optimizer_across_rounds: carry`). The hyperparameters stay this config's (a state saved
        under another config keeps its moments, not its betas or decay); the learning rate is set per update."""
        cfg = self.config
        self.optimizer.load_state_dict(torch.load(path, weights_only=True))
        for group in self.optimizer.param_groups:
            group.update(
                lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
            )


def is_lora(model: torch.nn.Module) -> TypeGuard[LoraPolicy]:
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_and_unload")


def save_policy(model: torch.nn.Module, directory: Path) -> None:
    """A plain HF checkpoint any engine can load: LoRA adapters are merged into a copy first."""
    if is_lora(model):
        import copy

        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(directory)
    else:
        cast(CausalLM, model).save_pretrained(directory)


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
