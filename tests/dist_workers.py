"Worker processes for test_distributed.py: each runs one scenario on one rank of a 2-process gloo group on loopback"
import os, sys, datetime
from functools import partial
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
    return dict(params=[p.detach().clone() for p in model.parameters()],
                masters=[m.value().clone() for m in opt.engine.masters.trained],
                scaler=opt.scaler.state_dict(), skipped=[r.skipped for r in opt.history],
                    norms=[r.grad_norm for r in opt.history])

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
    return dict(params=[p.detach().clone() for p in model.parameters()],
                masters=[p.detach().clone() for p in amp.master_params(opt)],
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
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=BS if world > 1 else 2 * BS),
                      DataLoader(TensorDataset(x, y), bs=BS))
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
                masters=[mp.conversion.masters.value(p).clone().reshape(-1) for p in learn.model.parameters()],
                scaler=mp.scaler.state_dict(), skipped=[r.skipped for r in mp.history],
                    norms=[r.grad_norm for r in mp.history])

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
    ("Rank 1 stalls (never joins a step); rank 0's step gives up after the agreement's timeout with an error that "
     "names it")
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
    """One rank of `scenario`: its results saved to `outdir`. A rank that finishes leaves with `os._exit(0)`: torch's gloo
    teardown at interpreter exit can abort a process whose results are already saved (pytorch/pytorch#179291, seen once
    in CI as 'terminate called without an active exception'); faulthandler prints every thread's stack should a rank abort"""
    import faulthandler, gc, sys
    faulthandler.enable(all_threads=True)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn = globals()[scenario]
        with_dir = ('ddp_fp16_optimizer', 'amp_ddp', 'fastai_ddp', 'fastai_distrib_ctx', 'amp_clip', 'fsdp2_fp16_optimizer',
                    'fsdp2_fastai', 'fastai_fine_tune_ddp')
        res = (fn(rank, world, outdir, *args) if scenario in with_dir else fn(rank, world, outdir)
               if scenario in ('fastai_callback', 'stalled_peer') else fn(rank, world, *args))
        torch.save(res, os.path.join(outdir, f'{scenario}{"".join(map(str, args))}_rank{rank}.pt'))
        # the scenario's DDP wrappers and pending works go while the group lives
        del res; gc.collect()
    finally: dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)

SHARD_STEPS, SHARD_INJECT = 12, {3: (-1, 'inf'), 7: (0, 'nan')}     # step: (rank that writes it into its grads, what)

def deep_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(),
                         nn.Linear(16, 1))

class Gain(nn.Module):
    "A learnt fp32 gain on the half output"
    def __init__(self): super().__init__(); self.gain = nn.Parameter(torch.ones(1))
    def forward(self, x): return x.float() * self.gain

def ddp_fp16_optimizer(rank, world, outdir, opt_name='adam', ddp=True, save_at=None, resume=False, state='fp32'):
    """FP16_Optimizer over a half MLP and an fp32 param, clipped, with an inf and a nan written into one rank's grads
    after the reduction; with `ddp=False` every rank trains on the whole batch (identical grads at any world size)"""
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = nn.Sequential(*deep_mlp(), Gain()).half()
    # an fp32 param (its own master), inside DDP like the rest
    gain = model[-1].gain; gain.data = gain.data.float()
    net = DDP(model) if (world > 1 and ddp) else model
    params = [{'params': list(model.parameters())[:4]}, {'params': list(model.parameters())[4:], 'lr': 5e-3}]
    inner = torch.optim.Adam(
        params, lr=1e-2, weight_decay=1e-3) if opt_name == 'adam' else torch.optim.SGD(
            params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if state != 'fp32':
        torch.manual_seed(1000 + rank)        # each rank its own torch seed: the stochastic rounding must not follow it
    opt = FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args=dict(init_scale=2.**10, scale_window=3),
                         verbose=False, state=state)
    start = 0
    if resume:
        ck = torch.load(os.path.join(outdir, 'ddp_fp16_optimizer.pt'), weights_only=False)
        model.load_state_dict(ck['model']); opt.load_state_dict(ck['opt']); start = ck['step'] + 1
    clipped = []
    for step in range(start, SHARD_STEPS):
        x, y = data(step)
        x, y = (shard_rows(x, rank, world), shard_rows(y, rank, world)) if ddp else (x, y)
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x.half()), y)
        opt.backward(loss, update_master_grads=False)
        who, what = SHARD_INJECT.get(step, (None, None))
        if who is not None and rank == who % world:
            list(model.parameters())[-3 if what == 'nan' else 0].grad.view(-1)[0] = float(what)
        opt.update_master_grads()
        clipped.append(opt.clip_master_grads(0.5))               # the global norm (-1: overflow)
        opt.step()
        if step == save_at:
            sd = opt.state_dict()
            if rank == 0:
                torch.save(dict(opt=sd, model=model.state_dict(), step=step), os.path.join(outdir, 'ddp_fp16_optimizer.pt'))
    sd = opt.state_dict()
    state = [sorted((k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()) for _, st in sorted(sd['optimizer_state_dict']['state'].items())]
    return dict(params=[p.detach().clone() for p in model.parameters()],
                masters=[m.clone() for m in sd['fp32_from_fp16']], state=state,
                scaler=opt.scaler.state_dict(), skipped=[r.skipped for r in opt.history], norms=clipped,
                nbytes=held_bytes(opt.param_groups, opt.state))

def held_bytes(groups, state) -> int:
    "Bytes of the fp32 masters (and fp32 params) and optimizer state a rank holds"
    ps = {id(p): p for g in groups for p in g['params']}.values()
    return sum(p.untyped_storage().nbytes() for p in ps) + sum(v.untyped_storage().nbytes() for st in state.values() for v in st.values() if isinstance(v, torch.Tensor))

def shard_rows(t, rank, world):
    "Rank `rank`'s share of the global batch's rows at `world` ranks"
    n = len(t) // world
    return t[rank * n:(rank + 1) * n]

def amp_clip(rank, world, outdir, recipe='amp'):
    ("amp O2 over DDP, clipped every step: by `amp.clip_grad_norm_` ('amp'), or by torch's over "
     "`amp.master_params` ('torch', the apex recipe)")
    from mixedprec import amp
    model = deep_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.**8, verbosity=0)
    net, norms = DDP(model), []
    for step in range(STEPS):
        x, y = data(step)
        loss = nn.functional.mse_loss(net(shard_rows(x, rank, world)), shard_rows(y, rank, world))
        with amp.scale_loss(loss, opt) as scaled: scaled.backward()
        norms.append(float(amp.clip_grad_norm_(opt, 0.5) if recipe == 'amp' else torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)))
        opt.step(); opt.zero_grad()
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    return dict(params=[p.detach().clone() for p in model.parameters()], masters=masters, norms=norms)

def amp_ddp(rank, world, outdir, save_at=None, resume=False):
    """amp O2 over DDP, an inf on rank 0 after the reduction; the optimizer's and amp's state dicts.
    `save_at`: rank 0 writes the state at that step; `resume`: a fresh run loads it in apex's order (model, optimizer, amp) and goes on"""
    from mixedprec import amp
    model = deep_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.**8, verbosity=0)
    net = DDP(model)
    start = 0
    if resume:
        ck = torch.load(os.path.join(outdir, 'amp_ddp.pt'), weights_only=True)
        model.load_state_dict(
            ck['model']); opt.load_state_dict(ck['opt']); amp.load_state_dict(ck['amp']); start = ck['step'] + 1
    for step in range(start, STEPS):
        x, y = data(step)
        loss = nn.functional.mse_loss(net(shard_rows(x, rank, world)), shard_rows(y, rank, world))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if step == INJECT_AT and rank == 0: model[2].weight.grad.view(-1)[0] = float('inf')
        opt.step(); opt.zero_grad()
        if step == save_at:
            ck = dict(model=model.state_dict(), opt=opt.state_dict(), amp=amp.state_dict(), step=step)
            if rank == 0: torch.save(ck, os.path.join(outdir, 'amp_ddp.pt'))
            dist.barrier()
    osd, asd = opt.state_dict(), amp.state_dict()
    return dict(params=[p.detach().clone() for p in model.parameters()], masters=asd['masters'][0], scaler=asd['loss_scaler0'], norms=[], state=[sorted((k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()) for _, st in sorted(osd['state'].items())], skipped=[r.skipped for r in amp.history()])

def fastai_opt(name):
    "fastai's Adam, fastai's SGD with momentum, or torch's AdamW in fastai's OptimWrapper"
    from fastai.optimizer import Adam, SGD, OptimWrapper
    return {'adam': Adam, 'sgd': partial(SGD, mom=0.9), 'torch': partial(OptimWrapper, opt=torch.optim.AdamW)}[name]

def state_list(osd) -> list:
    "An optimizer state dict's per-param states in order: fastai's list, or torch's dict by index"
    return osd['state'] if isinstance(osd['state'], list) else [osd['state'][i] for i in sorted(osd['state'])]

def fastai_results(learn, **extra) -> dict:
    ("What the fastai workers return: half params, masters and optimizer state, the scaler and the step history")
    mp = learn.mixed_precision
    masters, opt_sd = mp.state_dict()['masters'], learn.opt.state_dict()
    return dict(params=[p.detach().clone() for p in learn.model.parameters()], masters=[m.clone() if m is not None else None for m in masters], state=[sorted((k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()) for st in state_list(opt_sd)], scaler=mp.scaler.state_dict(), skipped=[r.skipped for r in mp.history], norms=[r.grad_norm for r in mp.history], **extra)

def ddp_fastai_parts(rank, world):
    ("This rank's share of the data as fastai DataLoaders, and a callback that wraps the model in DDP at each fit's "
     "start and takes it back at its end, as fastai's DistributedTrainer does")
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from torch.utils.data import TensorDataset
    from mixedprec.callback import MixedPrecision
    xs, ys = zip(*[data(s) for s in range(STEPS)])
    x, y = torch.cat([shard_rows(t, rank, world) for t in xs]), torch.cat([shard_rows(t, rank, world) for t in ys])
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=2 * BS // world), DataLoader(TensorDataset(x, y), bs=BS))
    class WrapDDP(Callback):
        order = MixedPrecision.order + 1
        def before_fit(self): self.learn.model = DDP(self.learn.model)      # (one rank too: the same broadcast)
        def after_fit(self): self.learn.model = self.learn.model.module
    return dls, WrapDDP

def fastai_ddp(rank, world, outdir, flat=False, opt='adam'):
    ("The fastai callback, flat masters or not, fastai's Adam or SGD, under DDP (wrapped at "
     "before_fit, as fastai's DistributedTrainer does); an inf on rank 1; saved on every rank")
    from fastai.learner import Learner
    from fastai.callback.core import Callback
    from mixedprec.callback import MixedPrecision
    dls, WrapDDP = ddp_fastai_parts(rank, world)
    class Inject(Callback):
        order = MixedPrecision.order - 1
        def before_step(self):
            if self.train_iter == INJECT_AT and rank == 1: self.learn.model.module[0].bias.grad[0] = float('inf')
    opt_func = fastai_opt(opt)
    learn = Learner(dls, deep_mlp(), loss_func=nn.MSELoss(), opt_func=opt_func, lr=1e-2, path=outdir, wd=1e-2)
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    learn.to_fp16(loss_scale=2.**8, clip=0.5, flat_master=flat)
    learn.fit(1, cbs=[WrapDDP(), Inject()])
    import fastai.learner
    # fastai's writer: with no RANK variable, every call writes
    writes, real_save = [], fastai.learner.save_model
    fastai.learner.save_model = lambda *a, **k: (writes.append(rank), real_save(*a, **k))
    try: learn.save(f'ddp{flat}{opt}', with_opt=True)              # rank 0 writes
    finally: fastai.learner.save_model = real_save
    return fastai_results(learn, writes=len(writes))

def fastai_fine_tune_ddp(rank, world, outdir, masters='fp32'):
    ("fastai's fine-tune under DDP (wrapped at each fit's start, as fastai's DistributedTrainer does): a frozen body "
     "without masters for a fit, then unfrozen, its masters made alike on every rank")
    from fastai.learner import Learner
    dls, WrapDDP = ddp_fastai_parts(rank, world)
    model = deep_mlp()
    learn = Learner(dls, model, loss_func=nn.MSELoss(), lr=1e-2, path=outdir, wd=1e-2,
                    splitter=lambda m: [list(m[:4].parameters()), list(m[4:].parameters())])
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    learn.freeze()
    learn.to_bf16(masters=masters)
    learn.fit(2, cbs=WrapDDP())
    conv = learn.mixed_precision.conversion
    body_frozen = [model[0].weight in conv.masters, model[0].weight.requires_grad]
    learn.unfreeze()
    learn.fit(2, cbs=WrapDDP())
    return fastai_results(learn, body=body_frozen + [model[0].weight in conv.masters])

def launched_as(rank, world):
    "The launcher's variables, set as torchrun sets them (fastai's and accelerate's helpers read them)"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))

def fastai_distrib_ctx(rank, world, outdir):
    """The fastai callback under fastai's own `learn.distrib_ctx()` (HF Accelerate's DDP on gloo, the launcher's variables set as torchrun sets
    them), with SaveModelCallback saving every epoch and loading the best at the end on every rank"""
    launched_as(rank, world)
    from fastai.learner import Learner
    from fastai.callback.core import Callback
    from fastai.callback.tracker import SaveModelCallback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.optimizer import Adam
    import fastai.distributed
    # fastai's own moves the indices to CUDA (for NCCL): gloo takes them on the CPU
    def cpu_broadcast(self, t, rank):
        t = torch.tensor(t, dtype=torch.long); dist.broadcast(t, rank); return t.tolist()
    fastai.distributed.DistributedDL._broadcast = cpu_broadcast
    from torch.utils.data import TensorDataset
    from mixedprec.callback import MixedPrecision
    xs, ys = zip(*[data(s) for s in range(STEPS)])
    # the whole data on every rank: DistributedDL gives each rank its part
    x, y = torch.cat(xs), torch.cat(ys)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=BS), DataLoader(TensorDataset(x, y), bs=BS))
    class Inject(Callback):
        order = MixedPrecision.order - 1
        def before_step(self):
            if self.epoch == 0 and self.iter == 1 and rank == 1:
                next(self.learn.model.parameters()).grad.view(-1)[0] = float('inf')
    learn = Learner(dls, deep_mlp(), loss_func=nn.MSELoss(), opt_func=Adam, lr=1e-2, path=outdir, wd=1e-2)
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    learn.to_fp16(loss_scale=2.**8, clip=0.5)
    with learn.distrib_ctx(cpu=True, sync_bn=False):
        learn.fit(3, cbs=[Inject(), SaveModelCallback(fname='best', with_opt=True, every_epoch=False)])
    return fastai_results(learn, model_type=type(learn.model).__name__)

def rounding_ranks(rank, world, masters='none', state='fp32'):
    ("FP16_Optimizer over a bf16 MLP under DDP, each rank seeded apart before it is built: what stochastic rounding "
     "leaves on each rank")
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = deep_mlp().bfloat16()
    net = DDP(model)
    # each rank its own torch seed, as launchers leave it when nobody seeds
    torch.manual_seed(1000 + rank)
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), verbose=False, masters=masters, state=state)
    for step in range(6):
        x, y = data(step)
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(net(shard_rows(x, rank, world).bfloat16()).float(),
                                            shard_rows(y, rank, world)))
        opt.step()
    return dict(params=[p.detach().clone() for p in model.parameters()], state=[v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0])

FSDP2_STEPS, FSDP2_INJECT, FSDP2_ROWS = 8, 4, 24      # the global batch: 24 rows, split evenly at 1, 2, 3 or 4 ranks

def fsdp2_data(step):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(FSDP2_ROWS, 6, generator=g)
    return x, x.sum(1, keepdim=True) * 0.3

def fsdp2_loss(params) -> float:
    "The loss of `deep_mlp` with `params` on a batch no step trained on"
    model = deep_mlp()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params): p.copy_(v)
        x, y = fsdp2_data(99)
        return float(nn.functional.mse_loss(model(x), y))

def fsdp2_reference(clip=1.0, lr=1e-2, skip_at=None, norm_type=2.):
    "The same steps unsharded, in fp32 with torch's AdamW (step `skip_at` skipped): clip norms, final params, losses"
    model = deep_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    norms, start = [], fsdp2_loss(model.parameters())
    for step in range(FSDP2_STEPS):
        x, y = fsdp2_data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type)) if step != skip_at else -1.)
        if step != skip_at: opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    return dict(norms=norms, params=params, start=start, loss=fsdp2_loss(params))

def fsdp2_checkpoint(model, optimizer, scaler, path, load=False):
    ("Save (or load) the model, the (inner torch) optimizer and the loss scaler with torch.distributed.checkpoint (DCP), "
     "as a user does")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {'model': model_sd, 'optim': optim_sd, 'loss_scaler': scaler.state_dict()}
    if not load: dcp.save(sd, checkpoint_id=path); return
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd['model'], optim_state_dict=sd['optim'])
    scaler.load_state_dict(sd['loss_scaler'])

class Fsdp2Amp:
    "amp O2 over an FSDP2 model behind FP16_Optimizer's few calls, so one scenario drives both front ends"
    def __init__(self, model, optimizer, dtype, state):
        from mixedprec import amp
        self.amp = amp
        model, self.opt = amp.initialize(model, optimizer, opt_level='O2',
                                         loss_scale='dynamic' if dtype == 'fp16' else 1.0, max_loss_scale=2.**10, verbosity=0,
                                         state=state)
        self.optimizer, self.scaler, self.pending = self.opt.optimizer, amp._state.scaler(0), None
    def zero_grad(self): self.opt.zero_grad()
    def backward(self, loss, update_master_grads=False, delay=False):
        if delay:                  # a micro-batch of an accumulated step: amp's own idiom
            with self.amp.scale_loss(loss, self.opt, delay_unscale=True) as scaled: scaled.backward()
            return
        self.pending = self.amp.scale_loss(loss, self.opt); self.pending.__enter__().backward()
    def update_master_grads(self): self.pending.__exit__(None, None, None)
    def clip_master_grads(self, clip, norm_type=2.): return self.amp.clip_grad_norm_(self.opt, clip, norm_type)
    engine = property(lambda self: self.amp._engine_of(self.opt)[0])
    def step(self): self.opt.step()
    state = property(lambda self: self.optimizer.state)
    history = property(lambda self: self.amp.history())
    masters = property(lambda self: self.amp._engine_of(self.opt)[0].masters)

def accelerate_fsdp2(rank, world, model, optimizer, policy):
    ("`accelerator.prepare(model, optimizer)` with accelerate's FSDP2 plugin (each Linear wrapped, then the root; "
     "the optimizer's params switched to the shards) and mixed_precision='no': accelerate's own code, with the "
     "distributed type it picks on GPUs (on CPUs it picks DDP)")
    launched_as(rank, world)
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, DistributedType
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy,
                                            auto_wrap_policy='transformer_based_wrap',
                                            transformer_cls_names_to_wrap=['Linear'])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # what accelerate's state sets on GPUs (state.py: the FSDP type and the plugin)
    accelerator.state.distributed_type = PartialState._shared_state['distributed_type'] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    accelerate_fsdp2.accelerator = accelerator           # for a scenario that calls accelerate's own clip
    return accelerator.prepare(model, optimizer)

def fsdp2_fp16_optimizer(rank, world, outdir, dtype='fp16', state='fp32', inject=False, save_at=None, resume=False,
                         front='fp16_optimizer', clip=1.0, lr=1e-2, inner='adamw', wrap='fully_shard', accumulate=False,
                         norm_type=2., accelerate_clip=False):
    ("FP16_Optimizer over `deep_mlp` wrapped layer by layer in FSDP2 with a `dtype` compute policy and fp32 "
     "reduction, clipped every step; with `inject`, an inf written into rank 1's shard of a grad at one step; a DCP "
     "checkpoint saved after step `save_at`, or (`resume`) loaded and the steps after it run; `front='amp'`: amp O2; "
     "`inner='sgd'`: FP16_Optimizer over torch's SGD with momentum; `wrap='accelerate'`: the model and the optimizer "
     "prepared by accelerate's FSDP2 plugin (`accelerate_fsdp2`), its AcceleratedOptimizer given to the front end; "
     "`accumulate`: each step from two micro-batches, the first without gradient sync (torch's idiom); `norm_type`: "
     "the clip's norm; `accelerate_clip`: the clip by accelerate's `accelerator.clip_grad_norm_`, as its users write it")
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = deep_mlp()
    policy = MixedPrecisionPolicy(param_dtype={'fp16': torch.float16, 'bf16': torch.bfloat16, 'fp32': None}[dtype],
                                  reduce_dtype=torch.float32)
    make = lambda m: (torch.optim.AdamW(m.parameters(), lr=lr) if inner == 'adamw' else
                      torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, dampening=0.1) if inner == 'sgd_dampening'
                      else torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, nesterov=True))
    if wrap == 'accelerate': model, optimizer = accelerate_fsdp2(rank, world, model, make(model), policy)
    else:
        for layer in model:
            if isinstance(layer, nn.Linear): fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = make(model)
    if front == 'amp': opt = Fsdp2Amp(model, optimizer, dtype, state)
    else: opt = FP16_Optimizer(optimizer, dynamic_loss_scale=dtype == 'fp16',
                         dynamic_loss_args=dict(init_scale=2.**10) if dtype == 'fp16' else None, verbose=False,
                         state=state)
    norms, path = [], os.path.join(outdir, f'dcp_{dtype}_{state}_{inner}')
    if resume: fsdp2_checkpoint(model, opt.optimizer, opt.scaler, path, load=True)
    for step in range(save_at + 1 if resume else 0, FSDP2_STEPS):
        x, y = fsdp2_data(step)
        opt.zero_grad()
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)
        for j, (xj, yj) in enumerate(zip(x.chunk(2), y.chunk(2)) if accumulate else [(x, y)]):
            last = j == 1 or not accumulate
            if accumulate: model.set_requires_gradient_sync(last)      # FSDP2 keeps the first one's grads itself
            loss = nn.functional.mse_loss(model(xj).float(), yj) / (2 if accumulate else 1)
            if front == 'amp': opt.backward(loss, update_master_grads=False, delay=not last)
            else: opt.backward(loss, update_master_grads=False)
        if inject and step == FSDP2_INJECT and rank == 1: model[2].weight.grad.to_local()[0, 0] = float('inf')
        opt.update_master_grads()
        if accelerate_clip:
            norms.append(float(accelerate_fsdp2.accelerator.clip_grad_norm_(model.parameters(), clip, norm_type)))
        else: norms.append(float(opt.clip_master_grads(clip, norm_type)))
        opt.step()
        if step == save_at and not resume: fsdp2_checkpoint(model, opt.optimizer, opt.scaler, path)
    full = [p.full_tensor().detach().clone() for p in model.parameters()]   # every rank gathers
    states = {k: v.dtype for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim()}
    ref = fsdp2_reference(clip, lr, FSDP2_INJECT if inject else None, norm_type) if rank == 0 else None
    return dict(norms=norms, params=full, loss=fsdp2_loss(full), skipped=[r.skipped for r in opt.history],
                named=[r.params for r in opt.history], scaler=opt.scaler.state_dict(), state_dtypes=states,
                masters=len(opt.engine.masters.trained), reference=ref, given=type(optimizer).__name__,
                wrapped=sum(type(m).__name__.startswith('FSDP') for m in model.modules()),
                runner=repr(opt.engine.runner))

def fsdp2_fastai(rank, world, outdir, dtype='fp16', state='fp32', inject=False, save_at=None, resume=False,
                 opt='fastai', clip=1.0, lr=1e-2):
    ("A fastai Learner over `deep_mlp` wrapped layer by layer in FSDP2 (a `dtype` compute policy, fp32 reduction), "
     "`to_fp16()`/`to_bf16()` clipping at `clip`, the same steps as `fsdp2_fp16_optimizer`, with fastai's Adam "
     "(`opt='fastai'`) or torch's AdamW (`'torch'`, through fastai's OptimWrapper); `save_at`: two fits, with "
     "`learn.save` (a DCP folder) between them, or (`resume`) `learn.load` and the second fit only")
    from pathlib import Path
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    from torch.utils.data import TensorDataset
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import Adam, OptimWrapper
    from fastai.callback.core import Callback
    from helpers import quiet
    import mixedprec.callback
    model = deep_mlp()
    policy = MixedPrecisionPolicy(param_dtype={'fp16': torch.float16, 'bf16': torch.bfloat16}[dtype],
                                  reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear): fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    def dls(steps):
        xs, ys = zip(*[fsdp2_data(s) for s in steps])
        x, y = fsdp2_data(99)
        rows = FSDP2_ROWS // world
        return DataLoaders(
            DataLoader(TensorDataset(torch.cat([shard_rows(x, rank, world) for x in xs]),
                                     torch.cat([shard_rows(y, rank, world) for y in ys])), bs=rows),
            DataLoader(TensorDataset(shard_rows(x, rank, world), shard_rows(y, rank, world)), bs=rows))
    class Inject(Callback):
        "An inf in rank 1's shard of a grad at step FSDP2_INJECT (`first`: the first step of this fit)"
        first = 0
        def after_backward(self):
            if self.learn.train_iter + self.first == FSDP2_INJECT and rank == 1:
                self.learn.model[2].weight.grad.to_local()[0, 0] = float('inf')
    inj = Inject()
    opt_func = partial(Adam, sqr_mom=0.999, eps=1e-8, wd=0.01) if opt == 'fastai' else partial(
        OptimWrapper, opt=torch.optim.AdamW)
    learn = quiet(Learner(dls(range(FSDP2_STEPS)), model, loss_func=nn.MSELoss(), opt_func=opt_func,
                          cbs=[inj] if inject else []))
    if dtype == 'fp16': learn.to_fp16(loss_scale=2.**10, clip=clip, state=state)
    else: learn.to_bf16(clip=clip, state=state)
    learn.path = Path(outdir)
    name = f'dcp_fastai_{opt}_{dtype}_{state}'
    if save_at is None: learn.fit(1, lr)
    else:
        if resume: learn.load(name)
        else:
            learn.dls = dls(range(save_at + 1)); learn.fit(1, lr)
            learn.save(name)
        inj.first = save_at + 1; learn.dls = dls(range(save_at + 1, FSDP2_STEPS)); learn.fit(1, lr)
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    raw = learn.opt.opt
    st = getattr(raw, 'opt', raw).state
    states = {k: v.dtype for s in st.values() for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim()}
    mp = learn.mixed_precision
    ref = fsdp2_reference(clip, lr, FSDP2_INJECT if inject else None) if rank == 0 else None
    return dict(params=full, loss=fsdp2_loss(full), skipped=[r.skipped for r in mp.history],
                norms=[r.grad_norm for r in mp.history],
                named=[r.params for r in mp.history], scaler=mp.scaler.state_dict(), state_dtypes=states,
                masters=len(mp.engine.masters.trained), fsdp2=mp.engine.masters.fsdp2, reference=ref)
