"""Open quality: how close an answer to an open prompt comes to what strong models or experts wrote there.

No model, no reward: a pure, deterministic word-overlap measure that no reward arm reads. It is what the
simulated users' preference on open prompts is built on (serving/users.py) and what the evaluation of
versions can report on open prompts beside the checkers. The references and criteria come from the prompt
bank's open lines (scripts/open_prompts.py: Arena-Hard's o3-mini and Gemini answers, HealthBench's ideal
completions and physician criteria, WritingBench's checklists); the judge never sees them.

Formula. `W(t)` is the content-word set of a text: lower-cased runs of letters and digits, tokens of one
character that are not digits dropped, a small inline English stopword list dropped, a crude plural cut
from words of five or more letters ("ies" -> "y", else a final "s" but not "ss"). With `P = W(prompt)`:

    R          = W(response) - P                        (echoing the prompt earns nothing)
    T_i        = W(first max_words words of reference i) - P
    F1(R, T)   = 2 |R & T| / (|R| + |T|)                (the harmonic mean of precision and recall)
    quality    = max_i F1(R, T_i)

over the references whose `T_i` is not empty. A prompt without a usable reference is measured the same
way against each criterion with positive points, `T_j = W(criterion text) - P - RUBRIC_WORDS` (the
rubric's own vocabulary, "correctly states that...", is not content), max over j. An empty response, an
empty `R` (a pure echo), or nothing to compare with scores 0. The result is in [0, 1].

References are cut to their first `max_words` words because the policy's answers are short (the demo
serves 48 tokens, about 35 words): recall against a 600-word essay would be near 0 for any answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

#: words of a reference compared with an answer (the demo serves 48 tokens, about 35 words)
REFERENCE_WORDS = 40

STOPWORDS: frozenset[str] = frozenset(
    """
    a about above after again against all also am an and any are aren as at be because been before being
    below between both but by can cannot could couldn did didn do does doesn doing don down during each
    else etc even ever every few for from further get gets got had hadn has hasn have haven having he her
    here hers herself him himself his how however i if in into is isn it its itself just let ll may me
    might more most much must mustn my myself no nor not now of off often on once one only or other ought
    our ours ourselves out over own per please quite rather re really same shall shan she should shouldn
    so some such than that the their theirs them themselves then there these they this those though
    through thus to too under until up upon us use used using ve very via was wasn we were weren what when
    where which while who whom whose why will with within without won would wouldn yes yet you your yours
    yourself yourselves
    """.split()
)

#: how rubric criteria talk about a response, not what it should contain
RUBRIC_WORDS: frozenset[str] = frozenset(
    """
    response responses answer answers correctly correct incorrectly states state stated mention mentions
    mentioned include includes included including provide provides provided explain explains explained
    evaluate evaluates evaluated assess assesses assessed ensure ensures ensuring clearly clear well
    whether user user's model fails fail failing appropriate appropriately adequately adequate specific
    specifically relevant accurately accurate
    """.split()
)

_TOKEN = re.compile(r"[^\W_]+")


def _norm(token: str) -> str:
    """A crude plural: words of five or more letters lose "ies" -> "y" or a final "s" (not "ss")."""
    if len(token) < 5 or not token.endswith("s") or token.endswith("ss"):
        return token
    return token[:-3] + "y" if token.endswith("ies") else token[:-1]


def content_words(text: str, max_words: int | None = None) -> set[str]:
    """`W(text)` of the module docstring; `max_words`: of the first that many tokens only."""
    tokens = _TOKEN.findall(text.lower())
    if max_words is not None:
        tokens = tokens[:max_words]
    return {_norm(t) for t in tokens if (len(t) > 1 or t.isdigit()) and t not in STOPWORDS}


def f1(response: set[str], target: set[str]) -> float:
    """Harmonic mean of precision |R & T| / |R| and recall |R & T| / |T|; 0 when either set is empty."""
    if not response or not target:
        return 0.0
    return 2 * len(response & target) / (len(response) + len(target))


def open_quality(
    prompt_text: str,
    response: str,
    references: Sequence[str],
    criteria: Sequence[tuple[str, int]],
    *,
    max_words: int = REFERENCE_WORDS,
) -> float:
    """Closeness of `response` to the references (else to the positive criteria) in [0, 1]; module docstring."""
    if max_words < 1:
        raise ValueError("max_words must be at least 1")
    prompt = content_words(prompt_text)
    answer = content_words(response) - prompt
    if not answer:
        return 0.0
    targets: Iterable[set[str]] = [t for r in references if (t := content_words(r, max_words) - prompt)]
    if not targets:
        targets = [content_words(text) - prompt - RUBRIC_WORDS for text, points in criteria if points > 0]
    return max((f1(answer, t) for t in targets), default=0.0)
