"Two gloo processes on loopback: every rank takes the same skip decision, holds the same scale and identical masters"
import os, socket, sys
import pytest, torch
import torch.multiprocessing as mp
import dist_workers as W

def free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def spawn(scenario, outdir, *args, timeout=240, world=2):
    "Run `scenario` on `world` ranks; returns each rank's results"
    ctx = mp.start_processes(W.main, args=(world, free_port(), scenario, str(outdir), *args), nprocs=world,
                             join=False, start_method='spawn')
    deadline = __import__('time').monotonic() + timeout
    while not ctx.join(timeout=5):
        if __import__('time').monotonic() > deadline:
            for p in ctx.processes: p.kill()
            pytest.fail(f"{scenario} did not finish in {timeout}s")
    tag = ''.join(map(str, args))
    return [torch.load(os.path.join(outdir, f'{scenario}{tag}_rank{r}.pt'), weights_only=False) for r in range(world)]

def identical(a, b):
    assert a['skipped'] == b['skipped'] and a['scaler'] == b['scaler']
    for k in ('params', 'masters'):
        assert len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k

@pytest.fixture(scope='module')
def fp16opt(tmp_path_factory): return spawn('fp16_optimizer', tmp_path_factory.mktemp('fp16opt'))

def test_fp16_optimizer_ranks_agree_on_a_one_rank_overflow(fp16opt):
    r0, r1 = fp16opt
    identical(r0, r1)
    assert r0['skipped'] == [False, False, False, True, False, False]
    assert r0['norms'] == r1['norms']                         # the clipping norm is the same on every rank

def test_without_the_agreement_the_ranks_diverge(tmp_path):
    r0, r1 = spawn('fp16_optimizer', tmp_path, 1, False)     # proves the test above tests something
    assert r0['skipped'] != r1['skipped'] and r0['scaler'] != r1['scaler']
    assert not all(torch.equal(a, b) for a, b in zip(r0['masters'], r1['masters']))

def test_ddp_matches_a_single_process_on_the_concatenated_batch(fp16opt):
    single = W.fp16_optimizer(0, 1, inject_rank=0)            # one process, the whole batch, the same overflow
    assert single['skipped'] == fp16opt[0]['skipped'] and single['scaler'] == fp16opt[0]['scaler']
    for a, b in zip(single['masters'], fp16opt[0]['masters']): torch.testing.assert_close(a, b, rtol=1e-2, atol=2e-3)

def test_amp_with_no_sync_accumulation(tmp_path):
    r0, r1 = spawn('amp_no_sync', tmp_path)
    identical(r0, r1)
    assert r0['skipped'] == [False, False, False, True, False, False]

@pytest.mark.parametrize("scenario,args", [('fp16_optimizer', (1, True, 'always')), ('amp_no_sync', ('always',))])
def test_ranks_agree_when_the_skip_is_decided_on_the_device(scenario, args, tmp_path):
    # the all-reduced flags feed the device-side scale update and the kernels' skip: the same decision on every rank
    r0, r1 = spawn(scenario, tmp_path, *args)
    identical(r0, r1)
    assert r0['skipped'] == [False, False, False, True, False, False]

def test_fastai_callback_flat_masters_and_a_checkpoint_that_loads_in_one_process(tmp_path):
    r0, r1 = spawn('fastai_callback', tmp_path)
    identical(r0, r1)
    assert r0['skipped'][W.INJECT_AT] and r0['norms'] == r1['norms']
    from helpers import synth_learner
    from fastai.learner import Learner
    from fastai.optimizer import Adam
    from torch import nn
    learn = Learner(synth_learner().dls, W.mlp(), loss_func=nn.MSELoss(), opt_func=Adam, lr=1e-2,
                    path=tmp_path).to_fp16(flat_master=True)
    learn.load('ddp', with_opt=True)
    assert learn.mixed_precision.scaler.state_dict() == r0['scaler']
    masters = [learn.mixed_precision.conversion.masters.value(p).reshape(-1) for p in learn.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(masters, r0['masters']))

def test_a_stalled_rank_is_named_after_the_agreement_timeout(tmp_path):
    ctx = mp.start_processes(W.main, args=(2, free_port(), 'stalled_peer', str(tmp_path)), nprocs=2, join=False,
                             start_method='spawn')
    for p in ctx.processes: p.join(timeout=120)
    res = torch.load(tmp_path / 'stalled_peer_rank0.pt', weights_only=False)
    assert res[
        'error'] and 'rank 0 of 2 waited 2 s in the overflow agreement' in res[
            'error'] and 'set_process_group(timeout=' in res['error']
    assert res['waited'] < 12                                  # not the process group's 30 minutes, nor the peer's 15 s
