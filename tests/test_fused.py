"The fused kernels against the pure-PyTorch references (CPU always; CUDA where there is a GPU), and the loader's rules"
import importlib.resources, os, random, warnings
import pytest, torch
from mixedprec import ops
from builds import build_cuda

CHUNK = 1 << 16                                      # the CPU kernels' work unit (CUDA's is 2048*32, the same size)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])

def lists(sizes, dtype, device, bad=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [(torch.randn(n, generator=g) * 4).to(dtype).to(device) for n in sizes]
    if bad is not None:
        value, where = bad
        t = ts[random.Random(seed).randrange(len(ts))]
        t.view(-1)[{'first': 0, 'last': -1, 'random': random.Random(seed + 1).randrange(t.numel())}[where]] = value
    return ts

SIZES = {'one': [1], 'three': [3], 'chunk-1': [CHUNK - 1], 'chunk': [CHUNK], 'chunk+1': [CHUNK + 1],
         'chunks': [3 * CHUNK + 5],
         'seven mixed': [1, 3, CHUNK - 1, 17, CHUNK + 1, 5, 1000],
             'two hundred': [random.Random(1).randrange(1, 300) for _ in range(200)]}

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
def test_scale_ops_bit_exact(device, sizes, src_dtype, dst_dtype, add):
    scale = 2.**-10 if len(SIZES[sizes]) % 2 else 1/3          # powers of two and not
    src = lists(SIZES[sizes], src_dtype, device)
    outs = []
    for impl in ('ref', 'fused'):
        dst = lists(SIZES[sizes], dst_dtype, device, seed=7)
        op = ops.scale_add_check_ if add else ops.scale_check_
        flag = op(src, dst, scale, impl=impl)
        outs.append((flag.item(), dst))
    assert outs[0][0] == outs[1][0] == False
    for a, b in zip(outs[0][1], outs[1][1]): torch.testing.assert_close(a, b, rtol=0, atol=0)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float('inf'), -float('inf'), float('nan')])
@pytest.mark.parametrize("where", ['first', 'last', 'random'])
@pytest.mark.parametrize("sizes", ['one', 'chunk+1', 'two hundred'])
def test_nonfinite_anywhere_is_flagged(device, value, where, sizes):
    for dtype in (torch.float16, torch.float32):
        src = lists(SIZES[sizes], dtype, device, bad=(value, where))
        for op in (ops.scale_check_, ops.scale_add_check_):
            assert op(src, [torch.zeros_like(t, dtype=torch.float32) for t in src], 0.5, impl='fused').item()

def test_in_place_and_empty_and_layouts():
    t = torch.tensor([2., 4., float('nan')])
    assert ops.scale_check_([t], [t], 0.5, impl='fused').item() and t[:2].tolist() == [1., 2.]
    assert not ops.scale_check_([], [], 1., impl='fused').item()
    assert ops.l2norm([], impl='fused').item() == 0.
    a = torch.randn(4, 6).t(); b = torch.empty(4, 6).t()           # same (transposed) layout: handled
    ops.scale_check_([a], [b], 2., impl='fused')
    assert torch.equal(b, a * 2)
    with pytest.raises((ValueError, RuntimeError), match='layout|contiguous|dense'):
        ops.scale_check_([torch.randn(4, 6).t()], [torch.empty(6, 4)], 1., impl='fused')
    with pytest.raises((ValueError, RuntimeError), match='dense|contiguous'):
        ops.l2norm([torch.randn(8, 8)[::2]], impl='fused')

@pytest.fixture
def streaming():
    "The CPU kernels with every output written by streaming stores (the threshold at 0 bytes), put back afterwards"
    kernels, why = ops._fused()
    if kernels is None: pytest.skip(why)
    before = kernels.module.stream_min_bytes()
    kernels.module.stream_min_bytes(0)
    yield kernels
    kernels.module.stream_min_bytes(before)

@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_streamed_outputs_are_what_normal_stores_write(streaming, src_dtype, dst_dtype):
    # Each output starts at another element past an aligned address (0-32 elements: every head an AVX-512 or AVX2
    # register
    # leaves), and spans a chunk boundary; what lies before it is untouched. A non-finite value is found in the head and
    # in the body.
    for offset in range(33):
        n = CHUNK + 3 * offset + 5
        src = lists([n], src_dtype, 'cpu', seed=offset)
        bad = [t.clone() for t in src]
        bad[0][offset // 2 if offset % 2 else n // 2] = float('inf')
        results = []
        for impl in ('ref', 'fused'):
            held = torch.full((n + offset,), 7., dtype=dst_dtype)
            flags = [ops.scale_check_(s, [held[offset:]], 1/3, impl=impl).item() for s in (bad, src)]
            results.append((flags, held))
        assert results[0][0] == results[1][0] == [True, False], offset
        assert torch.equal(results[0][1], results[1][1]), offset
        if src_dtype == dst_dtype:                                 # in place: stored normally, the same bits
            held = torch.full((n + offset,), 7., dtype=dst_dtype)
            held[offset:] = src[0]
            assert not ops.scale_check_([held[offset:]], [held[offset:]], 1/3, impl='fused').item()
            assert torch.equal(held, results[0][1]), offset

def test_large_outputs_are_streamed_by_default_and_exact():
    # Twice the last-level cache or more: streamed at the default threshold (32 MiB of L3 streams from 64 MiB on), with
    # the same result
    assert ops.stream_min_bytes() == 2 * ops.last_level_cache_bytes() >= 2 * 2**20
    kernels, why = ops._fused()
    if kernels is None: pytest.skip(why)
    assert kernels.module.stream_min_bytes() == ops.stream_min_bytes()
    n = ops.stream_min_bytes() // 4 + 4099                       # fp32 outputs just past the threshold, in two tensors
    src = [torch.randn(n // 2).half(), torch.randn(n - n // 2).half()]
    ref, fused = [torch.empty(t.numel()) for t in src], [torch.empty(t.numel()) for t in src]
    assert ops.scale_check_(src, ref, 0.5,
                            impl='ref').item() == ops.scale_check_(src, fused, 0.5, impl='fused').item() == False
    assert all(torch.equal(a, b) for a, b in zip(ref, fused))

@pytest.mark.parametrize("state", ['fp32', 'bf16'])
def test_streamed_model_copy_of_a_step_is_what_normal_stores_write(streaming, state):
    # The half copy the fused step writes, from fp32 masters held directly or in blocks (bf16 state), at odd offsets
    def run(impl):
        g = torch.Generator().manual_seed(8)
        sizes, offsets = [5, CHUNK + 9, 2100, 333], [0, 3, 17, 30]
        params = [torch.randn(n, generator=g) for n in sizes]
        kind = torch.float32 if state == 'fp32' else torch.bfloat16
        m, v = [torch.zeros(n, dtype=kind) for n in sizes], [torch.zeros(n, dtype=kind) for n in sizes]
        held = [torch.full((n + o,), 7., dtype=torch.half) for n, o in zip(sizes, offsets)]
        seeds = None if state == 'fp32' else [list(range(i, i + 2)) for i in range(len(sizes))]
        for i in range(3):
            grads = [(torch.randn(n, generator=g) * 1024).half() for n in sizes]
            ops.adam_step_(grads, params, m, v, [h[o:] for h, o in zip(held, offsets)], torch.tensor(False),
                           torch.zeros(()), 1/1024,
                           1e-2, state_seeds=seeds, impl=impl)
        return params + m + v + held
    for a, b in zip(run('ref'), run('fused')): assert torch.equal(a, b)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", ['one', 'chunks', 'seven mixed', 'two hundred'])
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_close_to_reference(device, sizes, dtype):
    ts = lists(SIZES[sizes], dtype, device)
    (rt, rp), (ft, fp) = ops.l2norm(ts, per_tensor=True, impl='ref'), ops.l2norm(ts, per_tensor=True, impl='fused')
    # fp32 sums in another order (the fused sums run in double): agreement to a few fp32 ulps
    torch.testing.assert_close(ft, rt, rtol=1e-5, atol=0)
    torch.testing.assert_close(fp, rp, rtol=1e-5, atol=0)
    assert ft.dtype == torch.float32 and ft.dim() == 0 and fp.shape == (len(ts),)

def _sgd_run(impl, grad_dtype, momentum, nesterov, wd, dampening, device='cpu', steps=12, skip_at=5, decoupled=False):
    g = torch.Generator().manual_seed(3)
    sizes = [7, CHUNK + 3, 300]
    params = [torch.randn(n, generator=g).to(device) for n in sizes]
    bufs = [torch.zeros(n, device=device) for n in sizes]
    # the model copy holds its masters' rounding, as after every write
    out = [p.half() for p in params]
    for i in range(steps):
        grads = [(torch.randn(n, generator=g) * 256).to(grad_dtype).to(device) for n in sizes]
        ops.sgd_step_(grads, params, bufs, out, torch.tensor(i == skip_at, device=device), 1/256, 0.1, momentum,
                      dampening, wd, nesterov,
                      first_run=i == 0, decoupled=decoupled, impl=impl)
    return params, bufs, out

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("momentum,nesterov,wd,dampening,decoupled",
                         [(0., False, 0., 0., False), (0.9, False, 1e-2, 0., False), (0.9, True, 1e-2, 0., False),
                                                                     (0.5, False, 0., 0.1, False), (0.9, False, 1e-2, 0., True), (0., False, 0.1, 0., True)])
def test_sgd_step_bit_exact_with_reference(device, grad_dtype, momentum, nesterov, wd, dampening, decoupled):
    ref, fused = (_sgd_run(impl, grad_dtype, momentum, nesterov, wd, dampening, device,
                           decoupled=decoupled) for impl in ('ref', 'fused'))
    for a, b in zip(ref, fused):
        for x, y in zip(a, b): torch.testing.assert_close(x, y, rtol=0, atol=0)

@pytest.mark.parametrize("momentum,nesterov,wd,dampening", [(0., False, 0., 0.), (0.9, False, 1e-2, 0.),
                                                            (0.9, True, 1e-2, 0.), (0.5, False, 1e-3, 0.1)])
def test_sgd_step_matches_torch_sgd_with_skip_as_noop(momentum, nesterov, wd, dampening):
    g = torch.Generator().manual_seed(3)
    master = torch.randn(500, generator=g)
    ref = torch.nn.Parameter(master.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd, dampening=dampening)
    buf, out, first = torch.zeros(500), master.half(), True
    for i in range(30):
        g16 = (torch.randn(500, generator=g) * 64).half()
        skip = i == 7
        ops.sgd_step_([g16], [master], [buf], [out], torch.tensor(skip), 1/64, 0.1, momentum, dampening, wd, nesterov,
                      first_run=first, impl='fused')
        if not skip: ref.grad = g16.float() / 64; opt.step(); first = False
    torch.testing.assert_close(master, ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(out, master.half())

def _adam_run(impl, grad_dtype, decoupled, wd, device='cpu', steps=12, skip_at=4):
    g = torch.Generator().manual_seed(5)
    sizes = [5, CHUNK + 1, 333]
    params = [torch.randn(n, generator=g).to(device) for n in sizes]
    m, v = [torch.zeros(n, device=device) for n in sizes], [torch.zeros(n, device=device) for n in sizes]
    out, step = [p.bfloat16() for p in params], torch.zeros((), device=device)
    for i in range(steps):
        grads = [(torch.randn(n, generator=g) * 1024).to(grad_dtype).to(device) for n in sizes]
        ops.adam_step_(grads, params, m, v, out, torch.tensor(i == skip_at, device=device), step, 1/1024, 1e-2, 0.9,
                       0.999, 1e-8, wd, decoupled, impl=impl)
    return params, m, v, out, [step]

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("decoupled,wd", [(True, 0.), (True, 0.1), (False, 0.), (False, 1e-2)])
def test_adam_step_bit_exact_with_reference(device, grad_dtype, decoupled, wd):
    ref, fused = (_adam_run(impl, grad_dtype, decoupled, wd, device) for impl in ('ref', 'fused'))
    for a, b in zip(ref, fused):
        for x, y in zip(a, b): torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert ref[-1][0].item() == 11.

@pytest.mark.parametrize("cls,decoupled,wd", [(torch.optim.AdamW, True, 0.1), (torch.optim.Adam, False, 1e-2),
                                              (torch.optim.Adam, False, 0.)])
def test_adam_step_matches_torch_over_many_steps(cls, decoupled, wd):
    g = torch.Generator().manual_seed(2)
    for n in (22, 1024, 278011):
        master = torch.randn(n, generator=g)
        ref = torch.nn.Parameter(master.clone())
        opt = cls([ref], lr=1e-2, betas=(0.6, 0.9), eps=3e-6, weight_decay=wd)
        m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
        for i in range(50):
            g16 = torch.randn(n, generator=g).half()
            ops.adam_step_([g16], [master], [m], [v], [], torch.tensor(i == 9), step, 1., 1e-2, 0.6, 0.9, 3e-6, wd,
                           decoupled, impl='fused')
            if i != 9: ref.grad = g16.float(); opt.step()
        torch.testing.assert_close(master, ref.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(m, opt.state[ref]['exp_avg'], rtol=1e-4, atol=1e-6)
        assert step.item() == opt.state[ref]['step'].item() == 49

@pytest.mark.parametrize("device", DEVICES)
def test_adam_per_param_step_counts(device):
    # torch keeps one count per param; params added later (or loaded) have other counts than the rest: each uses its own
    def run(impl):
        g = torch.Generator().manual_seed(4)
        sizes = [7, CHUNK + 3, 40]
        params = [torch.randn(n, generator=g).to(device) for n in sizes]
        m, v = [torch.zeros(n, device=device) for n in sizes], [torch.zeros(n, device=device) for n in sizes]
        steps = [torch.tensor(float(t), device=device) for t in (0, 5, 2)]
        out = [p.half() for p in params]
        for i in range(4):
            grads = [torch.randn(n, generator=g).half().to(device) for n in sizes]
            ops.adam_step_(grads, params, m, v, out, torch.tensor(i == 1, device=device), steps, 1., 1e-2, 0.9, 0.99,
                           1e-8, 0.1, True, impl=impl)
        return params + m + v + out + steps
    ref, fused = run('ref'), run('fused')
    for a, b in zip(ref, fused): torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [s.item() for s in fused[-3:]] == [3., 8., 5.]
    args = lambda n: ([torch.ones(2)] * n, [torch.ones(2) for _ in range(n)], [torch.zeros(2) for _ in range(n)],
                      [torch.zeros(2) for _ in range(n)], [])
    with pytest.raises(ValueError, match='same length'):
        ops.adam_step_(*args(1), torch.tensor(False), [], 1., 0.1, impl='fused')
    shared = torch.zeros(())
    with pytest.raises(ValueError, match='one per param'):
        ops.adam_step_(*args(2), torch.tensor(False), [shared, shared], 1., 0.1, impl='fused')
    for impl in ('ref', 'fused'):
        with pytest.raises(ValueError, match='1-element fp32'):
            ops.adam_step_(*args(1), torch.tensor(False), [torch.zeros((), dtype=torch.float64)], 1., 0.1, impl=impl)
    ops.adam_step_(*args(2), torch.tensor(False), shared, 1., 0.1, impl='fused')
    assert shared.item() == 1.                              # one shared count advances once per call

def test_a_tensor_scale_is_read_like_a_number():
    src = [torch.randn(100).half(), torch.randn(CHUNK + 1)]
    a, b = [torch.empty(100), torch.empty(CHUNK + 1)], [torch.empty(100), torch.empty(CHUNK + 1)]
    for impl in ('ref', 'fused'):
        ops.scale_check_(src, a, 1 / 3, impl=impl); ops.scale_check_(src, b, torch.tensor(1 / 3), impl=impl)
        for x, y in zip(a, b): assert torch.equal(x, y)
    # the reference checks a tensor scale itself, the kernels' binding for them
    for impl in ('ref', 'fused'):
        with pytest.raises(ValueError, match='1-element fp32'):
            ops.scale_check_(src, a, torch.tensor([1., 2.]), impl=impl)
        with pytest.raises(ValueError, match='1-element fp32'):
            ops.scale_check_(src, a, torch.tensor(1., dtype=torch.float64), impl=impl)

def test_flagged_step_changes_nothing():
    p, m, v, step = torch.randn(100), torch.randn(100).abs(), torch.randn(100).abs(), torch.tensor(3.)
    before = [t.clone() for t in (p, m, v, step)]
    ops.adam_step_([torch.randn(100).half()], [p], [m], [v], [], torch.tensor(True), step, 1., 0.1, impl='fused')
    ops.sgd_step_([torch.randn(100)], [p], [m], [], torch.tensor(True), 1., 0.1, momentum=0.9, impl='fused')
    for a, b in zip(before, (p, m, v, step)): assert torch.equal(a, b)

def test_impl_rules(monkeypatch):
    t = torch.ones(3)
    with pytest.raises(ValueError, match="impl must be"): ops.scale_check_([t], [t], 1., impl='turbo')
    monkeypatch.setattr(ops, '_fused', lambda: (None, 'RuntimeError: no compiler found (test)'))
    monkeypatch.setattr(ops, '_warned', set())
    with pytest.raises(RuntimeError, match="fused kernels cannot be used: RuntimeError: no compiler found"):
        ops.scale_check_([t], [t], 1., impl='fused')
    with pytest.warns(UserWarning, match='reference ops.*no compiler found'):
        assert not ops.scale_check_([t], [t], 1.).item()
    with warnings.catch_warnings():
        warnings.simplefilter('error'); ops.l2norm([t])                        # warned once only
    assert ops.backend(t) == 'ref'
    monkeypatch.setenv('MIXEDPREC_REQUIRE_FUSED', '1')
    with pytest.raises(RuntimeError, match='MIXEDPREC_REQUIRE_FUSED'): ops.scale_check_([t], [t], 1.)

def test_sources_ship_with_the_package():
    src = importlib.resources.files('mixedprec') / 'csrc'
    names = {p.name for p in src.iterdir()}
    assert {'mixedprec.cpp', 'cpu_kernels.cpp', 'cuda_dispatch.cpp', 'multi_tensor.h', 'multi_tensor_plan.h',
            'kernel_keys.h', 'kernel_dispatch.h', 'cuda_launch.cuh', 'scale_kernels.h', 'l2norm_kernel.h',
            'optim_kernels.h', 'core_kernels.cu', 'step_kernel.cu', 'bf16_bits.h', 'state8_bits.h',
            'messages.h', 'python_module.h'} <= names
    import tomllib, pathlib
    cfg = tomllib.loads((pathlib.Path(__file__).parent.parent / 'pyproject.toml').read_text())
    assert 'csrc/*' in cfg['tool']['setuptools']['package-data']['mixedprec']

def test_kernel_sources_include_atens_headers_not_the_whole_cpp_api():
    ("The first compile is most of a newcomer's first run: `<torch/extension.h>` and pybind11 took two thirds of it "
     "(39 s against 11 s on a 2-core EPYC), so the shipped sources include ATen's own headers and Python's C API")
    import re
    from pathlib import Path
    heavy = re.compile(
        r'^\s*(#\s*include\s*<(torch/(extension|torch|all|python)\.h|pybind11/[^>]*)>|PYBIND11_MODULE\b)', re.M)
    sources = sorted((Path(ops.__file__).parent / 'csrc').iterdir())
    assert any(f.suffix == '.cpp' for f in sources)
    for f in sources:
        m = heavy.search(f.read_text())
        assert m is None, (f"{f.name} uses {m.group(0).strip()}: include ATen's own headers (ATen/core/Tensor.h, "
                           "ATen/ops/*.h) instead")

def test_the_cuda_units_include_no_aten_header():
    ("A first use on a GPU builds the .cu units (the unscale and norms, then a step kernel per key) in seconds because "
     "nothing they include, followed to the end, is ATen's or torch's (18 s of headers a unit)")
    import re
    from pathlib import Path
    csrc = Path(ops.__file__).parent / 'csrc'
    local, system = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M), re.compile(r'^\s*#\s*include\s*<([^>]+)>', re.M)
    for unit in sorted(csrc.glob('*.cu')):
        seen, todo = set(), [unit.name]
        while todo:
            name = todo.pop()
            if name in seen: continue
            seen.add(name)
            text = (csrc / name).read_text()
            heavy = [h for h in system.findall(text) if h.startswith(('ATen/', 'torch/', 'c10/cuda/', 'c10/core/'))]
            assert not heavy, f"{unit.name} includes {heavy} through {name}"
            todo += local.findall(text)
        assert 'multi_tensor.h' in seen and 'kernel_keys.h' in seen

@pytest.mark.skipif(ops.find_cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_one_step_kernel_builds_on_its_own_says_what_it_builds_and_registers(tmp_path):
    # what a run's first CUDA step does when its kernel is missing (the builder the extension calls), in a process of
    # its own: its registry is the extension's, and `make test` registers every step kernel in this one
    import subprocess, sys, textwrap
    os.chmod(tmp_path, 0o700)
    code = textwrap.dedent(f"""
        import torch
        from mixedprec import ops
        from builds import CUDA_ARCH
        ext = ops.build_extension(cuda=True, cuda_arch=CUDA_ARCH)
        before = set(ext.kernel_keys())
        key = ops.step_kernel_key('adam', torch.float32, 'split', '8bit')
        ext.module.register_kernels(ops.build_step_kernel(key, CUDA_ARCH, cache={str(tmp_path)!r}).kernels())
        print(len(before), sorted(set(ext.kernel_keys()) - before) == [key])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get('PYTHONPATH', '')]))
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ['36', 'True'], res.stdout
    assert ("compiling the CUDA kernel of the Adam step for fp32 grads, split bf16 masters and 8-bit state" in
            res.stderr), res.stderr[-2000:]

@pytest.mark.skipif(ops.find_cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_cuda_sources_compile_without_a_gpu():
    # a syntax or type error in a .cu file fails here, GPU or not; the build is cached after the first run. The CPU
    # build is
    # loaded first: both come through /proc/self/fd/N, and glibc's dlopen would hand back the first for a reused N
    ops.backend(torch.zeros(1))
    ext = build_cuda()                              # `make test` started it in the background (tests/builds.py)
    assert ext.has_cuda()
    # every kernel a dispatch can ask for is registered: the core's 36 and the 144 step kernels (kernel_keys.h)
    keys = ext.kernel_keys()
    assert len(keys) == len(set(keys)) == 36 + 144
    assert ops.step_kernel_key('adam', torch.float32, 'split', '8bit') in keys
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            ext.scale_check([torch.ones(1, device='cuda')], [torch.ones(1, device='cuda')], 1.)

@pytest.mark.cuda
def test_cuda_path_is_taken_and_adam_skips_on_device():
    t = torch.ones(3, device='cuda')
    assert ops.backend(t) == 'cuda'
    p, m, v, step = torch.randn(
        10, device='cuda'), torch.zeros(10,
                                        device='cuda'), torch.zeros(10, device='cuda'), torch.zeros((), device='cuda')
    found = ops.scale_check_([torch.tensor([float('inf')], device='cuda')], [torch.zeros(1, device='cuda')], 1.)
    ops.adam_step_([torch.randn(10, device='cuda').half()], [p], [m], [v], [], found, step, 1., 0.1, impl='fused')
    assert step.item() == 0. and not m.any()

@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_a_value_error_on_each_device(device):
    # the kernels' binding checks its inputs and raises with the numbers in the message; on one GPU machine a message
    # formatted by an ostream of the extension's crashed the process, so the messages are built without one (messages.h)
    t = lambda *shape, **k: torch.ones(*shape, device=device, **k)
    with pytest.raises(ValueError, match='tensor pair 0 is not dense'):
        ops.scale_check_([torch.randn(4, 6, device=device).t()], [t(6, 4)], 1., impl='fused')
    with pytest.raises(ValueError, match='tensor 0 has 2 and 3'): ops.scale_check_([t(2)], [t(3)], 1., impl='fused')
    with pytest.raises(ValueError, match="step count 0 must be a 1-element fp32 tensor on its param's device.*got "
                                         "Double"):
        ops.adam_step_([t(2)], [t(2)], [t(2)], [t(2)], [], torch.tensor(False), [t((), dtype=torch.float64)], 1., 0.1,
                       impl='fused')
    with pytest.raises(ValueError, match='fp32 master params, tensor 0 is Half'):
        ops.sgd_step_([t(2)], [t(2, dtype=torch.half)], [], [], torch.tensor(False), 1., 0.1, impl='fused')

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ['sgd', 'adam'])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("state", ['fp32', 'bf16', '8bit'])
def test_a_step_takes_edits_of_the_half_copy_through_data_as_masters(device, kind, out_dtype, state):
    # a WGAN critic's `p.data.clamp_(-c, c)` changes the half param only: the step reads it before the update, and an
    # element that is not its master's rounding becomes the master; the others keep their fp32 bits. lr=0: the step
    # changes nothing else, so the masters after it are exactly what was adopted
    g = torch.Generator().manual_seed(7)
    sizes = [5, CHUNK + 3, 300]
    masters = [torch.randn(n, generator=g).to(device) for n in sizes]
    out = [m.to(out_dtype) for m in masters]
    for o in out: o.clamp_(-0.5, 0.5)                       # through `.data`: no version counter the engine could read
    expected = [torch.where(m.to(out_dtype) == o, m, o.float()) for m, o in zip(masters, out)]
    assert any(not torch.equal(e, m) for e, m in zip(expected, masters))
    grads = [torch.randn(n, generator=g).to(out_dtype).to(device) for n in sizes]
    kw = {}
    if state == 'fp32': st = [[torch.zeros(n, device=device) for n in sizes] for _ in range(2)]
    elif state == 'bf16': st = [[torch.zeros(n, dtype=torch.bfloat16, device=device) for n in sizes] for _ in range(2)]
    else:
        st = [[torch.zeros(n, dtype=dt, device=device) for n in sizes] for dt in (torch.int8, torch.uint8)]
        kw['state_scales'] = [[torch.zeros(-(-n // ops.Q_BLOCK), device=device) for n in sizes] for _ in range(2)]
    if state != 'fp32': kw['state_seeds'] = [(2 * i, 2 * i + 1) for i in range(len(sizes))]
    for impl in ('ref', 'fused'):
        ms, os_ = [m.clone() for m in masters], [o.clone() for o in out]
        if kind == 'sgd':
            if state != 'fp32':
                kw2 = {**kw, 'state_seeds': [s[:1] for s in kw['state_seeds']],
                       **({'state_scales': kw['state_scales'][:1]} if 'state_scales' in kw else {})}
            else: kw2 = kw
            ops.sgd_step_(grads, ms, st[0], os_, torch.tensor(False, device=device), 1., 0., 0.9, 0., 0., False,
                          first_run=True, impl=impl, **kw2)
        else:
            ops.adam_step_(grads, ms, st[0], st[1], os_, torch.tensor(False, device=device),
                           [torch.zeros((), device=device) for _ in sizes],
                           1., 0., impl=impl, **kw)
        for m, o, e in zip(ms, os_, expected):
            assert torch.equal(m, e), impl
            assert torch.equal(o, e.to(out_dtype))
