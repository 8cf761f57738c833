"""Nothing lost under faults: a checkpoint of another model is refused before anything changes (all four load paths), an
interrupt at any point of a step leaves the half weights equal to the masters, and a hopeless run blames the right thing."""
import pytest
import torch
from torch import nn
from functools import partial
from fastai.optimizer import Adam, RMSProp, SGD
from mixedprec import amp
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.scaler import ScalingError
from helpers import synth_learner, masters_of, master_values, Record, mlp

def snapshot(*objs):
    "Every tensor and number reachable from state dicts, models and scalers, copied"
    def walk(o):
        if isinstance(o, torch.Tensor): return o.detach().clone()
        if isinstance(o, dict): return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)): return [walk(v) for v in o]
        return o
    return [walk(o) for o in objs]

def same(a, b):
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict): return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b

def half_net(n_out):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, n_out))

def trained_fp16(n_out):
    model = half_net(n_out).half()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True, verbose=False)
    for _ in range(2):
        opt.zero_grad(); opt.backward(model(torch.randn(8, 4).half()).float().pow(2).mean() * (1e6 if _ == 0 else 1)); opt.step()
    return model, opt

@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1)])
def test_fp16_optimizer_refuses_another_models_state_and_changes_nothing(src, dst):
    _, other = trained_fp16(src)
    model, opt = trained_fp16(dst)
    before = snapshot(opt.state_dict(), model.state_dict(), opt.scaler.state_dict())
    with pytest.raises(ValueError, match='another model; nothing was loaded'): opt.load_state_dict(other.state_dict())
    assert same(before, snapshot(opt.state_dict(), model.state_dict(), opt.scaler.state_dict()))

def trained_amp(n_out):
    model = half_net(n_out)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)
    with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as s: s.backward()
    opt.step(); opt.zero_grad()
    return model, opt

@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1)])
def test_amp_refuses_another_models_state_and_changes_nothing(src, dst):
    trained_amp(src)
    other = amp.state_dict()
    model, opt = trained_amp(dst)
    before = snapshot(amp.state_dict(), model.state_dict(), opt.state_dict())
    with pytest.raises(ValueError, match='nothing was loaded'): amp.load_state_dict(other)
    assert same(before, snapshot(amp.state_dict(), model.state_dict(), opt.state_dict()))

def fastai_learner(n_out, path):
    learn = synth_learner(mlp(n_out=n_out), opt_func=Adam, lr=1e-2, path=path).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    return learn

def test_fastai_load_of_another_models_checkpoint_changes_nothing(tmp_path):
    fastai_learner(2, tmp_path).save('other', with_opt=True)
    learn = fastai_learner(1, tmp_path)
    mp = learn.mixed_precision
    state = lambda: snapshot([m for m in masters_of(learn)], [p for p in learn.model.parameters()],
                             mp.scaler.state_dict(), learn.opt.state_dict())
    before = state()
    with pytest.raises(RuntimeError, match='size mismatch'): learn.load('other', with_opt=True)
    assert same(before, state())
    learn.fit(1)                                                   # and it still trains

def test_callback_state_of_another_model_changes_nothing(tmp_path):
    other = fastai_learner(2, tmp_path).mixed_precision.state_dict()
    learn = fastai_learner(1, tmp_path)
    mp = learn.mixed_precision
    before = snapshot(mp.state_dict())
    with pytest.raises(ValueError, match='nothing was loaded'): mp.load_state_dict(other)
    assert same(before, snapshot(mp.state_dict()))

class BoomInStep:
    "A fastai optimizer callback that raises KeyboardInterrupt on the `at`-th param it sees: the step is half done"
    def __init__(self, at): self.at, self.n = at, 0
    def __call__(self, p, **kw):
        self.n += 1
        if self.n == self.at: raise KeyboardInterrupt

def _rmsprop_boom(params, lr, **kw):
    from fastai.optimizer import Optimizer, rms_prop_step, average_sqr_grad, weight_decay
    return Optimizer(params, [weight_decay, average_sqr_grad, rms_prop_step, BoomInStep(at=20)], lr=lr, sqr_mom=0.99,
                     eps=1e-8, wd=0., mom=0.)

OPTS = {'fused adam': (Adam, {}), 'rmsprop': (RMSProp, {}), 'flat adam': (Adam, {'flat_master': True})}

@pytest.mark.parametrize("event", ['before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch',
                                   'inside the step'])
@pytest.mark.parametrize("opt", list(OPTS))
def test_an_interrupt_anywhere_in_a_step_leaves_the_half_weights_equal_to_the_masters(event, opt):
    opt_func, kw = OPTS[opt]
    if event == 'inside the step':
        if opt == 'fused adam': pytest.skip("the fused kernels step every param in one call")
        opt_func = _rmsprop_boom
    learn = synth_learner(opt_func=opt_func, lr=1e-2).to_fp16(loss_scale=2.**8, **kw)
    calls = [0]
    def boom(l):
        calls[0] += 1
        if calls[0] == 3: raise KeyboardInterrupt
    cbs = [] if event == 'inside the step' else [Record(1, **{event: boom})]
    with pytest.raises(KeyboardInterrupt): learn.fit(1, cbs=cbs)
    for p, m in zip(learn.model.parameters(), master_values(learn)):
        assert torch.equal(p.detach(), m.to(p.dtype)), (event, opt)
    if event == 'inside the step': return
    learn.fit(1)                                                   # fit works next
    masters = [m.clone() for m in master_values(learn)]
    learn.to_fp32()                                                # and so does to_fp32, from the masters
    assert all(torch.equal(p.detach(), m) for p, m in zip(learn.model.parameters(), masters))

def test_amp_o3_nan_weights_are_blamed_not_the_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level='O3', loss_scale='dynamic', min_loss_scale=2.**10, verbosity=0)
    with torch.no_grad(): model[0].weight[0, 0] = float('nan')      # what fp16 Adam does when eps underflows
    with pytest.raises(ScalingError) as e:
        for i in range(200):
            with amp.scale_loss(model(torch.randn(8, 4)).float().mean(), opt) as s: s.backward()
            opt.step(); opt.zero_grad()
    msg = str(e.value)
    assert 'weights themselves are no longer finite' in msg and '0.weight (weights' in msg
    assert "half_dtype='bf16'" in msg and 'to_bf16()' not in msg
