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
AdamW over the whole model; the result is a plain HF model dir any engine loads (`models.verifier`). With
validation pairs drawn from other prompts, the weights kept are those of the lowest validation loss (early
stopping): 285 pairs are memorized in two epochs (training loss 0.008-0.145 in docs/benchmarks.md's three seeds).
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


@dataclass(frozen=True)
class VerifierCheck:
    """The verifier on the validation pairs (prompts it never trains on) after `update` updates (0: as loaded)."""

    update: int
    loss: float  # mean pairwise loss
    ordered: float  # share ordered right


@dataclass(frozen=True)
class VerifierRun:
    steps: list[VerifierStep]
    checks: list[VerifierCheck]  # empty without validation pairs
    kept: int  # the update count whose weights went to out_dir: the lowest validation loss, else the last


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
    validation: Sequence[VerdictPair] = (),
    check_every: int = 0,
    last_dir: Path | None = None,
    log: Callable[[VerifierStep | VerifierCheck], None] | None = None,
) -> VerifierRun:
    """Fine-tune the verifier at `model_dir` on `pairs` (`yes`/`no`: the single-token spellings the verifier sums,
    `verify.AnswerTokens`). Each update is one batch of `batch` pairs (micro-batches of `micro_batch` pairs), the
    pairs reshuffled every epoch.

    Early stopping: with `validation` pairs (from prompts `pairs` never draws on), the verifier is checked on them
    before training, every `check_every` updates (0: at the end of each epoch) and at the end, and out_dir gets the
    weights of the check with the lowest validation loss (the earliest on a tie), which may be the model as loaded.
    Without, out_dir gets the last weights. `last_dir`, if given, gets the last weights too."""
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

    def pair_terms(micro: Sequence[VerdictPair], total: int) -> tuple[torch.Tensor, int]:
        """The micro-batch's share of the batch loss (over `total` pairs) and how many pairs it orders right."""
        with autocast(compute_dtype, device):
            z = log_odds([p.better for p in micro] + [p.worse for p in micro])
        polarity = torch.tensor([float(p.polarity) for p in micro], device=device)
        better, worse = z[: len(micro)], z[len(micro) :]
        ordered = int((polarity * (better - worse) > 0).sum())
        return pairwise_verdict_loss(better, worse, polarity, total), ordered

    checks: list[VerifierCheck] = []
    best: dict[str, torch.Tensor] | None = None  # the weights of the best check so far, when it is not the last

    def check(update: int) -> None:
        nonlocal best
        if not validation or (checks and checks[-1].update == update):
            return
        model.train(False)  # no dropout while checking
        loss, ordered = 0.0, 0
        with torch.no_grad():
            for m in range(0, len(validation), micro_batch):
                term, right = pair_terms(validation[m : m + micro_batch], len(validation))
                loss, ordered = loss + float(term), ordered + right
        model.train()
        if not checks or loss < min(c.loss for c in checks):
            best = {k: v.detach().clone() for k, v in model.state_dict().items()}
        checks.append(VerifierCheck(update, loss, ordered / len(validation)))
        if log is not None:
            log(checks[-1])

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    steps: list[VerifierStep] = []
    check(0)
    for epoch in range(epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for start in range(0, len(order), batch):
            chosen = [pairs[i] for i in order[start : start + batch]]
            optimizer.zero_grad(set_to_none=True)
            total, ordered = 0.0, 0
            for m in range(0, len(chosen), micro_batch):
                loss, right = pair_terms(chosen[m : m + micro_batch], len(chosen))
                loss.backward()
                total, ordered = total + float(loss.detach()), ordered + right
            optimizer.step()
            step = VerifierStep(len(steps) + 1, epoch + 1, total, ordered / len(chosen))
            steps.append(step)
            if log is not None:
                log(step)
            if check_every and step.update % check_every == 0:
                check(step.update)
        if not check_every:
            check(len(steps))
    check(len(steps))

    def save(directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_policy(model, directory)
        tokenizer.save_pretrained(directory)

    if last_dir is not None:
        save(last_dir)
    kept = min(checks, key=lambda c: c.loss).update if checks else len(steps)  # min: the earliest of equal losses
    if best is not None and kept != len(steps):
        model.load_state_dict(best)
    save(out_dir)
    return VerifierRun(steps, checks, kept)
