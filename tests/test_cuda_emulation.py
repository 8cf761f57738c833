"""The CUDA kernels' own code, run on the CPU over an emulated grid (tests/csrc/cuda_emulator.cpp), against the references:
bit for bit through aligned packs and ragged ends, views aligned alike and differently, many launches with tensors carried
over between them, every master storage mode, and a front end training on it. CI has no GPU: this is where a wrong
index in a CUDA kernel fails before it reaches one. Where there is a GPU, the same bit-exact tests also run on the real
CUDA kernels (the `cuda` parameter), views at offsets included."""
import importlib.util, itertools, os, pathlib, random, subprocess, sysconfig
import pytest, torch
from torch.utils import cpp_extension
from mixedprec import ops
from builds import build_emulator

ROOT = pathlib.Path(__file__).parent.parent
CSRC = ROOT / 'mixedprec' / 'csrc'
# the GPU's chunk and block size; one that makes many launches and rounds
GPU_GRID, SMALL_GRID = (1 << 16, 512), (64, 32)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PACK = 4                                                # elements per vector access (multi_tensor.h's kPack)

@pytest.fixture(scope='module')
def emu():
    "The emulator, built once into build/cuda_emulator (`builds.build_emulator`)"
    mod = build_emulator()
    yield mod
    mod.set_grid(*GPU_GRID)

class Emulated:
    ("The emulator behind the same methods as `ops.Kernels`, so that `ops` and the front ends run the CUDA code on "
     "CPU tensors")
    def __init__(self, mod): self.mod = mod
    def has_cuda(self): return False
    def scale_check(self, src, dst, scale, scale_tensor=None):
        return self.mod.scale_check(src, dst, scale, scale_tensor)
    def scale_add_check(self, src, dst, scale, scale_tensor=None):
        return self.mod.scale_add_check(src, dst, scale, scale_tensor)
    def l2norm(self, tensors): return self.mod.l2norm(tensors)
    def sgd_step(self, *args): return self.mod.sgd_step(*args)
    def adam_step(self, *args): return self.mod.adam_step(*args)
    # prepared steps: the lists kept here, each step run through the emulated op with them
    _lists, _handles = {}, itertools.count(1)
    def prepare_step(self, *lists) -> int:
        handle = next(Emulated._handles)
        Emulated._lists[handle] = lists
        return handle
    def release_step(self, handle): Emulated._lists.pop(handle, None)
    def prepared_steps(self): return len(Emulated._lists)
    def sgd_prepared(self, h, found, inv, lr, mom, damp, wd, nesterov, first, decoupled, seeds, state_seeds):
        grads, params, bufs, _, out, _, lows, scales = Emulated._lists[h]
        return self.mod.sgd_step(grads, params, bufs, out, found, inv, lr, mom, damp, wd, nesterov, first, decoupled,
                                 lows, seeds, state_seeds, scales)
    def adam_prepared(self, h, found, inv, lr, b1, b2, eps, wd, decoupled, seeds, state_seeds):
        grads, params, m, v, out, steps, lows, scales = Emulated._lists[h]
        return self.mod.adam_step(grads, params, m, v, out, found, steps, inv, lr, b1, b2, eps, wd, decoupled, lows,
                                  seeds, state_seeds, scales)

def use_emulator(emu, monkeypatch, grid):
    "ops' fused path (impl='fused', and every front end) runs the emulated CUDA kernels on `grid` (chunk, threads)"
    emu.set_grid(*grid)
    monkeypatch.setattr(ops, '_choose', lambda t, impl, warn: Emulated(emu))
    monkeypatch.setattr(ops, '_chosen', {})

@pytest.fixture(params=[GPU_GRID, SMALL_GRID], ids=['gpu-grid', 'small-grid'])
def on_emulator(emu, monkeypatch, request):
    "The emulator, behind ops' fused path for this test, on the GPU's grid and on a small one"
    use_emulator(emu, monkeypatch, request.param)
    yield emu

@pytest.fixture(params=['gpu-grid', 'small-grid', pytest.param('cuda', marks=pytest.mark.cuda)])
def device(request, monkeypatch):
    "Where impl='fused' runs: the emulated CUDA kernels on CPU tensors (two grids), or the real ones on a GPU"
    if request.param == 'cuda': return 'cuda'
    use_emulator(request.getfixturevalue('emu'), monkeypatch, GPU_GRID if request.param == 'gpu-grid' else SMALL_GRID)
    return 'cpu'

# Views into buffers at offsets: fresh allocations; every list at the same offset; lists at other offsets; every list at
# the same offset but the one made with which=2 (the half copy or the low halves), one element further on.
LAYOUTS = ['aligned', 'same offset', 'other offsets', 'one list out of step']

def make(sizes, dtype, layout, which, seed, scale=4., device='cpu'):
    "Tensors of `sizes` for list number `which` of a call, laid out as `layout` says"
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(sizes):
        off = {'aligned': 0, 'same offset': 1 + k % 3, 'other offsets': 1 + (k + which) % 3,
               'one list out of step': 1 + k % 3 + (which == 2)}[layout]
        buf = torch.empty(n + off + PACK, dtype=dtype, device=device)
        t = buf[off:off + n]
        t.copy_((torch.randn(n, generator=g) * scale).to(dtype))
        out.append(t)
    return out

SIZES = {'tiny': [1, 3, 4, 5], 'ragged': [7, 8, 9, 1023, 1024, 1025], 'two chunks+': [2 * (1 << 16) + 3, 130]}

def clone(ts): return [t.clone() for t in ts]

def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), (x, y)

@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
def test_scale_bit_exact(device, sizes, layout, src_dtype, dst_dtype, add):
    if sizes == 'two chunks+' and (src_dtype, dst_dtype) != (torch.float16, torch.float32):
        pytest.skip("the large lists once, as unscale reads them")
    src = make(SIZES[sizes], src_dtype, layout, 0, seed=1, device=device)
    dst = make(SIZES[sizes], dst_dtype, layout, 2, seed=2, device=device)
    op, ref = (ops.scale_add_check_, ops.scale_add_check_ref_) if add else (ops.scale_check_, ops.scale_check_ref_)
    # a host number, and a scale the device computed
    for scale in (1 / 3, torch.tensor(2. ** -7, device=device)):
        a, b = clone(dst), clone(dst)
        assert not op(src, a, scale, impl='fused').item() and not ref(src, b, scale).item()
        assert_same(a, b)

@pytest.mark.parametrize("value", [float('inf'), float('nan')])
@pytest.mark.parametrize("where", [0, 1, 4, 6, -1])                  # in the head, a pack, the tail
def test_nonfinite_in_a_pack_or_a_ragged_end_is_flagged(device, value, where):
    for layout in LAYOUTS:
        src = make([11, 1029], torch.float16, layout, 0, seed=3, device=device)
        src[1][where] = value
        assert ops.scale_check_(src, make([11, 1029], torch.float32, layout, 2, seed=4, device=device), 1.,
                                impl='fused').item()

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_close_to_reference(device, layout, dtype):
    ts = make(SIZES['ragged'] + SIZES['two chunks+'], dtype, layout, 0, seed=5, device=device)
    (rt, rp), (ft, fp) = ops.l2norm(ts, per_tensor=True, impl='ref'), ops.l2norm(ts, per_tensor=True, impl='fused')
    torch.testing.assert_close(fp, rp, rtol=1e-5, atol=0)
    torch.testing.assert_close(ft, rt, rtol=1e-5, atol=0)

MODES = ['fp32', 'fp32+fp16 copy', 'fp32+bf16 copy', 'split', 'stochastic']

def step_lists(sizes, mode, layout, seed, device='cpu'):
    "Masters (fp32, or bf16 with low halves or seeds), the half copy `out` (list 2), and the lists' kwargs for a step"
    if mode.startswith('fp32'):
        params = make(sizes, torch.float32, layout, 1, seed, device=device)
        out = [] if mode == 'fp32' else make(sizes, torch.float16 if 'fp16' in mode else torch.bfloat16, layout, 2,
                                             seed + 1, device=device)
        # the masters' rounding, as after every write, but for every 7th element: an edit through `.data`
        for o, p in zip(out, params):
            kept = torch.arange(o.numel(), device=device).reshape(o.shape) % 7 != 3
            o.copy_(torch.where(kept, p.to(o.dtype), o))
        return params, out, {}
    params = make(sizes, torch.bfloat16, layout, 1, seed, device=device)
    if mode == 'stochastic': return params, [], {'seeds': [1000 + 7 * i for i in range(len(sizes))]}
    lows = make(sizes, torch.int16, layout, 2, seed, device=device)
    for p, lo, m in zip(params, lows, make(sizes, torch.float32, layout, 1, seed, device=device)):
        hi, low = ops.split_bf16_ref(m)
        p.copy_(hi); lo.copy_(low)
    return params, [], {'lows': lows}

def snapshot(*lists): return [t.clone() for l in lists for t in l]

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("momentum,nesterov,wd,decoupled", [(0., False, 0., False), (0.9, True, 1e-2, False),
                                                            (0.9, False, 0.1, True)])
def test_sgd_step_bit_exact(device, mode, layout, grad_dtype, momentum, nesterov, wd, decoupled):
    sizes = SIZES['tiny'] + SIZES['ragged']
    runs = []
    for impl in ('ref', 'fused'):
        params, out, kw = step_lists(sizes, mode, layout, seed=10, device=device)
        bufs = make(sizes, torch.float32, layout, 3, seed=11, device=device) if momentum else []
        for i in range(3):
            grads = make(sizes, grad_dtype, layout, 0, seed=20 + i, scale=256., device=device)
            ops.sgd_step_(grads, params, bufs, out, torch.tensor(i == 1, device=device), 1 / 256, 0.1, momentum, 0.,
                          wd, nesterov, first_run=i == 0,
                          decoupled=decoupled, impl=impl, **kw)
        runs.append(snapshot(params, bufs, out, kw.get('lows', [])))
    assert_same(*runs)

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("decoupled,wd", [(True, 0.1), (False, 1e-2), (False, 0.)])
def test_adam_step_bit_exact(device, mode, layout, grad_dtype, decoupled, wd):
    sizes = SIZES['tiny'] + SIZES['ragged']
    runs = []
    for impl in ('ref', 'fused'):
        params, out, kw = step_lists(sizes, mode, layout, seed=30, device=device)
        m = make(sizes, torch.float32, layout, 3, seed=31, scale=0.1, device=device)
        v = [t.abs() for t in make(sizes, torch.float32, layout, 4, seed=32, scale=0.01, device=device)]
        steps = [torch.tensor([float(k)], device=device) for k in range(len(sizes))]  # a count per param, each its own
        for i in range(3):
            grads = make(sizes, grad_dtype, layout, 0, seed=40 + i, scale=1024., device=device)
            ops.adam_step_(grads, params, m, v, out, torch.tensor(i == 1, device=device), steps, 1 / 1024, 1e-2, 0.9,
                           0.999, 1e-8, wd, decoupled, impl=impl, **kw)
        runs.append(snapshot(params, m, v, out, kw.get('lows', []), steps))
    assert_same(*runs)

def test_many_tensors_over_many_launches_carry_their_state(on_emulator):
    # over 48 tensors per launch (the most a table of Adam's seven lists holds): tensors in later tables keep their
    # step count, seed and per-tensor norm, and a launch's many blocks (the small grid gives the 25,000-element tensor
    # 391) each find their own tensor
    rng = random.Random(0)
    sizes = [rng.randrange(1, 300) for _ in range(70)] + [25_000] + [rng.randrange(1, 300) for _ in range(30)]
    on_emulator.reset_counters()
    runs = []
    for impl in ('ref', 'fused'):
        for mode in ('fp32+fp16 copy', 'stochastic'):
            params, out, kw = step_lists(sizes, mode, 'same offset', seed=50)
            m, v = make(sizes, torch.float32, 'aligned', 3, seed=51, scale=0.1), [torch.zeros(n) for n in sizes]
            # distinct: a carried tensor must not read another's
            steps = [torch.tensor([float(k)]) for k in range(len(sizes))]
            grads = make(sizes, torch.float16, 'same offset', 0, seed=52, scale=64.)
            ops.adam_step_(grads, params, m, v, out, torch.tensor(False), steps, 1 / 64, 1e-2, 0.9, 0.999, 1e-8, 0.01,
                           True, impl=impl, **kw)
            runs.append(snapshot(params, m, v, out, steps) + list(ops.l2norm(grads, per_tensor=True, impl=impl)))
    for r, f in zip(runs[:2], runs[2:]):
        assert_same(r[:-2], f[:-2])
        torch.testing.assert_close(f[-1], r[-1], rtol=1e-5, atol=0)
    assert on_emulator.counters()[2] >= 2 * 3                # each fused step: 3 launches or more (48 tensors each)

@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 1023, 1024, 1025, 70_001])
def test_aligned_lists_go_in_packs_and_ragged_ends_element_by_element(emu, n):
    # counts the loads and stores of one unscale (a load of src, a store of dst per element or pack)
    emu.set_grid(*GPU_GRID)
    chunks = [(c, min(n, c + GPU_GRID[0])) for c in range(0, n, GPU_GRID[0])]
    for layout, head in [('aligned', 0), ('same offset', None), ('other offsets', -1)]:
        # list 1: same offsets
        src, dst = make([n], torch.float16, layout, 0, seed=1), make([n], torch.float32, layout, 1, seed=2)
        if head is None: head = (PACK - (dst[0].data_ptr() // 4) % PACK) % PACK
        emu.reset_counters()
        emu.scale_check(src, dst, 0.5, None)
        elements, packs, launches = emu.counters()
        if head < 0: want_packs = 0
        else: want_packs = sum((e - min(e, b + head)) // PACK for b, e in chunks)
        assert (packs, elements) == (2 * want_packs, 2 * (n - PACK * want_packs)), (layout, n)
        assert launches == 1

def test_a_misaligned_pack_access_fails_in_the_emulation(emu):
    # the check that stands in for the GPU's fault: a pack read at an address not aligned for it raises here
    t = torch.zeros(16)
    with pytest.raises(RuntimeError, match='misaligned'): emu.load_pack(t, 1)
    emu.load_pack(t, 4)

def test_amp_trains_on_the_emulated_kernels_as_on_the_cpu_kernels(emu, monkeypatch):
    # a front end end to end, its unscale, overflow skip and fused AdamW run by the CUDA code: the same run, bit for
    # bit,
    # as with the C++ CPU kernels (both match the references bit for bit; impl='ref' would run torch's own AdamW
    # instead)
    from mixedprec import amp
    from mixedprec.engine import settings
    def run():
        with settings(impl='fused'):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.ReLU(), torch.nn.Linear(33, 3))
            init = [p.detach().clone() for p in model.parameters()]
            model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                        opt_level='O2',
                                        half_dtype='bf16', verbosity=0)
            g = torch.Generator().manual_seed(1)
            for i in range(6):
                x, y = torch.randn(16, 10, generator=g).bfloat16(), torch.randint(0, 3, (16,), generator=g)
                with amp.scale_loss(torch.nn.functional.cross_entropy(model(x).float(), y), opt) as scaled:
                    scaled.backward()
                    if i == 2: model[0].weight.grad.view(-1)[5] = float('inf')
                opt.step(); opt.zero_grad()
            return [p.detach().clone() for p in amp.master_params(opt)], [r.skipped for r in amp.history()], init
    cpu, cpu_skips, init = run()
    assert ops.backend(cpu[0]) == 'cpp'
    emu.set_grid(*SMALL_GRID)
    emu.reset_counters()
    monkeypatch.setattr(ops, '_choose', lambda t, impl, warn: Emulated(emu))
    monkeypatch.setattr(ops, '_chosen', {})
    emulated, skips, _ = run()
    assert emu.counters()[2] > 0                                         # the emulated kernels ran
    assert skips == cpu_skips and skips[2] and sum(skips) == 1
    assert_same(cpu, emulated)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(cpu, init))   # it trained

# The two common runs of bench/first_use_build.py and the step kernels each asks for (its table, read here: the keys are
# written once), which a first use on a GPU builds (seconds each): its half params' (their masters step on the fp32
# grads unscaled into them; fp32 masters write the fp16 copy) and those of the fp32 params it keeps (batchnorm)
def _bench(name):
    "A module of bench/, loaded by its path (bench/ on sys.path would shadow packages: its kernels.py, HF's `kernels`)"
    spec = importlib.util.spec_from_file_location(f'bench_{name}', ROOT / 'bench' / f'{name}.py')
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    return module
RUNS = _bench('first_use_build').RUNS
COMMON_RUNS = {'fp16, fp32 masters, AdamW': dict(half_dtype='fp16'),
               'bf16, split masters, 8-bit AdamW': dict(half_dtype='bf16', masters='split', state='8bit')}

@pytest.mark.parametrize('run', COMMON_RUNS)
def test_a_common_run_asks_for_the_step_kernels_its_first_use_builds(emu, monkeypatch, run):
    from mixedprec import amp
    from mixedprec.engine import settings
    kw, keys = COMMON_RUNS[run], set(RUNS[run])
    use_emulator(emu, monkeypatch, SMALL_GRID)
    # on a GPU the unscale writes the master grads (the scale lives on the device): no grad's unscale is the step's
    monkeypatch.setattr('mixedprec.master.defers', lambda g, p: False)
    emu.reset_counters()
    with settings(impl='fused'):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 3))
        model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opt_level='O2',
                                    verbosity=0, **kw)
        half = next(model.parameters()).dtype
        for _ in range(2):
            x, y = torch.randn(16, 10).to(half), torch.randint(0, 3, (16,))
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled: scaled.backward()
            opt.step(); opt.zero_grad()
    launched = set(emu.launched_keys())
    assert {k for k in launched if k >> 16 >= 4} == keys, [ops.describe_step_kernel(k) for k in launched]
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == half

@pytest.mark.skipif(ops.find_cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_packs_compile_to_vector_instructions(tmp_path):
    # a pack is one 16-byte (fp32) or 8-byte (fp16, bf16) load or store in the PTX for sm_90, not four scalar ones
    nvcc = os.path.join(ops.find_cuda_home(), 'bin', 'nvcc')
    ptx = tmp_path / 'core_kernels.ptx'
    includes = [f'-I{p}' for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}",
                                                                    f'-I{CSRC}']
    subprocess.run([nvcc, '-ptx', *ops._CUDA_FLAGS, '-std=c++20', '--expt-relaxed-constexpr', '-arch=sm_90',
                    '-DTORCH_EXTENSION_NAME=mixedprec_ptx', *includes, str(CSRC / 'core_kernels.cu'), '-o',
                        str(ptx)], check=True, capture_output=True)
    text = ptx.read_text()
    for instruction in ('ld.global.v4.f32', 'st.global.v4.f32', 'ld.global.v4.u16', 'st.global.v4.u16'):
        assert instruction in text, instruction

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ['sgd', 'adam'])
def test_bf16_state_steps_bit_exact(device, mode, layout, kind):
    ("Lean optimizer state: bf16 moments, read as fp32 and rounded back stochastically, from each list's own seed "
     "and index")
    sizes = SIZES['tiny'] + SIZES['ragged']
    runs = []
    for impl in ('ref', 'fused'):
        params, out, kw = step_lists(sizes, mode, layout, seed=50, device=device)
        m = make(sizes, torch.bfloat16, layout, 3, seed=51, scale=0.1, device=device)
        v = [t.abs() for t in make(sizes, torch.bfloat16, layout, 4, seed=52, scale=0.01, device=device)]
        for i in range(3):
            grads = make(sizes, torch.float16, layout, 0, seed=60 + i, scale=1024., device=device)
            found = torch.tensor(i == 1, device=device)
            if kind == 'sgd':
                ops.sgd_step_(grads, params, m, out, found, 1 / 1024, 0.1, 0.9, 0., 1e-2, False, first_run=False,
                              impl=impl,
                              state_seeds=[(900 + k + 10 * i,) for k in range(len(sizes))], **kw)
            else:
                steps = [torch.tensor([float(k)], device=device) for k in range(len(sizes))]
                ops.adam_step_(grads, params, m, v, out, found, steps, 1 / 1024, 1e-2, 0.9, 0.999, 1e-8, 0.1, True,
                               impl=impl,
                               state_seeds=[(900 + k + 10 * i, 950 + k + 10 * i) for k in range(len(sizes))], **kw)
        runs.append(snapshot(params, m, v, out, kw.get('lows', [])))
    assert_same(*runs)

def state8(sizes, layout, which, seed, scale, signed, device):
    ("8-bit optimizer state of `sizes`: codes laid out as `layout` says (list `which`), quantised from random "
     "values, and their scales")
    codes = make(sizes, torch.int8 if signed else torch.uint8, layout, which, seed, scale=0., device=device)
    scales = []
    for c, x in zip(codes, make(sizes, torch.float32, 'aligned', which, seed, scale=scale, device=device)):
        x = x * torch.logspace(
            -6, 0, x.numel(), device=device)[torch.randperm(x.numel(),
                                                            generator=torch.Generator().manual_seed(seed)).to(device)]
        q, s = ops.quantize8_ref(x if signed else x.abs(), None, signed)
        c.copy_(q); scales.append(s)
    return codes, scales

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ['sgd', 'adam'])
def test_8bit_state_steps_bit_exact(device, mode, layout, kind):
    "8-bit state: codes and a scale per 256 elements, decoded, updated and encoded again by a warp a block, as the ref"
    # (on the small grid, blocks that start in one chunk and end in the next)
    sizes = SIZES['tiny'] + SIZES['ragged'] + [255, 256, 257, 70000]
    runs = []
    for impl in ('ref', 'fused'):
        params, out, kw = step_lists(sizes, mode, layout, seed=70, device=device)
        m, msc = state8(sizes, layout, 3, 71, 0.1, True, device)
        v, vsc = state8(sizes, layout, 4, 72, 0.01, False, device)
        for i in range(3):
            grads = make(sizes, torch.float16, layout, 0, seed=80 + i, scale=1024., device=device)
            found = torch.tensor(i == 1, device=device)
            if kind == 'sgd':
                ops.sgd_step_(grads, params, m, out, found, 1 / 1024, 0.1, 0.9, 0., 1e-2, False, first_run=i == 0,
                              impl=impl,
                              state_seeds=[(900 + k + 10 * i,) for k in range(len(sizes))], state_scales=[msc], **kw)
            else:
                steps = [torch.tensor([float(k)], device=device) for k in range(len(sizes))]
                ops.adam_step_(grads, params, m, v, out, found, steps, 1 / 1024, 1e-2, 0.9, 0.999, 1e-8, 0.1, True,
                               impl=impl,
                               state_seeds=[(900 + k + 10 * i, 950 + k + 10 * i) for k in range(len(sizes))],
                                   state_scales=[msc, vsc], **kw)
        runs.append(snapshot(params, m, v, msc, vsc, out, kw.get('lows', [])))
    assert_same(*runs)

@pytest.mark.parametrize("layout,packed", [('aligned', True), ('same offset', False)])
def test_8bit_step_reads_each_input_once_in_coalesced_packs(emu, layout, packed):
    # a warp per quantisation block: whole blocks aligned at their start go in packs of 4 (lane l's at 4l and 128 + 4l),
    # the rest element by element; either way each list is read once and written once per element (no second pass)
    emu.set_grid(*GPU_GRID)
    sizes = [256 * 40] if packed else [256 * 40 + 3]
    params, out, _ = step_lists(sizes, 'fp32+fp16 copy', layout, seed=90)
    m, msc = state8(sizes, layout, 3, 91, 0.1, True, 'cpu')
    v, vsc = state8(sizes, layout, 4, 92, 0.01, False, 'cpu')
    grads = make(sizes, torch.float16, layout, 0, seed=93, scale=1024.)
    emu.reset_counters()
    emu.adam_step(grads, params, m, v, out, torch.tensor(False), [torch.zeros(1)], 1 / 1024, 1e-2, 0.9, 0.999, 1e-8,
                  0.1, True, [], None, torch.tensor([[1, 2]]), [*msc, *vsc])
    elements, packs, _ = emu.counters()
    n = sizes[0]
    # g, master, m, v, half copy read (edits through `.data`); master, m, v, half copy written
    assert elements + PACK * packs == 9 * n
    assert (packs == 9 * n // PACK) if packed else (packs == 0)
