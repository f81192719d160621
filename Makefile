# The two set-up commands of the README. Each creates .venv when missing, installs
# torch==2.13.0 only when no torch is importable (a newer or unpinned torch pulls a
# multi-GB CUDA build), installs tidal with its test extras, and runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint format

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"

demo: install
	$(BIN)/tidal demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two xdist workers: single-process tests use one core each; multi-process ones run one at a time, on
# one worker (tests/conftest.py: ONE_AT_A_TIME).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadscope

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
