"""torch's FSDP2 (`fully_shard`) under each front end, in each order: refused with what to use instead, never a model that
runs and does not train (amp O2 applied before `fully_shard` did exactly that). One gloo process group of one rank is
enough: the refusal is about the params FSDP2 re-creates, not about the world size."""
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

def test_fully_shard_then_amp_initialize_is_refused_before_anything_changes(group):
    from mixedprec import amp
    model = sharded(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dtypes = [p.dtype for p in model.parameters()]
    with pytest.raises(TypeError, match=r"amp.initialize: .*FSDP2.*MixedPrecisionPolicy.*shard=True"):
        amp.initialize(model, opt, opt_level='O2', verbosity=0)
    assert [p.dtype for p in model.parameters()] == dtypes, "the model is unchanged"
    # amp still works
    amp.initialize(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), opt_level='O2', verbosity=0)

def test_fp16_optimizer_over_a_fully_shard_model_is_refused(group):
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = sharded(mlp())
    with pytest.raises(TypeError, match=r"FP16_Optimizer: .*FSDP2"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)

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
