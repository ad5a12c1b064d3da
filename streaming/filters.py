"""What ingest keeps and how it cleans it: prompt filters and the PII scrub hook.

A filter returns the reason a query-log event is dropped (the `reason` label of
`dynrubric_ingest_filtered_total`) or None. The scrubber is any `str -> str` callable; the default
replaces email addresses and phone numbers, and `ingest.pii_scrubber = "module:function"` swaps it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence

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
        prompt = "\n".join(m.content for m in event.messages if m.role != "assistant")
        if not any(m.content.strip() for m in event.messages if m.role == "user"):
            return "empty_prompt"
        if len(prompt) > self.max_chars:
            return "too_long"
        if any(p.search(prompt) for p in self.deny):
            return "denied"
        return None


def scrubbed(event: AnyQueryLog, scrub: Scrubber) -> AnyQueryLog:
    """The event with the scrubber applied to every message and the response (the same object if clean)."""
    originals: Sequence[ChatMessage | ChatMessageRecord] = event.messages
    contents = [scrub(m.content) for m in originals]
    response = scrub(event.response)
    if response == event.response and all(c == m.content for c, m in zip(contents, originals, strict=True)):
        return event
    if isinstance(event, QueryLogEvent):
        messages = [ChatMessage(role=m.role, content=c) for m, c in zip(event.messages, contents, strict=True)]
        return event.model_copy(update={"messages": messages, "response": response})
    records = [ChatMessageRecord(role=m.role, content=c) for m, c in zip(event.messages, contents, strict=True)]
    return msgspec.structs.replace(event, messages=records, response=response)
