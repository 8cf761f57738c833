"""The first use of the CUDA kernels on a fresh machine: the seconds from an empty kernel cache until the kernels a
run needs are built, for one arch, without a GPU (nvcc compiles for an arch with none present). Each run in a
process of its own, with a cache of its own: the extension (C++ CPU kernels, the CUDA ops' host side, the unscale and
norm kernels), then the step kernels the run asks for, each built the first time a step needs it
(tests/test_cuda_emulation.py reads `RUNS` and checks that these runs ask for exactly these). Last, every step kernel in
one module (what `make test` builds once). Prints a table; `python bench/first_use_build.py [--arch 9.0]`."""
import argparse, os, subprocess, sys, tempfile, time
import torch
from mixedprec import ops

RUNS = {
    'fp16, fp32 masters, AdamW': [ops.step_kernel_key('adam', torch.float32, copy=torch.float16),
                                  ops.step_kernel_key('adam', torch.float32)],
    'bf16, split masters, 8-bit AdamW': [ops.step_kernel_key('adam', torch.float32, 'split', '8bit'),
                                         ops.step_kernel_key('adam', torch.float32, state='8bit')],
    'every step kernel (make test)': None,
}

def child(arch, cache, keys):
    "In a fresh process: time the extension's build, then each step kernel's; print them"
    t0 = time.perf_counter()
    ext = ops.build_extension(cuda=True, cuda_arch=arch, cache=cache)
    t1 = time.perf_counter()
    for key in keys or [None]: ext.build_step_kernel(key)
    t2 = time.perf_counter()
    print(f"{t1 - t0:.1f} {t2 - t1:.1f}")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--arch', default='9.0')
    ap.add_argument('--child', nargs='*')
    a = ap.parse_args()
    if a.child is not None: return child(a.arch, a.child[0], [int(k) for k in a.child[1:]])
    cpu = ops.cpu_isa()[0]
    print(f"first use of the CUDA kernels, sm_{a.arch.replace('.', '')}, empty cache, {os.cpu_count()} cores "
          f"(CPU ISA {cpu}), torch {torch.__version__}, nvcc {ops.find_cuda_home()}")
    print(f"| run | extension (s) | step kernels (s) | total (s) |\n|---|---|---|---|")
    for name, keys in RUNS.items():
        with tempfile.TemporaryDirectory() as cache:
            os.chmod(cache, 0o700)
            out = subprocess.run([sys.executable, __file__, '--arch', a.arch, '--child', cache, *map(str, keys or [])],
                                 capture_output=True, text=True, check=True).stdout.split()
            ext_s, steps_s = float(out[-2]), float(out[-1])
            what = f"{len(keys)}: " + '; '.join(ops.describe_step_kernel(k) for k in keys) if keys else 'all 144'
            print(f"| {name} ({what}) | {ext_s:.1f} | {steps_s:.1f} | {ext_s + steps_s:.1f} |", flush=True)

if __name__ == '__main__': main()
