"""The identity of a chat prompt: one function for the whole project.

The replay store keys logged prompts with it (Parquet column `prompt_key`, its `prompt_shards` index),
and the trainer keys prompt files, held-out prompts and human-ranked rankings files with it, so a ranking
written for a prompt is found whichever source the prompt came from. It is the store's original
algorithm, so replay stores written before keep their keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def prompt_key(messages: Iterable[tuple[str, str]]) -> str:
    """32 hex digits: blake2b-128 of the (role, content) pairs, each joined by a unit separator and
    the pairs by a record separator (characters that never occur in a role)."""
    canon = "\x1e".join(map("\x1f".join, messages))  # role US content, per pair (a C loop, not a generator)
    return hashlib.blake2b(canon.encode(), digest_size=16).hexdigest()
