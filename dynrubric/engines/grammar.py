"""JSON-schema constrained decoding for the in-process engine, with xgrammar.

xgrammar is the grammar library vLLM's own structured outputs use, so both engines constrain with the
same compiler. The grammar is compact JSON (no free whitespace, separators "," and ":"), as vLLM's
xgrammar backend builds it with `disable_any_whitespace` (`VllmServer` starts vLLM so): free whitespace
lets a small model spend its whole token budget on newlines.

Per decoding step each unfinished row's matcher writes the tokens its grammar allows next into a
bitmask, the bitmask sets every other logit to -inf (sampling then applies temperature and top-p as
usual), and the sampled token is fed back to the matcher. A row whose grammar can take no more tokens
is finished.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch


class SchemaGrammars:
    """Compiled grammars of one tokenizer and vocabulary, one per schema, compiled on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], threads: int = 1):
        import xgrammar as xgr

        # the model's vocabulary may be larger than the tokenizer's (a padded LM head): the bitmask
        # covers the model's, and ids the tokenizer does not know are never allowed
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, threads))
        self._compiled: dict[str, Any] = {}

    def compiled(self, schema: str) -> Any:
        if schema not in self._compiled:
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            self._compiled[schema] = self._compiler.compile_json_schema(
                schema, any_whitespace=False, separators=(",", ":")
            )
        return self._compiled[schema]

    def rows(self, schema: str, n: int) -> ConstrainedRows:
        return ConstrainedRows(self.compiled(schema), n, self.vocab_size)


class ConstrainedRows:
    """One grammar matcher per sequence of a decoding batch."""

    def __init__(self, compiled: Any, n: int, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self._matchers = [xgr.GrammarMatcher(compiled, terminate_without_stop_token=True) for _ in range(n)]
        self._bitmask = xgr.allocate_token_bitmask(n, vocab_size)

    def mask_(self, logits: torch.Tensor, active: Sequence[int]) -> torch.Tensor:
        """Set the logits of tokens the grammar forbids to -inf, in place, for the `active` rows."""
        if active:
            for i in active:
                self._matchers[i].fill_next_token_bitmask(self._bitmask, i)
            self._xgr.apply_token_bitmask_inplace(logits, self._bitmask, indices=list(active))
        return logits

    def accept(self, row: int, token: int) -> bool:
        """Feed the sampled token to the row's matcher; True when the row's grammar is complete."""
        matcher = self._matchers[row]
        if not matcher.accept_token(token):
            raise RuntimeError(f"grammar rejected token {token} that its own bitmask allowed")
        return matcher.is_terminated()


MAX_TEXT_LENGTH = 128


def json_text(min_length: int, max_length: int) -> dict[str, str]:
    """JSON Schema for a string of `min_length`..`max_length` printable characters of the Basic
    Multilingual Plane, without double quotes or backslashes (so no escapes are ever needed).

    Use it instead of minLength/maxLength: xgrammar 0.2.8 compiles a length-bounded string to
    min..max of any character but quote, backslash, CR and LF, which lets raw control characters (a
    tab) through unescaped, and `json.loads` rejects such output. It also takes UTF-8-encoded
    surrogates and some overlong 4-byte sequences for characters; the ranges here leave those out.
    One hole stays: an overlong 3-byte encoding of an ASCII character passes, and decodes to three
    U+FFFD, which can push the decoded text past `max_length`. xgrammar 0.2.8 fails to compile a
    repetition bound above 128 (and takes ~1.6 s for 128 on a 49k vocabulary), hence the cap.
    """
    if not 0 <= min_length <= max_length <= MAX_TEXT_LENGTH:
        raise ValueError(f"json_text needs 0 <= min_length <= max_length <= {MAX_TEXT_LENGTH}")
    chars = r"[ !#-\[\]-~\u00a0-\ud7ff\ue000-\uffff]"
    return {"type": "string", "pattern": f"^{chars}{{{min_length},{max_length}}}$"}
