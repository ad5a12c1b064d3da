"""The official IFEval and IFBench prompts as training-side prompts, for the evaluation of versions.

`dynrubric.rubric.official` reads the benchmark files and grades with the official checkers; this module
turns its graded prompts into `TrainPrompt`s (one user message, the benchmark's text as is), so the
evaluation samples them like any held-out prompt and checks each answer with `OfficialTruth.passes`.
None of these prompts is ever a training prompt.
"""

from __future__ import annotations

from dynrubric.rubric.official import Benchmark, OfficialTruth, graded_prompts
from dynrubric.train.prompts import TrainPrompt, make_prompt


def official_prompts(benchmark: Benchmark) -> list[tuple[TrainPrompt, OfficialTruth]]:
    """The benchmark's graded prompts in file order, excluded ones dropped
    (`dynrubric.rubric.official.excluded_prompts` lists those, with why)."""
    return [(make_prompt(p.prompt), p.truth) for p in graded_prompts(benchmark)]
