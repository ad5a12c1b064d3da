"""What every command gets from the CLI's root callback: the config files, loaded under a profile on first use.

The tiers' command modules import `settings_of` from here; `dynrubric/app/cli.py` (the composition
root) imports them. Nothing here imports a command module, so the dependency direction is plain:
cli -> tier commands -> context -> config_loader -> config.
"""

from __future__ import annotations

from pathlib import Path

import typer

from dynrubric.config import Settings
from dynrubric.config_loader import DEFAULT_PROFILE, load_settings


class Context:
    def __init__(self, config_paths: list[Path]):
        self.config_paths = config_paths
        self._settings: dict[str, Settings] = {}

    def settings(self, profile: str) -> Settings:
        """The settings under `profile` with the `-c` files on top (loaded once per profile)."""
        if profile not in self._settings:
            self._settings[profile] = load_settings(self.config_paths, profile=profile)
        return self._settings[profile]


def settings_of(ctx: typer.Context, profile: str = DEFAULT_PROFILE) -> Settings:
    """The validated settings of the command line this command runs under."""
    return ctx.find_root().obj.settings(profile)
