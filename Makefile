# `make demo` and `make test` each set everything up on a fresh machine: a .venv with mixedprec installed (`make test`
# adds the `dev` extras: nbdev, pytest, ...). An install re-runs only when pyproject.toml changes (the stamp files), so
# both are quick when nothing changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
export PATH := $(BIN):$(PATH)

.PHONY: demo test export-check nbtest pytest

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make: installing mixedprec, torch and fastai into $(VENV) (the first time this takes minutes, quietly)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make: installing mixedprec with its dev extras (nbdev, pytest) into $(VENV) (the first time this takes minutes, quietly)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -W ignore::FutureWarning:torch.jit._script -m mixedprec.demo    # fastai's import uses torch.jit.script, which torch deprecates

test: export-check nbtest pytest

export-check: $(STAMP)
	bash .ci/check_export.sh

nbtest: $(STAMP)
	$(BIN)/nbdev-test --n-workers 2

pytest: $(STAMP)
	$(BIN)/python -m pytest tests -q --durations=15
