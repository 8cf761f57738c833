import copy, pickle, warnings
import numpy as np
import pytest, torch
pytestmark = pytest.mark.usefixtures("decide")   # every test: the skip decided on the host, and on the device
from torch import nn
from mixedprec import amp

def mlp(seed=0, bn=True):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.ReLU(), nn.Linear(8, 2)]
    return nn.Sequential(*layers)

def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]

def train(model, opt, data, inject_at=None, skip=()):
    for i, (x, y) in enumerate(data):
        if i in skip: continue
        loss = nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if i == inject_at: model[0].weight.grad[0, 0] = float('nan')
        opt.step(); opt.zero_grad()

@pytest.mark.parametrize("level,dtypes", [("O0", {torch.float32}), ("O1", {torch.float32}),
                                          ("O2", {torch.half, torch.float32}), ("O3", {torch.half})])
def test_opt_levels_cast_as_documented(level, dtypes):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert {p.dtype for p in model.parameters()} == dtypes
    assert {
        p.dtype for p in amp.master_params(opt)} == ({torch.float32} if level in ('O0', 'O1', 'O2') else {torch.half})
    train(model, opt, batches(3))
    assert model(torch.randn(4, 6)).dtype == torch.float32

def test_initialize_returns_the_shapes_it_was_given():
    m0, m1 = mlp(), mlp(1)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=.1), torch.optim.SGD(m1.parameters(), lr=.1)
    model, optim = amp.initialize(m0, o0, opt_level="O2", verbosity=0); assert model is m0 and optim.optimizer is o0
    m0, m1 = mlp(), mlp(1); o0, o1 = torch.optim.SGD(m0.parameters(), lr=.1), torch.optim.SGD(m1.parameters(), lr=.1)
    model, [a, b] = amp.initialize(m0, [o0, o1], opt_level="O2",
                                   verbosity=0); assert (a.optimizer, b.optimizer) == (o0, o1)
    m0, m1 = mlp(), mlp(1); o0 = torch.optim.SGD(list(m0.parameters()) + list(m1.parameters()), lr=.1)
    [x, y], optim = amp.initialize([m0, m1], o0, opt_level="O2",
                                   verbosity=0); assert (x, y, optim.optimizer) == (m0, m1, o0)
    m0 = mlp(); assert amp.initialize(m0, opt_level="O3", verbosity=0) is m0

@pytest.mark.parametrize("kw,msg", [(dict(opt_level="O1", cast_model_type=torch.float16), "O1 keeps fp32"),
    (dict(opt_level="O0", master_weights=True), "needs a half model"),
        (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
    (dict(opt_level="O2", loss_scale=-1), "loss_scale"), (dict(opt_level="O5"), "opt_level must be"),
    (dict(opt_level="O2", cast_model_type=torch.bfloat16, half_dtype='fp16'), "contradicts"),
        (dict(opt_level="O2", num_losses=0), "num_losses")])
def test_contradicting_overrides_raise(kw, msg):
    model = mlp()
    with pytest.raises(ValueError, match=msg):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=.1), verbosity=0, **kw)

@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_returned_optimizer_wraps_the_one_passed_in_which_is_not_patched(level):
    ("amp returns an `AmpOptimizer` over the optimizer passed in: no method of that one is replaced, its groups, "
     "state and hooks are shared, ")
    ("and stepping it behind amp's back (the handle from before `initialize`) is refused, since it would neither "
     "skip nor copy into the model")
    torch.manual_seed(0)
    model = mlp(); inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    # a scheduler made on the handle from before
    before = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5)
    methods = ('step', 'zero_grad', 'state_dict', 'load_state_dict', 'add_param_group')
    own = {k: vars(inner).get(k) for k in methods}                               # (torch's scheduler wrapped `step`)
    model, opt = amp.initialize(model, inner, opt_level=level, verbosity=0)
    assert isinstance(opt, amp.AmpOptimizer) and isinstance(opt, torch.optim.Optimizer) and opt.optimizer is inner
    assert all(vars(inner).get(k) is own[k] for k in methods), "a method of the user's optimizer was replaced"
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    # and one made on the returned optimizer
    after = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    hooked = []
    opt.register_step_post_hook(lambda o, a, k: hooked.append(o))
    with warnings.catch_warnings():
        # neither scheduler warns that the step was not called
        warnings.simplefilter("error")
        for xb, yb in batches(3):
            with amp.scale_loss(nn.functional.mse_loss(model(xb), yb), inner) as s:
                s.backward()   # either handle scales
            opt.step(); before.step(); after.step(); opt.zero_grad()
    assert hooked == [inner] * 3
    assert inner.param_groups[0]['lr'] == pytest.approx(1e-2 * 0.5**3 * 0.9**3)
    with amp.scale_loss(nn.functional.mse_loss(model(xb), yb), opt) as s: s.backward()
    with pytest.raises(RuntimeError, match=r"returned the optimizer to step: `model, optimizer = amp.initialize"):
        inner.step()
    # the refused step changed nothing: the pending one still runs
    opt.step()
    assert len(hooked) == 4
    for copy_ in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="does not pickle or deep-copy.*amp.state_dict"): copy_(opt)

def test_bad_objects_raise():
    model = mlp()
    with pytest.raises(TypeError, match="nn.Modules"): amp.initialize(object(), verbosity=0)
    opt = torch.optim.SGD(model.parameters(), lr=.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="already passed"): amp.initialize(mlp(), opt, verbosity=0)
    with pytest.raises(ValueError, match="not passed to amp.initialize"):
        with amp.scale_loss(torch.ones(()), torch.optim.SGD(mlp().parameters(), lr=.1)) as s: pass
    with pytest.raises(ValueError, match="loss_id 3 is out of range"):
        with amp.scale_loss(torch.ones(()), opt, loss_id=3) as s: pass

def test_bf16_variant():
    model = mlp(); opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype='bf16', verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16 and amp._state.scalers[0].scale == 1.
    train(model, opt, batches(3))

def test_o2_scaled_run_equals_unscaled_control_with_skip_as_noop():
    data = batches(6)
    control, scaled = mlp(bn=False), mlp(bn=False)
    c_opt = torch.optim.SGD(control.parameters(), lr=0.05, momentum=0.9)
    control, c_opt = amp.initialize(control, c_opt, opt_level="O2", loss_scale=1., verbosity=0)
    train(control, c_opt, data, skip={3})
    s_opt = torch.optim.SGD(scaled.parameters(), lr=0.05, momentum=0.9)
    scaled, s_opt = amp.initialize(scaled, s_opt, opt_level="O2", max_loss_scale=2.**8, max_noskip=2, verbosity=0)
    train(scaled, s_opt, data, inject_at=3)
    for a, b in zip(control.parameters(), scaled.parameters()): assert torch.equal(a, b)
    for a, b in zip(amp.master_params(c_opt), amp.master_params(s_opt)): assert torch.equal(a, b)
    assert [r.skipped for r in amp.history()] == [False, False, False, True, False, False]

@pytest.mark.parametrize("num_losses", [1, 3])
def test_gan_three_losses_two_optimizers_skip_the_right_ones(num_losses):
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 6), nn.Linear(6, 1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level="O2", num_losses=num_losses,
                                                 max_loss_scale=2.**10, verbosity=0)
    z, real = torch.randn(8, 4), torch.randn(8, 6)
    ids = [0, 1, 2] if num_losses == 3 else [0, 0, 0]
    fake = gen(z)
    loss_d = disc(real).mean() - disc(fake.detach()).mean()
    with amp.scale_loss(loss_d, opt_d, loss_id=ids[0]) as s: s.backward()
    loss_g = -disc(fake).mean()                          # reaches both optimizers' params
    with amp.scale_loss(loss_g, [opt_g, opt_d], loss_id=ids[1]) as s: s.backward()
    loss_r = gen(z).pow(2).mean()
    with amp.scale_loss(loss_r, opt_g, loss_id=ids[2]) as s:
        s.backward(); gen.weight.grad[0, 0] = float('inf')
    wd, wg = disc.weight.detach().clone(), gen.weight.detach().clone()
    opt_g.step(); opt_d.step()
    assert (amp.skipped(opt_g), amp.skipped(opt_d)) == (True, False)
    assert torch.equal(gen.weight.detach(), wg) and not torch.equal(disc.weight.detach(), wd)
    scales = [s.scale for s in amp._state.scalers]
    assert scales == ([2.**10, 2.**10, 2.**9] if num_losses == 3 else [2.**9])
    opt_g.zero_grad(); opt_d.zero_grad()
    loss_r = gen(z).pow(2).mean()                        # the skip was for one step only
    with amp.scale_loss(loss_r, opt_g, loss_id=ids[2]) as s: s.backward()
    opt_g.step()
    assert not amp.skipped(opt_g) and not torch.equal(gen.weight.detach(), wg)

@pytest.mark.parametrize("delay", [False, True])
def test_gradient_accumulation_seed_examples(delay):
    data, iters = batches(4), 4
    model = mlp(bn=False); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.**8, verbosity=0)
    for i, (x, y) in enumerate(data, 1):
        loss = nn.functional.mse_loss(model(x), y) / iters
        with amp.scale_loss(loss, opt, delay_unscale=delay and i % iters != 0) as scaled: scaled.backward()
    grads = [p.grad.clone() for p in amp.master_params(opt)]
    ref = mlp(bn=False)
    for x, y in data: (nn.functional.mse_loss(ref(x), y) / iters).backward()
    for g, r in zip(grads, ref.parameters()): torch.testing.assert_close(g, r.grad, rtol=2e-2, atol=2e-3)
    assert len(amp.history()) == (1 if delay else 4)
    opt.step(); opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())

def test_clip_master_params_pattern():
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.**8, verbosity=0)
    x, y = batches(1)[0]
    with amp.scale_loss(nn.functional.mse_loss(model(x), y) * 100, opt) as scaled: scaled.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
    assert abs(torch.cat([p.grad.flatten() for p in amp.master_params(opt)]).norm().item() - 0.5) < 1e-4

class CustomData:
    def __init__(self, t): self.tensor = t
    def to(self, dtype): self.tensor = self.tensor.to(dtype); return self

class Takes(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(3, 1)
    def forward(self, batch, ids, arr):
        assert batch.tensor.dtype == torch.half and ids.dtype == torch.int64 and isinstance(arr, np.ndarray)
        return self.lin(batch.tensor) + ids.float().half().unsqueeze(1) * 0

def test_custom_batch_types_integers_and_numpy():
    model = Takes(); opt = torch.optim.SGD(model.parameters(), lr=.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    out = model(CustomData(torch.randn(2, 3)), torch.arange(2), np.ones(2))
    assert out.dtype == torch.float32

def test_state_dict_checkpoint_continues_identically(tmp_path):
    data = batches(8)
    def make():
        model = mlp(); opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return amp.initialize(model, opt, opt_level="O2", num_losses=2, max_loss_scale=2.**9, max_noskip=2, verbosity=0)
    model, opt = make()
    train(model, opt, data[:4], inject_at=1)
    torch.save({'model': model.state_dict(), 'opt': opt.state_dict(), 'amp': amp.state_dict()}, tmp_path/'ck.pt')
    train(model, opt, data[4:])
    final = [p.detach().clone() for p in model.parameters()]
    scale = amp._state.scalers[0].state_dict()
    model2, opt2 = make()
    ck = torch.load(tmp_path/'ck.pt', weights_only=True)
    model2.load_state_dict(ck['model']); opt2.load_state_dict(ck['opt']); amp.load_state_dict(ck['amp'])
    train(model2, opt2, data[4:])
    for a, b in zip(final, model2.parameters()): assert torch.equal(a, b.detach())
    assert amp._state.scalers[0].state_dict() == scale

@pytest.mark.skipif(not hasattr(torch, 'autocast'), reason="needs torch.autocast")
def test_o1_autocast_on_cpu_in_bf16():
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype='bf16', verbosity=0)
    train(model, opt, batches(2))
    assert model[0].weight.dtype == torch.float32 and amp._state.scalers[0].scale == 1.


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_penalty_on_the_grads_through_loss_scale_trains_as_in_fp32(dtype):
    ("torch's gradient-penalty recipe: grads of the scaled loss with `create_graph`, unscaled by `amp.loss_scale()`, "
     "their norm added to the loss. The loss is small enough (1e-6 of an MSE) that fp16's unscaled grads would flush "
     "to zero")
    def run(mixed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=5e4)
        if mixed:
            model, opt = amp.initialize(model, opt, opt_level='O2', cast_model_type=dtype, loss_scale=2.**10,
                                        verbosity=0)
        g, norms = torch.Generator().manual_seed(1), []
        for step in range(20):
            x = torch.randn(32, 8, generator=g); y = x[:, :1] * 1e-2
            loss = nn.functional.mse_loss(model(x).float(), y) * 1e-6
            scale = amp.loss_scale() if mixed else 1.
            grads = torch.autograd.grad(loss * scale, list(model.parameters()), create_graph=True)
            norm = torch.sqrt(sum((g.float() / scale).pow(2).sum() for g in grads))
            norms.append(norm.item())
            if mixed:
                with amp.scale_loss(loss + 0.1 * norm, opt) as scaled: scaled.backward()
            else: (loss + 0.1 * norm).backward()
            opt.step(); opt.zero_grad()
        return [p.detach().float() for p in model.parameters()], norms
    (ref, ref_norms), (half, norms) = run(False), run(True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=tol, atol=0)
    for a, b in zip(half, ref): torch.testing.assert_close(a, b, rtol=tol, atol=tol)

def test_loss_scale_before_initialize_says_what_to_call():
    from mixedprec import amp as fresh
    saved, fresh._state = fresh._state, None
    try:
        with pytest.raises(RuntimeError, match="amp.initialize before amp.loss_scale"): fresh.loss_scale()
    finally: fresh._state = saved
