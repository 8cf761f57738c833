"""Every door that saves or loads the model saves and loads the masters (issue 54): the model's `state_dict()` and every
submodule's (peft's `save_pretrained` saves a submodule), under each front end; `amp.master_params` reads as the
masters' values; a frozen param keeps no master. Public APIs only: each of these failed before masters followed
training and the doors stood on every module"""
import pytest, torch
from torch import nn
from mixedprec import amp
from mixedprec.fp16_optimizer import FP16_Optimizer
from fastai.optimizer import Adam
from helpers import synth_learner

def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

def data(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)

def fp16_optimizer(dtype=torch.float16, masters='fp32', freeze_first=False, steps=4):
    m = model().to(dtype)
    if freeze_first: m[0].requires_grad_(False)
    opt = FP16_Optimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), static_loss_scale=64., masters=masters,
                         verbose=False)
    for i in range(steps):
        x, y = data(i)
        opt.backward(nn.functional.mse_loss(m(x.to(dtype)).float(), y)); opt.step(); opt.zero_grad()
    return m, opt

def amp_model(dtype='fp16', masters='fp32', freeze_first=False, steps=4):
    m = model()
    if freeze_first: m[0].requires_grad_(False)
    m, opt = amp.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), opt_level='O2', half_dtype=dtype,
                            masters=masters, verbosity=0, loss_scale=64. if dtype == 'fp16' else None)
    for i in range(steps):
        x, y = data(i)
        with amp.scale_loss(nn.functional.mse_loss(m(x).float(), y), opt) as s: s.backward()
        opt.step(); opt.zero_grad()
    return m, opt

def below_half(t): return not torch.equal(t, t.half().float())

@pytest.mark.parametrize("masters", ['fp32', 'split'])
def test_fp16_optimizers_model_state_dict_and_a_submodules_are_the_masters(masters):
    dtype = torch.float16 if masters == 'fp32' else torch.bfloat16
    m, opt = fp16_optimizer(dtype, masters)
    saved = opt.state_dict()['fp32_from_fp16']
    sd, sub = m.state_dict(), m[2].state_dict()
    assert [sd[k].dtype for k in ('0.weight', '2.weight')] == [torch.float32] * 2
    assert torch.equal(sd['0.weight'], saved[0]) and torch.equal(sub['weight'], saved[2]) and below_half(saved[0])

def test_amp_and_fastai_submodules_state_dicts_are_the_masters():
    m, opt = amp_model()
    masters = amp.state_dict()['masters'][0]
    assert torch.equal(m[0].state_dict()['weight'], masters[0]) and torch.equal(m[2].state_dict()['bias'], masters[3])
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    mp = learn.mixed_precision.state_dict()['masters']
    assert torch.equal(learn.model[0].state_dict()['weight'], mp[0]) and below_half(mp[0])
    assert torch.equal(learn.model[3].state_dict()['weight'], mp[4])

def test_a_submodules_load_reaches_its_masters_exactly():
    m, opt = amp_model()
    v = torch.full((16, 8), 1 / 3)
    m[0].load_state_dict({'weight': v, 'bias': torch.zeros(16)})
    assert torch.equal(amp.state_dict()['masters'][0][0], v)               # 1/3 exactly, not its fp16 rounding
    m[0].load_state_dict({'weight': v * 2}, strict=False)                  # a partial load, as peft's adapters
    assert torch.equal(amp.state_dict()['masters'][0][0], v * 2)

def test_amp_master_params_of_split_masters_read_as_their_values():
    m, opt = amp_model('bf16', 'split')
    masters = amp.state_dict()['masters'][0]
    read = [p.detach().clone() for p in amp.master_params(opt)]
    assert all(torch.equal(a, b) for a, b in zip(read, masters)) and below_half(read[0])
    # a write into one reaches the master at the next step
    with torch.no_grad(): next(amp.master_params(opt)).fill_(0.25)
    opt.param_groups[0]['lr'] = 0.
    x, y = data(9)
    with amp.scale_loss(nn.functional.mse_loss(m(x).float(), y) * 0, opt) as s: s.backward()
    opt.step()
    assert torch.equal(amp.state_dict()['masters'][0][0], torch.full((16, 8), 0.25))

@pytest.mark.parametrize("front", ['fp16_optimizer', 'amp'])
def test_a_frozen_param_keeps_no_master(front):
    m, opt = fp16_optimizer(freeze_first=True) if front == 'fp16_optimizer' else amp_model(freeze_first=True)
    masters = opt.state_dict()['fp32_from_fp16'] if front == 'fp16_optimizer' else amp.state_dict()['masters'][0]
    # a value per half param (issue 59), the frozen layer's too: its exact value, which it holds no master for
    assert [tuple(t.shape) for t in masters] == [(16, 8), (16,), (1, 16), (1,)]
    e = opt.engine if front == 'fp16_optimizer' else opt._mixedprec_engine
    assert e.view.record.get(m[0].weight) is None and e.view.record.get(m[2].weight) is not None
    held = [p for g in opt.param_groups for p in g['params']]
    assert held[0] is m[0].weight and held[0].dtype == torch.float16      # the frozen layer: held as it is
    opt_sd = opt.state_dict()['optimizer_state_dict'] if front == 'fp16_optimizer' else opt.state_dict()
    assert 0 not in opt_sd['state'] and 2 in opt_sd['state']                # no optimizer state for it either
