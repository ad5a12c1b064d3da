"""Calibration answers: known-bad answers judged beside every set, to de-bias and to distrust the verifier.

Each set is judged together with A synthetic answers that no rubric should prefer to a real attempt:
the empty answer, an off-topic paragraph, and the question echoed back. They serve twice:

1. De-biasing, per verifier-judged item m. A small verifier says "Yes" to some criteria whatever the
   response (length, echoed words); the calibration answers measure that floor. With `z` the polarity-oriented
   verdict (`v`, or `1 - v` for a flaw) and `a_m` the calibration answers' mean `z` on item m:

       z'_m(y) = max(0, z_m(y) - a_m) / (1 - a_m)          (z'_m = 0 for all y when a_m >= 1)

   so an item credits a response only for what it gives beyond a known-bad answer. Checked items are
   exact and are not calibrated.
2. Trust, per item a model or a vote wrote (generated, consensus; evaluator.py applies it), with the
   calibrated verdicts (`rubric.trust_rule`, leads under `eps` excused):

       every (default): overruled when a calibration answer meets the item better than ANY real candidate
       best:            overruled only when a calibration answer meets it better than the set's BEST one

   `every` is the default because it keeps noise out of training: the items it drops and `best` keeps are
   mostly model-written items met by any non-empty text, which order a set's junk but, in a set whose
   ground truth ties, decide the advantages alone (docs/benchmarks.md: the ordered benchmark under both
   rules on the same verdicts, and the learning runs). That an empty answer ranks below every attempt is
   the floor item's job (derived.py), a check rather than an accident of the generated items.

   An overruled item is noise for this set and weighs nothing. Items read off the prompt (its ground
   truth, the echo veto) are never overruled: the echoed question that contains the required keyword
   meets that constraint for real. A set left with no item but the echo veto is untrusted: zero
   advantage, counted. docs/benchmarks.md has what the rules did on real sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

OFF_TOPIC = (
    "The weather was mild today, and the park was full of people walking their dogs. Later we had "
    "soup for dinner and watched an old film."
)


def known_bad_answers(question: str) -> list[str]:
    """The known-bad answers judged with every set: empty, off-topic, the question echoed."""
    return ["", OFF_TOPIC, question]


def calibrate_row(z: Sequence[float], n_real: int) -> list[float]:
    """One verifier-judged item's oriented verdicts, real candidates first then the calibration answers,
    de-biased against the calibration answers' mean (module docstring). Returns the same layout."""
    known_bad = z[n_real:]
    if not known_bad:
        return list(z)
    floor = sum(known_bad) / len(known_bad)
    if floor >= 1.0:
        return [0.0] * len(z)
    return [max(0.0, x - floor) / (1.0 - floor) for x in z]


def calibration_outranks(
    real_scores: Sequence[float],
    calibration_scores: Sequence[float],
    eps: float,
    rule: Literal["every", "best"] = "every",
) -> bool:
    """True when some calibration answer scores above any real candidate (`every`) or above the best one (`best`)
    by at least `eps`."""
    if not real_scores or not calibration_scores:
        return False
    beaten = min(real_scores) if rule == "every" else max(real_scores)
    return max(calibration_scores) - beaten >= eps
