"""What ingest keeps and how it cleans it: prompt filters and the PII scrub hook.

A filter returns the reason a query-log event is dropped (the `reason` label of
`dynrubric_ingest_filtered_total`) or None. The scrubber is any `str -> str` callable; the default
replaces email addresses and phone numbers, and `ingest.pii_scrubber = "module:function"` swaps it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from operator import attrgetter

import msgspec

from dynrubric.config import IngestConfig
from dynrubric.errors import DynrubricError
from streaming.events import AnyQueryLog, ChatMessage, ChatMessageRecord, QueryLogEvent

Scrubber = Callable[[str], str]

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
# a candidate phone number: digits with optional + prefix, spaces, dots, dashes, brackets (linear-time scan);
# _phone_or_keep then decides by its digits
PHONE = re.compile(r"(?<![\w+])[+(]?\d[\d\s().-]{5,}\d(?!\w)")
ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def scrub_pii(text: str) -> str:
    """Replace email addresses with <email> and phone numbers with <phone>."""
    if "@" in text:
        text = EMAIL.sub("<email>", text)
    if _ascii_digits(text) < 7:  # a phone number has 7 or more: most texts skip the regex scan
        return text
    return PHONE.sub(_phone_or_keep, text)


def _ascii_digits(text: str) -> int:
    """How many of 0-9 `text` holds: its UTF-8 bytes less those bytes deleted (two C passes, not ten
    str.count scans). An ASCII byte never occurs inside a multi-byte UTF-8 sequence, so bytes and characters
    agree; surrogatepass keeps a lone surrogate encodable (as three non-digit bytes)."""
    data = text.encode("utf-8", "surrogatepass")
    return len(data) - len(data.translate(None, b"0123456789"))


def _phone_or_keep(m: re.Match) -> str:
    s = m.group(0)
    digits = sum(c.isdigit() for c in s)
    # a bare digit run is more often a number in a maths prompt than a phone number
    looks_like_phone = 7 <= digits <= 15 and not s.isdigit() and not ISO_DATE.fullmatch(s)
    return "<phone>" if looks_like_phone else s


def load_scrubber(cfg: IngestConfig) -> Scrubber | None:
    if not cfg.scrub_pii:
        return None
    if cfg.pii_scrubber is None:
        return scrub_pii
    module, _, name = cfg.pii_scrubber.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise DynrubricError(
            f"ingest.pii_scrubber {cfg.pii_scrubber!r} cannot be loaded ({e})",
            "give 'importable.module:function', a function taking and returning a string",
        ) from None
    if not callable(fn):
        raise DynrubricError(f"ingest.pii_scrubber {cfg.pii_scrubber!r} is not callable", "point it at a function")
    return fn


class PromptFilter:
    """Shadow answers (the judged gate's second opinion, never shown to a user), empty prompts,
    over-long prompts and configured deny patterns are filtered out."""

    def __init__(self, cfg: IngestConfig):
        self.max_chars = cfg.max_prompt_chars
        self.deny = [re.compile(p) for p in cfg.deny_patterns]  # separately: each may carry its own flags

    def reason(self, event: AnyQueryLog) -> str | None:
        if event.shadow:
            return "shadow"
        parts = []
        asked = False  # a user message with more than whitespace
        for m in event.messages:  # one loop, no generators: this runs for every event
            if m.role != "assistant":
                parts.append(m.content)
                asked = asked or (m.role == "user" and not m.content.isspace() and m.content != "")
        if not asked:
            return "empty_prompt"
        prompt = "\n".join(parts)
        if len(prompt) > self.max_chars:
            return "too_long"
        if any(p.search(prompt) for p in self.deny):
            return "denied"
        return None


def scrubbed(event: AnyQueryLog, scrub: Scrubber) -> AnyQueryLog:
    """The event with the scrubber applied to every message and the response (the same object if clean)."""
    return scrubbed_all([event], scrub)[0]


def scrubbed_all(events: Sequence[AnyQueryLog], scrub: Scrubber) -> list[AnyQueryLog]:
    """`scrubbed` of each event, the texts of all of them scrubbed in one pass (`scrub_texts`)."""
    texts: list[str] = []
    for e in events:
        texts.extend(map(_CONTENT, e.messages))
        texts.append(e.response)
    cleaned = scrub_texts(texts, scrub)
    if cleaned == texts:  # most batches: nothing to replace
        return list(events)
    out: list[AnyQueryLog] = []
    start = 0
    for event in events:
        end = start + len(event.messages) + 1
        if cleaned[start:end] == texts[start:end]:
            out.append(event)
        else:
            out.append(_with_texts(event, cleaned[start : end - 1], cleaned[end - 1]))
        start = end
    return out


def scrub_texts(texts: list[str], scrub: Scrubber) -> list[str]:
    """`[scrub(t) for t in texts]`. The default scrubber changes only a text with an "@" or 7 or more ASCII
    digits; those are found for all texts at once (two C passes over them joined), and only they are scrubbed."""
    if scrub is not scrub_pii:
        return [scrub(t) for t in texts]
    out = list(texts)
    for i in _pii_candidates(texts):
        out[i] = scrub_pii(texts[i])
    return out


_CONTENT = attrgetter("content")
_ALL_BYTES = bytes(range(256))
_NOT_DIGIT_OR_NUL = _ALL_BYTES.translate(None, b"0123456789\x00")
_NOT_AT_OR_NUL = _ALL_BYTES.translate(None, b"@\x00")


def _pii_candidates(texts: list[str]) -> list[int] | range:
    """The indices of the texts that hold an "@" or 7 or more ASCII digits (`scrub_pii`'s shortcuts). The texts'
    UTF-8 bytes joined by NUL, less every byte but the digits (or the "@") and the NULs, split at the NULs: each
    text's digits (or "@"s). A text that holds a NUL itself makes the split miscount: then every index."""
    data = "\x00".join(texts).encode("utf-8", "surrogatepass")
    digits = data.translate(None, _NOT_DIGIT_OR_NUL).split(b"\x00")
    ats = data.translate(None, _NOT_AT_OR_NUL).split(b"\x00")
    if len(digits) != len(texts):
        return range(len(texts))
    return [i for i, (d, a) in enumerate(zip(digits, ats, strict=True)) if len(d) >= 7 or a]


def _with_texts(event: AnyQueryLog, contents: list[str], response: str) -> AnyQueryLog:
    """The event with its messages' contents and its response replaced (each message keeps its role)."""
    if isinstance(event, QueryLogEvent):
        messages = [ChatMessage(role=m.role, content=c) for m, c in zip(event.messages, contents, strict=True)]
        return event.model_copy(update={"messages": messages, "response": response})
    records = [ChatMessageRecord(role=m.role, content=c) for m, c in zip(event.messages, contents, strict=True)]
    return msgspec.structs.replace(event, messages=records, response=response)
