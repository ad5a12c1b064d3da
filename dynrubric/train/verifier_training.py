"""Train the verifier on ranked answers: the items it reads should be met more readily by the better answer (issue 36).

The judge alone ranks open answers no better than its verifier reads them: under the physicians' own criteria,
SmolLM2's P(yes) puts HealthBench's ideal completion above SmolLM2's answers in 0.635 of the pairs, and a
generator taught experts' items moved nothing (docs/benchmarks.md, the judge). Here the verifier learns from the
signal the generator learns from in R_anchor: a ranked pair of answers to one prompt (in production, the users'
thumbs; in the benchmark, a strong model's or a physician's answer over base SmolLM2's).

Per TRAIN-split prompt, the generator writes its set-conditioned rubric over the set as the judge would, and each
item the verifier reads (`evaluator.verifier_reads`; a generated item, not a derived one) makes pairs

    better  the verifier's own prompt (`verify.Verifier.prompts`): the question, the preferred answer, the item
    worse   the same item on one other answer of the set

and the loss is Bradley-Terry on the verdict's log-odds (`grpo.pairwise_verdict_loss`):

    z(x) = log sum_{y in Yes} p(y | x) - log sum_{n in No} p(n | x)          (the verdict is sigmoid(z))
    loss = softplus(-polarity * (z(better) - z(worse)))

so an item of polarity +1 is to be met more readily by the preferred answer, one of polarity -1 less readily. The
verdict's level is left free: only the pair's order is taught, the calibration answers' de-bias still sets the zero.
AdamW over the whole model; the result is a plain HF model dir any engine loads (`models.verifier`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from dynrubric.rubric.evaluator import verifier_reads
from dynrubric.rubric.items import Rubric, RubricItem


@dataclass(frozen=True)
class VerdictPair:
    """One item read on the preferred answer of a set and on one other answer."""

    better: str  # the verifier's rendered prompt: question, preferred answer, item
    worse: str  # the same question and item on the other answer
    polarity: int  # the item's: +1, to be met more readily by the preferred answer; -1, less


def items_read(rubric: Rubric, check_weight: float) -> list[RubricItem]:
    """The generated items of `rubric` whose verdict comes from the verifier (not a check alone)."""
    return [i for i in rubric.items if i.origin == "generator" and verifier_reads(i, check_weight)]


def verdict_pairs(
    prompts: Callable[[str, Sequence[str], Sequence[RubricItem]], list[str]],
    question: str,
    responses: Sequence[str],
    preferred: int,
    items: Sequence[RubricItem],
    rng: random.Random,
    per_answer: int = 1,
) -> list[VerdictPair]:
    """Up to `per_answer` items (a seeded draw) per other answer of the set, each as a pair with the preferred
    answer. `prompts(question, responses, items)` renders the verifier's prompts, response-major, as
    `Verifier.prompts`."""
    out = []
    for other in (k for k in range(len(responses)) if k != preferred):
        for item in rng.sample(list(items), min(per_answer, len(items))):
            better, worse = prompts(question, [responses[preferred], responses[other]], [item])
            out.append(VerdictPair(better, worse, item.polarity))
    return out


@dataclass(frozen=True)
class VerifierStep:
    update: int
    epoch: int
    loss: float  # the batch's mean pairwise loss, before the update
    ordered: float  # the share of the batch's pairs the verifier ordered right (polarity * (z_b - z_w) > 0), before


def train_verifier(
    model_dir: Path,
    pairs: Sequence[VerdictPair],
    yes: Sequence[str],
    no: Sequence[str],
    out_dir: Path,
    *,
    lr: float,
    epochs: int,
    batch: int,
    micro_batch: int,
    seed: int,
    compute_dtype: str = "auto",
    log: Callable[[VerifierStep], None] | None = None,
) -> list[VerifierStep]:
    """Fine-tune the verifier at `model_dir` on `pairs` (`yes`/`no`: the single-token spellings the verifier sums,
    `verify.AnswerTokens`); the result goes to `out_dir`. Each update is one batch of `batch` pairs (micro-batches of
    `micro_batch` pairs), the pairs reshuffled every epoch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dynrubric.train.grpo import CausalLM, autocast, pairwise_verdict_loss, save_policy, verdict_log_odds

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    lm = cast(CausalLM, model)
    device = next(model.parameters()).device
    yes_ids = torch.tensor([tokenizer.encode(s, add_special_tokens=False)[0] for s in yes], device=device)
    no_ids = torch.tensor([tokenizer.encode(s, add_special_tokens=False)[0] for s in no], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def log_odds(texts: Sequence[str]) -> torch.Tensor:
        rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
        hidden = lm.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        # only the answer position's logits: the last real token of each (right-padded) row
        last = hidden[torch.arange(len(rows), device=device), mask.sum(1) - 1]
        return verdict_log_odds(lm.get_output_embeddings()(last).float(), yes_ids, no_ids)

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    steps: list[VerifierStep] = []
    for epoch in range(epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for start in range(0, len(order), batch):
            chosen = [pairs[i] for i in order[start : start + batch]]
            optimizer.zero_grad(set_to_none=True)
            total, ordered = 0.0, 0
            for m in range(0, len(chosen), micro_batch):
                micro = chosen[m : m + micro_batch]
                with autocast(compute_dtype, device):
                    z = log_odds([p.better for p in micro] + [p.worse for p in micro])
                polarity = torch.tensor([float(p.polarity) for p in micro], device=device)
                better, worse = z[: len(micro)], z[len(micro) :]
                loss = pairwise_verdict_loss(better, worse, polarity, len(chosen))
                loss.backward()
                total += float(loss.detach())
                ordered += int((polarity * (better - worse) > 0).sum())
            optimizer.step()
            step = VerifierStep(len(steps) + 1, epoch + 1, total, ordered / len(chosen))
            steps.append(step)
            if log is not None:
                log(step)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_policy(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    return steps
