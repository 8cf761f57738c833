"""Lean optimizer state, 8-bit (issue 34): the moments of SGD and Adam/AdamW kept as 8-bit codes with one power-of-two
scale per 256 elements (csrc/state8_bits.h), decoded, updated and encoded again (rounded stochastically) in the kernels'
one pass. The code against the reference, bit for bit (the CUDA kernels' code: test_cuda_emulation.py); the code itself
(round trips, unbiased rounding, the second moment kept positive); the front ends, checkpoints and the layouts; and a
long run against fp32 masters with fp32 state."""
from functools import partial
import pytest, torch
from torch import nn
from fastai.optimizer import Adam, SGD
from mixedprec import ops, amp
from mixedprec.ops import quantize8_ref, dequantize8_ref, Q_BLOCK
from mixedprec.master import CheckpointError, _mix
from mixedprec.state import SCALES
from mixedprec.fp16_optimizer import FP16_Optimizer
from helpers import synth_learner, mlp
from test_lean_state import data, state_tensors, train_fp16_optimizer, train_amp, assert_same

def spread(n, seed, scale=1., signed=True, decades=6):
    "Values over `decades` orders of magnitude, shuffled, as a moment's are within a block"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale * torch.logspace(-decades, 0, n)[torch.randperm(n, generator=g)]
    return x if signed else x.abs()

# The code

@pytest.mark.parametrize("signed", [True, False])
def test_decoding_an_encoding_is_within_a_sixteenth_and_exact_on_the_codes(signed):
    x = spread(5000, 1, signed=signed)
    codes, scales = quantize8_ref(x, None, signed)
    assert codes.dtype == (torch.int8 if signed else torch.uint8) and scales.shape == (-(-5000 // Q_BLOCK),)
    # powers of two
    assert all(float(s).is_integer() or (s > 0 and torch.log2(s).item().is_integer()) for s in scales)
    y = dequantize8_ref(codes, scales)
    block_scale = scales.repeat_interleave(Q_BLOCK)[:5000]
    normal = x.abs() >= block_scale * 2.0 ** (-14 if signed else -30)          # the code's normal range
    assert ((y - x).abs() <= x.abs() / 16)[normal].all()                          # 3 mantissa bits, rounded to nearest
    # gradual underflow
    assert ((y - x).abs() <= block_scale * 2.0 ** (-18 if signed else -34)).logical_or(normal).all()
    assert (y.abs() <= block_scale).all() and (torch.sign(y) * torch.sign(x) >= 0).all()
    # a decoded value is a code: any rounding keeps it, but for the smallest when the
    codes2, scales2 = quantize8_ref(y, 5, signed)
    # block's largest rounded up to the scale,
    kept = y.abs() >= scales2.repeat_interleave(Q_BLOCK)[:5000] * 2.0 ** (-14 if signed else -30)
    # and its scale doubles
    assert torch.equal(dequantize8_ref(codes2, scales2)[kept], y[kept]) and kept.float().mean() > 0.5

def test_a_positive_second_moment_never_decodes_to_zero():
    v = torch.tensor([1.0, 1e-12, 1e-30, 0.0] + [1e-3] * 300)
    for seed in (None, 1, 2):
        y = dequantize8_ref(*quantize8_ref(v, seed, signed=False))
        # so no denominator sqrt(v) + eps falls to eps where the moment is not 0
        assert (y[v > 0] > 0).all() and y[3] == 0

def test_zero_and_diverged_blocks():
    z, s = quantize8_ref(torch.zeros(300), 1)
    assert s.eq(0).all() and z.eq(0).all() and dequantize8_ref(z, s).eq(0).all()
    tiny, s = quantize8_ref(torch.full((10,), 1e-30), 1)                          # below 2^-80 of nothing: zero
    assert s.eq(0).all()
    x = torch.ones(600); x[300] = float('inf')
    y = dequantize8_ref(*quantize8_ref(x, 1))
    # a diverged block stays loud; the others are kept
    assert y[256:512].isnan().all() and y[:256].eq(1).all() and y[512:].eq(1).all()

def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = spread(2048, 2, decades=3)
    draws = torch.stack([dequantize8_ref(*quantize8_ref(x, seed)) for seed in range(400)])
    # a code step is at most an eighth of the value
    ulp = x.abs() / 8
    # within 4 standard errors
    assert ((draws.mean(0) - x).abs() <= 4 * ulp / 400 ** 0.5 + 1e-12).float().mean() > 0.99
    assert_same(quantize8_ref(x, 7), quantize8_ref(x, 7))
    assert not torch.equal(quantize8_ref(x, 7)[0], quantize8_ref(x, 8)[0])

def test_codes_are_numbered_in_memory_order_as_the_kernels_read_them():
    x = spread(4 * 300 * 3 * 3, 3).reshape(4, 300, 3, 3).contiguous(memory_format=torch.channels_last)
    codes, scales = quantize8_ref(x, 9)
    assert codes.stride() == x.stride()
    flat_codes, flat_scales = quantize8_ref(x.permute(0, 2, 3, 1).reshape(-1), 9)
    assert torch.equal(codes.permute(0, 2, 3, 1).reshape(-1), flat_codes) and torch.equal(scales, flat_scales)

# The kernels

# the scale block (256), the CPU kernels' block (1024) and chunk (65536)
SIZES = [[1, 3, 255, 256, 257], [1023, 1024, 1025], [(1 << 16) + 5, 2048 + 1]]

def lists(sizes, store, seed, channels_last=False):
    "Masters (fp32 with a half copy, or bf16 split or rounded), 8-bit moments with their scales, and (half) grads"
    g = torch.Generator().manual_seed(seed)
    shape = lambda n: (n, 1, 1, 1) if channels_last else (n,)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    rnd = lambda n, s=1.: (torch.randn(shape(n), generator=g) * s).contiguous(memory_format=fmt)
    params = [rnd(n) for n in sizes]
    kw, out = {}, []
    if store == 'fp32': out = [p.half() for p in params]
    else:
        masters, params = params, [p.bfloat16() for p in params]
        if store == 'split':
            kw['lows'] = []
            for p, m in zip(params, masters):
                hi, lo = ops.split_bf16_ref(m); p.copy_(hi); kw['lows'].append(lo.contiguous(memory_format=fmt))
        else: kw['seeds'] = [77 + i for i in range(len(sizes))]
    m, v = [quantize8_ref(spread(n, seed + i, 0.1).reshape(shape(n)).contiguous(memory_format=fmt), None) for i,
            n in enumerate(sizes)], \
           [quantize8_ref(spread(n, seed + 50 + i, 0.01, False).reshape(shape(n)).contiguous(memory_format=fmt), None,
                          False) for i, n in enumerate(sizes)]
    grads = [[rnd(n, 512.).half() for n in sizes] for _ in range(3)]
    return params, out, kw, [c for c, _ in m], [s for _, s in m], [c for c, _ in v], [s for _, s in v], grads

@pytest.mark.parametrize("sizes,channels_last", [(0, False), (1, False), (2, False), (1, True)])
@pytest.mark.parametrize("store", ['fp32', 'split', 'none'])
@pytest.mark.parametrize("kind", ['sgd', 'adam'])
def test_cpu_kernels_equal_the_reference_bit_for_bit(sizes, store, kind, channels_last):
    runs = []
    for impl in ('ref', 'fused'):
        params, out, kw, m, msc, v, vsc, grads = lists(SIZES[sizes], store, seed=3, channels_last=channels_last)
        steps = [torch.tensor([float(k)]) for k in range(len(params))]
        for i, g in enumerate(grads):
            # the middle step is skipped: nothing changes
            found = torch.tensor(i == 1)
            seeds = [(1000 * i + k, 2000 * i + k) for k in range(len(params))]
            if kind == 'sgd':
                ops.sgd_step_(g, params, m, out, found, 1 / 512, 0.1, 0.9, 0., 1e-2, False, first_run=i == 0,
                              state_seeds=[s[:1] for s in seeds],
                              state_scales=[msc], impl=impl, **kw)
            else:
                ops.adam_step_(g, params, m, v, out, found, steps, 1 / 512, 1e-2, 0.9, 0.999, 1e-8, 0.1, True,
                               state_seeds=seeds,
                               state_scales=[msc, vsc], impl=impl, **kw)
        runs.append([*params, *out, *kw.get('lows', []), *m, *msc, *v, *vsc, *steps])
    assert_same(*runs)

def edge_values(n_blocks, seed):
    ("Blocks of 256 values at every magnitude a code can take and below it: signed zeros, fp32 subnormals, each power "
     "of two down to 2^-149 with random mantissas, and blocks whose largest magnitude sits at the zero-block edge")
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for b in range(n_blocks):
        top = [0., -24., -79., -81., 60.][b % 5]                   # the block's largest magnitude, as a power of two
        wide = torch.rand(Q_BLOCK, generator=g) < 0.25                # most within the codes' 2^-33, some far below
        e = top - torch.where(wide, torch.randint(0, 170, (Q_BLOCK,), generator=g),
                              torch.randint(0, 36, (Q_BLOCK,), generator=g)).float()
        x = (1 + torch.rand(Q_BLOCK, generator=g)) * torch.exp2(e.clamp(min=-149))
        x = x * torch.where(torch.rand(Q_BLOCK, generator=g) < 0.5, -1., 1.)
        x[:4] = torch.tensor([0., -0., 1e-45, -1e-40])
        x[4] = 2. ** top
        blocks.append(x)
    return torch.cat(blocks)

def test_the_kernels_encode_values_of_every_magnitude_as_the_reference():
    ("Adam with betas (0, 0) from zero state encodes the grad (m) and its square (v): every code, the gradual "
     "underflow, fp32 subnormals and zeros, blocks at the zero-block edge, the codes and scales bit for bit")
    runs = []
    for impl in ('ref', 'fused'):
        grads = [edge_values(10, 0), edge_values(7, 1)[:1500]]
        params = [torch.zeros_like(g) for g in grads]
        m = [quantize8_ref(torch.zeros_like(g), None) for g in grads]
        v = [quantize8_ref(torch.zeros_like(g), None, False) for g in grads]
        mc, msc, vc, vsc = [c for c, _ in m], [s for _, s in m], [c for c, _ in v], [s for _, s in v]
        ops.adam_step_(grads, params, mc, vc, [], torch.tensor(False), torch.tensor([0.]), 1., 0., 0., 0., 1e-8,
                       0., True, state_seeds=[(5, 6), (7, 8)], state_scales=[msc, vsc], impl=impl)
        runs.append([*mc, *msc, *vc, *vsc])
    assert_same(*runs)
    assert len(set(runs[0][0].tolist())) > 200 and len(set(runs[0][4].tolist())) > 200   # most codes were hit

@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_kernels_equal_the_reference_on_fuzzed_sizes(seed):
    ("Sizes drawn around the edges that matter: a scale block, the CPU kernels' 1024-element buffers and "
     "65536-element chunks")
    import random
    r = random.Random(seed)
    sizes = [r.choice([r.randint(1, 700), 1024 * r.randint(1, 4) + r.randint(-300, 300),
                       (1 << 16) + r.randint(-600, 600)]) for _ in range(8)]
    runs = []
    for impl in ('ref', 'fused'):
        params, out, kw, m, msc, v, vsc, grads = lists(
            sizes, r.choice(['fp32', 'split', 'none']) if impl == 'ref' else store, seed=seed)
        store = 'split' if 'lows' in kw else 'none' if 'seeds' in kw else 'fp32'
        steps = [torch.tensor([float(k)]) for k in range(len(params))]
        for i, g in enumerate(grads[:2]):
            ops.adam_step_(g, params, m, v, out, torch.tensor(False), steps, 1 / 512, 1e-2, 0.9, 0.999, 1e-8, 0.1, True,
                           state_seeds=[(7 * i + k, 11 * i + k) for k in range(len(params))], state_scales=[msc, vsc],
                               impl=impl, **kw)
        runs.append([*params, *out, *kw.get('lows', []), *m, *msc, *v, *vsc])
    assert_same(*runs)

def test_a_skipped_step_changes_no_state():
    params, out, kw, m, msc, v, vsc, grads = lists([1025, 7], 'split', seed=4)
    before = [t.clone() for t in [*params, *kw['lows'], *m, *msc, *v, *vsc]]
    steps = [torch.tensor([3.]) for _ in params]
    for impl in ('ref', 'fused'):
        ops.adam_step_(grads[0], params, m, v, out, torch.tensor(True), steps, 1., 1e-2, state_seeds=[(1, 2), (3, 4)],
                       state_scales=[msc, vsc],
                       impl=impl, **kw)
    assert_same(before, [*params, *kw['lows'], *m, *msc, *v, *vsc]) and all(s.item() == 3. for s in steps)

@pytest.mark.parametrize("impl", ['ref', 'fused'])
def test_stochastic_rounding_keeps_a_slow_average_moving(impl):
    ("An EMA at beta=0.999, as Adam's second moment: each step is 0.1% of the value, far below a code step (6-12%); "
     "rounded to nearest it never moves off its start, rounded stochastically it tracks fp32")
    n, steps, beta = 4096, 600, 0.999
    start = torch.full((n,), 1.0)
    codes, scales = quantize8_ref(start, None)
    p, g = [torch.zeros(n)], [torch.full((n,), 2.0)]
    ema_32, rn = start.clone(), quantize8_ref(start, None)
    for t in range(steps):
        ops.sgd_step_(g, p, [codes], [], torch.tensor(False), 1., 0., beta, beta, 0., False, state_seeds=[(_mix(t),)],
                      state_scales=[[scales]],
                      impl=impl)   # seeds mixed as the engine mixes them
        ema_32 = ema_32 * beta + (1 - beta) * 2.0
        rn = quantize8_ref(dequantize8_ref(*rn) * beta + (1 - beta) * 2.0, None)
    exact = 2.0 - beta ** steps
    assert ema_32.mean().item() == pytest.approx(exact, abs=1e-4)
    # unbiased: the mean over elements follows fp32 (to 5 standard errors)
    assert abs(dequantize8_ref(codes, scales).mean().item() - exact) < 0.015
    assert dequantize8_ref(*rn).mean().item() == 1.0                              # round-to-nearest stagnates

def test_bad_8bit_input_says_what_to_do():
    params, out, kw, m, msc, v, vsc, grads = lists([300], 'fp32', seed=6)
    step = lambda **k: ops.adam_step_(grads[0], params, k.get('m', m), k.get('v', v), out, torch.tensor(False),
                                      [torch.tensor([0.])], 1., 1e-2,
                                      state_seeds=[(1, 2)], impl=k['impl'],
                                          **({'state_scales': k['sc']} if 'sc' in k else {}))
    for impl in ('ref', 'fused'):
        with pytest.raises(ValueError, match="state_scales"): step(impl=impl)
        with pytest.raises(ValueError, match="per 256 elements"): step(impl=impl, sc=[msc, [torch.zeros(1)]])
        with pytest.raises(ValueError, match="int8 first moments, uint8 second moments"):
            step(impl=impl, v=[c.view(torch.int8) for c in v], sc=[msc, vsc])

# The front ends

@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)],
                         ids=['adamw', 'sgd'])
def test_fp16_optimizer_keeps_8bit_state_in_a_quarter_of_the_bytes_and_trains_as_with_fp32_state(opt_cls):
    lean, opt, _ = train_fp16_optimizer('8bit', opt_cls)
    full, full_opt, _ = train_fp16_optimizer('fp32', opt_cls)
    assert {t.dtype for t in state_tensors(opt)} <= {torch.int8, torch.uint8, torch.float32}
    per_elem = lambda o, dt: sum(t.nbytes for t in state_tensors(o) if t.dtype in dt)
    codes, all_full = per_elem(opt, (torch.int8, torch.uint8)), per_elem(full_opt, (torch.float32,))
    # + a scale per 256, per block started
    assert codes * 4 == all_full and per_elem(opt, (torch.float32,)) <= codes * 4 / 256 + 8 * len(opt.state) * 4
    assert lean == pytest.approx(full, rel=0.1)

def test_fp16_optimizer_8bit_state_resumes_bit_exact(tmp_path):
    _, _, straight = train_fp16_optimizer('8bit', torch.optim.AdamW, steps=20)
    _, opt, resumed = train_fp16_optimizer('8bit', torch.optim.AdamW, steps=20, resume_at=10, tmp_path=tmp_path)
    assert torch.int8 in {t.dtype for t in state_tensors(opt)}
    assert_same(list(straight.parameters()), list(resumed.parameters()))

@pytest.mark.parametrize("opt_level", ['O1', 'O2'])
def test_amp_keeps_8bit_state(opt_level):
    (full, full_opt), (lean, opt) = train_amp('fp32', opt_level), train_amp('8bit', opt_level)
    assert {t.dtype for t in state_tensors(full_opt)} == {torch.float32}
    # codes of each moment, and their scales
    assert {t.dtype for t in state_tensors(opt)} == {torch.int8, torch.uint8, torch.float32}
    assert lean == pytest.approx(full, rel=0.1)

@pytest.mark.parametrize("opt_func", [Adam, partial(SGD, mom=0.9)], ids=['adam', 'sgd'])
def test_fastai_8bit_state_trains_saves_loads_and_leaves_as_fp32(opt_func, tmp_path):
    kw = dict(lr=1e-2, path=tmp_path)
    losses = {}
    for state in ('fp32', '8bit'):
        learn = synth_learner(opt_func=opt_func, **kw).to_bf16(masters='split', state=state)
        learn.fit(3)
        losses[state] = learn.validate()[0]
    assert losses['8bit'] == pytest.approx(losses['fp32'], rel=0.1)
    learn.save('lean')
    sd = torch.load(tmp_path / 'models' / 'lean.pth', weights_only=False)
    saved = [s for s in sd['opt']['state'] if any(k.endswith(SCALES) for k in s)]
    # the codes and scales
    assert saved and all(
        s['grad_avg'].dtype == torch.int8 and s['grad_avg' + SCALES].dtype == torch.float32 for s in saved)
    other = synth_learner(opt_func=opt_func, **kw).to_bf16(masters='split', state='8bit')
    other.load('lean')
    other.fit(1); learn.fit(1)
    assert_same(list(other.model.parameters()), list(learn.model.parameters()))       # resumed bit for bit
    # the same file into fp32 state: decoded
    fp32 = synth_learner(opt_func=opt_func, **kw).to_bf16(masters='split')
    fp32.load('lean')
    fp32.fit(1)
    assert {t.dtype for t in state_tensors(fp32.opt)} == {torch.float32}
    # fastai's own step reads fp32 moments again
    learn.to_fp32()
    assert {
        t.dtype for t in state_tensors(
            learn.opt)} == {torch.float32} and not any(k.endswith(SCALES) for s in learn.opt.state.values() for k in s)
    learn.fit(1)
    assert learn.recorder.values[-1][0] < losses['8bit'] * 2

def test_a_damaged_8bit_checkpoint_is_refused_before_anything_changes(tmp_path):
    learn = synth_learner(lr=1e-2, path=tmp_path).to_bf16(masters='split', state='8bit')
    learn.fit(1)
    learn.save('ok')
    sd = torch.load(tmp_path / 'models' / 'ok.pth', weights_only=False)
    before = [p.clone() for p in learn.model.parameters()]
    for damage, match in [(lambda s: s.update({'grad_avg' + SCALES: s['grad_avg' + SCALES][:0]}),
                           "one per 256: the file is damaged"),
                          (lambda s: s.update({'grad_avg' + SCALES: s['grad_avg' + SCALES] * float('nan')}),
                           "inf or NaN"),
                          (lambda s: s.pop('grad_avg' + SCALES), "floating point")]:
        bad = torch.load(tmp_path / 'models' / 'ok.pth', weights_only=False)
        damage(next(s for s in bad['opt']['state'] if 'grad_avg' + SCALES in s))
        torch.save(bad, tmp_path / 'models' / 'bad.pth')
        with pytest.raises(CheckpointError, match=match): learn.load('bad')
        assert_same(before, list(learn.model.parameters()))
    learn.fit(1)                                                                          # and it trains on

def test_8bit_state_follows_a_channels_last_model():
    ("A Learner that trained, then is laid out channels-last (fastai's ChannelsLast): its 8-bit state is decoded, "
     "laid out as the param, and encoded again in the new layout's blocks")
    from fastai.vision.all import Learner
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from torch.utils.data import TensorDataset
    torch.manual_seed(0)
    x, y = torch.randn(64, 3, 8, 8), torch.randint(0, 2, (64,))
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=16), DataLoader(TensorDataset(x, y), bs=16))
    model = nn.Sequential(nn.Conv2d(3, 300, 3, padding=1), nn.BatchNorm2d(300), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(300, 2))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=Adam,
                    cbs=[]); learn.logger = lambda *a, **k: None
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    learn.to_bf16(masters='split', state='8bit'); learn.fit(1, 1e-2)
    learn.to_channelslast(); learn.fit(1, 1e-2)
    w = model[0].weight
    st = learn.opt.opt.state[next(m for m in learn.opt.opt.state if m.shape == w.shape)]
    assert w.is_contiguous(
        memory_format=torch.channels_last) and st[
            'grad_avg'].dtype == torch.int8 and st['grad_avg'].stride() == w.stride()
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0] * 1.5

def test_8bit_state_over_a_long_run_stays_with_fp32_masters_and_fp32_state():
    ("Drift: 600 AdamW steps of a small regression, split masters + 8-bit state against fp32 masters + fp32 state, "
     "both on bf16 weights")
    def run(store, state):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 1)).bfloat16()
        opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01), masters=store,
                             state=state, verbose=False)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2048, 16, generator=g); y = torch.sin(x @ torch.randn(16, 1, generator=g))
        for i in range(600):
            b = torch.randint(0, 2048, (64,), generator=g)
            opt.backward(nn.functional.mse_loss(model(x[b].bfloat16()).float(), y[b])); opt.step(); opt.zero_grad()
        with torch.no_grad(): return nn.functional.mse_loss(model(x.bfloat16()).float(), y).item()
    full, lean = run('fp32', 'fp32'), run('split', '8bit')
    assert full < 0.1 and lean == pytest.approx(full, rel=0.25, abs=0.01)

@pytest.mark.parametrize("impl", ['fused', 'ref'])
def test_an_8bit_checkpoint_loads_into_amp_with_fp32_state_decoded(impl):
    ("torch's load casts every state tensor to its param's dtype (int8 codes would become floats like -45.0); the "
     "engine puts them back, decoded where it keeps fp32 state, also where the optimizer's own step runs (impl='ref')")
    def make(state):
        torch.manual_seed(0)
        model = mlp(); opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return amp.initialize(model, opt, opt_level='O2', half_dtype='bf16', verbosity=0, state=state,
                              impl=impl if state == 'fp32' else None)
    x, y = data()
    model, opt = make('8bit')
    for _ in range(5):
        with amp.scale_loss(nn.functional.mse_loss(model(x[:64]), y[:64]), opt) as s: s.backward()
        opt.step(); opt.zero_grad()
    sd = opt.state_dict()
    saved = {i: dequantize8_ref(s['exp_avg'], s['exp_avg' + SCALES]) for i, s in sd['state'].items()}
    other_model, other = make('fp32')
    other_model.load_state_dict(model.state_dict()); other.load_state_dict(sd)
    masters = amp.master_params(other)
    for i, m in enumerate(masters):
        st = other.state[m]
        assert st['exp_avg'].dtype == torch.float32 and torch.equal(st['exp_avg'], saved[i]) and not any(k.endswith(SCALES) for k in st)
    with amp.scale_loss(nn.functional.mse_loss(other_model(x[:64]), y[:64]), other) as s: s.backward()
    other.step()
    assert all(torch.isfinite(m).all() for m in amp.master_params(other))
