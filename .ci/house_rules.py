"""The house rules that `make test` checks: lines of at most 120 characters (under 2% of the package's lines over it, and
of the tests'), no class over 250 lines (its methods added with fastcore's `@patch` count towards it), no exported
notebook cell over 100 lines.

    python .ci/house_rules.py          # prints the sizes, exits 1 on a breach
`.ci/wrap_lines.py` wraps long strings, comments and calls mechanically; `.ci/split_cells.py` splits long exported cells
at their top-level statements; `.ci/split_classes.py` moves a long class's later methods into `@patch` cells.
"""
import ast, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE, SHARE, CLASS, CELL = 120, 0.02, 250, 100

def long_share(paths) -> tuple:
    "Lines over LINE characters and all lines, over `paths`"
    lines = [l for p in paths for l in p.read_text().splitlines()]
    return sum(len(l) > LINE for l in lines), len(lines)

def _patched_class(node):
    "The class a module-level `@patch` function `node` adds a method to (its first argument's annotation), or None"
    if not isinstance(node, ast.FunctionDef) or not node.args.args: return None
    if not any(ast.unparse(d).startswith('patch') for d in node.decorator_list): return None
    ann = node.args.args[0].annotation
    return ast.unparse(ann) if ann is not None else None

def class_sizes(paths) -> dict:
    "Each class's length in lines, by name, with the methods patched onto it"
    res = {}
    for p in paths:
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef): res[n.name] = res.get(n.name, 0) + n.end_lineno - n.lineno + 1
        for n in tree.body:
            cls = _patched_class(n)
            if cls: res[cls] = res.get(cls, 0) + n.end_lineno - min([n.lineno] + [d.lineno for d in n.decorator_list]) + 1
    return res

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
    sizes = sorted(class_sizes(package).items(), key=lambda kv: -kv[1])
    print("largest classes (lines, patched methods included): " + ', '.join(f"{n} {s}" for n, s in sizes[:4]))
    for name, size in sizes:
        if size > CLASS: bad.append(f"class {name} is {size} lines, over {CLASS}: give one of its concerns a room")
    for name, size in sorted(export_cells(sorted((ROOT / 'nbs').glob('*.ipynb'))).items()):
        if size > CELL: bad.append(f"{name}: an exported cell of {size} lines, over {CELL}: one idea per cell "
                                   "(`python .ci/split_cells.py`, `python .ci/split_classes.py`)")
    for b in bad: print(f"house rule broken: {b}")
    return 1 if bad else 0

if __name__ == '__main__': sys.exit(main())
