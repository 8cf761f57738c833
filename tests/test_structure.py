"""The shape the design promises (issue 59): the front ends call only the step engine's verbs, and the core engine
knows nothing of fastai"""
import ast, re
from pathlib import Path

PKG = Path(__file__).parent.parent / 'mixedprec'
FRONT_ENDS = ('callback.py', 'fp16_optimizer.py', 'amp.py', 'demo.py')
INSIDE = ('held', 'runner', 'progress', 'masters', 'stage', 'optimizer', 'amp', 'plan')

def engine_reaches(path) -> list:
    "`<engine>.<inside>` in `path`, where <engine> is a name or attribute called `engine`, `e` or `engines[...]`"
    src = path.read_text()
    pat = re.compile(r"\b(?:engine|e|engines\[\w+\])\.(" + '|'.join(INSIDE) + r")\b")
    return [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(src.splitlines(), 1)
            if pat.search(line) and not line.lstrip().startswith('#')]

def test_the_front_ends_reach_nothing_inside_the_engine():
    reaches = [r for f in FRONT_ENDS for r in engine_reaches(PKG / f)]
    assert not reaches, "\n".join(reaches)

def test_the_core_engine_imports_neither_fastai_nor_fastcore():
    tree = ast.parse((PKG / 'engine.py').read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or '' for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split('.')[0] in ('fastai', 'fastcore')], names
