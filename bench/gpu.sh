#!/usr/bin/env bash
# The GPU checks in one command (about 6 minutes on one modern GPU, 130 s of it the kernels' first build): build the CUDA kernels, run every CUDA test (the
# fused-vs-reference parity tests with the fused kernels required, views at offsets included, and the end-to-end tests of the three front ends),
# the kernel benchmark, and a ResNet-50 training benchmark (fastai: fp32, mixedprec, fastai's native AMP; plain
# PyTorch: fp32, mixedprec.amp, torch's GradScaler) with host syncs counted per step. Prints the tables; run it where a
# GPU is lent and put them in the README.
#   bash bench/gpu.sh                  # python3 with torch and pytest, fastai from .whl/ where python3 lacks it
#                                      # (`make gpu-wheels` beforehand, for a machine that reaches no package index);
#                                      # the project's .venv where python3 has neither
#   PYTHON=python3 bash bench/gpu.sh   # with another Python that has torch, fastai and pytest
#   PROFILE=1 bash bench/gpu.sh        # then also the device time per op of the fastai loop's half configurations
#   CONFIGS="mixedprec fp16,torch amp fp16" STEPS=40 MAX_SECONDS=6 bash bench/gpu.sh   # fewer training configurations
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  has_fastai() { python3 -c 'import fastai' 2>/dev/null; }
  if python3 -c 'import torch, pytest' 2>/dev/null && { has_fastai || ls .whl/fastai-*.whl >/dev/null 2>&1; }; then
    PYTHON=python3
    if ! has_fastai; then        # a bare GPU machine: fastai and its pure-Python needs from .whl/
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mixedprec-site .whl/*.whl || exit 1
      export PYTHONPATH=/tmp/mixedprec-site
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}    # mixedprec from this checkout
  else test -x .venv/bin/python || make .venv/.installed; PYTHON=.venv/bin/python; fi
fi
export MIXEDPREC_REQUIRE_FUSED=1 PYTHONUNBUFFERED=1
status=0
step() { echo; echo "== $1 ($(date +%T))"; shift; "$@" || { echo "!! failed (exit $?): $*"; status=1; }; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
step "build" $PYTHON -c "
import time, torch; from mixedprec import ops
t = time.time(); ext = ops.build_extension(cuda=True)
print(f'torch {torch.__version__}, {torch.cuda.get_device_name()}: CUDA kernels built or loaded in {time.time() - t:.0f}s, has_cuda={ext.has_cuda()}')"
step "split masters on the GPU against fp32 masters there, and the CPU runs" $PYTHON -m pytest tests/test_bf16_masters.py \
    -k follow_the_model_to_the_gpu -q -s -p no:cacheprovider
# the CUDA tests over 8 processes where pytest-xdist is there (`make gpu-wheels` brings it): a file per process
XDIST=$($PYTHON -c 'import xdist' 2>/dev/null && echo "-n ${TEST_WORKERS:-8} --dist loadfile")
step "CUDA tests" $PYTHON -m pytest $XDIST tests/test_fused.py tests/test_cuda.py tests/test_custom_ops.py tests/test_bf16_masters.py tests/test_cuda_emulation.py -k cuda -q -p no:cacheprovider -rfE --tb=short
step "kernel benchmark" $PYTHON bench/kernels.py --device cuda --repeat 10
step "lean state: the AdamW step alone" $PYTHON bench/bf16_masters.py speed --device cuda --repeat 10
CONFIGS=${CONFIGS:-"fp32,mixedprec fp16,fastai fp16,mixedprec bf16,fastai bf16,torch fp32,mixedprec amp O2 fp16,torch amp fp16"}
step "training benchmark" $PYTHON bench/train.py --device cuda --models resnet50 --bs 256 --pool 8 --steps "${STEPS:-60}" \
    --max-seconds "${MAX_SECONDS:-10}" --sync-sites --configs "$CONFIGS"
if [ "${PROFILE:-0}" = 1 ]; then    # PROFILE=1: where the device time goes in the fastai loop, mixedprec's bf16 against fastai's
step "profile" $PYTHON bench/train.py --device cuda --models resnet50 --bs 256 --pool 8 --steps 12 --max-seconds 30 --profile \
    --configs "mixedprec fp16,mixedprec bf16,fastai bf16"
fi
exit $status
