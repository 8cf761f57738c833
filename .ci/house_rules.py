"""The house rules that `make test` checks, measured as objects:

- no object over 250 lines: a class counted with every base class of the package's it builds on, and with any
  method a `@patch` adds to it (a class of ours gets none: `@patch` is for classes we do not own, fastai's `Learner`);
- no exported notebook cell over 100 lines: a cell ends where an idea ends;
- lines of at most 120 characters, under 2% of the package's lines over it, and of the tests'.

    python .ci/house_rules.py          # prints the sizes, exits 1 on a breach
"""
import ast, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE, SHARE, OBJECT, CELL = 120, 0.02, 250, 100

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

def classes(paths) -> dict:
    "name -> (its own lines, the names of its bases, lines @patch adds to it), over the package's modules"
    res, patched = {}, {}
    for p in paths:
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                res[n.name] = (n.end_lineno - n.lineno + 1, [ast.unparse(b).split('.')[-1] for b in n.bases])
        for n in tree.body:
            cls = _patched_class(n)
            if cls:
                start = min([n.lineno] + [d.lineno for d in n.decorator_list])
                patched[cls] = patched.get(cls, 0) + n.end_lineno - start + 1
    return {k: (own, bases, patched.get(k, 0)) for k, (own, bases) in res.items()} | {
        k: (0, [], v) for k, v in patched.items() if k not in res}

def object_size(name:str, table:dict, seen=None) -> int:
    "A class's lines with its package bases' (each once) and the methods patched onto it"
    seen = set() if seen is None else seen
    if name in seen or name not in table: return 0
    seen.add(name)
    own, bases, patched = table[name]
    return own + patched + sum(object_size(b, table, seen) for b in bases)

def export_cells(nbs) -> dict:
    "The longest exported cell of each notebook, in lines"
    res = {}
    for nb in nbs:
        cells = [c for c in json.loads(nb.read_text())['cells']
                 if c['cell_type'] == 'code' and ''.join(c['source']).startswith('#|export')]
        if cells: res[nb.name] = max(len(''.join(c['source']).splitlines()) for c in cells)
    return res

def main() -> int:
    package = [p for p in sorted((ROOT / 'mixedprec').glob('*.py')) if p.name != '_modidx.py']
    tests = sorted((ROOT / 'tests').glob('*.py'))
    bad = []
    for what, paths in (('package', package), ('tests', tests)):
        n, total = long_share(paths)
        print(f"{what}: {n} of {total} lines over {LINE} characters ({n / total:.1%}; at most {SHARE:.0%})")
        if n > SHARE * total: bad.append(f"{what}: {n / total:.1%} of its lines are over {LINE} characters")
    table = classes(package)
    sizes = sorted(((object_size(k, table), k) for k in table), reverse=True)
    print("largest objects (a class with its package bases and patched methods): " +
          ', '.join(f"{k} {s}" for s, k in sizes[:5]))
    for size, name in sizes:
        if size > OBJECT: bad.append(f"{name} is {size} lines as an object, over {OBJECT}: split it into smaller objects")
    for name, (own, bases, patched) in table.items():
        if own and patched: bad.append(f"class {name} gets {patched} lines of `@patch` methods: write them in its body")
    for name, size in sorted(export_cells(sorted((ROOT / 'nbs').glob('*.ipynb'))).items()):
        if size > CELL: bad.append(f"{name}: an exported cell of {size} lines, over {CELL}: one idea per cell")
    for b in bad: print(f"house rule broken: {b}")
    return 1 if bad else 0

if __name__ == '__main__': sys.exit(main())
