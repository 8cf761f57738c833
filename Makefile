# `make demo` and `make test` each set everything up on a fresh machine: a .venv with `.[dev]` installed.
# The install re-runs only when pyproject.toml changes (the stamp file), so both are quick when nothing changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.installed
export PATH := $(BIN):$(PATH)

.PHONY: demo test export-check nbtest pytest

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m mixedprec.demo

test: export-check nbtest pytest

export-check: $(STAMP)
	bash .ci/check_export.sh

nbtest: $(STAMP)
	$(BIN)/nbdev-test --n-workers 2

pytest: $(STAMP)
	$(BIN)/python -m pytest tests -q --durations=15
