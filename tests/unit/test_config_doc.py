"""docs/configuration.md is what the config schema gives (scripts/make_config_doc.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]


def test_the_configuration_page_is_generated_from_the_schema():
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_config_doc.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr + r.stdout


def test_the_page_lists_every_key_and_what_each_profile_changes():
    from dynrubric.config import Settings
    from dynrubric.config_loader import profile_names

    text = (REPO / "docs" / "configuration.md").read_text()

    def listed(model: type[BaseModel], section: str) -> None:
        assert f"## `{section}`" in text
        for key, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                listed(field.annotation, f"{section}.{key}")
            else:
                assert f"| `{key}` |" in text, (section, key)

    for name, field in Settings.model_fields.items():
        listed(field.annotation, name)
    for name in profile_names():
        assert f"## Profile `{name}`" in text
    assert "| `train.grpo.lr` | `1e-06` | `5e-05` |" in text  # the demo's learning rate, read off its profile file
