"""Warm-start the rubric generator on experts' rubric items: supervised, before any co-evolution (issue 36).

Asked for rubric items, base SmolLM2 writes what its schema allows but little of what a rubric is: 142 of 149 items
on the open judge benchmark carried a check unrelated to their text (docs/benchmarks.md, the judge's open prompts).
Here it is shown what experts write. Per TRAIN-split open prompt of the bank that carries experts' criteria
(HealthBench's physicians' criteria, WritingBench's checklists; Arena-Hard has none), one example is

    input   the generator's own set-conditioned prompt (`RubricGenerator.set_prompt`): the question and a candidate
            set of K answers, the prompt's reference answer (where it has one) among the policy's, in a seeded order
    target  2-4 of the experts' criteria written in the generator's item schema (`expert_item`), as the JSON object
            the generator answers with, then the end-of-turn token

and the loss is the target's negative log-likelihood per token (`grpo.supervised_nll`), AdamW over the whole model.
The criteria of dev and test prompts are never read: those prompts' open-quality figure is graded against them.

An expert criterion becomes an item only where its words say what a response does: HealthBench's "Recommends
calling emergency services ..." becomes "The response recommends calling emergency services" (points -> weight
round(|p| / 2) in 1..5, the sign -> polarity); a criterion that is a step list, a grader's note or a "should"
is left out. WritingBench's "Methodological Rigor: Evaluates ..." becomes "The response shows methodological
rigor" (weight 3). Texts are cut to the schema's 80 characters at a clause boundary where there is one.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynrubric.jsonl import split_lines
from dynrubric.rubric.generate import ITEM_TEXT_CHARS

PREFIX = "The response "
#: one criterion's words that start a sentence about a response: an optional adverb ("Clearly"), then a verb in the
#: third person ("Recommends", "Fails", "Does", "Is")
_DOES = re.compile(r"^(?:[A-Z][a-z]+ly\s+[a-z]+s|[A-Z][a-z]*s)\b")
_NOT_ABOUT_THE_RESPONSE = re.compile(r"^(?:Step\b|Judge|Should\b|Responses\b|For\b|If\b)")
#: where a long criterion may be cut and still say one thing
_CLAUSE_ENDS = (" (", "; ", ". ", ", such as", " such as", ", including", " including", ", e.g.", " e.g.", ": ")
_DANGLING = frozenset(
    "and or the a an of to for with in on at into that as by from their its your this these including such about"
    " which who when while if unless because so than like without not is are be can could may".split()
)
#: dashes and curly quotes as ASCII; double quotes and backslashes, which the item schema does not allow, dropped
_ASCII = str.maketrans(
    {"\u2013": "-", "\u2014": "-", "\u2018": "'", "\u2019": "'", '"': "", "\\": "", "\u201c": "", "\u201d": ""}
)
WRITINGBENCH_WEIGHT = 3


def ascii_text(text: str) -> str:
    """`text` in the schema's characters: printable ASCII without double quotes or backslashes, one space apart."""
    flat = unicodedata.normalize("NFKD", text.translate(_ASCII)).encode("ascii", "ignore").decode()
    return " ".join(flat.split())


def shortened(rest: str, limit: int) -> str:
    """`rest` cut to at most `limit` characters: at its first clause boundary past 20 characters, then, if still
    too long, at the last word that fits; never ending on a connecting word or a punctuation mark."""
    for mark in _CLAUSE_ENDS:
        at = rest.find(mark)
        if at >= 20:
            rest = rest[:at]
    if len(rest) > limit:
        rest = rest[: limit + 1].rsplit(" ", 1)[0]
    words = rest.rstrip(" ,;:-.").split(" ")
    while len(words) > 1 and words[-1].lower().strip(",;:") in _DANGLING:
        words.pop()
    return " ".join(words).rstrip(" ,;:-.")


def expert_item(text: str, points: float, source: str) -> tuple[str, int, int] | None:
    """(text, weight, polarity) of one expert criterion in the generator's item schema, or None where its words do
    not say what a response does (module docstring)."""
    if points == 0:
        return None
    low, high = ITEM_TEXT_CHARS
    if source == "writingbench":
        title = ascii_text(text.split(":", 1)[0]).lower()
        rest = shortened(f"shows {title}", high + 1)
        weight, polarity = WRITINGBENCH_WEIGHT, 1
    else:
        words = ascii_text(text)
        if words.lower().startswith(PREFIX.lower()):
            words = words[len(PREFIX) :]
        elif words.startswith("Response "):
            words = words[len("Response ") :]
        elif _NOT_ABOUT_THE_RESPONSE.match(words) or not _DOES.match(words):
            return None
        rest = shortened(words[:1].lower() + words[1:], high + 1)
        weight, polarity = min(5, max(1, round(abs(points) / 2))), 1 if points > 0 else -1
    # the schema: "The response ", one lowercase letter, then low..high more characters
    if not re.fullmatch(rf"[a-z][ !#-\[\]-~]{{{low},{high}}}", rest):
        return None
    return PREFIX + rest, weight, polarity


def expert_rubric(
    criteria: Sequence[tuple[str, float]], source: str, rng: random.Random, items: int = 4, pool: int = 8
) -> str | None:
    """The target: up to `items` of the `pool` heaviest criteria that make items (a seeded draw), heaviest first,
    as the generator's JSON answer; None when fewer than 2 make items."""
    made = [i for i in (expert_item(t, p, source) for t, p in criteria) if i is not None]
    unique = list({i[0]: i for i in made}.values())
    heaviest = sorted(unique, key=lambda i: -i[1])[:pool]
    if len(heaviest) < 2:
        return None
    chosen = sorted(rng.sample(heaviest, min(items, len(heaviest))), key=lambda i: -i[1])
    return json.dumps({"items": [{"text": t, "weight": w, "polarity": p} for t, w, p in chosen]})


@dataclass(frozen=True)
class ExpertPrompt:
    """A TRAIN-split open prompt of the bank with experts' criteria."""

    id: str
    source: str
    question: str
    references: tuple[str, ...]
    criteria: tuple[tuple[str, float], ...]


def expert_prompts(bank: Path) -> list[ExpertPrompt]:
    """The bank's single-turn TRAIN-split open prompts that carry experts' criteria (never dev or test)."""
    out = []
    for line in split_lines(bank.read_text()):
        obj = json.loads(line)
        if obj.get("split") != "train" or obj.get("kind") != "open" or not obj.get("criteria"):
            continue
        if len(obj["messages"]) != 1:
            continue
        out.append(
            ExpertPrompt(
                id=obj["id"],
                source=obj["source"],
                question=obj["messages"][0]["content"],
                references=tuple(obj.get("references", ())),
                criteria=tuple((c["text"], float(c["points"])) for c in obj["criteria"]),
            )
        )
    return out


@dataclass(frozen=True)
class WarmStartExample:
    prompt_id: str
    prompt: str  # the generator's rendered set-conditioned prompt
    target: str  # the rubric JSON it is taught to answer with


def warmstart_examples(
    prompts: Sequence[ExpertPrompt],
    answers: dict[str, list[str]],
    set_prompt: Callable[[str, Sequence[str]], str],
    k: int,
    variants: int,
    seed: int,
) -> list[WarmStartExample]:
    """`variants` examples per prompt (another draw of items and another order of the set each time): the set is
    the prompt's first reference (where there is one) and the policy's answers, `k` in all."""
    rng = random.Random(seed)
    out = []
    for p in prompts:
        for _ in range(variants):
            target = expert_rubric(p.criteria, p.source, rng)
            if target is None:
                continue
            shown = list(p.references[:1]) + answers[p.id][: k - len(p.references[:1])]
            rng.shuffle(shown)
            out.append(WarmStartExample(p.id, set_prompt(p.question, shown), target))
    return out


@dataclass(frozen=True)
class WarmStartStep:
    update: int
    epoch: int
    nll: float  # the batch's mean negative log-likelihood per target token, before the update
    tokens: int


def warm_start(
    model_dir: Path,
    examples: Sequence[WarmStartExample],
    out_dir: Path,
    *,
    lr: float,
    epochs: int,
    batch: int,
    micro_batch: int,
    seed: int,
    compute_dtype: str = "auto",
    log: Callable[[WarmStartStep], None] | None = None,
) -> list[WarmStartStep]:
    """Supervised fine-tuning of the generator at `model_dir` on `examples`; the result, a plain HF model dir any
    engine loads, goes to `out_dir`. Each update is one batch of `batch` examples (micro-batches of `micro_batch`),
    the examples reshuffled every epoch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dynrubric.config import GRPOConfig
    from dynrubric.train.grpo import (
        SampledResponse,
        autocast,
        micro_batches,
        micro_logprobs,
        save_policy,
        supervised_nll,
    )

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    end = tokenizer.eos_token or ""
    rows = [
        SampledResponse(
            tuple(tokenizer.encode(e.prompt, add_special_tokens=False)),
            tuple(tokenizer.encode(e.target + end, add_special_tokens=False)),
        )
        for e in examples
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    device = next(model.parameters()).device
    chunk_mib = GRPOConfig.model_fields["logprob_chunk_mib"].default
    rng = random.Random(seed)
    steps: list[WarmStartStep] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for epoch in range(epochs):
        order = list(range(len(rows)))
        rng.shuffle(order)
        for start in range(0, len(order), batch):
            chosen = [rows[i] for i in order[start : start + batch]]
            tokens = sum(len(r.response_ids) for r in chosen)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for m in micro_batches([(r, 0.0, 1.0) for r in chosen], pad, micro_batch):
                with autocast(compute_dtype, device):
                    logp = micro_logprobs(model, m, chunk_mib)
                loss = supervised_nll(logp, m.mask, tokens)
                loss.backward()
                total += float(loss.detach())
            optimizer.step()
            step = WarmStartStep(len(steps) + 1, epoch + 1, total, tokens)
            steps.append(step)
            if log is not None:
                log(step)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_policy(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    return steps
