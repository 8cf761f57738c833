"""Prepared steps (issue 54): the fused optimizer steps hand their tensor lists to the kernels once and each step passes
its scalars, flag and seeds. They must train as the unprepared op does, bit for bit, in every master kind and state
store; fall back when the grads they hold are no longer the grads; and let go of the tensors with their launch"""
import gc
import pytest, torch
from torch import nn
from mixedprec import amp, ops
from mixedprec.fp16_optimizer import FP16_Optimizer

pytestmark = pytest.mark.skipif(ops.kernels_for(torch.zeros(1)) is None, reason="no fused kernels on this machine")

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

def train(front, opt_name, masters, state, prepared, steps=12, freeze_at=None, new_buffer_at=None):
    "The params after `steps` steps, with the prepared launches or without (the unprepared op on the same lists)"
    m = model()
    make = {'adamw': lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            'sgd': lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)}[opt_name]
    if front == 'amp':
        m, o = amp.initialize(m, make(m.parameters()), opt_level='O2', half_dtype='bf16', masters=masters, state=state,
                              verbosity=0)
    else:
        m = m.bfloat16(); o = FP16_Optimizer(make(m.parameters()), masters=masters, state=state, verbose=False)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        if i == freeze_at: m[0].requires_grad_(False)
        if freeze_at is not None and i == freeze_at + 3: m[0].requires_grad_(True)     # its master grad is made anew
        if i == new_buffer_at:           # as a relayout does: the next unscale makes the master grad buffers anew
            e = o._mixedprec_engine if front == 'amp' else o.engine
            for ms in e.masters.masters: ms.buffer = None
        x = torch.randn(8, 16, generator=g)
        loss = m(x if front == 'amp' else x.bfloat16()).float().square().mean()
        if front == 'amp':
            with amp.scale_loss(loss, o) as s: s.backward()
        else: o.backward(loss)
        o.step(); o.zero_grad()
    return [p.detach().float().clone() for p in m.parameters()], o

@pytest.fixture
def unprepared(monkeypatch):
    "The fused steps without prepared lists: each step hands its lists to the op"
    def run(*args, **kw):
        with monkeypatch.context() as mp:
            mp.setattr(ops, 'kernels_for', lambda *a, **k: None)
            return train(*args, prepared=False, **kw)
    return run

@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
@pytest.mark.parametrize("opt_name", ['adamw', 'sgd'])
@pytest.mark.parametrize("masters,state", [('fp32', 'fp32'), ('fp32', 'bf16'), ('fp32', '8bit'), ('split', '8bit'),
                                           ('none', 'fp32')])
def test_prepared_steps_train_as_the_op_does_bit_for_bit(front, opt_name, masters, state, unprepared):
    a, _ = train(front, opt_name, masters, state, prepared=True)
    b, _ = unprepared(front, opt_name, masters, state)
    for x, y in zip(a, b): assert torch.equal(x, y)

@pytest.mark.parametrize("change", [dict(freeze_at=4), dict(new_buffer_at=5)])
def test_a_grad_made_anew_falls_back_and_prepares_again(change, unprepared):
    ("A master grad made anew (a param frozen and unfrozen, a relayout): the launch holding the old one is not used, "
     "and is made anew")
    a, o = train('amp', 'adamw', 'fp32', 'fp32', prepared=True, **change)
    b, _ = unprepared('amp', 'adamw', 'fp32', 'fp32', **change)
    for x, y in zip(a, b): assert torch.equal(x, y)
    e = o._mixedprec_engine
    launches = [l for _, ls in e.runner.fused._prepared.values() for l in ls]
    # prepared anew over the grad buffers the masters keep now (the grads were dropped by the last zero_grad)
    assert launches and all(l.prepared is not None and l.prepared.holds([e.masters.of_held[id(p)].buffer for p in l.held])
                            for l in launches)

def test_the_kernels_let_go_of_a_gone_optimizers_tensors():
    ext = ops.kernels_for(torch.zeros(1))
    gc.collect()
    before = ext.prepared_steps()
    _, o = train('fp16_optimizer', 'adamw', 'fp32', 'fp32', prepared=True)
    assert ext.prepared_steps() > before
    del o; gc.collect()
    assert ext.prepared_steps() == before
