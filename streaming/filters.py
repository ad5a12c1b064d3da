"""What ingest keeps and how it cleans it: prompt filters and the PII scrub hook.

A filter returns the reason a query-log event is dropped (the `reason` label of
`dynrubric_ingest_filtered_total`) or None. The scrubber is any `str -> str` callable; the default
replaces email addresses and phone numbers, and `ingest.pii_scrubber = "module:function"` swaps it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from dynrubric.config import IngestConfig
from dynrubric.errors import DynrubricError
from streaming.events import ChatMessage, QueryLogEvent

Scrubber = Callable[[str], str]

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
# international or local numbers with at least 7 digits, allowing spaces, dots, dashes and brackets
PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{1,4}\)[\s.-]?)?\d{2,4}(?:[\s.-]?\d{2,4}){2,4}(?![\w])")


def scrub_pii(text: str) -> str:
    """Replace email addresses with <email> and phone numbers with <phone>."""
    if "@" in text:
        text = EMAIL.sub("<email>", text)
    return PHONE.sub(_phone_or_keep, text)


ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


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
    """Empty prompts, over-long prompts and configured deny patterns are filtered out."""

    def __init__(self, cfg: IngestConfig):
        self.max_chars = cfg.max_prompt_chars
        self.deny = re.compile("|".join(f"(?:{p})" for p in cfg.deny_patterns)) if cfg.deny_patterns else None

    def reason(self, event: QueryLogEvent) -> str | None:
        prompt = "\n".join(m.content for m in event.messages if m.role != "assistant")
        if not any(m.content.strip() for m in event.messages if m.role == "user"):
            return "empty_prompt"
        if len(prompt) > self.max_chars:
            return "too_long"
        if self.deny is not None and self.deny.search(prompt):
            return "denied"
        return None


def scrubbed(event: QueryLogEvent, scrub: Scrubber) -> QueryLogEvent:
    """The event with the scrubber applied to every message and the response."""
    messages = [ChatMessage(role=m.role, content=scrub(m.content)) for m in event.messages]
    return event.model_copy(update={"messages": messages, "response": scrub(event.response)})
