"""Benchmark of the per-step bookkeeping over a whole model's params: a per-tensor Python loop (as fastai v1 did),
torch's foreach ops (with torch._amp_foreach_non_finite_check_and_unscale_), for the full step also torch's fastest parts
(that unscale, a foreach clip and AdamW(fused=True)), and mixedprec's fused kernels; and fastai's
own Adam step (its per-param Python loop) against the fused step that the callback runs in its place.
Prints one table; every figure is also given as a ratio to a plain copy's bandwidth measured in the same run. The rows
'fused, no NT' run the same kernels with normal stores only, where 'fused' writes outputs past twice the last-level cache
with streaming (non-temporal) stores.

    python bench/kernels.py [--sizes resnet50,100m] [--repeat 5] [--device cpu] [--threads 1,2]
"""
import argparse, time
from contextlib import contextmanager
import torch
from mixedprec import ops

def resnet50_like():
    "About 25.5M params in 161 tensors, shaped like ResNet-50's"
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            inp = width * 4 if b else width * (2 if width > 64 else 1)
            shapes += [(width, inp, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,), (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if b == 0: shapes += [(width * 4, inp, 1, 1), (width * 4,), (width * 4,)]
    shapes += [(1000, 2048), (1000,)]
    return shapes

def hundred_m(): return [(4096, 4096)] * 5 + [(4096,)] * 5 + [(1024, 1024)] * 15          # ~100M params

def timeit(fn, repeat, device):
    fn()
    if device == 'cuda': torch.cuda.synchronize()
    best = float('inf')
    for _ in range(repeat):
        t = time.perf_counter(); fn()
        if device == 'cuda': torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best

@contextmanager
def normal_stores():
    "The CPU kernels without streaming (non-temporal) stores, whatever the outputs' size: the 'fused, no NT' rows"
    kernels, _ = ops._fused()
    if kernels is None: yield; return
    before = kernels.module.stream_min_bytes()
    kernels.module.stream_min_bytes(1 << 62)
    try: yield
    finally: kernels.module.stream_min_bytes(before)

def run(shapes, repeat, device):
    g16 = [torch.randn(s, device=device).half() for s in shapes]
    g32 = [torch.empty(s, device=device) for s in shapes]
    m32 = [torch.randn(s, device=device) for s in shapes]
    p16 = [torch.empty(s, device=device, dtype=torch.half) for s in shapes]
    exp_avg, exp_avg_sq = [torch.zeros(s, device=device) for s in shapes], [torch.zeros(s, device=device) for s in shapes]
    n = sum(t.numel() for t in g16)
    flat_a, flat_b = torch.randn(n, device=device), torch.empty(n, device=device)
    inv = torch.full((), 1 / 1024, device=device)
    found = torch.zeros((), device=device)

    def loop_unscale():                                           # fastai v1: one check and one copy per tensor, a sync each
        bad = False
        for s, d in zip(g16, g32):
            x = float(s.float().sum()); bad |= x != x or x in (float('inf'), -float('inf'))
            d.copy_(s).mul_(1 / 1024)
        return bad
    def foreach_unscale():
        torch._foreach_copy_(g32, g16)
        torch._amp_foreach_non_finite_check_and_unscale_(g32, found, inv)
    def loop_norm(): return torch.stack([t.norm() for t in g32]).norm()
    def foreach_norm(): return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g32)))
    def loop_copy():
        for m, p in zip(m32, p16): p.copy_(m)
    def foreach_copy(): torch._foreach_copy_(p16, m32)
    def loop_step():
        loop_unscale(); n = loop_norm(); c = min(1., 1e3 / (float(n) + 1e-6))
        for d in g32: d.mul_(c)
        opt_loop.step(); loop_copy()
    def foreach_step(opt):                                        # torch's AMP unscale, a foreach clip, `opt` (foreach or fused AdamW), foreach copy
        foreach_unscale(); c = torch.clamp(1e3 / (foreach_norm() + 1e-6), max=1.)
        torch._foreach_mul_(g32, c); opt.step(); foreach_copy()
    def fused_step():
        f = ops.scale_check_(g16, g32, 1 / 1024)
        c = min(1., 1e3 / (float(ops.l2norm(g32)) + 1e-6))
        ops.adam_step_(g32, m32, exp_avg, exp_avg_sq, p16, f, step, c, 1e-3, impl='fused')
    params = [torch.nn.Parameter(m) for m in m32]
    for p, g in zip(params, g32): p.grad = g
    opt_loop = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    opt_foreach = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    opt_torch_fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
    step = torch.zeros((), device=device if device == 'cuda' else 'cpu')

    copy_t = timeit(lambda: flat_b.copy_(flat_a), repeat, device)
    copy_bw = 8 * n / copy_t                                      # fp32 read + write
    rows = []
    def add(op, impl, fn, nbytes):
        t = timeit(fn, repeat, device); bw = nbytes / t
        rows.append((op, impl, t * 1e3, bw / 1e9, bw / copy_bw))
    add('unscale+check', 'loop', loop_unscale, 6 * n); add('unscale+check', 'foreach', foreach_unscale, 6 * n)
    add('unscale+check', 'fused', lambda: ops.scale_check_(g16, g32, 1 / 1024, impl='fused'), 6 * n)
    with normal_stores(): add('unscale+check', 'fused, no NT', lambda: ops.scale_check_(g16, g32, 1 / 1024, impl='fused'), 6 * n)
    add('l2norm', 'loop', loop_norm, 4 * n); add('l2norm', 'foreach', foreach_norm, 4 * n); add('l2norm', 'fused', lambda: ops.l2norm(g32, impl='fused'), 4 * n)
    add('master->model copy', 'loop', loop_copy, 6 * n); add('master->model copy', 'foreach', foreach_copy, 6 * n)
    add('master->model copy', 'fused', lambda: ops.scale_check_(m32, p16, 1., impl='fused'), 6 * n)
    with normal_stores(): add('master->model copy', 'fused, no NT', lambda: ops.scale_check_(m32, p16, 1., impl='fused'), 6 * n)
    step_bytes = 6 * n + 4 * n + 4 * 4 * n + 2 * n              # unscale, norm, Adam (g, p, m, v read; p, m, v written ~), copy
    add('full step (Adam)', 'loop', loop_step, step_bytes); add('full step (Adam)', 'foreach', lambda: foreach_step(opt_foreach), step_bytes)
    add('full step (Adam)', 'torch fused', lambda: foreach_step(opt_torch_fused), step_bytes)
    add('full step (Adam)', 'fused', fused_step, step_bytes)
    # fastai's Adam over fp32 masters of half params: its own step, and the callback's fused step (which also writes the half params)
    from fastai.optimizer import Adam
    from mixedprec.master import MasterParams, Masters
    from mixedprec.engine import fused_plan, fused_opt_step
    halves = [torch.nn.Parameter(t.clone(), requires_grad=False) for t in p16]
    mp = MasterParams([halves], Masters.for_params(halves))
    for m, g in zip(mp.master_params, g32): m.grad = g
    opt_fastai, opt_fused = Adam(mp.master_params, lr=1e-3), Adam(mp.master_params, lr=1e-3)     # two state sets
    plan, clean = fused_plan(opt_fused), torch.zeros((), dtype=torch.bool, device=device)
    adam_bytes = 4 * 7 * n                                         # g read; p, m, v read and written
    add('fastai Adam step', 'loop', opt_fastai.step, adam_bytes)
    add('fastai Adam step', 'fused', lambda: fused_opt_step(opt_fused, plan, mp, clean), adam_bytes + 2 * n)
    return n, len(shapes), copy_bw, rows

def cpu_name() -> str:
    "The CPU's model name and its half-precision units, for the table's title"
    try: name = next(l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name'))
    except (OSError, StopIteration): name = 'unknown CPU'
    units = sorted(f for f in ops.cpu_flags() if f.startswith('amx') or f in ('avx512_bf16', 'avx512_fp16', 'avx512f', 'avx2'))
    return f"{name} ({' '.join(units) or 'no AVX flags'})"

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--sizes', default='resnet50,100m'); ap.add_argument('--repeat', type=int, default=5); ap.add_argument('--device', default='cpu')
    ap.add_argument('--threads', default=None, help="comma-separated thread counts (default: torch's)")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(',')] if a.threads else [torch.get_num_threads()]
    kernels, _ = ops._fused()
    build = f"{ops.backend(torch.zeros(1, device=a.device))} ({kernels.namespace if kernels else 'none'}, streaming from {ops.stream_min_bytes() / 2**20:.0f} MiB of outputs)"
    print(f"torch {torch.__version__}, device {a.device} on {cpu_name()}, fused backend: {build}")
    for name in a.sizes.split(','):
        shapes = {'resnet50': resnet50_like, '100m': hundred_m}[name]()
        print(f"\n{name}:")
        print(f"{'threads':>7}  {'op':<20}{'impl':<14}{'ms':>9}{'GB/s':>8}{'x copy bw':>11}{'x loop':>9}")
        for t in threads:
            torch.set_num_threads(t)
            n, k, copy_bw, rows = run(shapes, a.repeat, a.device)
            print(f"{t:>7}  {n / 1e6:.1f}M params in {k} tensors; plain fp32 copy: {copy_bw / 1e9:.1f} GB/s")
            for op, impl, ms, gbs, rel in rows:
                loop_ms = next(r[2] for r in rows if r[0] == op and r[1] == 'loop')
                print(f"{t:>7}  {op:<20}{impl:<14}{ms:>9.1f}{gbs:>8.1f}{rel:>11.2f}{loop_ms / ms:>9.2f}")

if __name__ == '__main__': main()
