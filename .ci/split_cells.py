"""Split exported notebook cells over 100 lines at their top-level statements (a def, a class, an assignment, with the
comments above it), into cells of at most 100 lines each where the statements allow it. A class stays whole, in a cell
of its own when it is long. Outputs and markdown are untouched.

    python .ci/split_cells.py nbs/13_master.ipynb [...]
"""
import ast, json, sys, uuid

CELL = 100

def _starts(src:str) -> list:
    "The 0-based line where each top-level statement starts, with its decorators and the comments right above it"
    lines, tree = src.split('\n'), ast.parse(src)
    starts = []
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, 'decorator_list', [])]) - 1
        while first > 0 and lines[first - 1].lstrip().startswith('#') and not lines[first - 1].startswith('#|'): first -= 1
        starts.append(first)
    return starts

def split_source(src:str) -> list:
    "The sources of the cells `src` (an exported cell, its first line `#|export`) becomes"
    lines = src.split('\n')
    if len(lines) <= CELL: return [src]
    head, blines = lines[0], lines[1:]
    bounds = sorted(set(_starts('\n'.join(blines))) | {0}) + [len(blines)]
    pieces, chunk = [], 0
    for s, e in zip(bounds, bounds[1:]):                  # statement [s, e): close the chunk before it if it would overflow
        if s > chunk and e - chunk > CELL:
            pieces.append('\n'.join(blines[chunk:s]).strip('\n')); chunk = s
    pieces.append('\n'.join(blines[chunk:]).strip('\n'))
    return [f"{head}\n{p}" for p in pieces if p]

def split_notebook(path, split=None) -> int:
    ("Split the long exported cells of the notebook at `path` in place, by `split` (a cell's source -> the sources of "
     "its parts; default: at its top-level statements); the number of cells added")
    split = split or split_source
    nb = json.load(open(path))
    cells, added = [], 0
    for c in nb['cells']:
        src = ''.join(c['source'])
        if c['cell_type'] != 'code' or not src.startswith('#|export') or len(src.split('\n')) <= CELL: cells.append(c); continue
        parts = split(src)
        for i, p in enumerate(parts):
            new = dict(c) if i == 0 else {'cell_type': 'code', 'execution_count': None, 'id': uuid.uuid4().hex[:8], 'metadata': {}, 'outputs': []}
            new['source'] = p.splitlines(keepends=True)
            if i < len(parts) - 1 and i == 0: new['outputs'] = []
            cells.append(new)
        added += len(parts) - 1
    if added:
        nb['cells'] = cells
        with open(path, 'w') as f: json.dump(nb, f, indent=1, ensure_ascii=False); f.write('\n')
    return added

if __name__ == '__main__':
    for p in sys.argv[1:]: print(f"{p}: {split_notebook(p)} cells added")
