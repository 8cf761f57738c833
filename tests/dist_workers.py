"Worker processes for test_distributed.py: each runs one scenario on one rank of a 2-process gloo group on loopback"
import os, sys, datetime
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, INJECT_AT, BS = 6, 3, 8

def data(step):
    "The global batch of `step`: rank r trains on rows r*BS..(r+1)*BS-1"
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * BS, 6, generator=g)
    return x, x.sum(1, keepdim=True) * 0.3

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

def shard(t, rank, world): return t if world == 1 else t[rank * BS:(rank + 1) * BS]

def fp16_optimizer(rank, world, inject_rank=1, agree=True, decide='cuda'):
    "FP16_Optimizer over a DDP-wrapped half model; an inf written into rank `inject_rank`'s grads after DDP's reduction"
    from mixedprec.fp16_optimizer import FP16_Optimizer
    from mixedprec import distributed
    distributed.set_process_group(None, enabled=agree)
    model = mlp().half()
    net = DDP(model) if world > 1 else model
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), dynamic_loss_scale=True,
                         dynamic_loss_args=dict(init_scale=2.**8, scale_window=2), verbose=False,
                         decide=decide)            # 'always': the skip decided on the device (here the CPU), as on GPUs
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(shard(x, rank, world).half()).float(), shard(y, rank, world))
        opt.backward(loss, update_master_grads=False)
        if step == INJECT_AT and rank == inject_rank: model[0].weight.grad[0, 0] = float('inf')
        opt.update_master_grads(); opt.clip_master_grads(10.); opt.step()
    return dict(params=[p.detach().clone() for p in model.parameters()], masters=[m.detach().clone() for _, m, _ in opt.masters.pairs],
                scaler=opt.scaler.state_dict(), skipped=[r.skipped for r in opt.history], norms=[r.grad_norm for r in opt.history])

def amp_no_sync(rank, world, decide='cuda'):
    "amp O2 with two micro-batches per step, the first under no_sync; an inf on rank 0 after the reduction"
    from mixedprec import amp
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.**8, verbosity=0, decide=decide)
    net = DDP(model) if world > 1 else model
    for step in range(STEPS):
        x, y = data(step)
        xs, ys = shard(x, rank, world), shard(y, rank, world)
        for micro in range(2):
            half = slice(micro * len(xs) // 2, (micro + 1) * len(xs) // 2)
            ctx = net.no_sync() if (world > 1 and micro == 0) else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            with ctx:
                loss = nn.functional.mse_loss(net(xs[half]), ys[half]) / 2
                with amp.scale_loss(loss, opt, delay_unscale=micro == 0) as scaled:
                    scaled.backward()
                    if micro == 1 and step == INJECT_AT and rank == 0: model[2].weight.grad.view(-1)[0] = float('nan')
        opt.step(); opt.zero_grad()
    return dict(params=[p.detach().clone() for p in model.parameters()], masters=[p.detach().clone() for p in amp.master_params(opt)],
                scaler=amp._state.scalers[0].state_dict(), skipped=[r.skipped for r in amp.history()])

def fastai_callback(rank, world, outdir=None):
    "The fastai callback with flat masters, the model wrapped in DDP at before_fit as fastai's DistributedTrainer does"
    from fastai.learner import Learner
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.optimizer import Adam
    from torch.utils.data import TensorDataset
    import mixedprec.callback
    from mixedprec.callback import MixedPrecision
    xs, ys = zip(*[data(s) for s in range(STEPS)])
    x, y = torch.cat([shard(t, rank, world) for t in xs]), torch.cat([shard(t, rank, world) for t in ys])
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=BS if world > 1 else 2 * BS), DataLoader(TensorDataset(x, y), bs=BS))
    class WrapDDP(Callback):
        order = MixedPrecision.order + 1
        def before_fit(self): self.learn.model = DDP(self.learn.model) if world > 1 else self.learn.model
        def after_fit(self): self.learn.model = getattr(self.learn.model, 'module', self.learn.model)
    class Inject(Callback):
        order = MixedPrecision.order - 1
        def before_step(self):
            if self.train_iter == INJECT_AT and rank == 1: self.learn.model.module[0].bias.grad[0] = float('inf')
    learn = Learner(dls, mlp(), loss_func=nn.MSELoss(), opt_func=Adam, lr=1e-2, path=outdir or '.')
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    learn.to_fp16(loss_scale=2.**8, flat_master=True, clip=5.)
    learn.fit(1, cbs=[WrapDDP(), Inject()])
    if rank == 0 and outdir: learn.save('ddp', with_opt=True)
    mp = learn.mixed_precision
    return dict(params=[p.detach().clone() for p in learn.model.parameters()],
                masters=[mp.conversion.masters.get(p, p).detach().clone().reshape(-1) for p in learn.model.parameters()],
                scaler=mp.scaler.state_dict(), skipped=[r.skipped for r in mp.history], norms=[r.grad_norm for r in mp.history])

def timed_steps(rank, world, agree, n=200):
    "Seconds per FP16_Optimizer step over a DDP model, with or without the overflow agreement"
    import time
    from mixedprec import distributed
    from mixedprec.fp16_optimizer import FP16_Optimizer
    distributed.set_process_group(None, enabled=agree)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).half()
    net = DDP(model)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3), dynamic_loss_scale=True, verbose=False)
    x = torch.randn(64, 256).half()
    for i in range(n + 20):
        if i == 20: start = time.perf_counter()
        opt.zero_grad(); opt.backward(net(x).float().pow(2).mean()); opt.step()
    return (time.perf_counter() - start) / n

def stalled_peer(rank, world, outdir):
    "Rank 1 stalls (never joins a step); rank 0's step gives up after the agreement's timeout with an error that names it"
    import time
    from mixedprec import distributed
    from mixedprec.fp16_optimizer import FP16_Optimizer
    distributed.set_process_group(None, timeout=2.)
    if rank == 1:
        time.sleep(15); os._exit(0)
    model = mlp().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), verbose=False)
    t = time.monotonic()
    try: opt.backward(model(data(0)[0][:BS].half()).float().sum()); res = {'error': None}
    except RuntimeError as e: res = {'error': str(e)}
    res['waited'] = time.monotonic() - t
    torch.save(res, os.path.join(outdir, f'stalled_peer_rank{rank}.pt'))
    os._exit(0)                                       # the group is broken: no clean shutdown to wait for

def main(rank, world, port, scenario, outdir, *args):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn = globals()[scenario]
        res = fn(rank, world, *args) if scenario not in ('fastai_callback', 'stalled_peer') else fn(rank, world, outdir)
        torch.save(res, os.path.join(outdir, f'{scenario}{"".join(map(str, args))}_rank{rank}.pt'))
    finally: dist.destroy_process_group()
