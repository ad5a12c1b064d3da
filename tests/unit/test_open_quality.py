"""open_quality: the word-overlap closeness of an open answer to strong answers, which no reward reads."""

from __future__ import annotations

import random

import pytest

from dynrubric.rubric.open_quality import REFERENCE_WORDS, content_words, f1, open_quality

PROMPT = "My car battery keeps dying overnight. What could be draining it and how do I find out?"
REFERENCE = (
    "A battery that dies overnight usually points to a parasitic drain: something keeps drawing current after "
    "the ignition is off. Common culprits are a glovebox or trunk light that stays on, an aftermarket stereo or "
    "alarm, a stuck relay, or a failing alternator diode. To find it, disconnect the negative terminal, put a "
    "multimeter in series and pull fuses one at a time until the current drops."
)
OTHER = "Fresh basil, ripe tomatoes and mozzarella make a classic summer salad; drizzle olive oil and serve cold."


def q(response: str, references=(REFERENCE,), criteria=()) -> float:
    return open_quality(PROMPT, response, list(references), list(criteria))


def test_an_empty_answer_scores_zero():
    assert q("") == 0.0 and q("   \n") == 0.0


def test_echoing_the_prompt_earns_nothing():
    assert q(PROMPT) == 0.0
    assert q(f"{PROMPT} {PROMPT.lower()}?") == 0.0
    assert q("Good question! " + PROMPT) < 0.05  # filler around an echo is still nearly nothing


def test_an_answer_copied_from_a_reference_scores_high():
    first = " ".join(REFERENCE.split()[:REFERENCE_WORDS])
    assert q(first) == pytest.approx(1.0)
    assert q(REFERENCE) > 0.6  # the whole reference: everything past the cut dilutes precision


def test_an_off_topic_answer_scores_low():
    assert q(OTHER) < 0.05
    assert q(OTHER) < q("A parasitic drain such as a stuck relay or a trunk light can empty the battery.")


def test_more_of_the_reference_never_scores_less():
    words = [w for w in REFERENCE.split()[:REFERENCE_WORDS]]
    scores = [q(" ".join(words[:n])) for n in range(4, REFERENCE_WORDS + 1, 4)]
    assert scores == sorted(scores) and scores[-1] > scores[0]
    # replacing reference words with off-topic ones only lowers it
    assert q(" ".join(words[:20]) + " " + OTHER) < q(" ".join(words[:20]))


def test_the_best_reference_counts():
    assert q(REFERENCE, references=[OTHER, REFERENCE]) == q(REFERENCE, references=[REFERENCE])
    assert q(OTHER, references=[OTHER, REFERENCE]) > 0.5


def test_references_are_cut_to_max_words():
    late = " ".join(REFERENCE.split()[45:])
    assert open_quality(PROMPT, late, [REFERENCE], [], max_words=40) < 0.2
    assert open_quality(PROMPT, late, [REFERENCE], [], max_words=200) > 0.4
    with pytest.raises(ValueError):
        open_quality(PROMPT, late, [REFERENCE], [], max_words=0)


def test_without_a_reference_the_positive_criteria_are_the_target():
    criteria = [
        ("Correctly states that a parasitic drain such as a stuck relay or interior light is likely.", 8),
        ("Recommends testing with a multimeter and pulling fuses to isolate the circuit.", 5),
        ("Tells the user to buy a new car immediately.", -9),
    ]
    good = "Likely a parasitic drain: a stuck relay or interior light. Test with a multimeter, pulling fuses."
    assert q(good, references=[], criteria=criteria) > 0.4
    assert q(OTHER, references=[], criteria=criteria) < 0.05
    assert q("Buy a new car immediately.", references=[], criteria=criteria) == 0.0  # a bad criterion earns nothing
    assert q(good, references=[], criteria=[]) == 0.0  # nothing to compare with


def test_in_range_and_deterministic():
    rng = random.Random(0)
    vocab = (REFERENCE + " " + OTHER + " " + PROMPT).split()
    for _ in range(200):
        answer = " ".join(rng.choices(vocab, k=rng.randint(0, 40)))
        s = q(answer)
        assert 0.0 <= s <= 1.0 and s == q(answer)


def test_content_words_and_f1():
    assert content_words("The batteries, the BATTERY and it's a 12 V one!") == {"battery", "12"}
    assert f1({"a", "b"}, {"a", "b"}) == 1.0 and f1(set(), {"a"}) == 0.0 and f1({"a", "b"}, {"b", "c"}) == 0.5
