"Diagnostics and failure handling on all three front ends"
import matplotlib; matplotlib.use('Agg')
import pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from torch.utils.data import TensorDataset
from mixedprec import amp, convert, ops
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.scaler import LossScaler, ScalingError, plot_history
from mixedprec.callback import MixedPrecision
from helpers import synth_learner, Record, mlp, quiet

def inject(at, where='inf', param=lambda m: m[3].weight):
    def f(learn):
        if learn.train_iter == at: param(learn.model).grad.view(-1)[0] = float(where)
    return Record(-1, before_step=f)

def test_history_attributes_overflow_to_params_and_tells_inf_from_nan():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=[inject(1, 'inf'), inject(3, 'nan', lambda m: m[0].bias)])
    h = learn.mixed_precision.history
    assert (h[1].skipped, h[1].reason, h[1].params) == (True, 'overflow', ('3.weight (inf)',))
    assert h[3].params == ('0.bias (nan)',) and h[0].params is None and h[2].reason is None

def test_grad_norm_recorded_when_clipping_and_nonfinite_norm_is_a_skip():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8, clip=1.)
    learn.fit(1)
    assert all(r.grad_norm is not None and r.grad_norm > 0 for r in learn.mixed_precision.history)

def test_plot_draws_scale_and_skips():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8, max_noskip=2)
    learn.fit(1, cbs=inject(2))
    ax = learn.mixed_precision.plot()
    assert len(ax.lines) == 1 and len(ax.collections) == 1 and ax.get_yscale() == 'log'
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ['loss scale', 'skipped: overflow']
    # empty is fine
    ax = plot_history(FP16_Optimizer(torch.optim.SGD(mlp().half().parameters(), lr=1.), verbose=False).history)

def test_nan_in_the_input_batch_is_reported_as_data():
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    x[::16, 0] = float('nan')                                 # every batch of 16 has a NaN row
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=16), DataLoader(TensorDataset(x, y), bs=16))
    learn = Learner(dls, mlp(), loss_func=nn.MSELoss(), opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8, max_bad_loss=3)
    with pytest.raises(ScalingError, match='input batch held inf or NaN'): learn.fit(1)
    assert [
        r.reason for r in learn.mixed_precision.history] == [
            'nonfinite_input'] * 3 and learn.mixed_precision.loss_scale == 2.**8

def test_inputs_beyond_fp16s_range_are_reported_as_data_and_bf16_trains_on_them():
    # A raw feature in the hundreds of thousands (a salary, unnormalised) becomes inf when the inputs are cast into an
    # fp16 model
    torch.manual_seed(0)
    x = torch.randn(64, 8); x[:, 3] *= 1e5
    y = x[:, :3].sum(1, keepdim=True)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=16), DataLoader(TensorDataset(x, y), bs=16))
    learn = Learner(dls, mlp(), loss_func=nn.MSELoss(), opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8, max_bad_loss=3)
    with pytest.raises(ScalingError, match=r"input batch held inf or NaN .*above 65504.*cast into the half "
                                           r"model.*`Normalize`.*bf16"):
        learn.fit(1)
    assert [
        r.reason for r in learn.mixed_precision.history] == [
            'nonfinite_input'] * 3 and learn.mixed_precision.loss_scale == 2.**8
    learn = Learner(dls, mlp(), loss_func=nn.MSELoss(), opt_func=SGD, lr=1e-6).to_bf16()
    learn.fit(1)
    assert all(
        r.reason is None for r in learn.mixed_precision.history) and torch.isfinite(
            torch.tensor(learn.recorder.values[-1])).all()

def test_inf_loss_on_fp16_optimizer_and_amp_keeps_the_scale():
    model = mlp(bn=False) if False else nn.Linear(4, 1).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1.), dynamic_loss_scale=True, verbose=False)
    opt.backward(model(torch.randn(2, 4).half()).float().sum() * float('inf'))
    assert opt.overflow and opt.history[-1].reason == 'nonfinite_loss' and opt.loss_scale == 2.**16
    m = nn.Linear(4, 1); o = torch.optim.SGD(m.parameters(), lr=1.)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    with amp.scale_loss(m(torch.randn(2, 4)).sum() * float('nan'), o) as s: s.backward()
    o.step()
    assert amp.skipped(o) and amp.history()[-1].reason == 'nonfinite_loss' and amp._state.scalers[0].scale == 2.**16

def test_persistent_overflow_at_the_floor_raises_naming_params():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=4., min_scale=1., max_overflow_at_min=3)
    cb = Record(-1, before_step=lambda l: l.model[3].weight.grad.fill_(float('inf')))
    with pytest.raises(ScalingError, match=r"minimum loss scale 1.*bf16.*keep_fp32.*3\.weight \(inf\)"):
        learn.fit(1, cbs=cb)
    scales = [r.scale for r in learn.mixed_precision.history]
    assert min(scales) == 1. and learn.mixed_precision.loss_scale == 1.

@pytest.mark.parametrize("kw,exc,msg", [(dict(min_scale=0.), ValueError, 'min_scale'),
                                        (dict(loss_scale=-2.), ValueError, 'loss_scale'),
    (dict(max_scale=8., loss_scale=16.), ValueError, 'max_scale'), (dict(max_noskip=0), ValueError, 'max_noskip'),
    (dict(clip=0.), ValueError, 'clip'), (dict(bogus=1), TypeError, 'unknown keyword')])
def test_bad_settings_raise_at_construction(kw, exc, msg):
    with pytest.raises(exc, match=msg): synth_learner().to_fp16(**kw)

def test_messages_are_off_by_default_and_once_per_change_when_verbose(capsys):
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=inject(1))
    assert capsys.readouterr().out == ''
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8, max_noskip=2, verbose=True)
    learn.fit(1, cbs=inject(1))
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == 'mixedprec: step 2: loss scale 256 -> 128 (overflow in 3.weight (inf))'
    assert out[1:] == ['mixedprec: step 4: loss scale 128 -> 256 (2 clean steps)',
                       'mixedprec: step 6: loss scale 256 -> 512 (2 clean steps)']
    # a static scale: skips don't flood
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(dynamic=False, verbose=True)
    learn.fit(1, cbs=Record(-1, before_step=lambda l: l.model[3].weight.grad.fill_(float('inf'))))
    assert len(capsys.readouterr().out.strip().splitlines()) == 1

def test_conversion_warns_about_underflow_and_range(monkeypatch):
    monkeypatch.setattr(ops, '_warned', set())
    model = nn.Sequential(nn.Linear(100, 10), nn.Linear(10, 1))
    with torch.no_grad(): model[0].weight[:5] = 1e-9; model[1].weight[0, 0] = 1e5
    with pytest.warns(UserWarning) as rec: convert.convert_model(model)
    msgs = [str(w.message) for w in rec]
    assert any("exceed fp16's range" in m for m in msgs) and any("below fp16's smallest value" in m for m in msgs)
    with pytest.warns(UserWarning, match='running_var'):
        bn = nn.BatchNorm1d(3); bn.running_var.fill_(1e6)
        convert.convert_model(nn.Sequential(nn.Linear(3, 3), bn), keep_fp32=())
    # bf16 has fp32's range: no warning
    convert.convert_model(nn.Sequential(nn.Linear(100, 10)), dtype=torch.bfloat16)

def test_table_shows_scale_and_skipped_per_epoch():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8, table=True)
    learn.fit(2, cbs=inject(1))
    names = list(learn.recorder.metric_names)
    assert names[-3:] == ['loss_scale', 'skipped', 'time']
    assert [v[-1] for v in learn.recorder.values] == [1, 0] and learn.recorder.values[0][-2] == 128.
    assert not any(getattr(m, 'name', '') == 'loss_scale' for m in learn.metrics)

def test_every_param_frozen_is_a_clear_error():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16()
    for p in learn.model.parameters(): p.requires_grad_(False)
    for m in learn.opt.param_lists[0]: m.requires_grad_(False)
    assert learn.get_preds()[0].dtype == torch.float32
    with pytest.raises(ValueError, match='every param of the model is frozen'): learn.fit(1)

def test_params_replaced_after_the_optimizer_was_built():
    learn = synth_learner(opt_func=SGD, lr=0.01).to_fp16()
    learn.model[3] = nn.Linear(16, 1)
    with pytest.raises(ValueError, match=r"added or replaced after `to_fp16\(\)` \(3.weight, 3.bias\)"): learn.fit(1)
    learn.to_fp16(); learn.fit(1)
    assert learn.model[3].weight.dtype == torch.half

def test_optimizer_without_grads_in_a_step_is_a_noop():
    gen, disc = nn.Linear(2, 2).half(), nn.Linear(2, 1).half()
    opt_d = FP16_Optimizer(torch.optim.Adam(disc.parameters(), lr=0.1), static_loss_scale=8., verbose=False)
    w = disc.weight.detach().clone()
    opt_d.update_master_grads(); opt_d.step()                            # a generator turn: disc got no grads
    assert not opt_d.overflow and torch.equal(disc.weight.detach(), w)

class Pair(nn.Module):
    "Takes a dict batch with a mask, returns a tuple holding a dict"
    def __init__(self): super().__init__(); self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)
    def forward(self, batch):
        assert batch['x'].dtype == torch.half and batch['mask'].dtype == torch.bool
        return (self.a(batch['x']), {'b': self.b(batch['x'])})

def test_dict_batch_and_tuple_dict_prediction():
    class ToDict(DataLoader):
        def after_batch(self, b): x, y = b; return ({'x': x, 'mask': x > 0}, y)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    dls = DataLoaders(ToDict(TensorDataset(x, y), bs=16), ToDict(TensorDataset(x, y), bs=16))
    def loss(pred, y): return nn.functional.mse_loss(pred[0], y) + nn.functional.mse_loss(pred[1]['b'], y)
    seen = []
    learn = Learner(dls, Pair(), loss_func=loss, opt_func=SGD, lr=0.01).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=Record(1, after_pred=lambda l: seen.append((l.pred[0].dtype, l.pred[1]['b'].dtype))))
    assert set(seen) == {(torch.float32, torch.float32)} and learn.mixed_precision.scaler.n_steps == 4

def test_tied_weights_and_params_already_half():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__(); self.emb = nn.Embedding(10, 8); self.out = nn.Linear(8, 10, bias=False); self.out.weight = self.emb.weight
        def forward(self, ids): return self.out(self.emb(ids))
    ids = torch.randint(0, 10, (64,))
    dls = DataLoaders(DataLoader(TensorDataset(ids, ids), bs=16), DataLoader(TensorDataset(ids, ids), bs=16))
    learn = Learner(dls, Tied().half(), loss_func=nn.CrossEntropyLoss(), opt_func=Adam,
                    lr=1e-2).to_fp16(loss_scale=2.**8)
    assert len(learn.mixed_precision.conversion.masters) == 1
    learn.fit(1)
    assert learn.model.out.weight is learn.model.emb.weight and len(learn.opt.param_lists[0]) == 1
    assert torch.equal(learn.model.emb.weight.detach(), learn.opt.param_lists[0][0].detach().half())


# ---------------------------------------------------------------- constants beyond the half range (attention masks)

class MaskedAttention(nn.Module):
    ("Self-attention over token embeddings, its padding masked with `fill` (a number, or 'dtype' for the scores' own "
     "most negative value)")
    def __init__(self, fill):
        super().__init__(); self.fill = fill
        self.emb, self.q, self.k, self.out = nn.Embedding(20,
                                                          16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)
    def forward(self, toks):
        h, pad = self.emb(toks), (toks == 0)[:, None, :]
        s = self.q(h) @ self.k(h).transpose(1, 2) / 4
        s = s.masked_fill(pad, torch.finfo(s.dtype).min if self.fill == 'dtype' else self.fill)
        return self.out((s.softmax(-1) @ h).mean(1))

def attention_learner(fill):
    g = torch.Generator().manual_seed(0)
    # every 8th sequence is all padding
    toks = torch.randint(1, 20, (256, 8), generator=g); toks[::8] = 0
    y = (toks == 3).float().sum(1, keepdim=True)
    dls = DataLoaders(DataLoader(TensorDataset(toks[:192], y[:192]), bs=32),
                      DataLoader(TensorDataset(toks[192:], y[192:]), bs=32))
    torch.manual_seed(0)
    learn = Learner(dls, MaskedAttention(fill), loss_func=nn.MSELoss(), opt_func=Adam, lr=1e-2)
    learn.logger = lambda *a, **k: None
    return learn

@pytest.mark.parametrize("precision,fill", [("fp16", -1e9), ("bf16", torch.finfo(torch.float32).min)])
def test_a_mask_constant_beyond_the_half_range_names_the_module_and_the_fix(precision, fill):
    learn = getattr(attention_learner(fill), f"to_{precision}")()
    with pytest.raises(RuntimeError, match="without overflow") as e: learn.fit(1)
    note = "".join(getattr(e.value, '__notes__', []))
    assert "MaskedAttention" in note and "torch.finfo(x.dtype).min" in note

def test_a_mask_filled_from_the_scores_dtype_trains_in_fp16_as_in_fp32():
    "A fully masked row stays finite (a uniform softmax, as in fp32), and the run ends where fp32's does"
    ref, half = attention_learner('dtype'), attention_learner('dtype').to_fp16()
    for l in (ref, half): l.fit(2)
    assert half.mixed_precision.scaler.n_skipped < 10 and all(
        r.reason in (None, 'overflow') for r in half.mixed_precision.history)
    assert abs(half.recorder.values[-1][1] - ref.recorder.values[-1][1]) < 0.02 * ref.recorder.values[-1][1]


# ---------------------------------------------------------------- which op overflowed: watch_overflow, and the
# callback's own use of it

from mixedprec.convert import watch_overflow, convert_model

class NaiveRMSNorm(nn.Module):
    "Squares its input in the input's dtype: activations of a few hundred overflow fp16"
    def __init__(self, d): super().__init__(); self.weight = nn.Parameter(torch.ones(d))
    def forward(self, x): return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

def rms_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), NaiveRMSNorm(8), nn.Linear(8, 1))

@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
def test_watch_overflow_names_the_first_op_its_module_and_its_inputs(dtype):
    model, x = rms_model(), torch.randn(16, 8) * 300
    ref = model(x)
    if dtype is not None: convert_model(model, dtype, cast_io=True)
    with watch_overflow(model) as watch: out = model(x)
    if dtype != torch.float16:
        assert watch.first is None; return                       # fp32 and bf16 hold the squares
    assert (watch.first.op, watch.first.module, watch.first.kind, watch.first.dtype,
            watch.first.result) == ('pow', '1', 'NaiveRMSNorm', torch.float16, 'inf')
    # silently wrong
    assert 300 < watch.first.input_absmax < 65504 and torch.isfinite(
        out).all() and not torch.allclose(out, ref, atol=0.05)

def test_watch_overflow_reports_where_it_began_not_what_it_reached():
    "The ops after the first take inf and pass it on: they are not the news"
    class Chain(nn.Module):
        def forward(self, x): return (torch.exp(x * 20) * 2).sum() + 1
    model, x = Chain(), torch.ones(4, dtype=torch.float16)
    with watch_overflow(model) as watch: model(x)
    assert watch.first.op == 'exp' and watch.first.module == '' and "the model (Chain)" in str(watch.first)

def test_watch_overflow_raises_inside_forward_and_leaves_no_trace():
    model, x = rms_model().half(), (torch.randn(4, 8) * 300).half()
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    with pytest.raises(FloatingPointError, match=r"pow in `1` \(NaiveRMSNorm\).*keep_fp32=NaiveRMSNorm") as e:
        with watch_overflow(model, raise_at_first=True): model(x)
    assert any(
        f.name == 'forward' and 'test_diagnostics' in f.filename for f in __import__(
            'traceback').extract_tb(e.value.__traceback__))
    assert hooks == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    with watch_overflow(model) as watch:
        y = torch.full((2,), 1e4, dtype=torch.float16) * 10            # outside the model's forward: not watched
        model(x[:, :0].new_zeros(4, 8)).sum().backward()               # nor its backward
    assert watch.first is None

def test_a_fastai_run_stopped_by_non_finite_losses_names_the_op_and_keeps_its_buffers():
    class Exp(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)
        def forward(self, x): return self.out(torch.exp(self.bn(self.lin(x)) * 8))
    learn = synth_learner(model=Exp()).to_fp16(max_bad_loss=3)
    with pytest.raises(ScalingError, match=r"overflowed first at exp in the model \(Exp\): inf from finite float16 "
                                           r"inputs.*keep_fp32=Exp"):
        learn.fit(1)
    mp, xb = learn.mixed_precision, (torch.randn(32, 8),)
    # as in a training step: batchnorm updates its statistics
    learn.model.train()
    stats = [b.clone() for b in learn.model.buffers()]
    from mixedprec.callback import _forward_overflow
    assert "exp in the model (Exp)" in _forward_overflow(learn.model, xb)
    # the diagnosis ran the forward in train mode, and put the statistics back
    assert all(torch.equal(a, b) for a, b in zip(stats, learn.model.buffers()))

def test_watch_overflow_sees_an_in_place_op_overflow_its_own_input():
    class InPlace(nn.Module):
        def __init__(self): super().__init__(); self.lin = nn.Linear(4, 4)
        def forward(self, x): return self.lin(x).mul_(1e5).sum()
    model = InPlace().half()
    with watch_overflow(model) as watch: model(torch.ones(2, 4, dtype=torch.float16))
    assert watch.first.op == 'mul_' and watch.first.input_absmax < 65504

def test_watch_overflow_takes_an_inf_asked_for_as_meant():
    "A causal mask filled with -inf, and torch's MultiheadAttention's own, are not overflows"
    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.mha = nn.Linear(8, 8), nn.MultiheadAttention(8, 2, batch_first=True)
        def forward(self, x):
            causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            s = (self.q(x) @ x.transpose(1, 2)).masked_fill(causal, float('-inf')).softmax(-1)
            return self.mha(s @ x, x, x, attn_mask=causal)[0]
    model = Causal(); convert_model(model, torch.float16, cast_io=True)
    with watch_overflow(model) as watch: out = model(torch.randn(2, 5, 8))
    assert watch.first is None and torch.isfinite(out).all()
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2, enable_nested_tensor=False)
    convert_model(enc, torch.float16, cast_io=True)
    pad = torch.zeros(3, 7, dtype=torch.bool); pad[0, 4:] = True
    # uninitialised memory (`empty_like` inside torch's attention) is not news either
    with watch_overflow(enc) as watch:
        enc(torch.randn(3, 7, 32), src_key_padding_mask=pad)
        enc(torch.randn(3, 7, 32), mask=nn.Transformer.generate_square_subsequent_mask(7), is_causal=True)
    assert watch.first is None


def test_overflow_names_kept_before_the_grads_are_zeroed():
    # a decision made on the device is read by the books later: where the grads are zeroed in place first (fastai's
    # zero_grad), the names are frozen (each grad's largest magnitude, on the device) and still name the param after
    from mixedprec.engine import OverflowNames
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level='O2', verbosity=0)
    held = amp._state.engine.held
    grads = [(p, torch.zeros(p.shape)) for p in model.parameters()]
    grads[2][1][0, 1], grads[1][1][0] = float('inf'), float('nan')
    names = OverflowNames(held, [grads])
    names.freeze()
    for _, g in grads: g.zero_()
    assert names() == ['0.bias (nan)', '1.weight (inf)']
    assert OverflowNames(held, [grads])() == []                     # unfrozen names look at the grads as they are now

def _classifier(loss_times:float, seed:int=0):
    "A 4-class MLP Learner (Adam, 33 batches an epoch) whose loss is cross-entropy times `loss_times`"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 16, generator=g); y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x[:1056], y[:1056]), bs=32, shuffle=True),
                      DataLoader(TensorDataset(x[1056:], y[1056:]), bs=64))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    learn = Learner(dls, model, loss_func=lambda p, t: nn.functional.cross_entropy(p, t) * loss_times, opt_func=Adam,
                    lr=1e-3)
    quiet(learn)
    return learn

def test_a_short_fit_that_skips_most_steps_at_the_floor_stops_saying_what_to_do():
    # the loss times 5e5: at fp16's default floor (scale 1) the grads overflow on and off, and 118 of 132 steps were
    # skipped without a word (fp32: accuracy 0.81, fp16: 0.31). Judged after 32 steps past the scale's first search
    learn = _classifier(5e5).to_fp16()
    with pytest.raises(ScalingError, match=r"at the minimum loss scale 1 \(on and off.*lower `min_scale`"): learn.fit(4)
    sc = learn.mixed_precision.scaler
    first_clean = next(r.step for r in sc.history if not r.skipped)
    # judged 32 steps after the first clean one, in the fit
    assert sc.n_steps - first_clean < 32 < 132 - sc.n_steps
    # what the error says: the loss is beyond fp16 at scale 1
    learn = _classifier(5e5).to_fp16(min_scale=2.**-8)
    learn.fit(4)
    assert learn.mixed_precision.scaler.n_skipped < 30

def test_a_high_share_of_skips_above_the_floor_warns_within_a_short_fit():
    model = mlp().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), static_loss_scale=8., verbose=False)
    x = torch.randn(16, 8).half()
    with pytest.warns(UserWarning, match=r"50% of the last 32 optimizer steps were skipped"):
        for i in range(40):
            opt.zero_grad(); opt.backward(model(x).float().mean(), update_master_grads=False)
            if i % 2: model[3].weight.grad[0, 0] = float('inf')
            opt.update_master_grads(); opt.step()

def test_the_first_search_for_a_scale_is_not_judged():
    # 2**24 halves until the first clean step; then none skip: no warning, though more than 25% of the first 32 skipped
    import warnings
    learn = _classifier(1.).to_fp16(loss_scale=2.**24)
    learn.model[0].weight.register_hook(lambda g: g * 2.**8)      # grads that overflow at the first scales
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)
        warnings.filterwarnings('ignore', message='.*no fp16 units.*')
        learn.fit(1)
    assert learn.mixed_precision.scaler.n_skipped > 32 * 0.25

class _NoisyBlock(nn.Module):
    "A block that makes fp32 tensors inside `forward` (no dtype given), as user code often does"
    def __init__(self): super().__init__(); self.lin = nn.Linear(8, 8)
    def forward(self, x):
        h = self.lin(x)
        return torch.relu(h) @ (torch.eye(8) + torch.zeros(8)) + 0.01 * torch.randn(h.shape)

class _NoisyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Sequential(_NoisyBlock()))
        self.out = nn.Linear(8, 1)
    def forward(self, x): return self.out(self.body(x))

@pytest.mark.parametrize("precision", ['fp16', 'bf16'])
def test_an_fp32_tensor_made_in_forward_names_the_module_and_the_fix_that_trains(precision):
    # decided (DESIGN.md): mixedprec does not run the model under autocast, which would override keep_fp32; the error
    # names the module by its path and type, and the fix it gives trains like fp32
    def learner(**kw):
        torch.manual_seed(0)
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=16), DataLoader(TensorDataset(x, y), bs=16))
        learn = Learner(dls, _NoisyNet(), loss_func=nn.MSELoss(), opt_func=Adam, lr=1e-2)
        quiet(learn)
        return getattr(learn, f'to_{precision}')(**kw) if precision else learn
    with pytest.raises(RuntimeError, match="same dtype") as e: learner().fit(1)
    note = ' '.join(getattr(e.value, '__notes__', []))
    assert "`body.1.0` (_NoisyBlock)" in note and "keep_fp32=_NoisyBlock" in note and "dtype=h.dtype" in note
    learn = learner(keep_fp32=_NoisyBlock)
    learn.fit(3)
    assert learn.model.body[1][0].lin.weight.dtype == torch.float32 and learn.model.out.weight.dtype != torch.float32
    assert learn.recorder.values[-1][1] < learn.recorder.values[0][1]

def test_a_steps_names_keep_each_grads_peak_not_the_grad_past_zero_grad(monkeypatch):
    ("On a GPU a step's books wait for the device: what names its overflowed params keeps each grad's largest magnitude "
     "from `zero_grad` on, not the grads (fp32 master grads made for one step, by split masters, lived into the next)")
    import gc, weakref
    from mixedprec.engine import StepReasons
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).bfloat16()
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters()), verbose=False, masters='split', static_loss_scale=8.)
    model[1].weight.register_hook(lambda g: g * float('inf'))
    opt.backward(model(torch.randn(5, 4).bfloat16()).float().sum())
    e = opt.engine
    reasons = e.reasons.setdefault(opt.scaler, StepReasons())
    reasons.note(99, e.held, [e.masters.grads.unscaled()], True, None)   # what a GPU's step, not yet booked, holds
    names = reasons.steps[99][1]
    grads = [weakref.ref(g) for _, g in names.grads[0]]
    opt.step(); opt.zero_grad(); gc.collect()              # set_to_none (torch's default): the grads are dropped
    assert names.frozen is not None and all(r() is None for r in grads)
    assert [n.split(' (')[0] for n in names()] == ['(2, 3)']       # named, after its grad is gone
    assert reasons.why(99, 1) == ('overflow', tuple(names()))     # as the books will ask when they take it in
