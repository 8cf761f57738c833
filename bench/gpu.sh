#!/usr/bin/env bash
# The GPU checks in one command (under 8 minutes on one modern GPU): the kernel benchmark, the fused-vs-reference
# parity tests with the fused kernels required, and a ResNet-50 training benchmark against fp32 and fastai's native
# to_fp16, with host syncs counted per step. Prints the tables; run it where a GPU is lent and put them in the README.
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv/bin/python || make .venv/.installed
export MIXEDPREC_REQUIRE_FUSED=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
.venv/bin/python bench/kernels.py --device cuda --repeat 10
.venv/bin/python -m pytest tests/test_fused.py -q -x
.venv/bin/python bench/train.py --device cuda --models resnet50 --bs 64 --steps 60 --max-seconds 60 --configs "fp32,mixedprec fp16,fastai fp16,mixedprec bf16"
