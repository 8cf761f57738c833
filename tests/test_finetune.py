"""Fine-tuning a frozen base (issue 54): LoRA adapters (peft) on a GPT-2 built from a config, through the three front
ends, against the same fine-tune in fp32. What does not train holds no master, master grad or optimizer state; what
trains holds at most 20 bytes a param (10 with split masters and 8-bit state); the loss is fp32's; the frozen base does
not move; every door saves the masters, so the adapter peft saves reloads to the trained model's outputs"""
import pytest, torch
from torch import nn
from mixedprec import amp
from mixedprec.convert import convert_model
from mixedprec.fp16_optimizer import FP16_Optimizer
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from torch.utils.data import TensorDataset
from helpers import reachable_bytes, quiet, bf16_adamw

transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')
VOCAB, STEPS = 64, 80

def lora_gpt2(seed=0, init_seed=None):
    "A 2-layer, 128-wide GPT-2 from a config (the same base for every `seed`), with LoRA r=8 adapters (init `init_seed`)"
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, loss_type='ForCausalLM')
    base = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(seed if init_seed is None else init_seed)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=['c_attn', 'c_proj', 'c_fc'],
                                                     fan_in_fan_out=True, init_lora_weights='gaussian'))

def batches(n=STEPS, bs=8, seed=0):
    "Sequences that count up by a step of their own: a pattern the adapters can learn"
    g = torch.Generator().manual_seed(seed)
    res = []
    for _ in range(n):
        start, step = torch.randint(0, VOCAB, (bs, 1), generator=g), torch.randint(1, 4, (bs, 1), generator=g)
        res.append((start + step * torch.arange(16)) % VOCAB)
    return res

def counts(model):
    "(params that train, all params)"
    return sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters())

def frozen_of(model): return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

def train(front, masters='fp32', state='fp32', init_seed=0, measure=False):
    ("Fine-tune LoRA on `front` ('fp32', 'amp', 'fp16_optimizer'), bf16; returns the model, its last loss, the bytes "
     "reachable between the last backward and its step, and the frozen weights before")
    model = lora_gpt2(init_seed=init_seed)
    frozen, seen, first = frozen_of(model), None, None
    if front == 'fp32': opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else: model, opt = bf16_adamw(front, model, 3e-3, masters, state)   # on every param, frozen ones too
    for i, x in enumerate(batches()):
        loss = model(input_ids=x, labels=x).loss
        first = loss.item() if first is None else first
        if front == 'fp32': loss.backward()
        elif front == 'amp':
            with amp.scale_loss(loss, opt) as s: s.backward()
        else: opt.backward(loss)
        if measure and i == STEPS - 1: seen = reachable_bytes(model, opt, amp._state if front == 'amp' else None)
        opt.step(); opt.zero_grad()
    assert loss.item() < 0.85 * first, (front, first, loss.item())         # it learns
    return model, opt, loss.item(), seen, frozen

def model_bytes(model):
    "The bytes of the model's own params and buffers, as they are (half weights in mixed precision)"
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in
               [*model.parameters(), *model.buffers()]}.values())

@pytest.mark.parametrize("front,masters,state,per_param", [('amp', 'fp32', 'fp32', 20), ('fp16_optimizer', 'fp32', 'fp32', 20),
                                                           ('amp', 'split', '8bit', 10),
                                                           ('fp16_optimizer', 'split', '8bit', 10)])
def test_what_does_not_train_costs_no_master_and_what_trains_at_most_its_bytes(front, masters, state, per_param):
    model, opt, _, seen, frozen = train(front, masters, state, measure=True)
    trained, total = counts(model)
    beyond = seen - model_bytes(model)
    # beyond the model's half weights: the trainable params' masters, grads and moments, a few small tensors, and
    # the frozen base's exact fp32 values, 2 bytes a param at most (issue 59: its fp32 init is no half weight's)
    assert beyond <= per_param * trained + 2 * (total - trained) + 64 * 1024, (beyond / trained, front, masters, state)
    e = opt.engine if front == 'fp16_optimizer' else opt._mixedprec_engine
    assert {type(m).__name__ for m in e.masters.masters if not m.param.requires_grad} == {'Frozen'}
    assert all(not st for p, st in e.optimizer.state.items() if not p.requires_grad)

@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_a_lora_fine_tune_trains_as_fp32_leaves_the_base_alone_and_saves_its_adapter_as_fp32(front, tmp_path):
    fp32 = [train('fp32', init_seed=s)[2] for s in (0, 1, 2)]
    model, opt, loss, _, frozen = train(front)
    spread = max(fp32) - min(fp32)
    assert min(fp32) - spread <= loss <= max(fp32) + spread, (loss, fp32)
    for n, p in model.named_parameters():
        if n in frozen: assert torch.equal(p.detach(), frozen[n].to(p.dtype)), n          # the base never moved
    model.save_pretrained(tmp_path)
    saved = peft.load_peft_weights(str(tmp_path))
    e = opt.engine if front == 'fp16_optimizer' else opt._mixedprec_engine
    record = e.masters.record
    by_name = {n: p for n, p in model.named_parameters()}
    for k, v in saved.items():
        p = next(p for n, p in by_name.items() if n.replace('.default', '') == k)
        assert v.dtype == torch.float32 and torch.equal(v, record.value(p)), k       # the masters, not their rounding
    # reloaded into the same base, converted the same way: the trained model's outputs, bit for bit
    fresh = lora_gpt2(init_seed=5)
    if front == 'amp': convert_model(fresh, torch.bfloat16, cast_io=True)
    else: fresh = fresh.bfloat16(); convert_model(fresh, torch.bfloat16, cast_io=True)
    peft.set_peft_model_state_dict(fresh, saved)
    x = batches(1, seed=9)[0]
    model.eval(); fresh.eval()
    with torch.no_grad(): assert torch.equal(fresh(input_ids=x).logits.float(), model(input_ids=x).logits.float())

class LM(nn.Module):
    "A Learner's model around the peft model, which fastai's loss sees as logits"
    def __init__(self, lm): super().__init__(); self.peft = lm
    def forward(self, x): return self.peft(input_ids=x).logits.flatten(0, 1)

def lora_learner(tmp_path=None, init_seed=0):
    xs = torch.cat(batches())
    ys = torch.roll(xs, -1, 1); ys[:, -1] = (2 * xs[:, -1] - xs[:, -2]) % VOCAB
    dls = DataLoaders(DataLoader(TensorDataset(xs, ys), bs=8), DataLoader(TensorDataset(xs[:16], ys[:16]), bs=8))
    learn = Learner(dls, LM(lora_gpt2(init_seed=init_seed)), loss_func=lambda out, y: nn.functional.cross_entropy(
        out.float(), y.flatten()), lr=3e-3, path=tmp_path or '.')
    return quiet(learn)

def test_fastai_lora_holds_no_master_of_the_base_and_saves_fp32_adapters_through_a_submodule(tmp_path):
    learn = lora_learner(tmp_path).to_bf16()
    trained, total = counts(learn.model)
    seen = {}
    class Measure(Callback):
        order = 11                                              # after MixedPrecision: the grads are unscaled
        def before_step(self):
            seen['bytes'] = reachable_bytes(self.learn.model, self.learn.opt, self.learn.mixed_precision,
                                            stop=[self.learn])
    base = frozen_of(learn.model)
    learn.fit(1, cbs=Measure())
    # the frozen base: its exact fp32 values, 2 bytes a param at most beside its half weights (issue 59)
    assert seen['bytes'] - model_bytes(learn.model) <= 20 * trained + 2 * (total - trained) + 64 * 1024
    mp = learn.mixed_precision
    assert all(not p.requires_grad for p in mp.conversion.params if p not in mp.conversion.masters)
    for n, p in learn.model.named_parameters():
        if n in base: assert torch.equal(p.detach(), base[n].to(p.dtype))
    learn.model.peft.save_pretrained(tmp_path / 'adapter')    # a submodule's state_dict: the masters too
    saved = peft.load_peft_weights(str(tmp_path / 'adapter'))
    by_name = dict(learn.model.peft.named_parameters())
    for k, v in saved.items():
        p = next(p for n, p in by_name.items() if n.replace('.default', '') == k)
        assert v.dtype == torch.float32 and torch.equal(v, mp.conversion.masters.value(p)), k

def _unfreeze_run(front, masters, how, steps=12):
    ("A two-layer model whose first layer is frozen for `steps` steps, then trains (`requires_grad_(True)`, or a new "
     "param group); fp32 ('fp32' front) or bf16 through `front` with `masters`")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    m[0].requires_grad_(False)
    first = [m[2].weight, m[2].bias] if how == 'add_param_group' else list(m.parameters())
    opt = torch.optim.AdamW(first, lr=1e-2)
    if front == 'amp':
        m, opt = amp.initialize(m, opt, opt_level='O2', half_dtype='bf16', masters=masters, verbosity=0)
    elif front == 'fp16_optimizer':
        m = m.bfloat16(); opt = FP16_Optimizer(opt, masters=masters, verbose=False)
    dtype = torch.bfloat16 if front == 'fp16_optimizer' else torch.float32
    had = None
    for i in range(2 * steps):
        if i == steps:
            m[0].requires_grad_(True)
            if how == 'add_param_group': opt.add_param_group({'params': list(m[0].parameters())})
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, 8, generator=g)
        loss = nn.functional.mse_loss(m(x.to(dtype)).float(), x[:, :1] * x[:, 1:2])
        if front == 'amp':
            with amp.scale_loss(loss, opt) as s: s.backward()
        elif front == 'fp16_optimizer': opt.backward(loss)
        else: loss.backward()
        opt.step(); opt.zero_grad()
        if i == steps - 1 and front != 'fp32':
            e = opt.engine if front == 'fp16_optimizer' else opt._mixedprec_engine
            had = m[0].weight in e.masters.record
    e = None if front == 'fp32' else opt.engine if front == 'fp16_optimizer' else opt._mixedprec_engine
    return [p.detach().float() for p in m.parameters()], had, e

@pytest.mark.parametrize("how", ['requires_grad_', 'add_param_group'])
@pytest.mark.parametrize("masters", ['fp32', 'split', 'none'])
@pytest.mark.parametrize("front", ['amp', 'fp16_optimizer'])
def test_a_param_that_starts_to_train_gets_its_master_then_and_trains_as_in_fp32(front, masters, how):
    ref, _, _ = _unfreeze_run('fp32', None, how)
    got, had, e = _unfreeze_run(front, masters, how)
    assert had is False and e.masters.record.get(e.masters.masters[0].param) is not None
    assert type(e.masters.record.get(e.masters.masters[0].param)).__name__ == e.masters.kind.__name__
    for a, b in zip(ref, got): torch.testing.assert_close(b, a, rtol=6e-2, atol=6e-2)
    torch.manual_seed(0)
    start = nn.Linear(8, 32).weight.detach()
    assert (got[0] - start).abs().max() > 0.05 and (ref[0] - start).abs().max() > 0.05       # the first layer trained
