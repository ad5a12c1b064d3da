"""Co-evolution rewards, anchors, guards, prompt files, the run log and the phase schedule (fast)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from dynrubric.config import CoevolveConfig, RubricConfig
from dynrubric.engines.base import Completion, Engine
from dynrubric.errors import DynrubricError
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.rubric.score import aggregate
from dynrubric.train import guards
from dynrubric.train.coevolve import (
    RankedAnchors,
    agreement,
    feedback_ranking,
    generator_groups,
    lineage_ages,
    normalised,
    r_anchor,
    r_disc,
    read_anchor_file,
    temporal_anchors,
)
from dynrubric.train.prompts import JsonlPromptSource, ResponseHistory, make_prompt, read_prompt_file

RUBRIC = Rubric(items=[RubricItem(id="a", text="x", weight=3), RubricItem(id="b", text="y", weight=1)])


def test_r_disc_rewards_items_that_split_the_set() -> None:
    assert r_disc([[1, 1, 1, 1], [0, 0, 0, 0]], RUBRIC) == 0.0
    assert r_disc([[1, 0, 1, 0], [0, 0, 0, 0]], RUBRIC) == pytest.approx(3 * 0.25 / 4)
    assert r_disc([[1, 0, 1, 0], [1, 1, 0, 0]], RUBRIC) == pytest.approx(0.25)


def test_r_disc_pays_for_splitting_the_set_not_for_the_verifiers_uncertainty() -> None:
    """0.5 for every candidate (the hard-verdict fallback, NaN handling) tells no two candidates apart:
    it earns nothing, and less than an item that really splits the set with soft verdicts."""
    undecided = [[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]
    assert r_disc(undecided, RUBRIC) == 0.0
    soft = [[0.9, 0.1, 0.9, 0.1], [0.5, 0.5, 0.5, 0.5]]  # item a splits, b does not
    assert r_disc(soft, RUBRIC) == pytest.approx(3 * 0.4**2 / 4)
    assert r_disc(soft, RUBRIC) > r_disc(undecided, RUBRIC)


def test_r_anchor_matches_the_formula_and_prefers_the_right_order() -> None:
    s = [0.9, 0.5, 0.1]
    ls = lambda d: math.log(1 / (1 + math.exp(-d)))  # noqa: E731
    expected = ls(0.4) / (1 * 1) + ls(0.8) / (2 * 1) + ls(0.4) / (1 * 2)
    assert r_anchor(s) == pytest.approx(expected)
    assert r_anchor(s) > r_anchor(list(reversed(s)))
    assert r_anchor([0.5]) == 0.0


def test_temporal_anchors_rank_newer_above_older_within_the_age_window() -> None:
    lineage = {"base": None, "r1": "base", "r2": "r1", "r3": "r2"}
    ages = lineage_ages(lineage, "r3")
    assert ages == {"r3": 0, "r2": 1, "r1": 2, "base": 3}
    by_version = {"r3": ["n3"], "r2": ["n2"], "r1": ["n1"], "base": ["n0"], "other": ["x"]}
    got = temporal_anchors("current", by_version, ages, min_age=1, max_age=2, rng=random.Random(0))
    assert got == ["current", "n2", "n1"]  # base is too old, r3 too young, "other" is not an ancestor
    assert temporal_anchors("c", {"base": ["n0"]}, ages, 1, 2, random.Random(0)) is None


def test_normalised_is_zero_for_ties_at_the_rubric_threshold() -> None:
    tie = RubricConfig().eps
    assert normalised([1.0, 1.0, 1.0], tie) == [0.0, 0.0, 0.0]
    assert normalised([0.1, 0.1 + 6e-6, 0.1 - 1e-4], tie) == [0.0, 0.0, 0.0]  # engine noise, not a signal
    a = normalised([0.0, 1.0], tie)
    assert a[0] < 0 < a[1] and sum(a) == pytest.approx(0.0)


class ScriptedGenerator(Engine):
    """Writes the given rubric texts in turn: the tiny model never writes valid JSON, and the reward
    path for parseable rubrics must still be exercised."""

    def __init__(self, tokenizer, texts: list[str]):
        self._tok, self.texts, self.policy_version = tokenizer, texts, "scripted"

    @property
    def tokenizer(self):
        return self._tok

    def generate(self, requests):
        out = []
        for r in requests:
            out.append(
                [
                    Completion(
                        self.texts[i % len(self.texts)],
                        tuple(self._tok.encode(self.texts[i % len(self.texts)], add_special_tokens=False)),
                        "stop",
                    )
                    for i in range(r.params.n)
                ]
            )
        return out

    def score_next_token(self, prompts, candidates):
        raise NotImplementedError

    def load_weights(self, path, version):
        raise NotImplementedError


def test_generator_groups_reward_splitting_parseable_rubrics_above_the_rest(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    splitting = json.dumps(
        {
            "items": [
                {"id": "k", "text": "mentions u", "weight": 3, "polarity": 1},
                {"id": "p", "text": "is polite", "weight": 1, "polarity": 1},
            ]
        }
    )
    flat = json.dumps(
        {
            "items": [
                {"id": "p", "text": "is polite", "weight": 3, "polarity": 1},
                {"id": "q", "text": "is in English", "weight": 1, "polarity": 1},
            ]
        }
    )
    engine = ScriptedGenerator(tok, [splitting, flat, "not json at all", splitting])

    def verify(question, responses, rubric):
        return [
            [1.0 if ("u" in r) else 0.0 for r in responses] if "mentions u" in i.text else [1.0] * len(responses)
            for i in rubric.items
        ]

    def apply(question, rubric, responses):
        return aggregate(verify(question, responses, rubric), rubric)

    prompt = make_prompt("Say something.")
    responses = ["blue", "red", "sun", "tree"]
    groups, stats = generator_groups(
        engine,
        lambda q, rs: f"rubric for {q}",
        verify,
        apply,
        [(prompt, responses)],
        [RankedAnchors(["blue sun", "red tree"], "users")],
        CoevolveConfig(rubric_samples=4),
        max_items=12,
        temperature=0.7,
        tie_eps=RubricConfig().eps,
        seed=0,
    )
    [g] = groups
    assert g.temperature == 0.7  # the generator's loss takes log-probs at its sampling temperature
    assert stats.parsed == 3 and stats.anchored_sets == 1
    # the users ranked "blue sun" over "red tree": both splitting rubrics agree ("mentions u"), the flat one ties
    # (1/2): 2.5 of the 3 parsed rubrics' pairs
    assert stats.user_ranked_sets == 1 and stats.judge_user_pairs == 3
    assert stats.judge_user_agreement == pytest.approx(2.5 / 3)
    adv = g.advantages
    assert adv[0] == adv[3] > adv[1] > adv[2]  # splitting > valid but flat > unparseable
    assert all(len(r.response_ids) > 0 for r in g.rollouts) and g.rollouts[0].response_ids[-1] == tok.eos_token_id


def test_feedback_ranks_a_prompts_logged_responses_by_what_users_said() -> None:
    logged = [
        ("It is 4.", ["thumbs_up", "copy"]),
        ("It is 5.", ["thumbs_down", "regenerate"]),
        ("It is 4.", ["thumbs_up"]),
        ("Four.", ["thumbs_up", "thumbs_down"]),
        ("No idea.", ["dwell"]),
        ("", ["thumbs_up"]),
    ]
    # mean values: "It is 4." +1, "Four." 0, "It is 5." -1; dwell and copy are no verdict; empty answers skipped
    assert feedback_ranking(logged) == ["It is 4.", "Four.", "It is 5."]
    assert feedback_ranking([("a", ["thumbs_up"]), ("b", ["thumbs_up"])]) is None  # the users told nothing apart
    assert feedback_ranking([("a", ["copy"])]) is None
    assert agreement([0.9, 0.5, 0.1], eps=0.02) == (1.0, 3)
    assert agreement([0.1, 0.5, 0.5], eps=0.02) == (0.5 / 3, 3)  # 0 + 0 + a tie
    assert agreement([0.3], eps=0.02) == (0.0, 0)


def test_guards_name_the_reason() -> None:
    ok = dict(
        nonfinite_steps=[],
        kl=0.01,
        max_kl=0.05,
        kl_to_base=0.1,
        max_kl_to_base=0.15,
        reward_parent=0.5,
        reward_new=0.52,
        max_reward_drop=0.05,
    )
    assert guards.check(**ok).accepted
    assert guards.check(**{**ok, "nonfinite_steps": [2]}).reason == "nonfinite"
    assert guards.check(**{**ok, "kl": 0.2}).reason == "kl"
    assert guards.check(**{**ok, "kl": float("nan")}).reason == "kl"
    # each round within its own bound, but the drift they add up to is bounded too
    assert guards.check(**{**ok, "kl_to_base": 0.16}).reason == "kl_to_base"
    assert guards.check(**{**ok, "kl_to_base": float("nan")}).reason == "kl_to_base"
    drop = guards.check(**{**ok, "reward_parent": 0.6, "reward_new": 0.4})
    assert drop.reason == "reward_drop" and "0.6000 -> 0.4000" in drop.detail
    # ground truth: rejected only when the whole CI of the paired difference lies below 0
    worse = guards.check(**ok, groundtruth_vs_parent={"delta": -0.1, "low": -0.16, "high": -0.04, "prompts": 200})
    assert worse.reason == "heldout_regression" and "-0.100" in worse.detail
    unsure = guards.check(**ok, groundtruth_vs_parent={"delta": -0.05, "low": -0.12, "high": 0.02, "prompts": 200})
    assert unsure.accepted and "ground truth -0.050" in unsure.detail


def test_prompt_file_errors_name_the_line_and_the_watermark_advances(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    with pytest.raises(DynrubricError, match=r"bad.jsonl:2"):
        read_prompt_file(bad)
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(DynrubricError, match=r"bad.jsonl:2 is not valid JSON"):
        read_prompt_file(bad)
    good = tmp_path / "p.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(5)))
    source = JsonlPromptSource(good, ResponseHistory(tmp_path / "h.jsonl"))
    first, w1 = source.new_prompts(None, 3)
    second, w2 = source.new_prompts(w1, 3)
    third, w3 = source.new_prompts(w2, 3)
    assert [p.question for p in first + second] == [f"q{i}" for i in range(5)] and third == [] and w3 == w2 == "5"
    source.history.append([(first[0].key, "r1", ["a", "b"]), (first[0].key, "r2", ["c"])])
    assert source.responses_by_version(first[0].key) == {"r1": ["a", "b"], "r2": ["c"]}


def test_anchor_file_is_validated(tmp_path: Path) -> None:
    f = tmp_path / "anchors.jsonl"
    f.write_text(json.dumps({"prompt": "q", "responses": ["best", "worst"]}) + "\n")
    assert read_anchor_file(f) == {make_prompt("q").key: ["best", "worst"]}
    f.write_text(json.dumps({"prompt": "q", "responses": ["only"]}) + "\n")
    with pytest.raises(DynrubricError, match="fewer than 2"):
        read_anchor_file(f)


def test_schedule_alternates_k_alt_steps_and_starts_with_the_generator_after_a_collapse(tmp_path: Path) -> None:
    from dynrubric.config import Settings
    from dynrubric.registry import Registry
    from dynrubric.train.rounds import RoundRunner

    settings = Settings.model_validate(
        {"paths": {"state_dir": str(tmp_path)}, "train": {"coevolve": {"k_alt": 2}, "steps_per_round": 4}}
    )
    runner = RoundRunner(settings, Registry(tmp_path / "r.sqlite"), None, None)  # type: ignore[arg-type]
    assert runner.schedule(1, 4, refresh=False) == ["policy", "policy", "generator", "generator"]
    assert runner.schedule(2, 4, refresh=False) == ["policy", "policy", "generator", "generator"]
    assert runner.schedule(2, 4, refresh=True) == ["generator", "generator", "policy", "policy"]
    uneven = Settings.model_validate(
        {"paths": {"state_dir": str(tmp_path)}, "train": {"coevolve": {"k_alt": 3, "k_alt_generator": 1}}}
    )
    five = RoundRunner(uneven, runner.registry, None, None)  # type: ignore[arg-type]
    assert five.schedule(1, 4, refresh=False) == ["policy"] * 3 + ["generator"]  # each round: 3 policy, 1 generator
    assert five.schedule(2, 4, refresh=False) == ["policy"] * 3 + ["generator"]
    assert five.schedule(2, 4, refresh=True) == ["generator"] + ["policy"] * 3
    off = Settings.model_validate({"paths": {"state_dir": str(tmp_path)}, "train": {"coevolve": {"enabled": False}}})
    no_coevolution = RoundRunner(off, runner.registry, None, None)  # type: ignore[arg-type]
    assert no_coevolution.schedule(1, 3, refresh=True) == ["policy"] * 3
    alone = Settings.model_validate(
        {"paths": {"state_dir": str(tmp_path)}, "train": {"coevolve": {"k_alt": 0, "k_alt_generator": 2}}}
    )
    generator_alone = RoundRunner(alone, runner.registry, None, None)  # type: ignore[arg-type]
    assert generator_alone.schedule(3, 5, refresh=False) == ["generator"] * 5  # the policy stands still
    assert generator_alone.schedule(1, 2, refresh=True) == ["generator"] * 2
    with pytest.raises(ValidationError, match="needs k_alt_generator"):
        Settings.model_validate({"train": {"coevolve": {"k_alt": 0}}})


def test_file_anchors_are_found_for_prompts_from_the_replay_source(tmp_path: Path) -> None:
    """One prompt key for the whole project: an anchor file keyed by the trainer finds the prompts the
    replay store logged (with and without a system message), so R_anchor does not drop out in replay mode."""
    from streaming.store import ReplayPromptSource, Stored, StoreWriter
    from tests.integration.test_streaming_producer import query_event

    chats = [
        [{"role": "user", "content": "2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}],
    ]
    writer = StoreWriter(tmp_path / "replay")
    writer.commit([Stored(query_event(f"r{i}", policy_version="v1", messages=m), 0, i) for i, m in enumerate(chats)])
    writer.close()
    anchors_path = tmp_path / "anchors.jsonl"
    anchors_path.write_text(
        json.dumps({"prompt": "2+2?", "responses": ["4", "5"]})
        + "\n"
        + json.dumps({"messages": chats[1], "responses": ["A red fox.", "Foxes!"]})
        + "\n"
    )
    anchors = read_anchor_file(anchors_path)
    prompts, _ = ReplayPromptSource(tmp_path / "replay").new_prompts(None, 10)
    assert len(prompts) == 2
    assert sorted(anchors[p.key][0] for p in prompts) == ["4", "A red fox."]
    assert all(p.key == make_prompt(p.messages).key for p in prompts)


def test_users_feedback_in_the_replay_store_ranks_a_prompts_responses(tmp_path: Path) -> None:
    """The replay source gives the trainer every logged response of a prompt with the users' feedback on it, and
    `feedback_ranking` turns that into the generator's anchors: the response users liked over the one they
    regenerated, across the two versions that wrote them."""
    from streaming.events import FeedbackEvent
    from streaming.store import ReplayPromptSource, Stored, StoreWriter
    from tests.integration.test_streaming_producer import query_event

    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    writer = StoreWriter(tmp_path / "replay")
    logged = [
        query_event("a", policy_version="base", messages=chat, response="5"),
        query_event("b", policy_version="r1", messages=chat, response="It is 4."),
        query_event("c", policy_version="r1", messages=chat, response="It is 4."),
    ]
    writer.commit([Stored(e, 0, i) for i, e in enumerate(logged)])
    votes = [("a", "thumbs_down"), ("a", "regenerate"), ("b", "thumbs_up"), ("c", "thumbs_up"), ("c", "copy")]
    writer.commit(
        [
            Stored(FeedbackEvent(request_id=rid, ts=1795000000.0 + i, user_key="u1", kind=kind, value=1.0), 1, i)
            for i, (rid, kind) in enumerate(votes)
        ]
    )
    writer.close()
    source = ReplayPromptSource(tmp_path / "replay")
    [prompt], _ = source.new_prompts(None, 10)
    assert sorted((r, sorted(kinds)) for r, kinds in source.feedback_by_response(prompt.key)) == [
        ("5", ["regenerate", "thumbs_down"]),
        ("It is 4.", ["copy", "thumbs_up"]),
        ("It is 4.", ["thumbs_up"]),
    ]
    assert feedback_ranking(source.feedback_by_response(prompt.key)) == ["It is 4.", "5"]
