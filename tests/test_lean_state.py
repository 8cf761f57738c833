"""Lean optimizer state (issue 34, part 1): the moments of SGD and Adam/AdamW kept in bf16, rounded stochastically at each
step, by the C++ kernels and the references alike (the CUDA kernels' code: test_cuda_emulation.py), under every front end,
through checkpoints, and against the same run with fp32 state."""
from functools import partial
import pytest, torch
from torch import nn
from fastai.optimizer import Adam, SGD, RAdam
from mixedprec.callback import MixedPrecision
from mixedprec import ops, amp
from mixedprec.fp16_optimizer import FP16_Optimizer
from helpers import synth_learner, mlp

def bits(t): return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

def assert_same(a, b):
    "Bit for bit: as many tensors, each of the same dtype, layout and bits (bf16 compared as its raw bits)"
    assert len(a) == len(b)
    for x, y in zip(a, b): assert x.dtype == y.dtype and x.stride() == y.stride() and torch.equal(bits(x), bits(y))

# the CPU kernels' block (1024) and chunk (65536) edges
SIZES = [[1, 3, 17], [1023, 1024, 1025], [(1 << 16) + 5, 2048 + 1]]

def lists(sizes, store, seed, channels_last=False):
    "Masters (fp32 with a half copy, or bf16 split or rounded), bf16 moments and (half) grads"
    g = torch.Generator().manual_seed(seed)
    shape = lambda n: (n, 1, 1, 1) if channels_last else (n,)
    rnd = lambda n, s=1.: (torch.randn(shape(n), generator=g) * s).contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    params = [rnd(n) for n in sizes]
    kw, out = {}, []
    if store == 'fp32': out = [p.half() for p in params]
    else:
        masters = params
        params = [m.bfloat16() for m in masters]
        if store == 'split':
            kw['lows'] = []
            for p, m in zip(params, masters):
                hi, lo = ops.split_bf16_ref(m); p.copy_(hi); kw['lows'].append(lo.contiguous(memory_format=torch.channels_last) if channels_last else lo)
        else: kw['seeds'] = [77 + i for i in range(len(sizes))]
    m = [rnd(n, 0.1).bfloat16() for n in sizes]
    v = [rnd(n, 0.01).abs().bfloat16() for n in sizes]
    grads = [[rnd(n, 512.).half() for n in sizes] for _ in range(3)]
    return params, out, kw, m, v, grads

@pytest.mark.parametrize("sizes,channels_last", [(0, False), (1, False), (2, False), (1, True)])
@pytest.mark.parametrize("store", ['fp32', 'split', 'none'])
@pytest.mark.parametrize("kind", ['sgd', 'adam'])
def test_cpu_kernels_equal_the_reference_bit_for_bit(sizes, store, kind, channels_last):
    runs = []
    for impl in ('ref', 'fused'):
        params, out, kw, m, v, grads = lists(SIZES[sizes], store, seed=3, channels_last=channels_last)
        steps = [torch.tensor([float(k)]) for k in range(len(params))]
        for i, g in enumerate(grads):
            # the middle step is skipped: nothing changes
            found = torch.tensor(i == 1)
            seeds = [(1000 * i + k, 2000 * i + k) for k in range(len(params))]
            if kind == 'sgd':
                ops.sgd_step_(g, params, m, out, found, 1 / 512, 0.1, 0.9, 0., 1e-2, False,
                              state_seeds=[s[:1] for s in seeds], impl=impl, **kw)
            else:
                ops.adam_step_(g, params, m, v, out, found, steps, 1 / 512, 1e-2, 0.9, 0.999, 1e-8, 0.1, True,
                               state_seeds=seeds, impl=impl, **kw)
        runs.append([*params, *out, *kw.get('lows', []), *m, *v, *steps])
    assert_same(*runs)

def test_a_skipped_step_changes_no_state():
    params, out, kw, m, v, grads = lists([1025, 7], 'split', seed=4)
    before = [t.clone() for t in [*params, *kw['lows'], *m, *v]]
    steps = [torch.tensor([3.]) for _ in params]
    for impl in ('ref', 'fused'):
        ops.adam_step_(grads[0], params, m, v, out, torch.tensor(True), steps, 1., 1e-2, state_seeds=[(1, 2), (3, 4)],
                       impl=impl, **kw)
    assert_same(before, [*params, *kw['lows'], *m, *v]) and all(s.item() == 3. for s in steps)

@pytest.mark.parametrize("impl", ['ref', 'fused'])
def test_stochastic_rounding_keeps_a_slow_average_moving(impl):
    ("An EMA whose steps are smaller than half a bf16 ulp: rounded to nearest it stalls near 0.8; rounded "
     "stochastically it tracks fp32")
    n, steps, beta = 4096, 400, 0.99
    ema_sr = [torch.zeros(n, dtype=torch.bfloat16)]
    ema_rn, ema_32 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)
    p, g = [torch.zeros(n)], [torch.ones(n)]
    for t in range(steps):
        # m = 0.99 m + 0.01 g
        ops.sgd_step_(g, p, ema_sr, [], torch.tensor(False), 1., 0., beta, beta, 0., False, state_seeds=[(t,)],
                      impl=impl)
        ema_rn = (ema_rn.float() * beta + (1 - beta)).bfloat16()
        ema_32 = ema_32 * beta + (1 - beta)
    exact = 1 - beta ** steps
    assert ema_32.mean().item() == pytest.approx(exact, abs=1e-4)
    assert abs(ema_sr[0].float().mean().item() - exact) < 0.005        # unbiased: the mean over elements follows fp32
    assert ema_rn.float().mean().item() < exact - 0.15                  # round-to-nearest stalls far below

def test_the_rounding_streams_are_reproducible_and_differ_by_seed():
    def run(seed):
        params, out, kw, m, v, grads = lists([3000], 'fp32', seed=5)
        ops.adam_step_(grads[0], params, m, v, out, torch.tensor(False), [torch.tensor([0.])], 1 / 512, 1e-2,
                       state_seeds=[(seed, seed + 1)])
        return m[0], v[0]
    a, b, c = run(10), run(10), run(11)
    assert_same(a, b)
    assert not torch.equal(bits(a[0]), bits(c[0]))

def test_bad_lean_state_input_says_what_to_do():
    params, out, kw, m, v, grads = lists([8], 'fp32', seed=6)
    for impl in ('ref', 'fused'):
        with pytest.raises(ValueError, match="state_seeds"):
            ops.adam_step_(grads[0], params, m, v, out, torch.tensor(False), [torch.tensor([0.])], 1., 1e-2, impl=impl)
        with pytest.raises(ValueError, match="all fp32, all bf16 or all 8-bit"):
            ops.adam_step_(grads[0], params, m, [t.float() for t in v], out, torch.tensor(False),
                           [torch.tensor([0.])], 1., 1e-2,
                           state_seeds=[(1, 2)], impl=impl)
    with pytest.raises(ValueError, match=r"state must be one of \('fp32', 'bf16', '8bit'\)"):
        synth_learner().to_bf16(state='4bit')
    with pytest.raises(ValueError, match="flat_master=False"): synth_learner().to_bf16(state='bf16', flat_master=True)
    model = mlp().bfloat16()
    with pytest.raises(ValueError, match="RMSprop.*state='fp32'"):
        FP16_Optimizer(torch.optim.RMSprop(model.parameters(), lr=1e-3), state='bf16', verbose=False)
    # refused before anything changed
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())

def test_an_optimizer_lean_state_cannot_use_leaves_the_model_as_it_was():
    ("amp refuses before converting; fastai's to_bf16 gives the Learner back in fp32, without the callback, and it "
     "trains")
    model = mlp()
    with pytest.raises(ValueError, match="RMSprop.*state='fp32'"):
        amp.initialize(model, torch.optim.RMSprop(model.parameters(), lr=1e-3), opt_level='O2', half_dtype='bf16',
                       state='bf16', verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    learn = synth_learner(opt_func=RAdam, lr=1e-3)
    with pytest.raises(ValueError, match="RAdam.*state='fp32'|Optimizer.*state='fp32'"): learn.to_bf16(state='bf16')
    assert all(p.dtype == torch.float32 for p in learn.model.parameters()) and not any(isinstance(c, MixedPrecision) for c in learn.cbs)
    learn.fit(1)
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())

def state_tensors(opt):
    return [v for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0]

def data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g)

def train_fp16_optimizer(state, opt_cls, steps=60, store='split', resume_at=None, tmp_path=None):
    torch.manual_seed(0)
    model = mlp().bfloat16()
    make = lambda m: FP16_Optimizer(opt_cls(m.parameters(), lr=1e-2), masters=store, state=state, verbose=False)
    opt, (x, y) = make(model), data()
    for i in range(steps):
        if i == resume_at:
            torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, tmp_path / 'ck.pt')
            torch.manual_seed(123)
            model = mlp().bfloat16(); opt = make(model)
            ck = torch.load(tmp_path / 'ck.pt', weights_only=False)
            model.load_state_dict(ck['model']); opt.load_state_dict(ck['opt'])
        model.train()
        xb, yb = x[i % 8 * 32:(i % 8 + 1) * 32], y[i % 8 * 32:(i % 8 + 1) * 32]
        opt.backward(nn.functional.mse_loss(model(xb.bfloat16()).float(), yb)); opt.step(); opt.zero_grad()
    model.eval()
    with torch.no_grad(): return nn.functional.mse_loss(model(x.bfloat16()).float(), y).item(), opt, model

@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)],
                         ids=['adamw', 'sgd'])
def test_fp16_optimizer_keeps_bf16_state_and_trains_as_with_fp32_state(opt_cls):
    lean, opt, _ = train_fp16_optimizer('bf16', opt_cls)
    full, full_opt, _ = train_fp16_optimizer('fp32', opt_cls)
    assert {
        t.dtype for t in state_tensors(
            opt)} == {torch.bfloat16} and {t.dtype for t in state_tensors(full_opt)} == {torch.float32}
    # half the state's bytes
    assert sum(t.nbytes for t in state_tensors(opt)) * 2 == sum(t.nbytes for t in state_tensors(full_opt))
    assert lean == pytest.approx(full, rel=0.05)

def test_fp16_optimizer_bf16_state_resumes_bit_exact(tmp_path):
    _, _, straight = train_fp16_optimizer('bf16', torch.optim.AdamW, steps=20)
    _, opt, resumed = train_fp16_optimizer('bf16', torch.optim.AdamW, steps=20, resume_at=10, tmp_path=tmp_path)
    assert {t.dtype for t in state_tensors(opt)} == {torch.bfloat16}
    assert_same(list(straight.parameters()), list(resumed.parameters()))

def train_amp(state, opt_level, steps=40):
    ("An MLP trained under amp at `opt_level` in bf16 with Adam's moments kept as `state` says: its final loss, and "
     "its optimizer")
    torch.manual_seed(0)
    model = mlp(); opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, half_dtype='bf16', verbosity=0, state=state)
    x, y = data()
    for i in range(steps):
        with amp.scale_loss(nn.functional.mse_loss(model(x[:64]), y[:64]), opt) as s: s.backward()
        opt.step(); opt.zero_grad()
    return nn.functional.mse_loss(model(x), y).item(), opt

@pytest.mark.parametrize("opt_level", ['O1', 'O2'])
def test_amp_keeps_bf16_state(opt_level):
    (full, full_opt), (lean, opt) = train_amp('fp32', opt_level), train_amp('bf16', opt_level)
    assert {
        t.dtype for t in state_tensors(
            full_opt)} == {torch.float32} and {t.dtype for t in state_tensors(opt)} == {torch.bfloat16}
    assert lean == pytest.approx(full, rel=0.05)

@pytest.mark.parametrize("opt_func", [Adam, partial(SGD, mom=0.9)], ids=['adam', 'sgd'])
def test_fastai_bf16_state_trains_saves_and_loads(opt_func, tmp_path):
    kw = dict(lr=1e-2, path=tmp_path)
    losses = {}
    for state in ('fp32', 'bf16'):
        learn = synth_learner(opt_func=opt_func, **kw).to_bf16(masters='split', state=state)
        learn.fit(3)
        losses[state] = learn.validate()[0]
        kinds = {t.dtype for t in state_tensors(learn.opt)}
        assert kinds == ({torch.bfloat16} if state == 'bf16' else {torch.float32})
    assert losses['bf16'] == pytest.approx(losses['fp32'], rel=0.05)
    learn.save('lean')
    sd = torch.load(tmp_path / 'models' / 'lean.pth', weights_only=False)
    assert {
        v.dtype for s in sd[
            'opt']['state'] for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0} == {torch.bfloat16}
    other = synth_learner(opt_func=opt_func, **kw).to_bf16(masters='split', state='bf16')
    other.load('lean')
    other.fit(1); learn.fit(1)
    assert_same(list(other.model.parameters()), list(learn.model.parameters()))
