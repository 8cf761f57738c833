"""Bytes of fp32 masters + Adam state per rank against world size, sharded (ZeRO stage 1) and not, and the step's cost, on gloo ranks on
loopback: FP16_Optimizer over a DDP-wrapped half model. Prints one table.

    python bench/sharded.py [--width 512] [--layers 8] [--steps 30]
"""
import argparse, os, socket, sys, tempfile, time
import torch, torch.multiprocessing as mp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
import dist_workers as W
from kernels import cpu_name

def free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def run(rank, world, port, out, shard, width, layers, steps):
    import datetime, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from mixedprec.fp16_optimizer import FP16_Optimizer
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).half()
    net = DDP(model)
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), dynamic_loss_scale=True, verbose=False, shard=shard)
    x = torch.randn(16, width).half()
    for i in range(steps + 3):
        if i == 3: t = time.perf_counter()
        opt.zero_grad(); opt.backward(net(x).float().pow(2).mean()); opt.step()
    torch.save(dict(nbytes=W.held_bytes(opt.param_groups, opt.state), sec=(time.perf_counter() - t) / steps), os.path.join(out, f'{shard}{world}_{rank}.pt'))
    dist.destroy_process_group()

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--width', type=int, default=512); ap.add_argument('--layers', type=int, default=8); ap.add_argument('--steps', type=int, default=30)
    a = ap.parse_args()
    out, rows = tempfile.mkdtemp(), []
    for world in (1, 2, 3):
        res = {}
        for shard in (False, True):
            mp.start_processes(run, args=(world, free_port(), out, shard, a.width, a.layers, a.steps), nprocs=world, start_method='spawn')
            rs = [torch.load(os.path.join(out, f'{shard}{world}_{r}.pt')) for r in range(world)]
            res[shard] = max(r['nbytes'] for r in rs), max(r['sec'] for r in rs)
        rows.append((world, res))
    n = a.layers * (a.width * a.width + a.width)
    print(f"{a.layers}x Linear({a.width}, {a.width}) fp16 ({n / 1e6:.1f}M params), FP16_Optimizer(AdamW), gloo on loopback, 1 thread per rank; CPU: {cpu_name()}")
    print(f"{'ranks':<7}{'MiB/rank unsharded':>20}{'MiB/rank sharded':>18}{'ratio':>7}{'step time sharded/unsharded':>29}")
    for world, res in rows:
        (b0, t0), (b1, t1) = res[False], res[True]
        print(f"{world:<7}{b0 / 2**20:>20.1f}{b1 / 2**20:>18.1f}{b1 / b0:>7.2f}{t1 / t0:>29.2f}")

if __name__ == '__main__': main()
