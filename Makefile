# The README's two commands: `make up` and `make test`. Both set up .venv first (idempotent).
.PHONY: setup up test

setup:
	@bash scripts/setup.sh

up: setup
	.venv/bin/dynrubric doctor
	.venv/bin/dynrubric up

test: setup
	.venv/bin/python -m pytest
