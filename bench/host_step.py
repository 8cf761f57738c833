"""The host's share of a training step on a model of many small tensors (issue 54): 80 `Linear(64, 64)` (160 tensors),
one thread. The step's share is what an iteration spends after its backward (the unscale, the optimizer step, the scale's
update and clearing the grads), timed by itself at each iteration; configurations side by side in one run, rounds
interleaved at every iteration. Prints a table: each configuration's step (median and quartiles) and its ratio to
torch's autocast + `GradScaler` + fused `AdamW` in the same iteration (median and quartiles).

    python bench/host_step.py [--rounds 7] [--iters 30] [--layers 80] [--dtype bf16|fp16]
"""
import argparse, statistics, sys, time, warnings
from pathlib import Path
import torch
from torch import nn
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import cpu_name

def model(layers):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])

def torch_fp32(layers, dtype):
    m = model(layers); o = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    def fwd_bwd(x): m(x).float().square().mean().backward()
    def step(): o.step(); o.zero_grad()
    return fwd_bwd, step

def torch_autocast(layers, dtype):
    m = model(layers); o = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    sc = torch.amp.GradScaler('cpu', init_scale=1024.)
    def fwd_bwd(x):
        with torch.autocast('cpu', dtype=dtype): loss = m(x).float().square().mean()
        sc.scale(loss).backward()
    def step(): sc.step(o); sc.update(); o.zero_grad()
    return fwd_bwd, step

def mixedprec_amp(layers, dtype, **kw):
    from mixedprec import amp
    m = model(layers); o = torch.optim.AdamW(m.parameters(), lr=1e-4)
    m, o = amp.initialize(m, o, opt_level='O2', half_dtype=dtype, loss_scale=1024., verbosity=0, **kw)
    pending = []
    def fwd_bwd(x):
        loss = m(x).float().square().mean()
        ctx = amp.scale_loss(loss, o); s = ctx.__enter__(); s.backward(); pending.append(ctx)
    def step(): pending.pop().__exit__(None, None, None); o.step(); o.zero_grad()
    return fwd_bwd, step

def mixedprec_fp16_optimizer(layers, dtype, **kw):
    from mixedprec.fp16_optimizer import FP16_Optimizer
    m = model(layers).to(dtype); o = torch.optim.AdamW(m.parameters(), lr=1e-4)
    o = FP16_Optimizer(o, static_loss_scale=1024., verbose=False, **kw)
    def fwd_bwd(x): o.backward(m(x).float().square().mean(), update_master_grads=False)
    def step(): o.update_master_grads(); o.step(); o.zero_grad()
    return fwd_bwd, step

CONFIGS = {
    'torch fp32, fused AdamW': torch_fp32,
    'torch autocast + GradScaler + fused AdamW': torch_autocast,
    'mixedprec amp O2': mixedprec_amp,
    'mixedprec FP16_Optimizer': mixedprec_fp16_optimizer,
}

def prepared(make, layers, dtype):
    "A configuration's `fwd_bwd(x)` and `step()` and its input, warmed up"
    fwd_bwd, step = make(layers, dtype)
    x = torch.randn(16, 64)
    if make is mixedprec_fp16_optimizer: x = x.to(dtype)
    for _ in range(3): fwd_bwd(x); step()
    return fwd_bwd, step, x

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--rounds', type=int, default=7); ap.add_argument('--iters', type=int, default=30)
    ap.add_argument('--layers', type=int, default=80); ap.add_argument('--dtype', default='bf16')
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings('ignore')
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}[args.dtype]
    runs = {name: prepared(make, args.layers, dtype) for name, make in CONFIGS.items()}
    ref = 'torch autocast + GradScaler + fused AdamW'
    times, ratios = interleaved(runs, ref, args.rounds * args.iters)
    print(f"{cpu_name()}, torch {torch.__version__}, 1 thread, {args.layers} Linear(64, 64) ({2 * args.layers} tensors), "
          f"{args.dtype}, {args.rounds * args.iters} iterations, the configurations interleaved")
    table(times, ratios, 'torch autocast + GradScaler')

def interleaved(runs:dict, ref:str, iterations:int) -> tuple:
    ("Each configuration of `runs` ({name: (fwd_bwd, step, x)}) steps once per iteration, in an order that rotates: a "
     "burst of noise from the shared machine lands on all of them. Each step's time, and its ratio to `ref`'s step of "
     "the same iteration")
    times, ratios = {k: [] for k in runs}, {k: [] for k in runs}
    for it in range(iterations):
        names = list(runs)[it % len(runs):] + list(runs)[:it % len(runs)]
        now = {}
        for name in names:
            fwd_bwd, step, x = runs[name]
            fwd_bwd(x)
            t = time.perf_counter(); step(); now[name] = time.perf_counter() - t
        for name, t in now.items(): times[name].append(t); ratios[name].append(t / now[ref])
    return times, ratios

def table(times:dict, ratios:dict, ref:str):
    "Print each configuration's step time and its ratio to the reference's (medians and quartiles)"
    print(f"| configuration | step's share, ms (median, quartiles) | x {ref} (median of each iteration's ratio, "
          "quartiles) |")
    print("|---|---|---|")
    for name in times:
        t, r = statistics.quantiles(times[name], n=4), statistics.quantiles(ratios[name], n=4)
        print(f"| {name} | {t[1] * 1e3:.2f} ({t[0] * 1e3:.2f}-{t[2] * 1e3:.2f}) | {r[1]:.2f} ({r[0]:.2f}-{r[2]:.2f}) |")

if __name__ == '__main__': main()
