"""A value is never rounded away (issue 59): a half param that does not train keeps its exact fp32 value in at most
2 bytes beside its half weight, whichever door the value came through (the conversion, a load into the model, the
front end's own checkpoint), on fastai, amp O2 and FP16_Optimizer, in bf16 and fp16. When it starts to train its
master starts from that value, so a run resumed with its body frozen at the load equals the uninterrupted one bit for
bit; an optimizer state saved under another freeze state loads as torch's does"""
import pytest, torch
from functools import partial
from torch import nn
from fastai.optimizer import Adam
from fastai.callback.core import Callback
import fastai.callback.schedule  # noqa: F401 (Learner.fine_tune)
from mixedprec import amp
from mixedprec.master import Masters, exact_remainder, join_remainder
from mixedprec.fp16_optimizer import FP16_Optimizer
from helpers import synth_learner, reachable_bytes

DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}

def body_head(seed=0, width=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()),
                         nn.Linear(width, 1))

def two_groups(m): return [list(m[0].parameters()), list(m[1].parameters())]

def same_bits(a, b): return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))

# the remainder: what a half weight lacks of an fp32 value

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_remainder_gives_back_every_fp32_value_bit_for_bit(dtype):
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    v = torch.cat([bits.view(torch.float32), torch.randn(4096, generator=g) * 0.02,
                   torch.tensor([0., -0., 1e-45, -3e-39, 6e-8, 65504., 65520., 7e4, 3.4e38, float('inf'), -float('inf')])])
    v = v[torch.isfinite(v) | torch.isinf(v)]           # every finite and infinite value (a NaN has no fixed bits)
    half = v.to(dt)
    rem = exact_remainder(v, half)
    assert same_bits(join_remainder(half, rem), v)
    assert rem.code.dtype == torch.int16 and rem.code.shape == v.shape
    # what the 16-bit code cannot hold is kept beside it: rare where weights live (|w| above 2^-16 for fp16)
    w = torch.randn(1 << 16, generator=g) * 0.05
    w = w[w.abs() > 2**-16]
    assert exact_remainder(w, w.to(dt)).outliers == 0 or dtype == 'bf16' and exact_remainder(w, w.to(dt)).outliers < 4

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_what_the_half_weight_holds_exactly_keeps_no_remainder(dtype):
    v = torch.tensor([0., 1., -2., 0.5, 0.25])
    assert exact_remainder(v, v.to(DTYPES[dtype])) is None

def test_a_remainder_goes_stale_when_the_half_weight_is_written_however_it_is():
    r = Masters()
    p = nn.Parameter(torch.randn(64).bfloat16(), requires_grad=False)
    v = torch.randn(64)
    with torch.no_grad(): p.copy_(v)
    r.keep_exact(p, v)
    assert same_bits(r.value(p), v)
    p.data.mul_(2)                         # through `.data`: no version counter sees it
    assert torch.equal(r.value(p), p.detach().float())

# the doors, on each front end

def fastai_learner(dtype, frozen_before=True, **kw):
    model = body_head()
    if frozen_before: model[0].requires_grad_(False)
    learn = synth_learner(model=model, splitter=two_groups, opt_func=Adam, lr=1e-2)
    return getattr(learn, f'to_{dtype}')(**kw)

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_layer_frozen_before_the_learner_is_made_comes_back_from_to_fp32_bit_for_bit(dtype):
    model = body_head()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model[0].requires_grad_(False)
    learn = synth_learner(model=model, splitter=two_groups, opt_func=Adam, lr=1e-2)
    getattr(learn, f'to_{dtype}')()
    learn.fit(1)
    saved = learn.model.state_dict()
    for n, p in learn.model[0].named_parameters():
        assert p.dtype == DTYPES[dtype] and same_bits(saved[f'0.{n}'], before[f'0.{n}'])
    learn.to_fp32()
    for n, p in learn.model[0].named_parameters(): assert same_bits(p.detach(), before[f'0.{n}'])

def checkpoint(seed=1):
    "An fp32 checkpoint of the model whose body trained: values no half weight holds"
    return {k: v + 1e-3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(seed))
            for k, v in body_head().state_dict().items()}

def frozen_model_on(front, dtype):
    "The model with its body frozen, on `front`: (model, optimizer)"
    model = body_head()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if front == 'amp':
        return amp.initialize(model, opt, opt_level='O2', half_dtype=dtype, verbosity=0)
    model = model.to(DTYPES[dtype])
    return model, FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), verbose=False)

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("front", ['fastai', 'amp', 'fp16_optimizer', 'submodule'])
def test_values_loaded_into_frozen_params_are_the_checkpoints_bit_for_bit(front, dtype):
    sd = checkpoint()
    if front in ('fastai', 'submodule'):
        learn = fastai_learner(dtype)
        model = learn.model
        if front == 'fastai':              # `learn.load` of a plain state dict (no optimizer state in it)
            (learn.path/learn.model_dir).mkdir(exist_ok=True)
            torch.save(sd, learn.path/learn.model_dir/'ckpt.pth')
            learn.load('ckpt', with_opt=False)
        else: model[0].load_state_dict({k[2:]: v for k, v in sd.items() if k.startswith('0.')})
    else:
        model, _ = frozen_model_on(front, dtype)
        model.load_state_dict(sd)
    for k, v in model.state_dict().items():
        if k.startswith('0.'): assert same_bits(v, sd[k]), k
    assert model[0][0].weight.dtype == DTYPES[dtype]          # the model stays half; the remainder holds the rest
    if front in ('fastai', 'submodule'):
        learn.to_fp32()
        for k, v in model.state_dict().items():
            if k.startswith('0.'): assert same_bits(v, sd[k]), k

# a resumed run equals the uninterrupted one

def fastai_resumed(dtype, tmp, frozen_at_load):
    ("fastai: a Learner (its body frozen, with `frozen_at_load`) loads the checkpoint 'stage' (optimizer state too), is "
     "unfrozen and trains 2 epochs: its weights at the end ('fp32': fastai's own)")
    learn = synth_learner(model=body_head(), splitter=two_groups, opt_func=Adam, lr=1e-2, path=tmp)
    if frozen_at_load: learn.freeze()
    if dtype != 'fp32': getattr(learn, f'to_{dtype}')()
    learn.load('stage', with_opt=True)
    learn.unfreeze()                  # (fastai clears the optimizer state here, frozen or not)
    learn.fit(2)
    return {k: v.clone() for k, v in learn.model.state_dict().items()}

@pytest.mark.parametrize("dtype", ['fp32', *DTYPES])
def test_fastai_resumed_with_its_body_frozen_at_the_load_trains_as_resumed_unfrozen(dtype, tmp_path):
    "As in fp32: where the body was frozen when the checkpoint loaded does not change the run after `unfreeze()`"
    learn = synth_learner(model=body_head(), splitter=two_groups, opt_func=Adam, lr=1e-2, path=tmp_path)
    if dtype != 'fp32': getattr(learn, f'to_{dtype}')()
    learn.fit(2); learn.save('stage')
    unfrozen = fastai_resumed(dtype, tmp_path, frozen_at_load=False)
    frozen = fastai_resumed(dtype, tmp_path, frozen_at_load=True)
    for k in unfrozen: assert same_bits(frozen[k], unfrozen[k]), k

def torch_run(front, dtype, resume_from=None, steps=6):
    "amp O2 or FP16_Optimizer: as `fastai_run`, with a checkpoint of the model, the optimizer (and amp) in a dict"
    model = body_head()
    if resume_from is not None: model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scale = dict(loss_scale=128.) if dtype == 'fp16' else {}
    if front == 'amp': model, opt = amp.initialize(model, opt, opt_level='O2', half_dtype=dtype, verbosity=0, **scale)
    else:
        model = model.to(DTYPES[dtype])
        opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), verbose=False,
                             **({'static_loss_scale': 128.} if scale else {}))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 8, generator=g) for _ in range(2 * steps)]
    def train(batches):
        for x in batches:
            loss = model(x if front == 'amp' else x.to(DTYPES[dtype])).float().square().mean()
            if front == 'amp':
                with amp.scale_loss(loss, opt) as s: s.backward()
            else: opt.backward(loss)
            opt.step(); opt.zero_grad()
    if resume_from is None:
        train(xs[:steps])
        saved = {'model': {k: v.clone() for k, v in model.state_dict().items()}, 'opt': opt.state_dict()}
        if front == 'amp': saved['amp'] = amp.state_dict()
        saved = torch.load(_roundtrip(saved), weights_only=False)
    else:
        saved = resume_from
        model.load_state_dict(saved['model'])
        opt.load_state_dict(saved['opt'])
        if front == 'amp': amp.load_state_dict(saved['amp'])
        model[0].requires_grad_(True)
    train(xs[steps:])
    return {k: v.clone() for k, v in model.state_dict().items()}, saved

def _roundtrip(obj):
    import io
    buf = io.BytesIO(); torch.save(obj, buf); buf.seek(0)
    return buf

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_a_torch_run_resumed_with_its_body_frozen_at_the_load_equals_the_uninterrupted_run(front, dtype):
    whole, saved = torch_run(front, dtype)
    resumed, _ = torch_run(front, dtype, resume_from=saved)
    for k in whole: assert same_bits(resumed[k], whole[k]), k

@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_an_optimizer_state_saved_under_another_freeze_state_loads_as_torchs_does(front):
    "Saved with the body frozen, loaded into the same model unfrozen (and back): torch's optimizer loads either"
    _, saved = torch_run(front, 'bf16')
    model, opt = frozen_model_on(front, 'bf16')
    opt.load_state_dict(saved['opt'])
    inner = opt.optimizer if front == 'fp16_optimizer' else opt.optimizer
    moments = saved['opt']['optimizer_state_dict' if front == 'fp16_optimizer' else 'state']
    moments = (moments['state'] if front == 'fp16_optimizer' else moments)[0]['exp_avg']
    assert same_bits(inner.state[model[0][0].weight]['exp_avg'], moments)    # kept exact while the body is frozen
    model[0].requires_grad_(True)
    x = torch.randn(16, 8)
    loss = model(x if front == 'amp' else x.bfloat16()).float().square().mean()
    if front == 'amp':
        with amp.scale_loss(loss, opt) as s: s.backward()
    else: opt.backward(loss)
    opt.step()
    st = opt.optimizer.state if front == 'fp16_optimizer' else opt.state
    e = opt.engine if front == 'fp16_optimizer' else opt._mixedprec_engine
    held = e.masters.record.get(model[0][0].weight).held
    assert st[held]['exp_avg'].dtype == torch.float32
    if front == 'fp16_optimizer':         # FP16_Optimizer's own checkpoint, saved unfrozen, loads into a frozen body
        model2, opt2 = frozen_model_on(front, 'bf16')
        full = opt.state_dict()
        opt2.load_state_dict(full)
        ex = opt2.engine.masters.record
        assert same_bits(ex.value(model2[0][0].weight), e.masters.record.value(model[0][0].weight))

# what a frozen param holds

def fine_tune(dtype, frozen_before, tmp, **kw):
    ("fastai's `fine_tune` (one frozen epoch, one unfrozen) in `dtype` ('fp32': fastai's own); the bytes a frozen body "
     "param holds beyond its half weight in the frozen phase (the head's counted at 18 a param, its most), and the "
     "validation loss at the end")
    model = body_head(width=128)
    if frozen_before: model[0].requires_grad_(False)
    learn = synth_learner(model=model, splitter=two_groups, opt_func=Adam, lr=1e-2, path=tmp)
    if dtype != 'fp32': getattr(learn, f'to_{dtype}')(**kw)
    seen = []
    class Measure(Callback):
        order = 100
        def after_epoch(self):
            roots = [self.learn.model, self.learn.opt] + [c for c in self.learn.cbs if 'Mixed' in type(c).__name__]
            seen.append(reachable_bytes(*roots, stop=[self.learn]))
    learn.fine_tune(1, base_lr=1e-2, freeze_epochs=1, cbs=Measure())
    body = sum(p.numel() for p in learn.model[0].parameters())
    head = sum(p.numel() for p in learn.model[1].parameters())
    # 64 bytes of bookkeeping: the head's step counts, the loss scale (0-dim tensors)
    return (seen[0] - 18 * head - 2 * body - 64) / body, learn.validate()[0]

@pytest.mark.parametrize("frozen_before", [True, False], ids=['frozen_then_converted', 'converted_then_frozen'])
@pytest.mark.parametrize("dtype,kw", [('fp16', {}), ('bf16', {}), ('bf16', dict(masters='split', state='8bit'))],
                         ids=['fp16', 'bf16', 'bf16_split_8bit'])
def test_the_frozen_phase_of_a_fine_tune_holds_at_most_2_bytes_a_frozen_param_and_reaches_fp32s_loss(dtype, kw,
                                                                                                  frozen_before,
                                                                                                  tmp_path):
    per_param, loss = fine_tune(dtype, frozen_before, tmp_path, **kw)
    fp32_bytes, fp32_loss = fine_tune('fp32', frozen_before, tmp_path)
    assert per_param <= 2.0, per_param            # fp32 holds 4 in all, 2 beyond a half weight
    assert loss <= 1.1 * fp32_loss + 1e-3, (loss, fp32_loss)

def amp_steps(model, opt, n=3):
    for _ in range(n):
        with amp.scale_loss(model(torch.randn(16, 8)).float().square().mean(), opt) as s: s.backward()
        opt.step(); opt.zero_grad()

@pytest.mark.parametrize("how", ['fastai', 'amp'])
def test_a_param_frozen_after_it_trained_keeps_its_master_while_its_optimizer_still_steps_it(how):
    ("fastai's zeroed grads are stepped after `freeze()` (its weight decay goes on); torch keeps a frozen param's "
     "state. A param frozen before it trained keeps only its remainder")
    if how == 'fastai':
        learn = fastai_learner('bf16', frozen_before=False)
        learn.fit(1)
        model, record = learn.model, learn.mixed_precision.conversion.masters
    else:
        model = body_head()
        model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level='O2',
                                    half_dtype='bf16', verbosity=0)
        record = opt._mixedprec_engine.masters.record
        amp_steps(model, opt)
    w, b = model[0][0].weight, model[0][2].weight
    m = record.get(w)
    if how == 'fastai': learn.freeze(); learn.fit(1)
    else: model[0].requires_grad_(False); amp_steps(model, opt)
    assert m is not None and record.get(w) is m

def test_a_param_frozen_before_it_trained_keeps_no_master_and_its_exact_value():
    model = body_head()
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level='O2',
                                half_dtype='bf16', verbosity=0)
    record = opt._mixedprec_engine.masters.record
    w = model[0][0].weight
    value = record.value(w).clone()
    model[0].requires_grad_(False)
    amp_steps(model, opt)
    assert record.get(w) is None and record.remainder(w) is not None and same_bits(record.value(w), value)
    model[0].requires_grad_(True)
    amp_steps(model, opt, 1)
    assert record.get(w) is not None and record.remainder(w) is None

# a frozen param given a grad, a param the optimizer was built without

@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_a_frozen_param_given_a_grad_by_hand_is_refused_naming_it_and_what_to_do(front):
    model, opt = frozen_model_on(front, 'bf16')
    x = torch.randn(16, 8)
    loss = model(x if front == 'amp' else x.bfloat16()).float().square().mean()
    model[0][0].weight.grad = torch.ones_like(model[0][0].weight)
    name = r"0\.0\.weight" if front == 'amp' else r"\(64, 8\)"          # (FP16_Optimizer is given no model)
    with pytest.raises(RuntimeError, match=name + r" is frozen \(requires_grad=False\).*requires_grad_\(True\)"):
        if front == 'amp':
            with amp.scale_loss(loss, opt) as s: s.backward()
        else: opt.backward(loss)

def test_a_param_the_optimizer_was_built_without_is_named_as_such_not_as_replaced():
    model = body_head()
    model[0].requires_grad_(False)
    learn = synth_learner(model=model, opt_func=lambda ps, lr: Adam([p for p in ps if p.requires_grad], lr=lr), lr=1e-2)
    learn.to_bf16()
    learn.model[0].requires_grad_(True)
    with pytest.raises(ValueError, match="built without them") as e: learn.fit(1)
    assert 'replaced' not in str(e.value)

def test_a_relayout_keeps_stepping_fastais_zeroed_grads_as_fastai_does():
    ("fastai zeroes grads in place, and goes on stepping a param whose grad is zero (momentum, weight decay): a layout "
     "made anew mid-fit (a body that never trained starts to, as a GAN's generator does) must not stop that")
    from fastai.optimizer import SGD
    from fastai.callback.core import Callback
    class Swap(Callback):                     # after 3 batches: the head stops training, the body starts
        order = 100
        def after_batch(self):
            if self.iter == 2: self.learn.model[1].requires_grad_(False); self.learn.model[0].requires_grad_(True)
    def run(dtype):
        model = body_head()
        model[0].requires_grad_(False)
        learn = synth_learner(model=model, splitter=two_groups, opt_func=partial(SGD, mom=0.9), lr=1e-2, wd=0.1)
        if dtype != 'fp32': getattr(learn, f'to_{dtype}')()
        learn.fit(1, cbs=Swap())
        return learn.model[1].weight.detach().float().clone(), learn
    ref, _ = run('fp32')
    start = body_head()[1].weight.detach()
    got, learn = run('bf16')
    # the head moved on after it froze (momentum and weight decay), as in fp32
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)
    assert (ref - start).abs().max() > 2e-2

def test_remainders_follow_the_model_to_its_device():
    "fastai moves the model at `fit`, after `to_bf16()` made the frozen body's remainders: they follow it, as masters do"
    learn = fastai_learner('bf16')
    record = learn.mixed_precision.conversion.masters
    w = learn.model[0][0].weight
    value = record.value(w).clone()
    rem = record.remainder(w)
    record.exact[w] = rem._replace(code=rem.code.to('meta'))             # as if it stayed behind on another device
    assert record.off_device()
    record.exact[w] = rem
    assert not record.off_device() and same_bits(record.value(w), value)
