"""The fused kernels as torch custom ops: each schema passes torch.library.opcheck (schema, fake kernel, autograd
registration, AOT dispatch) on every device the build has, and a model compiled with torch.compile trains under the three
front ends with no graph break caused by mixedprec."""
import pytest
import torch
from torch import nn
from mixedprec import ops, amp
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.engine import Stage

DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])

@pytest.fixture(scope='module')
def kernels():
    k, why = ops._fused()
    if k is None: pytest.skip(f"no fused kernels here: {why}")
    return k

def lists(device, dtype=torch.half, n=2):
    shapes = [(5,), (2, 3)][:n]
    return [torch.randn(s, device=device).to(dtype) for s in shapes], [torch.randn(s, device=device) for s in shapes]

@pytest.mark.parametrize("device", DEVICES)
def test_every_op_passes_opcheck(kernels, device):
    from torch.library import opcheck
    k = kernels.ops
    g16, m32 = lists(device)
    flag = torch.zeros((), dtype=torch.bool, device=device)
    opcheck(k['scale_check_'], (g16, [torch.zeros_like(m) for m in m32], 0.5, None))
    opcheck(k['scale_check_'], (g16, [torch.zeros_like(m) for m in m32], 1., torch.tensor([0.25], device=device)))
    opcheck(k['scale_add_check_'], (g16, [torch.zeros_like(m) for m in m32], 0.5, None))
    opcheck(k['l2norm'], (m32,))
    out = [m.to(g.dtype) for g, m in zip(g16, m32)]
    opcheck(k['sgd_step_'], (g16, [m.clone() for m in m32], [torch.zeros_like(m) for m in m32], out, flag, 1., 0.1,
                             0.9, 0., 1e-2, True, False, False, [], None, None, []))
    opcheck(k['adam_step_'], (g16, [m.clone() for m in m32], [torch.zeros_like(m) for m in m32],
                              [torch.zeros_like(m) for m in m32], out, flag,
                              [torch.zeros((), device=device) for _ in m32], 1., 1e-3, 0.9, 0.999, 1e-8, 1e-2, True,
                                  [], None, None, []))
    # bf16 masters: split, and stochastic rounding
    hi, lo = zip(*[ops.split_bf16_ref(m) for m in m32])
    seeds = torch.arange(len(m32), dtype=torch.int64, device=device)
    for lows, sd in (([l.clone() for l in lo], None), ([], seeds)):
        opcheck(k['sgd_step_'], (g16, [h.clone() for h in hi], [torch.zeros_like(m) for m in m32], [], flag, 1., 0.1,
                                 0.9, 0., 1e-2, True, False, False, lows, sd, None, []))
        opcheck(k['adam_step_'], (g16, [h.clone() for h in hi], [torch.zeros_like(m) for m in m32],
                                  [torch.zeros_like(m) for m in m32], [], flag,
                                  [torch.zeros((), device=device) for _ in m32], 1., 1e-3, 0.9, 0.999, 1e-8, 1e-2,
                                      True, lows, sd, None, []))
    # bf16 state, with a seed per param and state list
    b16 = lambda: [torch.zeros_like(m, dtype=torch.bfloat16) for m in m32]
    ss = torch.arange(2 * len(m32), dtype=torch.int64, device=device).reshape(len(m32), 2)
    opcheck(k['sgd_step_'], (g16, [m.clone() for m in m32], b16(), out, flag, 1., 0.1, 0.9, 0., 1e-2, True, False,
                             False, [], None, ss[:, :1].contiguous(), []))
    opcheck(k['adam_step_'], (g16, [m.clone() for m in m32], b16(), b16(), out, flag,
                              [torch.zeros((), device=device) for _ in m32], 1., 1e-3, 0.9,
                              0.999, 1e-8, 1e-2, True, [], None, ss, []))
    # 8-bit state: codes, and a scale per 256 elements
    q8 = lambda dtype=torch.int8: [torch.zeros_like(m, dtype=dtype) for m in m32]
    sc = lambda: [torch.zeros(1, device=device) for m in m32]
    opcheck(k['sgd_step_'], (g16, [m.clone() for m in m32], q8(), out, flag, 1., 0.1, 0.9, 0., 1e-2, True, False,
                             False, [], None, ss[:, :1].contiguous(), sc()))
    opcheck(k['adam_step_'], (g16, [m.clone() for m in m32], q8(), q8(torch.uint8), out, flag,
                              [torch.zeros((), device=device) for _ in m32], 1., 1e-3, 0.9,
                              0.999, 1e-8, 1e-2, True, [], None, ss, sc() + sc()))

def test_the_ops_live_in_the_builds_namespace(kernels):
    assert kernels.namespace.startswith('mixedprec_') and hasattr(torch.ops, kernels.namespace)
    g16, m32 = lists('cpu')
    assert getattr(torch.ops, kernels.namespace).scale_check_(g16, m32, 2.).item() is False
    for g, m in zip(g16, m32): assert torch.equal(m, g.float() * 2)

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

def graph_breaks(model, x) -> list:
    "The graph breaks Dynamo reports for one forward of `model`"
    torch._dynamo.reset()
    return [str(b.reason) for b in torch._dynamo.explain(model)(x).break_reasons]

@pytest.mark.parametrize("front", ['amp O1', 'amp O2', 'fp16_optimizer', 'fastai'])
def test_a_compiled_model_trains_without_a_graph_break_from_mixedprec(front):
    model, x, y = mlp(), torch.randn(32, 8), torch.randn(32, 1)
    plain_breaks = graph_breaks(mlp(), x)
    if front.startswith('amp'):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level=front.split()[1], verbosity=0, half_dtype='bf16')
    elif front == 'fp16_optimizer':
        model = model.bfloat16(); x = x.bfloat16()
        opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), verbose=False)
    else:
        from helpers import synth_learner
        learn = synth_learner(model, lr=1e-2).to_bf16()
    assert graph_breaks(model, x) == plain_breaks
    compiled = torch.compile(model)
    losses = []
    if front == 'fastai':
        learn.model = compiled; learn.fit(2)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return
    for _ in range(5):
        loss = nn.functional.mse_loss(compiled(x).float(), y)
        if front.startswith('amp'):
            with amp.scale_loss(loss, opt) as s: s.backward()
        else: opt.backward(loss)
        opt.step(); opt.zero_grad(); losses.append(loss.item())
    assert losses[-1] < losses[0]

def test_the_fused_optimizer_step_compiles_as_one_graph_and_matches_eager(state='fp32'):
    from mixedprec import engine
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0, decide='always', max_loss_scale=2.**10,
                                    state=state)
        e = opt._mixedprec_engine
        step = torch.compile(engine.fused_opt_step, fullgraph=True) if compiled else engine.fused_opt_step
        g = torch.Generator().manual_seed(1)
        for i in range(6):
            x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
            with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y) * (1e6 if i == 3 else 1), opt) as s:
                s.backward()
            if i == 0: opt.step()                              # the first step makes the optimizer state, eagerly
            # what `StepEngine.step` does around the kernels, the skip read on the device
            else:
                step(opt, e.runner.plan, e.masters, e.progress.found, None, state)
                e.progress.ended(Stage.STEPPED); e.masters.weights.written()
            opt.zero_grad()
        return [m.detach().clone() for m in amp.master_params(opt)], [opt.state[m]['step'].item() for m in amp.master_params(opt)]
    torch._dynamo.reset()
    (eager, steps), (compiled, csteps) = run(False), run(True)
    assert steps == csteps == [5.] * 4                        # the overflowed step counted by neither
    for a, b in zip(eager, compiled): assert torch.equal(a, b)

@pytest.mark.parametrize("state", ['bf16', '8bit'])
def test_a_compiled_step_with_stochastic_rounding_says_to_compile_the_model_instead(state):
    # the rounding seeds are host ints that change every step; dynamo would recompile for each, then overflow int64 in
    # inductor
    from mixedprec import engine
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level='O2', half_dtype='bf16', verbosity=0, state=state)
    e = opt._mixedprec_engine
    with amp.scale_loss(model(torch.randn(4, 8)).float().pow(2).mean(), opt) as s: s.backward()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="inside torch.compile.*Compile the model"):
        torch.compile(engine.fused_opt_step, fullgraph=True)(opt, e.runner.plan, e.masters, e.progress.found, None, state)
    opt.step()                                                   # eagerly it steps
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k in ('exp_avg', 'exp_avg_sq')} == (
        {torch.bfloat16} if state == 'bf16' else {torch.int8, torch.uint8})
