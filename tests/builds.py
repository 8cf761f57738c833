"""The two builds that only tests need, in one place: the CUDA emulator (tests/csrc/cuda_emulator.cpp, the CUDA kernels'
code compiled for the CPU) and the CUDA extension compiled by nvcc without a GPU. The tests call these; `make test` also
runs this file in the background, niced, as soon as the install is done (`python tests/builds.py`), so that both
compiles (minutes on 2 cores) use the core that the notebooks and pytest leave idle. A test that needs a build still
running waits on its build lock, and finds it built after."""
import pathlib, sys
from torch.utils import cpp_extension
from mixedprec import ops

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA_ARCH = '9.0'                        # one arch: enough to type-check every kernel

def build_emulator():
    "The CUDA emulator, built once into build/cuda_emulator (torch rebuilds it when its sources change)"
    build = ROOT / 'build' / 'cuda_emulator'
    build.mkdir(parents=True, exist_ok=True)
    with ops._build_env(None):
        return cpp_extension.load('mixedprec_cuda_emulator', [str(ROOT / 'tests' / 'csrc' / 'cuda_emulator.cpp')],
                                  extra_include_paths=[str(ROOT / 'mixedprec' / 'csrc')],
                                      extra_cflags=['-O2', '-ffp-contract=off'],
                                  build_directory=str(build))

def build_cuda():
    ("The CUDA extension, compiled by nvcc for one arch into mixedprec's kernel cache with every step kernel "
     "registered (built once into one module: a run builds only the ones it asks for; None without a CUDA toolkit)")
    if ops.find_cuda_home() is None: return None
    ext = ops.build_extension(cuda=True, cuda_arch=CUDA_ARCH)
    ext.build_step_kernel()
    return ext

if __name__ == '__main__':
    for build in (build_emulator, build_cuda):
        try: build(); print(f"{build.__name__}: done", flush=True)
        except Exception as e:
            print(f"{build.__name__}: {type(e).__name__}: {e} (the test that needs it builds it again and reports)",
                  flush=True)
    sys.exit(0)
