"""The house rules that `make test` checks: lines of at most 120 characters (under 2% of the package's lines over it, and
of the tests'), no class over 250 lines, no exported notebook cell over 100 lines. The cells that are longer today are
listed below with their size now, as ceilings: they may shrink, never grow, and a new one may not join them.

    python .ci/house_rules.py          # prints the sizes, exits 1 on a breach
`.ci/wrap_lines.py` wraps long strings, comments and calls mechanically; `.ci/split_cells.py` splits long exported cells
at their top-level statements.
"""
import ast, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE, SHARE, CLASS, CELL = 120, 0.02, 250, 100
# the cells over 100 lines today, each holding one class (a class stays whole in one cell; every class is within 250
# lines), with their size now as ceilings
CELL_CEILINGS = {'13_master.ipynb': 228, '15_callback.ipynb': 243, '14_engine.ipynb': 241, '11_scaler.ipynb': 224,
                 '16_fp16_optimizer.ipynb': 148}

def long_share(paths) -> tuple:
    "Lines over LINE characters and all lines, over `paths`"
    lines = [l for p in paths for l in p.read_text().splitlines()]
    return sum(len(l) > LINE for l in lines), len(lines)

def class_sizes(paths) -> dict:
    "Each class's length in lines, by name"
    return {n.name: n.end_lineno - n.lineno + 1 for p in paths for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}

def export_cells(nbs) -> dict:
    "The longest exported cell of each notebook, in lines"
    res = {}
    for nb in nbs:
        cells = [c for c in json.loads(nb.read_text())['cells'] if c['cell_type'] == 'code' and ''.join(c['source']).startswith('#|export')]
        if cells: res[nb.name] = max(len(''.join(c['source']).splitlines()) for c in cells)
    return res

def main() -> int:
    package = [p for p in sorted((ROOT / 'mixedprec').glob('*.py')) if p.name != '_modidx.py']
    tests = sorted((ROOT / 'tests').glob('*.py'))
    bad = []
    for what, paths in (('package', package), ('tests', tests)):
        n, total = long_share(paths)
        print(f"{what}: {n} of {total} lines over {LINE} characters ({n / total:.1%}; at most {SHARE:.0%})")
        if n > SHARE * total: bad.append(f"{what}: {n / total:.1%} of its lines are over {LINE} characters (`python .ci/wrap_lines.py`)")
    for name, size in sorted(class_sizes(package).items(), key=lambda kv: -kv[1]):
        if size > CLASS: bad.append(f"class {name} is {size} lines, over {CLASS}: give one of its concerns a room")
    for name, size in sorted(export_cells(sorted((ROOT / 'nbs').glob('*.ipynb'))).items()):
        ceiling = CELL_CEILINGS.get(name, CELL)
        if size > CELL: print(f"{name}: longest exported cell {size} lines (ceiling {ceiling})")
        if size > ceiling: bad.append(f"{name}: an exported cell of {size} lines, over {ceiling}: one idea per cell")
    for b in bad: print(f"house rule broken: {b}")
    return 1 if bad else 0

if __name__ == '__main__': sys.exit(main())
