"Small Learners and callbacks shared by the tests"
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.callback.progress import ProgressCallback
from mixedprec.callback import MixedPrecision
from mixedprec.master import saved_values
from mixedprec.state import reachable_bytes     # noqa: F401 (the tests count bytes as the docs do)

def bf16_adamw(front, model, lr, masters='fp32', state='fp32', loss_scale=None, opt=torch.optim.AdamW, **opt_kw):
    ("`model` in bf16 and its AdamW through `front`: 'amp' (O2) or 'fp16_optimizer' (`FP16_Optimizer` over the bf16 "
     "model's params, as peft's examples build the optimizer: on every param); `loss_scale`: a static scale (default: "
     "the front end's); `opt` and `opt_kw`: another optimizer, or AdamW's settings")
    from mixedprec import amp
    from mixedprec.fp16_optimizer import FP16_Optimizer
    scale = {} if loss_scale is None else dict(loss_scale=loss_scale)
    if front == 'amp':
        return amp.initialize(model, opt(model.parameters(), lr=lr, **opt_kw), opt_level='O2', half_dtype='bf16',
                              masters=masters, state=state, verbosity=0, **scale)
    model = model.bfloat16()
    return model, FP16_Optimizer(opt(model.parameters(), lr=lr, **opt_kw), masters=masters, state=state,
                                 verbose=False, **{f'static_{k}': v for k, v in scale.items()})

def mlp(n_in=8, n_out=1):
    return nn.Sequential(nn.Linear(n_in, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, n_out))

def synth_dls(n=256, bs=32, seed=42, shuffle=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    n_trn = n * 3 // 4
    return DataLoaders(DataLoader(TensorDataset(x[:n_trn], y[:n_trn]), bs=bs, shuffle=shuffle),
                       DataLoader(TensorDataset(x[n_trn:], y[n_trn:]), bs=bs))

def synth_learner(model=None, seed=42, shuffle=False, **kwargs):
    "A regression Learner with a BatchNorm MLP: `seed` sets the model's init; the batches are always the same"
    torch.manual_seed(seed)
    kwargs.setdefault('loss_func', nn.MSELoss())
    learn = Learner(synth_dls(shuffle=shuffle), model if model is not None else mlp(), **kwargs)
    return quiet(learn)

def quiet(learn):
    "`learn` without its progress bar and epoch table"
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])
    learn.logger = lambda *a, **k: None
    return learn

def group_learner(width=16, **kwargs):
    "A Learner whose body (Linear, BatchNorm, ReLU) and head are two param groups; the same init for the same arguments"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU()), nn.Linear(width, 1))
    return synth_learner(model=model, splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())], **kwargs)

def masters_of(learn):
    "What the optimizer holds for each model param: its fp32 master, or the param itself (fp32, or frozen)"
    mp = learn.mixed_precision
    return [mp.conversion.masters.held(p) for p in learn.model.parameters()]

def master_values(learn):
    "The fp32 value of each model param: its master's (wherever it lives), or its own"
    mp = learn.mixed_precision
    return [mp.conversion.masters.value(p) for p in learn.model.parameters()]

class Record(Callback):
    "Run `fn(learn, event)` at each event, ordered just before (`offset=-1`) or after (`offset=1`) MixedPrecision"
    def __init__(self, offset, **fns):
        self.order = MixedPrecision.order + offset
        for k, f in fns.items(): setattr(self, k, (lambda f: lambda: f(self.learn))(f))


def values_of(engine):
    "The fp32 value of each half param a step engine's optimizer holds, trained or frozen (what its checkpoints save)"
    return saved_values(engine.view.record, [p for g in engine.view.params for p in g])
