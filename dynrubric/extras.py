"""Optional dependencies: each lives in a pyproject extra, and a missing one is an error naming that extra."""

from __future__ import annotations

import importlib
from types import ModuleType

from dynrubric.errors import DynrubricError


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """`import module`, or a DynrubricError saying which extra installs it and what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DynrubricError(
            f"{needed_for} needs {module.split('.')[0]}, which is not installed",
            f"pip install 'dynrubric[{extra}]' (or `make setup`)",
        ) from None
