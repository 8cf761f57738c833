"""Run notebooks and keep their outputs (the docs show what each lesson printed): python .ci/run_notebooks.py [nbs/NAME.ipynb ...]
Runs in nbs/, as nbdev-test does; a failing cell stops with its traceback and writes nothing."""
import os, re, sys, glob
from pathlib import Path
from fastcore.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

def without_progress_bars(text:str) -> str:
    "A console stream as the reader saw it last: fastprogress's bar redraws (carriage returns, `Epoch i/n : |███---|`) gone, the epoch table kept"
    lines = []
    for line in text.split('\n'):
        segs = [re.sub(r'Epoch \d+/\d+ :\s*(\|[█-]*\|.*?\])?', '', s).replace('█', '').rstrip() for s in line.split('\r')]
        segs = [s for s in segs if s.strip()]
        if segs: lines.append(segs[-1])
    return '\n'.join(lines) + '\n' if lines else ''

def run(path: Path):
    nb = read_nb(path)
    cwd = os.getcwd(); os.chdir(path.parent)
    try:
        shell = CaptureShell()
        shell.run_cell("import warnings as _w; _w.filterwarnings('ignore', category=FutureWarning); "    # warnings as one line, without this machine's paths
                       "_w.formatwarning = lambda m, c, *a, **k: f'{c.__name__}: {m}\\n'")
        shell.run_all(nb, exc_stop=True)
    finally: os.chdir(cwd)
    for c in nb.cells:                                # outputs only: no execution counts or run metadata to churn the diffs
        if c.cell_type == 'code':
            c.execution_count = None
            for o in c.get('outputs', []):
                if o.get('output_type') == 'stream': o['text'] = without_progress_bars(''.join(o['text']))
            c.outputs = [o for o in c.get('outputs', []) if o.get('output_type') != 'stream' or o['text']]
        c.metadata.pop('execution', None)
    write_nb(nb, path)
    print(f"ran {path.name}: {sum(len(c.get('outputs', [])) for c in nb.cells if c.cell_type == 'code')} outputs kept")

if __name__ == '__main__':
    root = Path(__file__).resolve().parent.parent
    paths = [Path(p).resolve() for p in sys.argv[1:]] or sorted((root / 'nbs').glob('*.ipynb'))
    for p in paths: run(p)
