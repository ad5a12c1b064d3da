"""Every seed of a run, named: a round's draws (candidates, judging chunks, rubrics, anchors, held-out) each
have a path, and the seed is a hash of it."""

from __future__ import annotations

import hashlib

SEED_BLOCK = 1000  # a derived seed starts a block: the rubric generator's retries add 1, 2, ... to it


def derive_seed(root: int, *path: str | int) -> int:
    """The seed named by `path` under the run's `train.seed`: blake2b of (root, *path), in [0, 2^62 - SEED_BLOCK).

    Distinct paths give independent seeds, and over 2^62 two blocks of a run overlap with negligible probability
    (n^2 SEED_BLOCK / 2^62 for n seeds), where integer offsets collide by construction: with `root + 101 step + i`,
    judging chunk j of step s (`i = 1000 + j`) drew the seed of index j - 10 of step s + 10. Every consumer takes
    64-bit seeds (torch generators, vLLM's `seed`, `random.Random`).
    """
    digest = hashlib.blake2b(repr((root, *path)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**62 - SEED_BLOCK)


def round_seed(root: int, round_id: int, purpose: str, step: int, i: int = 0) -> int:
    """The seed of one draw of a training round: `purpose` names it ("candidates", "judging", "anchors",
    "rubrics", "heldout"), `step` the round's step, `i` the index within it (a judging chunk)."""
    return derive_seed(root, "round", round_id, purpose, step, i)
