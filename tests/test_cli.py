"""The CLI's contract: bad input is one clear line naming the problem and the fix, non-zero, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynrubric.engines.vllm_server import free_port


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    full_env["COLUMNS"] = "200"  # rich wraps tables to the terminal width
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dynrubric", *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=300
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0]


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
    env = {"DYNRUBRIC_ENGINE__KIND": "openai-http", "DYNRUBRIC_TRAIN__PROMPTS_FILE": str(prompts),
           "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path / "state")}
    assert_one_line_error(run("train", "round", env=env), "engine.verifier_url (unset, so engine.base_url) and "
                          "engine.policy_url (unset, so engine.base_url)", "verifier would not be frozen")
    shared = {**env, "DYNRUBRIC_ENGINE__POLICY_URL": "http://127.0.0.1:1/",
              "DYNRUBRIC_ENGINE__VERIFIER_URL": "http://127.0.0.1:1/"}
    assert_one_line_error(run("train", "round", env=shared), "engine.verifier_url and engine.policy_url")
    two_models = {**env, "DYNRUBRIC_ENGINE__VERIFIER_URL": "http://127.0.0.1:2/",
                  "DYNRUBRIC_TRAIN__COEVOLVE__SINGLE_MODEL": "false"}
    assert_one_line_error(run("train", "round", env=two_models), "engine.generator_url (unset, so engine.base_url) and "
                          "engine.policy_url", "generator would not be frozen")
