"""The package as a user installs it: a wheel built from the checkout, installed into a clean venv, imported from outside
the checkout, and trained with. The kernel sources must ship in it (they are compiled on first use)."""
import os, subprocess, sys, sysconfig, zipfile
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent

TRAIN = r"""
import os, sys, mixedprec, mixedprec.callback
from mixedprec import ops
from fastai.vision.all import *
assert mixedprec.__file__.startswith(sys.prefix), f"imported from {mixedprec.__file__}, not the clean venv {sys.prefix}"
x, y = torch.randn(256, 20), torch.randint(0, 3, (256,))
dls = DataLoaders.from_dsets(list(zip(x[:192], y[:192])), list(zip(x[192:], y[192:])), bs=64)
learn = Learner(dls, nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3)), loss_func=CrossEntropyLossFlat()).to_bf16()
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
assert {p.dtype for p in learn.model[0].parameters()} == {torch.bfloat16}
print('trained', mixedprec.__version__, ops.backend(torch.zeros(1)), mixedprec.__file__)
"""

def test_the_built_wheel_installs_into_a_clean_venv_and_trains(tmp_path):
    wheels = tmp_path / 'wheels'
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w',
                        str(wheels), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel, = wheels.glob('mixedprec-*.whl')
    names = zipfile.ZipFile(wheel).namelist()
    assert {'mixedprec/csrc/mixedprec.cpp',
            'mixedprec/csrc/cpu_kernels.cpp'} <= set(names), "the kernel sources ship in the wheel"
    assert any(n.endswith('.dist-info/licenses/LICENSE') or n.endswith('.dist-info/LICENSE') for n in names), "the license ships"
    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', str(venv)], check=True, timeout=300)
    py = venv / 'bin' / 'python'
    r = subprocess.run([str(py), '-m', 'pip', 'install', '-q', '--no-deps', '--no-index', str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # the dependencies (torch, fastai: gigabytes) come from this environment's site-packages, after the clean venv's own
    purelib = subprocess.run([str(py), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, 'deps_from_test_env.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
    env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH',)}
    r = subprocess.run([str(py), '-W', 'ignore::FutureWarning', '-c', TRAIN], cwd=tmp_path, capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'trained' in r.stdout and str(venv) in r.stdout, r.stdout
