"""What every command gets from the CLI's root callback: the config source, loaded on first use.

The tiers' command modules import `settings_of` from here; `dynrubric/app/cli.py` (the composition
root) imports them. Nothing here imports a command module, so the dependency direction is plain:
cli -> tier commands -> context -> config.
"""

from __future__ import annotations

from pathlib import Path

import typer

from dynrubric.config import Settings, load_settings


class Context:
    def __init__(self, config_path: Path | None):
        self.config_path = config_path
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(self.config_path)
        return self._settings


def settings_of(ctx: typer.Context) -> Settings:
    """The validated settings of the command line this command runs under."""
    return ctx.find_root().obj.settings
