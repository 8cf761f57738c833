"""On the CPU the unscale of a grad whose master is kept in its bf16 weight (masters='split' or 'none') is the step's
(issue 55): the unscale only checks the half grads, and the fused step reads them with the scale, so no fp32 grad is
written and read back (on one thread of an AVX-512-BF16 EPYC, the unscale of 14.7M params took 28 ms of fresh fp32
grads against 2 ms). Until the step a master's grad is a `PendingGrad`: whatever reads or changes it (a clip through the
model, the optimizer's groups or `amp.master_params`, a log of its norm, a second unscale, the optimizer's own step, a
copy) makes the fp32 grad first, and the step reads that. So every way of training steps the same bits as before."""
import copy, io, pickle
import pytest, torch
from torch import nn
from mixedprec import amp
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.master import PendingGrad, MasterGrad
from mixedprec.ops import scale_check_
from helpers import bf16_adamw

def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))

def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g) * 4) for _ in range(n)]

def make(front, masters, state, scale, opt=torch.optim.AdamW):
    "A bf16 MLP under `front` ('amp' O2 or 'fp16_optimizer'): the model, the optimizer, its backward"
    model, o = bf16_adamw(front, mlp(), 1e-2, masters, state, loss_scale=scale, opt=opt, weight_decay=0.1)
    if front != 'amp': return model, o, o.backward
    def backward(loss):
        with amp.scale_loss(loss, o) as s: s.backward()
    return model, o, backward

def held_params(o):
    "What the optimizer holds in place of the model's params"
    return [p for g in (o.optimizer if isinstance(o, FP16_Optimizer) else o).param_groups for p in g['params']]

READS = {
    'nothing': lambda model, o: None,
    'the norm of each grad, through the model': lambda model, o: [p.grad.norm() for p in model.parameters()],
    "torch's clip, through the model": lambda model, o: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),
    "torch's clip, through the optimizer's groups": lambda model, o: torch.nn.utils.clip_grad_norm_(held_params(o),
                                                                                                   0.5),
    "torch's clip, through amp.master_params": lambda model, o: torch.nn.utils.clip_grad_norm_(
        amp.master_params(o) if not isinstance(o, FP16_Optimizer) else held_params(o), 0.5),
    "the front end's clip": lambda model, o: (amp.clip_grad_norm_(o, 0.5) if not isinstance(o, FP16_Optimizer)
                                              else o.clip_master_grads(0.5)),
}

def train(front, masters, state, read, scale=2.**10, steps=6, opt=torch.optim.AdamW):
    "The fp32 value of every master after `steps` steps, `read` run between each unscale and step"
    model, o, backward = make(front, masters, state, scale, opt)
    for x, y in batches(steps):
        backward(nn.functional.mse_loss(model(x.bfloat16() if front != 'amp' else x).float(), y))
        READS[read](model, o)
        o.step(); o.zero_grad()
    return list(model.state_dict().values())          # the fp32 masters (the weights, for masters='none')

def same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b): assert torch.equal(x.view(torch.int32), y.view(torch.int32))

@pytest.mark.parametrize("read", [r for r in READS if r != 'nothing'])
@pytest.mark.parametrize("scale", [2.**10, 1000.])
@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_split_masters_train_as_fp32_masters_bit_for_bit_whatever_reads_the_grads(front, scale, read):
    "Split masters are exact: with the unscale deferred or made by a read, they step fp32 masters' very bits"
    same_bits(train(front, 'split', 'fp32', read, scale), train(front, 'fp32', 'fp32', read, scale))

@pytest.mark.parametrize("masters,state", [('split', 'fp32'), ('split', '8bit'), ('none', 'bf16'), ('none', '8bit')])
@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_reading_a_deferred_grad_changes_no_bit_of_the_step(front, masters, state):
    "A read between the unscale and the step makes the fp32 grad the step reads: the same bits as the deferred unscale"
    same_bits(train(front, masters, state, 'nothing'),
              train(front, masters, state, 'the norm of each grad, through the model'))

@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_the_unscale_makes_no_fp32_grad_and_the_step_drops_the_half_one(front):
    model, o, backward = make(front, 'split', '8bit', 2.**10)
    (x, y), = batches(1)
    backward(nn.functional.mse_loss(model(x.bfloat16() if front != 'amp' else x).float(), y))
    if front == 'fp16_optimizer': o.update_master_grads()
    pending = [p.grad for p in held_params(o)]
    assert all(type(g) is PendingGrad and g.value is None for g in pending)
    assert all(g.scaled.dtype == torch.bfloat16 for g in pending)              # the backward's half grads, scaled
    assert all(type(p.grad) is MasterGrad and p.grad.master_grad is g for p, g in zip(model.parameters(), pending))
    o.step()
    assert all(g.value is None for g in pending)                                # the step read the half grads
    o.zero_grad()
    assert all(p.grad is None for p in held_params(o)) and all(p.grad is None for p in model.parameters())

def test_an_fp32_grad_is_made_once_at_the_first_read_and_writes_reach_the_step():
    model, o, backward = make('amp', 'split', 'fp32', 2.**10)
    ref_model, ref, ref_backward = make('amp', 'fp32', 'fp32', 2.**10)
    (x, y), = batches(1)
    for m, b in ((model, backward), (ref_model, ref_backward)): b(nn.functional.mse_loss(m(x).float(), y))
    g = held_params(o)[0].grad
    made = g.made()
    assert made.dtype == torch.float32 and g.made() is made and g.scaled is None
    torch.testing.assert_close(made, held_params(ref)[0].grad, rtol=0, atol=0)    # the unscale's bits
    for p in (held_params(o)[0], held_params(ref)[0]): p.grad.mul_(0.5)           # an in-place change, kept
    assert torch.equal(g.made(), held_params(ref)[0].grad)
    o.step(); ref.step()
    same_bits(list(model.state_dict().values()), list(ref_model.state_dict().values()))

def test_a_second_unscale_before_the_step_adds_to_the_deferred_grads():
    "Two losses scaled on their own (apex's two `scale_loss` blocks, no `delay_unscale`): the second adds in fp32"
    def run(masters):
        model = mlp()
        model, o = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level='O2',
                                  half_dtype='bf16', loss_scale=2.**10, verbosity=0, masters=masters, num_losses=2)
        for x, y in batches(4):
            out = model(x).float()
            for i, loss in enumerate((nn.functional.mse_loss(out, y), out.abs().mean())):
                with amp.scale_loss(loss, o, loss_id=i) as s: s.backward(retain_graph=i == 0)
            o.step(); o.zero_grad()
        return list(model.state_dict().values())
    same_bits(run('split'), run('fp32'))

@pytest.mark.parametrize("opt", [torch.optim.RMSprop, torch.optim.Adagrad])
def test_an_optimizers_own_step_reads_the_fp32_grads(opt):
    "An optimizer the fused kernels do not know steps with its own code, on fp32 grads made before it"
    same_bits(train('fp16_optimizer', 'split', 'fp32', 'nothing', opt=opt),
              train('fp16_optimizer', 'fp32', 'fp32', 'nothing', opt=opt))

def test_an_overflow_in_a_deferred_grad_skips_the_step_and_names_the_param():
    model, o, backward = make('fp16_optimizer', 'split', '8bit', 2.**10)
    before = [p.detach().clone() for p in model.parameters()]
    (x, y), = batches(1)
    model[2].weight.register_hook(lambda g: g * float('inf'))
    backward(nn.functional.mse_loss(model(x.bfloat16()).float(), y))
    o.step()
    assert o.overflow
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert o.scaler.history[-1].params == ('(16, 32) (nan)',)            # its shape: FP16_Optimizer has no names

@pytest.mark.parametrize("how", ['deepcopy', 'pickle', 'torch.save'])
def test_a_copy_of_a_deferred_grad_is_its_fp32_grad(how):
    model, o, backward = make('amp', 'split', '8bit', 2.**10)
    (x, y), = batches(1)
    backward(nn.functional.mse_loss(model(x).float(), y))
    g = held_params(o)[0].grad
    if how == 'deepcopy': c = copy.deepcopy(g)
    elif how == 'pickle': c = pickle.loads(pickle.dumps(g))
    else:
        buf = io.BytesIO(); torch.save(g, buf); buf.seek(0); c = torch.load(buf)
    assert type(c) is torch.Tensor and c.dtype == torch.float32 and torch.equal(c, g.made())

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("impl", ['fused', 'ref'])
def test_an_in_place_scale_by_one_is_a_check_that_writes_nothing(dtype, impl):
    "The unscale's check of the deferred grads: `scale_check_(g, g, 1.)` flags inf and NaN and leaves every bit"
    ts = [torch.randn(n).to(dtype) for n in (1, 37, 4096, 100_003)]
    ts[2][5] = float('nan')
    bits = [t.clone() for t in ts]
    assert scale_check_(ts, ts, 1., impl=impl)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ts, bits))
    assert not scale_check_(ts[:2] + ts[3:], ts[:2] + ts[3:], 1., impl=impl)
    ts[3][-1] = float('-inf')
    assert scale_check_(ts[3:], ts[3:], 1., impl=impl)

def test_a_half_params_lent_grad_saves_as_a_plain_tensor_that_loads_with_weights_only():
    model, o, backward = make('amp', 'split', '8bit', 2.**10)
    (x, y), = batches(1)
    backward(nn.functional.mse_loss(model(x).float(), y))
    buf = io.BytesIO(); torch.save([p.grad for p in model.parameters()], buf); buf.seek(0)
    loaded = torch.load(buf)
    assert all(type(g) is torch.Tensor and g.dtype == torch.bfloat16 for g in loaded)
    assert all(torch.equal(g, p.grad.master_grad.made().bfloat16()) for g, p in zip(loaded, model.parameters()))

def test_fastais_gradient_clip_clips_split_masters_as_fp32_masters_bit_for_bit():
    "fastai's `GradientClip` reads the model's grads after the callback's unscale: it makes them, and clips what is stepped"
    from fastai.callback.training import GradientClip
    from fastai.optimizer import Adam
    from helpers import synth_learner, master_values
    def fit(masters):
        learn = synth_learner(opt_func=Adam, lr=1e-2, cbs=GradientClip(0.05)).to_bf16(masters=masters, loss_scale=2.**8)
        learn.fit(1)
        return master_values(learn)
    same_bits(fit('split'), fit('fp32'))

def test_fp16_optimizers_second_backward_before_the_step_adds_to_the_deferred_grads():
    "`FP16_Optimizer.backward` twice (each unscaled at once), then one step: the second adds in fp32, as fp32 masters"
    def run(masters):
        model, o, backward = make('fp16_optimizer', masters, 'fp32', 2.**10)
        for x, y in batches(4):
            out = model(x.bfloat16()).float()
            backward(nn.functional.mse_loss(out, y), retain_graph=True)
            backward(out.abs().mean())
            o.step(); o.zero_grad()
        return list(model.state_dict().values())
    same_bits(run('split'), run('fp32'))
