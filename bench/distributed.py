"""What the overflow agreement costs: seconds per FP16_Optimizer step over a DDP model on 2 gloo processes (loopback),
with and without the one all-reduce per step that makes the ranks agree. Prints one table.

    python bench/distributed.py [--steps 200]
"""
import argparse, os, socket, sys, tempfile
import torch, torch.multiprocessing as mp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
import dist_workers as W

def free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0]); ap.add_argument('--steps', type=int, default=200)
    a = ap.parse_args()
    out = tempfile.mkdtemp()
    res = {}
    for agree in (False, True, False, True):                     # interleaved, twice, to even out drift
        mp.start_processes(W.main, args=(2, free_port(), 'timed_steps', out, agree, a.steps), nprocs=2, start_method='spawn')   # joins
        t = max(torch.load(os.path.join(out, f'timed_steps{agree}{a.steps}_rank{r}.pt')) for r in range(2))
        res.setdefault(agree, []).append(t)
    off, on = min(res[False]), min(res[True])
    print(f"2 gloo ranks on loopback, 8x Linear(256, 256) fp16 model, batch 64, {a.steps} steps (best of 2 runs)")
    print(f"{'agreement':<12}{'ms/step':>9}")
    print(f"{'off':<12}{off * 1e3:>9.2f}\n{'on':<12}{on * 1e3:>9.2f}\ncost: {(on - off) * 1e3:.2f} ms/step ({100 * (on - off) / off:+.1f}%)")

if __name__ == '__main__': main()
