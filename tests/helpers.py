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

def reachable_bytes(*roots, stop=()) -> int:
    ("The bytes of every tensor storage reachable from `roots` through attributes, containers, grads and optimizer "
     "state, each storage once (a `MasterGrad` holds none of its own); `stop`: objects not gone through (a Learner, "
     "whose data is not the training's)")
    import types, weakref
    seen, found, stack = {id(o) for o in stop}, {}, list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen: continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.layout == torch.strided and type(o).__name__ != 'MasterGrad':
                st = o.untyped_storage()
                found[(st.data_ptr(), str(o.device))] = st.nbytes()
            if o.grad is not None: stack.append(o.grad)
            stack.extend(getattr(o, '__dict__', {}).values())
        elif isinstance(o, (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType,
                            types.BuiltinFunctionType, weakref.ref)): continue
        elif isinstance(o, dict): stack += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)): stack += list(o)
        elif isinstance(o, types.MethodType): stack.append(o.__self__)
        else:
            stack.extend(getattr(o, '__dict__', {}).values())
            stack.extend(getattr(o, s) for s in getattr(type(o), '__slots__', ()) if hasattr(o, s))
            if hasattr(o, 'func') and hasattr(o, 'keywords'): stack += [o.func, o.args, o.keywords]
    return sum(found.values())
