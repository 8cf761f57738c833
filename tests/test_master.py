import dataclasses
from collections import namedtuple, OrderedDict
import numpy as np
import pytest, torch
from torch import nn
from mixedprec.convert import convert_model, cast_floats, to_fp32, check_half_dtype
from mixedprec.master import MasterParams
from mixedprec.engine import StepEngine, SwappedOptimizer, clip_norm
from mixedprec.scaler import LossScaler, ScalingError
from conftest import same_or_close

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_keeps_every_batchnorm_fp32(dtype):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4),
                          nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False)), nn.Linear(4, 2))
    convert_model(model, dtype)
    assert [p.dtype for p in model.parameters()] == [dtype]*2 + [torch.float32]*2 + [dtype]*4
    bn = model[2][1]
    assert (bn.running_mean.dtype, bn.running_var.dtype,
            bn.num_batches_tracked.dtype) == (torch.float32, torch.float32, torch.int64)
    model.train(); model(torch.randn(5, 3).to(dtype)).float().sum().backward()

def test_keep_fp32_is_configurable_and_casts_io():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    conv = convert_model(model, keep_fp32=(nn.LayerNorm, ))
    assert model[1].weight.dtype == torch.float32
    # a kept module that needs fp32 inputs gets cast hooks
    conv.undo(); conv = convert_model(model, keep_fp32=[nn.Linear])
    assert model[0].weight.dtype == torch.float32
    out = model(torch.randn(2, 3).half())
    assert out.dtype == torch.half
    conv.undo()
    assert model(torch.randn(2, 3)).dtype == torch.float32 and not model[0]._forward_pre_hooks

def test_undo_restores_exact_fp32_and_keeps_identity():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ids, vals = [id(p) for p in model.parameters()], [p.detach().clone() for p in model.parameters()]
    convert_model(model).undo()
    assert [id(p) for p in model.parameters()] == ids
    for p, v in zip(model.parameters(), vals): assert p.dtype == torch.float32 and torch.equal(p.detach(), v)

def test_already_half_params_and_tied_weights():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False); head.weight = emb.weight
    model = nn.Sequential(emb, head).half()
    conv = convert_model(model)
    assert len(conv.masters) == 1 and next(iter(conv.masters.values())).held.dtype == torch.float32
    mp = MasterParams([list(model.parameters())], conv.masters)
    assert len(mp.master_params) == 1
    model(torch.tensor([1, 2])).float().sum().backward()
    assert not mp.grads.unscale(1.).item()
    assert torch.equal(mp.master_params[0].grad, emb.weight.grad.float())

def test_param_listed_twice_gets_one_master():
    model = nn.Linear(2, 2)
    conv = convert_model(model)
    mp = MasterParams([[model.weight], [model.weight, model.bias]], conv.masters)
    assert [len(g) for g in mp.groups] == [1, 1] and len(mp.masters) == 2

@pytest.mark.parametrize("flat", [False, True])
def test_none_grads_are_skipped_and_master_grads_start_at_zero(flat):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    conv = convert_model(model)
    mp = MasterParams([list(model.parameters())], conv.masters, flat=flat)
    model[1](torch.randn(2, 3).half()).float().sum().backward()      # model[0] gets no grads
    assert not mp.grads.unscale(0.5).item()
    first, third = mp.masters[0], mp.masters[2]
    if flat: assert torch.count_nonzero(first.grad) == 0                # zero in the flat grad others reach
    else: assert first.grad is None
    assert torch.equal(third.grad, model[1].weight.grad.float() * 0.5)

def test_flat_split_by_key_and_state_round_trip():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward(); opt.step()
    moms = [opt.state[p]['momentum_buffer'].clone() for p in model.parameters()]
    conv = convert_model(model)
    # weights and biases apart
    mp = MasterParams([list(model.parameters())], conv.masters, flat=True, key=lambda p: p.dim())
    assert len(mp.groups[0]) == 2
    mp.state_in(opt.state)
    assert all(m in opt.state for m in mp.groups[0])
    mp.state_out(opt.state)
    for p, m in zip(model.parameters(), moms): assert torch.equal(opt.state[p]['momentum_buffer'], m)

def test_clip_matches_clip_grad_norm_on_fp32_copy(impl):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)); model.load_state_dict(ref.state_dict())
    conv = convert_model(model)
    mp = MasterParams([list(model.parameters())], conv.masters)
    x = torch.randn(4, 5)
    model(x.half()).float().sum().backward()
    mp.grads.unscale(1.)
    for p, m in zip(ref.parameters(), mp.master_params): p.grad = m.grad.clone()    # the same unscaled grads, in fp32
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norm = clip_norm([mp], 0.1)
    same_or_close(norm, expected, impl)
    for p, m in zip(ref.parameters(), mp.master_params): same_or_close(p.grad, m.grad, impl)

def test_unscale_names_params_when_hopeless():
    model = nn.Sequential(nn.Linear(2, 2))
    conv = convert_model(model)
    sc = LossScaler(loss_scale=1., max_overflow_at_min=2)
    engine = StepEngine.attach(torch.optim.SGD(model.parameters(), lr=0.), conv.masters, scaler=sc,
                               names={p: n for n, p in model.named_parameters()})
    for i in range(2):
        model(torch.randn(1, 2).half()).float().sum().backward()
        model[0].weight.grad[0, 0] = float('nan')
        if i == 0: engine.unscale(); assert engine.must_skip(); engine.step()
    with pytest.raises(ScalingError, match=r"0\.weight \(nan\)"): engine.unscale()
    assert sc.scale == 1.

def test_unscale_nonfinite_norm_is_overflow():
    model = nn.Linear(2, 1)
    conv = convert_model(model)
    # unscaling by 2**120 leaves finite fp32 values whose squares overflow
    sc = LossScaler(loss_scale=2.**-120, min_scale=2.**-130)
    engine = StepEngine.attach(torch.optim.SGD(model.parameters(), lr=0.), conv.masters, scaler=sc, clip=1.)
    model.weight.grad = torch.full((1, 2), 60000., dtype=torch.half); model.bias.grad = torch.zeros(1, dtype=torch.half)
    engine.scale(torch.zeros(()))                # (the grads were set by hand: no scaled backward made them)
    engine.unscale()
    assert engine.must_skip()
    assert sc.history[-1].reason == 'nonfinite_norm' and sc.scale == 2.**-121

Point = namedtuple('Point', 'x y')
class Sub(OrderedDict): pass
@dataclasses.dataclass
class DC:
    a: torch.Tensor
    n: int = 3
class Custom:
    def __init__(self, t): self.t = t
    def to(self, dtype): return Custom(self.t.to(dtype))

def test_cast_floats_keeps_types_and_never_casts_integers():
    b = [Point(torch.ones(2), torch.arange(2)), Sub(m=torch.ones(2, dtype=torch.bool), f=torch.ones(1)),
         DC(torch.ones(1)),
         Custom(torch.ones(1)), np.ones(2), 'text', None, (torch.ones(1, dtype=torch.uint8),)]
    out = cast_floats(b, torch.half)
    assert type(out) is list and type(out[0]) is Point and type(out[1]) is Sub and type(out[2]) is DC
    assert (out[0].x.dtype, out[0].y.dtype, out[1]['m'].dtype, out[1]['f'].dtype, out[2].a.dtype,
            out[2].n) == (torch.half, torch.int64, torch.bool, torch.half, torch.half, 3)
    assert out[
        3].t.dtype == torch.half and out[
            4] is b[4] and out[5] == 'text' and out[6] is None and out[7][0].dtype == torch.uint8
    back = to_fp32({'a': out[0].x, 'b': torch.ones(1, dtype=torch.float64)})
    assert back['a'].dtype == torch.float32 and back['b'].dtype == torch.float64

def test_check_half_dtype():
    assert check_half_dtype('bf16') == torch.bfloat16
    with pytest.raises(ValueError, match='float16 or torch.bfloat16'): check_half_dtype(torch.float32)
