"""A/B of the fused optimizer steps between two commits, side by side in one run: each side's kernels are built from
its own sources (a git worktree of the base commit), and worker processes of the two sides alternate, so that both see
the same machine. Prints one table: the best time of each side per configuration and their ratio.

    python bench/ab.py --base 86db3f4 [--sizes resnet50,100m] [--rounds 3] [--repeat 5] [--device cpu]

Measured so: the cost of taking edits of the half params through `.data` in every step (issue 45 part 3).
"""
import argparse, json, subprocess, sys, tempfile
from pathlib import Path
import torch
from kernels import cpu_name          # the CPU's model name and its half-precision units (bench/ is on the path)

ROOT = Path(__file__).resolve().parent.parent

WORKER = r'''
import json, sys, time, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + '/bench')
from mixedprec import ops
from kernels import resnet50_like, hundred_m
device, repeat = sys.argv[3], int(sys.argv[4])
res = {}
for size in sys.argv[2].split(','):
    shapes = {'resnet50': resnet50_like, '100m': hundred_m}[size]()
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=g).to(device) for s in shapes]
    for out_dtype in (torch.float16, torch.bfloat16):
        out = [m.to(out_dtype) for m in masters]
        grads = [torch.randn(s, generator=g).to(out_dtype).to(device) for s in shapes]
        m1, m2 = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
        steps, flag = [torch.zeros((), device=device) for _ in masters], torch.zeros((), dtype=torch.bool, device=device)
        run = lambda: ops.adam_step_(grads, masters, m1, m2, out, flag, steps, 1., 1e-8, impl='fused')
        run()
        best = float('inf')
        for _ in range(repeat):
            if device == 'cuda': torch.cuda.synchronize()
            t = time.perf_counter(); run()
            if device == 'cuda': torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        res[f"{size} Adam, {str(out_dtype).split('.')[-1]} copy"] = best
print(json.dumps(res))
'''

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--base', required=True, help='the commit to compare the working tree with')
    ap.add_argument('--sizes', default='resnet50,100m'); ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--repeat', type=int, default=5); ap.add_argument('--device', default='cpu')
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / 'base'
        subprocess.run(['git', '-C', str(ROOT), 'worktree', 'add', '--detach', str(base), args.base], check=True, capture_output=True)
        try:
            best = {'base': {}, 'head': {}}
            for r in range(args.rounds):
                for side, tree in (('base', base), ('head', ROOT)):
                    out = subprocess.run([sys.executable, '-c', WORKER, str(tree), args.sizes, args.device, str(args.repeat)],
                                         check=True, capture_output=True, text=True).stdout
                    for k, t in json.loads(out.strip().splitlines()[-1]).items(): best[side][k] = min(t, best[side].get(k, t))
        finally: subprocess.run(['git', '-C', str(ROOT), 'worktree', 'remove', '--force', str(base)], capture_output=True)
    where = cpu_name() if args.device == 'cpu' else f"{args.device}: {torch.cuda.get_device_name()}"
    print(f"fused step, best of {args.rounds} alternating rounds x {args.repeat}; base {args.base}, head = working tree; {where}")
    print(f"| configuration | base ms | head ms | head / base |\n|---|---|---|---|")
    for k in best['base']:
        a, b = best['base'][k] * 1e3, best['head'][k] * 1e3
        print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.3f} |")

if __name__ == '__main__': main()
