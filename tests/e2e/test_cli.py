"""The CLI's contract, through the installed console script (`.venv/bin/dynrubric`, this checkout on
PYTHONPATH): bad input is one clear line naming the problem and the fix, exit 2, no traceback; output
stays whole and machine-readable in a pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynrubric.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "dynrubric"


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    full_env["PYTHONPATH"] = str(REPO)  # the script's editable install may point at another checkout
    full_env.update(env or {})
    return full_env


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=cli_env(env), cwd=cwd, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


# one per class of usage error a new user meets; typer raises its bundled click's exceptions, so an
# upgrade that changes them brings tracebacks back here first (pyproject pins the tested range)
USAGE_ERRORS = {
    "unknown option": (["score", "--foo", "x"], ["No such option: --foo", "dynrubric score --help"]),
    "misspelt option": (["up", "--cycle", "2"], ["--cycle", "--cycles", "dynrubric up --help"]),
    "unknown command": (["scor", "x"], ["No such command 'scor'", "'score'", "dynrubric --help"]),
    "missing argument": (["score"], ["Missing argument", "sets_file", "dynrubric score --help"]),
    "bad value": (["train", "round", "--rounds", "abc"], ["'--rounds'", "integer", "dynrubric train round --help"]),
}


@pytest.mark.parametrize("case", USAGE_ERRORS)
def test_usage_error_is_one_line(case):
    args, needles = USAGE_ERRORS[case]
    assert_one_line_error(run(*args), *needles)


def test_config_given_a_directory(tmp_path):
    assert_one_line_error(run("-c", str(tmp_path), "config", "show"), str(tmp_path), "is a directory", "YAML file")


def test_usage_error_with_debug_shows_the_traceback():
    result = run("--debug", "score", "--foo", "x")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "No such option" in result.stderr


@pytest.mark.parametrize(
    ("var", "suggestion"),
    [
        ("DYNRUBRIC_ENGNE__KIND", "DYNRUBRIC_ENGINE__KIND"),  # a typo
        ("DYNRUBRIC_HOME", "DYNRUBRIC_PATHS__HOME"),  # a guess
    ],
)
def test_unknown_environment_variable(var, suggestion):
    assert_one_line_error(run("config", "show", env={var: "x"}), var, f"did you mean {suggestion}?")


def test_config_show_round_trips_through_a_pipe(tmp_path):
    long_item = "The response " + "states every assumption it makes about the question, " * 6 + "explicitly."
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"rubric": {"generic_rubric": [{"text": long_item}, {"text": "Short."}]}}))
    env = cli_env({"COLUMNS": "40"})
    shown = subprocess.run(
        f"'{SCRIPT}' -c '{cfg}' config show | '{SCRIPT}' -c /dev/stdin config show",
        shell=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    first = run("-c", str(cfg), "config", "show", env={"COLUMNS": "40"})
    assert shown.stdout == first.stdout
    assert f"- text: {long_item}\n" in shown.stdout  # one line, not wrapped at the width
    as_json = json.loads(run("-c", str(cfg), "config", "show", "--format", "json").stdout)
    assert as_json["rubric"]["generic_rubric"][0]["text"] == long_item


def test_config_show_prints_a_profile_under_the_c_files_and_the_environment(tmp_path):
    """`config show --profile demo` prints what `up` runs with by default; -c files go over it in order, and the
    environment over them; the default profile (production) is the schema defaults."""
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("train:\n  grpo:\n    clip_high: 0.3\n  steps_per_round: 2\n")
    second.write_text("train:\n  steps_per_round: 3\n")

    def train(*args: str, env: dict[str, str] | None = None) -> dict:
        shown = run(*args, "config", "show", "--format", "json", env=env)
        assert shown.returncode == 0, shown.stderr
        return json.loads(shown.stdout)["train"]

    demo = run("config", "show", "--profile", "demo")
    assert demo.returncode == 0, demo.stderr
    assert "    lr: 5.0e-05\n" in demo.stdout and "  steps_per_round: 11\n" in demo.stdout
    assert "    lr: 1.0e-06\n" in run("config", "show").stdout
    layered = json.loads(
        run("-c", str(first), "-c", str(second), "config", "show", "--profile", "demo", "--format", "json").stdout
    )["train"]
    assert (layered["grpo"]["lr"], layered["grpo"]["clip_high"], layered["steps_per_round"]) == (5e-05, 0.3, 3)
    env = {"DYNRUBRIC_TRAIN__STEPS_PER_ROUND": "5"}
    assert train("-c", str(first), "-c", str(second), env=env)["steps_per_round"] == 5


def test_an_unknown_profile_is_one_line_naming_the_choices():
    for command in (["config", "show"], ["up"], ["gate", "plan", "--rps", "1", "--users", "40"]):
        assert_one_line_error(
            run(*command, "--profile", "staging"), "unknown profile 'staging' (--profile)", "demo, production"
        )


def test_relative_paths_resolve_the_same_from_any_directory(tmp_path):
    cfg = tmp_path / "project" / "dynrubric.yaml"
    cfg.parent.mkdir()
    cfg.write_text("paths:\n  state_dir: state\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = [
        json.loads(run("-c", str(cfg), "config", "show", "--format", "json", cwd=cwd).stdout)
        for cwd in (cfg.parent, elsewhere)
    ]
    assert shown[0]["paths"]["state_dir"] == shown[1]["paths"]["state_dir"] == str(cfg.parent / "state")


def test_reading_commands_do_not_create_missing_state(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg")}  # the default state dir, empty
    assert_one_line_error(
        run("registry", "list", env=env, cwd=tmp_path),
        "no checkpoint registry",
        str(tmp_path / "xdg" / "dynrubric"),
        "dynrubric up",
    )
    assert_one_line_error(run("report", env=env, cwd=tmp_path), "no run log", "dynrubric up")
    assert_one_line_error(run("rollout", "status", env=env, cwd=tmp_path), "no rollouts recorded", "rollout start")
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "var").exists()


def test_registry_list_piped_is_not_truncated(tiny_model_dir, tmp_path):
    env = {"DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path / "state"), "COLUMNS": "40"}
    version = "a-version-name-longer-than-a-forty-column-terminal-is-wide"
    assert run("registry", "register", str(tiny_model_dir), "--version", version, env=env).returncode == 0
    table = run("registry", "list", env=env)
    assert table.returncode == 0, table.stderr
    assert version in table.stdout
    listed = [json.loads(line) for line in run("registry", "list", "--json", env=env).stdout.splitlines()]
    assert [c["version"] for c in listed] == [version]


def test_malformed_config_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  kind: [unclosed\n")
    assert_one_line_error(run("--config", str(bad), "config", "show"), "not valid YAML", "line")


def test_config_value_names_key_and_allowed_values(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  kind: tensorflow\n")
    assert_one_line_error(run("--config", str(cfg), "config", "show"), "engine.kind", "'transformers' or 'openai-http'")


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  knd: transformers\n")
    assert_one_line_error(run("--config", str(cfg), "config", "show"), "engine.knd")


def test_bad_environment_value():
    result = run("config", "show", env={"DYNRUBRIC_ENGINE__TIMEOUT_S": "-3"})
    assert_one_line_error(result, "engine.timeout_s", "DYNRUBRIC_ENGINE__TIMEOUT_S")


def test_config_show_masks_secrets():
    result = run("config", "show", env={"DYNRUBRIC_REWARD_SERVER__TOKEN": "hunter2"})
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout
    assert "token: '***'" in result.stdout


def test_missing_model_cache(tmp_path):
    result = run("generate", "hi", env={"DYNRUBRIC_PATHS__HOME": str(tmp_path / "empty")})
    assert_one_line_error(result, "not in the model cache", "dynrubric models prepare")


def test_unreachable_engine_url():
    url = f"http://127.0.0.1:{free_port()}"
    result = run("generate", "hi", env={"DYNRUBRIC_ENGINE__KIND": "openai-http", "DYNRUBRIC_ENGINE__BASE_URL": url})
    assert_one_line_error(result, "unreachable", url, "engine.base_url")


def test_debug_shows_the_traceback(tmp_path):
    result = run("--debug", "generate", "hi", env={"DYNRUBRIC_PATHS__HOME": str(tmp_path / "empty")})
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_doctor_reports_missing_pieces_with_fixes(tmp_path):
    result = run("doctor", env={"DYNRUBRIC_PATHS__HOME": str(tmp_path / "empty")})
    assert result.returncode == 1
    assert "missing" in result.stdout and "dynrubric models prepare" in result.stdout


@pytest.mark.slow
def test_generate_answers_with_the_cached_model():
    result = run("generate", "What is the capital of France?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_training_refuses_a_verifier_on_the_server_the_policy_reloads(tmp_path):
    """Over HTTP the verifier must be frozen: on the policy's server it would judge with the weights each
    step publishes. Refused at start, naming both keys; own URLs per role pass that check."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    env = {
        "DYNRUBRIC_ENGINE__KIND": "openai-http",
        "DYNRUBRIC_TRAIN__PROMPTS_FILE": str(prompts),
        "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path / "state"),
    }
    assert_one_line_error(
        run("train", "round", env=env),
        "engine.verifier_url (unset, so engine.base_url) and engine.policy_url (unset, so engine.base_url)",
        "verifier would not be frozen",
    )
    shared = {
        **env,
        "DYNRUBRIC_ENGINE__POLICY_URL": "http://127.0.0.1:1/",
        "DYNRUBRIC_ENGINE__VERIFIER_URL": "http://127.0.0.1:1/",
    }
    assert_one_line_error(run("train", "round", env=shared), "engine.verifier_url and engine.policy_url")
    two_models = {
        **env,
        "DYNRUBRIC_ENGINE__VERIFIER_URL": "http://127.0.0.1:2/",
        "DYNRUBRIC_TRAIN__COEVOLVE__SINGLE_MODEL": "false",
    }
    assert_one_line_error(
        run("train", "round", env=two_models),
        "engine.generator_url (unset, so engine.base_url) and engine.policy_url",
        "generator would not be frozen",
    )


def test_eval_policy_prints_the_dev_split_and_the_five_figures_against_parent_and_base(tiny_model_dir, tmp_path):
    """A registered candidate and its base answer the dev split and the five reported figures (a few prompts each,
    on the tiny model): one line a figure, each with its paired CI against the parent and the base."""
    env = {
        "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path / "state"),
        "DYNRUBRIC_MODELS__POLICY": str(tiny_model_dir),
        "DYNRUBRIC_EVALUATION__MAX_PROMPTS": "4",
        "DYNRUBRIC_EVALUATION__REPORT_PROMPTS": "3",
        "DYNRUBRIC_EVALUATION__MAX_TOKENS": "4",
        "COLUMNS": "200",
    }
    assert run("registry", "register", str(tiny_model_dir), "--version", "base", "--stable", env=env).returncode == 0
    assert (
        run("registry", "register", str(tiny_model_dir), "--version", "r1", "--parent", "base", env=env).returncode == 0
    )
    result = run("eval-policy", "r1", env=env)
    assert result.returncode == 0, result.stderr
    lines = {line.split(":")[0]: line for line in result.stdout.splitlines() if line.startswith("r1 ")}
    assert set(lines) == {f"r1 {s}" for s in ("dev", "test_seen", "test_unseen", "ifeval", "ifbench", "open")}
    assert "on 4 prompts" in lines["r1 dev"]
    for suite in ("test_seen", "test_unseen", "ifeval", "ifbench", "open"):
        line = lines[f"r1 {suite}"]
        assert "on 3 prompts" in line and "95% CI" in line and "vs base" in line, line
        # the same weights: every paired difference is exactly 0
        assert line.count("+0.000 (95% CI +0.000..+0.000)") == 2, line
