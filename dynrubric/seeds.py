"""Every seed of a run, named: each draw (a round's candidates, judging chunks, rubrics, anchors, held-out
evaluation; an evaluator's calls; a scored set) has a path, and its seed is a hash of the path.

A seed starts a block of `SEED_BLOCK` seeds: the rubric generator's retries of one draw add 1, 2, ... to it
(rubric/generate.py), so two draws collide when their blocks overlap, not only when their seeds are equal.
"""

from __future__ import annotations

import hashlib
from typing import Literal

SEED_BLOCK = 1000  # a derived seed starts a block: the rubric generator's retries add 1, 2, ... to it

#: the draws of a training round, each with its own seed per step (train/rounds.py)
RoundPurpose = Literal["candidates", "judging", "anchors", "rubrics", "heldout"]


def derive_seed(root: int, *path: str | int) -> int:
    """The seed named by `path` under the root seed (`train.seed`, `rubric.seed`): blake2b of (root, *path),
    in [0, 2^62 - SEED_BLOCK).

    Distinct paths give independent seeds, and over 2^62 two blocks of a run overlap with negligible probability
    (n^2 SEED_BLOCK / 2^62 for n seeds), where integer offsets collide by construction: with `root + 101 step + i`,
    judging chunk j of step s (`i = 1000 + j`) drew the seed of index j - 10 of step s + 10. Every consumer takes
    64-bit seeds (torch generators, vLLM's `seed`, `random.Random`).
    """
    digest = hashlib.blake2b(repr((root, *path)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**62 - SEED_BLOCK)


def round_seed(root: int, round_id: int, purpose: RoundPurpose, step: int, i: int = 0) -> int:
    """The seed of one draw of a training round: `purpose` names it, `step` the round's step, `i` the index
    within it (a judging chunk)."""
    return derive_seed(root, "round", round_id, purpose, step, i)
