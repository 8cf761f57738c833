"""bf16 training with fp32 masters, split masters ("16+16") and stochastic rounding (no masters): memory, step time and
accuracy, side by side in one run. Prints markdown tables (the README's and nbs/03_bf16_masters.ipynb's).

    python bench/bf16_masters.py memory   [--layers 8 --width 1024]    # bytes per param and peak memory of a training step (~100M params)
    python bench/bf16_masters.py speed    [--threads 1,2]              # the fused AdamW step alone, ~100M params
    python bench/bf16_masters.py accuracy [--seeds 3]                  # digits CNN and a transformer on a synthetic task
    python bench/bf16_masters.py lm       [--seeds 3 --steps 2000]     # a character-level LM: bytes per param, final loss, step time,
                                                                       # lean optimizer state (state='bf16', '8bit') and the anchors that install

Memory is the process's peak resident set (VmHWM, reset after setup) on the CPU, or torch.cuda.max_memory_allocated on a GPU;
each configuration runs in its own process, with glibc returning freed blocks at once (MALLOC_MMAP_THRESHOLD_).
"""
import argparse, json, os, statistics, subprocess, sys, time
import torch
from torch import nn

CONFIGS = {                                  # name -> (amp opt_level, masters, optimizer state) or None for plain fp32
    'fp32 (no mixed precision)': None,
    'bf16, fp32 masters (O2)': ('O2', 'fp32', 'fp32'),
    "bf16, split masters (masters='split')": ('O2', 'split', 'fp32'),
    "bf16, stochastic rounding (masters='none')": ('O2', 'none', 'fp32'),
    'bf16, no masters (O3, round to nearest)': ('O3', 'fp32', 'fp32'),
    "bf16, fp32 masters, bf16 state (state='bf16')": ('O2', 'fp32', 'bf16'),
    "bf16, split masters, bf16 state (masters='split', state='bf16')": ('O2', 'split', 'bf16'),
    "bf16, fp32 masters, 8-bit state (state='8bit')": ('O2', 'fp32', '8bit'),
    "bf16, split masters, 8-bit state (masters='split', state='8bit')": ('O2', 'split', '8bit'),
}
ANCHORS = {                                  # beside them in `lm`, when installed: name -> how to build the optimizer
    "torch-optimi AdamW, bf16 weights, Kahan summation": 'optimi',
    "torchao AdamW8bit, fp32 weights": 'torchao',
}

def initialize(model, opt, how):
    "The model and optimizer under amp as `how` (a `CONFIGS` value) says"
    from mixedprec import amp
    return amp.initialize(model, opt, opt_level=how[0], half_dtype='bf16', masters=how[1], state=how[2], verbosity=0)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import cpu_name as cpu_units                        # the CPU's model name and its half-precision units

def cpu_name() -> str: return f"{cpu_units()}, {torch.get_num_threads()} threads"

def transformer(layers, width, vocab=1000):
    "A pre-norm transformer encoder language model: about 12*width**2 params per layer"
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, width)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, width // 64, 4 * width, dropout=0., batch_first=True, norm_first=True), layers,
                                             enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)
        def forward(self, ids): return self.head(self.enc(self.emb(ids)))
    return LM()

def _unique_bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        if hasattr(t, '__tensor_flatten__') and type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):   # a subclass (torchao's 8-bit state): its parts
            n += _unique_bytes([getattr(t, k) for k in t.__tensor_flatten__()[0]]); continue
        s = t.untyped_storage()
        if s.data_ptr() in seen: continue
        seen.add(s.data_ptr()); n += s.nbytes()
    return n

def persistent_bytes(model, opt) -> dict:
    "Bytes held between steps: the model's weights, the masters (fp32, or int16 low halves), the optimizer state, grad buffers"
    from mixedprec.master import master_kind
    params = list(model.parameters())
    e = getattr(opt, '_mixedprec_engine', None)
    masters, grads = [], [p.grad for p in params if p.grad is not None]
    if e is not None:
        for p, m, g in e.masters.pairs:
            kind = master_kind(m).name         # fp32: the master; split: its int16 low half; none: nothing of its own
            masters.append(m if kind == 'fp32' else master_kind(m).low if kind == 'split' else torch.empty(0))
            if g is not None: grads.append(g)
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return dict(weights=_unique_bytes(params), masters=_unique_bytes(masters), state=_unique_bytes(state), grads=_unique_bytes(grads))

def _vm(key) -> float:
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key)) / 1024

def memory_worker(config, layers, width, steps, bs, seq):
    from mixedprec import amp
    torch.manual_seed(0)
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    model = transformer(layers, width).to(device)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    how = CONFIGS[config]
    if how is not None: model, opt = initialize(model, opt, how)
    ids = torch.randint(0, 1000, (bs, seq), device=device)
    def step():
        loss = nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        if how is None: loss.backward()
        else:
            with amp.scale_loss(loss, opt) as sl: sl.backward()
        opt.step(); opt.zero_grad()
    step()                                                       # the state exists from here
    held = persistent_bytes(model, opt)
    if device == 'cuda': torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    with open('/proc/self/clear_refs', 'w') as f: f.write('5')   # the peak resident set restarts from here
    before, times = _vm('VmRSS'), []
    for _ in range(steps):
        t = time.perf_counter(); step()
        if device == 'cuda': torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == 'cuda' else _vm('VmHWM')
    return dict(config=config, params=n, **{k: v / n for k, v in held.items()}, rss_before=before, peak=peak, step=statistics.median(times))

def memory(a):
    rows = []
    env = {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '131072'}
    for config in CONFIGS:
        out = subprocess.run([sys.executable, __file__, '_memory_worker', config, str(a.layers), str(a.width), str(a.steps), str(a.bs), str(a.seq)],
                             capture_output=True, text=True, env=env)
        if out.returncode: print(out.stderr[-3000:], file=sys.stderr); raise SystemExit(f"{config} failed")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[1]
    where = f"GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else cpu_name()
    print(f"\ntransformer LM, {a.layers} layers, width {a.width}: {rows[0]['params'] / 1e6:.0f}M params; batch {a.bs} x {a.seq} tokens; AdamW; "
          f"torch {torch.__version__}; {where}\n")
    print("| configuration | weights | masters | optimizer state | grads kept | bytes/param in all | peak memory of a step | step time vs fp32 masters |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        total = r['weights'] + r['masters'] + r['state'] + r['grads']
        print(f"| {r['config']} | {r['weights']:.1f} | {r['masters']:.1f} | {r['state']:.1f} | {r['grads']:.1f} | {total:.1f} | "
              f"{r['peak'] / 1024:.2f} GiB | {r['step'] / base['step']:.2f}x |")
    print(f"\n(bytes per param; 'grads kept' are buffers held from one step to the next; peak = resident set during {a.steps} steps, "
          f"including about {rows[0]['rss_before'] / 1024 - (rows[0]['weights'] + rows[0]['state']) * rows[0]['params'] / 2**30:.1f} GiB of Python, torch and data)")

def speed(a):
    "The fused AdamW step alone for each way of keeping masters and state, against torch's AdamW on fp32 params"
    from mixedprec import ops
    dev = a.device
    sync = torch.cuda.synchronize if dev == 'cuda' else (lambda: None)
    shapes = [(4096, 4096)] * 5 + [(4096,)] * 5 + [(1024, 1024)] * 15
    g = [torch.randn(s, device=dev).float() * 1e-3 for s in shapes]
    where = torch.cuda.get_device_name() if dev == 'cuda' else cpu_units()
    print(f"\nthe fused AdamW step alone (unscaled fp32 grads in, as the engine passes them), {sum(t.numel() for t in g) / 1e6:.0f}M params in {len(shapes)} "
          f"tensors; best of {a.repeat}; torch {torch.__version__}; {where}\n")
    print("| threads | fp32 masters + bf16 copy | split (bf16 + int16) | stochastic rounding (bf16) "
          "| split, bf16 state "
          "| split, 8-bit state | fp32 masters, 8-bit state | torch AdamW (fused=True on a GPU), fp32 params |")
    print("|---|---|---|---|---|---|---|---|")
    flag = torch.zeros((), dtype=torch.bool, device=dev)
    def best_of(run):
        run(); sync()
        best = float('inf')
        for _ in range(a.repeat):
            t = time.perf_counter(); run(); sync(); best = min(best, time.perf_counter() - t)
        return best
    for threads in (a.threads if dev == 'cpu' else [torch.get_num_threads()]):
        torch.set_num_threads(threads)
        res = {}
        kinds = (('fp32', 'fp32'), ('split', 'fp32'), ('none', 'fp32'), ('split', 'bf16'), ('split', '8bit'),
                 ('fp32', '8bit'))
        for mode, state in kinds:
            torch.manual_seed(0)
            m = [torch.randn(s, device=dev) for s in shapes]
            sdt = torch.bfloat16 if state == 'bf16' else torch.float32
            st = [[torch.zeros(s, device=dev, dtype=sdt) for s in shapes] for _ in range(2)]
            steps = [torch.zeros((), device=dev) for _ in shapes]
            if mode == 'fp32': params, kw, out = m, {}, [t.bfloat16() for t in m]
            elif mode == 'split':
                params, lows = map(list, zip(*[ops.split_bf16_ref(t) for t in m])); kw, out = dict(lows=lows), []
            else: params, kw, out = [t.bfloat16() for t in m], dict(seeds=list(range(len(shapes)))), []
            if state == '8bit':
                st = [[torch.zeros(s, device=dev, dtype=dt) for s in shapes] for dt in (torch.int8, torch.uint8)]
                kw['state_scales'] = [[torch.zeros(-(-t.numel() // ops.Q_BLOCK), device=dev) for t in m]
                                      for _ in range(2)]
            if state != 'fp32': kw['state_seeds'] = [(7 * i, 7 * i + 1) for i in range(len(shapes))]
            res[mode, state] = best_of(lambda: ops.adam_step_(g, params, st[0], st[1], out, flag, steps, 1., 1e-4,
                                                              weight_decay=0.01, impl='fused', **kw))
        ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in shapes]
        for p, gr in zip(ps, g): p.grad = gr
        opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **(dict(fused=True) if dev == 'cuda' else {}))
        res['torch'] = best_of(opt.step)
        base = res['fp32', 'fp32']
        print(f"| {threads} | 1.00 ({base * 1e3:.2f} ms) | " + ' | '.join(f"{res[k] / base:.2f}" for k in list(res)[1:])
              + " |")
    print(f"\n(each a time relative to the first column; torch AdamW(fused=True) took {res['torch'] * 1e3:.2f} ms, "
          f"the 8-bit split step {res['split', '8bit'] * 1e3:.2f} ms)")

def digits_data():
    from sklearn.datasets import load_digits
    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16, torch.tensor(d.target)
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return (x[idx[:1400]], y[idx[:1400]]), (x[idx[1400:]], y[idx[1400:]])

def digits_cnn():
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(256, 10))

def sort_data(n, seq=16, vocab=32, seed=0):
    "The synthetic text task: read a sequence of tokens, write it sorted"
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x, x.sort(1).values

def sort_model(vocab=32, width=128, seq=16):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.randn(seq, width) * 0.02)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0., batch_first=True, norm_first=True), 3,
                                             enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)
        def forward(self, x): return self.head(self.enc(self.emb(x) + self.pos.to(self.emb.weight.dtype)))
    return M()

def train_task(task, config, seed, epochs):
    from mixedprec import amp
    torch.manual_seed(seed)
    if task == 'digits CNN':
        (xt, yt), (xv, yv) = digits_data()
        model, lr, bs, flat = digits_cnn(), 2e-3, 64, False
    else:
        (xt, yt), (xv, yv) = sort_data(4096, seed=0), sort_data(512, seed=1)
        model, lr, bs, flat = sort_model(), 1e-3, 64, True
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    how = CONFIGS[config]
    if how is not None: model, opt = initialize(model, opt, how)
    loss_of = lambda out, y: nn.functional.cross_entropy(out.float().flatten(0, 1) if flat else out.float(), y.flatten() if flat else y)
    for ep in range(epochs):
        model.train()
        for idx in torch.randperm(len(xt), generator=torch.Generator().manual_seed(seed * 1000 + ep)).split(bs):
            loss = loss_of(model(xt[idx]), yt[idx])
            if how is None: loss.backward()
            else:
                with amp.scale_loss(loss, opt) as sl: sl.backward()
            opt.step(); opt.zero_grad()
    model.eval()
    with torch.no_grad(): pred = model(xv).float().argmax(-1)
    return (pred == yv).float().mean().item()

def accuracy(a):
    tasks = {t: e for t, e in {'digits CNN': a.epochs_digits, 'transformer, sort 16 tokens': a.epochs_sort}.items() if a.tasks is None or any(k in t for k in a.tasks)}
    print(f"\nvalidation accuracy, mean and spread (min-max) over seeds {list(range(a.seeds))}; AdamW; torch {torch.__version__}; {cpu_name()}\n")
    print(f"| configuration | {' | '.join(f'{t} ({e} epochs)' for t, e in tasks.items())} |")
    print(f"|---|{'---|' * len(tasks)}")
    from mixedprec import amp
    for config in [c for c in CONFIGS if a.only is None or any(o in c for o in a.only)]:
        cells = []
        for task, epochs in tasks.items():
            accs = [train_task(task, config, s, epochs) for s in range(a.seeds)]
            cells.append(f"{100 * statistics.mean(accs):.1f}% ({100 * min(accs):.1f}-{100 * max(accs):.1f})")
        print(f"| {config} | {' | '.join(cells)} |", flush=True)

def char_text():
    "Text that ships with Python: the standard library's sources of a few modules, as bytes below 128"
    import argparse as _a, difflib, textwrap, inspect as _i, json.decoder as _j
    text = ''.join(open(m.__file__, encoding='utf-8').read() for m in (_a, difflib, textwrap, _i, _j))
    data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
    n = int(len(data) * 0.9)
    return data[:n], data[n:]

def char_lm(width=128, layers=2, ctx=64, vocab=128):
    "A small causal transformer over characters"
    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.randn(ctx, width) * 0.02)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0., batch_first=True, norm_first=True), layers,
                                             enable_nested_tensor=False)
            self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)
            self.register_buffer('mask', nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)
        def forward(self, x):
            h = self.emb(x) + self.pos[:x.shape[1]].to(self.emb.weight.dtype)
            return self.head(self.norm(self.enc(h, mask=self.mask[:x.shape[1], :x.shape[1]].to(h.dtype), is_causal=True)))
    return CharLM()

def lm_run(config, seed, steps, bs=16, ctx=64, lr=2e-3):
    "Train the char LM for `steps` AdamW steps under `config`: final validation loss (nats/char), bytes per param held, median step time"
    from mixedprec import amp
    torch.manual_seed(seed)
    train, valid = char_text()
    model = char_lm(ctx=ctx)
    n = sum(p.numel() for p in model.parameters())
    anchor, how = ANCHORS.get(config), CONFIGS.get(config)
    if anchor == 'optimi':
        import optimi
        model = model.bfloat16(); opt = optimi.AdamW(model.parameters(), lr=lr, weight_decay=0.01, kahan_sum=True)
    elif anchor == 'torchao':
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(model.parameters(), lr=lr, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        if how is not None: model, opt = initialize(model, opt, how)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, cycle_momentum=False)
    g = torch.Generator().manual_seed(seed)
    half_in = anchor == 'optimi'
    times = []
    for i in range(steps):
        idx = torch.randint(0, len(train) - ctx - 1, (bs,), generator=g)
        x, y = torch.stack([train[j:j + ctx] for j in idx]), torch.stack([train[j + 1:j + ctx + 1] for j in idx])
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        if how is None: loss.backward()
        else:
            with amp.scale_loss(loss, opt) as sl: sl.backward()
        opt.step(); opt.zero_grad(); sched.step()
        times.append(time.perf_counter() - t)
    held = persistent_bytes(model, opt)
    model.eval()
    with torch.no_grad():
        xs = valid[:(len(valid) - 1) // ctx * ctx]
        x, y = xs.view(-1, ctx), valid[1:len(xs) + 1].view(-1, ctx)
        val = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()
    return dict(loss=val, bytes={k: v / n for k, v in held.items()}, step=statistics.median(times), params=n)

def lm(a):
    configs = [c for c in CONFIGS if a.only is None or any(o in c for o in a.only)]
    for name, mod in ANCHORS.items():
        if a.only is not None and not any(o in name for o in a.only): continue
        try: __import__({'optimi': 'optimi', 'torchao': 'torchao.optim'}[mod]); configs.append(name)
        except ImportError: print(f"(not installed, so not measured: {name})")
    rows = []
    for config in configs:
        runs = [lm_run(config, s, a.steps) for s in range(a.seeds)]
        rows.append((config, runs))
        print(f"  {config}: {[round(r['loss'], 4) for r in runs]}", file=sys.stderr, flush=True)
    ref = next(runs for c, runs in rows if c == 'fp32 (no mixed precision)') if any(c.startswith('fp32') for c, _ in rows) else rows[0][1]
    ref_losses, ref_step = [r['loss'] for r in ref], statistics.median(r['step'] for r in ref)
    lo, hi = min(ref_losses), max(ref_losses)
    print(f"\ncharacter-level transformer LM ({rows[0][1][0]['params'] / 1e6:.2f}M params, 2 layers of width 128, context 64, on Python's stdlib "
          f"sources), {a.steps} AdamW steps of 16 sequences, one-cycle schedule; seeds {list(range(a.seeds))}; torch {torch.__version__}; {cpu_name()}\n")
    print("| configuration | weights | masters | optimizer state | grads kept | bytes/param in all | final validation loss (nats/char), mean (min-max) | within fp32's spread | step time vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config, runs in rows:
        b = {k: statistics.mean(r['bytes'][k] for r in runs) for k in runs[0]['bytes']}
        ls = [r['loss'] for r in runs]
        m = statistics.mean(ls)
        inside = 'yes' if lo - (hi - lo) <= m <= hi + (hi - lo) else 'no'
        print(f"| {config} | {b['weights']:.1f} | {b['masters']:.1f} | {b['state']:.1f} | {b['grads']:.1f} | {sum(b.values()):.2f} | "
              f"{m:.4f} ({min(ls):.4f}-{max(ls):.4f}) | {inside} | {statistics.median(r['step'] for r in runs) / ref_step:.2f}x |", flush=True)
    print(f"\n('within fp32's spread': the mean lies within the fp32 runs' range widened by that range on each side, {lo:.4f}-{hi:.4f} "
          f"± {hi - lo:.4f}; bytes per param held between steps, measured from the tensors)")

if __name__ == '__main__':
    if len(sys.argv) > 1 and sys.argv[1] == '_memory_worker':
        c, layers, width, steps, bs, seq = sys.argv[2:]
        print(json.dumps(memory_worker(c, int(layers), int(width), int(steps), int(bs), int(seq))))
        raise SystemExit
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('what', choices=['memory', 'speed', 'accuracy', 'lm'])
    ap.add_argument('--only', nargs='*', default=None, help="lm, accuracy: only the configurations whose names hold one of these")
    ap.add_argument('--tasks', nargs='*', default=None, help="accuracy: only the tasks whose names hold one of these ('digits', 'sort')")
    ap.add_argument('--layers', type=int, default=8); ap.add_argument('--width', type=int, default=1024)
    ap.add_argument('--steps', type=int, default=3); ap.add_argument('--bs', type=int, default=4); ap.add_argument('--seq', type=int, default=64)
    ap.add_argument('--repeat', type=int, default=5); ap.add_argument('--threads', type=lambda s: [int(x) for x in s.split(',')], default=[1, 2])
    ap.add_argument('--device', default='cpu', help="speed: where the step runs ('cuda' on a GPU)")
    ap.add_argument('--seeds', type=int, default=3); ap.add_argument('--epochs-digits', type=int, default=8); ap.add_argument('--epochs-sort', type=int, default=15)
    a = ap.parse_args()
    if a.what == 'lm' and '--steps' not in sys.argv: a.steps = 2000
    {'memory': memory, 'speed': speed, 'accuracy': accuracy, 'lm': lm}[a.what](a)
