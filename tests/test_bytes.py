"""The bytes a param holds between steps, counted from every reachable tensor (issue 55): the fastai callback holds what
amp and FP16_Optimizer hold, for every master kind and state store: a bf16 weight and what its kind keeps beside it,
the moments as the store keeps them, and fp32 masters' grad buffers (kept between steps: allocating them each step
costs page faults). Nothing else: no fp32 grad of a master that has none between steps."""
import pytest, torch
from torch import nn
from fastai.optimizer import Adam
from mixedprec import amp
from mixedprec.state import reachable_bytes
from helpers import synth_learner, bf16_adamw

WIDTH = 256
# bytes a param between steps: weight 2, master (fp32 4 + its grad buffer 4; split's low half 2; none 0), Adam's two
# moments (fp32 8, bf16 4, 8-bit 2 and a scale per 256 elements)
EXPECTED = {('fp32', 'fp32'): 18, ('split', 'fp32'): 12, ('split', 'bf16'): 8, ('split', '8bit'): 6.03,
            ('none', '8bit'): 4.03, ('none', 'bf16'): 6}

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))

def train(front, masters, state, steps, then_backward=False):
    ("The MLP in bf16 under amp O2 or FP16_Optimizer, `steps` steps (and a backward after them, unscaled, with "
     "`then_backward`): the model, the optimizer, and the roots of what training holds")
    model, opt = bf16_adamw(front, mlp(), 1e-3, masters, state)
    x = torch.randn(16, 8)
    for i in range(steps + then_backward):
        loss = model(x if front == 'amp' else x.bfloat16()).float().square().mean()
        if front == 'amp':
            with amp.scale_loss(loss, opt) as s: s.backward()
        else: opt.backward(loss)
        if i == steps: break
        opt.step(); opt.zero_grad()
    return model, opt, [model, opt] + ([amp._state] if front == 'amp' else [])

def held_bytes(front, masters, state):
    "Bytes a param after two steps and a `zero_grad`, beyond nothing: the model, the optimizer and mixedprec's objects"
    if front == 'fastai':
        learn = synth_learner(model=mlp(), opt_func=Adam, lr=1e-3).to_bf16(masters=masters, state=state)
        learn.fit(1)
        model, roots = learn.model, [learn.model, learn.opt, learn.mixed_precision]
        stop = [learn]
    else:
        model, opt, roots = train(front, masters, state, steps=2)
        stop = []
    n = sum(p.numel() for p in model.parameters())
    return reachable_bytes(*roots, stop=stop) / n

@pytest.mark.parametrize("masters,state", list(EXPECTED))
@pytest.mark.parametrize("front", ['fastai', 'amp', 'fp16_optimizer'])
def test_a_param_holds_its_kinds_bytes_between_steps_on_every_front_end(front, masters, state):
    per_param = held_bytes(front, masters, state)
    # a little beyond: the step counts, the scaler, the rounding streams (a few KB over 70K params)
    assert EXPECTED[masters, state] - 0.05 <= per_param <= EXPECTED[masters, state] + 0.15, per_param

def pending_bytes(front):
    ("Bytes a param of `masters='split', state='8bit'` between an unscale and its step (after a first step): on the CPU "
     "its grad is the backward's bf16 one, whose unscale the step does")
    if front == 'fastai':
        from fastai.callback.core import Callback
        class Count(Callback):
            order = 11                                          # after mixedprec's callback (10), which unscales
            def before_step(self):
                if self.train_iter == 1: self.bytes = reachable_bytes(self.learn.model, self.learn.opt,
                                                                      self.learn.mixed_precision, stop=[self.learn])
        count = Count()
        learn = synth_learner(model=mlp(), opt_func=Adam, lr=1e-3, cbs=count).to_bf16(masters='split', state='8bit')
        learn.fit(1)
        return count.bytes / sum(p.numel() for p in learn.model.parameters())
    model, opt, roots = train(front, 'split', '8bit', steps=1, then_backward=True)
    return reachable_bytes(*roots) / sum(p.numel() for p in model.parameters())

@pytest.mark.parametrize("front", ['fastai', 'amp', 'fp16_optimizer'])
def test_from_the_unscale_to_the_step_a_bf16_master_adds_its_half_grad_and_no_fp32_grad(front):
    per_param = pending_bytes(front)
    assert EXPECTED['split', '8bit'] + 2 - 0.05 <= per_param <= EXPECTED['split', '8bit'] + 2 + 0.15, per_param   # not +4
