"""End-to-end training benchmark, on the CPU or a GPU: the same model, data and batch size in fp32, mixedprec's to_fp16()
and to_bf16(), fastai 2.8's own to_fp16() and to_bf16(), and plain torch.autocast(bfloat16) on the fp32 model; and plain
PyTorch loops (PLAIN): fp32, mixedprec.amp at O2, torch.autocast with GradScaler. Each configuration runs in its own
process (for its peak memory). On CUDA it counts host syncs per step. Prints one table.

    python bench/train.py [--models cnn,transformer,transformer512,resnet50] [--steps 40] [--max-seconds 60] [--bs 64] [--device cpu|cuda] [--rounds 3]

With --rounds N the configurations run N times, interleaved (every configuration once per round), and the table shows the
median steps/s and each ratio's lowest and highest over the rounds: on shared machines one run's ratios can be off by 20%.
"""
import argparse, json, os, resource, statistics, subprocess, sys, time

CONFIGS = ['fp32', 'mixedprec fp16', 'mixedprec bf16', 'fastai fp16', 'fastai bf16', 'autocast bf16']   # fastai Learners; plain loops: PLAIN

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
    d, heads, layers = (512, 8, 4) if kind == 'transformer512' else (128, 4, 2)
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, d)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0., batch_first=True), layers)
            self.head = nn.Linear(d, 10)
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
    ids = torch.randint(0, 1000, (n, 128 if kind == 'transformer512' else 64), generator=g)
    w = torch.randn(1000, 10, generator=g)
    return ids, w[ids].sum(1).argmax(1)

class Clock:
    "Time mixedprec's calls by kind: host time on the CPU; on CUDA, the device time between events around each call"
    def __init__(self, device): self.device, self.host, self.events, self.on = device, {}, {}, False
    def wrap(self, f, kind='book'):
        import torch
        def g(*a, **k):
            if not self.on: return f(*a, **k)
            if self.device == 'cuda':
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); r = f(*a, **k); e1.record(); self.events.setdefault(kind, []).append((e0, e1)); return r
            t = time.perf_counter(); r = f(*a, **k); self.host[kind] = self.host.get(kind, 0.) + time.perf_counter() - t; return r
        return g
    def seconds(self, kind='book'): return self.host.get(kind, 0.) + sum(a.elapsed_time(b) for a, b in self.events.get(kind, [])) / 1000

class SyncCounter:
    "Count synchronizing CUDA calls (torch's sync debug mode warns on each) while on"
    def __init__(self): self.n, self.on, self.sites = 0, False, {}
    def start(self):
        import torch, warnings
        self.n, self.on, self.sites = 0, True, {}
        self._show, warnings.showwarning = warnings.showwarning, self._count
        warnings.simplefilter('always'); torch.cuda.set_sync_debug_mode('warn')
    def _count(self, message, category=None, filename='?', lineno=0, *a, **k):
        if 'synchroniz' not in str(message).lower(): return
        self.n += 1
        site = f"{os.path.relpath(filename)}:{lineno}"
        self.sites[site] = self.sites.get(site, 0) + 1
    def top(self, n=4): return ', '.join(f"{k} x{v}" for k, v in sorted(self.sites.items(), key=lambda kv: -kv[1])[:n])
    def stop(self):
        import torch, warnings
        torch.cuda.set_sync_debug_mode(0); warnings.showwarning = self._show; self.on = False

def book_clock(device):
    "A `Clock` wrapped around mixedprec's per-step entry points"
    import mixedprec.master as master, mixedprec.engine as engine
    clock = Clock(device)
    engine.step_outcome = clock.wrap(engine.step_outcome)          # the decision, for every front end
    for name in ('masters_to_model', 'zero_model_grads'): setattr(master.MasterParams, name, clock.wrap(getattr(master.MasterParams, name)))
    engine.fused_opt_step = clock.wrap(engine.fused_opt_step, 'step')   # the optimizer itself, with the master->model copy fused in
    return clock

class Window:
    "The timed part of a run: synchronizes at both ends, and runs the bookkeeping clock and (on CUDA) the sync counter in between"
    def __init__(self, device, clock=None): self.device, self.clock, self.syncs = device, clock, SyncCounter() if device == 'cuda' else None
    def start(self):
        import torch
        if self.device == 'cuda': torch.cuda.synchronize()
        if self.clock: self.clock.on = True
        if self.syncs: self.syncs.start()
        self.t0 = time.perf_counter()
    def elapsed(self): return time.perf_counter() - self.t0
    def stop(self, n) -> dict:
        "Steps per second, bookkeeping share and syncs per step over the `n` steps since `start`"
        import torch
        if self.syncs: self.syncs.stop()
        if self.device == 'cuda': torch.cuda.synchronize()
        elapsed = self.elapsed()
        if self.clock: self.clock.on = False
        return dict(timed=n, sps=n / elapsed, book=self.clock.seconds() / elapsed if self.clock else None,
                    fused=self.clock.seconds('step') / elapsed if self.clock else None,
                    syncs=self.syncs.n / max(n, 1) if self.syncs else None, sites=self.syncs.top() if self.syncs else '')

def measure(step, steps, max_seconds, window):
    "Run `step()` until `steps` or `max_seconds`; time all but the first two in `window`"
    for _ in range(2): step()
    window.start()
    n = 0
    while n < steps - 2 and window.elapsed() < max_seconds:
        step(); n += 1
    return window.stop(n)

def peak_memory(device):
    import torch
    if device == 'cuda': return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

PLAIN = ('torch fp32', 'mixedprec amp O2 fp16', 'torch amp fp16', 'raw bf16', 'raw bf16 channels_last')

def _step_note(res, waits) -> str:
    "The sync sites, then how often the host's books (one step late) waited for the device, and the fused step's share of the time"
    note = (f"the scaler's drain waited for the device {waits} times in {res['timed'] + 2} steps; "
            f"the fused optimizer step (not counted as bookkeeping) took {100 * res['fused']:.1f}% of the time" if res.get('fused') else '')
    return '; '.join(s for s in (res['sites'], note) if s)

def plain_worker(model_kind, config, steps, max_seconds, bs, device, pool):
    "A plain PyTorch loop with torch's AdamW: fp32; mixedprec.amp at O2 (the fused AdamW step); torch.autocast with GradScaler"
    import torch
    from torch import nn
    from mixedprec import amp
    torch.manual_seed(0)
    x, y = make_data(model_kind, bs * pool + 512)
    x, y = x.to(device), y.to(device)
    model = make_model(model_kind).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, **({'fused': True} if config == 'torch amp fp16' and device == 'cuda' else {}))
    clock = book_clock(device) if config.startswith('mixedprec') else None
    if config == 'mixedprec amp O2 fp16': model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)
    if config.startswith('raw bf16'):                          # the ceiling: bf16 weights and AdamW on them, no masters, no scaling
        model = model.to(torch.bfloat16); opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        if x.is_floating_point(): x = x.to(torch.bfloat16)
        if config == 'raw bf16 channels_last': model = model.to(memory_format=torch.channels_last); x = x.contiguous(memory_format=torch.channels_last)
    gscaler = torch.amp.GradScaler(device) if config == 'torch amp fp16' else None
    i = [0]
    def step():
        k = i[0] % pool; i[0] += 1
        xb, yb = x[k * bs:(k + 1) * bs], y[k * bs:(k + 1) * bs]
        if gscaler:
            with torch.autocast(device, dtype=torch.float16): loss = nn.functional.cross_entropy(model(xb), yb)
            gscaler.scale(loss).backward(); gscaler.step(opt); gscaler.update()
        elif clock:
            loss = nn.functional.cross_entropy(model(xb), yb)
            with amp.scale_loss(loss, opt) as scaled: scaled.backward()
            opt.step()
        else:
            nn.functional.cross_entropy(model(xb).float(), yb).backward(); opt.step()
        opt.zero_grad()
    res = measure(step, steps, max_seconds, Window(device, clock))
    if clock and device == 'cuda': res['sites'] = _step_note(res, amp._state.scalers[0].waits)
    model.eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.float16, enabled=gscaler is not None):
        acc = (model(x[-512:]).argmax(1) == y[-512:]).float().mean().item()
    return dict(res, steps=res['timed'] + 2, acc=acc, mem=peak_memory(device))

def worker(model_kind, config, steps, max_seconds, bs, device='cpu', pool=0, profile=False):
    "Train `config` for up to `steps` batches from a pool of `pool` distinct batches (0: all distinct), resident on `device`"
    pool = pool or steps
    if config in PLAIN: return plain_worker(model_kind, config, steps, max_seconds, bs, device, pool)
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.optimizer import Adam
    from fastai.callback.core import Callback, CancelFitException, CancelValidException
    import mixedprec.callback as mpcb
    torch.manual_seed(0)
    x, y = make_data(model_kind, bs * pool + 512)
    batches = lambda x, y, bs: [(x[i:i + bs].to(device), y[i:i + bs].to(device)) for i in range(0, len(x), bs)]
    dls = DataLoaders(DataLoader(batches(x[:-512], y[:-512], bs), bs=None), DataLoader(batches(x[-512:], y[-512:], 256), bs=None), device=device)
    learn = Learner(dls, make_model(model_kind).to(device), loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=2e-3)
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    clock = book_clock(device) if config.startswith('mixedprec') else None
    if config == 'mixedprec fp16': learn.to_fp16()
    elif config == 'mixedprec bf16': learn.to_bf16()
    elif config == 'mixedprec bf16 channels_last':
        from fastai.callback.channelslast import ChannelsLast
        learn.to_bf16().to_channelslast()
    elif config == 'fastai fp16': mpcb.fastai_to_fp16(learn)
    elif config == 'fastai bf16': mpcb.fastai_to_bf16(learn)
    class Autocast(Callback):
        def before_batch(self): self.ctx = torch.autocast(device, dtype=torch.bfloat16); self.ctx.__enter__()
        def after_loss(self): self.ctx.__exit__(None, None, None)
    res, window = {}, Window(device, clock)
    keys = ['self_device_time_total', 'self_cpu_time_total'] if device == 'cuda' else ['self_cpu_time_total']   # GPU work, then host work
    table = lambda p: res.__setitem__('profile', '\n'.join(p.key_averages().table(sort_by=k, row_limit=16, max_name_column_width=70) for k in keys))
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == 'cuda' else []),
                                  schedule=torch.profiler.schedule(wait=2, warmup=2, active=5, repeat=1), on_trace_ready=table) if profile else None
    class Profile(Callback):
        "With --profile: the time of each op over steps 5 to 9, by device time and by host time (the timings of such a run are not comparable)"
        order = 99
        def before_fit(self): prof.start()
        def after_batch(self): prof.step() if self.training else None
        def after_fit(self): prof.stop()
    class Budget(Callback):
        "Time fastai's own loop: the window opens after the second batch and closes after `steps` or `max_seconds`"
        order = 100
        def before_fit(self): self.n = 0
        def before_validate(self): raise CancelValidException()          # only training steps are timed
        def after_batch(self):
            if not self.training: return
            self.n += 1
            if self.n == 2: window.start()
            if self.n >= steps or (self.n > 2 and window.elapsed() > max_seconds):
                res.update(window.stop(self.n - 2))
                raise CancelFitException()
    learn.fit(steps // pool + 1, cbs=[Budget()] + ([Autocast()] if config == 'autocast bf16' else []) + ([Profile()] if profile else []))
    if clock and device == 'cuda': res['sites'] = _step_note(res, learn.mixed_precision.scaler.waits)
    learn.model.eval()
    with torch.no_grad(): acc = torch.cat([learn.model(xb).argmax(1) == yb for xb, yb in dls.valid.dataset]).float().mean().item()
    return dict(res, steps=res['timed'] + 2, acc=acc, mem=peak_memory(device))

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--models', default='cnn,transformer'); ap.add_argument('--steps', type=int, default=40)
    ap.add_argument('--max-seconds', type=float, default=60); ap.add_argument('--bs', type=int, default=64)
    ap.add_argument('--device', default='cpu'); ap.add_argument('--configs', default=','.join(CONFIGS))
    ap.add_argument('--pool', type=int, default=0, help="distinct batches, cycled (0: every step a new batch)")
    ap.add_argument('--sync-sites', action='store_true', help="print where the host syncs happen (CUDA)")
    ap.add_argument('--profile', action='store_true', help="fastai configs: print the device and the host time per op over 5 steps (timings then not comparable)")
    ap.add_argument('--rounds', type=int, default=1, help="run the configurations this many times, interleaved; report median steps/s and each ratio's range")
    ap.add_argument('--worker', nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        if a.device == 'cpu':
            import warnings; warnings.simplefilter('ignore')
        print(json.dumps(worker(a.worker[0], a.worker[1], a.steps, a.max_seconds, a.bs, a.device, a.pool, a.profile))); return
    import torch
    from mixedprec.convert import speed_note
    where = torch.cuda.get_device_name() if a.device == 'cuda' else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}; bf16: {speed_note(torch.bfloat16, a.device) or 'fast'}; fp16: {speed_note(torch.float16, a.device) or 'fast'}")
    configs = a.configs.split(',')
    for model in a.models.split(','):
        print(f"\n{model}, batch {a.bs}, Adam, up to {a.steps} steps or {a.max_seconds:g}s per configuration" + (f", {a.rounds} rounds interleaved (median)" if a.rounds > 1 else ''))
        runs = {cfg: [] for cfg in configs}                   # each configuration's result in every round
        for _ in range(a.rounds):
            for cfg in configs: runs[cfg].append(run_config(a, model, cfg))
        report(a, configs, runs)

def run_config(a, model, cfg):
    "One configuration in its own process: its result, or the last line of its error"
    out = subprocess.run([sys.executable, __file__, '--worker', model, cfg, '--steps', str(a.steps), '--max-seconds', str(a.max_seconds), '--bs', str(a.bs),
                          '--device', a.device, '--pool', str(a.pool)] + (['--profile'] if a.profile else []),
                         capture_output=True, text=True)
    if out.returncode: return {'error': (out.stderr.strip().splitlines() or ['?'])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])

def report(a, configs, runs):
    "The table: median steps/s over the rounds, the ratio to the latest fp32 configuration above it (and its range over the rounds when there are several)"
    mem = 'peak GPU MB' if a.device == 'cuda' else 'peak RSS MB'
    print(f"{'configuration':<30}{'steps':>6}{'steps/s':>9}{'x fp32':>8}" + (f"{'range':>12}" if a.rounds > 1 else '') +
          f"{mem:>13}{'accuracy':>10}{'bookkeeping':>13}" + (f"{'syncs/step':>12}" if a.device == 'cuda' else ''))
    base = None
    for cfg in configs:
        good = [r for r in runs[cfg] if 'error' not in r]
        if not good: print(f"{cfg:<30} failed: {runs[cfg][-1]['error']}"); continue
        if cfg in ('fp32', 'torch fp32') or base is None: base = runs[cfg]
        ratios = [r['sps'] / b['sps'] for r, b in zip(runs[cfg], base) if 'error' not in r and 'error' not in b]
        r = good[-1]
        sps = statistics.median(x['sps'] for x in good)
        book = f"{100 * statistics.median(x['book'] for x in good):.1f}%" if r['book'] is not None else '-'
        spread = f"{min(ratios):>6.2f}-{max(ratios):.2f}" if a.rounds > 1 and ratios else ''
        syncs = f"{r['syncs']:>12.1f}" if r.get('syncs') is not None else ''
        print(f"{cfg:<30}{r['steps']:>6}{sps:>9.2f}{statistics.median(ratios) if ratios else float('nan'):>8.2f}" + (f"{spread:>12}" if a.rounds > 1 else '') +
              f"{max(x['mem'] for x in good):>13.0f}{r['acc']:>10.3f}{book:>13}{syncs}")
        if r.get('sites') and a.sync_sites: print(f"{'':<30}syncs at: {r['sites']}")
        if r.get('profile'): print(r['profile'])

if __name__ == '__main__': main()
