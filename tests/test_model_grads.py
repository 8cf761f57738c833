"""What a half param's `.grad` holds between the unscale and the step: a `MasterGrad`, which stands for the master's
unscaled fp32 grad. The plain PyTorch loop's clip, `torch.nn.utils.clip_grad_norm_(model.parameters(), c)`, then clips the
grads that are stepped, as in fp32 (before, it found no grads, clipped nothing and returned 0). Checked against fp32
reference runs, for amp and FP16_Optimizer, fp16 and bf16, fp32 and bf16 masters, and in the loops users write around it."""
import gc, weakref
import pytest, torch
from torch import nn
from mixedprec import amp
from mixedprec.fp16_optimizer import FP16_Optimizer
from mixedprec.master import MasterGrad
from helpers import synth_learner, masters_of, Record
from fastai.optimizer import SGD

def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g) * 4) for _ in range(n)]

def amp_setup(**kw):
    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0, loss_scale=2.**10, **kw)
        def backward(loss):
            with amp.scale_loss(loss, opt) as scaled: scaled.backward()
        return model, opt, backward, lambda c: amp.clip_grad_norm_(opt, c)
    return make

def fp16_optimizer_setup(dtype, **kw):
    def make(model):
        model = model.to(dtype)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d): m.float()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), static_loss_scale=2.**10,
                             verbose=False, **kw)
        return model, opt, opt.backward, opt.clip_master_grads
    return make

SETUPS = {'amp O2 fp16': amp_setup(), 'amp O2 bf16': amp_setup(half_dtype='bf16'),
          'amp O2 bf16, split masters': amp_setup(half_dtype='bf16', masters='split'),
          'FP16_Optimizer fp16': fp16_optimizer_setup(torch.float16),
              'FP16_Optimizer bf16, split masters': fp16_optimizer_setup(torch.bfloat16, masters='split')}

def run(setup, clip, steps=12):
    ("Train the MLP; `clip`: None, 'model' (torch's clip over `model.parameters()`) or 'masters' (the front end's "
     "own); the weights and the norms")
    model = mlp()
    half = setup is not None
    if half: model, opt, backward, clip_masters = SETUPS[setup](model)
    else: opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9); backward = lambda loss: loss.backward()
    norms = []
    for x, y in batches(steps):
        dtype = next(model.parameters()).dtype if setup and setup.startswith('FP16') else torch.float32
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        backward(loss)
        if clip == 'model': norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        elif clip == 'masters': norms.append(float(clip_masters(0.05)))
        opt.step(); opt.zero_grad()
    weights = [p.detach().float().clone() for p in model.parameters()]
    return weights, norms

@pytest.mark.parametrize("setup", list(SETUPS))
def test_torchs_clip_over_the_model_params_clips_the_masters_as_in_fp32(setup):
    fp32, fp32_norms = run(None, 'model')
    unclipped, _ = run(None, None)
    mixed, norms = run(setup, 'model')
    own, own_norms = run(setup, 'masters')
    # it clipped every step (before: nothing, and 0. returned)
    assert min(norms) > 0.05
    # the norm of the unscaled master grads, as the front end's clip gives
    torch.testing.assert_close(norms, own_norms, rtol=1e-5, atol=0)
    for a, b in zip(mixed, own): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, fp32_norms, rtol=0.03, atol=0)           # and as fp32 training's
    err = max((a - b).abs().max().item() for a, b in zip(mixed, fp32))
    assert err < 0.01, err
    assert max((a - b).abs().max().item() for a, b in zip(unclipped, fp32)) > 10 * err    # the clip mattered

@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_half_params_grad_reads_as_its_masters_unscaled_grad_until_the_step(setup):
    model, opt, backward, _ = SETUPS[setup](mlp())
    ref = mlp()
    (x, y), = batches(1)
    dtype = next(model.parameters()).dtype if setup.startswith('FP16') else torch.float32
    backward(nn.functional.mse_loss(model(x.to(dtype)).float(), y))
    nn.functional.mse_loss(ref(x), y).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == p.dtype and p.grad.shape == p.shape
        if p.dtype == torch.float32:
            continue                                   # BatchNorm: its own master, a plain grad
        assert isinstance(p.grad, MasterGrad) and p.grad.master_grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.float(), r.grad, rtol=0.05, atol=2e-3)   # unscaled (the loss scale is 1024)
        # bf16 noise on a bias before BatchNorm, whose true grad is 0
        torch.testing.assert_close(p.grad.norm(), r.grad.norm(), rtol=0.05, atol=5e-3)
        assert p.grad.detach().master_grad is p.grad.master_grad and p.grad.data.master_grad is p.grad.master_grad
    w = next(model.parameters())
    w.grad.mul_(0.)                                                              # in place: reaches the master's grad
    assert not w.grad.master_grad.any()
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
    assert all(p.grad.float().abs().max() <= 1e-4 for p in model.parameters())
    opt.step()
    # after the step, as before: no grads
    assert all(p.grad is None for p in model.parameters() if p.dtype != torch.float32)
    assert 'MasterGrad' not in repr([p.grad for p in model.parameters()])

def test_a_gan_whose_generator_backward_reaches_the_discriminator_trains_as_in_fp32():
    ("The DCGAN loop: the generator's loss is backpropagated through the discriminator, whose params then hold grads "
     "that ")
    ("`netD.zero_grad()` drops at the next iteration. The lent grads end at the step, so that backward adds nothing "
     "to them")
    def gan(mixed):
        torch.manual_seed(0)
        G, D = nn.Sequential(nn.Linear(4, 16), nn.ReLU(),
                             nn.Linear(16, 6)), nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        optG, optD = torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.Adam(D.parameters(), lr=1e-3)
        if mixed:
            [G, D], [optG, optD] = amp.initialize([G, D], [optG, optD], opt_level='O2', half_dtype='bf16',
                                                  num_losses=2, verbosity=0)
        def backward(loss, opt, i):
            if not mixed: return loss.backward()
            with amp.scale_loss(loss, opt, loss_id=i) as scaled: scaled.backward()
        bce, g = nn.functional.binary_cross_entropy_with_logits, torch.Generator().manual_seed(1)
        for _ in range(8):
            real, z = torch.randn(16, 6, generator=g) + 2, torch.randn(16, 4, generator=g)
            D.zero_grad()
            fake = G(z)
            lossD = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
            backward(lossD, optD, 0)
            torch.nn.utils.clip_grad_norm_(D.parameters(), 1.)
            optD.step()
            G.zero_grad()
            backward(bce(D(fake), torch.ones(16, 1)), optG, 1)                     # reaches D's params too
            optG.step()
        return [p.detach().float() for p in [*G.parameters(), *D.parameters()]]
    for a, b in zip(gan(True), gan(False)): torch.testing.assert_close(a, b, rtol=0.05, atol=0.01)

def test_a_backward_into_grads_lent_but_not_stepped_is_refused():
    model = mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level='O2', verbosity=0)
    (x, y), = batches(1)
    with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled: scaled.backward()
    with pytest.raises(RuntimeError, match="already unscaled into their fp32 masters and not yet stepped"):
        nn.functional.mse_loss(model(x), y).backward()
    opt.zero_grad()                                                              # drops them: the loop goes on
    with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled: scaled.backward()
    opt.step()

def test_a_fastai_callback_after_mixedprec_clips_through_the_model_as_clip_does():
    ("A user's callback ordered after MixedPrecision, clipping `learn.model`'s params in `before_step` "
     "(GradientClip's code, at ")
    "the point where the grads are unscaled), trains as `to_fp16(clip=...)`"
    clip = lambda learn: torch.nn.utils.clip_grad_norm_(learn.model.parameters(), 0.05)
    norms = []
    def theirs():
        learn = synth_learner(opt_func=SGD, lr=0.05).to_fp16(loss_scale=2.**8)
        learn.fit(1, cbs=[Record(1, before_step=lambda learn: norms.append(float(clip(learn))))])
        return [m.detach().clone() for m in masters_of(learn)]
    def ours():
        learn = synth_learner(opt_func=SGD, lr=0.05).to_fp16(loss_scale=2.**8, clip=0.05)
        learn.fit(1)
        return [m.detach().clone() for m in masters_of(learn)], [h.grad_norm for h in learn.mixed_precision.history]
    a, (b, ours_norms) = theirs(), ours()
    assert min(norms) > 0.05
    torch.testing.assert_close(norms, [float(n) for n in ours_norms[-len(norms):]], rtol=1e-5, atol=0)
    for x, y in zip(a, b): torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)

def test_bf16_masters_fp32_grads_still_live_from_the_unscale_to_the_step_only():
    ("Split masters keep no fp32 copy of the weights, and their fp32 grads exist only while a step is pending: the "
     "stand-ins keep none alive")
    model, opt, backward, _ = SETUPS['amp O2 bf16, split masters'](mlp())
    for x, y in batches(2):
        backward(nn.functional.mse_loss(model(x), y))
        refs = [weakref.ref(p.grad.master_grad) for p in model.parameters() if isinstance(p.grad, MasterGrad)]
        assert len(refs) == 4
        opt.step(); opt.zero_grad(); gc.collect()
        assert all(r() is None for r in refs)
