("Sharded fp32 masters (ZeRO stage 1) on 2 and 3 gloo ranks: bit for bit the unsharded run, and one checkpoint that "
 "loads at any world size")
import pytest, torch
import dist_workers as W
import torch.multiprocessing as mp
from test_distributed import spawn, free_port

def same(a, b, keys=('params', 'masters', 'state'), since=0):
    "Two runs' results equal bit for bit (`since`: `b` ran from the start, `a` resumed at that step)"
    assert a['skipped'] == b['skipped'][since:] and a['norms'] == b['norms'][since:] and a['scaler'] == b['scaler']
    for k in keys:
        assert len(a[k]) == len(b[k]), k
        for x, y in zip(a[k], b[k]):
            if isinstance(x, torch.Tensor): assert torch.equal(x, y), k
            else: assert repr(x) == repr(y), k          # the state's (name, value) lists

@pytest.mark.parametrize("world,opt", [(2, 'adam'), (3, 'sgd'), (3, 'adam')])
def test_sharded_equals_unsharded_ddp_bit_for_bit(world, opt, tmp_path):
    sharded = spawn('sharded', tmp_path, True, opt, world=world)
    plain = spawn('sharded', tmp_path, False, opt, world=world)
    for r in range(world):
        same(sharded[r], plain[r]); same(sharded[r], sharded[0])
    # the inf and the nan, each written on one rank only
    assert sharded[0]['skipped'][3] and sharded[0]['skipped'][7]
    # the clip was active
    assert sharded[0]['norms'][3] == sharded[0]['norms'][7] == -1 and sum(n > 0.5 for n in sharded[0]['norms']) >= 3
    # each rank holds about 1/world of the masters and state: the largest shard under 1/world + the largest param
    # the largest param's fp32 master + Adam's two states (bytes)
    total, largest = plain[0]['nbytes'], 24 * 32 * 16
    assert all(s['nbytes'] < total / world + largest for s in sharded)

@pytest.mark.parametrize("state", ['bf16', '8bit'])
def test_lean_state_sharded_equals_unsharded_and_every_rank_rounds_alike(state, tmp_path):
    # the ranks start from different torch seeds; the rounding seed is rank 0's on every rank, so plain DDP keeps
    # identical
    # state and weights on all ranks, and ZeRO-1 shards the bf16 state as it shards fp32 state
    sharded = spawn('sharded', tmp_path, True, 'adam', True, None, False, state, world=2)
    plain = spawn('sharded', tmp_path, False, 'adam', True, None, False, state, world=2)
    for r in range(2):
        same(plain[r], plain[0]); same(sharded[r], plain[r])
    kinds = {v.dtype for st in plain[0]['state'] for k, v in st if k in ('exp_avg', 'exp_avg_sq')}
    assert kinds == ({torch.bfloat16} if state == 'bf16' else {torch.int8, torch.uint8})

@pytest.mark.parametrize("masters,state", [('none', 'fp32'), ('split', 'bf16'), ('split', '8bit')])
def test_ranks_seeded_apart_round_alike_under_ddp(masters, state, tmp_path):
    # stochastic rounding of the weights (masters='none') or of the state must draw the same bits on every rank, or the
    # replicated weights drift apart with no error
    ranks = spawn('rounding_ranks', tmp_path, masters, state, world=2)
    for k in ('params', 'state'):
        assert len(ranks[0][k]) and all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16) if b.dtype == torch.bfloat16 else b) for a, b in zip(ranks[0][k], ranks[1][k])), k

def test_a_checkpoint_saved_at_2_ranks_resumes_at_1_and_3_as_the_uninterrupted_run(tmp_path):
    # every rank on the whole batch: the same grads at any world size
    whole = spawn('sharded', tmp_path, True, 'adam', False, 5, world=2)
    one = W.sharded(0, 1, str(tmp_path), False, 'adam', False, None, True)  # a single process, unsharded
    same(one, whole[0], keys=('params', 'masters'), since=6)
    three = spawn('sharded', tmp_path, True, 'adam', False, None, True, world=3)
    for r in range(3): same(three[r], whole[0], keys=('params', 'masters'), since=6)
    assert [list(map(repr, s)) for s in one['state']] == [list(map(repr, s)) for s in whole[0]['state']] == [list(map(repr, s)) for s in three[0]['state']]

def test_a_rank_that_dies_mid_step_gives_an_error_on_the_others_not_a_hang(tmp_path):
    ctx = mp.start_processes(W.main, args=(2, free_port(), 'sharded_peer_dies', str(tmp_path)), nprocs=2, join=False,
                             start_method='spawn')
    for p in ctx.processes: p.join(timeout=120)
    res = torch.load(tmp_path / 'sharded_peer_dies_rank0.pt', weights_only=False)
    assert res[
        'error'] and 'rank 0 of 2 waited 2 s in the all-gather of the sharded params' in res[
            'error'] and 'set_process_group(timeout=' in res['error']
    assert res['waited'] < 12

def test_amp_sharded_equals_unsharded_and_its_state_dicts_are_whole(tmp_path):
    sharded, plain = spawn('amp_sharded', tmp_path, True), spawn('amp_sharded', tmp_path, False)
    for r in range(2): same(sharded[r], plain[r])
    # every param's state, from both ranks
    assert sharded[0]['skipped'][W.INJECT_AT] and len(sharded[0]['state']) == len(sharded[0]['masters']) == 8

@pytest.mark.parametrize("world,flat,opt", [(2, False, 'adam'), (3, True, 'sgd'), (2, False, 'torch')])
def test_fastai_sharded_equals_unsharded_and_its_checkpoint_loads_in_one_process(world, flat, opt, tmp_path):
    sharded, plain = spawn('fastai_sharded', tmp_path, True, flat, opt,
                           world=world), spawn('fastai_sharded', tmp_path, False, flat, opt, world=world)
    for r in range(world): same(sharded[r], plain[r]); same(sharded[r], sharded[0])
    # the inf, and the clip at work
    assert sharded[0]['skipped'][W.INJECT_AT] and sum((n or 0) > 0.5 for n in sharded[0]['norms']) >= 2
    total, largest = plain[0]['nbytes'], 4 * 32 * 24                   # the masters' bytes; the largest param's master
    assert all(
        s['nbytes'] <= total / world + largest for s in sharded) and max(s['nbytes'] for s in sharded) < 0.7 * total, [s['nbytes'] for s in sharded]
    # rank 0 writes (no RANK variable here)
    assert [s['writes'] for s in sharded] == [s['writes'] for s in plain] == [1] + [0] * (world - 1)
    assert all(s['readable'] for s in sharded)
    assert plain[0]['partial'] is None and all('call `learn.save()` on every rank' in s['partial'] for s in sharded)
    from helpers import synth_learner
    from fastai.learner import Learner
    from torch import nn
    learn = Learner(synth_learner().dls, W.deep_mlp(), loss_func=nn.MSELoss(), opt_func=W.fastai_opt(opt), lr=1e-2,
                    path=tmp_path).to_fp16()
    # the sharded run's checkpoint, whole, in one process (per-param masters)
    learn.load(f'shardedTrue{flat}{opt}', with_opt=True)
    mp = learn.mixed_precision
    assert mp.scaler.state_dict() == sharded[0]['scaler']
    assert all(torch.equal(a, b) for a, b in zip(mp.state_dict()['masters'], sharded[0]['masters']))
    st = W.state_list(learn.opt.state_dict())
    assert [list(map(repr, sorted(s.items()))) for s in st] == [list(map(repr, s)) for s in sharded[0]['state']]

def test_masters_kept_in_the_bf16_weights_cannot_be_sharded_and_say_what_to_pass():
    from helpers import synth_learner
    from mixedprec.fp16_optimizer import FP16_Optimizer
    from torch import nn
    with pytest.raises(ValueError, match="pass masters='fp32'"): synth_learner().to_bf16(masters='split', shard=True)
    model = nn.Linear(4, 4).bfloat16()
    with pytest.raises(ValueError, match="pass masters='fp32' with shard=True"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), masters='none', shard=True, verbose=False)

def test_sharded_flat_masters_with_a_torch_optimizer_are_refused_with_what_to_do(monkeypatch):
    ("An OptimWrapper's state_dict is by position over the flat masters, which differ with the world size: refused "
     "at the first sharded fit")
    import mixedprec.callback as C
    from helpers import synth_learner
    learn = synth_learner(opt_func=W.fastai_opt('torch'))
    monkeypatch.setattr(C, 'world_size', lambda: 2)
    with pytest.raises(ValueError, match="pass flat_master=False, or a fastai opt_func"):
        learn.to_fp16(flat_master=True, shard=True)

def test_fastai_distrib_ctx_with_save_model_callback_sharded_equals_unsharded(tmp_path):
    ("fastai's own distrib_ctx (Accelerate's DDP) and SaveModelCallback, which saves each better epoch and loads the "
     "best on every rank at the end")
    sharded, plain = spawn('fastai_distrib_ctx', tmp_path, True), spawn('fastai_distrib_ctx', tmp_path, False)
    for r in range(2): same(sharded[r], plain[r]); same(sharded[r], sharded[0])
    # DDP unwrapped after the fit
    assert all(s['sharded'] for s in sharded) and not plain[0]['sharded'] and sharded[0]['model_type'] == 'Sequential'
    # the inf on rank 1, skipped by both
    assert sharded[0]['skipped'][1] and sum(sharded[0]['skipped']) == 1
    assert (tmp_path / 'models' / 'bestTrue.pth').exists()

@pytest.mark.parametrize("world", [2, 3])
def test_amp_sharded_resumes_in_apexs_order(world, tmp_path):
    # apex's documented resume: amp.initialize, then model.load_state_dict, optimizer.load_state_dict,
    # amp.load_state_dict on every rank.
    # The model's load hook met other ranks' masters (4-byte stand-ins) and crashed halfway; the resumed run must equal
    # the uninterrupted one
    whole = spawn('amp_sharded', tmp_path, True, 2, world=world)               # saves after step 2, goes on to the end
    resumed = spawn('amp_sharded', tmp_path, True, None, True, world=world)
    for r in range(world): same(resumed[r], whole[r], since=3)

# ---------------------------------------------------------------- defects of the sharded paths (issue 31)

@pytest.mark.parametrize("world", [2, 3])
def test_amp_sharded_clips_by_the_global_norm_and_refuses_the_local_recipe(world, tmp_path):
    sharded, plain = spawn('amp_clip', tmp_path, True, 'amp',
                           world=world), spawn('amp_clip', tmp_path, False, 'amp', world=world)
    # apex's recipe, unsharded: torch's clip over master_params
    recipe = spawn('amp_clip', tmp_path, False, 'torch', world=world)
    for r in range(world):
        # the clip was at work
        assert sharded[r]['norms'] == plain[r]['norms'] == plain[0]['norms'] and any(n > 0.5 for n in plain[0]['norms'])
        assert all(torch.equal(a, b) for a, b in zip(sharded[r]['params'], plain[r]['params']))
        assert all(torch.equal(a, b) for a, b in zip(sharded[r]['masters'], plain[r]['masters']))
        torch.testing.assert_close(torch.tensor(recipe[r]['norms']), torch.tensor(plain[r]['norms']), rtol=1e-5, atol=0)
        for a, b in zip(recipe[r]['params'], plain[r]['params']): torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    assert all(
        'amp.clip_grad_norm_(optimizer, max_norm)' in s['refused'] for s in sharded) and plain[0]['refused'] is None
    assert all(
        'with sharded masters' in s[
            'model_refused'] and 'amp.clip_grad_norm_(optimizer, max_norm)' in s['model_refused'] for s in sharded)

def test_fastai_flat_sharded_masters_count_fp32_params_once_in_the_clip(tmp_path):
    # BatchNorm's fp32 params are their own masters and not sharded under flat masters: every rank holds their grads
    sharded, plain = spawn('fastai_sharded', tmp_path, True, True, 'sgd',
                           True), spawn('fastai_sharded', tmp_path, False, True, 'sgd', True)
    for r in range(2): same(sharded[r], plain[r])
    assert any((n or 0) > 0.5 for n in plain[0]['norms'])

def test_a_sharded_optimizer_keeps_no_half_grad_after_the_step(tmp_path):
    res = spawn('sharded_remote_grads', tmp_path, world=2)
    for r in res:
        assert r['alive'] == [0, 0, 0], r                     # other ranks' half grads were kept until the next unscale

def test_a_rank_that_stalls_before_a_state_dict_gather_is_named_within_the_bounded_wait(tmp_path):
    ctx = mp.start_processes(W.main, args=(2, free_port(), 'sharded_stall_before_gather', str(tmp_path)), nprocs=2,
                             join=False, start_method='spawn')
    for p in ctx.processes: p.join(timeout=120)
    res = torch.load(tmp_path / 'sharded_stall_before_gather_rank0.pt', weights_only=False)
    assert res[
        'error'] and 'waited 2 s in the gather of the sharded state' in res[
            'error'] and '1' in res['error'].split('(')[-1], res['error']
    assert res['waited'] < 12

@pytest.mark.parametrize("flat", [False, True])
def test_a_param_another_rank_owns_that_got_no_grad_is_passed_over(flat):
    ("A branch unused on some batches (no grad) whose master another rank keeps: flat sharded masters crashed at the "
     "unscale ('NoneType' has no zero_)")
    from torch import nn
    from mixedprec.master import MasterParams, Masters, master_kind, RemoteMaster

    from mixedprec.distributed import Shards
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).half()
    params = list(model.parameters())
    # rank 0 of a simulated 2-rank world
    ms = MasterParams([params], Masters().add_missing(params), flat=flat, shards=Shards(params, world=2, rank=0))
    remote = [p for p, m, _ in ms.pairs if isinstance(master_kind(m), RemoteMaster)]
    local = [p for p, m, _ in ms.pairs if not isinstance(master_kind(m), RemoteMaster)]
    assert remote and local
    for p in local: p.grad = torch.full_like(p, 2.)
    assert not bool(ms.grads_to_masters(0.5))
    assert all(bool((g == 1.).all()) for p, g in ms.unscaled_grads() if p in local)
    assert all(p.grad is None for p in remote)
