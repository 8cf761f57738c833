# `make demo`, `make test` and `make docs` each set everything up on a fresh machine: a .venv with mixedprec installed
# (`make test` adds the `dev` extras: nbdev, pytest, ...; `make docs` the `docs` extras: nbconvert, markdown). An install
# re-runs only when pyproject.toml changes (the stamp files), so all three are quick when nothing changed.
# TORCH_INDEX=<url>: install torch from that package index first (for example PyTorch's CPU-only wheels, on a machine
# without a GPU: a much smaller install).
PYTHON ?= python3
TORCH_INDEX ?=
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs
export PATH := $(BIN):$(PATH)
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip's progress, one line per package, without its notes: what it collects, then what it installed
PIP := $(BIN)/python -m pip install --disable-pip-version-check
SHOW := { grep --line-buffered -E '^(Collecting|Installing collected|Successfully installed|ERROR|error)' || true; }

.PHONY: demo test docs screenshots export-check house-rules test-builds nbtest pytest test-torch-range gpu-wheels

define install
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make: installing $(1) into $(VENV) (the first time this takes minutes; one line per package)"
	$(PIP) -q --upgrade pip
	$(if $(TORCH_INDEX),$(PIP) torch --index-url "$(TORCH_INDEX)" 2>&1 | $(SHOW))
	$(PIP) -e "$(2)" 2>&1 | $(SHOW)
endef

$(DEMO_STAMP): pyproject.toml
	$(call install,mixedprec with torch and fastai,.)
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	$(call install,mixedprec with its dev extras (nbdev and pytest),.[dev])
	touch $(STAMP) $(DEMO_STAMP)

$(DOCS_STAMP): pyproject.toml
	$(call install,mixedprec with its docs extras (nbconvert and markdown),.[docs])
	touch $(DOCS_STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -W ignore::FutureWarning:torch.jit._script -m mixedprec.demo    # fastai's import uses torch.jit.script, which torch deprecates

test: export-check house-rules test-builds nbtest pytest test-torch-range

test-builds: $(STAMP)    # the tests' own compiles (the CUDA emulator; nvcc's build), niced in the background on the core the tests leave idle
	mkdir -p build
	nice -n 19 $(BIN)/python tests/builds.py > build/test-builds.log 2>&1 &

export-check: $(STAMP)
	bash .ci/check_export.sh

# lines of at most 120 characters (under 2% over), classes of at most 250 lines (with their @patch methods), exported
# cells of at most 100
house-rules: $(STAMP)
	$(BIN)/python .ci/house_rules.py

nbtest: $(STAMP)
	$(BIN)/nbdev-test --n-workers 2

pytest: $(STAMP)
	$(BIN)/python -m pytest tests -q --durations=15

docs: $(DOCS_STAMP)
	$(BIN)/python .ci/build_docs.py _docs

screenshots: $(DOCS_STAMP)    # the docs, and PNGs of the index and a recipe page as headless Chromium renders them
	$(BIN)/python .ci/build_docs.py _docs --screenshots

# the declared torch range: C++17 sources against torch 2.4.1's headers; kernel parity, the compiled step and a short
# fit under the lowest and the newest (2.11.0, 2.15.0); venvs cached in ~/.cache/mixedprec/venvs
test-torch-range: $(STAMP)
	PYTHON=$(PYTHON) bash .ci/torch_range.sh

# fastai and the pure-Python packages it needs beyond what a GPU machine's image has (torch, numpy, pandas, ...), as
# wheels in .whl/ (ignored by git), at this venv's versions: bench/gpu.sh installs them on a machine that reaches
# no package index
# (fastprogress 1.1 imports fasthtml, a web framework with many needs of its own; 1.0.3, which fastai 2.8 accepts,
# does not); pytest-xdist (and execnet) spread bench/gpu.sh's CUDA tests over processes
GPU_WHEELS := fastai fastcore fastdownload fasttransform plum-dispatch beartype fastprogress==1.0.3 \
	pytest-xdist==3.8.0 execnet==2.1.2
# the GPU machine's Python
GPU_PYTHON ?= 3.12
GPU_PLATFORM := --python-version $(GPU_PYTHON) --implementation cp \
	$(foreach p,manylinux_2_28 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d .whl $(GPU_PLATFORM) \
		$$($(BIN)/python -c "import importlib.metadata as m; \
		print(' '.join(n if '==' in n else f'{n}=={m.version(n)}' for n in '$(GPU_WHEELS)'.split()))") 2>&1 | $(SHOW)
	ls .whl
