# The README's two commands: `make up` and `make test`. Both set up .venv first (idempotent).
.PHONY: setup up test

setup:
	@bash scripts/setup.sh

up: setup
	.venv/bin/dynrubric doctor
	.venv/bin/dynrubric up

# lint, format and types first (config in pyproject.toml), then the suite
test: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/python -m pytest
