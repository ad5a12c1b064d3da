"""Writes the simulated users' prompt bank (dynrubric/data/prompts.jsonl): checkable prompts, ground truth known.

Two kinds, each line carrying the ground truth its text states (`dynrubric.rubric.groundtruth.derive`
reads back exactly that from the text; the bank's loader checks it):
- instruction: a base question followed by one or two official IFEval instructions, their text written by
  the official `build_description` (PyPI `if-verifiable`) with arguments drawn here, from the instructions
  whose checker needs no downloaded data and that a short answer (the demo serves 48 tokens) can meet;
- arithmetic: "What is A op B? Answer with the number only.", the answer computed;
- open: real user questions no checker grades (Arena-Hard v2.0, WritingBench in English, HealthBench), with the
  strong models' answers and the experts' criteria they are measured against (scripts/open_prompts.py).

Every line carries its `base` question and its `split` (train, dev or test: `dynrubric.train.splits.split_of`
of the base, so no base question is in two splits). The held-out instruction types (`splits.HELDOUT_TYPES`) are
written only onto dev and test base questions, half of whose instruction prompts carry one (the unseen types
that test reports apart); training prompts carry only the other types.

Usage: python scripts/make_prompt_bank.py [--out PATH] [--seed N] [--instruction N] [--arithmetic N]
(deterministic for a seed)
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynrubric.train.splits import HELDOUT_TYPES, split_of

BASE_QUESTIONS = [
    "Describe a sunset over the sea.",
    "Explain why the sky is blue.",
    "Write a short note inviting a friend to lunch.",
    "Give advice to someone who wants to start running.",
    "Describe your ideal weekend.",
    "Explain how a bicycle works.",
    "Write a product description for a reusable water bottle.",
    "Tell me about the moon.",
    "Describe a busy market.",
    "Explain what a library is for.",
    "Write a thank-you message to a teacher.",
    "Describe the taste of an apple.",
    "Explain how plants grow.",
    "Give tips for a job interview.",
    "Describe a rainy day in a city.",
    "Explain why people need sleep.",
    "Write a short story about a lost cat.",
    "Describe a mountain village.",
    "Explain how to make a cup of tea.",
    "Give reasons to learn a second language.",
    "Describe a winter morning.",
    "Explain what money is.",
    "Write an announcement for a school picnic.",
    "Describe a train journey.",
    "Explain how bees make honey.",
    "Give advice for saving money.",
    "Describe an old lighthouse.",
    "Explain why exercise is healthy.",
    "Write a review of a small cafe.",
    "Describe a garden in spring.",
    "Explain how a compass works.",
    "Give tips for studying for an exam.",
    "Describe a birthday party.",
    "Explain what clouds are made of.",
    "Write a short poem about the ocean.",
    "Describe a quiet forest.",
    "Explain how to plant a tree.",
    "Give advice for a first day at a new job.",
    "Describe a city at night.",
    "Explain why recycling matters.",
    "Write a message welcoming new neighbours.",
    "Describe a summer festival.",
    "Explain how rain forms.",
    "Give tips for keeping a houseplant alive.",
    "Describe a visit to a museum.",
    "Explain what a volcano is.",
    "Write a short speech for a friend's wedding.",
    "Describe the smell of fresh bread.",
    "Explain how the heart works.",
    "Give advice for a long flight.",
    "Describe a snowy mountain.",
    "Explain why the seasons change.",
    "Write a postcard from a beach holiday.",
    "Describe a football match.",
    "Explain how a refrigerator keeps food cold.",
    "Give tips for cooking rice.",
    "Describe a desert at noon.",
    "Explain what gravity does.",
    "Write a note apologising for being late.",
    "Describe a farmers market.",
    "Explain how a rainbow appears.",
    "Give advice for learning to swim.",
    "Describe a small fishing boat.",
    "Explain why we have time zones.",
    "Write a short ad for a bakery.",
    "Describe a walk along a river.",
    "Explain how vaccines help the body.",
    "Give tips for a good night's sleep.",
    "Describe a crowded subway car.",
    "Explain what a budget is.",
    "Write a welcome message for a new club member.",
    "Describe autumn leaves.",
    "Explain how a battery stores energy.",
    "Give advice for moving to a new city.",
    "Describe a thunderstorm.",
    "Explain why the ocean is salty.",
    "Write a short letter to a pen pal.",
    "Describe your favourite meal.",
    "Explain how airplanes stay in the air.",
    "Give tips for writing a clear email.",
    "Describe a quiet library.",
    "Explain what photosynthesis is.",
    "Write a short story about a brave mouse.",
    "Describe a campfire at night.",
    "Explain how a camera takes a picture.",
    "Give advice for a road trip.",
    "Describe a hot summer afternoon.",
    "Explain why bread rises.",
    "Write an invitation to a board game night.",
    "Describe a harbour at dawn.",
    "Explain what an election is.",
    "Give tips for staying focused at work.",
    "Describe a snowman.",
    "Explain how wind turbines make electricity.",
    "Write a short review of a favourite book.",
    "Describe the first day of school.",
    "Explain why we should drink water.",
    "Give advice for a picnic.",
    "Describe a zoo on a busy day.",
    "Explain how a clock keeps time.",
    "Write a motivational note for a friend.",
    "Describe a cup of hot chocolate.",
    "Explain what friendship means.",
    "Give tips for learning to draw.",
]

# instruction id -> its arguments, drawn so that a short answer can meet it (None: no arguments)
KEYWORD_POOL = [
    "light",
    "water",
    "friend",
    "morning",
    "simple",
    "green",
    "home",
    "story",
    "happy",
    "quiet",
    "bright",
    "small",
    "warm",
    "fresh",
    "road",
    "music",
    "garden",
    "market",
    "smile",
    "window",
]


def _two(rng: random.Random) -> list[str]:
    return rng.sample(KEYWORD_POOL, 2)


ARGUMENTS = {
    "change_case:english_lowercase": lambda r: {},
    "change_case:english_capital": lambda r: {},
    "punctuation:no_comma": lambda r: {},
    "startend:quotation": lambda r: {},
    "detectable_format:title": lambda r: {},
    "keywords:existence": lambda r: {"keywords": _two(r)},
    "keywords:forbidden_words": lambda r: {"forbidden_words": _two(r)},
    "keywords:frequency": lambda r: {
        "keyword": r.choice(KEYWORD_POOL),
        "frequency": r.choice([2, 3]),
        "relation": "at least",
    },
    "keywords:letter_frequency": lambda r: {
        "letter": r.choice("bcdfgkmpw"),
        "let_frequency": r.choice([2, 3]),
        "let_relation": "at least",
    },
    "length_constraints:number_words": lambda r: r.choice(
        [
            {"num_words": r.choice([10, 15, 20, 25, 30]), "relation": "less than"},
            {"num_words": r.choice([5, 8, 10, 15]), "relation": "at least"},
        ]
    ),
    "startend:end_checker": lambda r: {
        "end_phrase": r.choice(
            ["Any other questions?", "Is there anything else I can help with?", "That is all.", "Hope this helps."]
        )
    },
    "detectable_content:postscript": lambda r: {"postscript_marker": r.choice(["P.S.", "P.P.S"])},
    "detectable_format:number_highlighted_sections": lambda r: {"num_highlights": r.choice([1, 2])},
    "detectable_format:constrained_response": lambda r: {},
    "detectable_content:number_placeholders": lambda r: {"num_placeholders": r.choice([1, 2])},
    "detectable_format:number_bullet_lists": lambda r: {"num_bullets": r.choice([2, 3])},
    "detectable_format:json_format": lambda r: {},
    "combination:two_responses": lambda r: {},
    "length_constraints:number_paragraphs": lambda r: {"num_paragraphs": 2},
    "detectable_format:multiple_sections": lambda r: {
        "section_spliter": r.choice(["Section", "SECTION"]),
        "num_sections": 2,
    },
    "combination:repeat_prompt": None,  # its argument is the request itself
}
# pairs that cannot both hold, or that make one answer too long for the demo's 48 tokens
CONFLICTS = {
    frozenset({"change_case:english_lowercase", "change_case:english_capital"}),
    frozenset({"detectable_format:json_format", "startend:quotation"}),
    frozenset({"detectable_format:constrained_response", "combination:two_responses"}),
}
NO_SECOND = {
    "detectable_format:constrained_response",
    "combination:repeat_prompt",
    "combination:two_responses",
    "detectable_format:json_format",
    "detectable_format:multiple_sections",
    "length_constraints:number_paragraphs",
}

OPS = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]


def instruction_prompt(rng: random.Random, first: str, base: str, second: bool, allowed: Sequence[str]) -> dict:
    """`base` with the instruction `first` and, when `second`, one more of `allowed`."""
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    ids = [first]
    if second and first not in NO_SECOND:
        others = [i for i in allowed if i not in NO_SECOND and i != first and frozenset({first, i}) not in CONFLICTS]
        ids.append(rng.choice(others))
    parts, instructions = [base], []
    for iid in ids:
        checker = INSTRUCTION_DICT[iid](iid)
        draw = ARGUMENTS[iid]
        if draw is None:
            continue  # repeat_prompt: added last, once the request is complete
        parts.append(checker.build_description(**draw(rng)))
        instructions.append({"id": iid, "kwargs": checker.get_instruction_args() or {}})
    if "combination:repeat_prompt" in ids:
        request = " ".join(parts)
        checker = INSTRUCTION_DICT["combination:repeat_prompt"]("combination:repeat_prompt")
        parts.append(checker.build_description(prompt_to_repeat=request))
        instructions.append({"id": "combination:repeat_prompt", "kwargs": {"prompt_to_repeat": request}})
    return {
        "kind": "instruction",
        "messages": [{"role": "user", "content": " ".join(parts)}],
        "instructions": instructions,
        "base": base,
        "split": split_of(base),
    }


def arithmetic_prompt(rng: random.Random) -> dict:
    sym, fn = rng.choice(OPS)
    a, b = (rng.randint(2, 12), rng.randint(2, 12)) if sym == "*" else (rng.randint(10, 99), rng.randint(2, 60))
    base = f"{a} {sym} {b}"
    return {
        "kind": "arithmetic",
        "messages": [{"role": "user", "content": f"What is {base}? Answer with the number only."}],
        "answer": float(fn(a, b)),
        "base": base,
        "split": split_of(base),
    }


def build(seed: int, n_instruction: int, n_arithmetic: int) -> list[dict]:
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    seen_ids = [i for i in ARGUMENTS if i not in HELDOUT_TYPES]
    unseen_ids = [i for i in ARGUMENTS if i in HELDOUT_TYPES]
    counts = {"train": 0, "held": 0}
    while len(items) < n_instruction:
        base = rng.choice(BASE_QUESTIONS)
        if split_of(base) == "train":  # seen types only, cycled so that each is trained on
            first, allowed = seen_ids[counts["train"] % len(seen_ids)], seen_ids
        else:  # dev and test: half their prompts lead with a held-out type
            pool = unseen_ids if rng.random() < 0.5 else seen_ids
            first, allowed = rng.choice(pool), list(ARGUMENTS)
        item = instruction_prompt(rng, first, base, rng.random() < 0.25, allowed)
        text = item["messages"][0]["content"]
        if text not in seen:
            seen.add(text)
            items.append(item)
            counts["train" if item["split"] == "train" else "held"] += 1
    arithmetic: list[dict[str, Any]] = []
    while len(arithmetic) < n_arithmetic:
        item = arithmetic_prompt(rng)
        if item["messages"][0]["content"] not in seen:
            seen.add(item["messages"][0]["content"])
            arithmetic.append(item)
    out = []
    for n, item in enumerate(items, 1):
        out.append({"id": f"instr-{n:04d}", **item})
    for n, item in enumerate(arithmetic, 1):
        out.append({"id": f"arith-{n:04d}", **item})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "dynrubric/data/prompts.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instruction", type=int, default=1000)
    ap.add_argument("--arithmetic", type=int, default=200)
    ap.add_argument(
        "--open-max-chars",
        type=int,
        default=1500,
        help="open prompts up to this many characters (most then fit train.max_prompt_tokens, 512)",
    )
    args = ap.parse_args()
    from open_prompts import build_open  # scripts/open_prompts.py, beside this script

    prompts = build(args.seed, args.instruction, args.arithmetic) + build_open(args.open_max_chars)
    lines = [json.dumps(p) for p in prompts]  # ASCII: no raw U+2028 for str.splitlines to cut a line at
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {args.out}")


if __name__ == "__main__":
    main()
