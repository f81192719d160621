# The two set-up commands of the README. Each creates .venv when missing, installs
# torch==2.13.0 only when no torch is importable (a newer or unpinned torch pulls a
# multi-GB CUDA build), installs every other dependency at the exact version and hash of
# requirements.lock (so two machines test the same thing), installs tidal, and runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements.lock

.PHONY: install demo test lint format lock sandbox-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# --no-deps everywhere: the lock already lists every dependency (torch's too), so nothing is resolved
# from what the registry serves today; `pip check` then proves the set is consistent.
install: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet --no-deps torch==2.13.0
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check

# Refresh requirements.lock from pyproject.toml (and .ci/lock.in): the newest versions that resolve
# together today, with the hashes of every file of each; commit it with the test run that passed on it.
lock:
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet pip-tools==7.6.2
	.venv-lock/bin/pip-compile --quiet --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links \
		--unsafe-package torch --extra test --extra serve -o $(LOCK) pyproject.toml .ci/lock.in

# The code-reward sandbox runs candidate code under bubblewrap; as root on Debian/Ubuntu, install it when
# missing (elsewhere the sandbox tests that need it say how to install it).
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap libseccomp2 >/dev/null; } || \
		echo "bubblewrap (bwrap) is missing: install it (apt-get install bubblewrap) to test the code sandbox"

demo: install
	$(BIN)/tidal demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two xdist workers: single-process tests use one core each; multi-process ones run one at a time, on
# one worker (tests/conftest.py: ONE_AT_A_TIME).
test: lint sandbox-tools
	$(BIN)/python -m pytest -q -n 2 --dist loadscope

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
