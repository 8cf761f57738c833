"""torch's FSDP2 (`fully_shard`) under each front end, in each order. FP16_Optimizer and amp O2 drive an FSDP2 model (its
sharded fp32 params are the masters): trained at 2 and 3 gloo ranks against an unsharded fp32 run, a skip on one rank's
shard skips on all and is named on all, the clip norm is the global one, DCP checkpoints resume. The fastai callback, and
amp over a model wrapped after it, refuse it with what to use instead, never a model that runs and does not train (amp O2
applied before `fully_shard` did exactly that); for those, one gloo process group of one rank is enough."""
import pytest, torch
from torch import nn
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")

@pytest.fixture(scope='module')
def group(tmp_path_factory):
    "A one-rank gloo group for `fully_shard`, removed after this module"
    if dist.is_initialized(): pytest.skip("a process group is already set up in this process")
    dist.init_process_group('gloo', init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

def sharded(model):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)
    return model

X = torch.randn(4, 8)

def test_amp_o2_then_fully_shard_is_refused_at_the_first_scale_loss_not_silently_untrained(group):
    from mixedprec import amp
    m = mlp()
    model, opt = amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level='O2', verbosity=0)
    sharded(model)
    with pytest.raises(TypeError, match=r"fully_shard.*after amp.initialize.*MixedPrecisionPolicy"):
        with amp.scale_loss(model(X).float().sum(), opt) as s: s.backward()

def test_fully_shard_then_amp_o2_takes_the_fp32_params_as_masters_and_casts_nothing(group):
    from mixedprec import amp
    model = sharded(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"opt_level='O1' with an FSDP2 model: use opt_level='O2'"):
        amp.initialize(model, opt, opt_level='O1', verbosity=0)
    with pytest.raises(ValueError, match=r"pass masters='fp32'"):
        amp.initialize(model, opt, opt_level='O2', verbosity=0, masters='split', half_dtype='bf16')
    dtypes = [p.dtype for p in model.parameters()]
    model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)
    assert [p.dtype for p in model.parameters()] == dtypes == [torch.float32] * 4, "FSDP2's policy casts, not amp"
    assert not amp._engine_of(opt)[0].masters.trained, "no second copy of the weights"
    with amp.scale_loss(model(X).float().sum(), opt) as s: s.backward()
    opt.step()

def test_fp16_optimizer_over_fsdp2_takes_its_fp32_params_as_masters_and_refuses_what_does_not_combine(group):
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = sharded(mlp())
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    assert opt.engine.masters.fsdp2 and not opt.engine.masters.trained, "no second copy of the weights"
    assert all(m is p for m, p in zip(opt.param_groups[0]['params'], model.parameters()))
    with pytest.raises(TypeError, match="shard"):
        FP16_Optimizer(torch.optim.SGD(sharded(mlp()).parameters(), lr=0.1), verbose=False, shard=True)
    with pytest.raises(ValueError, match="pass masters='fp32'"):
        FP16_Optimizer(torch.optim.SGD(sharded(mlp()).parameters(), lr=0.1), verbose=False, masters='split')
    with pytest.raises(TypeError, match=r"torch.float16 params.*keep the params fp32.*MixedPrecisionPolicy"):
        FP16_Optimizer(torch.optim.SGD(sharded(mlp().half()).parameters(), lr=0.1), verbose=False)

def test_a_backward_without_the_scaling_call_on_fsdp2_is_refused_at_the_step_naming_accelerates(group):
    ("A plain `loss.backward()` (what accelerate's `accelerator.backward(loss)` runs with mixed_precision='no') would "
     "step grads no scaler saw: refused at the step on every front end, naming the call to make instead")
    from mixedprec import amp
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = sharded(mlp())
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    model(X).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"never unscaled.*optimizer.backward\(loss\).*accelerator.backward"):
        opt.step()
    model = sharded(mlp())
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1), opt_level='O2', verbosity=0)
    model(X).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"never unscaled.*amp.scale_loss.*accelerator.backward"): opt.step()

@pytest.mark.parametrize('dampening, stepped', [(0., False), (0.1, False), (0.1, True)])
def test_sgds_lean_state_made_up_front_on_fsdp2_steps_as_the_one_made_at_the_first_step(group, dampening, stepped):
    ("On FSDP2, lean state exists before the first step (DCP loads only the keys a fresh optimizer holds); SGD's first "
     "step with dampening (buffer = grad) is known by the rounding stream's count, still 0: bit for bit with the state "
     "made at the first step, unsharded. `stepped`: torch's SGD stepped twice before, its buffers kept, not restarted")
    from mixedprec.fp16_optimizer import FP16_Optimizer
    weights = []
    for model in (mlp(), sharded(mlp())):
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=dampening)
        for step in range(2 if stepped else 0):
            inner.zero_grad(); model(X).pow(2).mean().backward(); inner.step()
        opt = FP16_Optimizer(inner, verbose=False, state='bf16')
        assert len(opt.optimizer.state) == (4 if len(weights) or stepped else 0)
        for step in range(4):
            opt.zero_grad(); opt.backward(model(X).float().pow(2).mean()); opt.step()
        weights.append([getattr(p, 'full_tensor', p.detach)().detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))

def test_fp16_optimizer_then_fully_shard_is_refused_at_the_backward(group):
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = mlp().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    sharded(model)
    with pytest.raises(RuntimeError, match=r"reached none of the params.*fully_shard"):
        opt.backward(model(X.half()).float().sum())

def test_fastai_to_fp16_then_fully_shard_is_refused_at_the_fit_naming_the_order_that_works(group):
    from helpers import synth_learner
    import mixedprec.callback
    # (with batchnorm kept fp32, FSDP2 refuses the mixed dtypes itself)
    learn = synth_learner(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))).to_fp16()
    sharded(learn.model)
    with pytest.raises(TypeError, match=r"fit: the model was wrapped by `fully_shard` after to_fp16.*Wrap first"):
        learn.fit(1)


# FP16_Optimizer on FSDP2 at 2 and 3 gloo ranks (tests/dist_workers.py: `fsdp2_fp16_optimizer`): deep_mlp wrapped layer
# by layer, AdamW, clipped at 1.0 every step, against the same steps unsharded in fp32 with torch's AdamW
def run(*args, world):
    from test_distributed import spawn
    import tempfile, pathlib
    return spawn('fsdp2_fp16_optimizer', pathlib.Path(tempfile.mkdtemp()), *args, world=world)

def agreed(ranks):
    "Every rank holds the same weights, skipped the same steps and clipped by the same norms"
    for r in ranks[1:]:
        assert r['skipped'] == ranks[0]['skipped'] and r['norms'] == ranks[0]['norms']
        assert all(torch.equal(a, b) for a, b in zip(r['params'], ranks[0]['params']))

@pytest.mark.parametrize('front', ['fp16_optimizer', 'amp'])
def test_fsdp2_in_fp32_under_mixedprec_is_torchs_unsharded_adamw(front):
    ranks = run('fp32', 'fp32', False, None, False, front, world=2)
    agreed(ranks)
    ref = ranks[0]['reference']
    assert max((a - b).abs().max().item() for a, b in zip(ranks[0]['params'], ref['params'])) < 1e-6
    assert ranks[0]['norms'] == pytest.approx(ref['norms'], rel=1e-5)
    # fp32 state on each rank's shards is stepped by the fused AdamW, as the README says
    assert all(r['runner'] == 'torch AdamW' for r in ranks), [r['runner'] for r in ranks]

@pytest.mark.parametrize('front, named', [('fp16_optimizer', '(24, 32) (inf)'), ('amp', '2.weight (inf)')])
def test_fsdp2_fp16_skips_on_every_rank_names_the_param_on_every_rank_and_trains_as_fp32(front, named):
    from dist_workers import FSDP2_INJECT
    ranks = run('fp16', 'fp32', True, None, False, front, world=3)     # the inf: in rank 1's shard of a grad only
    agreed(ranks)
    ref = ranks[0]['reference']                           # the same step skipped
    assert ranks[0]['skipped'] == [step == FSDP2_INJECT for step in range(len(ref['norms']))]
    assert all(r['named'][FSDP2_INJECT] == (named,) for r in ranks)
    clipped = [i for i in range(len(ref['norms'])) if i != FSDP2_INJECT]
    assert [ranks[0]['norms'][i] for i in clipped] == pytest.approx([ref['norms'][i] for i in clipped], rel=2e-3)
    assert ranks[0]['loss'] == pytest.approx(ref['loss'], rel=1e-2) and ref['loss'] < 0.6 * ref['start']

@pytest.mark.parametrize('world, front, state', [(2, 'fp16_optimizer', 'bf16'), (3, 'fp16_optimizer', 'bf16'),
                                                 (3, 'amp', 'bf16'), (2, 'fp16_optimizer', '8bit'), (3, 'amp', '8bit')])
def test_fsdp2_bf16_with_lean_state_on_each_ranks_shards_trains_as_fp32(world, front, state):
    ranks = run('bf16', state, False, None, False, front, world=world)
    agreed(ranks)
    ref = ranks[0]['reference']
    kept = {'bf16': {torch.bfloat16}, '8bit': {torch.int8, torch.uint8, torch.float32}}[state]    # (8-bit: the scales)
    assert set(ranks[0]['state_dtypes'].values()) == kept, "the moments kept lean on each rank's shards"
    assert not any(ranks[0]['skipped']) and ranks[0]['norms'] == pytest.approx(ref['norms'], rel=6e-2)
    assert ranks[0]['loss'] == pytest.approx(ref['loss'], rel=3e-2)

@pytest.mark.parametrize('front', ['fp16_optimizer', 'amp'])
def test_fsdp2_accumulates_with_torchs_no_sync_idiom_as_the_unsharded_fp32_run(front):
    ("Two micro-batches a step, the first under `set_requires_gradient_sync(False)` (FSDP2 keeps its grads itself, "
     "every `.grad` None): FP16_Optimizer's `backward(update_master_grads=False)` and amp's `delay_unscale` take it")
    ranks = run('fp32', 'fp32', False, None, False, front, 1.0, 1e-2, 'adamw', 'fully_shard', True, world=2)
    agreed(ranks)
    ref = ranks[0]['reference']
    assert not any(ranks[0]['skipped'])
    assert max((a - b).abs().max().item() for a, b in zip(ranks[0]['params'], ref['params'])) < 1e-6
    assert ranks[0]['norms'] == pytest.approx(ref['norms'], rel=1e-5)

@pytest.mark.parametrize('world, front, norm_type', [(2, 'fp16_optimizer', float('inf')), (3, 'amp', float('inf')),
                                                     (3, 'fp16_optimizer', 1.)])
def test_fsdp2_clip_norms_of_every_type_are_the_global_norm_on_every_rank(world, front, norm_type):
    "The norm a clip returns (users log it and branch on it) is the whole model's on every rank, as torch's unsharded"
    ranks = run('fp32', 'fp32', False, None, False, front, 1.0, 1e-2, 'adamw', 'fully_shard', False, norm_type,
                world=world)
    agreed(ranks)
    ref = ranks[0]['reference']
    assert ranks[0]['norms'] == pytest.approx(ref['norms'], rel=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(ranks[0]['params'], ref['params'])) < 1e-6

@pytest.mark.parametrize('front', ['fp16_optimizer', 'amp'])
def test_accelerates_own_clip_between_the_backward_and_the_step_clips_the_unscaled_grads(front):
    ("`accelerator.clip_grad_norm_(model.parameters(), c)`, as accelerate's users write it, after the front end's "
     "backward: FSDP2's shards are their own masters, unscaled in place, so it clips what is stepped")
    ranks = run('fp16', 'fp32', False, None, False, front, 1.0, 1e-2, 'adamw', 'accelerate', False, 2., True, world=2)
    agreed(ranks)
    ref = ranks[0]['reference']                    # fp16 compute, a loss scale of 2**10: a clip of scaled grads is 1024x
    assert not any(ranks[0]['skipped']) and ranks[0]['norms'] == pytest.approx(ref['norms'], rel=5e-3)
    assert ranks[0]['loss'] == pytest.approx(ref['loss'], rel=1e-2) and ref['loss'] < 0.6 * ref['start']

# accelerate's FSDP2 plugin (`accelerator.prepare(model, optimizer)`, tests/dist_workers.py: `accelerate_fsdp2`): its
# AcceleratedOptimizer given to FP16_Optimizer or amp.initialize, which step the torch optimizer inside it
@pytest.mark.parametrize('front, state, named', [('fp16_optimizer', 'bf16', '(24, 32) (inf)'),
                                                 ('amp', '8bit', '2.weight (inf)')])
def test_accelerates_fsdp2_plugin_under_each_front_end_skips_on_every_rank_and_trains_as_fp32(front, state, named):
    pytest.importorskip('accelerate')
    from dist_workers import FSDP2_INJECT
    ranks = run('fp16', state, True, None, False, front, 1.0, 1e-2, 'adamw', 'accelerate', world=2)
    agreed(ranks)
    assert ranks[0]['given'] == 'AcceleratedOptimizer' and ranks[0]['wrapped'] == 5, "accelerate wrapped 4 + the root"
    assert ranks[0]['masters'] == 0, "FSDP2's fp32 shards are the masters: no second copy"
    ref = ranks[0]['reference']
    assert ranks[0]['skipped'] == [step == FSDP2_INJECT for step in range(len(ref['norms']))]
    assert all(r['named'][FSDP2_INJECT] == (named,) for r in ranks)
    clipped = [i for i in range(len(ref['norms'])) if i != FSDP2_INJECT]
    assert [ranks[0]['norms'][i] for i in clipped] == pytest.approx([ref['norms'][i] for i in clipped], rel=6e-2)
    assert ranks[0]['loss'] == pytest.approx(ref['loss'], rel=3e-2) and ref['loss'] < 0.6 * ref['start']

def test_accelerates_optimizer_is_refused_where_accelerate_would_scale_the_loss_or_skip_steps_too():
    ("accelerate's own GradScaler (mixed_precision='fp16', made on GPUs; set here as it sets it) and its gradient "
     "accumulation (steps skipped inside its AcceleratedOptimizer) would run beside mixedprec's: refused by name")
    pytest.importorskip('accelerate')
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from mixedprec.fp16_optimizer import FP16_Optimizer
    from mixedprec import amp
    try:
        for kw, match in [({}, r"accelerate's own loss scaler.*mixed_precision='no'.*MixedPrecisionPolicy"),
                          (dict(gradient_accumulation_steps=4), r"gradient_accumulation_steps=4.*delay_unscale")]:
            accelerator = Accelerator(cpu=True, **kw)
            if not kw: accelerator.scaler = torch.amp.GradScaler('cpu')
            m = mlp()
            model, opt = accelerator.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
            assert type(opt).__name__ == 'AcceleratedOptimizer'
            with pytest.raises(ValueError, match=r"FP16_Optimizer: .*" + match): FP16_Optimizer(opt, verbose=False)
            with pytest.raises(ValueError, match=r"amp.initialize: .*" + match):
                amp.initialize(model, opt, opt_level='O2', verbosity=0)
            assert all(p.dtype == torch.float32 for p in model.parameters()), "refused before anything changed"
            AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True)
        m = mlp()
        model, opt = accelerator.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
        assert FP16_Optimizer(opt, verbose=False).optimizer is opt.optimizer, "the torch optimizer inside, stepped"
    finally: AcceleratorState._reset_state(True)

@pytest.mark.parametrize('state, front, inner, wrap', [
    ('fp32', 'fp16_optimizer', 'adamw', 'fully_shard'), ('bf16', 'fp16_optimizer', 'adamw', 'fully_shard'),
    ('bf16', 'amp', 'adamw', 'fully_shard'), ('bf16', 'fp16_optimizer', 'sgd', 'fully_shard'),
    ('bf16', 'fp16_optimizer', 'sgd_dampening', 'fully_shard'), ('bf16', 'amp', 'adamw', 'accelerate')])
def test_a_dcp_checkpoint_of_fsdp2_at_2_ranks_resumes_bit_for_bit_at_2_and_loads_at_3(state, front, inner, wrap):
    ("Saved through DCP as a user does (the inner optimizer and the loss scaler). Lean state's stochastic rounding "
     "stream comes back too: Adam's and SGD's state exists before the first step, as DCP loads only the keys the fresh "
     "optimizer holds (SGD's was made at its first step before, with dampening until 3387cc6, and its stream "
     "restarted). `wrap='accelerate'`: the model and optimizer prepared by accelerate's FSDP2 plugin")
    from test_distributed import spawn
    import tempfile, pathlib
    d = pathlib.Path(tempfile.mkdtemp())
    run_at = lambda resume, world: spawn('fsdp2_fp16_optimizer', d, 'fp16', state, False, 3, resume, front, 1.0, 1e-2,
                                         inner, wrap, world=world)
    whole, two, three = run_at(False, 2), run_at(True, 2), run_at(True, 3)              # saved after step 3
    assert set(whole[0]['state_dtypes'].values()) == {torch.float32 if state == 'fp32' else torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(whole[0]['params'], two[0]['params']))
    assert two[0]['scaler'] == whole[0]['scaler'], "the loss scaler's state came back too"
    agreed(three)
    assert max((a - b).abs().max().item() for a, b in zip(whole[0]['params'], three[0]['params'])) < 1e-3

def test_8bit_state_on_fsdp2_is_saved_decoded_so_dcp_loads_it_at_another_world_size():
    from test_distributed import spawn
    import tempfile, pathlib
    d = pathlib.Path(tempfile.mkdtemp())
    whole = spawn('fsdp2_fp16_optimizer', d, 'fp16', '8bit', False, 3, world=2)         # saved after step 3
    two = spawn('fsdp2_fp16_optimizer', d, 'fp16', '8bit', False, 3, True, world=2)
    three = spawn('fsdp2_fp16_optimizer', d, 'fp16', '8bit', False, 3, True, world=3)
    agreed(two); agreed(three)
    assert {torch.int8, torch.uint8} <= set(three[0]['state_dtypes'].values()), "8-bit again after the load"
    for r in (two, three):      # re-quantized at the load (to nearest): close to the uninterrupted run, not bit for bit
        assert max((a - b).abs().max().item() for a, b in zip(whole[0]['params'], r[0]['params'])) < 1e-2
        assert r[0]['loss'] == pytest.approx(whole[0]['loss'], rel=1e-2)


# The fastai callback on FSDP2: a Learner built on the wrapped model, `to_fp16()`/`to_bf16()` as usual
def policy(dtype=torch.float16):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

def fsdp2_learner(dtype=torch.float16, wrap=True):
    from torch.distributed.fsdp import fully_shard
    from helpers import synth_learner
    import mixedprec.callback
    torch.manual_seed(0)
    learn = synth_learner(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    if wrap:
        for layer in (learn.model[0], learn.model[2]): fully_shard(layer, mp_policy=policy(dtype))
        fully_shard(learn.model, mp_policy=policy(dtype))
    return learn

def test_fastai_on_fsdp2_casts_nothing_its_fp32_shards_are_the_masters_and_opt_step_is_the_engines(group):
    from fastai.callback.training import GradientClip
    fp32 = fsdp2_learner(wrap=False); fp32.add_cb(GradientClip(1.0))
    start = fp32.validate()[0]
    fp32.fit(3, 1e-2)
    unsharded = fsdp2_learner(wrap=False).to_fp16(clip=1.0)
    unsharded.fit(3, 1e-2)
    learn = fsdp2_learner().to_fp16(clip=1.0)
    learn.fit(3, 1e-2)
    mp = learn.mixed_precision
    assert [p.dtype for p in learn.model.parameters()] == [torch.float32] * 4, "FSDP2's policy casts, not mixedprec"
    assert mp.engine.masters.fsdp2 and not mp.engine.masters.trained, "no second copy of the weights"
    assert max((a - p.detach().full_tensor()).abs().max().item() for a, p in zip(      # (the clip's sums: 1 ulp)
        unsharded.mixed_precision.engine.masters.master_params, learn.model.parameters())) < 1e-6, "as without FSDP2"
    assert [(r.skipped, r.scale, r.grad_norm) for r in mp.history] == [
        (r.skipped, r.scale, r.grad_norm) for r in unsharded.mixed_precision.history], "the same skips and clip norms"
    assert learn.validate()[0] == pytest.approx(fp32.validate()[0], rel=0.1) and learn.validate()[0] < 0.6 * start
    assert len(mp.history) == 18
    # a manual step outside the fit is the engine's step, on the shards
    before = [p.detach().full_tensor().clone() for p in learn.model.parameters()]
    xb, yb = learn.dls.one_batch()
    learn.loss_func(learn.model(xb).float(), yb).backward()
    learn.opt.step(); learn.opt.zero_grad()
    assert all(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, learn.model.parameters()))
    learn.to_fp32()
    assert [p.dtype for p in learn.model.parameters()] == [torch.float32] * 4 and learn.opt.param_lists

def test_fastai_on_fsdp2_refuses_what_cannot_train_saying_how_to_wrap(group, tmp_path):
    from torch.distributed.fsdp import fully_shard
    with pytest.raises(ValueError, match=r"compute in none \(fp32\).*MixedPrecisionPolicy\(param_dtype=torch.float16"):
        learn = fsdp2_learner(wrap=False)
        fully_shard(learn.model)                                  # no policy: it would train in fp32
        learn.to_fp16()
    with pytest.raises(ValueError, match=r"compute in torch.bfloat16, and torch.float16 was asked for"):
        fsdp2_learner(torch.bfloat16).to_fp16()
    with pytest.raises(ValueError, match=r"pass masters='fp32'"): fsdp2_learner(torch.bfloat16).to_bf16(masters='split')
    with pytest.raises(TypeError, match=r"shard"): fsdp2_learner().to_fp16(shard=True)
    learn = fsdp2_learner().to_fp16()
    assert learn.mixed_precision.conversion.steps_masters and not learn.mixed_precision.conversion.masters
    learn.path = tmp_path
    with pytest.raises(TypeError, match=r"export .*FSDP2.*learn.save\(name\)"): learn.export()
    with pytest.raises(FileNotFoundError, match=r"nothing.dcp is not there.*DCP"): learn.load('nothing')

def test_fastais_distrib_ctx_with_an_fsdp2_model_or_accelerates_fsdp_plugin_is_refused_saying_what_works(group):
    ("fastai's DistributedTrainer prepares the model for DDP and takes `.module` back after the fit; with accelerate's "
     "FSDP plugin it would shard the model after to_fp16() converted it. Refused at the fit's start, before anything "
     "changes, and the Learner trains once it is gone")
    pytest.importorskip('accelerate')
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin, DistributedType
    import fastai.distributed
    try:
        learn = fsdp2_learner().to_fp16()
        learn.to_distributed(cpu=True, sync_bn=False)
        with pytest.raises(TypeError, match=r"distrib_ctx / to_distributed.*wrap the FSDP2 model in DDP.*"
                                            r"fully_shard.*before building the Learner.*DistributedDL"):
            learn.fit(1, 1e-2)
        learn.remove_cb(fastai.distributed.DistributedTrainer)
        learn.fit(1, 1e-2)
        assert len(learn.mixed_precision.history) == 6 and type(learn.model).__name__.startswith('FSDP')
        AcceleratorState._reset_state(True)
        plain = fsdp2_learner(wrap=False).to_fp16()
        plain.to_distributed(cpu=True, sync_bn=False, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        # what accelerate's state picks on GPUs with the plugin (DDP on CPUs)
        plain.distributed_trainer.accelerator.state.distributed_type = DistributedType.FSDP
        with pytest.raises(TypeError, match=r"its accelerate FSDP plugin would shard the model after to_fp16"):
            plain.fit(1, 1e-2)
        assert [p.dtype for p in plain.model.parameters()] == [torch.float16] * 4, "not sharded, still converted"
    finally: AcceleratorState._reset_state(True)

@pytest.mark.parametrize('state', ['bf16', '8bit'])
def test_fastai_save_and_load_of_fsdp2_is_a_dcp_folder_with_the_optimizer_state_and_the_scaler(group, tmp_path, state):
    learn = fsdp2_learner().to_fp16(state=state)
    learn.path = tmp_path
    learn.fit(1, 1e-2)
    path = learn.save('ck')
    assert path.is_dir() and path.name == 'ck.dcp' and (path / '.metadata').exists()
    weights = [p.detach().full_tensor().clone() for p in learn.model.parameters()]
    scaler, steps = learn.mixed_precision.scaler.state_dict(), learn.opt.state_dict()['state'][0]['step']
    learn.fit(1, 1e-2)                                             # moves on from the checkpoint
    fresh = fsdp2_learner().to_fp16(state=state)                   # a new optimizer: no state yet
    fresh.path = tmp_path
    fresh.load('ck')
    assert all(torch.equal(a, p.detach().full_tensor()) for a, p in zip(weights, fresh.model.parameters()))
    assert fresh.mixed_precision.scaler.state_dict() == scaler
    got = fresh.opt.state_dict()['state']
    assert got[0]['grad_avg'].dtype == {'bf16': torch.bfloat16, '8bit': torch.float32}[state], "8-bit: saved decoded"
    assert got[0]['step'] == steps
    fresh.fit(1, 1e-2)
    assert all(torch.equal(a.detach().full_tensor(), b.detach().full_tensor())
               for a, b in zip(learn.model.parameters(), fresh.model.parameters())), "resumed bit for bit"


# The callback at 2 and 3 gloo ranks (tests/dist_workers.py: `fsdp2_fastai`), the same steps as FP16_Optimizer's above
def run_fastai(*args, world):
    from test_distributed import spawn
    import tempfile, pathlib
    return spawn('fsdp2_fastai', pathlib.Path(tempfile.mkdtemp()), *args, world=world)

@pytest.mark.parametrize('world, opt', [(3, 'fastai'), (2, 'torch')])
def test_fastai_on_fsdp2_fp16_skips_on_every_rank_names_the_param_and_trains_as_fp32(world, opt):
    from dist_workers import FSDP2_INJECT
    ranks = run_fastai('fp16', 'fp32', True, None, False, opt, world=world)
    for r in ranks[1:]:
        assert r['skipped'] == ranks[0]['skipped'] and all(torch.equal(a, b) for a, b in zip(r['params'], ranks[0]['params']))
    ref = ranks[0]['reference']
    assert ranks[0]['fsdp2'] and ranks[0]['masters'] == 0
    assert ranks[0]['skipped'] == [step == FSDP2_INJECT for step in range(len(ref['norms']))]
    assert all(r['named'][FSDP2_INJECT] == ('2.weight (inf)',) for r in ranks)
    clipped = [i for i in range(len(ref['norms'])) if i != FSDP2_INJECT]      # the global norm, over every rank
    assert [ranks[0]['norms'][i] for i in clipped] == pytest.approx([ref['norms'][i] for i in clipped], rel=2e-3)
    assert ranks[0]['loss'] == pytest.approx(ref['loss'], rel=1e-2) and ref['loss'] < 0.6 * ref['start']

@pytest.mark.parametrize('world, opt, state', [(2, 'fastai', 'bf16'), (3, 'fastai', '8bit')])
def test_fastai_on_fsdp2_bf16_with_lean_state_trains_as_fp32(world, opt, state):
    ranks = run_fastai('bf16', state, False, None, False, opt, world=world)
    ref = ranks[0]['reference']
    kept = {'bf16': {torch.bfloat16}, '8bit': {torch.int8, torch.uint8, torch.float32}}[state]
    assert set(ranks[0]['state_dtypes'].values()) == kept, "the moments kept lean on each rank's shards"
    assert not any(ranks[0]['skipped'])
    assert ranks[0]['loss'] == pytest.approx(ref['loss'], rel=3e-2)

@pytest.mark.parametrize('opt', ['fastai', 'torch'])
def test_fastai_learn_save_of_fsdp2_at_2_ranks_resumes_bit_for_bit_at_2_and_loads_at_3(opt):
    from test_distributed import spawn
    import tempfile, pathlib
    d = pathlib.Path(tempfile.mkdtemp())
    whole = spawn('fsdp2_fastai', d, 'fp16', 'fp32', False, 3, False, opt, world=2)       # saved after step 3
    two = spawn('fsdp2_fastai', d, 'fp16', 'fp32', False, 3, True, opt, world=2)
    three = spawn('fsdp2_fastai', d, 'fp16', 'fp32', False, 3, True, opt, world=3)
    assert all(torch.equal(a, b) for a, b in zip(whole[0]['params'], two[0]['params']))
    assert two[0]['scaler'] == whole[0]['scaler'], "the loss scaler's state came back too"
    assert max((a - b).abs().max().item() for a, b in zip(whole[0]['params'], three[0]['params'])) < 1e-3
