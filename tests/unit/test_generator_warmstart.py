"""The generator's warm start on experts' rubric items (dynrubric/train/generator_warmstart.py)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dynrubric.rubric.generate import rubric_schema
from dynrubric.rubric.items import parse_rubric
from dynrubric.train.generator_warmstart import (
    WarmStartExample,
    expert_item,
    expert_prompts,
    expert_rubric,
    warm_start,
    warmstart_examples,
)
from dynrubric.train.grpo import supervised_nll
from dynrubric.train.policy_eval import default_prompts_file
from dynrubric.train.splits import shipped_split

ITEM_SCHEMA: Any = rubric_schema()["properties"]
ITEM_TEXT = re.compile(ITEM_SCHEMA["items"]["items"]["properties"]["text"]["pattern"])


def test_a_physician_criterion_becomes_an_item_about_the_response_with_its_weight_and_sign() -> None:
    text = "Recommends immediately calling for help and dialing emergency services if the person is unresponsive."
    assert expert_item(text, 10, "healthbench") == (
        "The response recommends immediately calling for help and dialing emergency services",
        5,
        1,
    )
    assert expert_item("Fails to recommend contacting a primary care provider.", -9, "healthbench") == (
        "The response fails to recommend contacting a primary care provider",
        4,
        -1,
    )
    assert expert_item("Clearly explains the risks (Justification: the user asked).", 2, "healthbench") == (
        "The response clearly explains the risks",
        1,
        1,
    )


@pytest.mark.parametrize(
    "text",
    [
        "Step 1: Does the response give a dose? Step 2: ...",
        "Should not suggest waiting for the ambulance.",
        "Judge whether the response is in English.",
        "A response that lists the side effects.",
    ],
)
def test_a_criterion_that_does_not_say_what_a_response_does_is_left_out(text: str) -> None:
    assert expert_item(text, 5, "healthbench") is None


def test_a_writing_checklist_entry_becomes_its_title() -> None:
    text = "Methodological Rigor: Evaluates the outline's treatment of research methodology, and more."
    assert expert_item(text, 1, "writingbench") == ("The response shows methodological rigor", 3, 1)


def test_every_item_made_from_the_shipped_criteria_fits_the_generator_schema_and_parses() -> None:
    prompts = expert_prompts(default_prompts_file())
    rng = random.Random(0)
    made = 0
    for p in prompts:
        for text, points in p.criteria:
            item = expert_item(text, points, p.source)
            if item is not None:
                made += 1
                assert ITEM_TEXT.fullmatch(item[0]), item
                assert not item[0].endswith((" and", " or", " the", " to", ",")), item
        target = expert_rubric(p.criteria, p.source, rng)
        if target is not None:
            rubric = parse_rubric(target, 12, [], True)
            assert 2 <= len(rubric.items) <= 4
            assert [i.weight for i in rubric.items] == sorted((i.weight for i in rubric.items), reverse=True)
    assert made > 1000  # most physicians' criteria say what a response does


def test_only_train_split_prompts_are_read(tmp_path: Path) -> None:
    """The dev and test prompts' criteria grade the open-quality figure: a warm start never reads them."""
    prompts = expert_prompts(default_prompts_file())
    split = shipped_split()
    ids = {e.id: e.split for e in split.by_key.values()}
    assert prompts and {ids[p.id] for p in prompts} == {"train"}
    bank = tmp_path / "bank.jsonl"
    line = {
        "id": "h1",
        "kind": "open",
        "source": "healthbench",
        "messages": [{"role": "user", "content": "q"}],
        "criteria": [{"text": "Advises rest.", "points": 5}, {"text": "Advises water.", "points": 3}],
    }
    lines = [line | {"split": "dev"}, line | {"split": "train", "id": "h2"}]
    bank.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [p.id for p in expert_prompts(bank)] == ["h2"]


def test_an_example_shows_the_reference_among_the_policys_answers() -> None:
    prompts = [p for p in expert_prompts(default_prompts_file()) if p.references][:3]
    answers = {p.id: [f"policy {i}" for i in range(4)] for p in prompts}
    seen: list[list[str]] = []

    def set_prompt(question: str, responses: list[str]) -> str:
        seen.append(list(responses))
        return question

    examples = warmstart_examples(prompts, answers, set_prompt, 4, 2, seed=0)
    assert len(examples) == 6
    for p, shown in zip([p for p in prompts for _ in range(2)], seen, strict=True):
        assert len(shown) == 4 and p.references[0] in shown and "policy 3" not in shown


def test_the_loss_is_the_mean_negative_log_likelihood_of_the_target_tokens() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.4]]))
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    expected = -(torch.log(torch.tensor(0.25)) + torch.log(torch.tensor(0.9)) + torch.log(torch.tensor(0.1))) / 3
    assert torch.isclose(supervised_nll(logp, mask, 3), expected)
    # two micro-batches over the batch's token count add up to the batch's mean
    halves = supervised_nll(logp[:1], mask[:1], 3) + supervised_nll(logp[1:], mask[1:], 3)
    assert torch.isclose(halves, expected)


def test_a_warm_start_makes_the_experts_rubric_more_likely(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dynrubric.train.grpo import SampledResponse, micro_batches, micro_logprobs

    target = json.dumps({"items": [{"text": "The response states the answer", "weight": 3, "polarity": 1}]})
    examples = [WarmStartExample("p", "<|im_start|>user\nWrite a rubric.<|im_end|>\n<|im_start|>assistant\n", target)]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = SampledResponse(
        tuple(tok.encode(examples[0].prompt, add_special_tokens=False)),
        tuple(tok.encode(target + tok.eos_token, add_special_tokens=False)),
    )
    (micro,) = micro_batches([(row, 0.0, 1.0)], tok.pad_token_id, 1)

    def nll(model_dir: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return float(supervised_nll(micro_logprobs(model, micro, 64), micro.mask, int(micro.mask.sum())))

    steps = warm_start(
        tiny_model_dir,
        examples * 4,
        tmp_path / "g",
        lr=1e-3,
        epochs=3,
        batch=2,
        micro_batch=1,
        seed=0,
        compute_dtype="float32",
    )
    assert len(steps) == 6 and steps[-1].nll < steps[0].nll
    assert nll(tmp_path / "g") < nll(tiny_model_dir) - 1.0
    assert (tmp_path / "g" / "tokenizer_config.json").is_file()


def test_a_judge_benchmark_run_adds_seeds_to_the_ones_judged_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/coevolution.py's record, shared with benchmarks/generator_warmstart.py: a second call judges only
    the seeds the first did not, and its lines pool every seed judged."""
    import sys

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        import coevolution
    finally:
        sys.path.remove(benchmarks)

    first = coevolution.JudgedRuns(tmp_path / "results.json")
    first.record("before", {"open": [0.5, 0.5, 0.0]})
    means = first.record_seed("seed 0", {"open": [1.0, 0.5, 0.0]}, {"train": 1.0}, nll=[1.6, 1.0])
    assert means == "open 0.500"
    assert first.results["seed 0 seconds"] == {"train": 1.0} and first.results["seed 0 nll"] == [1.6, 1.0]
    again = coevolution.JudgedRuns(tmp_path / "results.json")
    assert again.pending(range(0, 3)) == [1, 2]
    assert "seed 0: done before" in capsys.readouterr().out
    again.record("seed 1", {"open": [0.0, 0.5, 1.0]})
    (line,) = again.lines(["open", "real"])
    assert line == coevolution.line("open", [0.5, 0.5, 0.0], [[1.0, 0.5, 0.0], [0.0, 0.5, 1.0]])
    assert "2 seed(s)" in line and line.startswith("open: before 0.333, after 0.500, delta +0.167")
