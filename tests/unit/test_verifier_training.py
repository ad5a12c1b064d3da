"""The verifier's training on ranked answers (dynrubric/train/verifier_training.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from dynrubric.rubric.checks import Check
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.train.grpo import pairwise_verdict_loss, verdict_log_odds
from dynrubric.train.verifier_training import VerdictPair, items_read, train_verifier, verdict_pairs


def test_the_log_odds_are_those_of_the_verdict_the_verifier_reads() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    yes, no = torch.tensor([0, 2]), torch.tensor([1, 3])
    p = logits.softmax(-1)[0]
    verdict = float((p[0] + p[2]) / (p[0] + p[2] + p[1] + p[3]))  # verify.verdict_from_logprobs' P(yes)
    assert float(torch.sigmoid(verdict_log_odds(logits, yes, no))[0]) == pytest.approx(verdict)


def test_the_pairwise_loss_rewards_the_order_the_items_polarity_asks_for() -> None:
    better, worse = torch.tensor([2.0, 2.0]), torch.tensor([0.0, 0.0])
    right = pairwise_verdict_loss(better, worse, torch.tensor([1.0, 1.0]), 2)
    wrong = pairwise_verdict_loss(better, worse, torch.tensor([-1.0, -1.0]), 2)
    assert float(right) == pytest.approx(math.log1p(math.exp(-2.0)))
    assert float(wrong) == pytest.approx(math.log1p(math.exp(2.0)))
    tied = pairwise_verdict_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), 4)
    assert float(tied) == pytest.approx(math.log(2.0) / 4)  # over the whole batch's pairs


def item(n: int, **kw: object) -> RubricItem:
    return RubricItem(id=f"i{n}", text=f"The response does thing number {n}", weight=2, **kw)  # type: ignore[arg-type]


def test_only_generated_items_the_verifier_answers_are_trained_on() -> None:
    checked = item(2, check=Check(kind="max_words", value=50))
    rubric = Rubric(items=[item(1), checked, item(3, origin="ground_truth"), item(4, polarity=-1)])
    assert [i.id for i in items_read(rubric, check_weight=1.0)] == ["i1", "i4"]
    assert [i.id for i in items_read(rubric, check_weight=0.0)] == ["i1", "i2", "i4"]


def render(question: str, responses: Sequence[str], items: Sequence[RubricItem]) -> list[str]:
    return [f"{question}|{r}|{i.text}" for r in responses for i in items]


def test_each_other_answer_is_paired_with_the_preferred_one_under_an_item() -> None:
    items = [item(1), item(2, polarity=-1)]
    pairs = verdict_pairs(render, "Q", ["best", "b", "c", "d"], 0, items, random.Random(0))
    assert [p.worse.split("|")[1] for p in pairs] == ["b", "c", "d"]
    assert all(p.better.startswith("Q|best|") and p.better.split("|")[2] == p.worse.split("|")[2] for p in pairs)
    assert all(p.polarity == (-1 if p.better.endswith("2") else 1) for p in pairs)
    two = verdict_pairs(render, "Q", ["a", "best"], 1, items, random.Random(0), per_answer=5)
    assert sorted(p.polarity for p in two) == [-1, 1] and all(p.worse.startswith("Q|a|") for p in two)


def test_training_moves_each_pairs_verdicts_the_way_its_polarity_says(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs = [
        VerdictPair("question: sky? answer: blue. met?", "question: sky? answer: green. met?", 1),
        VerdictPair("question: sea? answer: wet. harmful?", "question: sea? answer: dry. harmful?", -1),
    ]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    yes, no = ["yes"], ["no"]

    def gaps(model_dir: Path) -> list[float]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = (
            torch.tensor([tok.encode(t, add_special_tokens=False)[0] for t in yes]),
            torch.tensor([tok.encode(t, add_special_tokens=False)[0] for t in no]),
        )

        def z(text: str) -> float:
            with torch.no_grad():
                logits = model(torch.tensor([tok.encode(text, add_special_tokens=False)])).logits[:, -1]
            return float(verdict_log_odds(logits, *ids)[0])

        return [z(p.better) - z(p.worse) for p in pairs]

    run = train_verifier(
        tiny_model_dir, pairs * 4, yes, no, tmp_path / "v", lr=1e-3, epochs=3, batch=4, micro_batch=2, seed=0,
        compute_dtype="float32",
    )  # fmt: skip
    steps = run.steps
    assert len(steps) == 6 and steps[-1].loss < steps[0].loss
    assert run.checks == [] and run.kept == 6  # no validation pairs: the last weights
    before, after = gaps(tiny_model_dir), gaps(tmp_path / "v")
    assert after[0] > before[0] + 1.0  # polarity +1: the preferred answer meets the item more readily
    assert after[1] < before[1] - 1.0  # polarity -1: less readily
    assert (tmp_path / "v" / "tokenizer_config.json").is_file()


def test_validation_pairs_keep_the_weights_of_the_lowest_validation_loss(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Early stopping: validation pairs that training can only make worse (the same texts, the opposite polarity)
    keep the model as loaded; validation pairs that agree with training keep the last weights. `last_dir` gets the
    last weights either way."""
    from safetensors.torch import load_file

    pairs = [VerdictPair("question: sky? answer: blue. met?", "question: sky? answer: green. met?", 1)] * 4
    opposed = [VerdictPair(p.better, p.worse, -p.polarity) for p in pairs[:1]]
    common = {"lr": 1e-3, "epochs": 2, "batch": 2, "micro_batch": 2, "seed": 0, "compute_dtype": "float32"}

    def weights(directory: Path) -> dict[str, torch.Tensor]:
        return load_file(str(next(directory.glob("*.safetensors"))))

    worse = train_verifier(
        tiny_model_dir, pairs, ["yes"], ["no"], tmp_path / "kept", validation=opposed, check_every=1,
        last_dir=tmp_path / "last", **common,
    )  # fmt: skip
    assert [c.update for c in worse.checks] == [0, 1, 2, 3, 4], worse.checks
    assert worse.kept == 0 and worse.checks[-1].loss > worse.checks[0].loss
    base, kept, last = weights(tiny_model_dir), weights(tmp_path / "kept"), weights(tmp_path / "last")
    assert all(torch.equal(base[k], kept[k]) for k in base)  # the model as loaded
    assert any(not torch.equal(base[k], last[k]) for k in base)

    better = train_verifier(
        tiny_model_dir, pairs, ["yes"], ["no"], tmp_path / "kept2", validation=pairs[:1], **common
    )  # fmt: skip
    assert [c.update for c in better.checks] == [0, 2, 4] and better.kept == 4  # once per epoch, and the last
    assert better.checks[-1].loss < better.checks[0].loss


def test_the_supervision_arm_with_a_trained_verifier_judges_with_that_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """benchmarks/supervision.py's `judge:set+verifier`: judge:set+levers whose `models.verifier` is --verifier."""
    import sys

    from dynrubric.config_loader import load_settings

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        import supervision
    finally:
        sys.path.remove(benchmarks)

    base = load_settings(None, {}, profile="demo")
    args = (0, tmp_path / "run", tmp_path / "prompts.jsonl", "http://127.0.0.1:1")
    trained = supervision.run_settings(base, supervision.TRAINED_VERIFIER, *args, tiny_model_dir)
    levers = supervision.run_settings(base, "judge:set+levers", *args, tiny_model_dir)
    assert trained.models.verifier == str(tiny_model_dir.resolve()) and levers.models.verifier == base.models.verifier
    assert trained.rubric == levers.rubric  # only the verifier's weights differ
    with pytest.raises(SystemExit, match="needs --verifier"):
        supervision.run_settings(base, supervision.TRAINED_VERIFIER, *args, None)
