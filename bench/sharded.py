"""Bytes per rank, measured from the tensors each rank holds, at 1-4 gloo ranks on loopback: the model's params, the grads
at their peak (after the backward, before the step), the fp32 masters and the optimizer state (Adam: torch's AdamW,
fastai's Adam in the callback), for DDP under FP16_Optimizer, amp O2 and the fastai callback, beside torch's own FSDP2
(`fully_shard` with bf16 compute, fp32 sharded params) and FP16_Optimizer on FSDP2 (fp32, bf16 and 8-bit optimizer
state), with the step time of each FSDP2 configuration against torch's; then the bytes on paper for a 7B-param model at
8, 64 and 512 ranks. Prints the tables. (mixedprec's own ZeRO-1, `shard=True`, is removed: FSDP2 held fewer bytes at
every world size; its last figures are in bench/RESULTS.md.)

    python bench/sharded.py [--width 512] [--layers 8] [--steps 10] [--worlds 1,2,3,4] [--only FSDP2]
"""
import argparse, os, socket, sys, tempfile, time
import torch, torch.multiprocessing as mp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import cpu_name

CONFIGS = ['DDP, FP16_Optimizer', 'DDP, amp O2', 'DDP, fastai callback', 'torch FSDP2 (bf16 compute)', 'FSDP2 + FP16_Optimizer (bf16 compute)', 'FSDP2 + FP16_Optimizer, bf16 state',
           'FSDP2 + FP16_Optimizer, 8-bit state']

def free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def nbytes(tensors) -> int:
    "Bytes of the distinct storages behind `tensors` (a DTensor: its local shard; a 4-byte stand-in counts 4)"
    from torch.distributed.tensor import DTensor
    seen = {}
    for t in tensors:
        if t is None: continue
        if isinstance(t, DTensor): t = t.to_local()
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())

def run(rank, world, port, out, config, width, layers, steps):
    import datetime, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(16, width)
    if 'FP16_Optimizer' in config and 'FSDP2' not in config:
        from mixedprec.fp16_optimizer import FP16_Optimizer
        model = model.half(); net = DDP(model)
        opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), dynamic_loss_scale=True, verbose=False)
        inner = opt.optimizer
        def backward(): opt.zero_grad(); opt.backward(net(x.half()).float().pow(2).mean(), update_master_grads=False)
        unscale, step = opt.update_master_grads, opt.step
    elif 'amp' in config:
        from mixedprec import amp
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)
        net, inner, pending = DDP(model), opt, []
        def backward():
            opt.zero_grad(); cm = amp.scale_loss(net(x).float().pow(2).mean(), opt); pending[:] = [cm]; cm.__enter__().backward()
        def unscale(): pending[0].__exit__(None, None, None)
        step = opt.step
    elif 'fastai' in config:
        return run_fastai(rank, world, out, config, model, x, steps)
    else:
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model: fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        net = model
        opt = inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        def backward(): opt.zero_grad(); net(x).float().pow(2).mean().backward()
        unscale, step = (lambda: None), opt.step
        if 'FP16_Optimizer' in config:        # mixedprec on FSDP2: its sharded fp32 params are the masters
            from mixedprec.fp16_optimizer import FP16_Optimizer
            opt = FP16_Optimizer(inner, verbose=False,
                                 state='bf16' if 'bf16 state' in config else '8bit' if '8-bit' in config else 'fp32')
            def backward(): opt.zero_grad(); opt.backward(net(x).float().pow(2).mean(), update_master_grads=False)
            unscale, step = opt.update_master_grads, opt.step
    model_params = list(model.parameters())
    peak_grads, t = 0, None
    for i in range(steps + 2):
        if i == 2: t = time.perf_counter()
        backward()
        model_grads = nbytes([p.grad for p in model_params])
        unscale()                                        # the half grads into the master grads: for a moment, both are held
        masters = [p for g in inner.param_groups for p in g['params'] if all(p is not q for q in model_params)]
        peak_grads = max(peak_grads, model_grads + nbytes([m.grad for m in masters]))
        step()
    sec = (time.perf_counter() - t) / steps
    masters = [p for g in inner.param_groups for p in g['params'] if all(p is not q for q in model_params)]
    state = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    res = dict(params=nbytes(model_params), grads=peak_grads, masters=nbytes(masters), state=nbytes(state), sec=sec)
    torch.save(res, os.path.join(out, f'{CONFIGS.index(config)}_{world}_{rank}.pt'))
    dist.destroy_process_group()

def run_fastai(rank, world, out, config, model, x, steps):
    "The fastai callback (`to_fp16`, fastai's Adam), the model wrapped in DDP at `before_fit` as fastai's DistributedTrainer does: the same four columns, read in the fit"
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import TensorDataset
    from fastai.learner import Learner
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.optimizer import Adam
    from mixedprec.callback import MixedPrecision
    xs = x.repeat(steps + 2, 1)
    dls = DataLoaders(DataLoader(TensorDataset(xs, torch.zeros(len(xs))), bs=len(x)), DataLoader(TensorDataset(x, torch.zeros(len(x))), bs=len(x)))
    seen = dict(grads=0, t=[])
    class Measure(Callback):
        order = MixedPrecision.order + 1                  # after the callback: DDP around the half model; the unscaled master grads at before_step
        def before_fit(self): self.learn.model = DDP(self.learn.model)
        def after_fit(self): self.learn.model = self.learn.model.module
        def after_backward(self): self.half = nbytes([p.grad for p in self.learn.model.parameters()])
        def before_step(self):
            model_params = list(self.learn.model.parameters())
            masters = [p for g in self.learn.opt.param_lists for p in g if all(p is not q for q in model_params)]
            seen['grads'] = max(seen['grads'], self.half + nbytes([m.grad for m in masters]))
        def after_batch(self): seen['t'].append(time.perf_counter())
    learn = Learner(dls, model, loss_func=lambda pred, y: pred.float().pow(2).mean(), opt_func=Adam, lr=1e-4)
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    learn.to_fp16()
    learn.fit(1, cbs=Measure())
    model_params = list(learn.model.parameters())
    masters = [p for g in learn.opt.param_lists for p in g if all(p is not q for q in model_params)]
    state = [v for st in learn.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    t = seen['t']
    res = dict(params=nbytes(model_params), grads=seen['grads'], masters=nbytes(masters), state=nbytes(state), sec=(t[-1] - t[1]) / (len(t) - 2))
    torch.save(res, os.path.join(out, f'{CONFIGS.index(config)}_{world}_{rank}.pt'))
    dist.destroy_process_group()

def on_paper(n:float, world:int) -> dict:
    ("Bytes per rank for `n` params with AdamW at the grads' peak: half weights and grads, fp32 masters with their grad "
     "buffers, and the state (FSDP2: fp32 sharded params and grads, the state as kept)")
    return {'DDP + mixedprec, fp32 masters': (2 + 2 + 4 + 4 + 8) * n,
            'torch FSDP2 + AdamW': (4 + 4 + 8) * n / world,      # + one layer's unsharded weights and grads while it runs
            'FSDP2 + mixedprec, bf16 state': (4 + 4 + 4) * n / world,
            'FSDP2 + mixedprec, 8-bit state': (4 + 4 + 2 + 4 / 256) * n / world}

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--width', type=int, default=512); ap.add_argument('--layers', type=int, default=8)
    ap.add_argument('--steps', type=int, default=10); ap.add_argument('--worlds', default='1,2,3,4')
    ap.add_argument('--only', default=None, help="only the configurations whose names hold this (e.g. FSDP2)")
    a = ap.parse_args()
    configs = [c for c in CONFIGS if a.only is None or a.only in c]
    worlds = [int(w) for w in a.worlds.split(',')]
    out, res = tempfile.mkdtemp(), {}
    for world in worlds:
        for config in configs:
            mp.start_processes(run, args=(world, free_port(), out, config, a.width, a.layers, a.steps), nprocs=world, start_method='spawn')
            rs = [torch.load(os.path.join(out, f'{CONFIGS.index(config)}_{world}_{r}.pt')) for r in range(world)]
            res[config, world] = {k: max(r[k] for r in rs) for k in rs[0]}          # the fullest rank
    n = a.layers * (a.width * a.width + a.width)
    print(f"{a.layers}x Linear({a.width}, {a.width}) ({n / 1e6:.2f}M params), AdamW, gloo on loopback, 1 thread per rank; CPU: {cpu_name()}")
    print("MiB per rank (the fullest rank), measured from the tensors it holds; grads at their peak (the unscale, when the half grads and\n"
          "the master grads both exist; DDP's own gradient buckets are not counted)\n")
    print(f"| ranks | configuration | params | grads (peak) | fp32 masters | optimizer state | total | step time vs torch's FSDP2 |")
    print("|---|---|---|---|---|---|---|---|")
    for world in worlds:
        for config in configs:
            r = res[config, world]
            total = r['params'] + r['grads'] + r['masters'] + r['state']
            base = res.get(('torch FSDP2 (bf16 compute)', world)) if config.startswith('FSDP2 +') else None
            rel = f"{r['sec'] / base['sec']:.2f}" if base else ''
            print(f"| {world} | {config} | {r['params'] / 2**20:.1f} | {r['grads'] / 2**20:.1f} | {r['masters'] / 2**20:.1f} | {r['state'] / 2**20:.1f} | "
                  f"{total / 2**20:.1f} | {rel} |")
    print("\nOn paper: GiB per rank for a 7B-param model, AdamW (FSDP2 adds one layer's unsharded bf16 weights and grads while it runs)\n")
    ranks = (8, 64, 512)
    print("| scheme | " + " | ".join(f"{w} ranks" for w in ranks) + " |")
    print("|---|" + "---|" * len(ranks))
    for scheme in on_paper(1, 1):
        print(f"| {scheme} | " + " | ".join(f"{on_paper(7e9, w)[scheme] / 2**30:.1f}" for w in ranks) + " |")

if __name__ == '__main__': main()
