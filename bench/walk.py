"""The walks of issue 59, traced: the package files and classes one training step crosses (a fastai step from
`before_backward` to the end of the batch, fp16 and split bf16; `FP16_Optimizer.step`). `sys.setprofile` records every
call into `mixedprec/`; a class counts when a method of it runs (a NamedTuple's fields do not).

    python bench/walk.py [--calls]
"""
import collections, os, sys, warnings
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / 'tests')]
warnings.filterwarnings('ignore')
import torch
from torch import nn
from fastai.callback.core import Callback
from helpers import synth_learner
import mixedprec.callback  # noqa: F401 (to_fp16/to_bf16)
from mixedprec.fp16_optimizer import FP16_Optimizer

PKG = str(ROOT / 'mixedprec')

def profiler(seen):
    "A `sys.setprofile` hook that records (class, function) of each call into the package, by file"
    def hook(frame, event, arg):
        if event != 'call' or not frame.f_code.co_filename.startswith(PKG): return
        me = frame.f_locals.get('self')
        cls = type(me).__qualname__ if me is not None and type(me).__module__.startswith('mixedprec') else None
        seen[os.path.basename(frame.f_code.co_filename)].add((cls, frame.f_code.co_name))
    return hook

def report(name, seen, calls=False):
    classes = sorted({c for v in seen.values() for c, _ in v if c})
    print(f"| {name} | {len(seen)} | {', '.join(sorted(seen))} | {len(classes)} | {', '.join(classes)} |")
    if calls: print({f: sorted(v, key=str) for f, v in seen.items()})

class Trace(Callback):
    "Profiles the third batch, from the loss's scaling to the end of the batch"
    order = 0
    def __init__(self): self.seen, self.n = collections.defaultdict(set), 0
    def before_backward(self):
        self.n += 1
        if self.n == 3: sys.setprofile(profiler(self.seen))
    def after_batch(self):
        if self.n == 3: sys.setprofile(None)

def fastai_step(**kw):
    learn = synth_learner(lr=1e-3)
    learn.to_bf16(**kw) if kw else learn.to_fp16()
    trace = Trace()
    learn.fit(1, cbs=[trace])
    return trace.seen

def fp16_optimizer_step():
    "The third `step()` of a clean run (a static scale, so nothing overflows)"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)).half()
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters()), verbose=False, static_loss_scale=8.)
    seen = collections.defaultdict(set)
    for i in range(3):
        opt.backward(model(torch.randn(4, 8).half()).float().mean())
        if i == 2: sys.setprofile(profiler(seen))
        opt.step()
        sys.setprofile(None)
        opt.zero_grad()
    return seen

if __name__ == '__main__':
    calls = '--calls' in sys.argv
    print("| walk | files | which | classes | which |\n|---|---|---|---|---|")
    report("fastai step, to_fp16()", fastai_step(), calls)
    report("fastai step, to_bf16(masters='split')", fastai_step(masters='split'), calls)
    report("FP16_Optimizer.step", fp16_optimizer_step(), calls)
