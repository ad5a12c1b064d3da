"""Ground truth: one check per constraint for the simulated users, the judge's derived items and the evaluation
of versions; the official IFEval checkers; the prompt bank states exactly what its text asks."""

from __future__ import annotations

import json
import random
import re

import pytest

from dynrubric.config import RubricConfig, Settings
from dynrubric.engines.base import Completion, Engine, GenerationRequest
from dynrubric.rubric.evaluator import Evaluator
from dynrubric.rubric.groundtruth import GroundTruth, answer_matches, derive
from dynrubric.rubric.instructions import SUPPORTED, Instruction
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.train.policy_eval import CheckGrader, EvalPrompt, decode_params, paired_bootstrap, sample_outcomes
from dynrubric.train.prompts import make_prompt
from streaming.prompt_bank import PromptItem, check, load_prompts

# (question, response): the places where the users' own checker, the judge's and the evaluation used to differ
DISAGREEMENTS = [
    ("What is 17 + 25? Answer with the number only.", "17 + 25 = 42"),  # users: FIRST number, judge: last
    ("What is 17 + 25? Answer with the number only.", "42, or maybe 41"),
    ("Describe a tomato. Include the word 'red'.", "It can reduce hunger."),  # users: whole word, judge: substring
    ("Describe a tomato. Include the word 'red'.", "It is RED and round."),
    ("Say hello. Start your response with the word 'Hello'.", "hello there"),  # users: case-sensitive
    (
        "Describe a cat. Your entire response should be in English, and in all lowercase letters. No capital letters "
        "are allowed.",
        "a cat is a small furry animal that likes milk.",
    ),
    ("Describe a cat. Wrap your entire response with double quotation marks.", '"A cat is small."'),
    ("Describe a cat. Answer with less than 5 words.", "A small furry animal."),
    ("Describe a cat. Answer with less than 5 words.", "A cat is a small furry animal."),
    ("What is 9 * 8?", ""),
]


class Scripted(Engine):
    """An engine that answers every prompt with the response scripted for it (a policy whose answers are
    fixed, so that the evaluation path can be checked against the other two; cannot come from a real model)."""

    policy_version = "scripted"

    def __init__(self, tokenizer, answers: dict[str, str]):
        self._tokenizer = tokenizer
        self.answers = answers

    @property
    def tokenizer(self):
        return self._tokenizer

    def render_chat(self, messages, add_generation_prompt=True):
        return messages[-1]["content"]

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        return [[Completion(self.answers[r.prompt], (), "stop")] for r in requests]

    def score_next_token(self, prompts, candidates):
        return [{c: -0.7 for c in candidates} for _ in prompts]

    def load_weights(self, path, version):
        self.policy_version = version


def test_users_judge_and_evaluation_give_one_verdict_per_constraint(tiny_model_dir):
    """Issue 24, point 4: the users' feedback check, the judge's derived items and the held-out evaluation are
    the same function of (prompt, response). Before, the users took the first number, whole words and a
    case-sensitive start; the judge the last number, substrings and any case."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for question, response in DISAGREEMENTS:
        engine = Scripted(tok, {question: response})
        evaluator = Evaluator(engine, engine, RubricConfig(calibration_answers=False))
        kind = "arithmetic" if question.startswith("What is") else "instruction"
        users = check(PromptItem(id="x", kind=kind, messages=[{"role": "user", "content": question}]), response)
        rubric = evaluator.rubric_generator.with_derived(
            Rubric(items=[RubricItem(id="g", text="Is good", weight=1)]), question, [response]
        )
        judged = evaluator.judge(question, rubric, [response])
        truth_rows = [
            row[0] if item.polarity == 1 else 1.0 - row[0]
            for item, row in zip(rubric.items, judged.verdicts, strict=True)
            if item.origin == "ground_truth"
        ]
        judge = bool(truth_rows) and all(v == 1.0 for v in truth_rows)
        prompt = EvalPrompt(prompt=make_prompt(question), grader=CheckGrader(derive(question)))
        evaluation = sample_outcomes(engine, "v", [prompt], decode_params(Settings())).scores[prompt.prompt.key] == 1
        assert users == judge == evaluation, (question, response, users, judge, evaluation)
    # the cases themselves: last number, substring (as the official keyword checker), any case
    assert check(
        PromptItem(id="a", kind="arithmetic", messages=[{"role": "user", "content": DISAGREEMENTS[0][0]}]),
        "17 + 25 = 42",
    )


def test_a_version_is_evaluated_in_batches_of_evaluation_decode_batch(tiny_model_dir, tmp_path):
    """`evaluation.decode_batch`: the prompts a version's evaluation sends at once (a batch waits for its longest
    answer; 32 at a time left vLLM's batch half empty, benchmarks/round_time.py)."""
    from transformers import AutoTokenizer

    from dynrubric.config_loader import override
    from dynrubric.train.policy_eval import evaluate_suites

    questions = [f"What is {i} + {i}?" for i in range(7)]

    class Counting(Scripted):
        batches: list[int] = []

        def generate(self, requests):
            self.batches.append(len(requests))
            return super().generate(requests)

    engine = Counting(AutoTokenizer.from_pretrained(tiny_model_dir), {q: str(2 * i) for i, q in enumerate(questions)})
    prompts = [EvalPrompt(prompt=make_prompt(q), grader=CheckGrader(derive(q))) for q in questions]
    settings = override(Settings(), {"paths": {"state_dir": str(tmp_path)}, "evaluation": {"decode_batch": 3}})
    out = evaluate_suites(settings, engine, [("v", tmp_path)], {"dev": prompts})
    assert engine.batches == [3, 3, 1] and out["dev"]["v"].pass_rate() == 1.0


def test_the_bank_states_exactly_what_its_text_asks_and_is_checkable():
    """Every checkable line of the bank (its open lines, real user questions, have no checker)."""
    items = [i for i in load_prompts() if i.kind != "open"]
    rng = random.Random(0)
    for item in rng.sample(items, 200):
        truth = item.ground_truth()
        assert not truth.empty
        if item.kind == "instruction":
            assert tuple(item.instructions) == truth.instructions and not truth.checks
        else:
            assert truth.answer == item.answer
    # every instruction id the bank uses is one the official registry checks here
    assert {ins.id for i in items for ins in (i.instructions or [])} <= set(SUPPORTED)


def test_official_descriptions_are_read_back_into_their_arguments():
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    rng = random.Random(1)
    for iid in SUPPORTED:
        checker = INSTRUCTION_DICT[iid](iid)
        if iid == "combination:repeat_prompt":
            text = "Describe a cat. " + checker.build_description(prompt_to_repeat="Describe a cat.")
        elif iid == "language:response_language":
            text = "Describe a cat. " + checker.build_description(language="de")
        else:
            random.seed(rng.random())  # the official builders draw missing arguments from `random`
            text = "Describe a cat. " + checker.build_description()
        [instruction] = derive(text).instructions
        assert instruction.id == iid
        assert instruction.kwargs == (checker.get_instruction_args() or {}), iid


def test_the_official_checker_decides_and_an_empty_answer_meets_nothing():
    lower = Instruction(id="change_case:english_lowercase")
    assert lower.follows("a calm sea under a grey sky.") and not lower.follows("A calm sea.")
    assert not lower.follows("   ")
    words = Instruction(id="length_constraints:number_words", kwargs={"num_words": 5, "relation": "less than"})
    assert words.follows("Four words right here.") and not words.follows("Five words are right here.")
    truth = GroundTruth(answer=42.0, instructions=(words,))
    assert truth.results("It is 42.") == [True, True] and truth.passes("It is 42.")
    assert not truth.passes("It is 41.") and not GroundTruth().passes("anything")
    assert answer_matches(0.5, "half: 0.5") and not answer_matches(42, "")
    with pytest.raises(ValueError, match="not supported"):
        Instruction(id="length_constraints:number_sentences")  # needs NLTK data no registry package ships
    assert json.loads(words.key()) == {"id": words.id, "kwargs": words.kwargs}


def test_paired_bootstrap_interval_is_centred_on_the_paired_difference():
    a = [1.0] * 30 + [0.0] * 70
    b = [1.0] * 10 + [0.0] * 90
    delta, low, high = paired_bootstrap(a, b, samples=2000, confidence=0.95)
    assert delta == pytest.approx(0.2)
    # 20 of 100 prompts improved, none got worse: the difference is a binomial share, its CI about +-0.08
    assert 0.10 < low < 0.2 < high < 0.30
    same = paired_bootstrap(a, a, samples=500, confidence=0.95)
    assert same == (0.0, 0.0, 0.0)


class ScriptedVersions(Scripted):
    """Each version answers by its own rule (a policy that echoes the question cannot be trained on demand from
    a real model in a test: its answers are scripted, the evaluation and the guard are the real ones)."""

    def __init__(self, tokenizer, rules):
        super().__init__(tokenizer, {})
        self.rules = rules

    def generate(self, requests):
        return [[Completion(self.rules[self.policy_version](r.prompt), (), "stop")] for r in requests]


def test_the_guard_rejects_a_candidate_that_learned_to_echo_the_question(tiny_model_dir, tmp_path):
    """Reward hacking is caught on ground truth: a candidate that answers by repeating the question meets every
    keyword constraint (the official checker only looks for the word) and the judge's echo veto scores it 0;
    on the held-out prompts it fails every computed answer its parent got right, and the round's guard
    rejects it (heldout_regression), whatever the judge's reward said."""
    from transformers import AutoTokenizer

    from dynrubric.config import TrainConfig
    from dynrubric.train.policy_eval import round_evidence
    from dynrubric.train.rounds import round_verdict
    from tests.run_records import evaluation, policy_step

    lines = [json.dumps({"prompt": f"What is {a} + {a + 1}? Answer with the number only."}) for a in range(2, 32)]
    lines += [json.dumps({"prompt": f"Describe thing {i}. Include the word 'blue'."}) for i in range(10)]
    bank = tmp_path / "heldout.jsonl"
    bank.write_text("\n".join(lines) + "\n")

    def honest(question: str) -> str:
        truth = derive(question)
        return f"{truth.answer:g}" if truth.answer is not None else "It is blue."

    engine = ScriptedVersions(AutoTokenizer.from_pretrained(tiny_model_dir), {"base": honest, "r1": lambda q: q})
    settings = Settings.model_validate(
        {
            "paths": {"state_dir": str(tmp_path / "state")},
            "evaluation": {"prompts_file": str(bank)},
            "train": {"heldout_share": 0.99},
        }
    )
    evidence = round_evidence(settings, engine, ("r1", tmp_path), ("base", tmp_path), ("base", tmp_path))
    assert evidence.pass_rate == {"r1": 10 / 40, "base": 1.0}
    verdict, metrics = round_verdict(
        TrainConfig(),
        [policy_step(0, reward_mean=0.9)],
        evaluation(kl_to_parent=0.01, kl_to_base=0.01, reward_parent=0.3, reward_new=0.9, groundtruth=evidence),
    )
    # the judge's held-out reward went up (0.3 -> 0.9): only ground truth shows the candidate is worse
    assert verdict.reason == "heldout_regression" and metrics["heldout_pass"] == 0.25


def test_the_rollouts_judged_check_decides_a_pair_by_ground_truth_where_the_prompt_has_one():
    """A shadow pair whose prompt states a ground truth is decided by it (1 / 1/2 / 0 for the canary), with no
    model; only the other pairs reach the rubric judge."""
    from serving.judged import PairJudge
    from serving.online import ShadowPair

    class Judge:
        asked: list[str] = []

        def score_sets(self, prompts, sets):
            self.asked.extend(prompts)
            return [type("Scored", (), {"scores": [0.9 if "good" in r else 0.1 for r in rs]})() for rs in sets]

    judge = Judge()
    q = "What is 7 + 5? Answer with the number only."
    pairs = [
        ShadowPair("a", q, stable="13", canary="12"),
        ShadowPair("b", q, stable="12", canary="12"),
        ShadowPair("c", q, stable="12", canary="It is 11."),
        ShadowPair("d", "Tell me a story.", stable="meh", canary="a good story"),
    ]
    assert PairJudge(judge, eps=0.02).score(pairs) == [1.0, 0.5, 0.0, 1.0]
    assert judge.asked == ["Tell me a story."]
    assert PairJudge(judge, eps=0.02, ground_truth=False).score(pairs[:1]) == [0.5]  # the stub judge ties them


def collapse_evidence(tiny_model_dir, tmp_path):
    """Issue 38's round trained on the judge alone, scripted on 200 dev prompts: instruction prompts rose 0.200 ->
    0.306 (34 -> 52 of 170), arithmetic fell 0.233 -> 0.033 (7 -> 1 of 30), the total rose +0.060."""
    from transformers import AutoTokenizer

    from dynrubric.train.policy_eval import round_evidence

    lines = [
        json.dumps({"prompt": f"What is {a} + {a + 1}? Answer with the number only.", "split": "dev"})
        for a in range(2, 32)
    ]
    lines += [
        json.dumps({"prompt": f"Describe thing {i}. Include the word 'blue'.", "split": "dev"}) for i in range(170)
    ]
    bank = tmp_path / "dev.jsonl"
    bank.write_text("\n".join(lines) + "\n")

    def answers(arithmetic_right: int, instruction_right: int):
        def answer(question: str) -> str:
            n = int(re.findall(r"(?:What is|Describe thing) (\d+)", question)[0])
            truth = derive(question)
            if truth.answer is not None:
                return f"{truth.answer:g}" if n < 2 + arithmetic_right else "It is a number."
            return "It is blue." if n < instruction_right else "It is red."

        return answer

    engine = ScriptedVersions(
        AutoTokenizer.from_pretrained(tiny_model_dir), {"base": answers(7, 34), "r1": answers(1, 52)}
    )
    settings = Settings.model_validate(
        {"paths": {"state_dir": str(tmp_path / "state")}, "evaluation": {"prompts_file": str(bank), "figures": []}}
    )
    return round_evidence(settings, engine, ("r1", tmp_path), ("base", tmp_path), ("base", tmp_path))


def test_the_guard_rejects_a_candidate_that_collapsed_on_one_kind_whatever_the_total(tiny_model_dir, tmp_path):
    """Every slice protected: the total rose significantly, arithmetic fell significantly on 30 prompts (at least
    `evaluation.min_decided_prompts`), so the round is rejected, naming the kind; with a threshold above 30 prompts
    arithmetic is shown and does not decide."""
    from dynrubric.config import TrainConfig
    from dynrubric.train.rounds import round_verdict
    from tests.run_records import evaluation, policy_step

    evidence = collapse_evidence(tiny_model_dir, tmp_path)
    assert evidence.pass_rate_by_kind["base"] == pytest.approx({"arithmetic": 7 / 30, "instruction": 34 / 170})
    assert evidence.pass_rate_by_kind["r1"] == pytest.approx({"arithmetic": 1 / 30, "instruction": 52 / 170})
    assert evidence.vs_parent.delta == pytest.approx(0.06) and evidence.vs_parent.low > 0  # the total rose
    arithmetic = evidence.vs_parent_by_kind["arithmetic"]
    assert arithmetic.prompts == 30 and arithmetic.delta == pytest.approx(-0.2) and arithmetic.high < 0
    assert evidence.vs_parent_by_kind["instruction"].prompts == 170

    def verdict(min_decided_prompts: int):
        return round_verdict(
            TrainConfig(max_kl=0.45, max_kl_to_base=0.45),
            [policy_step(0)],
            evaluation(kl_to_parent=0.1, kl_to_base=0.1, groundtruth=evidence),
            min_decided_prompts=min_decided_prompts,
        )

    rejected, metrics = verdict(20)
    assert rejected.reason == "kind_regression", rejected
    assert "arithmetic prompts -0.200" in rejected.detail and "over 30 prompts" in rejected.detail
    assert metrics["heldout_vs_parent_by_kind"]["arithmetic"]["delta"] == pytest.approx(-0.2)
    # a kind with too few prompts does not decide: the significant total gain accepts the round
    accepted, _ = verdict(31)
    assert accepted.accepted, accepted
    assert "arithmetic -0.200" in accepted.detail and "under 31 prompts: not decided on" in accepted.detail
