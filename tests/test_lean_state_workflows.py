"""Lean optimizer state (`state='bf16'`, `state='8bit'`) under what fastai users combine with it: `lr_find` (saves and
restores the optimizer), `fine_tune` (freeze, then params gain state), discriminative learning rates, `fit_one_cycle`
(scheduled lr and momentum), `GradientAccumulation`, and a copy of the Learner mid-training. Each against a twin run: the
same run without the workflow (bit for bit where it must leave no trace), or with fp32 state (close)."""
import copy
import pytest, torch
from fastai.optimizer import Adam
from fastai.callback.training import GradientAccumulation
from fastai.callback.schedule import *                   # Learner.lr_find, fit_one_cycle
from mixedprec.state import SCALES
from helpers import group_learner
from test_lean_state import assert_same, bits
from test_fastai_workflows import params as weights

STATES = ['bf16', '8bit']

def lean_learner(state, **kwargs):
    ("Body and head in two param groups, split bf16 masters with `state`; 2400 body weights: blocks of 256 and a "
     "ragged one")
    return group_learner(width=300, opt_func=Adam, lr=1e-2, **kwargs).to_bf16(masters='split', state=state)

def fastai_opt(learn): return learn.opt.opt if hasattr(learn.opt, 'opt') else learn.opt

def opt_state(learn):
    "Every state tensor of the optimizer, param by param in its groups' order (codes, scales, bf16 or fp32 moments)"
    opt = fastai_opt(learn)
    return [v.clone() for ps in opt.param_lists for p in ps for k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]

def lean_kinds(learn):
    "The dtypes of the moments the optimizer holds, over params that have state"
    return {v.dtype for s in fastai_opt(learn).state.values() for k, v in s.items() if k in ('grad_avg', 'sqr_avg')}

LEAN = {'bf16': {torch.bfloat16}, '8bit': {torch.int8, torch.uint8}, 'fp32': {torch.float32}}

@pytest.mark.parametrize("state", STATES)
def test_lr_find_leaves_no_trace_in_lean_state(state):
    ("lr_find saves the model and optimizer, explores, and loads them back: the run after it is bit for bit the run "
     "without it")
    with_find, without = lean_learner(state), lean_learner(state)
    for learn in (with_find, without): learn.fit(1)
    before = (weights(with_find), opt_state(with_find))
    with with_find.no_bar(), with_find.no_logging(): with_find.lr_find(num_it=10, show_plot=False)
    assert_same(weights(with_find), before[0]); assert_same(opt_state(with_find), before[1])
    assert lean_kinds(with_find) == LEAN[state]
    for learn in (with_find, without): learn.fit(1)
    assert_same(weights(with_find), weights(without))

@pytest.mark.parametrize("state", STATES)
def test_fine_tune_gives_newly_unfrozen_params_lean_state_and_trains_as_fp32_state(state):
    ("Frozen body params have no state; when fine_tune unfreezes them they gain it in the lean form, and the run "
     "ends where fp32 state's does")
    losses = {}
    for st in ('fp32', state):
        learn = lean_learner(st)
        learn.freeze()
        # (fastai's freeze leaves batchnorm training)
        body = [m.detach().clone() for m in learn.model[0][0].parameters()]
        learn.fit(2)
        assert_same([p.detach() for p in learn.model[0][0].parameters()], body)        # frozen: unmoved
        assert not any(isinstance(v, torch.Tensor) for p in learn.model[0][0].parameters()    # and without state
                       for v in fastai_opt(learn).state[p].values())            # (fastai's `do_wd` flag is no state)
        learn.unfreeze()
        learn.fit(4, lr=slice(1e-3, 1e-2))
        assert [h['lr'] for h in learn.opt.hypers] == [1e-3, 1e-2]
        assert not torch.equal(bits(learn.model[0][0].weight.detach()), bits(body[0]))  # unfrozen: trained
        assert lean_kinds(learn) == LEAN[st]
        losses[st] = learn.validate()[0]
    assert losses[state] == pytest.approx(losses['fp32'], rel=0.15)

@pytest.mark.parametrize("state", STATES)
def test_one_cycle_schedule_and_gradient_accumulation_with_lean_state_train_as_fp32_state(state):
    ("fit_one_cycle schedules lr and Adam's beta1 (fastai's mom) every step; GradientAccumulation steps every 4th "
     "batch: both reach the fused step's hyper-parameters")
    for kw in ({}, {'cbs': [GradientAccumulation(n_acc=4 * 32)]}):
        losses = {}
        for st in ('fp32', state):
            learn = lean_learner(st, **kw)
            learn.fit_one_cycle(6, 1e-2)
            assert learn.opt.hypers[0]['mom'] != learn.opt.hypers[0].get('mom0', None)
            losses[st] = learn.validate()[0]
        assert losses[state] == pytest.approx(losses['fp32'], rel=0.15), kw

@pytest.mark.parametrize("state", STATES)
def test_a_copied_learner_trains_on_as_the_original(state):
    ("copy.deepcopy of a Learner mid-training carries the lean state, its scales and rounding seeds: both then train "
     "bit for bit alike")
    learn = lean_learner(state)
    learn.fit(2)
    twin = copy.deepcopy(learn)
    assert_same(opt_state(twin), opt_state(learn))
    for l in (learn, twin): l.fit(2)
    assert_same(weights(twin), weights(learn))
    assert_same(opt_state(twin), opt_state(learn))
    if state == '8bit': assert any(k.endswith(SCALES) for s in fastai_opt(learn).state.values() for k in s)

@pytest.mark.parametrize("inner", ['AdamW', 'Adam', 'SGD'])
@pytest.mark.parametrize("state", STATES)
def test_fastais_optim_wrapper_around_torchs_optimizers_keeps_lean_state(inner, state, tmp_path):
    ("fastai's documented way to train with a torch optimizer, `opt_func=partial(OptimWrapper, opt=...)`, takes lean "
     "state as the torch optimizer itself does: fused steps keep it lean, it trains as fp32 state, `save`/`load` "
     "resume bit for bit, and `to_fp32()` gives the torch optimizer fp32 moments")
    from functools import partial
    from fastai.optimizer import OptimWrapper
    kw = dict(momentum=0.9) if inner == 'SGD' else {}
    def learner(st):
        return group_learner(width=300, opt_func=partial(OptimWrapper, opt=getattr(torch.optim, inner), **kw), lr=1e-2,
                             path=tmp_path).to_bf16(masters='split', state=st)
    def moments(learn):
        o = learn.opt
        while hasattr(o, 'opt'): o = o.opt                  # mixedprec's wrapper, fastai's OptimWrapper, torch's
        return {v.dtype for s in o.state.values() for k, v in s.items() if k in ('exp_avg', 'exp_avg_sq', 'momentum_buffer')}
    losses = {}
    for st in ('fp32', state):
        learn = learner(st)
        learn.fit(3)
        assert moments(learn) == (LEAN[st] - {torch.uint8} if inner == 'SGD' else LEAN[st])   # SGD: one signed moment
        assert learn.mixed_precision.engine.runner.plan.name == f"fastai OptimWrapper(torch {inner})"
        losses[st] = learn.validate()[0]
    assert losses[state] == pytest.approx(losses['fp32'], rel=0.15)
    whole, halves = learner(state), learner(state)
    whole.fit(2)
    halves.fit(1); halves.save('half', with_opt=True)
    resumed = learner(state); resumed.load('half', with_opt=True); resumed.fit(1)
    assert_same(weights(resumed), weights(whole))
    resumed.to_fp32()
    assert moments(resumed) == {torch.float32}
