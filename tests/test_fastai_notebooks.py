"""fastai's own notebook tests that touch mixed precision (18_callback.fp16, 18a_callback.training, 17_callback.tracker,
14_callback.schedule, 18b_callback.preds), written again here in our own code and run with mixedprec's `to_fp16`/`to_bf16`
on the CPU in place of fastai's CUDA-only runs. Where the cell checks a number, the same run in fp32 is the reference."""
from functools import partial
import pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam
from fastai.callback.core import Callback
from fastai.callback.training import ShortEpochCallback, BnFreeze
from fastai.callback.tracker import TerminateOnNaNCallback, ReduceLROnPlateau
from fastai.callback.preds import MCDropoutCallback
from fastai.callback.schedule import fit_one_cycle, fit_flat_cos, fit_sgdr   # Learner.fit_one_cycle, ...
from mixedprec.callback import MixedPrecision
from helpers import synth_learner, masters_of

def two_linears():
    "fastai's fp16 notebook model: two Linear(1, 1) layers, one param group each"
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))

def one_d_learner(precision=None, mom=0., **kw):
    "A 1-in 1-out regression Learner on `two_linears`, split in two groups, with fastai's SGD"
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 1, generator=g); y = 2 * x + 3 + 0.1 * torch.randn(160, 1, generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x[:128], y[:128]), bs=16), DataLoader(TensorDataset(x[128:], y[128:]), bs=16))
    learn = Learner(dls, two_linears(), loss_func=nn.MSELoss(), opt_func=partial(SGD, mom=mom), lr=1e-2,
                    splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback']); learn.logger = lambda *a, **k: None
    if precision == 'fp16': learn.to_fp16(**kw)
    elif precision == 'bf16': learn.to_bf16(**kw)
    return learn

def weights(learn): return [p.detach().float().clone() for p in learn.model.parameters()]

# ---------------------------------------------------------------- 18_callback.fp16

def test_dynamic_scale_moves_and_the_model_trains():
    # fastai: after 3 epochs the loss scale has changed from its start and stays within (1, 2**24); the losses fall
    learn = one_d_learner('fp16', loss_scale=2.**20, max_noskip=4)
    learn.fit(3)
    assert 1 < learn.mixed_precision.loss_scale < 2**24 and learn.mixed_precision.loss_scale != 2.**20
    first, last = learn.recorder.values[0], learn.recorder.values[-1]
    assert all(b < a for a, b in zip(first, last))

def test_static_scale_stays_and_the_model_trains():
    # fastai: dynamic=False keeps the scale at 512 (its default), and the model trains as in fp32
    ref, learn = one_d_learner(), one_d_learner('fp16', dynamic=False, loss_scale=512.)
    ref.fit(3); learn.fit(3)
    assert learn.mixed_precision.loss_scale == 512.
    assert all(torch.allclose(a, b, atol=2e-3) for a, b in zip(weights(learn), weights(ref)))

@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
def test_freeze_then_create_opt_trains_the_second_group_only(precision):
    # fastai: to_fp16(); freeze(); create_opt(); fit(3): the frozen group has no momentum state and does not move;
    # the second group has its grad_avg, and trains as in fp32
    ref, learn = one_d_learner(mom=0.9), one_d_learner(precision, mom=0.9, **({'loss_scale': 2.**8} if precision == 'fp16' else {}))
    for l in (ref, learn): l.freeze(); l.create_opt()
    before = weights(learn)
    ref.fit(3); learn.fit(3)
    frozen, trained = list(learn.model[0].parameters()), list(learn.model[1].parameters())
    assert all(torch.equal(a, b) for a, b in zip(before[:2], weights(learn)[:2]))
    held = dict(zip(learn.model.parameters(), masters_of(learn)))
    assert all('grad_avg' not in learn.opt.state[held[p]] for p in frozen)
    assert all('grad_avg' in learn.opt.state[held[p]] for p in trained)
    tol = 2e-2 if precision == 'bf16' else 2e-3
    assert all(torch.allclose(a, b, atol=tol) for a, b in zip(weights(learn), weights(ref)))

def test_to_fp32_after_a_fit_leaves_fp32_weights_equal_to_the_masters():
    learn = one_d_learner('fp16'); learn.fit(1)
    masters = [m.detach().clone() for m in masters_of(learn)]
    learn.to_fp32()
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    assert all(torch.equal(p.detach(), m) for p, m in zip(learn.model.parameters(), masters))
    learn.fit(1)

# ---------------------------------------------------------------- 18a_callback.training

def test_short_epoch_callback_runs_part_of_an_epoch():
    learn = synth_learner().to_fp16()
    steps = []
    learn.fit(1, cbs=[ShortEpochCallback(pct=0.5), RecordSteps(steps)])
    assert 0 < len(steps) < 6 and len(learn.mixed_precision.history) == len(steps)

class RecordSteps(Callback):
    order = MixedPrecision.order + 1
    def __init__(self, steps): self.steps = steps
    def after_step(self): self.steps.append(self.train_iter)

def test_bn_freeze_keeps_running_statistics_in_mixed_precision():
    # fastai: with a frozen body (train_bn=False), BnFreeze keeps its batchnorm layers in eval mode, so their running
    # statistics do not move; without BnFreeze they do. Both as in fp32
    def run(precision, bn_freeze):
        torch.manual_seed(0)
        body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        learn = synth_learner(nn.Sequential(body, nn.Linear(16, 1)), train_bn=False, splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
        if precision: learn.to_fp16(loss_scale=2.**8)
        learn.freeze()
        learn.fit(1, cbs=BnFreeze() if bn_freeze else [])
        return body[1].running_mean.clone()
    for bn_freeze in (True, False):
        ref, half = run(None, bn_freeze), run('fp16', bn_freeze)
        assert torch.equal(ref, torch.zeros(16)) == torch.equal(half, torch.zeros(16)) == bn_freeze
        torch.testing.assert_close(half, ref, atol=1e-2, rtol=1e-2)

# ---------------------------------------------------------------- 17_callback.tracker

def test_terminate_on_nan_stops_the_fit_when_the_recorded_loss_is_nan():
    # the loss logged by fastai is unscaled and fp32: a NaN loss stops the fit (mixedprec skips the steps, and
    # TerminateOnNaNCallback sees the NaN)
    learn = synth_learner().to_fp16(max_bad_loss=100)
    learn.loss_func = lambda pred, y: nn.functional.mse_loss(pred, y) * float('nan')
    learn.fit(3, cbs=TerminateOnNaNCallback())
    assert learn.epoch == 0 and learn.mixed_precision.skipped

def test_reduce_lr_on_plateau_reads_the_unscaled_loss():
    ref, learn = synth_learner(), synth_learner().to_fp16(loss_scale=2.**10)
    lrs = []
    for l in (ref, learn):
        l.fit(4, 1e-2, cbs=ReduceLROnPlateau(monitor='valid_loss', min_delta=10., patience=1)); lrs.append(l.opt.hypers[-1]['lr'])
    assert lrs[0] == lrs[1] < 1e-2                                   # the same decisions as in fp32

# ---------------------------------------------------------------- 14_callback.schedule

@pytest.mark.parametrize("fit", ['fit_one_cycle', 'fit_flat_cos', 'fit_sgdr'])
def test_schedules_set_the_same_hypers_as_in_fp32(fit):
    ref, learn = synth_learner(opt_func=partial(SGD, mom=0.9)), synth_learner(opt_func=partial(SGD, mom=0.9)).to_fp16(loss_scale=2.**8)
    seen = [[], []]
    for l, s in zip((ref, learn), seen):
        rec = RecordHypers(s)
        if fit == 'fit_sgdr': l.fit_sgdr(2, 1, 1e-2, cbs=rec)
        else: getattr(l, fit)(2, 1e-2, cbs=rec)
    assert seen[0] == seen[1] and len(seen[0]) >= 12 and len(set(seen[0])) > 2    # the schedule moved, the same in both
    assert all(torch.allclose(a, b, atol=5e-3) for a, b in zip(weights(learn), weights(ref)))

class RecordHypers(Callback):
    order = MixedPrecision.order + 1
    def __init__(self, seen): self.seen = seen
    def before_step(self): self.seen.append((round(self.opt.hypers[-1]['lr'], 12), round(self.opt.hypers[-1]['mom'], 12)))

# ---------------------------------------------------------------- 18b_callback.preds

def test_mc_dropout_keeps_dropout_on_at_inference_and_returns_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    learn = synth_learner(model).to_fp16()
    learn.fit(1)
    a, _ = learn.get_preds(cbs=MCDropoutCallback())
    b, _ = learn.get_preds(cbs=MCDropoutCallback())
    c, _ = learn.get_preds()
    d, _ = learn.get_preds()
    assert a.dtype == torch.float32 and not torch.equal(a, b) and torch.equal(c, d)
