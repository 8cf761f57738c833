("Every front end under DDP on 2 and 3 gloo ranks: the ranks stay identical bit for bit through a skip decided on one "
 "rank and a clip, lean state rounds alike on every rank, and one checkpoint loads at any world size. Sharding is "
 "FSDP2's (tests/test_fsdp2.py); mixedprec's own `shard=` argument is gone")
import pytest, torch
import dist_workers as W
from test_distributed import spawn

def same(a, b, keys=('params', 'masters', 'state'), since=0):
    "Two runs' results equal bit for bit (`since`: `b` ran from the start, `a` resumed at that step)"
    assert a['skipped'] == b['skipped'][since:] and a['norms'] == b['norms'][since:] and a['scaler'] == b['scaler']
    for k in keys:
        assert len(a[k]) == len(b[k]), k
        for x, y in zip(a[k], b[k]):
            if isinstance(x, torch.Tensor): assert torch.equal(x, y), k
            else: assert repr(x) == repr(y), k          # the state's (name, value) lists

@pytest.mark.parametrize("world,opt", [(2, 'adam'), (3, 'sgd')])
def test_fp16_optimizer_ranks_stay_identical_through_skips_and_clips(world, opt, tmp_path):
    ranks = spawn('ddp_fp16_optimizer', tmp_path, opt, world=world)
    for r in range(world): same(ranks[r], ranks[0])
    # the inf and the nan, each written on one rank only, skipped by all
    assert ranks[0]['skipped'][3] and ranks[0]['skipped'][7] and sum(ranks[0]['skipped']) == 2
    # the clip was active
    assert ranks[0]['norms'][3] == ranks[0]['norms'][7] == -1 and sum(n > 0.5 for n in ranks[0]['norms']) >= 3

@pytest.mark.parametrize("state", ['bf16', '8bit'])
def test_lean_state_rounds_alike_on_every_rank(state, tmp_path):
    # the ranks start from different torch seeds; the rounding seed is rank 0's on every rank, so DDP keeps identical
    # state and weights on all ranks
    ranks = spawn('ddp_fp16_optimizer', tmp_path, 'adam', True, None, False, state, world=2)
    same(ranks[1], ranks[0])
    kinds = {v.dtype for st in ranks[0]['state'] for k, v in st if k in ('exp_avg', 'exp_avg_sq')}
    assert kinds == ({torch.bfloat16} if state == 'bf16' else {torch.int8, torch.uint8})

@pytest.mark.parametrize("masters,state", [('none', 'fp32'), ('split', 'bf16'), ('split', '8bit')])
def test_ranks_seeded_apart_round_alike_under_ddp(masters, state, tmp_path):
    # stochastic rounding of the weights (masters='none') or of the state must draw the same bits on every rank, or the
    # replicated weights drift apart with no error
    ranks = spawn('rounding_ranks', tmp_path, masters, state, world=2)
    as_ints = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    for k in ('params', 'state'):
        assert len(ranks[0][k]) and all(torch.equal(as_ints(a), as_ints(b)) for a, b in zip(ranks[0][k], ranks[1][k])), k

def test_a_checkpoint_saved_at_2_ranks_resumes_at_1_and_3_as_the_uninterrupted_run(tmp_path):
    # every rank on the whole batch: the same grads at any world size
    whole = spawn('ddp_fp16_optimizer', tmp_path, 'adam', False, 5, world=2)
    one = W.ddp_fp16_optimizer(0, 1, str(tmp_path), 'adam', False, None, True)   # a single process
    same(one, whole[0], keys=('params', 'masters'), since=6)
    three = spawn('ddp_fp16_optimizer', tmp_path, 'adam', False, None, True, world=3)
    for r in range(3): same(three[r], whole[0], keys=('params', 'masters'), since=6)
    assert [list(map(repr, s)) for s in one['state']] == [list(map(repr, s)) for s in whole[0]['state']] == [
        list(map(repr, s)) for s in three[0]['state']]

@pytest.mark.parametrize("world", [2, 3])
def test_amp_resumes_in_apexs_order_as_the_uninterrupted_run(world, tmp_path):
    # apex's documented resume: amp.initialize, then model.load_state_dict, optimizer.load_state_dict,
    # amp.load_state_dict on every rank
    whole = spawn('amp_ddp', tmp_path, 2, world=world)               # saves after step 2, goes on to the end
    resumed = spawn('amp_ddp', tmp_path, None, True, world=world)
    for r in range(world): same(resumed[r], whole[r], since=3); same(whole[r], whole[0])
    # the inf on rank 0 skipped on all; every param's state in the optimizer's state dict
    assert whole[0]['skipped'][W.INJECT_AT] and len(whole[0]['state']) == len(whole[0]['masters']) == 8

@pytest.mark.parametrize("world", [2, 3])
def test_amp_clip_grad_norm_equals_torchs_clip_over_master_params(world, tmp_path):
    ours = spawn('amp_clip', tmp_path, 'amp', world=world)
    recipe = spawn('amp_clip', tmp_path, 'torch', world=world)       # apex's recipe: torch's clip over master_params
    assert any(n > 0.5 for n in ours[0]['norms'])                    # the clip was at work
    for r in range(world):
        assert ours[r]['norms'] == ours[0]['norms']
        assert all(torch.equal(a, b) for a, b in zip(ours[r]['params'], ours[0]['params']))
        torch.testing.assert_close(torch.tensor(recipe[r]['norms']), torch.tensor(ours[r]['norms']), rtol=1e-5, atol=0)
        for a, b in zip(recipe[r]['params'], ours[r]['params']): torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)

@pytest.mark.parametrize("world,flat,opt", [(2, False, 'adam'), (3, True, 'sgd'), (2, False, 'torch')])
def test_fastai_under_ddp_stays_identical_and_its_checkpoint_loads_in_one_process(world, flat, opt, tmp_path):
    ranks = spawn('fastai_ddp', tmp_path, flat, opt, world=world)
    for r in range(world): same(ranks[r], ranks[0])
    # the inf, and the clip at work
    assert ranks[0]['skipped'][W.INJECT_AT] and sum((n or 0) > 0.5 for n in ranks[0]['norms']) >= 2
    # rank 0 writes (no RANK variable here)
    assert [s['writes'] for s in ranks] == [1] + [0] * (world - 1)
    from helpers import synth_learner
    from fastai.learner import Learner
    from torch import nn
    learn = Learner(synth_learner().dls, W.deep_mlp(), loss_func=nn.MSELoss(), opt_func=W.fastai_opt(opt), lr=1e-2,
                    path=tmp_path).to_fp16()
    learn.load(f'ddp{flat}{opt}', with_opt=True)           # per-param masters here, whatever the run used
    mp = learn.mixed_precision
    assert all(torch.equal(a, b) for a, b in zip(mp.state_dict()['masters'], ranks[0]['masters']))
    st = W.state_list(learn.opt.state_dict())
    assert [list(map(repr, sorted(s.items()))) for s in st] == [list(map(repr, s)) for s in ranks[0]['state']]
    if opt != 'torch': assert mp.scaler.state_dict() == ranks[0]['scaler']    # torch's state dict carries no scaler

def test_fastai_distrib_ctx_with_save_model_callback(tmp_path):
    ("fastai's own distrib_ctx (Accelerate's DDP) and SaveModelCallback, which saves each better epoch and loads the "
     "best on every rank at the end")
    ranks = spawn('fastai_distrib_ctx', tmp_path)
    same(ranks[1], ranks[0])
    assert ranks[0]['model_type'] == 'Sequential'                    # DDP unwrapped after the fit
    assert ranks[0]['skipped'][1] and sum(ranks[0]['skipped']) == 1  # the inf on rank 1, skipped by both
    assert (tmp_path / 'models' / 'best.pth').exists()

def test_shard_true_is_refused_by_every_front_end_by_name():
    ("mixedprec's own ZeRO-1 is removed (FSDP2 holds fewer bytes a rank at every world size), and its `shard=` "
     "argument with it: each door refuses it by name, before anything changes")
    from torch import nn
    from helpers import synth_learner
    from mixedprec import amp
    from mixedprec.fp16_optimizer import FP16_Optimizer
    fix = r"shard"                      # the argument is gone: every door refuses it by name, before anything changes
    learn = synth_learner()
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(TypeError, match=fix): learn.to_fp16(shard=True)
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(learn.model.parameters(), before))
    with pytest.raises(TypeError, match=fix): synth_learner().to_bf16(shard=True)
    model = nn.Linear(4, 4).half()
    with pytest.raises(TypeError, match=fix):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=True, verbose=False)
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=fix):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level='O2', shard=True, verbosity=0)
    assert model.weight.dtype == torch.float32 and getattr(model, '_mixedprec_conversion', None) is None

@pytest.mark.parametrize("masters", ['fp32', 'split'])
def test_a_fine_tune_under_ddp_makes_the_unfrozen_bodys_masters_alike_on_every_rank(masters, tmp_path):
    ranks = spawn('fastai_fine_tune_ddp', tmp_path, masters, world=2)
    same(ranks[1], ranks[0])
    # frozen, the body had no master; unfrozen, it has one (made from its half weights, on each rank alike)
    assert ranks[0]['body'] == [False, False, True]
    one = spawn('fastai_fine_tune_ddp', tmp_path, masters, world=1)[0]
    for a, b in zip(ranks[0]['params'], one['params']):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)   # the same global batches
