"""A short character-level language model on FSDP2 at 2 gloo ranks (CPU), over 3 seeds: torch's own recipe (FSDP2 with an
fp16 `MixedPrecisionPolicy`, `ShardedGradScaler`, `AdamW`) beside mixedprec on the same FSDP2 model (`FP16_Optimizer`
with fp32, bf16 and 8-bit optimizer state), and plain fp32 FSDP2 for the seed spread. Every configuration trains the same
model from the same init on the same batches for each seed; the text is the source of Python's own `argparse` module (it
ships with every Python). The table gives the final held-out loss (mean and range over the seeds), the optimizer-plus-master
bytes a rank holds (the fp32 sharded params and the optimizer state, measured from each rank's local tensors), and the
step time side by side. Ratios only: these machines are noisy.

    python bench/fsdp2_charlm.py [--steps 150] [--seeds 0,1,2] [--world 2]
"""
import argparse, datetime, inspect, os, sys, tempfile, time
import torch, torch.multiprocessing as mp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import cpu_name
from sharded import free_port, nbytes

CONFIGS = ['torch FSDP2, fp32', 'torch FSDP2 + fp16 policy + ShardedGradScaler', 'mixedprec FP16_Optimizer, fp32 state',
           'mixedprec FP16_Optimizer, bf16 state', 'mixedprec FP16_Optimizer, 8-bit state']
CONTEXT, WIDTH, BATCH, LR = 32, 256, 64, 3e-3

def corpus():
    "The characters of Python's argparse module as int64 codes, and the vocabulary size"
    import argparse as source
    text = inspect.getsource(source)
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.int64), len(chars)

def batch(codes, g, n):
    "`n` windows of CONTEXT characters and the character after each, drawn with generator `g`"
    at = torch.randint(0, len(codes) - CONTEXT - 1, (n,), generator=g)
    x = torch.stack([codes[i:i + CONTEXT] for i in at.tolist()])
    return x, codes[at + CONTEXT]

def make_model(vocab, seed):
    from torch import nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(vocab, 32), nn.Flatten(), nn.Linear(CONTEXT * 32, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, vocab))

def train(rank, world, config, seed, steps, codes, vocab):
    "One configuration and seed: the final held-out loss, the optimizer-plus-master bytes of this rank, seconds a step"
    from torch import nn
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    model = make_model(vocab, seed)
    policy = MixedPrecisionPolicy() if config == 'torch FSDP2, fp32' else MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float32)
    for m in (model[2], model[4], model[6], model): fully_shard(m, mp_policy=policy)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    loss_of = lambda x, y: nn.functional.cross_entropy(model(x).float(), y)
    if config.startswith('mixedprec'):
        from mixedprec.fp16_optimizer import FP16_Optimizer
        state = {'fp32 state': 'fp32', 'bf16 state': 'bf16', '8-bit state': '8bit'}[config.split(', ')[-1]]
        opt = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False, state=state)
        def step(x, y): opt.zero_grad(); opt.backward(loss_of(x, y)); opt.clip_master_grads(1.0); opt.step()
    elif 'ShardedGradScaler' in config:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler(device='cpu')
        def step(x, y):
            inner.zero_grad(); scaler.scale(loss_of(x, y)).backward(); scaler.unscale_(inner)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); scaler.step(inner); scaler.update()
    else:
        def step(x, y):
            inner.zero_grad(); loss_of(x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); inner.step()
    g = torch.Generator().manual_seed(1000 + seed)        # the same batches for every configuration of a seed
    t = None
    for i in range(steps):
        if i == 5: t = time.perf_counter()
        x, y = batch(codes, g, BATCH * world)
        step(x[rank::world], y[rank::world])
    sec = (time.perf_counter() - t) / (steps - 5)
    held = torch.Generator().manual_seed(99)
    with torch.no_grad():
        x, y = batch(codes, held, 512)
        loss = float(loss_of(x, y))
    state = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return dict(loss=loss, bytes=nbytes(list(model.parameters())) + nbytes(state), sec=sec)

def run(rank, world, port, out, steps, seeds):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    codes, vocab = corpus()
    res = {(c, s): train(rank, world, c, s, steps, codes, vocab) for s in seeds for c in CONFIGS}
    torch.save(res, os.path.join(out, f'rank{rank}.pt'))
    dist.destroy_process_group()

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--steps', type=int, default=150); ap.add_argument('--seeds', default='0,1,2')
    ap.add_argument('--world', type=int, default=2)
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(',')]
    out = tempfile.mkdtemp()
    mp.start_processes(run, args=(a.world, free_port(), out, a.steps, seeds), nprocs=a.world, start_method='spawn')
    ranks = [torch.load(os.path.join(out, f'rank{r}.pt')) for r in range(a.world)]
    codes, vocab = corpus()
    n = sum(p.numel() for p in make_model(vocab, 0).parameters())
    print(f"char-LM on FSDP2, {a.world} gloo ranks, {n / 1e3:.0f}K params, {a.steps} steps of {BATCH * a.world} windows, "
          f"AdamW lr {LR}, clip 1.0, seeds {seeds}; {cpu_name()}, torch {torch.__version__}")
    print("| configuration | held-out loss, mean (min-max) | optimizer + master MiB / rank | x torch FSDP2 bytes | "
          "step time x torch fp16 |")
    print("|---|---|---|---|---|")
    base = CONFIGS[1]
    mean = lambda k, c: sum(ranks[0][(c, s)][k] for s in seeds) / len(seeds)
    for c in CONFIGS:
        losses = [ranks[0][(c, s)]['loss'] for s in seeds]
        mib = max(r[(c, seeds[0])]['bytes'] for r in ranks) / 2**20
        print(f"| {c} | {sum(losses) / len(losses):.3f} ({min(losses):.3f}-{max(losses):.3f}) | {mib:.2f} | "
              f"{mib * 2**20 / max(r[(base, seeds[0])]['bytes'] for r in ranks):.2f} | "
              f"{mean('sec', c) / mean('sec', base):.2f} |")

if __name__ == '__main__': main()
