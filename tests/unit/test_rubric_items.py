"""The rubric schema and the tolerant parser: what a small generator writes, and junk."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dynrubric.rubric.items import MAX_ITEMS, MIN_ITEMS, Rubric, RubricItem, RubricParseError, parse_rubric


def test_reasoning_fences_trailing_commas_single_quotes_and_string_weights():
    raw = """Let me think about what separates these answers.
```json
{'items': [
  {'id': 'correct', 'text': 'States the final answer 42', 'weight': '5', 'polarity': 1,},
  {'id': 'shows', 'text': 'Shows the intermediate steps', 'weight': 2.6},
  {'id': 'err', 'text': 'Contains an arithmetic error', 'weight': 4.0, 'polarity': '-1'},
]}
```
These items should split the candidates."""
    rubric = parse_rubric(raw)
    assert [(i.id, i.weight, i.polarity) for i in rubric.items] == [
        ("correct", 5, 1),
        ("shows", 3, 1),
        ("err", 4, -1),
    ]


def test_bare_list_without_fence_and_python_literals():
    raw = (
        'Items: [{"text": "Is polite", "weight": 1, "polarity": "positive"}, '
        '{"text": "Uses a list", "weight": 2, "polarity": "negative", "extra": None}] done'
    )
    rubric = parse_rubric(raw)
    assert [i.polarity for i in rubric.items] == [1, -1]
    assert [i.id for i in rubric.items] == ["i1", "i2"]


def test_weight_rule_rounds_and_clamps_and_drops_non_numbers():
    raw = json.dumps(
        {
            "items": [
                {"text": "a b c", "weight": 10},
                {"text": "d e f", "weight": -3},
                {"text": "g h i", "weight": "heavy"},
                {"text": "j k l", "weight": float("nan")} if False else {"text": "j k l", "weight": "nan"},
                {"text": "m n o", "weight": 2.5},
            ]
        }
    )
    rubric = parse_rubric(raw)
    assert [(i.text, i.weight) for i in rubric.items] == [("a b c", 5), ("d e f", 1), ("m n o", 2)]


def test_near_duplicates_merge_keeping_larger_weight_and_contradictions_drop():
    raw = json.dumps(
        [
            {"id": "a", "text": "The response states the correct answer.", "weight": 2},
            {"id": "b", "text": "the response states the correct answer", "weight": 4},
            {"id": "c", "text": "The response states the correct answer!", "weight": 1, "polarity": -1},
            {"id": "d", "text": "The response is short.", "weight": 1},
        ]
    )
    rubric = parse_rubric(raw)
    assert [(i.id, i.weight, i.polarity) for i in rubric.items] == [("a", 4, 1), ("d", 1, 1)]


def test_more_than_max_items_keeps_the_heaviest_in_order():
    items = [{"text": f"distinct property number {n} zz{n}", "weight": 1 + n % 5} for n in range(20)]
    rubric = parse_rubric(json.dumps({"items": items}), max_items=6)
    assert len(rubric.items) == 6
    assert all(i.weight >= 4 for i in rubric.items)


def test_duplicate_ids_are_renamed():
    raw = json.dumps([{"id": "x", "text": "alpha beta", "weight": 1}, {"id": "x", "text": "gamma delta", "weight": 1}])
    assert len({i.id for i in parse_rubric(raw).items}) == 2


@pytest.mark.parametrize(
    "raw, reason",
    [
        ("", "empty"),
        ("I cannot write a rubric.", "no JSON"),
        ('{"items": []}', "no list of rubric items"),
        ('[{"text": "", "weight": 3}, {"weight": 2}]', "none of the 2 entries"),
    ],
)
def test_errors_say_what_was_wrong(raw, reason):
    with pytest.raises(RubricParseError) as e:
        parse_rubric(raw)
    assert reason in e.value.reason


def test_schema_rejects_out_of_range_and_too_many_items():
    with pytest.raises(ValidationError):
        RubricItem(id="a", text="x", weight=6, polarity=1)
    with pytest.raises(ValidationError):
        RubricItem(id="a", text="x", weight=1, polarity=0)
    item = RubricItem(id="a", text="x", weight=1, polarity=1)
    with pytest.raises(ValidationError):
        Rubric(items=[])
    with pytest.raises(ValidationError):
        Rubric(items=[item, item])  # duplicate ids


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
)
json_like = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(
            st.sampled_from(["items", "id", "text", "weight", "polarity", "rubric", "x"]), children, max_size=5
        ),
    ),
    max_leaves=25,
)
item_like = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.text(max_size=8), st.integers(), st.none()),
        "text": st.one_of(st.text(max_size=40), st.integers(), st.none()),
        "weight": st.one_of(
            st.integers(-20, 20),
            st.floats(-20, 20),
            st.floats(allow_nan=True, allow_infinity=True),
            st.text(max_size=5),
            st.none(),
        ),
        "polarity": st.one_of(
            st.sampled_from([1, -1, 0, "+1", "-1", "negative", "positive", "?"]), st.none(), st.floats()
        ),
    },
)


def _check(rubric: Rubric) -> None:
    assert MIN_ITEMS <= len(rubric.items) <= MAX_ITEMS
    for i in rubric.items:
        assert 1 <= i.weight <= 5 and i.polarity in (1, -1) and i.text.strip()


def _parse_or_typed_error(raw: str) -> None:
    try:
        _check(parse_rubric(raw))
    except RubricParseError as e:
        assert e.reason


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_arbitrary_text_parses_or_raises_the_typed_error(raw):
    _parse_or_typed_error(raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_like, st.text(max_size=20), st.text(max_size=20), st.booleans())
def test_json_junk_wrapped_in_prose_parses_or_raises_the_typed_error(value, before, after, fence):
    body = json.dumps(value, allow_nan=True)
    if fence:
        body = f"```json\n{body}\n```"
    _parse_or_typed_error(f"{before}{body}{after}")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(item_like, max_size=15), st.booleans(), st.integers(0, 2))
def test_item_junk_never_gives_an_invalid_rubric(items, wrap, damage):
    body = json.dumps({"items": items} if wrap else items, allow_nan=True)
    if damage == 1:
        body = body.replace('"', "'")
    elif damage == 2:
        body = body.replace("}", ",}").replace("]", ",]")
    _parse_or_typed_error(body)
    try:
        rubric = parse_rubric(body)
    except RubricParseError:
        return
    if damage == 0:  # the body decodes to `items` exactly: the weight rule, entry by entry
        valid = [
            (" ".join(e["text"].split()), w)
            for e in items
            if isinstance(e.get("text"), str)
            and e["text"].strip()
            and _valid_polarity(e.get("polarity"))
            and (w := _rule_weight(e.get("weight", 1))) is not None
        ]
        assert len(rubric.items) <= len(valid)
        for item in rubric.items:
            # the entry that wrote the item, and the twins merged into it: the largest of their weights
            first = next(w for text, w in valid if text == item.text)
            assert first <= item.weight and item.weight in {w for _, w in valid}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(-20, 20),
            st.floats(-20, 20),
            st.floats(allow_nan=True, allow_infinity=True),
            st.floats(-20, 20).map(str),
            st.booleans(),
            st.none(),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_every_item_weight_follows_the_weight_rule(weights):
    """Distinct texts (nothing merges): the items are the entries with a usable weight, in order, each
    weight rounded to the nearest integer and clamped into 1..5."""
    entries = [{"text": f"distinct property number {n} zz{n}", "weight": w} for n, w in enumerate(weights)]
    expected = [(e["text"], w) for e in entries if (w := _rule_weight(e["weight"])) is not None]
    try:
        rubric = parse_rubric(json.dumps({"items": entries}, allow_nan=True))
    except RubricParseError:
        assert not expected
        return
    assert [(i.text, i.weight) for i in rubric.items] == expected


def _rule_weight(value) -> int | None:
    """The module docstring's weight rule: a finite number (or numeric string) rounded to the nearest
    integer and clamped into 1..5; anything else drops the item."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return min(5, max(1, round(value)))


def _valid_polarity(value) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return math.isfinite(value) and value != 0
    return isinstance(value, str) and value.strip().lower() in {"1", "+1", "-1", "positive", "negative"}


def test_an_item_written_four_times_is_a_one_item_rubric():
    item = {"text": "The response gives the final answer 42.", "weight": 3, "polarity": 1}
    rubric = parse_rubric(json.dumps({"items": [item] * 4}))
    assert [(i.text, i.weight) for i in rubric.items] == [(item["text"], 3)]


@pytest.mark.parametrize(
    ("text", "check", "stated"),
    [
        ("The response is a garden.", {"kind": "max_words", "value": 1}, False),
        ("The response has some issues.", {"kind": "max_words", "value": 1}, False),
        ("The response is at most 50 words long.", {"kind": "max_words", "value": 50}, True),
        ("The response is at most 50 words long.", {"kind": "max_words", "value": 40}, False),
        ("The response mentions Paris.", {"kind": "contains", "value": "paris"}, True),
        ("The response that satisfies the requirements.", {"kind": "not_contains", "value": "True"}, False),
        ("The response uses no commas.", {"kind": "no_commas"}, True),
        ("The response is polite.", {"kind": "no_commas"}, False),
        ("The response lists 3 bullet points.", {"kind": "bullet_count", "value": 3}, True),
        ("The response's final number is 42.", {"kind": "final_number", "value": 42}, True),
        ("The response starts with 'Dear Sir'.", {"kind": "starts_with", "value": "Dear Sir"}, True),
        ("The response is formal, Dear Sir.", {"kind": "starts_with", "value": "Dear Sir"}, False),
        ("The response matches a date.", {"kind": "regex", "value": r"\d+"}, False),
    ],
)
def test_a_check_is_kept_only_where_its_items_text_states_it(text, check, stated):
    raw = json.dumps(
        {"items": [{"text": text, "weight": 2, "check": check}, {"text": "The response is kind.", "weight": 1}]}
    )
    notes: list[str] = []
    kept = parse_rubric(raw, stated_checks_only=True, notes=notes).items[0]
    assert (kept.check is not None) == stated
    assert bool(notes) == (not stated)
    assert parse_rubric(raw).items[0].check is not None  # off: every well-formed check stands, as before
