"""What users combine with mixedprec: a callback for one fit or removed, schedulers, optimizer step hooks, copies and
pickles of an amp model, keep_fp32 as users write it, lr_find, GradScaler's names, a cap below the default start."""
import copy, io, pickle, warnings
import pytest
import torch
from torch import nn
from fastai.optimizer import Adam
from fastai.callback.schedule import lr_find   # Learner.lr_find
from mixedprec import amp, convert, ops
from mixedprec.callback import MixedPrecision
from mixedprec.fp16_optimizer import FP16_Optimizer
from helpers import synth_learner, masters_of, quiet, master_values

def test_a_callback_for_one_fit_leaves_a_training_fp32_learner():
    learn = synth_learner(opt_func=Adam, lr=1e-2)
    learn.fit(1, cbs=MixedPrecision(loss_scale=2.**8))
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32} and not hasattr(learn, 'mixed_precision')
    held = [p for g in learn.opt.param_lists for p in g]
    assert all(a is b for a, b in zip(held, learn.model.parameters()))
    w = learn.model[0].weight.detach().clone()
    learn.fit(1)
    assert not torch.equal(w, learn.model[0].weight.detach())              # it still trains, in fp32

def test_removing_the_callback_returns_to_fp32_from_the_masters():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    masters = [m.detach().clone() for m in masters_of(learn)]
    state = learn.opt.state_dict()['state']
    learn.remove_cb(learn.mixed_precision)
    assert all(torch.equal(p.detach(), m) for p, m in zip(learn.model.parameters(), masters))
    assert 'grad_avg' in learn.opt.state[learn.model[0].weight] and len(state) == len(list(learn.model.parameters()))
    w = learn.model[0].weight.detach().clone()
    learn.fit(1)
    assert not torch.equal(w, learn.model[0].weight.detach())

def two_layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                  lambda ps: torch.optim.RMSprop(ps, lr=1e-3)])
@pytest.mark.parametrize("front", ['fp16', 'amp'])
def test_step_hooks_run_once_per_real_step_and_schedulers_see_the_step(front, make):
    model = two_layer()
    if front == 'amp':
        opt = make(model.parameters())
        model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0, decide='never')
        inner = opt
    else:
        model = model.half()
        opt = FP16_Optimizer(make(model.parameters()), dynamic_loss_scale=True, verbose=False, decide='never')
        inner = opt.optimizer
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.9)
    calls = []
    inner.register_step_pre_hook(
        lambda o, a, k: calls.append('pre')); inner.register_step_post_hook(lambda o, a, k: calls.append('post'))
    with warnings.catch_warnings():
        warnings.simplefilter('error')                         # no "lr_scheduler.step() before optimizer.step()"
        for i in range(4):
            x = torch.randn(8, 4)
            # step 1 overflows
            loss = model(x.half() if front == 'fp16' else x).float().pow(2).mean() * (1e6 if i == 1 else 1)
            if front == 'amp':
                with amp.scale_loss(loss, opt) as s: s.backward()
            else: opt.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
    assert calls == ['pre', 'post'] * 3                       # the skipped step ran no hook
    assert inner.param_groups[0]['lr'] == pytest.approx(make([torch.zeros(1)]).defaults['lr'] * 0.9 ** 4)

def test_amp_o1_models_copy_and_pickle_as_models():
    model = two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level='O1', verbosity=0)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters(): p.zero_()
    x = torch.randn(3, 4)
    # the copy runs its own weights
    assert torch.equal(ema(x), torch.zeros(3, 2)) and not torch.equal(model(x), torch.zeros(3, 2))
    assert ema(x).dtype == torch.float32
    buf = io.BytesIO(); torch.save(model, buf); buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert torch.equal(back(x), model(x))

def test_keep_fp32_takes_a_type_or_a_tuple_and_keeps_batchnorm():
    class Net(nn.Module):
        def __init__(self):
            super().__init__(); self.lin, self.ln, self.bn = nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8); self.out = nn.Linear(8, 1)
        def forward(self, x): return self.out(self.bn(self.ln(self.lin(x))))
    for keep in (nn.LayerNorm, (nn.LayerNorm,)):
        learn = synth_learner(Net()).to_fp16(keep_fp32=keep)
        m = learn.model
        assert (m.lin.weight.dtype, m.ln.weight.dtype,
                m.bn.weight.dtype) == (torch.float16, torch.float32, torch.float32)
        learn.fit(1)
    learn = synth_learner(Net()).to_fp16(keep_batchnorm=False)
    assert learn.model.bn.weight.dtype == torch.float16

def test_lr_find_leaves_the_history_as_it_was():
    learn = synth_learner(opt_func=Adam).to_fp16(loss_scale=2.**20, max_scale=2.**20)
    learn.fit(1)
    before = list(learn.mixed_precision.history), learn.mixed_precision.scaler.state_dict()
    with learn.no_logging(): learn.lr_find(num_it=10, show_plot=False)
    assert (list(learn.mixed_precision.history), learn.mixed_precision.scaler.state_dict()) == before
    learn.fit(1)
    steps = [r.step for r in learn.mixed_precision.history]
    assert steps == list(range(1, len(steps) + 1))

def test_gradscaler_names_and_a_cap_below_the_default_start():
    mp = synth_learner().to_fp16(init_scale=2.**10, growth_interval=50, growth_factor=4.,
                                 backoff_factor=0.25).mixed_precision
    sc = mp.scaler
    assert (sc.scale, sc.max_noskip, sc.factor) == (2.**10, 50, 4.)
    with pytest.raises(TypeError, match='backoff_factor=0.5 is not 1/growth factor'):
        synth_learner().to_fp16(growth_factor=4., backoff_factor=0.5)
    assert synth_learner().to_fp16(max_scale=1024).mixed_precision.loss_scale == 1024.
    opt = FP16_Optimizer(torch.optim.SGD(two_layer().half().parameters(), lr=0.1), dynamic_loss_scale=True,
                         verbose=False,
                         dynamic_loss_args=dict(init_scale=8., growth_interval=3))
    assert (opt.scaler.scale, opt.scaler.max_noskip) == (8., 3)

def test_the_fp16_convolution_note_is_for_models_with_convolutions(monkeypatch):
    monkeypatch.setattr(convert, 'cpu_flags', lambda: {'avx512_fp16'})
    assert 'convolutions' in convert.speed_note(torch.float16, 'cpu')
    assert 'convolutions' not in convert.speed_note(torch.float16, 'cpu', convs=False)
    monkeypatch.setattr(ops, '_warned', set())
    with pytest.warns(UserWarning) as rec: synth_learner().to_fp16()
    assert not any('convolutions' in str(r.message) for r in rec)

def tiny_cnn_learner(**kw):
    "A BN CNN on 8x8 single-channel images (kept tiny: fp16 convolution backward is slow on CPUs)"
    from torch.utils.data import TensorDataset
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x[:48], y[:48]), bs=16),
                      DataLoader(TensorDataset(x[48:], y[48:]), bs=16))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    from fastai.learner import Learner
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=1e-2, **kw)
    quiet(learn)
    return learn

@pytest.mark.parametrize("order", ['to_bf16 first', 'to_channelslast first'])
@pytest.mark.parametrize("flat", [False, True])
def test_channels_last_with_bf16_trains_like_nchw(order, flat):
    from fastai.callback.channelslast import ChannelsLast       # Learner.to_channelslast
    ref = tiny_cnn_learner().to_bf16(flat_master=flat)
    ref.fit(2)
    learn = tiny_cnn_learner()
    if order == 'to_bf16 first': learn.to_bf16(flat_master=flat).to_channelslast()
    else: learn.to_channelslast(); learn.to_bf16(flat_master=flat)
    assert type(learn.mixed_precision).__module__ == 'mixedprec.callback'
    learn.fit(2)
    conv = learn.model[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    for m in learn.mixed_precision.engine.masters.masters:
        assert m.value().stride() == m.param.stride() and torch.equal(m.param.detach(), m.value().to(m.param.dtype))
    for a, b in zip(master_values(ref), master_values(learn)):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    sd = learn.opt.state_dict()                                 # checkpoints keep the logical (NCHW) order
    learn.to_fp32()
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())

def test_the_table_columns_line_up(capsys):
    from fastai.learner import Learner
    from fastai.callback.progress import ProgressCallback
    from helpers import synth_dls, mlp
    torch.manual_seed(0)
    learn = Learner(synth_dls(), mlp(), loss_func=nn.MSELoss()).to_fp16(table=True)
    learn.fit(2)
    lines = [l.split('\r')[-1].split('█')[-1] for l in capsys.readouterr().out.splitlines()]
    header = next(l for l in lines if 'loss_scale' in l)
    rows = [l for l in lines if l.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(len(r.split()) == len(header.split()) for r in rows), (header, rows)
    scale, skipped = rows[-1].split()[3:5]
    assert float(scale) == learn.mixed_precision.loss_scale and int(skipped) >= 0

def test_an_fp32_tensor_made_in_forward_gets_a_hint():
    class Noisy(nn.Module):
        def __init__(self): super().__init__(); self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 1)
        def forward(self, x):
            h = self.lin(x)
            return self.out(h + torch.randn(h.shape) @ torch.eye(8))      # fp32 noise meets half activations
    learn = synth_learner(Noisy()).to_fp16()
    with pytest.raises(RuntimeError) as e: learn.fit(1)
    notes = ' '.join(getattr(e.value, '__notes__', []))
    assert 'float32 tensor made inside the `forward` of' in notes and 'dtype=h.dtype' in notes
