"""The three-way split holds in the shipped bank, and breaks loudly when a base question or a held-out type moves.

dynrubric/train/splits.py: no base question in two splits, no held-out instruction type in a training prompt,
every held-out type reported on test; the trainer trains on no dev or test prompt, and the round's guard reads
dev only.
"""

from __future__ import annotations

import copy
import json

import pytest

from dynrubric.jsonl import split_lines
from dynrubric.rubric.groundtruth import derive
from dynrubric.train import splits
from dynrubric.train.prompts import make_prompt
from streaming.prompt_bank import default_path


@pytest.fixture(scope="module")
def bank() -> list[dict]:
    return [json.loads(line) for line in split_lines(default_path().read_text()) if line.strip()]


def test_the_shipped_bank_holds_the_split(bank: list[dict]) -> None:
    assert splits.violations(bank) == []
    assert len(splits.HELDOUT_TYPES) >= 5
    by_split = {s: [line for line in bank if line["split"] == s] for s in splits.SPLITS}
    assert all(by_split.values()), "every split has prompts"
    assert len({line["base"] for line in bank}) == len({(line["base"], line["split"]) for line in bank})


def test_moving_a_base_question_across_splits_is_caught(bank: list[dict]) -> None:
    moved = copy.deepcopy(bank)
    line = next(x for x in moved if x["split"] == "test" and x["kind"] == "instruction")
    line["split"] = "train"  # the same base question now in test and in train
    problems = splits.violations(moved)
    assert any(line["id"] in p and "belongs to 'test'" in p for p in problems), problems
    assert any("is in 'test' and 'train'" in p or "is in 'train' and 'test'" in p for p in problems), problems


def test_a_held_out_type_in_a_training_prompt_is_caught(bank: list[dict]) -> None:
    from dynrubric.rubric.instructions import Instruction

    changed = copy.deepcopy(bank)
    line = next(x for x in changed if x["split"] == "train" and x["kind"] == "instruction")
    held = Instruction(id="punctuation:no_comma")
    line["messages"][-1]["content"] += " " + held.describe()  # the text now asks for a held-out type
    problems = splits.violations(changed)
    assert any(line["id"] in p and "held-out type" in p for p in problems), problems


def test_a_held_out_type_missing_from_test_is_caught(bank: list[dict]) -> None:
    kept = [x for x in bank if not (x["split"] == "test" and "startend:end_checker" in str(x.get("instructions")))]
    assert "held-out type startend:end_checker has no test prompt" in splits.violations(kept)


def test_the_trainer_takes_no_dev_or_test_prompt_and_no_held_out_type(bank: list[dict]) -> None:
    split = splits.shipped_split()
    for line in bank:
        p = make_prompt([(m["role"], m["content"]) for m in line["messages"]])
        ids = [i.id for i in derive(p.question).instructions]
        assert splits.trainable(p.key, ids, split) == (line["split"] == "train"), line["id"]
    # a prompt of live traffic that is not in the bank: trained on, unless it asks for a held-out type
    free = make_prompt("Describe a kite.")
    assert splits.trainable(free.key, [], split)
    assert not splits.trainable(free.key, ["startend:end_checker"], split)


def test_the_guard_reads_dev_and_the_reported_figures_read_test() -> None:
    from dynrubric.config import Settings
    from dynrubric.train.policy_eval import bank_suite

    settings = Settings.model_validate({"evaluation": {"max_prompts": 10**6, "report_prompts": 10**6}})
    split = splits.shipped_split()
    dev = bank_suite(settings, "dev")
    assert dev and {split.split(p.prompt.key) for p in dev} == {"dev"}
    for suite, unseen in (("test_seen", False), ("test_unseen", True)):
        prompts = bank_suite(settings, suite)
        assert prompts and {split.split(p.prompt.key) for p in prompts} == {"test"}, suite
        assert {split.by_key[p.prompt.key].unseen for p in prompts} == {unseen}, suite


def test_no_reported_figure_can_reject_a_round() -> None:
    """The guard decides on dev: a candidate far worse on every test figure, equal on dev, is accepted."""
    from dynrubric.config import TrainConfig
    from dynrubric.train.records import Comparison, Figure
    from dynrubric.train.rounds import check_guards
    from tests.run_records import evaluation, truth

    worse = Comparison(version="r1", reference="base", prompts=100, delta=-0.5, low=-0.6, high=-0.4)
    evidence = truth().model_copy(
        update={
            "figures": {
                name: Figure(prompts=100, score={"r1": 0.0, "base": 0.5}, vs_parent=worse, vs_base=worse)
                for name in ("test_seen", "test_unseen", "ifeval", "ifbench", "open")
            }
        }
    )
    verdict = check_guards(TrainConfig(), evaluation(groundtruth=evidence), [], truth_guard=True)
    assert verdict.accepted, verdict
    dev_worse = evidence.model_copy(update={"vs_parent": worse})
    assert not check_guards(TrainConfig(), evaluation(groundtruth=dev_worse), [], truth_guard=True).accepted
