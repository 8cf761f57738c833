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
from fastai.callback.core import CancelFitException
from fastai.callback.training import GradientAccumulation
from fastai.test_utils import synth_learner as fastai_synth_learner, synth_dbunch
from fastai.torch_core import to_detach, no_random
from fastcore.foundation import L
from fastcore.test import test_eq, test_close, test_is, test_ne
for _f in (test_eq, test_close, test_is, test_ne): _f.__test__ = False      # fastai's assertions, not tests of ours
from mixedprec.callback import MixedPrecision
from helpers import synth_learner, masters_of, quiet

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
    dls = DataLoaders(DataLoader(TensorDataset(x[:128], y[:128]), bs=16),
                      DataLoader(TensorDataset(x[128:], y[128:]), bs=16))
    learn = Learner(dls, two_linears(), loss_func=nn.MSELoss(), opt_func=partial(SGD, mom=mom), lr=1e-2,
                    splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
    quiet(learn)
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
    ref, learn = one_d_learner(mom=0.9), one_d_learner(precision, mom=0.9,
                                                       **({'loss_scale': 2.**8} if precision == 'fp16' else {}))
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

# ---------------------------------------------------------------- 18_callback.fp16, cell by cell as fastai wrote them
# fastai's cells run `NonNativeMixedPrecision` on CUDA; here `to_fp16()`/`to_bf16()` on the CPU, with these differences
# of
# design, each marked where it applies: the model is converted at `to_fp16()`, not at `before_fit` (so the cells set the
# model before the call), it stays half until `to_fp32()`, and inputs are cast inside the model (callbacks see fp32
# `x`).
# Each numeric check is fastai's, at bf16's precision (eps x10) where fastai's eps is fp16's.

class TestBeforeMixedPrecision(Callback):
    __test__ = False
    order = -55
    def before_fit(self):
        assert first_param(self.model).dtype == self.mixed_precision.dtype    # ours: half since to_fp16()
    def before_batch(self): test_eq(self.x.dtype, torch.float32)
    def after_pred(self):
        test_eq(self.pred.dtype, torch.float32)                  # ours: the model's output hook casts it
    def after_loss(self): self.tst_loss = self.learn.loss_grad.detach().clone()
    def before_step(self):
        self.learn.has_overflown = grad_overflow(self.mixed_precision.model_pgs)
        self.grads = [p.grad.data.clone() for p in self.model.parameters()]
        self.old_params = [p.data.clone() for p in self.model.parameters()]
    def after_cancel_step(self): assert self.has_overflown

class TestAfterMixedPrecision(Callback):
    __test__ = False
    order = 65
    def __init__(self, eps=1e-3): self.eps, self.checked = eps, 0
    def before_fit(self): test_eq(first_param(self.model).dtype, self.mixed_precision.dtype)
    def after_fit(self):
        test_eq(first_param(self.model).dtype, self.mixed_precision.dtype)  # ours: half until to_fp32()
    def before_batch(self): test_eq(self.x.dtype, torch.float32)                   # ours: cast inside the model
    def after_pred(self): test_eq(self.pred.dtype, torch.float32)
    def before_backward(self):
        loss_scale = self.mixed_precision.loss_scale if self.training else 1.
        test_eq(self.loss_grad, self.test_before_mixed_precision.tst_loss * loss_scale)
    def before_step(self):
        tbmp = self.test_before_mixed_precision
        test_eq(self.loss_grad, tbmp.loss_grad)
        # Test gradients have been copied and scaled back
        test_close(sum([[p.grad.data for p in pg] for pg in self.mixed_precision.master_pgs], []),
                   [g.float() / self.mixed_precision.loss_scale for g in tbmp.grads])
    def after_batch(self):
        if self.has_overflown: return
        tbmp, mp = self.test_before_mixed_precision, self.mixed_precision
        # Test master params have been copied to model
        test_close(sum([[p.data for p in pg] for pg in mp.master_pgs], []),
                   [p.data.float() for p in self.model.parameters()], eps=self.eps)
        # Test update has been done properly
        for p, g, op in zip(self.model.parameters(), tbmp.grads, tbmp.old_params):
            test_close(p.data.float(), op.float() - self.lr * g.float() / mp.loss_scale, eps=self.eps)
        self.checked += self.training

def first_param(model): return next(iter(model.parameters()))

def grad_overflow(pgs) -> bool:
    "fastai's `grad_overflow`: a grad whose sum is inf or NaN"
    return any(p.grad is not None and not torch.isfinite(p.grad.float().sum()) for pg in pgs for p in pg)

def fastai_cell_learner(precision, mom=0., **kw):
    "fastai's cell: `synth_learner()`, two Linear(1, 1) in two groups, SGD; then ours: to_fp16()/to_bf16()"
    learn = fastai_synth_learner()
    learn.model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    learn.opt_func = partial(SGD, mom=mom)
    learn.splitter = lambda m: [list(m[0].parameters()), list(m[1].parameters())]
    quiet(learn)
    return learn.to_fp16(**kw) if precision == 'fp16' else learn.to_bf16(**kw)

class CountCancels(Callback):
    order = 70
    def __init__(self): self.cancels, self.steps = 0, 0
    def after_cancel_step(self): self.cancels += 1
    def after_step(self): self.steps += 1

@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
def test_fastai_fp16_cell_dynamic_scale(precision):
    # fastai's NonNativeMixedPrecision starts its dynamic scale at 2**24: ours is told the same, so the first steps
    # overflow
    torch.manual_seed(0)
    # bf16 has fp32's range: it does not overflow at 2**24, so its scale starts below the cap (and stays)
    kw = dict(loss_scale=2.**24) if precision == 'fp16' else dict(loss_scale=2.**20, dynamic=True)
    learn = fastai_cell_learner(precision, **kw)
    after, counts = TestAfterMixedPrecision(eps=1e-3 if precision == 'fp16' else 1e-2), CountCancels()
    learn.fit(3, cbs=[after, TestBeforeMixedPrecision(), counts])
    # Check loss scale did change
    assert 1 < learn.mixed_precision.loss_scale < 2**24
    # Check the model did train
    for v1, v2 in zip(learn.recorder.values[0], learn.recorder.values[-1]): assert v2 < v1
    # ours: a cancel is a skipped step and nothing else; every step taken was checked by fastai's after_batch
    assert counts.cancels == learn.mixed_precision.scaler.n_skipped and (counts.cancels > 0) == (precision == 'fp16')
    assert after.checked == counts.steps - counts.cancels > 0

@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
def test_fastai_fp16_cell_static_scale(precision):
    torch.manual_seed(0)
    learn = fastai_cell_learner(precision, dynamic=False, loss_scale=512.)
    after, counts = TestAfterMixedPrecision(eps=1e-3 if precision == 'fp16' else 1e-2), CountCancels()
    learn.fit(3, cbs=[after, TestBeforeMixedPrecision(), counts])
    # Check loss scale did not change
    test_eq(learn.mixed_precision.loss_scale, 512)
    # Check the model did train
    for v1, v2 in zip(learn.recorder.values[0], learn.recorder.values[-1]): assert v2 < v1
    assert counts.cancels == 0 and after.checked == counts.steps > 0

@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
def test_fastai_fp16_cell_freeze_then_create_opt(precision):
    torch.manual_seed(0)
    learn = fastai_cell_learner(precision, mom=0.9)
    learn.freeze()
    learn.create_opt()
    init_ps = [p for pg in learn.opt.param_groups for p in pg]
    learn.fit(3)
    final_ps = [p for pg in learn.opt.param_groups for p in pg]
    for p1, p2 in zip(init_ps, final_ps): test_is(p1, p2)
    # First param groups has no state because not trained
    test_eq([learn.opt.state[p] for p in learn.opt.param_lists[0]], [{}, {'do_wd': False}])
    # Second param groups has state
    for p in learn.opt.param_lists[1]: assert 'grad_avg' in learn.opt.state[p]
    learn.to_fp32()
    test_eq(first_param(learn.model).dtype, torch.float32)

@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
def test_a_step_after_the_fit_moves_the_half_model(precision):
    # learn.opt.step() is the engine's: a manual backward and step after fit move the masters *and* the model
    learn = fastai_cell_learner(precision)
    learn.fit(1)
    x, y = learn.dls.one_batch()
    before = [p.detach().clone() for p in learn.model.parameters()]
    learn.loss_func(learn.model(x), y).backward()
    learn.opt.step(); learn.opt.zero_grad()
    mp = learn.mixed_precision
    masters = [m for g in mp.master_pgs for m in g]
    assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters())
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, learn.model.parameters()))
    for p, m in zip(learn.model.parameters(), masters): test_eq(p.detach(), m.detach().to(p.dtype))

def test_a_step_after_the_fit_moves_the_half_model_with_a_torch_optimizer():
    # the same through fastai's OptimWrapper around torch's AdamW: its zero_grad sets the grads to None, as torch's does
    from fastai.optimizer import OptimWrapper
    learn = fastai_synth_learner()
    learn.model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    learn.opt_func = partial(OptimWrapper, opt=torch.optim.AdamW)
    quiet(learn)
    learn.to_bf16()
    learn.fit(1)
    x, y = learn.dls.one_batch()
    before = [p.detach().clone() for p in learn.model.parameters()]
    learn.loss_func(learn.model(x), y).backward()
    learn.opt.step(); learn.opt.zero_grad()
    masters = [m for g in learn.mixed_precision.master_pgs for m in g]
    assert all(p.grad is None for p in learn.model.parameters()) and all(m.grad is None for m in masters)
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, learn.model.parameters()))
    for p, m in zip(learn.model.parameters(), masters): test_eq(p.detach(), m.detach().to(p.dtype))

# ---------------------------------------------------------------- 18a_callback.training: one callback, two Learners in
# turn

class GetGrads(Callback):
    run_valid, order = False, GradientAccumulation.order + 1
    def before_step(self): self.grads = to_detach(L([p.grad.clone() for p in self.model.parameters()]))

def _test_acc(bs, n, cbs=None, cuda=False):
    with no_random(99):
        db = synth_dbunch(bs=bs, n_train=n, n_valid=n, cuda=cuda)
        learn = fastai_synth_learner(data=db, cbs=[GetGrads] + L(cbs))
        quiet(learn)
        learn.fit(1, lr=0.01)
        train, valid = learn.recorder.values[-1]
        return train, valid, learn.get_grads.grads, learn

def test_fastai_gradient_accumulation_cell_with_one_shared_callback():
    acc_cb = GradientAccumulation(n_acc=8)
    fp16_cb = MixedPrecision(init_scale=1024)
    train1, valid1, grads1, learn1 = _test_acc(8, 1, fp16_cb)
    train2, valid2, grads2, learn2 = _test_acc(1, 8, [acc_cb, fp16_cb])
    test_close(grads2, grads1, eps=0.01)
    test_close(valid2, valid1)
    test_ne(train2, train1)
    # ours: the callback moved to the second Learner; the first is back in fp32 without it
    assert fp16_cb.learn is learn2 and fp16_cb not in learn1.cbs and not hasattr(learn1, 'mixed_precision')
    assert all(p.dtype == torch.float32 for p in learn1.model.parameters())
    assert all(p.dtype == torch.float16 for p in learn2.model.parameters())

def test_one_callback_two_learners_fitting_at_once_is_refused_by_name():
    cb = MixedPrecision(loss_scale=2.**8)
    learn1 = fastai_synth_learner(cbs=cb)
    class Nested(Callback):
        def after_batch(self):
            with pytest.raises(ValueError, match="fitting now"): fastai_synth_learner(cbs=cb)
            raise CancelFitException()
    learn1.fit(1, cbs=Nested())
    assert cb.learn is learn1 and all(p.dtype == torch.float16 for p in learn1.model.parameters())

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
        learn = synth_learner(nn.Sequential(body, nn.Linear(16, 1)), train_bn=False,
                              splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
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
        l.fit(4, 1e-2, cbs=ReduceLROnPlateau(monitor='valid_loss', min_delta=10.,
                                             patience=1)); lrs.append(l.opt.hypers[-1]['lr'])
    assert lrs[0] == lrs[1] < 1e-2                                   # the same decisions as in fp32

# ---------------------------------------------------------------- 14_callback.schedule

@pytest.mark.parametrize("fit", ['fit_one_cycle', 'fit_flat_cos', 'fit_sgdr'])
def test_schedules_set_the_same_hypers_as_in_fp32(fit):
    ref, learn = synth_learner(
        opt_func=partial(SGD, mom=0.9)), synth_learner(opt_func=partial(SGD, mom=0.9)).to_fp16(loss_scale=2.**8)
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
    def before_step(self):
        self.seen.append((round(self.opt.hypers[-1]['lr'], 12), round(self.opt.hypers[-1]['mom'], 12)))

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
