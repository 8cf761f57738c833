"""End-to-end training benchmark on the CPU: the same model, data and batch size in fp32, mixedprec's to_fp16() and
to_bf16(), fastai 2.8's own to_fp16() and to_bf16(), and plain torch.autocast('cpu', bfloat16) on the fp32 model.
Each configuration runs in its own process (for its peak RSS). Prints one table.

    python bench/train.py [--models cnn,transformer,resnet50] [--steps 40] [--max-seconds 60] [--bs 64] [--device cpu|cuda]
"""
import argparse, json, os, resource, subprocess, sys, time

CONFIGS = ['fp32', 'mixedprec fp16', 'mixedprec bf16', 'fastai fp16', 'fastai bf16', 'autocast bf16']

def make_model(kind):
    from torch import nn
    if kind == 'resnet50':
        import torchvision
        return torchvision.models.resnet50(num_classes=10)
    if kind == 'cnn':
        def block(ci, co, stride):
            return nn.Sequential(nn.Conv2d(ci, co, 3, stride, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU(),
                                 nn.Conv2d(co, co, 3, 1, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU())
        return nn.Sequential(block(3, 32, 1), block(32, 64, 2), block(64, 128, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 128)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 512, dropout=0., batch_first=True), 2)
            self.head = nn.Linear(128, 10)
        def forward(self, ids): return self.head(self.enc(self.emb(ids)).mean(1))
    return Encoder()

def make_data(kind, n, seed=0):
    "A learnable synthetic task: labels from a fixed random teacher"
    import torch
    g = torch.Generator().manual_seed(seed)
    if kind in ('cnn', 'resnet50'):
        size = 32 if kind == 'cnn' else 128
        x = torch.randn(n, 3, size, size, generator=g)
        w = torch.randn(3 * size * size, 10, generator=g)
        return x, (x.flatten(1) @ w).argmax(1)
    ids = torch.randint(0, 1000, (n, 64), generator=g)
    w = torch.randn(1000, 10, generator=g)
    return ids, w[ids].sum(1).argmax(1)

def worker(model_kind, config, steps, max_seconds, bs, device='cpu'):
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.optimizer import Adam
    from fastai.callback.core import Callback, CancelFitException
    import mixedprec.callback as mpcb, mixedprec.master as master
    torch.manual_seed(0)
    x, y = make_data(model_kind, bs * steps + 512)
    dls = DataLoaders(DataLoader(TensorDataset(x[:-512], y[:-512]), bs=bs, shuffle=False, drop_last=True), DataLoader(TensorDataset(x[-512:], y[-512:]), bs=256), device=device)
    learn = Learner(dls, make_model(model_kind).to(device), loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=2e-3)
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    if config == 'mixedprec fp16': learn.to_fp16()
    elif config == 'mixedprec bf16': learn.to_bf16()
    elif config == 'fastai fp16': mpcb.fastai_to_fp16(learn)
    elif config == 'fastai bf16': mpcb.fastai_to_bf16(learn)
    book = [0.]
    if config.startswith('mixedprec'):                            # time mixedprec's own per-step bookkeeping
        def timed(f):
            def g(*a, **k):
                t = time.perf_counter(); r = f(*a, **k); book[0] += time.perf_counter() - t; return r
            return g
        mpcb.unscale_step = timed(mpcb.unscale_step)
        master.MasterParams.masters_to_model = timed(master.MasterParams.masters_to_model)
        master.MasterParams.zero_model_grads = timed(master.MasterParams.zero_model_grads)
    class Autocast(Callback):
        def before_batch(self): self.ctx = torch.autocast(device, dtype=torch.bfloat16); self.ctx.__enter__()
        def after_loss(self): self.ctx.__exit__(None, None, None)
    syncs = [0]
    class Budget(Callback):
        order = 100
        def before_fit(self): self.n, self.t0 = 0, None
        def after_batch(self):
            if not self.training: return
            self.n += 1
            if device == 'cuda': torch.cuda.synchronize()
            if self.n == 2:
                self.t0 = time.perf_counter(); book[0] = 0.
                if device == 'cuda': torch.cuda.set_sync_debug_mode('warn'); syncs[0] = 0
            if self.n >= steps or (self.t0 and time.perf_counter() - self.t0 > max_seconds):
                self.t1 = time.perf_counter()
                if device == 'cuda': torch.cuda.set_sync_debug_mode(0)
                raise CancelFitException()
    if device == 'cuda':                                          # count host syncs: the sync debug mode warns on each
        import warnings
        def count(message, *a, **k):
            if 'synchroniz' in str(message).lower(): syncs[0] += 1
        warnings.showwarning = count; warnings.simplefilter('always')
    budget = Budget()
    cbs = [budget] + ([Autocast()] if config == 'autocast bf16' else [])
    learn.fit(1, cbs=cbs)
    timed_steps = budget.n - 2
    elapsed = budget.t1 - budget.t0
    acc = (learn.get_preds()[0].argmax(1) == y[-512:]).float().mean().item()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(steps=budget.n, sps=timed_steps / elapsed, acc=acc, rss=rss, book=book[0] / elapsed if config.startswith('mixedprec') else None,
                syncs=syncs[0] / max(timed_steps, 1) if device == 'cuda' else None)

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--models', default='cnn,transformer'); ap.add_argument('--steps', type=int, default=40)
    ap.add_argument('--max-seconds', type=float, default=60); ap.add_argument('--bs', type=int, default=64)
    ap.add_argument('--device', default='cpu'); ap.add_argument('--configs', default=','.join(CONFIGS))
    ap.add_argument('--worker', nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        if a.device == 'cpu':
            import warnings; warnings.simplefilter('ignore')
        print(json.dumps(worker(a.worker[0], a.worker[1], a.steps, a.max_seconds, a.bs, a.device))); return
    import torch
    from mixedprec.master import speed_note
    where = torch.cuda.get_device_name() if a.device == 'cuda' else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}; bf16: {speed_note(torch.bfloat16, a.device) or 'fast'}; fp16: {speed_note(torch.float16, a.device) or 'fast'}")
    for model in a.models.split(','):
        print(f"\n{model}, batch {a.bs}, Adam, up to {a.steps} steps or {a.max_seconds:g}s per configuration")
        print(f"{'configuration':<16}{'steps':>6}{'steps/s':>9}{'x fp32':>8}{'peak RSS MB':>13}{'accuracy':>10}{'bookkeeping':>13}" + (f"{'syncs/step':>12}" if a.device == 'cuda' else ''))
        base = None
        for cfg in a.configs.split(','):
            out = subprocess.run([sys.executable, __file__, '--worker', model, cfg, '--steps', str(a.steps), '--max-seconds', str(a.max_seconds), '--bs', str(a.bs), '--device', a.device],
                                 capture_output=True, text=True)
            if out.returncode: print(f"{cfg:<16} failed: {out.stderr.strip().splitlines()[-1]}"); continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base = base or r['sps']
            book = f"{100 * r['book']:.1f}%" if r['book'] is not None else '-'
            syncs = f"{r['syncs']:>12.1f}" if r.get('syncs') is not None else ''
            print(f"{cfg:<16}{r['steps']:>6}{r['sps']:>9.2f}{r['sps'] / base:>8.2f}{r['rss']:>13.0f}{r['acc']:>10.3f}{book:>13}{syncs}")

if __name__ == '__main__': main()
