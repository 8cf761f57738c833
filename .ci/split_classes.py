"""Split exported notebook cells that hold a class too long for one cell (over 100 lines): the class keeps its
attributes, `__init__` and its first methods; each later method moves, in order, into cells that follow it, as a
function added to the class with fastcore's `@patch` (as fastai's notebooks do). Methods that cannot live outside the
class body stay in it: static methods, zero-argument `super()`, property setters. Outputs and markdown are untouched.

    python .ci/split_classes.py nbs/14_engine.ipynb [...]
"""
import ast, os, re, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import split_cells

CELL, KEEP = 100, 90
STAY = {'__init__', '__new__', '__init_subclass__', '__torch_dispatch__', '__torch_function__', '__class_getitem__'}

def _first_line(node, lines) -> int:
    "0-based first line of `node` with its decorators and the comments right above it"
    first = min([node.lineno] + [d.lineno for d in getattr(node, 'decorator_list', [])]) - 1
    while first > 0 and lines[first - 1].lstrip().startswith('#') and not lines[first - 1].startswith('#|'): first -= 1
    return first

def _movable(node) -> bool:
    "True when method `node` can be a patched function"
    if not isinstance(node, ast.FunctionDef) or node.name in STAY or not node.args.args: return False
    names = [ast.unparse(d) for d in node.decorator_list]
    if any(n == 'staticmethod' or n.endswith('.setter') or n.endswith('.deleter') for n in names): return False
    return not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == 'super' and not n.args
                   for n in ast.walk(node))

def _patched(node, lines, cls:str, start:int) -> str:
    "The source of method `node` (its lines from `start`) as a module-level function patched onto `cls`"
    src = [l[4:] if l.startswith('    ') else l for l in lines[start:node.end_lineno]]
    out, deco = [], [ast.unparse(d) for d in node.decorator_list]
    how = '@patch(cls_method=True)' if 'classmethod' in deco else '@patch(as_prop=True)' if 'property' in deco else '@patch'
    placed = False
    for l in src:
        s = l.strip()
        if s in ('@classmethod', '@property'): continue
        if not placed and (s.startswith('@') or s.startswith('def ')): out.append(how); placed = True
        if s.startswith(f'def {node.name}('):
            first = node.args.args[0].arg
            l = re.sub(rf'def {node.name}\({first}\b(?!:)', f'def {node.name}({first}:{cls}', l, count=1)
        out.append(l)
    return '\n'.join(out).rstrip('\n')

def split_source(src:str) -> list:
    "The sources of the cells that exported cell `src` becomes (one, when it holds no class over the limit)"
    lines = src.split('\n')
    if len(lines) <= CELL: return [src]
    head, body = lines[0], lines[1:]
    tree = ast.parse('\n'.join(body))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > KEEP]
    if not classes: return [src]
    node = classes[0]
    cstart = _first_line(node, body)
    moved, used = [], node.body[0].end_lineno - cstart      # the class line and docstring
    # a method that a statement of the class body names (`on_train_begin = before_fit`) stays with it
    named = {n.id for st in node.body if not isinstance(st, ast.FunctionDef) for n in ast.walk(st) if isinstance(n, ast.Name)}
    for i, st in enumerate(node.body):
        size = st.end_lineno - (node.body[i - 1].end_lineno if i else cstart)
        if i == 0 or not _movable(st) or getattr(st, 'name', None) in named or (not moved and used + size <= KEEP): used += size if i else 0
        else: moved.append(st)
    # the class as kept: every line of the class up to its end, minus the moved methods' lines
    gone = set()
    for st in moved: gone |= set(range(_first_line(st, body), st.end_lineno))
    cls_lines = [l for j, l in enumerate(body[cstart:node.end_lineno], start=cstart) if j not in gone]
    while cls_lines and not cls_lines[-1].strip(): cls_lines.pop()
    first_part = '\n'.join(body[:cstart] + cls_lines).strip('\n')
    pieces, chunk = [first_part], []
    for st in moved:
        fn = _patched(st, body, node.name, _first_line(st, body))
        if chunk and 1 + len('\n\n'.join(chunk + [fn]).split('\n')) > CELL: pieces.append('\n\n'.join(chunk)); chunk = []
        chunk.append(fn)
    if chunk: pieces.append('\n\n'.join(chunk))
    rest = '\n'.join(body[node.end_lineno:]).strip('\n')
    if rest: pieces.append(rest)
    return [f"{head}\n{p}" for p in pieces]

def split_notebook(path) -> int:
    "Split the long class cells of the notebook at `path` in place; the number of cells added"
    return split_cells.split_notebook(path, split_source)

if __name__ == '__main__':
    for p in sys.argv[1:]: print(f"{p}: {split_notebook(p)} cells added")
