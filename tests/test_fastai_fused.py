("fastai's Adam and SGD stepped by the fused kernels, the skip decided on the host and on the device (the CPU, with "
 "'always'), against fastai's own step")
import pytest, torch
from functools import partial
from fastai.optimizer import SGD, Adam, RAdam, Lamb, QHAdam, OptimWrapper
from fastai.callback.schedule import fit_one_cycle
from mixedprec.engine import fused_plan
from helpers import synth_learner, masters_of, Record, mlp
from mixedprec.engine import settings

FUSABLE = {'adam': (Adam, 'fastai Adam (true wd)'), 'adam-l2': (partial(Adam, decouple_wd=False), 'fastai Adam (L2)'),
           'sgd': (SGD, 'fastai SGD (true wd)'), 'sgd-mom-wd': (partial(SGD, mom=0.9, wd=1e-2),
                                                                'fastai SGD with momentum (true wd)'),
           'sgd-mom-l2': (partial(SGD, mom=0.9, wd=1e-2, decouple_wd=False), 'fastai SGD with momentum (L2)')}

def test_fastai_fused_kind_knows_adam_and_sgd_only():
    for opt_func, kind in FUSABLE.values(): assert fused_plan(opt_func(mlp().parameters(), lr=1e-3)).name == kind
    for opt_func in (RAdam, Lamb, QHAdam, partial(OptimWrapper, opt=torch.optim.RAdam)):
        assert fused_plan(opt_func(mlp().parameters(), lr=1e-3)) is None
    # fastai's OptimWrapper around an optimizer the kernels know is stepped as that optimizer
    wrapped = fused_plan(OptimWrapper(mlp().parameters(), opt=torch.optim.AdamW, lr=1e-3))
    assert wrapped.name == "fastai OptimWrapper(torch AdamW)" and wrapped.kind == 'adam'

def _fit_recording(opt_func, where, fit=lambda l: l.fit_one_cycle(3, 1e-2), **kw):
    ("Train with the skip decided `where` ('never': on the host, 'always': on the device, 'fastai': fastai's own "
     "step, which the reference ops get); the Learner, and (the fused plan's name, on the device) as seen during the "
     "fit")
    with settings(impl='ref' if where == 'fastai' else None, decide='never' if where == 'fastai' else where):
        learn = synth_learner(opt_func=opt_func, wd=kw.pop('wd', None)).to_fp16(**kw)
        seen = set()
        learn.add_cb(Record(1, before_step=lambda l: seen.add((getattr(l.mixed_precision.engine.runner.plan, 'name', None),
                                                               l.mixed_precision.engine.runner.on_device))))
        fit(learn)
    return learn, seen

def _state(learn):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for p in masters_of(learn) for k, v in learn.opt.state[p].items()}

@pytest.mark.parametrize("name", list(FUSABLE))
def test_fused_fastai_step_matches_fastais_own(name):
    # a one-cycle fit (lr and mom change every batch), weight decay off for batchnorm and biases (fastai's default
    # `do_wd`),
    # a starting scale that overflows the first steps: fastai's own step and the fused one agree to fp32 rounding; the
    # fused
    # step decided on the host and on the device, bit for bit
    opt_func, kind = FUSABLE[name]
    (host, seen_h), (fused, seen_f), (dev, seen_d) = (_fit_recording(opt_func, w, loss_scale=2.**30, max_scale=2.**30,
                                                                     wd=1e-2)
                                                      for w in ('fastai', 'never', 'always'))
    assert seen_h == {(None, False)} and seen_f == {(kind, False)} and seen_d == {(kind, True)}
    hist = lambda l: [(r.step, r.scale, r.skipped, r.reason, r.params) for r in l.mixed_precision.history]
    assert hist(host) == hist(dev) == hist(fused) and sum(r[2] for r in hist(dev)) >= 2
    for a, b in zip(masters_of(host), masters_of(dev)): torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for a, b in zip(masters_of(fused), masters_of(dev)): assert torch.equal(a, b)
    for p, q in zip(host.model.parameters(), dev.model.parameters()): assert p.dtype == q.dtype
    for p, m in zip(dev.model.parameters(), masters_of(dev)):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))   # the kernels wrote the half model
    sh, sd = _state(host), _state(dev)
    assert sh.keys() == sd.keys()
    if 'step' in sd:
        assert type(sd['step']) is int and sd['step'] == sh['step']      # fastai's ints again after the fit
    for k in sh:
        if isinstance(sh[k], torch.Tensor): torch.testing.assert_close(sd[k], sh[k], rtol=1e-5, atol=1e-7)
    assert 'step' not in dev.opt.__dict__ and 'zero_grad' not in dev.opt.__dict__     # fastai's own step between fits
    dev.opt.step()                                                                     # ... which still works

def test_fused_sgd_keeps_its_momentum_buffer_at_momentum_zero():
    # fastai's SGD built with momentum keeps `grad_avg` even while `mom` is 0 (it then holds the last grad)
    def fit(learn):
        learn.opt.set_hyper('mom', 0.); learn.fit(1, 1e-2)
        learn.opt.set_hyper('mom', 0.9); learn.fit(1, 1e-2)
    (host, _), (dev, seen) = (_fit_recording(partial(SGD, mom=0.9), w, fit=fit,
                                             loss_scale=2.**8) for w in ('fastai', 'always'))
    assert seen == {('fastai SGD with momentum (true wd)', True)}
    for a, b in zip(masters_of(host), masters_of(dev)): torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)

def test_fused_fastai_step_falls_back_to_the_host(tmp_path):
    # what the kernels cannot run decides on the host, with fastai's own step: other optimizers, flat masters
    for opt_func, kw in ((RAdam, {}), (Adam, {'flat_master': True})):
        _, seen = _fit_recording(opt_func, 'always', fit=lambda l: l.fit(1), **kw)
        assert seen == {(None, False)}

def test_fused_fastai_checkpoints_hold_ints_and_resume(tmp_path):
    learn, _ = _fit_recording(Adam, 'always', fit=lambda l: l.fit(1, 1e-2))
    learn.save(tmp_path/'ck', with_opt=True)
    sd = torch.load(tmp_path/'ck.pth', weights_only=True)
    assert {type(s['step']) for s in sd['opt']['state']} == {int}
    # resume the fused fit from the checkpoint, and continue the original: the same masters
    other, _ = _fit_recording(Adam, 'always', fit=lambda l: (l.load(tmp_path/'ck', with_opt=True), l.fit(1, 1e-2)))
    again, _ = _fit_recording(Adam, 'always', fit=lambda l: (l.fit(1, 1e-2), l.fit(1, 1e-2)))
    for a, b in zip(masters_of(other), masters_of(again)): assert torch.equal(a, b)

def test_overflowed_params_are_named_when_decided_on_the_device():
    learn, seen = _fit_recording(Adam, 'always', fit=lambda l: l.fit(1, 1e-2), loss_scale=2.**30, max_scale=2.**30)
    skipped = [r for r in learn.mixed_precision.history if r.skipped]
    assert seen == {('fastai Adam (true wd)', True)} and skipped and all(r.params for r in skipped)
