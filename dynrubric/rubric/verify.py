"""Probabilistic verdicts: P(yes) for every (item, response) of a set from the verifier's next-token logprobs.

Layout: each verifier prompt is `[instructions, question, response]` + `[criterion, question to answer]`,
rendered with the chat template. Prompts are ordered response-major, so the M prompts of one response
are adjacent and share everything up to the criterion: the engine computes that prefix once (KV reuse in
the transformers engine, prefix caching in vLLM). All M x K prompts go out as ONE `score_next_token` call.

`v = P(Yes) / (P(Yes) + P(No))` where P(Yes) sums the probability of every single-token spelling of
Yes the tokenizer has (" Yes", "Yes", "yes", ...), likewise for No. When neither has any probability
(an engine that returns only its top-k logprobs), the verifier generates a short answer and reads it:
Yes = 1, No = 0, anything else = 0.5; each such hard verdict is counted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams
from dynrubric.rubric.items import Rubric, RubricItem

YES_SPELLINGS = (" Yes", "Yes", " yes", "yes", " YES", "YES")
NO_SPELLINGS = (" No", "No", " no", "no", " NO", "NO")

VERIFIER_INSTRUCTIONS = (
    "You are a strict grader. You will see a question, a response to it, and one criterion. "
    "Decide whether the response meets the criterion. Answer with exactly one word: Yes or No."
)
CRITERION_MARK = "\n\nCriterion: "


@dataclass(frozen=True)
class AnswerTokens:
    """The Yes and No spellings that are single, distinct tokens of the verifier's tokenizer."""

    yes: tuple[str, ...]
    no: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return self.yes + self.no

    @classmethod
    def of(cls, engine: Engine) -> AnswerTokens:
        tok = engine.tokenizer

        def single(spellings: Sequence[str]) -> dict[int, str]:
            out: dict[int, str] = {}
            for s in spellings:
                ids = tok.encode(s, add_special_tokens=False)
                if len(ids) == 1 and ids[0] not in out:
                    out[ids[0]] = s
            return out

        yes, no = single(YES_SPELLINGS), single(NO_SPELLINGS)
        if not yes or not no:  # a tokenizer with no whole-word Yes/No: use the first tokens
            first = engine.candidate_token_ids(YES_SPELLINGS[:2] + NO_SPELLINGS[:2])
            yes = yes or {first[s]: s for s in YES_SPELLINGS[:2]}
            no = no or {first[s]: s for s in NO_SPELLINGS[:2]}
        shared = set(yes) & set(no)
        yes = {i: s for i, s in yes.items() if i not in shared}
        no = {i: s for i, s in no.items() if i not in shared}
        if not yes or not no:
            raise ValueError("the verifier's tokenizer has no distinct first token for Yes and No")
        return cls(yes=tuple(yes.values()), no=tuple(no.values()))


def truncate_tokens(engine: Engine, text: str, budget: int) -> str:
    """`text` cut to at most `budget` tokens (marked with an ellipsis when cut)."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= budget:
        return text
    cut: str = engine.tokenizer.decode(ids[:budget], skip_special_tokens=True)
    return cut + " ..."


def response_prefix(question: str, response: str) -> str:
    return f"Question:\n{question}\n\nResponse:\n{response}"


def verifier_prompt(engine: Engine, question: str, response: str, criterion: str) -> str:
    user = (
        f"{response_prefix(question, response)}{CRITERION_MARK}{criterion}\n"
        "Does the response meet the criterion? Answer Yes or No."
    )
    return engine.render_chat([{"role": "system", "content": VERIFIER_INSTRUCTIONS}, {"role": "user", "content": user}])


def verdict_from_logprobs(logprobs: dict[str, float], answers: AnswerTokens) -> float | None:
    """P(Yes)/(P(Yes)+P(No)), or None when neither has probability mass."""

    def mass(spellings: Sequence[str]) -> float:
        total = 0.0
        for s in spellings:
            lp = logprobs.get(s)
            if isinstance(lp, (int, float)) and not math.isnan(lp) and lp != -math.inf:
                total += math.exp(min(lp, 0.0))
        return total

    p_yes, p_no = mass(answers.yes), mass(answers.no)
    if not (p_yes + p_no > 0.0) or not math.isfinite(p_yes + p_no):
        return None
    return p_yes / (p_yes + p_no)


_ANSWER = re.compile(r"\b(yes|no)\b", re.I)


def hard_verdict(text: str) -> float:
    m = _ANSWER.search(text)
    if m is None:
        return 0.5
    return 1.0 if m.group(1).lower() == "yes" else 0.0


class Verifier:
    """Judges a whole candidate set against a rubric with one batched logprob call."""

    def __init__(self, engine: Engine, response_token_budget: int = 512):
        self.engine = engine
        self.response_token_budget = response_token_budget
        self.answers = AnswerTokens.of(engine)

    def prompts(self, question: str, responses: Sequence[str], items: Rubric | Sequence[RubricItem]) -> list[str]:
        """M*K prompts, response-major: index k*M + m is (item m, response k)."""
        items = items.items if isinstance(items, Rubric) else items
        out: list[str] = []
        for response in responses:
            cut = truncate_tokens(self.engine, response, self.response_token_budget)
            out.extend(verifier_prompt(self.engine, question, cut, item.text) for item in items)
        return out

    def verify(self, question: str, responses: Sequence[str], rubric: Rubric) -> tuple[list[list[float]], int]:
        """(M x K raw P(yes) verdicts, number of hard fallback verdicts) for every item of `rubric`."""
        return self.verify_items(question, responses, rubric.items)

    def verify_items(
        self, question: str, responses: Sequence[str], items: Sequence[RubricItem]
    ) -> tuple[list[list[float]], int]:
        """(M x K raw P(yes) verdicts, number of hard fallback verdicts) for `items`."""
        m, k = len(items), len(responses)
        prompts = self.prompts(question, responses, items)
        scored = self.engine.score_next_token(prompts, self.answers.all)
        flat: list[float | None] = [verdict_from_logprobs(lp, self.answers) for lp in scored]
        missing = [i for i, v in enumerate(flat) if v is None]
        if missing:
            greedy = SamplingParams(max_tokens=3, temperature=0.0)
            outs = self.engine.generate([GenerationRequest(prompts[i], greedy) for i in missing])
            for i, completions in zip(missing, outs, strict=True):
                flat[i] = hard_verdict(completions[0].text if completions else "")
        verdicts = [[float(flat[r * m + i]) for r in range(k)] for i in range(m)]  # type: ignore[arg-type]
        return verdicts, len(missing)
