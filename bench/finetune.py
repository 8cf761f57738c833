"""Fine-tuning a frozen base (issue 54), measured two ways; each prints a table.

    python bench/finetune.py bytes      # LoRA (peft, r=8) on a GPT-2 and a BERT built from configs, and a 7B on paper:
                                        # every reachable tensor's bytes between backward and step, against fp32
    python bench/finetune.py accuracy   # fastai's fine_tune of a pretrained body (frozen for an epoch, then unfrozen):
                                        # fp32, and bf16/fp16 with the body's masters made at the unfreeze from its
                                        # half weights (mixedprec's way) or kept exact from the start
"""
import statistics, sys, warnings
from pathlib import Path
import torch
from torch import nn
BENCH = Path(__file__).resolve().parent
# bench/ (the script's folder, on the path) holds a kernels.py, which transformers would take for the `kernels` it seeks
sys.path = [p for p in sys.path if Path(p or '.').resolve() != BENCH] + [str(BENCH.parent / 'tests')]

def cpu_name() -> str:
    "bench/kernels.py's CPU name, loaded from its file"
    import importlib.util
    spec = importlib.util.spec_from_file_location('bench_kernels', BENCH / 'kernels.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod.cpu_name()

def _lora(kind, seed=0):
    import transformers, peft
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == 'gpt2':
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=64,
                                                                    n_positions=32, bos_token_id=0, eos_token_id=0,
                                                                    loss_type='ForCausalLM'))
        targets = ['c_attn', 'c_proj', 'c_fc']
    else:
        base = transformers.BertForSequenceClassification(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512, vocab_size=1000,
            max_position_embeddings=64, num_labels=2))
        targets = ['query', 'value']
    return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=targets, fan_in_fan_out=kind == 'gpt2'))

def _step_bytes(kind, front, **kw):
    "The bytes reachable from the model, the optimizer and mixedprec's objects between the backward and the step"
    from helpers import reachable_bytes
    from mixedprec import amp
    from mixedprec.fp16_optimizer import FP16_Optimizer
    model = _lora(kind)
    x = torch.randint(0, 64, (4, 32))
    run = (lambda m: m(input_ids=x, labels=x).loss) if kind == 'gpt2' else (
        lambda m: m(input_ids=x, labels=torch.tensor([0, 1, 0, 1])).loss)
    if front == 'fp32':
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2): run(model).backward(); seen = reachable_bytes(model, opt); opt.step(); opt.zero_grad()
    elif front == 'amp O2':
        model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opt_level='O2',
                                    half_dtype='bf16', verbosity=0, **kw)
        for _ in range(2):
            with amp.scale_loss(run(model), opt) as s: s.backward()
            seen = reachable_bytes(model, opt, amp._state); opt.step(); opt.zero_grad()
    else:
        model = model.bfloat16()
        opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), verbose=False, **kw)
        for _ in range(2): opt.backward(run(model)); seen = reachable_bytes(model, opt); opt.step(); opt.zero_grad()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    half = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in
               [*model.parameters(), *model.buffers()]}.values())
    return seen, trained, sum(p.numel() for p in model.parameters()), half

def bytes_table():
    warnings.filterwarnings('ignore')
    print(f"{cpu_name()}, torch {torch.__version__}: LoRA r=8 through each front end (bf16), the optimizer on every "
          "param as peft's examples build it; bytes reachable between backward and step")
    print("| model | front end | x fp32 fine-tune | bytes a trainable param beyond the half weights |")
    print("|---|---|---|---|")
    for kind in ('gpt2', 'bert'):
        base, trained, total, _ = _step_bytes(kind, 'fp32')
        print(f"| {kind} ({trained / total:.1%} of {total} params train) | fp32 | 1.00 | |")
        for front, kw in [('amp O2', {}), ('FP16_Optimizer', {}), ('amp O2', dict(masters='split', state='8bit')),
                          ('FP16_Optimizer', dict(masters='split', state='8bit'))]:
            seen, trained, total, half = _step_bytes(kind, front, **kw)
            name = front + (', split masters, 8-bit state' if kw else '')
            print(f"| {kind} | {name} | {seen / base:.2f} | {(seen - half) / trained:.1f} |")
    # a 7B model with LoRA r=8 on its attention and MLP (0.06% trains), on paper from the same per-param bytes
    n, t = 6.74e9, 4.2e6
    print(f"| 7B on paper ({t / n:.2%} train) | fp32: {(4 * n + 16 * t) / 2**30:.1f} GiB | bf16 + 20 B a trainable "
          f"param: {(2 * n + 20 * t) / (4 * n + 16 * t):.2f}x | |")

def _digits(classes):
    from sklearn.datasets import load_digits
    d = load_digits()
    keep = torch.tensor([c in classes for c in d.target])
    x = torch.tensor(d.images, dtype=torch.float32)[keep].unsqueeze(1) / 16
    y = torch.tensor(d.target)[keep] - min(classes)
    return x, y

def _body(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                         nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())

def _learner(body, x, y, seed):
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.metrics import accuracy
    from torch.utils.data import TensorDataset
    from helpers import quiet
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(x), generator=g)
    tr, va = idx[:len(x) * 3 // 4], idx[len(x) * 3 // 4:]
    dls = DataLoaders(DataLoader(TensorDataset(x[tr], y[tr]), bs=32, shuffle=True),
                      DataLoader(TensorDataset(x[va], y[va]), bs=64))
    torch.manual_seed(seed)
    model = nn.Sequential(body, nn.Linear(64, 5))
    return quiet(Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy,
                         splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())]))

def accuracy_table(seeds=(0, 1, 2)):
    "fastai's fine_tune of a body pretrained on digits 0-4, fine-tuned on digits 5-9"
    warnings.filterwarnings('ignore')
    import copy, mixedprec.callback    # noqa: F401 (Learner.to_bf16 is mixedprec's)
    from fastai.callback.schedule import fine_tune      # noqa: F401
    x0, y0 = _digits(range(5)); x1, y1 = _digits(range(5, 10))
    res = {}
    for seed in seeds:
        pre = _learner(_body(seed), x0, y0, seed); pre.fit_one_cycle(5, 1e-2)      # the pretrained body, in fp32
        # the body keeps no master while frozen, only its exact values, however it was frozen; masters at the unfreeze
        for name in ('fp32', 'bf16, body frozen before to_bf16', 'bf16, body frozen after to_bf16',
                     'fp16, body frozen before to_fp16'):
            learn = _learner(copy.deepcopy(pre.model[0]), x1, y1, seed)
            dtype = name.split(',')[0]
            if name.endswith('after to_bf16'): getattr(learn, f'to_{dtype}')(); learn.freeze()
            elif dtype != 'fp32': learn.freeze(); getattr(learn, f'to_{dtype}')()
            learn.fine_tune(8, 3e-2, freeze_epochs=1)
            res.setdefault(name, []).append(learn.validate()[1])
    print(f"{cpu_name()}, torch {torch.__version__}: fastai fine_tune (1 frozen epoch, 8 unfrozen, lr 3e-2) of a conv body "
          f"pretrained on digits 0-4, on digits 5-9; seeds {list(seeds)}")
    print("| run | valid accuracy: mean (min-max) |")
    print("|---|---|")
    for name, accs in res.items():
        print(f"| {name} | {statistics.mean(accs):.4f} ({min(accs):.4f}-{max(accs):.4f}) |")

if __name__ == '__main__':
    torch.set_num_threads(max(1, torch.get_num_threads()))
    {'bytes': bytes_table, 'accuracy': accuracy_table}[sys.argv[1] if len(sys.argv) > 1 else 'bytes']()
