import pytest, torch
# every test with the skip decided on the host and on the device (fastai's Adam/SGD fused)
pytestmark = pytest.mark.usefixtures("decide")
from torch import nn
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam
from fastai.callback.core import Callback
from fastai.callback.training import GradientAccumulation, GradientClip
import fastai.callback.fp16 as fastai_fp16
from mixedprec.callback import MixedPrecision, fastai_to_fp16, fastai_to_fp32
from mixedprec.scaler import ScalingError
from helpers import synth_learner, masters_of, Record, mlp
from conftest import same_or_close

def test_to_fp16_is_ours_and_fastais_stays_reachable():
    learn = synth_learner().to_fp16()
    assert type(learn.mixed_precision) is MixedPrecision
    learn = fastai_to_fp16(synth_learner())
    assert type(learn.mixed_precision) is fastai_fp16.MixedPrecision
    learn.to_fp32()
    assert not hasattr(learn, 'mixed_precision')

def test_conversion_dtypes_and_masters():
    learn = synth_learner().to_fp16()
    assert [p.dtype for p in learn.model.parameters()] == [torch.half]*2 + [torch.float32]*2 + [torch.half]*2
    assert learn.model[1].running_var.dtype == torch.float32
    assert {m.dtype for m in masters_of(learn)} == {torch.float32}

def test_dtypes_at_each_event_and_oracles():
    seen = {}
    def grads_in(learn): seen['grads'] = [p.grad.float().clone() for p in learn.model.parameters()]
    def loss_in(learn): seen['loss'] = learn.loss_grad.detach().clone()
    def check_batch(learn):
        # callbacks see fp32 batches
        assert learn.xb[0].dtype == torch.float32 and learn.yb[0].dtype == torch.float32
        if 'hooked' not in seen:
            seen['hooked'] = learn.model[0].register_forward_pre_hook(lambda m,
                                                                      args: seen.__setitem__('input', args[0].dtype))
    def check_pred(learn): assert learn.pred.dtype == torch.float32
    def check_loss(learn):
        assert learn.loss_grad.dtype == torch.float32
        assert torch.equal(learn.loss_grad, seen['loss'] * learn.mixed_precision.loss_scale)
    def check_grads(learn):
        mp = learn.mixed_precision
        scale = mp.history[-1].scale
        for m, g in zip(masters_of(learn), seen['grads']):
            assert m.grad.dtype == torch.float32 and torch.equal(m.grad, g * (1 / scale))
        seen['old'] = [m.detach().clone() for m in masters_of(learn)]
    def check_step(learn):
        mp = learn.mixed_precision
        if mp.skipped: return
        lr = learn.opt.hypers[0]['lr']
        for p, m, old, g in zip(learn.model.parameters(), masters_of(learn), seen['old'], seen['grads']):
            # fastai's own step; the fused one (device decision) rounds its own way
            want = old.add(g * (1 / mp.history[-1].scale), alpha=-lr)
            if mp.engine.runner.plan is None: assert torch.equal(m.detach(), want)
            else: torch.testing.assert_close(m.detach(), want, rtol=1e-6, atol=1e-8)
            assert torch.equal(p.detach(), m.detach().to(p.dtype))
        seen['steps'] = seen.get('steps', 0) + 1
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=[Record(-1, before_step=grads_in, before_backward=loss_in),
                      Record(1, before_batch=check_batch, after_pred=check_pred, before_backward=check_loss,
                             before_step=check_grads, after_step=check_step)])
    assert seen['steps'] == 6 and seen['input'] == torch.half                               # the model gets half inputs

def _snapshot(learn):
    opt = learn.opt
    return ([p.detach().clone() for p in learn.model.parameters()], [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()} for g in opt.param_lists for p in g])

@pytest.mark.parametrize("flat", [False, True])
def test_injected_inf_skips_the_step_exactly(flat):
    snaps, inject_at = [], 3
    def inject(learn):
        if learn.train_iter + 1 == inject_at: learn.model[3].weight.grad[0, 0] = float('inf')
    learn = synth_learner(opt_func=Adam, lr=1e-2, wd=0.1).to_fp16(loss_scale=2.**10, flat_master=flat)
    learn.fit(1, cbs=[Record(-1, before_step=inject), Record(1, after_step=lambda l: snaps.append(_snapshot(l)))])
    mp = learn.mixed_precision
    assert [r.skipped for r in mp.history] == [False, False, True, False, False, False]
    (p_before, s_before), (p_after, s_after) = snaps[1], snaps[2]
    for a, b in zip(p_before, p_after): assert torch.equal(a, b)
    for a, b in zip(s_before, s_after):
        assert a.keys() == b.keys()
        for k in a: assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
    assert mp.history[3].scale == mp.history[2].scale / 2
    assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters())

def test_max_noskip_growth_cap_and_static():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=4., max_noskip=2, max_scale=16.)
    learn.fit(2)
    assert [r.scale for r in learn.mixed_precision.history] == [4., 4., 8., 8.] + [16.] * 8
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(dynamic=False)
    learn.fit(1)
    assert {r.scale for r in learn.mixed_precision.history} == {512.}

@pytest.mark.parametrize("opt_func", [SGD, Adam])
def test_flat_master_trains_to_the_same_weights(opt_func):
    res = []
    for flat in (False, True):
        learn = synth_learner(opt_func=opt_func, lr=1e-2, wd=1e-2).to_fp16(loss_scale=2.**8, flat_master=flat)
        learn.fit(2)
        # flat: weights (wd), biases (no wd), and the 2 fp32 BN params
        assert len(learn.opt.param_lists[0]) == (4 if flat else 6)
        learn.to_fp32()
        res.append([p.detach().clone() for p in learn.model.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b)

def test_clip_matches_clip_grad_norm_on_fp32_copy(impl):
    checked = []
    def unclipped(learn):
        scale = learn.mixed_precision.scaler.scale
        checked.append(
            [p.grad.float() * (1 / scale) if p.grad.dtype != torch.float32 else p.grad * (1 / scale) for p in learn.model.parameters()])
    def compare(learn):
        ref = [nn.Parameter(torch.zeros_like(g)) for g in checked[-1]]
        for r, g in zip(ref, checked[-1]): r.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, 0.05)
        for r, m in zip(ref, masters_of(learn)): same_or_close(r.grad, m.grad, impl)
        same_or_close(torch.tensor(learn.mixed_precision.history[-1].grad_norm), norm, impl)
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8, clip=0.05)
    learn.fit(1, cbs=[Record(-1, before_step=unclipped), Record(1, before_step=compare)])
    assert len(checked) == 6

def test_fit_twice_keeps_scale_masters_and_state():
    learn = synth_learner(opt_func=Adam, lr=1e-3).to_fp16(loss_scale=2.**8, max_noskip=4)
    learn.fit(1)
    mp, opt = learn.mixed_precision, learn.opt
    scale, n, masters = mp.loss_scale, mp.scaler.n_steps, [m for m in mp.engine.masters.master_params]
    avg = opt.state[masters[0]]['grad_avg']
    learn.fit(1)
    # the same `MixedPrecisionOpt`, not a new one per fit
    assert learn.opt is opt and learn.mixed_precision.engine.masters.master_params == masters
    assert mp.scaler.n_steps == 2 * n and mp.loss_scale >= scale
    # updated in place, never reset
    assert opt.state[masters[0]]['step'] == 2 * n and opt.state[masters[0]]['grad_avg'] is avg

def test_to_fp32_gives_masters_exactly_and_keeps_state():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    masters = [m.detach().clone() for m in masters_of(learn)]
    learn.to_fp32()
    params = list(learn.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    for p, m in zip(params, masters): assert torch.equal(p.detach(), m)
    assert [p for g in learn.opt.param_lists for p in g] == params
    assert all(learn.opt.state[p]['step'] == 6 for p in params)
    learn.fit(1)                                         # and keeps training in fp32 from there

@pytest.mark.parametrize("flat", [False, True])
def test_switch_fp16_to_bf16(flat):
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8, flat_master=flat)
    learn.fit(1)
    masters = [m.detach().clone() for m in masters_of(learn)]
    learn.to_bf16(flat_master=flat)
    assert len([cb for cb in learn.cbs if isinstance(cb, MixedPrecision)]) == 1
    assert learn.model[0].weight.dtype == torch.bfloat16 and learn.mixed_precision.loss_scale == 1.
    for m, old in zip(masters_of(learn), masters): assert torch.equal(m.detach().reshape(old.shape), old)
    learn.fit(1)
    assert learn.opt.state[learn.opt.param_lists[0][0]]['step'] == 12

def test_to_fp16_twice_does_not_stack_and_unknown_kwargs_raise():
    learn = synth_learner().to_fp16().to_fp16()
    assert len([cb for cb in learn.cbs if isinstance(cb, MixedPrecision)]) == 1
    assert learn.model[0].weight.dtype == torch.half
    with pytest.raises(TypeError, match="unknown keyword argument.*scale_window"):
        synth_learner().to_fp16(scale_window=2)
    with pytest.raises(ValueError, match="clip"): synth_learner().to_fp16(clip=-1.)

def test_logged_loss_is_unscaled():
    losses = []
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**12)
    learn.fit(1, cbs=Record(1, after_loss=lambda l: losses.append(l.loss_grad.item()) if l.training else None))
    recorded = [float(l) for l in learn.recorder.losses]
    assert recorded and max(recorded) < 1e3
    assert len(recorded) == len(losses)

def test_gradient_accumulation_unscales_only_on_real_steps():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=GradientAccumulation(n_acc=64))          # bs 32: a real step every 2 batches
    assert learn.mixed_precision.scaler.n_steps == 3

def test_gradient_accumulation_overflow_in_one_microbatch_skips_the_step():
    def inject(learn):
        if learn.train_iter == 2: learn.model[3].weight.grad[0, 0] = float('inf')
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=[GradientAccumulation(n_acc=64), Record(-5, after_backward=inject)])
    assert [r.skipped for r in learn.mixed_precision.history] == [False, True, False]

@pytest.mark.parametrize("to, dtype", [('to_fp16', torch.float16), ('to_bf16', torch.bfloat16)])
def test_fastais_gradient_clip_clips_the_unscaled_grads_that_are_stepped(to, dtype):
    ("fastai's GradientClip (ordered after MixedPrecision) clips what the optimizer steps: from the unscale to the "
     "step a half param's grad stands for its master's unscaled fp32 grad. It trains as `clip=` does (to the rounding "
     "of torch's norm against the fused one) and as fp32 with GradientClip")
    kw = dict(loss_scale=2.**8) if dtype == torch.float16 else {}
    def run(how):
        learn = synth_learner(opt_func=SGD, lr=0.05)
        cbs = [GradientClip(0.05)] if how != 'clip=' else []
        if how != 'fp32': getattr(learn, to)(clip=0.05 if how == 'clip=' else None, **kw)
        learn.fit(2, cbs=cbs)
        return masters_of(learn) if how != 'fp32' else [p.detach() for p in learn.model.parameters()]
    theirs, ours, fp32 = run('GradientClip'), run('clip='), run('fp32')
    for a, b, c in zip(theirs, ours, fp32):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # (a clip of the scaled grads moves fp16's weights by 1/256 of fp32's: 1e-3 to 8e-3 off here)
        torch.testing.assert_close(a, c, rtol=0, atol=5e-5 if dtype == torch.float16 else 2e-3)

def test_inference_returns_fp32_with_and_without_optimizer():
    learn = synth_learner().to_fp16()
    preds, targs = learn.get_preds()                   # no optimizer yet
    assert preds.dtype == torch.float32
    learn.fit(1)
    preds, _ = learn.get_preds()
    assert preds.dtype == torch.float32 and learn.model[0].weight.dtype == torch.half
    assert isinstance(learn.validate()[0], float)

class Boom(Exception): pass

def test_exception_mid_fit_leaves_a_usable_learner():
    def boom(learn):
        if learn.train_iter == 3: raise Boom('mid-epoch')
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    with pytest.raises(Boom): learn.fit(1, cbs=Record(1, after_backward=boom))
    learn.fit(1)                                       # stale half grads were dropped at before_fit
    assert learn.mixed_precision.scaler.n_steps == 3 + 6
    masters = [m.detach().clone() for m in masters_of(learn)]
    learn.to_fp32()
    for p, m in zip(learn.model.parameters(), masters): assert torch.equal(p.detach(), m)

def test_nonfinite_loss_skips_without_lowering_scale_then_raises():
    class NaNLoss(nn.Module):
        def forward(self, pred, targ): return (pred - targ).pow(2).mean() * float('nan')
    learn = synth_learner(opt_func=SGD, lr=0.01, loss_func=NaNLoss()).to_fp16(loss_scale=2.**8, max_bad_loss=3)
    with pytest.raises(ScalingError, match="forward pass or the data"): learn.fit(1)
    mp = learn.mixed_precision
    assert mp.loss_scale == 2.**8 and [r.reason for r in mp.history] == ['nonfinite_loss'] * 3

def test_integer_inputs_are_not_cast():
    class Emb(nn.Module):
        def __init__(self): super().__init__(); self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 1)
        def forward(self, x): return self.lin(self.emb(x % 10).mean(1))
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from torch.utils.data import TensorDataset
    x, y = torch.randint(0, 10, (64, 3)), torch.randn(64, 1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=16), DataLoader(TensorDataset(x, y), bs=16))
    learn = Learner(dls, Emb(), loss_func=nn.MSELoss(), opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=Record(1,
                            before_batch=lambda l: (
                                _ for _ in ()).throw(AssertionError) if l.xb[0].dtype != torch.int64 else None))
    assert learn.mixed_precision.scaler.n_steps == 4

def test_state_dict_round_trip():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8, max_noskip=2)
    learn.fit(1)
    sd = learn.mixed_precision.state_dict()
    other = synth_learner(seed=0).to_fp16()
    other.mixed_precision.load_state_dict(sd)
    assert other.mixed_precision.scaler.state_dict() == learn.mixed_precision.scaler.state_dict()
    half = lambda l: [l.mixed_precision.conversion.masters.held(p) for p in l.model.parameters() if p.dtype == torch.half]
    for a, b in zip(half(other), half(learn)):
        assert torch.equal(a.detach(), b.detach())       # fp32 params travel in the model's state
    assert [m is None for m in sd['masters']] == [False, False, True, True, False, False]
    with pytest.raises(ValueError, match="another model"):
        synth_learner(model=nn.Sequential(nn.Linear(8, 1))).to_fp16().mixed_precision.load_state_dict(sd)
