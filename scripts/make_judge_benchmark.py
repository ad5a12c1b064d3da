"""Writes the judge benchmark (dynrubric/data/judge_benchmark.jsonl): candidate sets with a known order.

Ground truth is programmatic, never a model's opinion:
- arithmetic word problems: worked correct > answer only > one planted slip > wrong method > off topic
  > empty (the slip and the method are computed, so their final numbers are wrong by construction);
- instructions with 5 checkable constraints: six responses meeting 5, 4, ..., 0 of them (which ones
  are broken is drawn at random; each is broken by an edit whose effect a test re-checks);
- factual questions: correct with a reason > correct alone > near miss > clearly wrong > off topic > empty.
Equal-quality sets (`"collapsed": true`) hold six answers of one quality level (paraphrases of a correct
worked solution, six responses meeting all constraints, six phrasings of the right fact): a judge that
separates them is splitting noise, and the collapse detector should fire on them.

Usage: python scripts/make_judge_benchmark.py [--out PATH] [--seed N]   (deterministic for a seed)
"""

from __future__ import annotations

import argparse
import json
import random
from functools import partial
from pathlib import Path

OFF_TOPIC = [
    "Gardening is a relaxing hobby, and tomatoes grow best in full sun with regular watering.",
    "The history of the bicycle goes back to the early nineteenth century in Europe.",
    "My favourite season is autumn because the leaves change colour and the air is crisp.",
    "Jazz music started in New Orleans and mixes blues, ragtime and brass band traditions.",
]

# ---------------------------------------------------------------- arithmetic word problems
# each: (question template, correct steps, slip step index, wrong-method steps); numbers filled at random
ARITHMETIC = [
    (
        "A baker makes {a} trays of {b} cookies and sells {c} cookies. How many cookies are left?",
        lambda a, b, c: [(f"{a} x {b}", a * b), (f"{a * b} - {c}", a * b - c)],
        lambda a, b, c: [(f"{a} + {b}", a + b), (f"{a + b} - {c}", a + b - c)],
    ),
    (
        "Sam has {a} marbles and buys {b} bags with {c} marbles in each. How many marbles does Sam have now?",
        lambda a, b, c: [(f"{b} x {c}", b * c), (f"{a} + {b * c}", a + b * c)],
        lambda a, b, c: [(f"{a} + {b} + {c}", a + b + c)],
    ),
    (
        "A train travels at {a} km per hour for {b} hours and then {c} km more. How far does it travel in total?",
        lambda a, b, c: [(f"{a} x {b}", a * b), (f"{a * b} + {c}", a * b + c)],
        lambda a, b, c: [(f"{a} + {b}", a + b), (f"{a + b} + {c}", a + b + c)],
    ),
    (
        "A shop has {a} boxes of {b} pens. It gives away {c} pens. How many pens does it keep?",
        lambda a, b, c: [(f"{a} x {b}", a * b), (f"{a * b} - {c}", a * b - c)],
        lambda a, b, c: [(f"{a} x {b} x {c}", a * b * c)],
    ),
    (
        "Mia reads {a} pages a day for {b} days, then {c} pages on the last day. How many pages does she read?",
        lambda a, b, c: [(f"{a} x {b}", a * b), (f"{a * b} + {c}", a * b + c)],
        lambda a, b, c: [(f"{a} + {b} + {c}", a + b + c)],
    ),
    (
        "A farmer has {a} rows of {b} apple trees. {c} trees are cut down. How many trees remain?",
        lambda a, b, c: [(f"{a} x {b}", a * b), (f"{a * b} - {c}", a * b - c)],
        lambda a, b, c: [(f"{a} + {b}", a + b), (f"{a + b} - {c}", a + b - c)],
    ),
]


def _worked(steps: list[tuple[str, int]], answer: int, style: int) -> str:
    lines = [f"{expr} = {val}" for expr, val in steps]
    if style == 0:
        return "First, " + ". Then ".join(lines) + f". The answer is {answer}."
    if style == 1:
        return "Step by step: " + "; ".join(lines) + f". So the total is {answer}."
    if style == 2:
        return "We compute " + ", and then ".join(lines) + f". Final answer: {answer}."
    if style == 3:
        return "Working: " + " and ".join(lines) + f". Therefore the result is {answer}."
    if style == 4:
        return "Let us solve it. " + ". Next, ".join(lines) + f". That gives {answer}."
    return "Calculation: " + ", ".join(lines) + f". Answer: {answer}."


def arithmetic_sets(rng: random.Random, n_ordered: int, n_equal: int) -> list[dict]:
    out = []
    for n in range(n_ordered + n_equal):
        template, correct, wrong = ARITHMETIC[n % len(ARITHMETIC)]
        while True:
            a, b, c = rng.randint(3, 12), rng.randint(4, 15), rng.randint(2, 20)
            steps = correct(a, b, c)
            answer = steps[-1][1]
            bad = wrong(a, b, c)
            slip = rng.choice([1, -1, 10, -10, 2])
            slipped = [(steps[0][0], steps[0][1] + slip)] + [
                (e.replace(str(steps[0][1]), str(steps[0][1] + slip)), v + slip) for e, v in steps[1:]
            ]
            finals = {answer, bad[-1][1], slipped[-1][1]}
            if len(finals) == 3 and answer > 0:
                break
        question = template.format(a=a, b=b, c=c)
        if n < n_ordered:
            responses = [
                _worked(steps, answer, rng.randrange(6)),
                str(answer),
                _worked(slipped, slipped[-1][1], rng.randrange(6)),
                _worked(bad, bad[-1][1], rng.randrange(6)),
                rng.choice(OFF_TOPIC),
                "",
            ]
            out.append(_ordered(question, responses, "arithmetic", rng))
        else:
            responses = [_worked(steps, answer, s) for s in range(6)]
            out.append({"prompt": question, "responses": responses, "collapsed": True, "kind": "arithmetic"})
    return out


# ---------------------------------------------------------------- instructions with 5 checkable constraints
TOPICS = [
    ("the ocean", ["waves", "salt", "tide", "coral", "deep"]),
    ("a city at night", ["lights", "streets", "quiet", "neon", "traffic"]),
    ("learning to cook", ["recipe", "kitchen", "taste", "practice", "heat"]),
    ("a mountain hike", ["trail", "summit", "boots", "view", "climb"]),
    ("winter mornings", ["frost", "coffee", "cold", "snow", "sunrise"]),
    ("a public library", ["books", "silence", "reading", "shelves", "cards"]),
    ("the moon", ["craters", "orbit", "tides", "light", "phases"]),
    ("a busy market", ["stalls", "fruit", "voices", "prices", "crowds"]),
]
FILLER = ["it", "feels", "calm", "and", "bright", "with", "many", "small", "details", "to", "notice", "every", "day"]


def _sentence_words(rng: random.Random, topic_words: list[str], n: int) -> list[str]:
    words: list[str] = []
    while len(words) < n:
        words.append(rng.choice(topic_words + FILLER))
    return words


def _instruction_response(
    rng: random.Random,
    words: list[str],
    required: str,
    forbidden: str,
    end_word: str,
    limit: int,
    fifth: str,
    broken: set[str],
) -> str:
    """A response to an instruction question meeting every constraint except those in `broken`."""
    pool = [w for w in words if w not in (required, forbidden, end_word)]
    body = _sentence_words(rng, pool, rng.randint(8, 14))
    if "required" not in broken:
        body.insert(rng.randrange(len(body)), required)
    if "forbidden" in broken:
        body.insert(rng.randrange(len(body)), forbidden)
    if "limit" in broken:
        body += _sentence_words(rng, pool, limit + 5 - len(body))
    text = " ".join(body)
    if "end" not in broken:
        text += f" {end_word}"
    if fifth == "no_commas" and "no_commas" in broken:
        parts = text.split(" ")
        parts[2] += ","
        parts[len(parts) // 2] += ","
        text = " ".join(parts)
    text = text[0].upper() + text[1:] + "."
    if fifth == "lowercase" and "lowercase" not in broken:
        text = text.lower()
    return text


def instruction_sets(rng: random.Random, n_ordered: int, n_equal: int) -> list[dict]:
    """Constraints: word limit, required word, forbidden word, end word, and no commas or lower case."""
    out = []
    for n in range(n_ordered + n_equal):
        topic, words = TOPICS[n % len(TOPICS)]
        required, forbidden, end_word = rng.sample(words, 3)
        limit = rng.choice([25, 30, 40])
        fifth = rng.choice(["no_commas", "lowercase"])
        phrasing = n % 3
        fifth_text = "Do not use any commas." if fifth == "no_commas" else "Write everything in lowercase letters."
        if phrasing == 0:
            question = (
                f'Write a short description of {topic} in at most {limit} words. Include the word "{required}". '
                f'Do not use the word "{forbidden}". End your response with the word "{end_word}". {fifth_text}'
            )
        elif phrasing == 1:
            question = (
                f"Describe {topic}. Use no more than {limit} words, mention the word '{required}', avoid the word "
                f"'{forbidden}', and finish your answer with the word '{end_word}'. {fifth_text}"
            )
        else:
            question = (
                f"In under {limit + 1} words, tell me about {topic}. You must include the word {required}, never "
                f"use the word {forbidden}, and end with the word {end_word}. {fifth_text}"
            )
        constraints = ["limit", "required", "forbidden", "end", fifth]

        respond = partial(_instruction_response, rng, words, required, forbidden, end_word, limit, fifth)

        if n < n_ordered:
            order = rng.sample(constraints, 5)
            responses = [respond(set(order[: 5 - met])) for met in range(5, -1, -1)]
            out.append(_ordered(question, responses, "instruction", rng))
        else:
            responses = [respond(set()) for _ in range(6)]
            out.append({"prompt": question, "responses": responses, "collapsed": True, "kind": "instruction"})
    return out


# ---------------------------------------------------------------- factual questions with graded wrong answers
# (question, correct, reason, near miss, clearly wrong)
FACTS = [
    (
        "What is the capital of Australia?",
        "Canberra",
        "It was purpose-built as the seat of government.",
        "Sydney",
        "Nairobi",
    ),
    ("How many legs does a spider have?", "8", "All arachnids have four pairs of legs.", "6", "100"),
    ("What is the chemical symbol for gold?", "Au", "It comes from the Latin word aurum.", "Ag", "Fe"),
    ("In what year did the Second World War end?", "1945", "Germany and Japan surrendered that year.", "1944", "1812"),
    ("What planet is closest to the Sun?", "Mercury", "It orbits the Sun in about 88 days.", "Venus", "Neptune"),
    ("How many continents are there on Earth?", "7", "The usual count lists seven landmasses.", "6", "12"),
    (
        "Who wrote the play Romeo and Juliet?",
        "William Shakespeare",
        "He wrote it in the 1590s.",
        "Christopher Marlowe",
        "Charles Dickens",
    ),
    (
        "At what temperature in Celsius does water boil at sea level?",
        "100",
        "That is the boiling point at standard pressure.",
        "90",
        "0",
    ),
    (
        "What is the largest ocean on Earth?",
        "the Pacific Ocean",
        "It covers about a third of the planet's surface.",
        "the Atlantic Ocean",
        "the Caspian Sea",
    ),
    ("How many sides does a hexagon have?", "6", "The prefix hexa means six.", "8", "3"),
    (
        "What gas do plants absorb from the air for photosynthesis?",
        "carbon dioxide",
        "They use it with water and light to make sugar.",
        "oxygen",
        "helium",
    ),
    ("How many minutes are in an hour?", "60", "An hour is divided into sixty minutes.", "100", "12"),
]


def factual_sets(rng: random.Random, n_ordered: int, n_equal: int) -> list[dict]:
    out = []
    for n in range(n_ordered + n_equal):
        question, correct, reason, near, wrong = FACTS[n % len(FACTS)]
        if n < n_ordered:
            responses = [
                f"The answer is {correct}. {reason}",
                f"{correct}.",
                f"The answer is {near}.",
                f"The answer is {wrong}.",
                rng.choice(OFF_TOPIC),
                "",
            ]
            out.append(_ordered(question, responses, "factual", rng))
        else:
            responses = [
                f"The answer is {correct}.",
                f"{correct}.",
                f"It is {correct}.",
                f"The correct answer is {correct}.",
                f"{correct}, as far as I know.",
                f"I would say {correct}.",
            ]
            out.append({"prompt": question, "responses": responses, "collapsed": True, "kind": "factual"})
    return out


def _ordered(question: str, best_to_worst: list[str], kind: str, rng: random.Random) -> dict:
    """A set with responses shuffled and `order` listing their indices best..worst."""
    shuffled = list(range(len(best_to_worst)))
    rng.shuffle(shuffled)
    responses = [best_to_worst[i] for i in shuffled]
    order = sorted(range(len(responses)), key=lambda j: shuffled[j])
    return {"prompt": question, "responses": responses, "order": order, "kind": kind}


def build(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return arithmetic_sets(rng, 22, 8) + instruction_sets(rng, 22, 8) + factual_sets(rng, 22, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "dynrubric/data/judge_benchmark.jsonl"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sets = build(args.seed)
    args.out.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in sets))
    ordered = sum("order" in s for s in sets)
    print(f"wrote {len(sets)} sets ({ordered} ordered, {len(sets) - ordered} equal-quality) to {args.out}")


if __name__ == "__main__":
    main()
