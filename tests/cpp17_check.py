"""Compile every kernel source as C++17 against this Python's torch headers (`python tests/cpp17_check.py`): the C++
sources and the CUDA emulator with g++ (-fsyntax-only), the CUDA sources with nvcc (to PTX only: no GPU and no link
needed) where a CUDA toolkit is found. torch up to 2.13 builds extensions as C++17 (torch 2.14 as C++20), so this runs
under an older torch whose headers compile as C++17 (.ci/torch_range.sh: 2.4.1); ours must too."""
import subprocess, sys, sysconfig, tempfile, time
from pathlib import Path
from torch.utils.cpp_extension import include_paths
from mixedprec.ops import find_cuda_home

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / 'mixedprec' / 'csrc'
CUDA_ARCH = 'compute_90'

def run(what, cmd):
    "Run one compile; print its time, or its errors and fail"
    t = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode: sys.exit(f"cpp17_check: {what} does not compile as C++17:\n{res.stderr[-6000:]}")
    print(f"cpp17_check: {what}: C++17 ok ({time.time() - t:.0f}s)", flush=True)

def main():
    incs = [f'-I{p}' for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f'-I{CSRC}']
    home = find_cuda_home()
    cuda_host = [CSRC / 'cuda_dispatch.cpp'] if home else []      # its CUDA headers need the toolkit's
    cuda_incs = [f'-I{Path(home) / "include"}'] if home else []
    for src in [CSRC / 'mixedprec.cpp', CSRC / 'cpu_kernels.cpp', *cuda_host,
                ROOT / 'tests' / 'csrc' / 'cuda_emulator.cpp']:
        run(src.name, ['g++', '-std=c++17', '-fsyntax-only', '-fopenmp', '-DWITH_CUDA', '-DTORCH_EXTENSION_NAME=check',
                       *incs, *cuda_incs, str(src)])
    if home is None: print("cpp17_check: no CUDA toolkit: the .cu sources were not compiled"); return
    nvcc = [str(Path(home) / 'bin' / 'nvcc'), '-std=c++17', '--fmad=false', '-DWITH_CUDA', f'-arch={CUDA_ARCH}', '-ptx',
            '-DTORCH_EXTENSION_NAME=check']
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted(CSRC.glob('*.cu')):
            out = Path(tmp) / f'{src.stem}.ptx'
            run(src.name, nvcc + [*incs, f'-I{Path(home) / "include"}', str(src), '-o', str(out)])

if __name__ == '__main__': main()
