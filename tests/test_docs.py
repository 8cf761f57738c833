"The getting-started notebook and the README say the same: the README's Quick start and Usage sections, word for word"
import json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def section(text, title):
    m = re.search(rf'^## {re.escape(title)}\n(.*?)(?=^## )', text, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1).strip()

def test_index_holds_the_readmes_quick_start_and_usage():
    readme = (ROOT / 'README.md').read_text()
    nb = json.loads((ROOT / 'nbs' / 'index.ipynb').read_text())
    md = '\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown')
    for title in ('Quick start', 'Usage'):
        for part in re.split(r'\n(?=### )', section(readme, title)):
            assert part.strip() in md, f"nbs/index.ipynb lacks this part of the README's {title!r} section:\n{part[:300]}"

def test_the_user_chapters_keep_their_outputs():
    for p in [ROOT / 'nbs' / f for f in ('index.ipynb', '01_recipes.ipynb', '02_when_things_go_wrong.ipynb', '03_bf16_masters.ipynb')]:
        cells = [c for c in json.loads(p.read_text())['cells'] if c['cell_type'] == 'code' and not ''.join(c['source']).lstrip().startswith('#|')]
        shown = [c for c in cells if c.get('outputs')]
        assert shown or not cells, f"{p.name}: no code cell keeps its output; run .ci/run_notebooks.py {p.relative_to(ROOT)}"
