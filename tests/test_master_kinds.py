"""A kind of master written here only, with no change under mixedprec/ (issue 54): an fp16 param's master kept as the
fp16 weight and the fp32 remainder that makes it exact, which the fused kernels do not step. Through every front end it
trains as fp32 masters do, clips, skips an overflow, and its values survive every door that saves and loads"""
import copy, io
import pytest, torch
from torch import nn
from mixedprec import amp
from mixedprec.master import StandInMaster
from mixedprec.fp16_optimizer import FP16_Optimizer
from fastai.optimizer import Adam
from helpers import synth_learner, master_values, values_of

class PairMaster(StandInMaster):
    "The master of an fp16 param as the param and an fp32 remainder `low`: value = param + low, exactly"
    def __init__(self, param, held=None):
        super().__init__(param, held)
        self.low = torch.zeros_like(param, dtype=torch.float32)
    @classmethod
    def refuses(cls, dtype): return None if dtype == torch.float16 else "PairMaster keeps fp16 params"
    def value(self): return self.param.detach().float() + self.low.float()
    def put(self, v):
        self.param.copy_(v)
        self.low.copy_(v - self.param.float())
    def take_param(self): self.low.zero_()          # the param was edited: it is the whole value

def data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g)

def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

def train_fp16_optimizer(masters, steps=30, clip=None, inf_at=None):
    m = model().half()
    opt = FP16_Optimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), static_loss_scale=64., masters=masters,
                         verbose=False)
    x, y = data()
    norms = []
    for i in range(steps):
        opt.backward(nn.functional.mse_loss(m(x.half()).float(), y), update_master_grads=False)
        if i == inf_at: m[0].weight.grad[0, 0] = float('inf')
        opt.update_master_grads()
        if clip: norms.append(opt.clip_master_grads(clip))
        opt.step(); opt.zero_grad()
    return m, opt, norms

def test_a_kind_written_outside_the_package_trains_clips_and_skips_as_fp32_masters():
    (m1, o1, n1), (m2, o2, n2) = (train_fp16_optimizer(k, clip=0.5, inf_at=10) for k in ('fp32', PairMaster))
    assert all(type(m) is PairMaster for m in o2.engine.masters.trained)
    assert o2.engine.runner.plan is None                         # the fused kernels do not know it: its own step
    assert [r.skipped for r in o1.history] == [r.skipped for r in o2.history] and o2.history[10].skipped
    torch.testing.assert_close(torch.tensor(n1), torch.tensor(n2), rtol=1e-3, atol=1e-4)
    for a, b in zip(values_of(o1.engine), values_of(o2.engine)): torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)

def test_its_values_survive_every_door():
    m, opt, _ = train_fp16_optimizer(PairMaster, steps=5)
    values = [t.clone() for t in values_of(opt.engine)]
    assert not all(torch.equal(v, v.half().float()) for v in values)     # bits below fp16's: the remainder holds them
    # the model's state_dict and a submodule's
    sd = m.state_dict()
    assert torch.equal(sd['0.weight'], values[0]) and torch.equal(m[2].state_dict()['weight'], values[2])
    # FP16_Optimizer's checkpoint, into a fresh model and optimizer
    buf = io.BytesIO(); torch.save({'model': sd, 'opt': opt.state_dict()}, buf); buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    m2 = model(seed=5).half()
    o2 = FP16_Optimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2), masters=PairMaster, verbose=False)
    m2.load_state_dict(ck['model'])
    assert all(torch.equal(a, b) for a, b in zip(values_of(o2.engine), values))
    o2.load_state_dict(ck['opt'])
    assert all(torch.equal(a, b) for a, b in zip(values_of(o2.engine), values))
    # a copy of the model keeps fp32 masters of its own, with the values
    twin = copy.deepcopy(m)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), sd.values()))

def test_through_amp_and_its_checkpoint():
    def run(masters):
        m = model().half(); o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        m, o = amp.initialize(m, o, opt_level='O2', masters=masters, verbosity=0, loss_scale=128.)
        x, y = data()
        for _ in range(20):
            with amp.scale_loss(nn.functional.mse_loss(m(x).float(), y), o) as s: s.backward()
            amp.clip_grad_norm_(o, 1.); o.step(); o.zero_grad()
        return m, o
    (_, o1), (m2, o2) = run('fp32'), run(PairMaster)
    for a, b in zip(values_of(o1._mixedprec_engine), values_of(o2._mixedprec_engine)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    # amp.master_params reads as the values, and a write into one reaches the master
    held = list(amp.master_params(o2))
    assert all(torch.equal(h, v) for h, v in zip(held, values_of(o2._mixedprec_engine)))
    sd = amp.state_dict()
    o2.param_groups[0]['lr'] = 0.
    with torch.no_grad(): held[0].fill_(0.25)
    with amp.scale_loss(m2(data()[0]).float().sum() * 0, o2) as s: s.backward()
    o2.step()
    assert torch.equal(values_of(o2._mixedprec_engine)[0], torch.full_like(held[0], 0.25))
    amp.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(values_of(o2._mixedprec_engine), sd['masters'][0]))

def test_through_fastai_save_and_load(tmp_path):
    learn = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path).to_fp16(masters=PairMaster, loss_scale=2.**8)
    learn.fit(1)
    assert all(type(m) is PairMaster for m in learn.mixed_precision.engine.masters.trained)
    values = [v.clone() for v in master_values(learn)]
    learn.save('pair')
    other = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path, seed=3).to_fp16(masters=PairMaster).load('pair')
    assert all(torch.equal(a, b) for a, b in zip(master_values(other), values))
    learn.fit(1); other.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(master_values(other), master_values(learn)))
    learn.to_fp32()
    assert all(torch.equal(p.detach(), v) for p, v in zip(learn.model.parameters(), master_values(other)))

def test_a_kind_that_cannot_hold_the_dtype_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="PairMaster keeps fp16 params"):
        FP16_Optimizer(torch.optim.SGD(model().bfloat16().parameters(), lr=0.1), masters=PairMaster, verbose=False)
