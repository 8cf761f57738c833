#!/usr/bin/env bash
# The declared torch range, tested at both ends (`make test-torch-range`, which `make test` runs). `make test`'s pytest
# runs every test under the project's own venv's torch (2.14.1); this script adds, each in a venv of its own cached
# outside the checkout (minutes once):
#   1. the kernel sources compiled as C++17 against torch 2.4.1's headers (torch 2.14 and later need C++20): g++ for
#      the CPU sources, nvcc (PTX only, no GPU needed) for the CUDA sources, where nvcc is installed;
#   2. under the lowest and the newest declared torch (2.11.0, the GPU machines' torch, and 2.15.0): the fused kernels
#      built, their parity tests, the compiled fused step (torch.compile) and a short fastai fit; under torch 2.4.1 too
#      (below the declared range: the rest of the suite does not pass there, but the kernels load and match the
#      references, which guards what made old torch find no ops), the parity tests and the fit.
# TORCH_RANGE picks the versions of 2 (default "2.11.0 2.15.0"), CPP17_TORCH that of 1, MIXEDPREC_VENVS the cache
# folder (default ~/.cache/mixedprec/venvs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSIONS=${TORCH_RANGE:-"2.11.0 2.15.0"}
CPP17_TORCH=${CPP17_TORCH:-2.4.1}
VENVS=${MIXEDPREC_VENVS:-$HOME/.cache/mixedprec/venvs}
PYTHON=${PYTHON:-python3}
# the torchvision of each torch (0.29.2 asks for torch>=2.14)
declare -A VISION=([2.4.1]=0.19.1 [2.5.1]=0.20.1 [2.6.0]=0.21.0 [2.11.0]=0.26.0 [2.14.1]=0.29.1 [2.15.0]=0.29.2)
mkdir -p "$VENVS"

make_venv() {    # a venv with torch $1, fastai and the test tools; mixedprec is read from the checkout (PYTHONPATH)
  local v=$1 venv=$VENVS/torch$1
  if [ -f "$venv/.ready" ]; then return; fi
  echo "torch-range: making $venv (once per machine: a few GB to download)"
  rm -rf "$venv"; $PYTHON -m venv "$venv"
  # the machine's pip may cap torch (/etc/xdg/pip/constraints.txt): the range's ends are asked for by name, uncapped
  PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "torch==$v" "torchvision==${VISION[$v]}" "fastai>=2.8,<2.9" fastcore ninja scikit-learn pytest hypothesis
  touch "$venv/.ready"
}

check_one() {
  local v=$1 py=$VENVS/torch$1/bin/python
  echo; echo "== torch $v ($(date +%T))"
  "$py" -c "import torch; assert torch.__version__.split('+')[0] == '$v', torch.__version__"
  # in the declared range, the compiled fused step too (torch 2.11's Dynamo reads no ContextVar: ops.current_impl)
  local declared=$([ "$v" != "$CPP17_TORCH" ] && echo tests/test_custom_ops.py)
  PYTHONPATH=$ROOT MIXEDPREC_CACHE=$VENVS/kernels "$py" -m pytest -q -p no:cacheprovider tests/test_fused.py \
    tests/test_torch_range.py $declared -k 'not test_cuda_sources_compile_without_a_gpu' -W ignore::DeprecationWarning \
    -W ignore::FutureWarning
}

for v in $CPP17_TORCH $VERSIONS; do make_venv "$v"; done
echo "== C++17 against torch $CPP17_TORCH's headers ($(date +%T))"
PYTHONPATH=$ROOT "$VENVS/torch$CPP17_TORCH/bin/python" tests/cpp17_check.py
for v in $CPP17_TORCH $VERSIONS; do check_one "$v"; done
