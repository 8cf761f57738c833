import copy
import pytest, torch
pytestmark = pytest.mark.usefixtures("decide")   # every test: the skip decided on the host, and on the device
from torch import nn
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.scaler import ScalingError
from mixedprec import ops, engine
from conftest import same_or_close

def half_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).half()

def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]

def run(model, opt, data, inject_at=None, clip=None):
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        opt.backward(loss, update_master_grads=False)
        if i == inject_at: next(model.parameters()).grad[0, 0] = float('inf')
        opt.update_master_grads()
        if clip: opt.clip_master_grads(clip)
        opt.step()

def test_seed_examples_run():
    D_in, D_out = 6, 2
    model = torch.nn.Linear(D_in, D_out).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    optimizer = FP16_Optimizer(optimizer, static_loss_scale=128.0)
    loss = model(torch.randn(3, D_in).half()).float().sum()
    optimizer.backward(loss); optimizer.step()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3), dynamic_loss_scale=True,
                               dynamic_loss_args={'scale_window': 500})
    assert optimizer.scaler.max_noskip == 500 and optimizer.loss_scale == 2.**16

def test_masters_are_fp32_and_model_follows():
    model = half_mlp()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), static_loss_scale=64., verbose=False)
    run(model, opt, batches(3))
    for p, m in zip(model.parameters(), (p for g in opt.param_groups for p in g['params'])):
        assert m.dtype == torch.float32 and torch.equal(p.detach(), m.detach().half())

def test_fp32_model_matches_plain_torch_with_skip_as_noop(impl):
    # params that are fp32 are their own masters: a power-of-two scale is exact, so the run equals plain SGD,
    # with the injected-overflow iteration a no-op
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)); model = copy.deepcopy(ref)
    data = batches(6)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for i, (x, y) in enumerate(data):
        if i == 3: continue
        ref_opt.zero_grad(); nn.functional.mse_loss(ref(x), y).backward(); ref_opt.step()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
                         dynamic_loss_scale=True,
                         dynamic_loss_args=dict(init_scale=2.**10), verbose=False)
    run(model, opt, data, inject_at=3)
    for a, b in zip(ref.parameters(), model.parameters()):
        same_or_close(a.detach(), b.detach(), impl, rtol=1e-5, atol=1e-7)
    assert [r.skipped for r in opt.history] == [False, False, False, True, False, False] and opt.loss_scale == 2.**9

def test_half_model_scaled_equals_unscaled_control_with_skip():
    data = batches(5)
    control, scaled = half_mlp(), half_mlp()
    c_opt = FP16_Optimizer(torch.optim.SGD(control.parameters(), lr=0.05), static_loss_scale=1., verbose=False)
    s_opt = FP16_Optimizer(torch.optim.SGD(scaled.parameters(), lr=0.05), static_loss_scale=256., verbose=False)
    run(control, c_opt, [b for i, b in enumerate(data) if i != 2])
    run(scaled, s_opt, data, inject_at=2)
    for a, b in zip(control.parameters(), scaled.parameters()): assert torch.equal(a, b)
    assert s_opt.loss_scale == 256. and s_opt.scaler.n_skipped == 1

def test_overflow_keeps_params_and_adam_state():
    model = half_mlp()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), static_loss_scale=8., verbose=False)
    run(model, opt, batches(2))
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[m].items()} for g in opt.param_groups for m in g['params']]
    run(model, opt, batches(1, seed=5), inject_at=0)
    assert opt.overflow and opt.skipped
    for p, q in zip(model.parameters(), params): assert torch.equal(p.detach(), q)
    for m, st in zip((m for g in opt.param_groups for m in g['params']), state):
        for k in st: assert torch.equal(opt.state[m][k], st[k])

def test_clip_master_grads_returns_norm_or_minus_one():
    model = half_mlp()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=4., verbose=False)
    x, y = batches(1)[0]
    opt.backward(nn.functional.mse_loss(model(x.half()).float(), y))
    norm = opt.clip_master_grads(1e-3)
    grads = [m.grad for g in opt.param_groups for m in g['params']]
    assert norm > 1e-3 and abs(torch.cat([g.flatten() for g in grads]).norm().item() - 1e-3) < 1e-6
    opt.zero_grad()
    opt.backward(nn.functional.mse_loss(model(x.half()).float(), y) * float('inf'))
    assert opt.clip_master_grads(1.) == -1

def test_state_dict_round_trip_continues_identically(tmp_path):
    data = batches(8)
    a = half_mlp(); a_opt = FP16_Optimizer(torch.optim.Adam(a.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                           dynamic_loss_args=dict(init_scale=2.**8, scale_window=2), verbose=False)
    run(a, a_opt, data[:4])
    torch.save({'model': a.state_dict(), 'opt': a_opt.state_dict()}, tmp_path/'ck.pt')
    run(a, a_opt, data[4:])
    b = half_mlp(seed=7); b_opt = FP16_Optimizer(torch.optim.Adam(b.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                                 dynamic_loss_args=dict(init_scale=2.**8, scale_window=2),
                                                     verbose=False)
    ck = torch.load(tmp_path/'ck.pt', weights_only=True)
    b.load_state_dict(ck['model']); b_opt.load_state_dict(ck['opt'])
    run(b, b_opt, data[4:])
    for p, q in zip(a.parameters(), b.parameters()): assert torch.equal(p, q)
    assert a_opt.scaler.state_dict() == b_opt.scaler.state_dict()
    assert all(m.dtype == torch.float32 for m in ck['opt']['fp32_from_fp16'])

def test_add_param_group_after_first_step_matches_reference():
    # reference: the group is there from the start, but its params get no grads in step 0 (so SGD leaves them alone)
    data = batches(4)
    def go(add_late):
        model = half_mlp()
        opt = FP16_Optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9), static_loss_scale=16.,
                             verbose=False)
        if not add_late:
            opt.add_param_group({'params': model[2].parameters(), 'lr': 0.01})
            for p in model[2].parameters(): p.requires_grad_(False)
        for i, b in enumerate(data):
            if i == 1:
                if add_late: opt.add_param_group({'params': model[2].parameters(), 'lr': 0.01})
                else:
                    for p in model[2].parameters(): p.requires_grad_(True)
            run(model, opt, [b])
        return model, opt
    (late, late_opt), (early, _) = go(True), go(False)
    assert len(late_opt.param_groups) == 2 and late_opt.param_groups[1]['lr'] == 0.01
    for p, q in zip(late.parameters(), early.parameters()): assert torch.equal(p, q)
    assert 'momentum_buffer' in late_opt.state[late_opt.param_groups[0]['params'][0]]

def test_gradient_accumulation_with_update_master_grads_false():
    model, data = half_mlp(), batches(4)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=32., verbose=False)
    for x, y in data: opt.backward(nn.functional.mse_loss(model(x.half()).float(), y) / 4, update_master_grads=False)
    opt.update_master_grads()
    assert opt.scaler.n_steps == 1
    ref = half_mlp()
    for x, y in data: (nn.functional.mse_loss(ref(x.half()).float(), y) / 4 * 32.).backward()
    for m, p in zip((m for g in opt.param_groups for m in g['params']), ref.parameters()):
        assert torch.equal(m.grad, p.grad.float() / 32.)

def test_closure_reruns_while_overflowing():
    model = half_mlp()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args=dict(init_scale=2.**30, max_scale=2.**30), verbose=False)
    x, y = batches(1)[0]
    calls = []
    def closure():
        calls.append(opt.loss_scale); opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.half()).float(), y); opt.backward(loss); return loss
    opt.step(closure)
    assert len(calls) > 1 and calls[-1] < calls[0] and not opt.overflow

def test_bad_arguments():
    model = half_mlp()
    with pytest.raises(TypeError, match='torch.optim.Optimizer'): FP16_Optimizer(model)
    with pytest.raises(TypeError, match='unknown dynamic_loss_args'):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1.), dynamic_loss_scale=True,
                       dynamic_loss_args={'delayed_shift': 2})
    with pytest.raises(ValueError, match='dynamic_loss_scale=True'):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1.), dynamic_loss_args={'init_scale': 4.})


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                             weight_decay=1e-3),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                      lambda ps: torch.optim.Adam(ps, lr=1e-2)])
def test_fused_step_matches_the_wrapped_optimizer(make, monkeypatch, decide):
    data = batches(6)
    runs, real = [], engine.FusedStep.__call__
    for use_fused in (False, True):
        model = half_mlp()
        opt = FP16_Optimizer(make(list(model.parameters())), dynamic_loss_scale=True,
                             dynamic_loss_args=dict(init_scale=2.**8), verbose=False,
                             impl=None if use_fused else 'ref')
        calls = []
        monkeypatch.setattr(engine.FusedStep, '__call__', lambda *a, **kw: calls.append(1) or real(*a, **kw))
        run(model, opt, data, inject_at=2)
        # on the device the overflowed step runs, as a no-op
        assert len(calls) == (0 if not use_fused else 5 if decide == 'host' else 6)
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    for a, b in zip(m1.parameters(), m2.parameters()): torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    for a, b in zip(o1.param_groups[0]['params'], o2.param_groups[0]['params']):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    s1, s2 = o1.optimizer.state_dict(), o2.optimizer.state_dict()
    assert s1['state'].keys() == s2['state'].keys() and all(s1['state'][k].keys() == s2['state'][k].keys() for k in s1['state'])
    for m in o2.engine.masters.trained: assert torch.equal(m.param.detach(), m.held.detach().half())
