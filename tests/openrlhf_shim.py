"""Load pieces of the installed openrlhf 0.11.2 without its heavy runtime (deepspeed, ray, flash-attn).

openrlhf is installed `--no-deps` (it pins transformers 5.15 and needs flash-attn and deepspeed, none of
which fit this CPU environment). Its package `__init__`s import the Ray actors, so nothing here imports
`openrlhf` itself. Instead:

- `loss_modules()` loads `openrlhf/models/utils.py` and `openrlhf/models/loss.py` from their files under
  a private package name. `utils.py` does `import deepspeed` at import time only (the functions used here,
  `compute_approx_kl` and `masked_mean`, never touch it), so an empty module stands in for deepspeed
  while the files load, and is removed again afterwards.
- `train_ppo_ray_parser_run(argv)` runs the real `if __name__ == "__main__":` block of
  `openrlhf/cli/train_ppo_ray.py` (argument parser AND its validation asserts) with `train` replaced by
  a function that captures the parsed, hierarchised args. The module's top-level imports (ray, the
  trainer) are not executed; `openrlhf.utils.config` (pure Python) is loaded from its file.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

PRIVATE = "_openrlhf_under_test"


def openrlhf_dir() -> Path | None:
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def loss_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """(openrlhf.models.utils, openrlhf.models.loss), loaded from the installed files."""
    root = openrlhf_dir()
    assert root is not None, "openrlhf is not installed"
    pkg = types.ModuleType(f"{PRIVATE}.models")
    pkg.__path__ = [str(root / "models")]
    parent = types.ModuleType(PRIVATE)
    parent.__path__ = []
    had_deepspeed = "deepspeed" in sys.modules
    sys.modules.setdefault(PRIVATE, parent)
    sys.modules.setdefault(f"{PRIVATE}.models", pkg)
    if not had_deepspeed:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # import-time only, see above
    try:
        utils = _load(f"{PRIVATE}.models.utils", root / "models" / "utils.py")
        loss = _load(f"{PRIVATE}.models.loss", root / "models" / "loss.py")
    finally:
        if not had_deepspeed:
            del sys.modules["deepspeed"]
    return utils, loss


def train_ppo_ray_parse(argv: list[str]) -> Any:
    """Parse `argv` exactly as `python -m openrlhf.cli.train_ppo_ray argv` would, validation included;
    return the hierarchised args it would hand to `train(args)`. Raises SystemExit on a bad flag and
    AssertionError where its own checks fail."""
    root = openrlhf_dir()
    assert root is not None, "openrlhf is not installed"
    source = (root / "cli" / "train_ppo_ray.py").read_text()
    tree = ast.parse(source)
    main_block = next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    code = compile(ast.Module(body=main_block.body, type_ignores=[]), str(root / "cli" / "train_ppo_ray.py"), "exec")
    captured: dict[str, Any] = {}
    namespace: dict[str, Any] = {"__name__": "__main__", "train": lambda args: captured.setdefault("args", args)}
    exec(compile("import argparse, os\nfrom datetime import datetime", "<imports>", "exec"), namespace)
    config_name = "openrlhf.utils.config"
    saved = {n: sys.modules.get(n) for n in (config_name,)}
    saved_argv = sys.argv
    sys.modules[config_name] = _load(f"{PRIVATE}.utils_config", root / "utils" / "config.py")
    sys.argv = ["train_ppo_ray", *argv]
    try:
        exec(code, namespace)
    finally:
        sys.argv = saved_argv
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return captured["args"]
