"""The step engine under the three front ends: the silent failures it removed, and the behaviours of apex's and PyTorch's
own suites (apex tests/L0/run_amp: multiple models, optimizers and losses, checkpointing, add_param_group; torch's
grad-scaling tests: skipped iterations, clipping, accumulation, multiple optimizers and losses, state_dict), each against an
fp32 reference run that skips the same steps."""
import copy
import pytest
import torch
from torch import nn
from mixedprec import amp
from mixedprec.engine import StepEngine, Stage, settings, fused_plan
from mixedprec.fp16_optimizer import FP16_Optimizer
from helpers import synth_learner, masters_of, Record

LEVELS = ['O0', 'O1', 'O2', 'O3']

def two_layer(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)

# ---- the six silent failures ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("clear", ['model.zero_grad', 'grad=None', 'none'])
def test_amp_o2_master_grads_do_not_carry_into_the_next_step(clear, impl):
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.**8, verbosity=0)
    for _ in range(3):
        if clear == 'model.zero_grad': model.zero_grad()
        elif clear == 'grad=None': model.weight.grad = None
        with amp.scale_loss(model(torch.ones(1, 2)).sum(), opt) as s: s.backward()
        assert [p.grad.tolist() for p in amp.master_params(opt)] == [[[1., 1.]]]
        opt.step()

def test_amp_o2_master_grads_do_not_carry_past_a_skipped_step():
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.**8, verbosity=0)
    with amp.scale_loss(model(torch.ones(1, 2)).sum() * 1e6, opt) as s: s.backward()      # overflows fp16 once scaled
    opt.step()
    assert amp.skipped(opt)
    model.zero_grad()
    with amp.scale_loss(model(torch.ones(1, 2)).sum(), opt) as s: s.backward()
    assert [p.grad.tolist() for p in amp.master_params(opt)] == [[[1., 1.]]]

def test_amp_o3_state_dict_holds_the_trained_weights():
    model = two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(3):
        x, y = batch(i)
        with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s: s.backward()
        opt.step(); opt.zero_grad()
    sd = model.state_dict()
    assert all(v.dtype == torch.float16 for v in sd.values())                   # pure half precision: no masters
    assert all(torch.equal(sd[k], p.detach()) for k, p in model.named_parameters())
    assert not all(torch.equal(sd[k], before[k]) for k in sd)

def _add_group_run(level, mixed, impl_):
    ("Train the first layer, add the second as a new group after two steps; returns the weights (fp32 reference when "
     "not `mixed`)")
    model = two_layer()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    if mixed: model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=128., verbosity=0, impl=impl_)
    for i in range(5):
        if i == 2: opt.add_param_group({'params': model[2].parameters(), 'lr': 0.1})
        x, y = batch(i)
        loss = nn.functional.mse_loss(model(x).float(), y)
        if mixed:
            with amp.scale_loss(loss, opt) as s: s.backward()
        else: loss.backward()
        opt.step(); opt.zero_grad()
    return [p.detach().float() for p in model.parameters()]

@pytest.mark.parametrize("level", LEVELS)
def test_add_param_group_after_initialize_trains_like_fp32(level, impl):
    ref, got = _add_group_run(level, False, impl), _add_group_run(level, True, impl)
    tol = dict(rtol=0, atol=0) if level == 'O0' else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(ref, got): torch.testing.assert_close(b, a, **tol)

def test_add_param_group_at_o2_gives_the_new_params_masters():
    model = two_layer()
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.add_param_group({'params': model[2].parameters()})
    assert [p.dtype for p in amp.master_params(opt)] == [torch.float32] * 4
    assert len(opt.param_groups) == 2 and opt._mixedprec_engine.masters.trained[-1].param is model[2].bias

def test_a_backward_without_the_scaling_call_raises_at_the_step():
    model = two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    nn.functional.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
    with pytest.raises(RuntimeError, match='amp.scale_loss'): opt.step()
    half = two_layer().half()
    fopt = FP16_Optimizer(torch.optim.SGD(half.parameters(), lr=0.1), verbose=False)
    half(batch(0)[0].half()).float().sum().backward()
    with pytest.raises(RuntimeError, match=r'optimizer.backward\(loss\)'): fopt.step()

def test_initialize_twice_on_one_model_is_refused():
    for level in LEVELS:
        model = two_layer()
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
        with pytest.raises(RuntimeError, match='already passed to amp.initialize'):
            amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)

def test_two_initializes_keep_their_own_scalers():
    m1, m2 = two_layer(1), two_layer(2)
    m1, o1 = amp.initialize(m1, torch.optim.SGD(m1.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    m2, o2 = amp.initialize(m2, torch.optim.SGD(m2.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert amp._setups[o1._mixedprec_engine] is not amp._setups[o2._mixedprec_engine]
    with amp.scale_loss(m1(batch(0)[0]).sum() * 1e6, o1) as s:
        s.backward()        # overflows: only the first initialize's scale drops
    o1.step()
    assert amp._setups[o1._mixedprec_engine].scalers[0].scale == 2.**15 and amp._setups[o2._mixedprec_engine].scalers[0].scale == 2.**16

def test_flat_master_leaves_a_param_without_grad_unchanged():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__(); self.body, self.unused = nn.Linear(8, 1), nn.Linear(8, 1)
        def forward(self, x): return self.body(x)
    from functools import partial
    from fastai.optimizer import SGD
    # momentum and weight decay would move an unused slice of a flat master
    for flat in (False, True):
        learn = synth_learner(TwoHeads(), opt_func=partial(SGD, mom=0.9), lr=0.1, wd=0.1).to_fp16(flat_master=flat)
        before = [p.detach().clone() for p in learn.model.unused.parameters()]
        learn.fit(2)
        assert all(torch.equal(p.detach(), b) for p, b in zip(learn.model.unused.parameters(), before)), flat
        assert not torch.equal(learn.model.body.weight.detach().float(), before[0].float())

# ---- apex's suite: several models, optimizers and losses
# --------------------------------------------------------------

def _multi_run(level, mixed, inject, impl_=None):
    ("Two models, two optimizers, three losses (the third reaches both); an inf in loss `inject[1]`'s backward at "
     "iteration `inject[0]`")
    m0, m1 = two_layer(0), two_layer(1)
    o0 = torch.optim.SGD(m0.parameters(), lr=0.05, momentum=0.9)
    # O3 keeps no masters: Adam's eps (1e-8) underflows in fp16 weights' state and turns them NaN, as in apex, so SGD
    # there
    o1 = torch.optim.Adam(m1.parameters(), lr=1e-2) if level != 'O3' else torch.optim.SGD(m1.parameters(), lr=0.05)
    if mixed:
        [m0, m1], [o0, o1] = amp.initialize([m0, m1], [o0, o1], opt_level=level, num_losses=3, loss_scale=128.,
                                            verbosity=0, impl=impl_)
    for i in range(6):
        x, y = batch(i)
        losses = [nn.functional.mse_loss(m0(x).float(), y), nn.functional.mse_loss(m1(x).float(), y),
                  nn.functional.mse_loss((m0(x).float() + m1(x).float()) / 2, y)]
        skip = {0: False, 1: False}
        for k, (loss, opts) in enumerate(zip(losses, ([o0], [o1], [o0, o1]))):
            bad = inject == (i, k)
            if mixed:
                with amp.scale_loss(loss, opts, loss_id=k) as s:
                    s.backward()
                    if bad: next(p for p in (m0 if k == 0 else m1).parameters()).grad.view(-1)[0] = float('inf')
            else:
                loss.backward()
                if bad:
                    for o in opts: skip[id(o) == id(o1)] = True
        for o, s in ((o0, skip[False]), (o1, skip[True])):
            if mixed or not s: o.step()
            o.zero_grad()
        if mixed and inject is not None and inject[0] == i:
            reached = {0: [o0], 1: [o1], 2: [o0, o1]}[inject[1]]
            assert [amp.skipped(o) for o in (o0, o1)] == [o0 in reached, o1 in reached]
    return [p.detach().float() for m in (m0, m1) for p in m.parameters()]

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("inject", [None, (2, 0), (3, 1), (1, 2)])
def test_multiple_models_optimizers_losses_match_fp32_with_the_same_skips(level, inject, impl):
    ref, got = _multi_run(level, False, inject), _multi_run(level, True, inject, impl)
    tol = dict(rtol=0, atol=0) if level == 'O0' else dict(rtol=5e-2, atol=5e-2)
    for a, b in zip(ref, got): torch.testing.assert_close(b, a, **tol)

# ---- checkpoints resume bit for bit
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("level", ['O1', 'O2', 'O3'])
def test_amp_checkpoint_resumes_exactly(level, tmp_path, decide):
    def make():
        m = two_layer()
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        return amp.initialize(m, o, opt_level=level, verbosity=0)
    def train(m, o, steps):
        for i in steps:
            x, y = batch(i)
            with amp.scale_loss(nn.functional.mse_loss(m(x).float(), y) * (1e6 if i == 3 else 1), o) as s: s.backward()
            o.step(); o.zero_grad()
    m, o = make()
    train(m, o, range(5))
    torch.save({'model': m.state_dict(), 'opt': o.state_dict(), 'amp': amp.state_dict()}, tmp_path / 'ck.pt')
    train(m, o, range(5, 9))
    m2, o2 = make()
    ck = torch.load(tmp_path / 'ck.pt', weights_only=True)
    m2.load_state_dict(ck['model']); o2.load_state_dict(ck['opt']); amp.load_state_dict(ck['amp'])
    train(m2, o2, range(5, 9))
    for a, b in zip(m.parameters(), m2.parameters()): assert torch.equal(a, b)
    for a, b in zip(amp.master_params(o), amp.master_params(o2)): assert torch.equal(a, b)

def test_fp16_optimizer_checkpoint_resumes_exactly(tmp_path, decide):
    def make():
        m = two_layer().half()
        return m, FP16_Optimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), dynamic_loss_scale=True,
                                 verbose=False)
    def train(m, o, steps):
        for i in steps:
            x, y = batch(i)
            o.zero_grad(); o.backward(nn.functional.mse_loss(m(x.half()).float(), y) * (1e6 if i == 6 else 1)); o.step()
    m, o = make()
    train(m, o, range(4))
    sd = copy.deepcopy(o.state_dict())
    train(m, o, range(4, 8))
    m2, o2 = make()
    o2.load_state_dict(sd)
    train(m2, o2, range(4, 8))
    for a, b in zip(m.parameters(), m2.parameters()): assert torch.equal(a, b)
    assert [r.skipped for r in o2.history] == [False, False, True, False]

# ---- torch's grad-scaling cases, through FP16_Optimizer and amp O2, against fp32
# ----------------------------------------

def _scaling_case(front, mode, mixed, skip_at=3):
    ("One of torch's `_run_scaling_case` shapes: 'plain', 'clip' (clip the unscaled grads), 'accumulate' (two "
     "backwards per step)")
    model = two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if mixed and front == 'amp':
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale='dynamic', verbosity=0)
    if mixed and front == 'fp16':
        model = model.half()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), dynamic_loss_scale=True,
                             verbose=False)
    params = lambda: list(amp.master_params(opt)) if front == 'amp' and mixed else opt.optimizer.param_groups[0]['params'] if mixed else list(model.parameters())
    for i in range(6):
        parts = [batch(i)] if mode != 'accumulate' else [batch(10 + 2 * i), batch(11 + 2 * i)]
        bad = i == skip_at
        for j, (x, y) in enumerate(parts):
            if front == 'fp16' and mixed: x = x.half()
            loss = nn.functional.mse_loss(model(x).float(), y) / len(parts)
            if bad and j == 0: loss = loss * float('inf') if not mixed else loss * 1e6
            if not mixed: loss.backward() if not (bad and j == 0) else None
            elif front == 'amp':
                with amp.scale_loss(loss, opt) as s: s.backward()
            else: opt.backward(loss)
        if mode == 'clip':
            if mixed and front == 'fp16': opt.clip_master_grads(0.5)
            elif not (mixed and bad): torch.nn.utils.clip_grad_norm_(params(), 0.5)
        if mixed or not bad: opt.step()
        opt.zero_grad()
    skipped = amp.skipped(opt) if front == 'amp' and mixed else None
    return [p.detach().float() for p in params()], skipped

@pytest.mark.parametrize("front", ['amp', 'fp16'])
@pytest.mark.parametrize("mode", ['plain', 'clip', 'accumulate'])
def test_torch_scaling_cases_match_fp32_with_the_same_skipped_step(front, mode, decide):
    ref, _ = _scaling_case(front, mode, False)
    got, _ = _scaling_case(front, mode, True)
    for a, b in zip(ref, got): torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)

def test_step_hooks_and_a_scheduler_see_the_engine_step(decide):
    model = two_layer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)      # created after initialize
    calls = []
    opt.register_step_pre_hook(
        lambda o, a, k: calls.append('pre')); opt.register_step_post_hook(lambda o, a, k: calls.append('post'))
    from torch.optim.optimizer import register_optimizer_step_pre_hook, register_optimizer_step_post_hook
    # every optimizer's, as torch runs them
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append('global pre')),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append('global post'))]
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            for i in range(3):
                with amp.scale_loss(nn.functional.mse_loss(model(batch(i)[0]), batch(i)[1]), opt) as s: s.backward()
                opt.step(); sched.step(); opt.zero_grad()
    finally:
        for h in handles: h.remove()
    assert calls == ['global pre', 'pre', 'post', 'global post'] * 3

@pytest.mark.parametrize("front", ['amp', 'fp16'])
def test_a_second_step_without_a_backward_changes_nothing(front, impl):
    model = two_layer()
    if front == 'amp':
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)
    else:
        model = model.half(); opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                   verbose=False)
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x.half() if front == 'fp16' else x).float(), y)
    if front == 'amp':
        with amp.scale_loss(loss, opt) as s: s.backward()
    else: opt.backward(loss)
    opt.step()
    once = [p.detach().clone() for p in model.parameters()]
    opt.step()                                                 # as apex: the grads were used; nothing is stepped twice
    assert all(torch.equal(a, p.detach()) for a, p in zip(once, model.parameters()))

def test_the_step_protocol_has_one_stage_and_a_clip_out_of_order_is_refused_by_name():
    from mixedprec.fp16_optimizer import FP16_Optimizer
    from mixedprec import amp
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    e, seen = opt.engine, []
    seen.append(e.progress.stage)
    with pytest.raises(RuntimeError, match="clipping needs the unscaled grads of a pending step, and the step "
                                           "protocol is at stage READY"):
        opt.clip_master_grads(1.)
    opt.backward(model(torch.randn(8, 4).half()).float().pow(2).mean(), update_master_grads=False); seen.append(e.progress.stage)
    opt.update_master_grads(); seen.append(e.progress.stage)
    opt.clip_master_grads(1.)
    opt.step(); seen.append(e.progress.stage)
    with pytest.raises(RuntimeError, match="stage STEPPED"): opt.clip_master_grads(1.)
    opt.zero_grad(); seen.append(e.progress.stage)
    assert seen == [Stage.READY, Stage.SCALED, Stage.UNSCALED, Stage.STEPPED, Stage.READY]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level='O2', verbosity=0)
    with pytest.raises(RuntimeError, match="stage READY"): amp.clip_grad_norm_(opt, 1.)
    with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as s: s.backward()
    assert amp.clip_grad_norm_(opt, 1e-3) > 1e-3                        # the norm before clipping
    opt.step()

# ---- the one door: attach and detach, through each optimizer family's adapter ----------------------------------------

def _stepped_once(make_opt):
    "A model and its optimizer after one fp32 step (so it has state), then converted to fp16 with its masters"
    from mixedprec.convert import convert_model
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = make_opt(model)
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return model, opt, convert_model(model, torch.float16)

def _torch_adam(model): return torch.optim.Adam(model.parameters(), lr=1e-2)
def _fastai_adam(model):
    from fastai.optimizer import Adam
    return Adam(list(model.parameters()), lr=1e-2)
def _fastai_wrapper(model):
    from fastai.optimizer import OptimWrapper
    return OptimWrapper(list(model.parameters()), torch.optim.Adam, lr=1e-2)

@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("make_opt", [_torch_adam, _fastai_adam, _fastai_wrapper])
def test_attach_then_detach_gives_the_optimizer_back_its_params_and_state(make_opt, flat):
    from mixedprec.engine import adapter_for
    model, opt, conv = _stepped_once(make_opt)
    adapter = adapter_for(opt)
    params = list(model.parameters())
    before = {id(p): {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)} for state in adapter.states() for p, st in state.items()}
    assert before, "the fp32 step made state"
    e = StepEngine.attach(opt, conv.masters, flat=flat)
    held = [p for g in adapter.groups() for p in g]
    assert not any(
        p is q for p in held for q in params
            if q.dtype == torch.float16), "the optimizer holds masters, not the half params"
    assert any(p in state for state in adapter.states() for p in held), "the state moved onto the masters"
    e.view.detach()
    assert [p for g in adapter.groups() for p in g] == params
    after = {id(p): st for state in adapter.states() for p, st in state.items()}
    for i, st in before.items():
        for k, v in st.items():
            assert torch.equal(after[i][k].to(v.dtype), v), (k, "state comes back as it went in")

def test_an_optimizer_of_no_known_family_is_refused_by_name():
    from mixedprec.engine import adapter_for
    class Mine:
        def step(self): pass
    with pytest.raises(TypeError, match="Mine.*ADAPTERS"): adapter_for(Mine())

def test_a_second_unscale_without_a_backward_is_refused_by_name_and_the_books_count_one_step():
    ("The stage is the engine's one state: an unscale needs a scaled backward since the last one (it used to advance "
     "the scaler twice); FP16_Optimizer's `update_master_grads()` after its `backward` changes nothing, as in apex")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    opt.backward(model(torch.randn(8, 4).half()).float().pow(2).mean())
    with pytest.raises(RuntimeError, match=r"stage UNSCALED: the grads were unscaled already"): opt.engine.unscale()
    opt.update_master_grads()
    opt.step()
    assert len(opt.history) == 1

def test_clearing_grads_drops_the_pending_decision_with_them():
    ("An overflowed backward, then zero_grad, then a clean backward: the step is taken (the skip judged grads that "
     "are gone)")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    opt.backward(model(torch.randn(8, 4).half()).float().pow(2).mean() * 1e30)      # overflows
    assert opt.engine.must_skip()
    opt.zero_grad()
    assert opt.engine.progress.stage == Stage.READY
    opt.backward(model(torch.randn(8, 4).half()).float().pow(2).mean())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert not opt.skipped and any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
