"""The project's import graph: no module imports itself back through others, and each module imports
on its own in a fresh interpreter (`python -c "import X"`), whatever was imported before it."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dynrubric", "streaming", "serving")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its body (function-local imports included: a circle
    through a lazy import is still a circle, only hidden until the function runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a package path: its deepest module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how packages re-export; a submodule that
    # imports its package gets it initialised first, so those edges are not circles
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".") and not t.startswith(name + ".")}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


CORE = ("dynrubric.engines", "dynrubric.rubric", "dynrubric.train")
TIERS = ("streaming", "serving")
APP = "dynrubric.app"


def _within(name: str, packages: tuple[str, ...] | str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ((packages,) if isinstance(packages, str) else packages))


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Arrows that point up: the core (engines, rubric, train) into a tier or the application, a tier into the
    application. The shared modules at the top of `dynrubric/` (config, errors, registry, ...) are below all."""
    found = []
    for name, targets in sorted(graph.items()):
        if _within(name, CORE):
            above: tuple[str, ...] = (*TIERS, APP)
        elif _within(name, TIERS):
            above = (APP,)
        elif name.startswith("dynrubric.") and not _within(name, APP) and name != "dynrubric.__main__":
            above = (*TIERS, APP)  # the shared modules (config, errors, registry, the reward server)
        else:
            continue
        found += [f"{name} -> {t}" for t in sorted(targets) if _within(t, above)]
    return found


def test_layering_violations_are_found():
    assert layering_violations({"dynrubric.rubric.x": {"streaming.store"}, "serving.a": {"dynrubric.app.cli"}}) == [
        "dynrubric.rubric.x -> streaming.store",
        "serving.a -> dynrubric.app.cli",
    ]
    assert layering_violations({"dynrubric.app.cli": {"serving.a", "dynrubric.rubric.x"}}) == []


def test_no_arrow_points_up_the_layers():
    """The core imports neither tier nor the application; the tiers do not import the application; the shared
    modules at the top of `dynrubric/` import neither (function-local imports count)."""
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert layering_violations(graph) == []


def test_every_module_imports_alone():
    """Each module in a fresh child (fork of a parent that imported only third-party packages, so the
    child pays the project's imports alone, not torch's again): a circle or a missing dependency fails."""
    modules = project_modules()
    third_party = {
        top
        for name, path in modules.items()
        for top in _top_level_imports(path)
        if top not in PACKAGES and top not in sys.builtin_module_names
    }
    for top in sorted(third_party):  # optional extras (vllm, peft, psycopg...) may be absent
        if importlib.util.find_spec(top) is not None:
            try:
                __import__(top)
            except Exception:
                pass
    failures = []
    for name in modules:
        if name.split(".")[-1] == "__main__":
            continue
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(read)
            code = 0
            try:
                for loaded in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
                    del sys.modules[loaded]
                __import__(name)
            except BaseException as e:
                os.write(write, f"{name}: {type(e).__name__}: {e}".encode()[:2000])
                code = 1
            os._exit(code)
        os.close(write)
        message = os.read(read, 4000).decode()
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failures.append(message or f"{name}: child exited {status}")
    assert not failures, "\n".join(failures)


def _top_level_imports(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_the_report_command_does_not_import_torch(tmp_path: Path):
    """`dynrubric report` only reads the run log and draws it: run in a fresh interpreter over a one-step
    run log, it must leave torch (seconds to import, gigabytes in a GPU image) unloaded."""
    import subprocess

    from tests.run_records import policy_step, round_summary, write_runlog

    (tmp_path / "train").mkdir()
    write_runlog(tmp_path / "train" / "runlog.jsonl", [round_summary(1, [policy_step(0)])])
    code = (
        "import sys\n"
        "from dynrubric.app.cli import main\n"
        "sys.argv = ['dynrubric', 'report']\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    print('torch loaded:', 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "report: " in done.stdout, done.stdout + done.stderr
    assert "torch loaded: False" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "report" / "run.png").is_file()
