"The getting-started notebook and the README say the same: the README's Quick start and Usage sections, word for word (its prose in markdown cells, each code block a code cell that runs)"
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
    code = [''.join(c['source']).strip() for c in nb['cells'] if c['cell_type'] == 'code']
    blocks = 0
    for title in ('Quick start', 'Usage'):
        for i, part in enumerate(re.split(r'```python\n(.*?)```', section(readme, title), flags=re.S)):
            if i % 2:
                blocks += 1
                assert part.strip() in code, f"nbs/index.ipynb has no code cell that is this block of the README's {title!r} section:\n{part[:300]}"
                continue
            for chunk in re.split(r'\n(?=### )', part):
                assert chunk.strip() in md, f"nbs/index.ipynb lacks this part of the README's {title!r} section:\n{chunk[:300]}"
    assert blocks == 3, "the three front ends' usage blocks"

def test_every_python_block_in_the_readme_is_a_cell_that_nbdev_test_runs():
    "Every ```python block of the README runs as written: it is a code cell of the getting-started notebook, which `nbdev-test` runs in `make test`"
    readme = (ROOT / 'README.md').read_text()
    nb = json.loads((ROOT / 'nbs' / 'index.ipynb').read_text())
    code = [''.join(c['source']).strip() for c in nb['cells'] if c['cell_type'] == 'code' and not ''.join(c['source']).lstrip().startswith('#|')]
    for block in re.findall(r'```python\n(.*?)```', readme, re.S):
        assert block.strip() in code, f"this README block is not run by any test:\n{block[:300]}"

def test_the_user_chapters_keep_their_outputs():
    for p in sorted((ROOT / 'nbs').glob('*.ipynb')):                  # every chapter: the docs show what its lessons printed
        cells = [c for c in json.loads(p.read_text())['cells'] if c['cell_type'] == 'code' and not ''.join(c['source']).lstrip().startswith('#|')]
        shown = [c for c in cells if c.get('outputs')]
        assert shown or not cells, f"{p.name}: no code cell keeps its output; run .ci/run_notebooks.py {p.relative_to(ROOT)}"

def test_the_docs_site_builds_offline_with_working_links(tmp_path):
    "`make docs`: every notebook and Markdown page to HTML, and every relative link between them resolves (the builder exits otherwise)"
    import subprocess, sys
    r = subprocess.run([sys.executable, str(ROOT / '.ci' / 'build_docs.py'), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    pages = {p.name for p in tmp_path.glob('*.html')}
    assert {'index.html', 'readme.html', '01_recipes.html', 'design.html', 'results.html', 'contributing.html'} <= pages, pages
    index = (tmp_path / 'index.html').read_text()
    assert 'href="01_recipes.html"' in index and 'to_fp16' in index
