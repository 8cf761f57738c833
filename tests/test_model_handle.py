"""The model the user holds is the model that trains: what users and fastai do to the model reaches the masters, or is refused loudly.
Each test runs the same thing in fp32 and with mixedprec and compares, or checks the refusal's words."""
import copy, pickle, warnings
import pytest, torch
from fastcore.basics import noop
from torch import nn
from fastai.learner import Learner, load_learner
from fastai.optimizer import Adam, SGD, OptimWrapper
from fastai.callback.fp16 import MixedPrecision as FastaiMixedPrecision
from fastai.callback.channelslast import ChannelsLast
import fastai.callback.channelslast      # Learner.to_channelslast / to_contiguous
from mixedprec.callback import MixedPrecision, MixedPrecisionOpt
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.scaler import ScalingError
from mixedprec import amp
from helpers import master_values, synth_learner, masters_of, Record, mlp, quiet

def relu_bn_mlp(seed=0):
    ("An MLP whose BatchNorm follows a ReLU: no bias right before a BatchNorm, whose grad is rounding noise that "
     "Adam would blow up")
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 1))

def two_groups(m): return [list(m[0].parameters()), list(m[1:].parameters())]
def weights(learn): return [p.detach().float().clone() for p in learn.model.parameters()]
def fp32_and_half(precision='fp16', **kw):
    "The same Learner twice: fp32, and in `precision` with masters"
    ref, half = synth_learner(**kw), synth_learner(**kw)
    half = half.to_fp16(loss_scale=2.**8) if precision == 'fp16' else half.to_bf16()
    return ref, half

def held(learn):
    "The fp32 value of each model param: its master's in mixed precision (the param's own where it has none)"
    return master_values(learn) if hasattr(learn, 'mixed_precision') else list(learn.model.parameters())

def close(a, b, tol):
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))

# ---------------------------------------------------------------- what users do to the model, against the same run in
# fp32

class UnfreezeAt1(Record):
    def __init__(self): super().__init__(-1)
    def before_epoch(self):
        if self.epoch == 1: self.learn.unfreeze()

def _clamp(learn):
    with torch.no_grad():
        for p in learn.model.parameters(): p.clamp_(-0.05, 0.05)

ACTIONS = {
    'freeze, create_opt':      lambda l: (l.freeze(), l.create_opt(), l.fit(2)),
    'fit, freeze, reset_opt':  lambda l: (l.fit(1), l.freeze(), l.fit(2, reset_opt=True)),
    'requires_grad_ between fits': lambda l: (l.fit(1), l.model[0].requires_grad_(False), l.fit(1)),
    'freeze, unfreeze in fit': lambda l: (l.freeze(), l.fit(1), l.fit(2, cbs=UnfreezeAt1())),
    'clamp before each batch': lambda l: l.fit(2, cbs=Record(-1,
                                                             before_batch=lambda l: _clamp(l) if l.training else None)),
    're-init between fits':    lambda l: (l.fit(1), _reinit(l), l.fit(1)),
    'load_state_dict mid-fit': lambda l: (l.fit(1), l.model.load_state_dict(relu_bn_mlp(7).state_dict()), l.fit(1)),
    're-init through .data between fits': lambda l: (l.fit(1), l.model[3].weight.data.fill_(0.25), l.fit(1)),
}

def _reinit(learn):
    with torch.no_grad(): nn.init.constant_(learn.model[3].weight, 0.25)

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("action", list(ACTIONS))
def test_user_actions_train_as_in_fp32(action, flat, precision):
    ("Each action on the model, in fp32 and in mixed precision: the same requires_grad, and the same weights up to "
     "half precision's rounding")
    res = {}
    for name in ("fp32", precision):
        learn = synth_learner(model=relu_bn_mlp(), opt_func=Adam, lr=1e-2, splitter=two_groups)
        if name == "fp16": learn.to_fp16(loss_scale=2.**8, flat_master=flat)
        elif name == "bf16": learn.to_bf16(flat_master=flat)
        ACTIONS[action](learn)
        res[name] = ([p.requires_grad for p in learn.model.parameters()], weights(learn),
                     [m.detach().clone() for m in held(learn)])
    assert res["fp32"][0] == res[precision][0]
    tol = 2e-2 if precision == "fp16" else 6e-2
    assert close(res["fp32"][1], res[precision][1], tol), [(a - b).abs().max().item() for a, b in zip(res["fp32"][1], res[precision][1])]
    assert close(res["fp32"][2], res[precision][2], tol)


@pytest.mark.parametrize("flat", [False, True])
def test_freeze_reaches_the_model_at_once_and_a_new_optimizer_keeps_it(flat):
    learn = synth_learner(opt_func=Adam, lr=1e-2, splitter=two_groups).to_fp16(flat_master=flat)
    learn.freeze()
    assert not any(p.requires_grad for p in learn.model[0].parameters())
    before = weights(learn)
    learn.create_opt(); learn.fit(2)
    after = weights(learn)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1],
                                                            after[1]) and not torch.equal(before[-1], after[-1])


# ---------------------------------------------------------------- clearing grads as the optimizer would

class Branchy(nn.Module):
    "A head that gets a grad on every other batch only"
    def __init__(self):
        super().__init__(); self.body, self.branch, self.n = nn.Linear(8, 1), nn.Linear(8, 1), 0
    def forward(self, x):
        self.n += 1
        return self.body(x) + (self.branch(x) if self.n % 2 else 0)

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_branch_without_a_grad_moves_as_in_fp32(precision):
    "fastai zeroes grads in place: the branch keeps a zero grad, and Adam's momentum and weight decay still move it"
    moves = {}
    for name in ("fp32", precision):
        learn = synth_learner(model=Branchy(), opt_func=Adam, lr=1e-2, wd=0.1)
        if name == "fp16": learn.to_fp16(loss_scale=2.**8)
        elif name == "bf16": learn.to_bf16()
        seen = []
        learn.fit(1, cbs=Record(1,
                                after_step=lambda l: seen.append(held(l)[2].detach().clone()) if l.training else None))
        moves[name] = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert moves["fp32"] == moves[precision] and all(moves["fp32"])


def test_fp16_optimizer_drops_grads_as_torch_does():
    model = Branchy().half()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), static_loss_scale=8., verbose=False)
    x = torch.randn(4, 8).half()
    for _ in range(4):
        opt.zero_grad(); opt.backward(model(x).float().sum()); opt.step()
    m_branch = opt.param_groups[0]['params'][2]
    # torch's zero_grad sets None: the branch is left out on its off batches
    assert m_branch.grad is None


# ---------------------------------------------------------------- in-place edits of the model reach the masters

@pytest.mark.parametrize("flat", [False, True])
def test_a_clamp_after_the_last_step_is_what_the_checkpoint_holds(flat):
    learn = synth_learner(opt_func=SGD, lr=0.1).to_fp16(loss_scale=2.**8, flat_master=flat)
    learn.fit(1)
    _clamp(learn)
    sd, names = learn.model.state_dict(), [n for n, _ in learn.model.named_parameters()]
    assert all(sd[n].abs().max() <= 0.05 for n in names) and all(m.abs().max() <= 0.05 for m in masters_of(learn))


def test_load_state_dict_into_the_model_mid_training_is_kept_exactly():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16()
    other = synth_learner(seed=7)
    learn.fit(1)
    learn.model.load_state_dict(other.model.state_dict())
    # exact fp32, not the halves
    assert all(torch.equal(m.detach(), p.detach()) for m, p in zip(masters_of(learn), other.model.parameters()))
    learn.fit(1, lr=0.)                            # a step at lr 0 keeps the loaded weights
    assert all(torch.equal(m.detach(), p.detach()) for m, p in zip(masters_of(learn), other.model.parameters()))


def test_reinit_of_one_layer_between_fits_is_trained_from():
    learn = synth_learner(opt_func=SGD, lr=0.).to_fp16()
    learn.fit(1)
    with torch.no_grad(): nn.init.constant_(learn.model[3].weight, 0.25)
    learn.fit(1)
    assert torch.all(masters_of(learn)[-2] == 0.25) and torch.all(learn.model[3].weight == 0.25)
    learn.to_fp32()
    assert torch.all(learn.model[3].weight == 0.25)


def test_amp_and_fp16_optimizer_take_in_place_edits():
    for front in ("fp16_optimizer", "amp"):
        torch.manual_seed(0)
        model = mlp()
        if front == "amp":
            opt = torch.optim.SGD(model.parameters(), lr=0.)
            model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=8., verbosity=0)
            def step(loss):
                with amp.scale_loss(loss, opt) as s: s.backward()
                opt.step(); opt.zero_grad()
            masters = lambda: list(amp.master_params(opt))
        else:
            model = model.half()
            for m in model.modules():
                if isinstance(m, nn.BatchNorm1d): m.float()
            opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.), static_loss_scale=8., verbose=False)
            def step(loss): opt.backward(loss); opt.step(); opt.zero_grad()
            masters = lambda: [p for g in opt.param_groups for p in g['params']]
        x = torch.randn(16, 8)
        step(model(x.to(next(model.parameters()).dtype) if front != "amp" else x).float().mean())
        with torch.no_grad(): model[0].weight.fill_(0.5)
        step(model(x.to(next(model.parameters()).dtype) if front != "amp" else x).float().mean())
        assert torch.all(masters()[0] == 0.5), front


# ---------------------------------------------------------------- closures evaluate the current masters

def test_lbfgs_closure_under_fp16_optimizer_matches_fp32():
    torch.manual_seed(0)
    x, w_true = torch.randn(64, 8), torch.randn(8, 1)
    y = x @ w_true
    losses = {}
    for name in ("fp32", "half"):
        torch.manual_seed(1)
        model = nn.Linear(8, 1, bias=False)
        if name == "half":
            model = model.bfloat16()
            opt = FP16_Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=10), verbose=False)
        else: opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=10)
        def closure():
            opt.zero_grad()
            loss = ((model(x.to(model.weight.dtype)).float() - y) ** 2).mean()
            if name == "half": opt.backward(loss)
            else: loss.backward()
            return loss
        for _ in range(3): opt.step(closure)
        losses[name] = ((model(x.to(model.weight.dtype)).float() - y) ** 2).mean().item()
    assert losses["half"] < 4 * losses["fp32"] + 1e-3, losses        # was ~500x worse: the closure saw stale weights


# ---------------------------------------------------------------- optimizer state of the masters' dtype

def test_adagrad_state_made_on_half_params_moves_as_fp32():
    torch.manual_seed(0)
    model = mlp().half()
    opt = FP16_Optimizer(torch.optim.Adagrad(model.parameters(), lr=1e-2), static_loss_scale=8., verbose=False)
    assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    x = torch.randn(32, 8).half()
    for _ in range(3): opt.zero_grad(); opt.backward(model(x).float().pow(2).mean()); opt.step()
    assert not opt.overflow and all(torch.isfinite(p).all() for p in model.parameters())


def test_adagrad_in_fastai_optim_wrapper_trains():
    def adagrad(params, lr): return OptimWrapper(params, torch.optim.Adagrad, lr=lr)
    ref, half = synth_learner(
        model=relu_bn_mlp(), opt_func=adagrad,
            lr=1e-2), synth_learner(model=relu_bn_mlp(), opt_func=adagrad, lr=1e-2).to_fp16(loss_scale=2.**8)
    ref.fit(1); half.fit(1)
    assert half.mixed_precision.scaler.n_skipped == 0
    assert close(weights(ref), weights(half), 2e-2)


# ---------------------------------------------------------------- copies and pickles train on

SETUPS = {'fp16': lambda l: l.to_fp16(loss_scale=2.**8),
          'fp16 flat': lambda l: l.to_fp16(loss_scale=2.**8, flat_master=True),
          'bf16 split': lambda l: l.to_bf16(masters='split'), 'bf16 none': lambda l: l.to_bf16(masters='none'),
          'bf16 split, 8-bit state': lambda l: l.to_bf16(masters='split', state='8bit'),
              'fp16, bf16 state': lambda l: l.to_fp16(state='bf16')}

@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_learner_trains_on_as_the_original(how, setup):
    ("A copy made mid-training (bf16 masters without an fp32 copy too: the copy's conversion makes them anew, apart "
     "from the optimizer's copies) trains on bit for bit as the original")
    learn = SETUPS[setup](synth_learner(opt_func=Adam, lr=1e-2))
    learn.logger = noop                            # (synth_learner's lambda does not pickle)
    learn.fit(1)
    twin = copy.deepcopy(learn) if how == "deepcopy" else pickle.loads(pickle.dumps(learn))
    learn.fit(1); twin.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(weights(learn), weights(twin)))
    assert all(torch.equal(a, b) for a, b in zip(master_values(learn), master_values(twin)))


def test_a_copied_model_keeps_its_masters_for_the_checkpoint():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16()
    learn.fit(1)
    twin = copy.deepcopy(learn.model)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), learn.model.state_dict().values()))


# ---------------------------------------------------------------- one callback, one Learner

def test_one_callback_instance_moves_to_a_second_learner_with_the_first_ones_masters_kept():
    # fastai's gradient-accumulation cell passes one callback to two Learners in turn: the first goes back to fp32 with
    # its masters' exact values (not the half weights), the second trains in mixed precision like a fresh to_fp16()
    mp = MixedPrecision(loss_scale=2.**8)
    first = synth_learner(opt_func=Adam, lr=1e-2, cbs=mp)
    first.fit(1)
    masters = [m.detach().clone() for m in masters_of(first)]
    second, ref = synth_learner(opt_func=Adam, lr=1e-2,
                                cbs=mp), synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    assert _is_fp32(first) and all(torch.equal(p.detach(), m) for p, m in zip(first.model.parameters(), masters))
    mp.scaler.load_state_dict(ref.mixed_precision.scaler.state_dict())     # the same scale as a fresh callback
    second.fit(1); ref.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(masters_of(second), masters_of(ref)))
    first.fit(1)                                          # the first Learner trains on, in fp32


# ---------------------------------------------------------------- fastai's own ways out return to fp32

def _is_fp32(learn):
    return all(p.dtype == torch.float32 for p in learn.model.parameters()) and not any(isinstance(c, MixedPrecision) for c in learn.cbs)

@pytest.mark.parametrize("way", ["to_contiguous", "remove_cb_class", "to_non_native_fp32", "to_fp32"])
def test_fastais_exits_leave_mixed_precision(way):
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_bf16()
    learn.fit(1)
    masters = [m.detach().clone() for m in masters_of(learn)]
    if way == "to_contiguous": learn.to_contiguous(to_fp32=True)
    elif way == "remove_cb_class": learn.remove_cb(FastaiMixedPrecision)
    elif way == "to_non_native_fp32": learn.to_non_native_fp32()
    else: learn.to_fp32()
    assert _is_fp32(learn) and all(torch.equal(m, p.detach()) for m, p in zip(masters, learn.model.parameters()))


# ---------------------------------------------------------------- clear errors

def test_a_model_cast_back_to_fp32_names_to_fp32():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16()
    with pytest.raises(TypeError, match="to_fp32"): learn.model.float()          # refused at the call
    learn.model[0].float()                                                        # a submodule: named at the next fit
    with pytest.raises(ValueError, match="to_fp32"): learn.get_preds()


def test_sparse_grads_get_mixedprecs_message():
    class Emb(nn.Module):
        def __init__(self): super().__init__(); self.emb = nn.Embedding(10, 4, sparse=True); self.lin = nn.Linear(4, 1)
        def forward(self, x): return self.lin(self.emb(x)).sum(1)
    model = Emb().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(TypeError, match="sparse=False"): opt.backward(model(torch.randint(0, 10, (4, 3))).float().sum())


# ---------------------------------------------------------------- skip health: a high share of skipped steps is never
# silent

def _poison_every(n_of_5):
    "A callback that puts an inf into the model's grads on `n_of_5` of every 5 training batches"
    state = {'i': 0}
    def after_backward(learn):
        if not learn.training: return
        state['i'] += 1
        if state['i'] % 5 < n_of_5:
            with torch.no_grad(): learn.model[3].weight.grad[0, 0] = float('inf')
    return Record(-1, after_backward=after_backward)

def test_overflows_on_and_off_at_the_floor_raise():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=1., min_scale=1., skip_window=20)
    with pytest.raises(ScalingError, match=r"80% of the last 20 steps at the minimum loss scale 1 \(on and off"):
        learn.fit(10, cbs=_poison_every(4))
    # it stopped as soon as the window was full, counted
    sc = learn.mixed_precision.scaler
    # from the first clean step (the scale's search is not judged)
    first_clean = next(r.step for r in sc.history if not r.skipped)
    assert sc.n_steps - first_clean + 1 <= 21


def test_a_high_share_of_skips_above_the_floor_warns_once():
    model = mlp().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), static_loss_scale=8., verbose=False)
    opt.scaler.books._recent = type(opt.scaler.books._recent)(maxlen=10)
    x = torch.randn(16, 8).half()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(30):
            opt.zero_grad(); opt.backward(model(x).float().mean(), update_master_grads=False)
            if i % 2: model[3].weight.grad[0, 0] = float('inf')
            opt.update_master_grads(); opt.step()
    said = [w for w in caught if 'were skipped' in str(w.message)]
    assert len(said) == 1 and '50%' in str(said[0].message)


def test_amp_min_loss_scale_none_is_no_floor():
    model, opt = mlp(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    sc = amp._state.scaler(0)
    assert sc.min_scale < 2.**-100
    x = torch.randn(16, 8).half()
    for _ in range(20):
        with amp.scale_loss(model(x).float().mean(), opt) as s:
            s.backward()
            model[3].weight.grad[0, 0] = float('inf')
        opt.step(); opt.zero_grad()
    sc.drain(); assert sc.scale == 2.**-4


def test_a_submodule_called_by_itself_with_fp32_inputs_is_named():
    "fastai's GANLoss calls the critic itself, with fp32 tensors: the error says so, and what to do"
    class Gan(nn.Module):
        def __init__(self): super().__init__(); self.generator, self.critic = nn.Linear(4, 8), nn.Linear(8, 1)
        def forward(self, x): return self.critic(self.generator(x))
    learn = synth_learner(model=Gan(), opt_func=Adam).to_fp16()
    with pytest.raises(RuntimeError) as e: learn.model.critic(torch.randn(2, 8))
    assert "called by itself with float32" in '\n'.join(getattr(e.value, '__notes__', []))


@pytest.mark.parametrize("flat", [False, True])
def test_ranger_resumes_exactly_after_save_and_load(tmp_path, flat):
    "fastai's ranger is Lookahead(RAdam): its own count and slow weights travel in the checkpoint beside RAdam's state"
    from fastai.optimizer import ranger
    full = synth_learner(opt_func=ranger, lr=1e-2, path=tmp_path).to_fp16(loss_scale=2.**8, flat_master=flat)
    full.fit(2)
    part = synth_learner(opt_func=ranger, lr=1e-2, path=tmp_path).to_fp16(loss_scale=2.**8, flat_master=flat)
    part.fit(1); part.save('mid', with_opt=True)
    back = synth_learner(opt_func=ranger, lr=1e-2, path=tmp_path, seed=3).to_fp16(loss_scale=2.**8, flat_master=flat)
    back.load('mid', with_opt=True)
    assert back.opt.count == part.opt.count and back.opt.slow_weights is not None
    back.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(weights(full), weights(back)))


def test_a_copied_channels_last_learner_with_flat_masters_trains_on_as_the_original():
    ("Flat masters laid out as channels_last params: a copy's optimizer state and masters are split by each param's "
     "layout, not by a plain reshape")
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 4, 4, generator=g), torch.randn(64, 1, generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x[:48], y[:48]), bs=16),
                      DataLoader(TensorDataset(x[48:], y[48:]), bs=16))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 1))
    learn = Learner(dls, model, loss_func=nn.MSELoss(), opt_func=Adam, lr=1e-2, cbs=ChannelsLast())
    learn.logger = noop
    learn.to_bf16(flat_master=True)
    with learn.no_bar(): learn.fit(1)
    assert learn.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    twin = copy.deepcopy(learn)
    with learn.no_bar(): learn.fit(1)
    with twin.no_bar(): twin.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(weights(learn), weights(twin)))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(masters_of(learn), masters_of(twin)))

# ---------------------------------------------------------------- fastai's step: the engine steps in `before_step`, the
# optimizer is not patched

class GradLog(Record):
    ("After MixedPrecision: record, at each `before_step`, the grads the optimizer will step (unscaled masters), "
     "cancel the steps listed, and record the weights after each step")
    def __init__(self, cancel=()):
        super().__init__(1); self.seen, self.after, self.cancel = [], [], set(cancel)
    def before_step(self):
        steps = masters_of(self.learn) if hasattr(self.learn, 'mixed_precision') else self.learn.model.parameters()
        self.seen.append([p.grad.detach().float().clone() if p.grad is not None else None for p in steps])
        if len(self.seen) - 1 in self.cancel: raise CancelStepException()
    def after_step(self): self.after.append(weights(self.learn))

from fastai.callback.core import CancelStepException

@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
def test_later_callbacks_see_unscaled_grads_once_and_can_cancel_the_step(precision):
    # a grad-logging callback ordered after MixedPrecision sees, once per batch, the grads the optimizer steps:
    # unscaled, as in fp32;
    # one that cancels a step cancels it in mixed precision too (the grads are dropped, the weights stay)
    ref, half = synth_learner(relu_bn_mlp(), opt_func=SGD), synth_learner(relu_bn_mlp(), opt_func=SGD)
    half = half.to_fp16(loss_scale=2.**8) if precision == 'fp16' else half.to_bf16()
    logs = [GradLog(cancel={2, 3}), GradLog(cancel={2, 3})]
    for l, log in zip((ref, half), logs): l.fit(1, 1e-2, cbs=log)
    assert len(logs[0].seen) == len(logs[1].seen) == 6
    tol = 3e-2 if precision == 'bf16' else 3e-3
    assert close(logs[1].seen[0], logs[0].seen[0], tol)          # unscaled (a scale of 2**8 would be far off)
    for log in logs:
        assert all(torch.equal(a, b) for a, b in zip(log.after[1], log.after[2])) and all(torch.equal(a, b) for a, b in zip(log.after[2], log.after[3]))
        assert not all(torch.equal(a, b) for a, b in zip(log.after[3], log.after[4]))
    assert close(weights(half), weights(ref), tol)

def test_no_optimizer_method_is_patched():
    # the engine steps from the callback's `before_step` and cancels fastai's own step; `learn.opt` is a
    # `MixedPrecisionOpt` over fastai's
    # optimizer (for the state dict in the model's layout), which keeps its class's methods throughout, and is
    # `learn.opt` again after `to_fp32`
    learn = synth_learner().to_fp16()
    raw = learn.opt.opt
    methods = ('step', 'zero_grad', 'state_dict', 'load_state_dict')
    seen = []
    learn.fit(1, cbs=Record(1, before_step=lambda l: seen.append(sorted(k for k in methods if k in vars(l.opt.opt)))))
    assert seen and all(s == [] for s in seen) and learn.opt.opt is raw
    assert isinstance(learn.opt, MixedPrecisionOpt) and not any(k in vars(raw) for k in methods)
    learn.save('handle')
    learn.to_fp32()
    assert learn.opt is raw and not any(k in vars(raw) for k in methods)

def _wgan(opt_func, seed=0):
    "A tiny WGAN (fastai's `GANLearner.wgan`: critic weights clamped to 0.01 through `p.data` before each batch)"
    from fastai.vision.gan import GANLearner
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    class Noise(torch.utils.data.Dataset):
        def __len__(self): return 64
        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(10, generator=g), torch.randn(3, 8, 8, generator=g) * 0.5 + 0.25
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(10, 3 * 8 * 8), nn.Unflatten(1, (3, 8, 8)), nn.Tanh())
    crit = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 1))
    learn = GANLearner.wgan(DataLoaders(DataLoader(Noise(), bs=8), DataLoader(Noise(), bs=8)), gen, crit,
                            opt_func=opt_func, lr=1e-2)
    quiet(learn)
    return learn

@pytest.mark.parametrize("opt", ['RMSProp', 'Adam'])      # fastai's own step (RMSProp), the fused kernels (Adam)
def test_a_wgan_keeps_its_clamp_in_half_precision_as_in_fp32(opt):
    # GANTrainer clamps the critic through `p.data` before each batch; the step takes the clamped half weights as the
    # masters (before: the masters overwrote the clamp, max |w| 0.231 where fp32 keeps 0.056). GANLoss calls the
    # generator and the critic by themselves: their inputs are cast as the model's
    import fastai.optimizer as fo
    opt_func = getattr(fo, opt)
    def run(precision):
        learn = _wgan(opt_func)
        if precision: getattr(learn, f'to_{precision}')(**({'loss_scale': 2.**8} if precision == 'fp16' else {}))
        learn.fit(2)
        crit = learn.model.critic
        masters = [learn.mixed_precision.conversion.masters.held(p) for p in crit.parameters()] if precision else list(crit.parameters())
        return max(m.detach().abs().max().item() for m in masters), learn
    ref, _ = run(None)
    assert ref < 0.2
    for precision in ('bf16', 'fp16'):
        peak, learn = run(precision)
        assert abs(peak - ref) < 0.02, (precision, peak, ref)
        gen = learn.model.generator
        assert gen[0].weight.dtype == (torch.bfloat16 if precision == 'bf16' else torch.float16)

# ---------------------------------------------------------------- modules kept in fp32

def plain_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_module_kept_in_fp32_trains_exactly_as_fp32(precision):
    # Nothing to convert: the callback does nothing (no cast hooks) and fastai's optimizer steps the fp32 params itself;
    # this used
    # to fail the first backward with "params the optimizer does not hold"
    ref = synth_learner(plain_mlp(), opt_func=Adam, lr=1e-2)
    ref.fit(2)
    learn = synth_learner(plain_mlp(), opt_func=Adam, lr=1e-2)
    with pytest.warns(UserWarning,
                      match=r"nothing in the model is converted .*Linear.*mixed precision changes nothing"):
        learn = getattr(learn, f'to_{precision}')(keep_fp32=nn.Linear)
    learn.fit(2)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert not learn.model._forward_pre_hooks and not learn.model[0]._forward_pre_hooks
    assert all(torch.equal(a, b) for a, b in zip(weights(ref), weights(learn)))
    assert learn.recorder.values[-1] == ref.recorder.values[-1]
    learn.to_fp32(); learn.fit(1)                                     # and out again

def orthogonal_mlp():
    from torch.nn.utils import parametrizations
    model = plain_mlp()
    # Householder products: no half kernel on the CPU
    parametrizations.orthogonal(model[0], orthogonal_map='householder')
    return model

def test_an_op_without_a_half_kernel_names_the_module_to_keep_in_fp32_and_that_fix_trains():
    learn = synth_learner(orthogonal_mlp(), opt_func=Adam, lr=1e-2).to_bf16()
    with pytest.raises(NotImplementedError) as caught: learn.fit(1)
    note = ' '.join(getattr(caught.value, '__notes__', []))
    assert "no bf16 kernel for this op" in note and "learn.to_bf16(keep_fp32=_Orthogonal)" in note, note
    from torch.nn.utils.parametrizations import _Orthogonal
    # the advice, as written
    learn = synth_learner(orthogonal_mlp(), opt_func=Adam, lr=1e-2).to_bf16(keep_fp32=_Orthogonal)
    learn.fit(2)
    assert learn.model[
        0].parametrizations.weight.original.dtype == torch.bfloat16 and learn.mixed_precision.engine.masters is not None
    first, last = learn.recorder.values[0][0], learn.recorder.values[-1][0]
    assert last < first and torch.isfinite(torch.tensor(last))
    # the parametrization computed in fp32, on the half weight
    w = learn.model[0].weight.float()
    assert torch.allclose(w.T @ w, torch.eye(8), atol=1e-2)


# ---------------------------------------------------------------- copies of the model: an EMA, an fp32 copy

from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from mixedprec.convert import fp32_copy

def _amp_run(dtype, **kw):
    ("A model through amp O2, and a function that trains it 12 steps on fixed batches, calling `after_step(i)` after "
     "each")
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(16, 32, 8)
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level='O2',
                                cast_model_type=dtype, verbosity=0, **kw)
    def train(after_step):
        for i in range(12):
            with amp.scale_loss(model(x[i]).float().pow(2).mean(), opt) as scaled: scaled.backward()
            opt.step(); opt.zero_grad(); after_step(i)
    return model, train

def _fastai_run(setup):
    "A Learner set up by `setup`, and a function that fits it one epoch (6 steps), calling `after_step(i)` after each"
    learn = setup(synth_learner(opt_func=Adam, lr=1e-2))
    def train(after_step): learn.fit(1, cbs=Record(1, after_step=lambda l: after_step(l.train_iter)))
    return learn.model, train

RUNS = {'amp O2 fp16': lambda: _amp_run(torch.float16), 'amp O2 bf16': lambda: _amp_run(torch.bfloat16),
        'fastai fp16 flat': lambda: _fastai_run(lambda l: l.to_fp16(loss_scale=2.**8, flat_master=True)),
        'fastai bf16 split': lambda: _fastai_run(lambda l: l.to_bf16(masters='split'))}

def _fp32_values(model):
    return {k: v.detach().float().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("run", RUNS)
def test_an_ema_copy_averaged_in_place_saves_and_computes_its_average(run, how):
    ("torch's `AveragedModel` (a deep copy, averaged in place in the params' dtype): its `state_dict()` is what it "
     "computes with, and follows an fp32 EMA of the masters; it saved the copy-time weights before")
    model, train = RUNS[run]()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    if how == "pickle": ema.module = pickle.loads(pickle.dumps(ema.module))
    shadow = {}
    def after_step(i):
        ema.update_parameters(model)
        for k, v in _fp32_values(model).items(): shadow[k] = v if k not in shadow else shadow[k].lerp_(v, 0.1)
    train(after_step)
    saved, params = ema.module.state_dict(), dict(ema.module.named_parameters())
    tol = 4e-2 if 'bf16' in run else 5e-3          # the average is rounded to the half dtype at each step
    for k, p in params.items():
        assert torch.equal(saved[k], p.detach().float()), k              # the checkpoint is what the copy computes with
        torch.testing.assert_close(saved[k], shadow[k], rtol=tol, atol=tol)

@pytest.mark.parametrize("run", [r for r in RUNS if 'split' not in r])
def test_an_ema_written_into_a_copys_state_dict_is_fp32_and_computed_with(run):
    ("timm's `ModelEmaV2`/`V3` way: lerp the copy's `state_dict()` values toward the model's in place. Those values "
     "are the copy's fp32 masters, so the EMA is exactly an fp32 one, and the copy computes with its rounding (it "
     "computed with its copy-time weights before)")
    model, train = RUNS[run]()
    ema, shadow = copy.deepcopy(model), _fp32_values(model)
    def after_step(i):
        with torch.no_grad():
            for (k, e), m in zip(ema.state_dict().items(), model.state_dict().values()):
                if e.is_floating_point(): e.lerp_(m, 0.001); shadow[k].lerp_(m.float(), 0.001)
                else: e.copy_(m)
    train(after_step)
    x = torch.randn(4, 8)
    fresh = mlp(); fresh.load_state_dict(shadow); fresh.eval(); ema.eval()
    out = ema(x)
    # bit for bit an fp32 EMA with decay 0.999
    assert all(torch.equal(ema.state_dict()[k], v) for k, v in shadow.items())
    for k, p in ema.named_parameters():
        assert torch.equal(p, shadow[k].to(p.dtype)), k  # and the params are its rounding
    torch.testing.assert_close(out, fresh(x), rtol=3e-2, atol=3e-2)

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_write_into_the_training_models_state_dict_reaches_the_next_forward_and_step(precision):
    ("In plain torch a `state_dict()` value shares the param's storage; here it is the param's master: an in-place "
     "write to it is the model's weight at once, as loading the same values is")
    def half_learner():
        learn = synth_learner(relu_bn_mlp(), opt_func=Adam, lr=1e-2)
        return learn.to_fp16(loss_scale=2.**8) if precision == 'fp16' else learn.to_bf16()
    written, loaded = half_learner(), half_learner()
    for l in (written, loaded): l.fit(1)
    with torch.no_grad(): written.model.state_dict()['0.weight'].mul_(0.5)
    sd = loaded.model.state_dict(); sd['0.weight'] = sd['0.weight'] * 0.5; loaded.model.load_state_dict(sd)
    x, w = torch.randn(2, 8), written.model[0].weight
    for l in (written, loaded): l.model.eval(); l.model(x)
    assert torch.equal(w, masters_of(written)[0].to(w.dtype))          # rounded into the param before the forward
    for l in (written, loaded): l.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(weights(written), weights(loaded)))
    assert all(torch.equal(a, b) for a, b in zip(masters_of(written), masters_of(loaded)))

@pytest.mark.parametrize("run", RUNS)
def test_fp32_copy_holds_the_masters_without_hooks_and_leaves_the_model_training(run):
    model, train = RUNS[run]()
    train(lambda i: None)
    masters = _fp32_values(model)
    cp = fp32_copy(model)
    assert all(v.dtype == torch.float32 for v in cp.state_dict().values() if v.is_floating_point())
    # the masters, not the half weights
    assert all(torch.equal(cp.state_dict()[k], v) for k, v in masters.items())
    assert not hasattr(cp, '_mixedprec_conversion') and not any(m._forward_pre_hooks or m._forward_hooks for m in cp.modules())
    cp.eval(); assert cp(torch.randn(2, 8)).dtype == torch.float32
    assert all(torch.equal(model.state_dict()[k], v) for k, v in masters.items())          # the model is as it was
    assert any(p.dtype != torch.float32 for p in model.parameters())

def test_fp32_copy_of_an_unconverted_model_says_what_it_takes():
    with pytest.raises(ValueError, match="converted"): fp32_copy(mlp())

def test_a_converted_model_cast_to_fp32_names_fp32_copy():
    model, _ = _amp_run(torch.bfloat16)
    with pytest.raises(TypeError, match=r"fp32_copy\(model\)"): copy.deepcopy(model).float()       # refused at the call
    twin = copy.deepcopy(model)
    twin[0].float()                                                  # a submodule: named at its first forward
    with pytest.raises(RuntimeError) as e: twin(torch.randn(2, 8))
    assert "fp32_copy(model)" in "".join(getattr(e.value, '__notes__', []))

def test_a_copy_of_a_converted_model_in_a_new_learner_is_refused_naming_fp32_copy_which_trains():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_bf16()
    learn.fit(1)
    with pytest.raises(ValueError, match=r"fp32_copy\(model\)"):
        synth_learner(model=copy.deepcopy(learn.model)).to_bf16()
    again = synth_learner(model=fp32_copy(learn.model), opt_func=Adam, lr=1e-2).to_bf16()
    # it starts from the masters, not their rounding
    assert all(torch.equal(a, b) for a, b in zip(masters_of(again), masters_of(learn)))
    start = weights(again)
    again.fit(1)
    assert again.recorder.values[
        -1][0] < learn.recorder.values[0][0] and not all(torch.equal(a, b) for a, b in zip(start, weights(again)))

def test_load_state_dict_with_assign_is_refused_before_anything_changes():
    ("`assign=True` would swap in the checkpoint's fp32 tensors as new params, which the optimizer does not hold: "
     "refused, and the model trains on as its twin")
    learn, twin = synth_learner(opt_func=Adam, lr=1e-2).to_bf16(), synth_learner(opt_func=Adam, lr=1e-2).to_bf16()
    for l in (learn, twin): l.fit(1)
    params, sd = list(learn.model.parameters()), {k: v * 2 for k, v in learn.model.state_dict().items()}
    with pytest.raises(RuntimeError, match="assign=True.*Nothing was loaded"):
        learn.model.load_state_dict(sd, assign=True)
    assert all(a is b for a, b in zip(params, learn.model.parameters()))
    for l in (learn, twin): l.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(weights(learn), weights(twin)))
    assert all(torch.equal(a, b) for a, b in zip(masters_of(learn), masters_of(twin)))

def test_a_layer_replaced_after_amp_initialize_is_named():
    model, _ = _amp_run(torch.bfloat16)
    model[3] = nn.Linear(16, 1)
    with pytest.raises(RuntimeError) as e: model(torch.randn(2, 8))
    assert "3.weight, 3.bias" in "".join(getattr(e.value, '__notes__', []))

def test_a_change_through_data_between_fits_is_taken():
    "torch's version counter misses `p.data.zero_()`: the next fit takes the change before anything reads the masters"
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    learn.model[0].bias.data.zero_()
    with torch.no_grad(): learn.model[3].weight.mul_(0.5)            # in place: seen by the version counter
    learn.fit(1, lr=0.)
    assert torch.equal(masters_of(learn)[1], torch.zeros(16)) and not learn.model[0].bias.any()

def test_one_element_changed_through_data_between_fits_leaves_the_others_fp32_bits():
    # between fits, as in each step: only the changed element is taken (it used to round its whole master)
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    w = learn.model[0].weight
    before = learn.mixed_precision.conversion.masters.value(w).clone()
    w.data[0, 0] = 0.5
    learn.fit(1, lr=0.)
    after = learn.mixed_precision.conversion.masters.value(w)
    assert after[0, 0] == 0.5 and torch.equal(after.flatten()[1:], before.flatten()[1:])
    assert not torch.equal(before.flatten()[1:], before.flatten()[1:].half().float())       # they had bits below fp16's

def _clamped_run(front, precision, impl, steps=4, c=0.05):
    ("SGD with momentum on an MLP whose first layer is clamped through `.data` after every step (a WGAN critic's "
     "clip), then a step at lr=0: the first layer's params and their masters")
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(32, 8)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(precision)
    if front == 'amp' and dtype is not None:
        model, opt = amp.initialize(model, opt, opt_level='O2', cast_model_type=dtype,
                                    loss_scale=2.**8 if dtype == torch.float16 else 1.,
                                    verbosity=0, impl=impl)
    elif front == 'fp16_optimizer' and dtype is not None:
        model = model.to(dtype)
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), static_loss_scale=2.**8,
                             verbose=False, impl=impl)
    for i in range(steps + 1):
        if i == steps:
            for g in opt.param_groups: g['lr'] = 0.
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(dtype) if front == 'fp16_optimizer' and dtype else x).float(), y)
        if front == 'amp' and dtype is not None:
            with amp.scale_loss(loss, opt) as scaled: scaled.backward()
        elif front == 'fp16_optimizer' and dtype is not None: opt.backward(loss)
        else: loss.backward()
        opt.step()
        if i < steps:
            for p in model[0].parameters(): p.data.clamp_(-c, c)
    masters = opt.param_groups[0]['params'][:2]
    assert [m.shape for m in masters] == [p.shape for p in model[0].parameters()]
    return [p.detach().float().clone() for p in model[0].parameters()], [m.detach().clone() for m in masters]

@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
@pytest.mark.parametrize("impl", ['ref', 'fused'])
def test_a_clamp_through_data_after_each_step_reaches_the_masters_in_every_front_end(front, precision, impl):
    # the step after a clamp through `.data` starts from the clamped values: the masters hold them (up to half an ulp of
    # the clamp: a master that rounds to 0.05 is not an edit), and the run follows fp32's. Before: the masters ignored
    # the clamp, and each step undid it
    ref, _ = _clamped_run(front, None, impl)
    half, masters = _clamped_run(front, precision, impl)
    assert all(m.dtype == torch.float32 and m.abs().max() <= 0.05 * (1 + 2.**-8) for m in masters)
    tol = 5e-3 if precision == 'bf16' else 2e-3
    for a, b in zip(half, ref): torch.testing.assert_close(a, b, atol=tol, rtol=0)

def test_fp32_copy_of_a_model_without_masters_is_fp32_throughout():
    "amp's O3 keeps no masters: the copy takes the half values, cast to fp32"
    torch.manual_seed(0)
    model = mlp()
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level='O3', verbosity=0)
    cp = fp32_copy(model)
    assert all(t.dtype == torch.float32 for t in [*cp.parameters(), *cp.buffers()] if t.is_floating_point())
    assert all(torch.equal(a.float(), b) for a, b in zip(model.parameters(), cp.parameters()))
    cp.eval(); assert cp(torch.randn(2, 8)).dtype == torch.float32

@pytest.mark.parametrize("kw", [dict(flat_master=True), dict(masters='split'), dict(state='8bit')])
def test_a_clamp_through_data_in_a_callback_reaches_every_kind_of_master(kw):
    # flat masters step through the optimizer's own step (adopt_data_edits before it), split masters hold the bf16
    # param as their high half, 8-bit state steps through the fused kernels' 8-bit path
    def clamp(learn):
        if learn.training:
            for p in learn.model[0].parameters(): p.data.clamp_(-0.05, 0.05)
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_bf16(**kw)
    learn.fit(3, cbs=Record(-1, after_step=clamp))
    # each step starts from the clamp, so the masters end within one Adam step (about lr) of it (untaken: 0.2 and more)
    mp = learn.mixed_precision
    masters = [mp.conversion.masters.value(p) for p in learn.model[0].parameters()]
    assert all(m.abs().max() <= 0.05 + 1.5e-2 for m in masters), [m.abs().max() for m in masters]
