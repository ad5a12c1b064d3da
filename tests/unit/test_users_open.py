"""Simulated users on open prompts: the thumb follows open_quality with Gaussian noise, not a checker; only
train prompts of the bank are ever sent."""

from __future__ import annotations

import json
from collections import Counter
from statistics import NormalDist

import httpx
import pytest

from dynrubric.rubric.open_quality import REFERENCE_WORDS
from dynrubric.train.splits import split_of
from serving.users import OPEN_SIGMA, OPEN_THRESHOLD, SimulatedUsers, load_checkable, load_served, open_thumb
from streaming.prompt_bank import PromptItem

QUESTION = "My car battery keeps dying overnight. What could be draining it and how do I find out?"
REFERENCE = (
    "A battery that dies overnight usually points to a parasitic drain: something keeps drawing current after "
    "the ignition is off. Common culprits are a glovebox or trunk light that stays on, an aftermarket stereo or "
    "alarm, a stuck relay, or a failing alternator diode. To find it, disconnect the negative terminal, put a "
    "multimeter in series and pull fuses one at a time until the current drops."
)
GOOD = " ".join(REFERENCE.split()[:REFERENCE_WORDS])
BAD = "Fresh basil, ripe tomatoes and mozzarella make a classic summer salad; drizzle olive oil and serve cold."


def base_in(split: str, prefix: str = "arena-hard:t") -> str:
    return next(f"{prefix}{n}" for n in range(1000) if split_of(f"{prefix}{n}") == split)


def open_item(split: str = "train", **fields) -> PromptItem:
    line = {
        "id": f"arena-{split}",
        "kind": "open",
        "source": "arena-hard",
        "messages": [{"role": "user", "content": QUESTION}],
        "base": base_in(split),
        "split": split,
        "references": [REFERENCE],
    }
    return PromptItem.model_validate(line | fields)


def fake_router(answer: str, feedback: list[dict]) -> httpx.Client:
    """A router that answers every request with `answer` and records the feedback it gets."""
    n = iter(range(10**6))

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/feedback":
            feedback.append(json.loads(request.content))
            return httpx.Response(200, json={})
        headers = {"x-request-id": f"r{next(n)}", "x-dynrubric-variant": "stable", "x-dynrubric-policy-version": "v0"}
        return httpx.Response(200, headers=headers, json={"choices": [{"message": {"content": answer}}]})

    return httpx.Client(base_url="http://router", transport=httpx.MockTransport(handle))


def thumbs_up_rate(answer: str, requests: int = 300, seed: int = 3) -> tuple[float, list]:
    item = open_item()
    users = SimulatedUsers("http://router", [item], rated_share=1.0, regenerate_p=0.0, seed=seed)
    feedback: list[dict] = []
    with fake_router(answer, feedback) as client:
        outcomes = [users.one(client) for _ in range(requests)]
    assert all(o is not None and o.ok is None for o in outcomes)  # no checker on an open prompt
    assert {o.quality for o in outcomes} == {item.open_quality(answer)}
    kinds = Counter(f["kind"] for f in feedback)
    assert kinds["thumbs_up"] + kinds["thumbs_down"] == requests
    return kinds["thumbs_up"] / requests, [o.feedback for o in outcomes]


def test_the_thumb_follows_the_quality_with_noise():
    good, _ = thumbs_up_rate(GOOD)
    bad, _ = thumbs_up_rate(BAD)
    assert open_item().open_quality(GOOD) == pytest.approx(1.0) and open_item().open_quality(BAD) < 0.05
    assert good == 1.0  # 1.0 is ~18 sigma above the threshold
    assert bad < 0.3  # quality ~0: up only when the noise lifts it past the threshold (18 %)
    # an answer at about the threshold: a coin flip, the noise decides
    words = GOOD.split()
    mid = next(
        " ".join(words[:k]) for k in range(1, len(words)) if open_item().open_quality(" ".join(words[:k])) > 0.05
    )
    q = open_item().open_quality(mid)
    rate, _ = thumbs_up_rate(mid)
    expected = 1 - NormalDist().cdf((OPEN_THRESHOLD - q) / OPEN_SIGMA)
    assert abs(rate - expected) < 0.1 and 0.05 < rate < 0.95


def test_the_same_seed_gives_the_same_thumbs():
    assert thumbs_up_rate(GOOD[:120], requests=100, seed=5) == thumbs_up_rate(GOOD[:120], requests=100, seed=5)


def test_open_thumb_is_a_noisy_threshold():
    assert open_thumb(OPEN_THRESHOLD + 0.01, 0.5) and not open_thumb(OPEN_THRESHOLD - 0.01, 0.5)
    assert open_thumb(0.0, 0.999999, sigma=0.05, threshold=0.045)  # noise can lift a poor answer
    assert not open_thumb(0.0, 0.0, sigma=0.05, threshold=0.045)
    assert open_thumb(0.5, 0.3, sigma=0.0, threshold=0.08)  # no noise: the threshold alone


def test_a_disliked_open_answer_is_regenerated():
    users = SimulatedUsers("http://router", [open_item()], rated_share=0.0, regenerate_p=1.0, seed=0)
    with fake_router(BAD, []) as client:
        bad = [users.one(client) for _ in range(50)]
    with fake_router(GOOD, []) as client:
        good = [users.one(client) for _ in range(50)]
    assert sum(o.feedback == ["regenerate"] for o in bad) > 30  # disliked 82 % of the time
    assert all(o.feedback == [] for o in good)


def test_only_train_prompts_are_served(tmp_path):
    with pytest.raises(ValueError, match="train"):
        SimulatedUsers("http://router", [open_item("train"), open_item("dev")])
    with pytest.raises(ValueError, match="split"):
        open_item("train", base=base_in("test"))  # a split that is not split_of(base)
    lines = [open_item(s).model_dump(exclude_none=True) for s in ("train", "dev", "test")]
    lines.append({"id": "a1", "kind": "arithmetic", "messages": [{"role": "user", "content": "What is 2 + 3?"}]})
    bank = tmp_path / "bank.jsonl"
    bank.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [p.split for p in load_served(bank)] == ["train", None]  # a line from before the split counts as train
    assert [p.kind for p in load_checkable(bank)] == ["arithmetic"]


def test_only_open_lines_carry_references():
    with pytest.raises(ValueError, match="open"):
        PromptItem(
            id="a", kind="arithmetic", messages=[{"role": "user", "content": "What is 2 + 3?"}], references=["5"]
        )


def test_the_traffic_is_half_open_whatever_the_banks_counts():
    """Two checkable prompts beside many open ones: about half the requests still go to open prompts."""
    from serving.users import SimulatedUsers, load_served

    bank = load_served()
    prompts = [p for p in bank if p.kind == "open"][:200] + [p for p in bank if p.kind != "open"][:2]
    users = SimulatedUsers("http://127.0.0.1:9", prompts, seed=3)
    drawn = [users._draw()[1].kind == "open" for _ in range(2000)]
    assert 0.45 < sum(drawn) / len(drawn) < 0.55
    only_open = SimulatedUsers("http://127.0.0.1:9", prompts[:5], seed=3)
    assert all(only_open._draw()[1].kind == "open" for _ in range(50))
