"""Run a notebook as nbdev-test does, on this CPU made to compute and look like an AVX2-only one (no half-precision
units), timing each cell: an upper bound for nbdev's 600 s per cell there, since emulated bf16 on a faster CPU forced to
AVX2 is slower than on a real AVX2 CPU. Usage:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MIXEDPREC_ISA=avx2 .venv/bin/python .ci/avx2_emulation.py nbs/01_recipes.ipynb

The CPU flags mixedprec reads are replaced by an AVX2-only set, so recipes choose what they choose there. torch.compile
is unreliable under the ATEN_CPU_CAPABILITY override (plain torch gives wrong results), so compiled cells say nothing."""
import os, sys, time
from pathlib import Path
from fastcore.nbio import read_nb
from execnb.shell import CaptureShell

FAKE = "import mixedprec.ops as _o, mixedprec.convert as _c; _f = frozenset({'avx', 'avx2', 'fma', 'f16c', 'sse4_2'}); _o.cpu_flags = _c.cpu_flags = lambda: _f"

def main(path:str):
    nb = read_nb(Path(path).resolve())
    os.chdir(Path(path).resolve().parent)
    shell = CaptureShell()
    shell.run_cell(FAKE)
    total = time.time()
    for i, c in enumerate(nb.cells):
        if c.cell_type != 'code' or any(c.source.lstrip().startswith(f'#|{f}') for f in ('slow', 'cuda', 'eval: false')): continue
        t = time.time()
        shell.run_cell(c.source)
        print(f"cell {i}: {time.time() - t:.0f}s{'  FAILED: ' + repr(shell.exc)[:300] if shell.exc else ''}", flush=True)
        if shell.exc: sys.exit(1)
    print(f"{Path(path).name}: {time.time() - total:.0f}s in all")

if __name__ == '__main__': main(*sys.argv[1:])
