"""`dynrubric train ...` and `dynrubric registry ...`: the training tier's commands.

Heavy machinery (torch, engines) is imported inside command bodies so `dynrubric --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dynrubric.cli import settings_of

console = Console()
registry_app = typer.Typer(help="The checkpoint registry: versions, lineage, states.", no_args_is_help=True)
train_app = typer.Typer(help="Policy updates: embedded GRPO rounds, OpenRLHF on Ray.", no_args_is_help=True)


def _registry(ctx: typer.Context):
    from dynrubric.registry import open_registry

    return open_registry(settings_of(ctx))


# ---------------------------------------------------------------- registry
@registry_app.command("list")
def registry_list(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False
) -> None:
    """Every version, oldest first, with its parent, round, state and headline metrics."""
    checkpoints = _registry(ctx).list()
    if as_json:
        for c in checkpoints:
            print(json.dumps(c.to_json()))
        return
    table = Table(title=f"{len(checkpoints)} checkpoint(s)")
    for col in ("version", "parent", "round", "state", "reward_mean", "kl", "sha256", "reason"):
        table.add_column(col)
    for c in checkpoints:
        reward, kl = c.metrics.get("reward_mean"), c.metrics.get("kl")
        table.add_row(
            c.version,
            c.parent or "-",
            "-" if c.round is None else str(c.round),
            c.state.value,
            "-" if reward is None else f"{reward:.4f}",
            "-" if kl is None else f"{kl:.5f}",
            c.weights_sha256[:12],
            c.reason or "",
        )
    console.print(table)


@registry_app.command("show")
def registry_show(ctx: typer.Context, version: Annotated[str, typer.Argument(help="version id")]) -> None:
    """One version as JSON (path, hash, metrics, state, reason)."""
    print(json.dumps(_registry(ctx).get(version).to_json(), indent=2))


@registry_app.command("register")
def registry_register(
    ctx: typer.Context,
    model_dir: Annotated[Path, typer.Argument(help="a save_pretrained directory")],
    parent: Annotated[str | None, typer.Option(help="parent version")] = None,
    version: Annotated[str | None, typer.Option(help="version id (default: v<N>)")] = None,
    stable: Annotated[bool, typer.Option("--stable", help="promote it right away (a base model)")] = False,
) -> None:
    """Copy a model dir into the registry as a new version."""
    registry = _registry(ctx)
    ckpt = registry.register(model_dir, parent=parent, round=None, metrics={}, version=version)
    if stable:
        ckpt = registry.promote(ckpt.version)
    console.print(f"registered [bold]{ckpt.version}[/] ({ckpt.state.value}) at {ckpt.path}")


@registry_app.command("promote")
def registry_promote(ctx: typer.Context, version: Annotated[str, typer.Argument(help="version id")]) -> None:
    """Make a version stable; the previous stable version is retired."""
    ckpt = _registry(ctx).promote(version)
    console.print(f"[green]stable[/] {ckpt.version}")


@registry_app.command("reject")
def registry_reject(
    ctx: typer.Context,
    version: Annotated[str, typer.Argument(help="version id")],
    reason: Annotated[str, typer.Option(help="why (recorded)")],
) -> None:
    """Reject a version for good, recording why."""
    ckpt = _registry(ctx).reject(version, reason)
    console.print(f"[red]rejected[/] {ckpt.version}: {ckpt.reason}")
