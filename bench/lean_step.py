"""The lean optimizer step on the CPU against torch's fp32 AdamW (issue 55): bf16 weights with split masters and 8-bit
Adam state (6 bytes a param) through amp O2 and FP16_Optimizer, and bf16 with fp32 masters, against torch's AdamW on an
fp32 model (foreach, its CPU default, and fused). A stack of Linear layers shaped as a transformer's (per block
d->3d, 3d->d, d->4d, 4d->d): about 0.23M params at d=64 and 14.7M at d=512. One thread; the step's share of each
iteration (unscale, step, clearing the grads), the configurations interleaved at every iteration, each step divided by
torch foreach AdamW's of the same iteration. Prints a table per size. With `--parts`, a second table: the step's parts
under FP16_Optimizer (the unscale, the step, `zero_grad`), for each master kind and state store, interleaved alike.

    python bench/lean_step.py [--widths 64,512] [--iters 60] [--parts]
"""
import argparse, statistics, sys, time, warnings
from pathlib import Path
import torch
from torch import nn
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import cpu_name
from host_step import interleaved, table

def model(width):
    torch.manual_seed(0)
    layers = []
    for _ in range(4): layers += [nn.Linear(width, 3 * width), nn.Linear(3 * width, width), nn.Linear(width, 4 * width),
                                  nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)

def torch_adamw(width, **kw):
    m = model(width); o = torch.optim.AdamW(m.parameters(), lr=1e-4, **kw)
    def fwd_bwd(x): m(x).float().square().mean().backward()
    def step(): o.step(); o.zero_grad()
    return fwd_bwd, step, torch.randn(8, width)

def amp_o2(width, **kw):
    from mixedprec import amp
    m = model(width)
    m, o = amp.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-4), opt_level='O2', half_dtype='bf16', verbosity=0,
                          **kw)
    pending = []
    def fwd_bwd(x):
        ctx = amp.scale_loss(m(x).float().square().mean(), o); ctx.__enter__().backward(); pending.append(ctx)
    def step(): pending.pop().__exit__(None, None, None); o.step(); o.zero_grad()
    return fwd_bwd, step, torch.randn(8, width)

def fp16_optimizer_parts(width, **kw):
    "A bf16 model under FP16_Optimizer: its forward and backward, its step's three calls (unscale, step, zero_grad), x"
    from mixedprec.fp16_optimizer import FP16_Optimizer
    m = model(width).bfloat16()
    o = FP16_Optimizer(torch.optim.AdamW(m.parameters(), lr=1e-4), verbose=False, **kw)
    def fwd_bwd(x): o.backward(m(x).float().square().mean(), update_master_grads=False)
    return fwd_bwd, (o.update_master_grads, o.step, o.zero_grad), torch.randn(8, width).bfloat16()

def fp16_optimizer(width, **kw):
    fwd_bwd, calls, x = fp16_optimizer_parts(width, **kw)
    def step():
        for call in calls: call()
    return fwd_bwd, step, x

CONFIGS = {
    'torch AdamW (foreach), fp32 model': lambda w: torch_adamw(w, foreach=True),
    'torch AdamW (fused), fp32 model': lambda w: torch_adamw(w, fused=True),
    'amp O2 bf16, fp32 masters': lambda w: amp_o2(w),
    "amp O2 bf16, masters='split', state='8bit'": lambda w: amp_o2(w, masters='split', state='8bit'),
    "FP16_Optimizer bf16, masters='split', state='8bit'": lambda w: fp16_optimizer(w, masters='split', state='8bit'),
}

PARTS = {"masters='fp32', state='fp32'": {}, "masters='fp32', state='8bit'": dict(state='8bit'),
         "masters='split', state='fp32'": dict(masters='split'), "masters='split', state='bf16'": dict(
             masters='split', state='bf16'), "masters='split', state='8bit'": dict(masters='split', state='8bit'),
         "masters='none', state='8bit'": dict(masters='none', state='8bit')}

def parts(width, iters):
    "The unscale, the step and `zero_grad` of FP16_Optimizer's bf16 step for each of `PARTS`: a table of medians, ms"
    runs = {name: fp16_optimizer_parts(width, **kw) for name, kw in PARTS.items()}
    took = {k: ([], [], []) for k in runs}
    for it in range(iters + 3):
        for name in list(runs)[it % len(runs):] + list(runs)[:it % len(runs)]:
            fwd_bwd, calls, x = runs[name]
            fwd_bwd(x)
            t = [time.perf_counter()]
            for call in calls: call(); t.append(time.perf_counter())
            if it >= 3:
                for i in range(3): took[name][i].append(t[i + 1] - t[i])
    print("| FP16_Optimizer bf16, AdamW | unscale, ms | step, ms | zero_grad, ms | the three |\n|---|---|---|---|---|")
    for name, ts in took.items():
        med = [statistics.median(t) * 1e3 for t in ts]
        print(f"| {name} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {sum(med):.2f} |")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--widths', default='64,512'); ap.add_argument('--iters', type=int, default=60)
    ap.add_argument('--parts', action='store_true', help="also the step's parts for each master kind and state store")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings('ignore')
    for width in map(int, args.widths.split(',')):
        runs = {}
        for name, make in CONFIGS.items():
            fwd_bwd, step, x = make(width)
            for _ in range(3): fwd_bwd(x); step()
            runs[name] = (fwd_bwd, step, x)
        n = sum(p.numel() for p in model(width).parameters())
        times, ratios = interleaved(runs, 'torch AdamW (foreach), fp32 model', args.iters)
        print(f"\n{cpu_name()}, torch {torch.__version__}, 1 thread, d={width}: {n / 1e6:.2f}M params in 32 tensors, "
              f"{args.iters} iterations, the configurations interleaved")
        table(times, ratios, 'torch AdamW (foreach)')
        if args.parts: print(); parts(width, args.iters)

if __name__ == '__main__': main()
