"""A short fastai fit with the fused kernels, as `.ci/torch_range.sh` runs it under the lowest and the newest torch that
pyproject.toml declares (and `make test` under the current one): to_fp16 and to_bf16 train as an fp32 run does."""
import pytest
import torch
from mixedprec import ops
from mixedprec.callback import MixedPrecision
from helpers import synth_learner

def fit(how):
    learn = synth_learner(seed=3)
    if how != 'fp32': getattr(learn, how)()
    before = float(learn.validate()[0])
    learn.fit(12, 3e-2)
    return learn, before, float(learn.validate()[0])

@pytest.mark.parametrize("how", ['to_fp16', 'to_bf16'])
def test_a_short_fit_trains_as_fp32_with_the_fused_kernels(how):
    assert ops.backend(torch.zeros(1), impl='fused') == 'cpp', "the fused kernels must build under this torch"
    _, _, fp32 = fit('fp32')
    learn, before, half = fit(how)
    mp = next(cb for cb in learn.cbs if isinstance(cb, MixedPrecision))
    assert next(learn.model.parameters()).dtype == (torch.float16 if how == 'to_fp16' else torch.bfloat16)
    assert sum(r.skipped for r in mp.scaler.history) <= 4              # at most the scale's first settling steps
    assert half < 0.2 * before and half < 1.25 * fp32, (before, half, fp32)
