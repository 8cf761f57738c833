"""Checkpoints: every door checks the whole record (keys, dtypes, shapes, finiteness, the scaler's ranges) before anything
changes, `learn.load` is all or nothing, and a save that fails or is killed halfway leaves the previous checkpoint whole."""
import copy, os, random, signal, subprocess, sys, textwrap
import pytest, torch
from torch import nn
from fastai.optimizer import Adam
from mixedprec import amp
from mixedprec.engine import StepEngine, save_checkpoint
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.master import CheckpointError
from helpers import synth_learner, masters_of, mlp, master_values
from test_faults import snapshot, same

def trained_learner(path, flat=False, **kw):
    learn = synth_learner(mlp(), opt_func=Adam, lr=1e-2, path=path).to_fp16(loss_scale=2.**8, flat_master=flat, **kw)
    learn.fit(1)
    return learn

def learner_state(learn):
    "Everything a load may change: the masters, the model's weights and buffers, the scaler and the optimizer state"
    mp = learn.mixed_precision
    return snapshot([m for m in masters_of(learn)], learn.model.state_dict(keep_vars=True),
                    [b for b in learn.model.buffers()],
                    [p for p in learn.model.parameters()], mp.scaler.state_dict(), learn.opt.state_dict())

def written(path, name):
    "The checkpoint `name` as torch reads it (all of it, to corrupt)"
    return torch.load(path/'models'/f'{name}.pth', weights_only=False)

def write(path, name, state): torch.save(state, path/'models'/f'{name}.pth')

def refused_and_unchanged(learn, name, match='nothing was loaded', exc=(ValueError, RuntimeError)):
    before = learner_state(learn)
    with pytest.raises(exc, match=match): learn.load(name, with_opt=True)
    assert same(before, learner_state(learn))

# ---------------------------------------------------------------- learn.load: all or nothing

@pytest.mark.parametrize("flat", [False, True])
def test_learn_load_with_a_key_more_or_fewer_changes_nothing(tmp_path, flat):
    learn = trained_learner(tmp_path, flat)
    learn.save('good', with_opt=True)
    learn.fit(1)                                                       # the learner moves on: a load would change it
    ck = written(tmp_path, 'good')
    fewer = copy.deepcopy(ck); fewer['model'].pop('3.bias'); write(tmp_path, 'fewer', fewer)
    more = copy.deepcopy(ck); more['model']['4.weight'] = torch.zeros(2); write(tmp_path, 'more', more)
    refused_and_unchanged(learn, 'fewer', match=r"Missing key\(s\): 3\.bias")
    refused_and_unchanged(learn, 'more', match=r"Unexpected key\(s\): 4\.weight")
    learn.load('good', with_opt=True)                                  # the good one still loads, and training goes on
    learn.fit(1)

@pytest.mark.parametrize("corrupt", ['scale 0', 'state of the wrong shape', 'not an optimizer state'])
def test_learn_load_whose_optimizer_part_is_refused_raises_and_keeps_the_weights(tmp_path, corrupt):
    # fastai's load_model would load the weights, then only warn "Could not load the optimizer state"
    learn = trained_learner(tmp_path)
    learn.save('good', with_opt=True)
    learn.fit(1)
    ck = written(tmp_path, 'good')
    if corrupt == 'scale 0': ck['opt']['mixedprec']['scaler']['scale'] = 0.
    elif corrupt == 'state of the wrong shape': ck['opt']['state'][0]['grad_avg'] = torch.zeros(3)
    else: ck['opt'] = {'junk': 1}
    write(tmp_path, 'bad', ck)
    refused_and_unchanged(learn, 'bad')

# ---------------------------------------------------------------- the scaler's whole state, through every door

BAD_SCALER = {'min_scale 0': dict(min_scale=0.), 'factor 0.5': dict(factor=0.5), 'max_noskip 0': dict(max_noskip=0),
              'max_scale inf': dict(max_scale=float('inf')), 'scale above max_scale': dict(scale=2.**30),
              'scale nan': dict(scale=float('nan')), 'negative count': dict(n_skipped=-1),
                  'min above max': dict(min_scale=2.**25)}

def fp16_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True, verbose=False)
    for _ in range(2):
        opt.zero_grad(); opt.backward(model(torch.randn(8, 4).half()).float().pow(2).mean()); opt.step()
    return model, opt

def amp_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), opt_level='O2', verbosity=0)
    with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as s: s.backward()
    opt.step(); opt.zero_grad()
    return model, opt

@pytest.mark.parametrize("bad", list(BAD_SCALER))
def test_every_door_refuses_a_scaler_state_out_of_range(tmp_path, bad):
    fields = BAD_SCALER[bad]
    # fastai: the callback's own state_dict, and learn.load
    learn = trained_learner(tmp_path)
    mp = learn.mixed_precision
    sd = mp.state_dict(); sd['scaler'].update(fields)
    before = learner_state(learn)
    with pytest.raises(ValueError, match='nothing was loaded|not a LossScaler'): mp.load_state_dict(sd)
    assert same(before, learner_state(learn))
    learn.save('good', with_opt=True); ck = written(tmp_path, 'good'); ck['opt']['mixedprec']['scaler'].update(fields); write(tmp_path, 'bad', ck)
    refused_and_unchanged(learn, 'bad', match='nothing was loaded|not a LossScaler')
    # FP16_Optimizer
    model, opt = fp16_optimizer()
    sd = opt.state_dict(); sd['loss_scaler'].update(fields)
    before = snapshot(opt.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match='nothing was loaded|not a LossScaler'): opt.load_state_dict(sd)
    assert same(before, snapshot(opt.state_dict(), model.state_dict()))
    # amp
    model, opt = amp_model()
    sd = amp.state_dict(); sd['loss_scaler0'].update(fields)
    before = snapshot(amp.state_dict(), model.state_dict(), opt.state_dict())
    with pytest.raises(ValueError, match='nothing was loaded|not a LossScaler'): amp.load_state_dict(sd)
    assert same(before, snapshot(amp.state_dict(), model.state_dict(), opt.state_dict()))

# ---------------------------------------------------------------- the masters' values: finite, floating, of the right
# shape

@pytest.mark.parametrize("bad", ['nan', 'int64', 'transposed'])
def test_every_door_refuses_a_master_that_cannot_be_one(tmp_path, bad):
    def spoil(v):
        if bad == 'nan': v = v.clone(); v.view(-1)[0] = float('nan'); return v
        if bad == 'int64': return v.round().long()
        return v.t().contiguous() if v.dim() == 2 else v.flip(0)[:-1]
    match = {'nan': 'inf or NaN', 'int64': 'torch.int64, a master is floating point',
             'transposed': 'comes from another model'}[bad]
    learn = trained_learner(tmp_path)
    mp = learn.mixed_precision
    sd = mp.state_dict(); sd['masters'][0] = spoil(sd['masters'][0])
    before = learner_state(learn)
    with pytest.raises(ValueError, match=match): mp.load_state_dict(sd)
    assert same(before, learner_state(learn))
    learn.save('good', with_opt=True); ck = written(tmp_path, 'good'); ck['model']['0.weight'] = spoil(ck['model']['0.weight']); write(tmp_path, 'bad', ck)
    refused_and_unchanged(learn, 'bad', match=match if bad != 'transposed' else 'size mismatch')
    model, opt = fp16_optimizer()
    sd = opt.state_dict(); sd['fp32_from_fp16'][0] = spoil(sd['fp32_from_fp16'][0])
    before = snapshot(opt.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match=match): opt.load_state_dict(sd)
    assert same(before, snapshot(opt.state_dict(), model.state_dict()))
    model, opt = amp_model()
    sd = amp.state_dict(); sd['masters'][0][0] = spoil(sd['masters'][0][0])
    before = snapshot(amp.state_dict(), model.state_dict(), opt.state_dict())
    with pytest.raises(ValueError, match=match): amp.load_state_dict(sd)
    assert same(before, snapshot(amp.state_dict(), model.state_dict(), opt.state_dict()))

def test_a_nan_weight_loaded_into_the_half_model_is_refused():
    # model.load_state_dict straight into a converted model (the user's own load): the master would be NaN
    learn = synth_learner(mlp()).to_fp16()
    sd = {k: v.clone() for k, v in learn.model.state_dict().items()}
    sd['0.weight'][0, 0] = float('inf')
    before = learner_state(learn)
    with pytest.raises(ValueError, match='0.weight holds inf or NaN'): learn.model.load_state_dict(sd)
    assert same(before, learner_state(learn))

def test_optimizer_state_with_nan_or_ints_is_refused_and_half_state_is_cast(tmp_path):
    learn = trained_learner(tmp_path)
    learn.save('good', with_opt=True)
    ck = written(tmp_path, 'good')
    nan = copy.deepcopy(
        ck); nan['opt']['state'][0]['sqr_avg'] = torch.full_like(nan['opt']['state'][0]['sqr_avg'],
                                                                 float('nan')); write(tmp_path, 'nan', nan)
    refused_and_unchanged(learn, 'nan', match="'sqr_avg' of param 0 .* holds inf or NaN")
    ints = copy.deepcopy(
        ck); ints[
            'opt']['state'][0]['grad_avg'] = ints['opt']['state'][0]['grad_avg'].long(); write(tmp_path, 'ints', ints)
    refused_and_unchanged(learn, 'ints', match="'grad_avg' of param 0 .* is torch.int64")
    half = copy.deepcopy(ck)
    for s in half['opt']['state']:
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0: s[k] = v.half()
    write(tmp_path, 'half', half)
    # fp16 state is cast to the masters' fp32, and trains on
    learn.load('half', with_opt=True)
    assert all(
        v.dtype == torch.float32 for p in masters_of(
            learn) for v in learn.opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    learn.fit(1)
    assert all(torch.isfinite(m).all() for m in masters_of(learn))

def test_amp_optimizer_load_refuses_another_models_state_with_the_same_param_count():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))              # 4 params: (8, 4) (8,) (2, 8) (2,)
    b = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))              # 4 params: (4, 8) (4,) (4, 4) (4,)
    sds = []
    for m in (b, a):
        m, opt = amp.initialize(m, torch.optim.Adam(m.parameters(), lr=1e-2), opt_level='O2', verbosity=0)
        x = torch.randn(8, m[0].in_features)
        with amp.scale_loss(m(x).float().pow(2).mean(), opt) as s: s.backward()
        opt.step(); sds.append(opt.state_dict())
    before = snapshot(opt.state_dict(), m.state_dict())
    with pytest.raises(ValueError, match="'exp_avg' of param 0 is \\(4, 8\\), the param is \\(8, 4\\): it comes from "
                                         "another model"):
        opt.load_state_dict(sds[0])
    assert same(before, snapshot(opt.state_dict(), m.state_dict()))

# ---------------------------------------------------------------- a round trip just after a skipped step

def test_fp16_optimizer_round_trip_after_a_skipped_step_loses_no_step():
    # torch's grad-scaling `try_pickle` case: an inf at one step, a state_dict round trip right after; the next step
    # must step
    def run(round_trip):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-1), dynamic_loss_scale=True, verbose=False)
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            opt.zero_grad(); opt.backward(model(torch.randn(8, 4, generator=g).half()).float().pow(2).mean(),
                                          update_master_grads=False)
            if i == 1: next(model.parameters()).grad.view(-1)[0] = float('inf')
            opt.update_master_grads(); opt.step()
            if i == 1 and round_trip: opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        return [p.detach().clone() for p in model.parameters()], [r.skipped for r in opt.history]
    (w, skipped), (w_rt, skipped_rt) = run(False), run(True)
    assert skipped == skipped_rt == [False, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(w, w_rt))

# ---------------------------------------------------------------- atomic saves

def test_learn_save_that_fails_halfway_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    learn = trained_learner(tmp_path)
    learn.save('ck', with_opt=True)
    good = (tmp_path/'models'/'ck.pth').read_bytes()
    learn.fit(1)
    import fastai.learner
    real = torch.save
    def half_write(obj, f, **kw):                                      # writes part of the file, then the disk is full
        real(obj, f, **kw)
        with open(f, 'r+b') as fh: fh.truncate(1000)
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(fastai.learner.torch, 'save', half_write)
    with pytest.raises(OSError, match=r"could not save .*ck\.pth: the disk is full.*previous file at that path .* is "
                                      r"unchanged"):
        learn.save('ck', with_opt=True)
    monkeypatch.undo()
    assert (tmp_path/'models'/'ck.pth').read_bytes() == good
    assert [f.name for f in (tmp_path/'models').iterdir()] == ['ck.pth']  # no temporary file left behind
    learn.load('ck', with_opt=True)

def test_export_and_save_checkpoint_are_atomic_too(tmp_path, monkeypatch):
    learn = trained_learner(tmp_path)
    # (the synthetic data has no empty copy; export pickles it whole)
    learn.dls.new_empty = lambda: learn.dls
    learn.export('model.pkl')
    good = (tmp_path/'model.pkl').read_bytes()
    def boom(*a, **k): raise PermissionError(13, 'Permission denied')
    import fastai.learner
    monkeypatch.setattr(fastai.learner.torch, 'save', boom)
    with pytest.raises(OSError, match='no permission to write'): learn.export('model.pkl')
    monkeypatch.undo()
    assert (tmp_path/'model.pkl').read_bytes() == good
    model, opt = fp16_optimizer()
    save_checkpoint({'model': model.state_dict(), 'opt': opt.state_dict()}, tmp_path/'plain.pt')
    ck = torch.load(tmp_path/'plain.pt', weights_only=True)              # what it wrote loads with weights only
    opt.load_state_dict(ck['opt'])

KILLED_SAVE = textwrap.dedent('''
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from helpers import synth_learner, mlp
    from fastai.optimizer import Adam
    import mixedprec.callback
    learn = synth_learner(mlp(), opt_func=Adam, lr=1e-2, path={path!r}).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    real = torch.save
    def killed(obj, f, **kw):
        real(obj, f, **kw)
        with open(f, 'r+b') as fh: fh.truncate(500)
        os.kill(os.getpid(), signal.SIGKILL)                          # killed halfway through the write
    torch.save = killed
    learn.save('ck', with_opt=True)
''')

def test_a_save_killed_halfway_leaves_the_previous_checkpoint_whole(tmp_path):
    learn = trained_learner(tmp_path)
    learn.save('ck', with_opt=True)
    good = (tmp_path/'models'/'ck.pth').read_bytes()
    r = subprocess.run([sys.executable, '-c', KILLED_SAVE.format(tests=os.path.dirname(__file__),
                                                                 path=str(tmp_path))], capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    assert (tmp_path/'models'/'ck.pth').read_bytes() == good
    before = learner_state(learn)
    learn.fit(1); learn.load('ck', with_opt=True)
    after = learner_state(learn)
    assert same(before[0], after[0]) and same(before[4], after[4])   # the masters and the scaler, bit for bit

FSIZE_SAVE = textwrap.dedent('''
    import resource, signal, sys
    sys.path.insert(0, {tests!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)                     # past the limit a write fails with EFBIG instead of killing
    from helpers import synth_learner, mlp
    from fastai.optimizer import Adam
    import mixedprec.callback
    learn = synth_learner(mlp(), opt_func=Adam, lr=1e-2, path={path!r}).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
    try: learn.save('ck', with_opt=True)
    except OSError as e: print('ERROR', e)
''')

def test_a_save_past_the_file_size_limit_says_so_and_keeps_the_old_file(tmp_path):
    learn = trained_learner(tmp_path)
    learn.save('ck', with_opt=True)
    good = (tmp_path/'models'/'ck.pth').read_bytes()
    r = subprocess.run([sys.executable, '-c', FSIZE_SAVE.format(tests=os.path.dirname(__file__), path=str(tmp_path))],
                       capture_output=True, timeout=300, text=True)
    assert 'ERROR mixedprec: could not save' in r.stdout and 'previous file at that path (if any) is unchanged' in r.stdout, (r.stdout, r.stderr[-2000:])
    assert (tmp_path/'models'/'ck.pth').read_bytes() == good

# ---------------------------------------------------------------- a property: random corruptions are all refused, and
# nothing changes

def _corruptions(ck, rng):
    "A few random damages of a valid fastai checkpoint, each with its name"
    keys = [k for k in ck['model'] if ck['model'][k].is_floating_point()]
    k = rng.choice(keys)
    scaler_fields = {'scale': [0., -1., float('inf'), float('nan'), 2.**40], 'min_scale': [0., -2.],
                     'factor': [1., 0.5], 'max_noskip': [0, -5],
                     'max_scale': [float('inf'), 0.], 'n_steps': [-1], 'noskip': [-3]}
    field = rng.choice(sorted(scaler_fields))
    i = rng.randrange(len(ck['opt']['state']))
    tensor_keys = [s for s, v in ck['opt']['state'][i].items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    def nan_at(t):
        t = t.clone(); t.view(-1)[rng.randrange(t.numel())] = float('nan'); return t
    return {f'drop {k}':            lambda c: c['model'].pop(k), f'add a key':           lambda c: c['model'].__setitem__('extra.weight', torch.zeros(3)), f'{k} as float64 NaN':  lambda c: c['model'].__setitem__(k, nan_at(c['model'][k].double())), f'{k} reshaped':        lambda c: c['model'].__setitem__(k, c['model'][k].reshape(-1)[:-1] if c['model'][k].numel() > 1 else torch.zeros(2)), f'{k} as int':          lambda c: c['model'].__setitem__(k, c['model'][k].long()) if k in ('0.weight', '0.bias', '3.weight', '3.bias') else c['model'].pop(k), f'scaler {field}':      lambda c: c['opt']['mixedprec']['scaler'].__setitem__(field, rng.choice(scaler_fields[field])), f'state {i} NaN':       lambda c: [c['opt']['state'][i].__setitem__(s, nan_at(c['opt']['state'][i][s])) for s in tensor_keys[:1]] or c['opt']['state'].pop(), f'state {i} shape':     lambda c: [c['opt']['state'][i].__setitem__(s, torch.zeros(7)) for s in tensor_keys[:1]] or c['opt']['state'].pop(), 'a group less':         lambda c: c['opt']['hypers'].pop(),}

@pytest.mark.parametrize("seed", range(3))
def test_random_corruptions_of_a_checkpoint_are_all_refused_and_change_nothing(tmp_path, seed):
    rng = random.Random(seed)
    learn = trained_learner(tmp_path, flat=bool(seed % 2))
    learn.save('good', with_opt=True)
    learn.fit(1)
    ck = written(tmp_path, 'good')
    for name, spoil in _corruptions(ck, rng).items():
        bad = copy.deepcopy(ck); spoil(bad); write(tmp_path, 'bad', bad)
        before = learner_state(learn)
        try:
            learn.load('bad', with_opt=True)
            raise AssertionError(f"{name}: loaded")
        except (ValueError, RuntimeError, KeyError): pass
        assert same(before, learner_state(learn)), name
    learn.load('good', with_opt=True); learn.fit(1)

# ---------------------------------------------------------------- checkpoints written before the checked loads still
# load

OLD = os.path.join(os.path.dirname(__file__), 'data', 'checkpoints_c59eba0')    # written by mixedprec at commit c59eba0

@pytest.mark.parametrize("flat", [False, True])
def test_a_fastai_checkpoint_of_an_earlier_version_loads(tmp_path, flat):
    import shutil
    shutil.copy(os.path.join(OLD, f'learn_flat{flat}.pth'), tmp_path / 'old.pth')
    ck = torch.load(tmp_path / 'old.pth', weights_only=True)          # also with weights only
    learn = synth_learner(mlp(), opt_func=Adam, lr=1e-2, path=tmp_path,
                          model_dir='.').to_fp16(loss_scale=2.**8, flat_master=flat)
    learn.load('old', with_opt=True)
    assert all(torch.equal(m, ck['model'][n]) for (n, _), m in zip(learn.model.named_parameters(), master_values(learn)))
    assert learn.mixed_precision.scaler.state_dict() == ck['opt']['mixedprec']['scaler']
    learn.fit(1)

def test_plain_pytorch_checkpoints_of_an_earlier_version_load():
    ck = torch.load(os.path.join(OLD, 'fp16_optimizer.pt'), weights_only=True)
    model, opt = fp16_optimizer()
    model.load_state_dict(ck['model']); opt.load_state_dict(ck['opt'])
    assert all(torch.equal(a, b) for a, b in zip(opt.state_dict()['fp32_from_fp16'], ck['opt']['fp32_from_fp16']))
    ck = torch.load(os.path.join(OLD, 'amp.pt'), weights_only=True)
    model, opt = amp_model()
    model.load_state_dict(ck['model']); opt.load_state_dict(ck['opt']); amp.load_state_dict(ck['amp'])
    assert all(torch.equal(a, b) for a, b in zip(amp.state_dict()['masters'][0], ck['amp']['masters'][0]))

def test_a_kept_mixed_precision_export_carries_no_optimizer_through_the_callback(tmp_path):
    # the callback's state reader holds the optimizer (a wrapped torch one: its bound methods); export pickles the
    # callback
    from functools import partial
    from fastai.optimizer import OptimWrapper
    learn = synth_learner(mlp(), opt_func=partial(OptimWrapper, opt=torch.optim.AdamW), lr=1e-2,
                          path=tmp_path).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    learn.dls.new_empty = lambda: learn.dls
    learn.export('kept.pkl', keep_mixed_precision=True)
    back = torch.load(tmp_path / 'kept.pkl', weights_only=False)       # as pickled (load_learner returns it to fp32)
    cb = next(c for c in back.cbs if type(c).__name__ == 'MixedPrecision' and hasattr(c, 'scaler'))
    assert cb.state_io is None and cb.engine is None and back.opt is None
    assert not any(isinstance(o, torch.optim.Optimizer) for o in vars(cb).values())

def test_a_hand_made_state_dict_without_batchnorms_step_count_loads_as_in_torch():
    # torch's batchnorm fills in `num_batches_tracked` for a dict without version metadata; the key check lets it, as
    # torch does
    learn = synth_learner(mlp()).to_fp16()
    sd = {k: v.clone() for k, v in learn.model.state_dict().items() if not k.endswith('num_batches_tracked')}
    learn.model.load_state_dict(sd)
    plain = mlp(); plain.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})

def test_learn_load_checks_each_tensor_once(tmp_path, monkeypatch):
    # learn.load checks the model's state and the optimizer's before anything changes; the model's own load hook then
    # takes the checked state without checking it again (it used to run every check twice)
    import mixedprec.convert as convert, mixedprec.master
    learn = synth_learner(path=tmp_path, opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1); learn.save('once')
    calls = []
    real = convert.check_master_value
    # the masters' record (mixedprec.master) checks the masters; convert checks the fp32 params it keeps
    for module in (convert, mixedprec.master):
        monkeypatch.setattr(module, 'check_master_value', lambda *a, **k: (calls.append(a[2]), real(*a, **k))[1])
    learn.load('once')
    assert len(calls) == len(set(calls)) == len(list(learn.model.parameters()))
    learn.model.load_state_dict(learn.model.state_dict())          # a direct load still checks, once
    assert len(calls) == 2 * len(list(learn.model.parameters()))
    learn.fit(1)
