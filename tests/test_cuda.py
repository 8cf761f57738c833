("End to end on a GPU: each front end trains with the CUDA kernels, skips on overflow, matches the reference ops, "
 "and syncs as documented")
import warnings
import pytest, torch
from torch import nn
import torch.nn.functional as F
from mixedprec import amp, ops
from mixedprec.fp16_optimizer import FP16_Optimizer
from fastai.callback.core import Callback
from helpers import synth_learner, masters_of
from mixedprec.engine import settings

pytestmark = pytest.mark.cuda

@pytest.fixture(autouse=True)
def deterministic():
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old

def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 4)).cuda()

def batches(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 8, 8, generator=g).cuda(),
             torch.randint(0, 4, (8,), generator=g).cuda()) for _ in range(n)]

def make_opt(kind, params):
    return {'sgd': lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
            'adamw': lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
            'adam': lambda: torch.optim.Adam(params, lr=1e-2)}[kind]()

def amp_run(impl, kind='adamw', inject_at=None, n=6, level='O2', half_dtype=None, decide='cuda', masters='fp32',
            state='fp32'):
    "Train `cnn` with amp; returns the masters after each step and the scaler history"
    with settings(impl=impl, decide=decide):
        model = cnn()
        model, opt = amp.initialize(model, make_opt(kind, model.parameters()), opt_level=level, verbosity=0,
                                    half_dtype=half_dtype, masters=masters,
                                    state=state)
        snaps = []
        for i, (x, y) in enumerate(batches(n)):
            loss = F.cross_entropy(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if i == inject_at: model[0].weight.grad.view(-1)[0] = float('inf')
            opt.step(); opt.zero_grad()
            snaps.append([p.detach().clone() for p in amp.master_params(opt)])
        return snaps, list(amp.history()), model

@pytest.mark.parametrize("kind", ['sgd', 'adamw', 'adam'])
def test_amp_o2_fused_matches_reference(kind):
    (ref, _, _), (fused, hist, model) = amp_run('ref', kind), amp_run('fused', kind)
    assert ops.backend(next(model.parameters())) == 'cuda'
    assert next(model.parameters()).dtype == torch.float16 and model[1].weight.dtype == torch.float32
    # the kernels match the reference ops bit for bit (test_fused); torch's own CUDA Adam rounds differently (it
    # multiplies
    # by reciprocals), and Adam turns an ulp on a near-zero grad into a step of up to lr: bound that, and keep it rare
    lr = 0.05 if kind == 'sgd' else 1e-2
    for a, b in zip(ref[-1], fused[-1]):
        if kind == 'sgd': torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else: assert (a - b).abs().max() < 0.1 * lr and ((a - b).abs() > 1e-5).float().mean() < 0.1
    assert not any(r.skipped for r in hist)

def test_amp_overflow_skips_the_step_on_cuda():
    snaps, hist, _ = amp_run('fused', 'adamw', inject_at=2)
    assert [r.skipped for r in hist] == [False, False, True, False, False, False]
    assert hist[2].reason == 'overflow' and hist[3].scale == hist[2].scale / 2
    assert hist[2].params and '0.weight' in hist[2].params[0]
    for a, b in zip(snaps[1], snaps[2]): assert torch.equal(a, b)          # the skipped step changed no master
    assert all(torch.isfinite(p).all() for p in snaps[-1])

@pytest.mark.parametrize("kind", ['sgd', 'adamw'])
def test_skip_decided_on_the_device_matches_the_host(kind):
    # the same kernels, the skip decided by the host (a sync per step) or on the device (none): bit for bit the same run
    (h_snaps, h_hist, _), (d_snaps, d_hist, model) = (amp_run('fused', kind, inject_at=2,
                                                              decide=d) for d in ('never', 'cuda'))
    assert amp._state.engine.runner.on_device
    assert h_hist == d_hist and d_hist[2].skipped and d_hist[2].params == ('0.weight (inf)',)   # both name the param
    for a, b in zip(h_snaps, d_snaps):
        for x, y in zip(a, b): assert torch.equal(x, y)
    steps = [st['step'] for st in amp._state.optimizers[0].state.values() if 'step' in st]
    # Adam's counts moved beside the params, the skip not counted
    assert all(s.is_cuda and s.item() == 5 for s in steps)

def test_amp_bf16_trains_on_cuda():
    snaps, hist, model = amp_run('fused', 'adamw', n=4, half_dtype='bf16')
    assert next(model.parameters()).dtype == torch.bfloat16 and not any(r.skipped for r in hist)
    assert not torch.equal(snaps[0][0], snaps[-1][0])

def test_fp16_optimizer_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda().half()
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), dynamic_loss_scale=True, verbose=False)
    x, y = torch.randn(64, 32, device='cuda').half(), torch.randint(0, 4, (64,), device='cuda')
    losses = []
    for i in range(30):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        opt.backward(loss, update_master_grads=False)
        if i == 5: model[0].weight.grad.view(-1)[3] = float('nan')
        opt.update_master_grads()
        opt.clip_master_grads(1.0)
        opt.step()
        losses.append(loss.item())
    assert opt.history[5].skipped and sum(r.skipped for r in opt.history) == 1
    assert losses[-1] < 0.5 * losses[0]
    for g in opt.param_groups:
        for p in g['params']: assert p.dtype == torch.float32 and p.is_cuda

@pytest.mark.parametrize("how", ['to_fp16', 'to_bf16'])
def test_fastai_callback_trains_and_checkpoints_on_cuda(how, tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.dls.cuda()
    getattr(learn, how)()
    learn.fit(2, 1e-2)
    assert next(
        learn.model.parameters()).is_cuda and all(m.is_cuda and m.dtype == torch.float32 for m in masters_of(learn))
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0] * 1.5
    learn.save('ckpt')
    before = [m.clone() for m in masters_of(learn)]
    learn.fit(1, 1e-2)
    learn.load('ckpt')
    for a, b in zip(before, masters_of(learn)): assert torch.equal(a, b)

@pytest.mark.parametrize("masters,state", [('fp32', 'bf16'), ('split', '8bit')])
def test_lean_state_fused_matches_reference_on_cuda(masters, state):
    ref, _, _ = amp_run('ref', 'adamw', half_dtype='bf16', masters=masters, state=state, inject_at=3)
    fused, _, _ = amp_run('fused', 'adamw', half_dtype='bf16', masters=masters, state=state, inject_at=3)
    for a, b in zip(ref, fused):
        for x, y in zip(a, b): assert torch.equal(x, y)

def test_8bit_state_follows_the_model_to_the_gpu(tmp_path):
    learn = synth_learner(path=tmp_path).to_bf16(masters='split', state='8bit')
    learn.fit(1, 1e-2)                                        # the codes and scales are made on the CPU
    learn.dls.cuda()
    # fastai moves the model to the data's device; the state follows
    learn.fit(1, 1e-2)
    held = [v for s in learn.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert held and all(t.is_cuda for t in held) and torch.int8 in {t.dtype for t in held}
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0] * 1.5

def test_masters_follow_the_model_to_the_gpu():
    from mixedprec.convert import convert_model
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    conv = convert_model(model, torch.float16)
    assert not conv.follow_devices()
    model.cuda()                                              # fastai moves the model to the data's device at fit
    assert conv.follow_devices()
    assert all(m.is_cuda and m.dtype == torch.float32 for m in conv.masters.values())
    conv.undo()
    assert all(p.is_cuda and p.dtype == torch.float32 for p in model.parameters())

def sync_sites(fn) -> list:
    "Where `fn` makes synchronizing CUDA calls (torch's sync debug mode warns on each): 'file:line' per call"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try: fn()
        finally: torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename.split('/')[-1]}:{w.lineno}" for w in caught if 'synchroniz' in str(w.message).lower()]

@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_steady_state_step_makes_no_host_sync(front):
    # the skip is decided on the device: the fused step reads the overflow flag there and the scale is updated there;
    # the
    # host takes each step into its books one step late, from a copy that has landed by then. Only naming the params of
    # an
    # overflowed step reads the grads (a few syncs, in the step after it)
    model = cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if front == 'amp': model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)
    else: model = model.half(); opt = FP16_Optimizer(opt, dynamic_loss_scale=True, verbose=False)
    data = batches(10)
    def step(x, y):
        x = x.half() if front == 'fp16_optimizer' else x
        loss = F.cross_entropy(model(x).float(), y)
        if front == 'amp':
            with amp.scale_loss(loss, opt) as scaled: scaled.backward()
        else: opt.backward(loss)
        opt.step(); opt.zero_grad()
    for x, y in data[:3]:
        step(x, y)                      # warm-up: allocations, optimizer state, the scale's device copy
    torch.cuda.synchronize()
    # the process's first use of the debug mode may add a sync of its own
    sync_sites(lambda: torch.zeros(1, device='cuda').item())
    sites = [sync_sites(lambda: step(x, y)) for x, y in data[3:]]
    hist = list(amp.history() if front == 'amp' else opt.history)
    after_skip = [hist[i - 1].skipped for i in range(3, len(data))]
    assert len(hist) == len(data)
    assert all(not s for s, skip in zip(sites, after_skip) if not skip), (sites, after_skip)
    assert all(len(s) <= 6 for s in sites), sites                # naming an overflowed step's params: a few reads

class SyncSites(Callback):
    ("Where each training batch syncs, from `before_batch` to `after_step` (mixedprec's hooks and the model's work; "
     "fastai's recorder syncs after that)")
    order = 99
    def __init__(self): self.sites, self._cm = [], None
    def before_batch(self):
        if not self.training: return
        self._cm = warnings.catch_warnings(record=True)
        self._caught = self._cm.__enter__()
        warnings.simplefilter('always'); torch.cuda.set_sync_debug_mode('warn')
    def after_step(self):
        torch.cuda.set_sync_debug_mode(0)
        self._cm.__exit__(None, None, None)
        self.sites.append(
            [f"{w.filename.split('/')[-1]}:{w.lineno}" for w in self._caught if 'synchroniz' in str(w.message).lower()])

@pytest.mark.parametrize("opt_func", ['Adam', 'SGD'])
def test_fastai_fused_step_makes_no_host_sync(opt_func):
    # fastai's Adam/SGD stepped by the fused kernels on the GPU, under a one-cycle schedule: the skip is decided on the
    # device, so mixedprec's hooks and the step make no host sync; the same skips and masters as deciding on the host
    from fastai.optimizer import Adam, SGD
    from fastai.callback.schedule import fit_one_cycle
    from functools import partial
    opt_func = {'Adam': Adam, 'SGD': partial(SGD, mom=0.9, wd=1e-2)}[opt_func]
    runs = {}
    for where in ('never', 'cuda'):
        with settings(decide=where):
            learn = synth_learner(opt_func=opt_func)
            learn.dls.cuda()
            learn.to_fp16()
            sync = SyncSites()
            # the process's first use of the debug mode may add a sync of its own
            sync_sites(lambda: torch.zeros(1, device='cuda').item())
            learn.fit_one_cycle(2, 1e-2, cbs=[sync])
        runs[where] = learn, sync.sites
    (host, host_sites), (dev, dev_sites) = runs['never'], runs['cuda']
    assert all(len(s) >= 1 for s in host_sites[3:])                     # the host decision reads the flag once a step
    hist = dev.mixed_precision.history
    assert [
        r.skipped for r in hist] == [r.skipped for r in host.mixed_precision.history] and len(hist) == len(dev_sites)
    # after the warm-up, no sync; only naming the params of an overflowed step reads its grads (in the step after it)
    assert all(not s for i, s in enumerate(dev_sites) if i >= 3 and not hist[i - 1].skipped), (dev_sites, [r.skipped for r in hist])
    for a, b in zip(masters_of(host), masters_of(dev)): torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("decide", ['never', 'cuda'])
def test_fastai_names_the_overflowing_param_whichever_side_decides(decide):
    # fastai zeroes the grads in place after each step, before the books read a decision made on the device: the
    # names are kept on the device first (OverflowNames.freeze), so the history names the param as the host's does
    from helpers import synth_learner, Record
    def inject(learn):
        if learn.iter == 3 and learn.epoch == 0: learn.model[0].weight.grad.view(-1)[1] = float('nan')
    with settings(decide=decide):
        learn = synth_learner()
        learn.dls.cuda()
        learn.to_fp16()
        learn.add_cb(Record(-1, after_backward=inject))
        learn.fit(1, 1e-2)
    hist = list(learn.mixed_precision.scaler.history)
    bad = [r for r in hist if r.skipped and r.reason == 'overflow']
    assert any(r.params == ('0.weight (nan)',) for r in bad), hist[:6]
