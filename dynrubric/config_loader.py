"""Builds the settings (dynrubric/config.py) from their sources and says which key is wrong when one is.

Sources, later ones winning key by key:

    schema defaults  <  profile  <  YAML files of `-c` in the order given  <  DYNRUBRIC_* environment

A profile is a YAML file shipped in dynrubric/profiles/ (`production`: the schema defaults; `demo`: what
`dynrubric up` runs with on a 2-core CPU); `dynrubric config show --profile NAME` prints the result. Without
`-c`, `$DYNRUBRIC_CONFIG` names the one file. Nested keys use `__` in the environment:
`DYNRUBRIC_ENGINE__KIND=openai-http`. Every section forbids unknown keys, and every `DYNRUBRIC_*` variable
must name a key (or be DYNRUBRIC_CONFIG), so a typo is an error that names the key and the closest valid name
instead of a silently ignored setting. The one exception is what Kubernetes adds to every pod's environment for
each Service of its namespace (`service_links`): a Service `dynrubric-router` is `DYNRUBRIC_ROUTER_SERVICE_HOST`
and its family, which are no settings and are ignored.

Paths resolve the same from any working directory: a relative path in a YAML file is relative to that
file, one in the environment to the directory the command runs in, and every path is absolute after
loading (`~` is kept and expanded where the path is used). The state dir defaults to the user's state
dir, `$XDG_STATE_HOME/dynrubric` (`~/.local/state/dynrubric`).
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import EnvSettingsSource

from dynrubric.config import ENV_PREFIX, Settings
from dynrubric.errors import DynrubricError

CONFIG_ENV = "DYNRUBRIC_CONFIG"
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
#: the profile of every command but `dynrubric up` (whose default is `demo`)
DEFAULT_PROFILE = "production"
#: keys that were renamed (old -> new; `[]` stands for a list item): a file or variable naming the old key is an
#: error saying the new one, not a silently ignored setting
RENAMED_KEYS = {
    "rubric.anchors": "rubric.calibration_answers",
    "train.coevolve.anchors": "train.coevolve.ranking_source",
    "train.coevolve.anchors_file": "train.coevolve.rankings_file",
    "train.coevolve.anchor_lambda": "train.coevolve.ranking_weight",
    "serving.engines[].kind": "serving.engines[].server",
}


def profile_names() -> list[str]:
    """The shipped profiles: the YAML files of dynrubric/profiles/."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def profile_path(name: str) -> Path:
    """The file of profile `name`; an unknown name is an error naming the choices."""
    names = profile_names()
    if name not in names:
        raise DynrubricError(f"unknown profile {name!r} (--profile)", f"use one of: {', '.join(names)}")
    return PROFILES_DIR / f"{name}.yaml"


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    """A config file's sections; every way it can be unreadable is an error naming the file and the fix."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise DynrubricError(
            f"config file {path} does not exist", f"pass an existing YAML file or unset {CONFIG_ENV}"
        ) from None
    except IsADirectoryError:
        raise DynrubricError(f"config file {path} is a directory", "pass a YAML file, e.g. -c dynrubric.yaml") from None
    except (PermissionError, UnicodeDecodeError) as e:
        raise DynrubricError(f"config file {path} cannot be read ({e})", "pass a readable UTF-8 YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise DynrubricError(f"config file {path} is not valid YAML{where}", "fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DynrubricError(
            f"config file {path} must hold a mapping of sections, got {type(data).__name__}",
            "write `section: {key: value}` pairs, as `dynrubric config show` prints them",
        )
    return data


def _describe(error: ErrorDetails) -> str:
    key = ".".join(str(p) for p in error["loc"])
    env = ENV_PREFIX + "__".join(str(p).upper() for p in error["loc"])
    if error["type"] == "extra_forbidden":
        # serving.engines.0.kind -> serving.engines[].kind
        renamed = RENAMED_KEYS.get(re.sub(r"\.(\d+)(?=\.|$)", "[]", key))
        if renamed is not None:
            return f"config key '{key}' was renamed to '{renamed}'; write that key instead"
        return f"unknown config key '{key}'; `dynrubric config show` lists the valid keys"
    return f"config key '{key}' (env {env}): {error['msg']}, got {error.get('input')!r}"


def env_names(model: type[BaseModel] = Settings, prefix: str = ENV_PREFIX) -> dict[str, bool]:
    """Every environment variable that names a key: name -> whether deeper `__` parts are allowed
    (a free-form mapping such as monitoring.targets). A whole section may be given as JSON."""
    names: dict[str, bool] = {}
    for field, info in model.model_fields.items():
        name = prefix + field.upper()
        nested = _model_of(info.annotation)
        names[name] = nested is None and typing.get_origin(info.annotation) is dict
        if nested is not None:
            names.update(env_names(nested, name + "__"))
    return names


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _env_name(key: str) -> str:
    """The variable that sets a dotted key: train.grpo.lr -> DYNRUBRIC_TRAIN__GRPO__LR."""
    return ENV_PREFIX + key.replace(".", "__").upper()


# what Kubernetes (enableServiceLinks, on by default) sets for a Service NAME, after NAME_SERVICE_HOST
_SERVICE_LINK_SUFFIX = re.compile(
    r"SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?"
)


def service_links(environ: dict[str, str]) -> set[str]:
    """The variables of `environ` that Kubernetes sets for the Services of a pod's namespace: for a Service
    `dynrubric-router`, DYNRUBRIC_ROUTER_SERVICE_HOST, _SERVICE_PORT, _SERVICE_PORT_<PORT NAME>, _PORT and
    _PORT_<PORT>_<PROTOCOL>[_PROTO|_PORT|_ADDR]. They come as a family and _SERVICE_HOST is always in it: a
    variable counts only beside its Service's _SERVICE_HOST, so a typo such as DYNRUBRIC_SERVING_PORT (for
    DYNRUBRIC_SERVING__PORT) is still an error."""
    names = {k.upper(): k for k in environ}
    services = {n.removesuffix("_SERVICE_HOST") for n in names if n.endswith("_SERVICE_HOST")}
    return {
        var
        for name, var in names.items()
        if "__" not in name
        and any(name.startswith(s + "_") and _SERVICE_LINK_SUFFIX.fullmatch(name[len(s) + 1 :]) for s in services)
    }


def _check_env_names(environ: dict[str, str]) -> None:
    known = env_names()
    links = service_links(environ)
    for var in sorted(environ):
        name = var.upper()
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV or name in known or var in links:
            continue
        if any(name.startswith(k + "__") for k, open_ended in known.items() if open_ended):
            continue
        renamed = {_env_name(old): (old, new) for old, new in RENAMED_KEYS.items() if "[]" not in old}
        if name in renamed:
            old, new = renamed[name]
            raise DynrubricError(
                f"environment variable {var} sets '{old}', which was renamed to '{new}'",
                f"set {_env_name(new)} instead",
            )
        close = difflib.get_close_matches(name, [*known, CONFIG_ENV], n=1, cutoff=0.6)
        fix = f"did you mean {close[0]}? (" if close else "("
        raise DynrubricError(
            f"unknown environment variable {var}: no config key has that name",
            fix + "`dynrubric config show` lists the keys; KEY.SUB is DYNRUBRIC_KEY__SUB) or unset it",
        )


def _is_path(annotation: Any) -> bool:
    if annotation is Path:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return Path in typing.get_args(annotation)
    return False


def _absolute_paths(data: dict[str, Any], model: type[BaseModel], base: Path) -> dict[str, Any]:
    """Relative path values made absolute against `base` (the YAML file's dir, or the working dir)."""
    out = dict(data)
    for key, value in data.items():
        info = model.model_fields.get(key)
        if info is None:
            continue  # the validation names the unknown key
        nested = _model_of(info.annotation)
        if nested is not None and isinstance(value, dict):
            out[key] = _absolute_paths(value, nested, base)
        elif _is_path(info.annotation) and isinstance(value, (str, Path)) and str(value):
            path = Path(value)
            if not path.is_absolute() and not str(value).startswith("~"):
                out[key] = str(base / path)
    return out


def _file_layer(path: Path) -> dict[str, Any]:
    return _absolute_paths(_read_yaml(path), Settings, path.absolute().parent)


def _validated(data: dict[str, Any]) -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(_describe(err) for err in e.errors())
        raise DynrubricError(problems, "fix the config file, the profile or the DYNRUBRIC_* variable") from None


def load_settings(
    configs: Path | Sequence[Path] | None = None,
    environ: dict[str, str] | None = None,
    profile: str = DEFAULT_PROFILE,
) -> Settings:
    """Load and validate the settings: defaults < `profile` < `configs` in order (default: $DYNRUBRIC_CONFIG)
    < `environ` (default: os.environ); raise DynrubricError naming each bad key."""
    environ = dict(os.environ if environ is None else environ)
    files = [configs] if isinstance(configs, Path) else list(configs or [])
    if not files and environ.get(CONFIG_ENV):
        files = [Path(environ[CONFIG_ENV])]
    data = _file_layer(profile_path(profile))
    for path in files:
        data = _deep_merge(data, _file_layer(Path(path)))
    _check_env_names(environ)
    env_source = EnvSettingsSource(Settings, env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False)
    links = service_links(environ)
    env_source.env_vars = {k.lower(): v for k, v in environ.items() if k != CONFIG_ENV and k not in links}
    try:
        env_data = _absolute_paths(env_source(), Settings, Path.cwd())
    except Exception as e:  # pydantic-settings raises SettingsError for unparseable env JSON
        raise DynrubricError(f"config from the environment is invalid: {e}", "fix the DYNRUBRIC_* variable") from None
    return _validated(_deep_merge(data, env_data))


def override(settings: Settings, changes: dict[str, Any]) -> Settings:
    """A new validated Settings: `settings` with `changes` (sections as nested dicts) merged on top; `settings`
    itself is frozen and stays as it was."""
    return _validated(_deep_merge(settings.model_dump(), changes))


def _dump(value: Any, reveal: bool) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value() if reveal else "***"
    if isinstance(value, BaseModel):
        return {k: _dump(getattr(value, k), reveal) for k in type(value).model_fields}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_dump(v, reveal) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v, reveal) for k, v in value.items()}
    return value


def masked_dump(settings: Settings) -> dict[str, Any]:
    """Settings as plain data with every secret replaced by '***' (unset secrets stay null)."""
    return _dump(settings, reveal=False)


def plain_dump(settings: Settings) -> dict[str, Any]:
    """Settings as plain data that `-c` reads back, secrets included (the config file of a run's children)."""
    return _dump(settings, reveal=True)
