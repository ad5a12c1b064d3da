"""Every seed of a run, named: each draw of a training round (candidates, judging chunks, rubrics, anchors,
held-out evaluation) and eval-judge's real-set sampling has a path, and its seed is a hash of the path; the
judge's own calls and bulk-scored sets keep their block sequences (`judge_call_seed`, `set_seed`).

A seed starts a block of `SEED_BLOCK` seeds: the rubric generator's retries of one draw add 1, 2, ... to it
(rubric/generate.py), so two draws collide when their blocks overlap, not only when their seeds are equal.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Sequence
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


def judge_call_seed(root: int, call: int) -> int:
    """The seed of an evaluator's `call`-th call without a seed of its own (`dynrubric score`, `eval-judge`):
    consecutive blocks from `rubric.seed`, `root + SEED_BLOCK * call`. They are not hashed so that the judge's
    rubrics, and with them the shipped benchmark's numbers, stay those measured; within one evaluator the blocks
    never overlap, and a round's draws are hashed into [0, 2^62), far from them."""
    return root + SEED_BLOCK * call


def set_seed(root: int, prompt: str, responses: Sequence[str]) -> int:
    """The seed of one set judged by bulk scoring (`score --ray`) from its content, so that its scores are the
    same whichever actor scores it: `root + SEED_BLOCK * crc32(set)` (mod 2^31), as measured."""
    digest = zlib.crc32(json.dumps([prompt, list(responses)], ensure_ascii=False).encode())
    return (root + SEED_BLOCK * digest) % (2**31)
