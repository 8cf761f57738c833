"Ordinary fastai workflows under to_fp16()/to_bf16(): checkpoints, export, inference, fine-tuning, other callbacks"
import warnings
import numpy as np, pandas as pd
import pytest, torch
# every test with the skip decided on the host and on the device (fastai's Adam/SGD fused)
pytestmark = pytest.mark.usefixtures("decide")
from torch import nn
from fastai.learner import Learner, load_learner
from fastai.optimizer import SGD, Adam
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.tracker import SaveModelCallback, EarlyStoppingCallback
from fastai.callback.mixup import MixUp, CutMix
from fastai.callback.channelslast import ChannelsLast
from fastai.callback.schedule import fit_one_cycle, lr_find
from fastai.interpret import ClassificationInterpretation
from fastai.metrics import accuracy
from fastai.losses import CrossEntropyLossFlat
from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, CategoryBlock
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from torch.utils.data import TensorDataset
from mixedprec.callback import MixedPrecision
from mixedprec import convert, ops
from helpers import synth_learner, masters_of, master_values, Record, mlp, group_learner

def params(learn): return [p.detach().clone() for p in learn.model.parameters()]
def same(a, b): return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

@pytest.mark.parametrize("flat", [False, True])
def test_checkpoint_resume_is_bit_identical(tmp_path, flat):
    full = synth_learner(opt_func=Adam, lr=1e-2,
                         path=tmp_path).to_fp16(loss_scale=2.**8, max_noskip=3, flat_master=flat)
    full.fit(2)
    part = synth_learner(opt_func=Adam, lr=1e-2,
                         path=tmp_path).to_fp16(loss_scale=2.**8, max_noskip=3, flat_master=flat)
    part.fit(1)
    part.save('mid', with_opt=True)
    resumed = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path,
                            seed=123).to_fp16(loss_scale=2.**8, max_noskip=3, flat_master=flat)
    resumed.load('mid', with_opt=True)
    assert resumed.mixed_precision.scaler.state_dict() == part.mixed_precision.scaler.state_dict()
    resumed.fit(1)
    assert same(params(resumed), params(full)) and same([m.detach() for m in masters_of(resumed)],
                                                        [m.detach() for m in masters_of(full)])
    assert resumed.mixed_precision.scaler.state_dict() == full.mixed_precision.scaler.state_dict()

def test_checkpoint_holds_fp32_masters_and_loads_weights_only(tmp_path):
    learn = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    f = learn.save('ck', with_opt=True)
    sd = torch.load(f, weights_only=True)
    assert set(sd) == {'model', 'opt'} and sd['model']['0.weight'].dtype == torch.float32
    assert torch.equal(sd['model']['0.weight'], masters_of(learn)[0].detach())
    assert not torch.equal(sd['model']['0.weight'], sd['model']['0.weight'].half().float())    # not fp16-rounded
    assert sd['opt']['mixedprec']['scaler']['scale'] == learn.mixed_precision.loss_scale
    assert len(sd['opt']['state']) == 6 and 'grad_avg' in sd['opt']['state'][0]

def test_fp32_and_fp16_checkpoints_load_both_ways(tmp_path):
    fp32 = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path)
    fp32.fit(1); fp32.save('f32', with_opt=True)
    half = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path, seed=5).to_fp16()
    with warnings.catch_warnings():
        # fastai turns optimizer-load errors into warnings
        warnings.filterwarnings('error', message='Could not load')
        half.load('f32', with_opt=True)
    assert same([m.detach() for m in masters_of(half)], params(fp32))
    assert 'grad_avg' in half.opt.state[half.opt.param_lists[0][0]]
    half.fit(1); half.save('f16', with_opt=True)
    back = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path, seed=6)
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='Could not load')
        back.load('f16', with_opt=True)
    assert same(params(back), [m.detach() for m in masters_of(half)])
    back.fit(1)

def test_save_model_and_early_stopping_callbacks(tmp_path):
    learn = synth_learner(opt_func=Adam, lr=1e-2, path=tmp_path).to_fp16(loss_scale=2.**8)
    learn.fit(3, cbs=[SaveModelCallback(fname='best', with_opt=True), EarlyStoppingCallback(patience=1)])
    assert (tmp_path/'models'/'best.pth').exists()
    assert learn.model[0].weight.dtype == torch.half and learn.mixed_precision.engine.masters is not None
    learn.fit(1)

def digits_df():
    from sklearn.datasets import load_digits
    d = load_digits()
    df = pd.DataFrame(d.data / 16., columns=[f'p{i}' for i in range(64)])
    df['quad'] = (np.arange(len(df)) % 4).astype(str)
    df['y'] = d.target
    return df

@pytest.fixture(scope='module')
def tabular(tmp_path_factory):
    df = digits_df()
    dls = TabularDataLoaders.from_df(df, path=tmp_path_factory.mktemp('tab'), procs=[Categorify], cat_names=['quad'],
                                     cont_names=[f'p{i}' for i in range(64)],
                                     y_names='y', y_block=CategoryBlock, bs=64, valid_idx=list(range(1500, 1797)))
    return df, dls

def test_tabular_train_inference_interpretation_and_export(tabular):
    df, dls = tabular
    torch.manual_seed(0)
    learn = tabular_learner(dls, layers=[64], metrics=accuracy).to_fp16()
    assert learn.model.embeds[0].weight.dtype == torch.half
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2)
    assert learn.validate()[1] > 0.8
    preds, targs = learn.get_preds()
    assert preds.dtype == torch.float32
    assert learn.predict(df.iloc[0])[2].dtype == torch.float32
    interp = ClassificationInterpretation.from_learner(learn)
    assert interp.losses.dtype == torch.float32 and interp.confusion_matrix().sum() == 297
    learn.export('export.pkl')
    assert learn.model.embeds[0].weight.dtype == torch.half
    with learn.no_bar(), learn.no_logging(): learn.fit(1)          # the Learner trains on after export
    loaded = load_learner(learn.path/'export.pkl')
    assert not hasattr(loaded, 'mixed_precision') and all(p.dtype == torch.float32 for p in loaded.model.parameters())
    # plain fastai loads it: mixedprec is never imported in the serving process, and the file holds no masters
    import subprocess, sys
    probe = ("import sys; from fastai.learner import load_learner; l = load_learner(sys.argv[1]); "
             "print(sorted({str(p.dtype) for p in l.model.parameters()}), any(m.startswith('mixedprec') for m in "
             "sys.modules))")
    out = subprocess.run([sys.executable, '-c', probe, str(learn.path/'export.pkl')], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "['torch.float32'] False", out.stderr[-2000:]
    learn.export('kept.pkl', keep_mixed_precision=True)
    assert (learn.path/'export.pkl').stat().st_size < (learn.path/'kept.pkl').stat().st_size
    learn.add_cb(ChannelsLast())
    # fastai's load_learner leaves by to_contiguous(to_fp32=True)
    learn.export('kept_cl.pkl', keep_mixed_precision=True)
    for f in ('kept.pkl', 'kept_cl.pkl'):
        back = load_learner(learn.path/f)
        assert not any(isinstance(c, MixedPrecision) for c in back.cbs) and all(p.dtype == torch.float32 for p in back.model.parameters()), f
        assert all(torch.equal(m.detach(), p.detach()) for m, p in zip(masters_of(learn), back.model.parameters()))
    assert loaded.predict(df.iloc[0])[2].dtype == torch.float32
    assert loaded.get_preds(dl=loaded.dls.test_dl(df.iloc[:10]))[0].dtype == torch.float32

def test_lr_find_restores_scale_masters_model_and_state():
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1)
    before = (params(learn), [m.detach().clone() for m in masters_of(learn)], learn.mixed_precision.scaler.state_dict(),
              [learn.opt.state[m]['grad_avg'].clone() for m in learn.opt.param_lists[0]])
    with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=10, show_plot=False)
    assert same(params(learn), before[0]) and same([m.detach() for m in masters_of(learn)], before[1])
    assert learn.mixed_precision.scaler.state_dict() == before[2]
    assert same([learn.opt.state[m]['grad_avg'] for m in learn.opt.param_lists[0]], before[3])
    learn.fit(1)

@pytest.mark.parametrize("flat", [False, True])
def test_freeze_fine_tune_unfreeze_and_discriminative_lrs(flat):
    learn = group_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8, flat_master=flat)
    learn.freeze()
    body = [v.clone() for v in master_values(learn)[:2]]
    learn.fit(1)
    assert same(master_values(learn)[:2], body)           # frozen values stayed put, exactly (no master)
    assert learn.model[0][0].weight.grad is None and not learn.model[0][0].weight.requires_grad
    learn.unfreeze()
    learn.fit(1, lr=slice(1e-3, 1e-2))
    assert not same(master_values(learn)[:2], body)       # newly unfrozen params train
    assert [h['lr'] for h in learn.opt.hypers] == [1e-3, 1e-2]
    learn = group_learner(opt_func=Adam, lr=1e-2).to_fp16(flat_master=flat)
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(1, 1e-2)
    assert learn.mixed_precision.scaler.n_steps == 12

def test_mixup_on_features():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 8, generator=g), torch.randint(0, 3, (128,), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=32), DataLoader(TensorDataset(x, y), bs=32))
    learn = Learner(dls, mlp(8, 3), loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=MixUp())
    assert learn.mixed_precision.scaler.n_steps == 4

def test_cutmix_on_tiny_images():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 2, (32,), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=16), DataLoader(TensorDataset(x, y), bs=16))
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-2).to_bf16()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=CutMix())
    assert learn.mixed_precision.scaler.n_steps == 2 and model[0].weight.dtype == torch.bfloat16

class TextModel(nn.Module):
    "Embedding, LayerNorm and an LSTM"
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.lstm, self.head = nn.Embedding(
            50, 16), nn.LayerNorm(16), nn.LSTM(16, 16, batch_first=True), nn.Linear(16, 2)
    def forward(self, ids):
        out, _ = self.lstm(self.norm(self.emb(ids)))
        return self.head(out[:, -1])

def test_text_model_with_embedding_layernorm_lstm():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (64, 12), generator=g); y = (ids[:, 0] > 25).long()
    dls = DataLoaders(DataLoader(TensorDataset(ids, y), bs=16), DataLoader(TensorDataset(ids, y), bs=16))
    learn = Learner(dls, TextModel(), loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=1e-2).to_fp16()
    assert learn.model.lstm.weight_ih_l0.dtype == torch.half
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    assert learn.get_preds()[0].dtype == torch.float32

def test_cancel_fit_mid_epoch_leaves_a_usable_learner():
    def cancel(learn):
        if learn.train_iter == 2: raise CancelFitException()
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    learn.fit(1, cbs=Record(1, after_batch=cancel))
    masters = [m.detach().clone() for m in masters_of(learn)]
    learn.fit(1)
    learn.to_fp32()
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())

def test_keyboard_interrupt_like_exception_then_to_fp32_and_fit():
    def interrupt(learn):
        if learn.train_iter == 3: raise KeyboardInterrupt
    learn = synth_learner(opt_func=Adam, lr=1e-2).to_fp16(loss_scale=2.**8)
    with pytest.raises(KeyboardInterrupt): learn.fit(1, cbs=Record(1, after_backward=interrupt))
    masters = [m.detach().clone() for m in masters_of(learn)]
    learn.to_fp32()
    assert same(params(learn), masters)
    learn.fit(1)

def test_speed_note_warns_once(monkeypatch):
    monkeypatch.setattr(convert, 'cpu_flags', lambda: {'avx2'})
    monkeypatch.setattr(ops, '_warned', set())
    with pytest.warns(UserWarning, match='no bf16 units'): synth_learner().to_bf16()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        synth_learner().to_bf16()                      # once per process
    assert convert.speed_note(torch.bfloat16, 'cpu').startswith('this CPU has no bf16')
    monkeypatch.setattr(convert, 'cpu_flags', lambda: {'avx512_bf16', 'amx_bf16', 'avx512_fp16', 'amx_fp16'})
    assert convert.speed_note(torch.bfloat16, 'cpu') is None and convert.speed_note(torch.float16, 'cpu') is None

def test_model_without_float_params_warns():
    class Ids(nn.Module):
        def __init__(self): super().__init__(); self.register_buffer('table', torch.arange(3))
        def forward(self, x): return x
    with pytest.warns(UserWarning, match='nothing in the model is converted .it has no float params or buffers., so '
                                         'mixed precision changes nothing'):
        learn = synth_learner(model=nn.Sequential(Ids(), nn.Flatten())).to_fp16()
    # no cast hooks left, the ids untouched
    assert not learn.model._forward_pre_hooks and learn.model[0].table.dtype == torch.int64

def test_tta_on_a_tiny_image_learner():
    from fastai.vision.all import DataBlock, ImageBlock, CategoryBlock, PILImage, RandomSplitter, Flip
    g = np.random.default_rng(0)
    imgs = (g.random((48, 16, 16, 3)) * 255).astype(np.uint8)
    labels = [str(i % 2) for i in range(48)]
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_x=lambda i: PILImage.create(imgs[i]),
                       get_y=lambda i: labels[i],
                       splitter=RandomSplitter(seed=0), batch_tfms=[Flip()])
    dls = dblock.dataloaders(list(range(48)), bs=8)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy).to_fp16(loss_scale=2.**8)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1)
        preds, targs = learn.tta(n=2)
    assert preds.dtype == torch.float32 and preds.shape == (len(dls.valid_ds), 2)
    assert learn.model[0].weight.dtype == torch.half

def test_optim_wrapper_checkpoint_keeps_torch_state(tmp_path):
    from functools import partial
    from fastai.optimizer import OptimWrapper
    opt_func = partial(OptimWrapper, opt=torch.optim.AdamW)
    learn = synth_learner(opt_func=opt_func, lr=1e-2, path=tmp_path).to_fp16(loss_scale=2.**8, max_noskip=2)
    learn.fit(1)
    assert learn.mixed_precision.loss_scale > 2.**8                      # the scale moved: a checkpoint must carry it
    f = learn.save('ow', with_opt=True)
    assert torch.load(f, weights_only=True)['opt']['mixedprec']['scaler'] == learn.mixed_precision.scaler.state_dict()
    fresh = synth_learner(opt_func=opt_func, lr=1e-2, path=tmp_path, seed=3).to_fp16(loss_scale=2.**8, max_noskip=2)
    fresh.load('ow', with_opt=True)
    assert fresh.mixed_precision.scaler.state_dict() == learn.mixed_precision.scaler.state_dict()
    fresh.fit(1); learn.fit(1)
    assert same(params(fresh), params(learn))
    assert fresh.mixed_precision.scaler.state_dict() == learn.mixed_precision.scaler.state_dict()
    # plain fastai fp32 loads it (torch ignores the scaler's key)
    plain = synth_learner(opt_func=opt_func, lr=1e-2, path=tmp_path, seed=4)
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='Could not load')
        plain.load('ow', with_opt=True)
    saved = torch.load(f, weights_only=True)['model']
    assert all(torch.equal(plain.model.state_dict()[k], v) for k, v in saved.items()) and saved['0.weight'].dtype == torch.float32
    assert len(plain.opt.opt.state) == 6 and all('exp_avg' in st for st in plain.opt.opt.state.values())
