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
    with pytest.raises(ValueError, match=r"pass state='bf16'"):
        amp.initialize(model, opt, opt_level='O2', verbosity=0, state='8bit')
    dtypes = [p.dtype for p in model.parameters()]
    model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)
    assert [p.dtype for p in model.parameters()] == dtypes == [torch.float32] * 4, "FSDP2's policy casts, not amp"
    assert not amp._engines_of(opt)[0].masters.pairs, "no second copy of the weights"
    with amp.scale_loss(model(X).float().sum(), opt) as s: s.backward()
    opt.step()

def test_fp16_optimizer_over_fsdp2_takes_its_fp32_params_as_masters_and_refuses_what_does_not_combine(group):
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = sharded(mlp())
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    assert opt.masters.fsdp2 and not opt.masters.pairs, "no second copy of the weights"
    assert all(m is p for m, p in zip(opt.param_groups[0]['params'], model.parameters()))
    for kw, match in [(dict(shard=True), "FSDP2 shards them already: leave shard=False"),
                      (dict(masters='split'), "pass masters='fp32'"), (dict(state='8bit'), "pass state='bf16'")]:
        with pytest.raises(ValueError, match=match):
            FP16_Optimizer(torch.optim.SGD(sharded(mlp()).parameters(), lr=0.1), verbose=False, **kw)
    with pytest.raises(TypeError, match=r"torch.float16 params.*keep the params fp32.*MixedPrecisionPolicy"):
        FP16_Optimizer(torch.optim.SGD(sharded(mlp().half()).parameters(), lr=0.1), verbose=False)

def test_fp16_optimizer_then_fully_shard_is_refused_at_the_backward(group):
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = mlp().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    sharded(model)
    with pytest.raises(RuntimeError, match=r"reached none of the params.*fully_shard"):
        opt.backward(model(X.half()).float().sum())

def test_fastai_to_fp16_over_a_fully_shard_model_and_the_other_order_are_refused(group):
    from helpers import synth_learner
    import mixedprec.callback
    learn = synth_learner()
    sharded(learn.model)
    with pytest.raises(TypeError, match=r"to_fp16/to_bf16: .*FSDP2"): learn.to_fp16()
    # (with batchnorm kept fp32, FSDP2 refuses the mixed dtypes itself)
    learn = synth_learner(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))).to_fp16()
    sharded(learn.model)
    with pytest.raises(TypeError, match=r"fit: the model was wrapped by `fully_shard` after to_fp16"): learn.fit(1)


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

@pytest.mark.parametrize('world, front', [(2, 'fp16_optimizer'), (3, 'fp16_optimizer'), (3, 'amp')])
def test_fsdp2_bf16_with_bf16_state_on_each_ranks_shards_trains_as_fp32(world, front):
    ranks = run('bf16', 'bf16', False, None, False, front, world=world)
    agreed(ranks)
    ref = ranks[0]['reference']
    assert set(ranks[0]['state_dtypes'].values()) == {torch.bfloat16}, "the moments kept in bf16, half the bytes"
    assert not any(ranks[0]['skipped']) and ranks[0]['norms'] == pytest.approx(ref['norms'], rel=6e-2)
    assert ranks[0]['loss'] == pytest.approx(ref['loss'], rel=3e-2)

def test_a_dcp_checkpoint_of_fsdp2_at_2_ranks_resumes_bit_for_bit_at_2_and_loads_at_3():
    from test_distributed import spawn
    import tempfile, pathlib
    d = pathlib.Path(tempfile.mkdtemp())
    whole = spawn('fsdp2_fp16_optimizer', d, 'fp16', 'fp32', False, 3, world=2)        # saved after step 3
    two = spawn('fsdp2_fp16_optimizer', d, 'fp16', 'fp32', False, 3, True, world=2)
    three = spawn('fsdp2_fp16_optimizer', d, 'fp16', 'fp32', False, 3, True, world=3)
    assert all(torch.equal(a, b) for a, b in zip(whole[0]['params'], two[0]['params']))
    assert two[0]['scaler'] == whole[0]['scaler'], "the loss scaler's state came back too"
    agreed(three)
    assert max((a - b).abs().max().item() for a, b in zip(whole[0]['params'], three[0]['params'])) < 1e-3
