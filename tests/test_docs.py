("The getting-started notebook and the README say the same: the README's Quick start and Usage sections, word for "
 "word (its prose in markdown cells, each code block a code cell that runs)")
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
                assert part.strip() in code, ("nbs/index.ipynb has no code cell that is this block of the README's "
                                              f"{title!r} section:\n{part[:300]}")
                continue
            for chunk in re.split(r'\n(?=### )', part):
                assert chunk.strip() in md, (f"nbs/index.ipynb lacks this part of the README's {title!r} "
                                             f"section:\n{chunk[:300]}")
    assert blocks == 3, "the three front ends' usage blocks"

def paragraphs(text):
    "Markdown paragraphs with their line breaks and quote marks evened out, so that wrapping does not count"
    return [' '.join(l.removeprefix('> ').strip() for l in p.split('\n')) for p in re.split(r'\n\s*\n', text.strip()) if p.strip()]

def test_index_opens_with_the_readmes_opening_and_nothing_else():
    ("The opening (what it is, why, when not to use it) is the README's paragraph for paragraph: no paragraph lost, "
     "none doubled or cut")
    readme = (ROOT / 'README.md').read_text()
    nb = json.loads((ROOT / 'nbs' / 'index.ipynb').read_text())
    md = '\n\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown')
    def opening(text): return paragraphs(text.split('\n## Quick start')[0].split('\n', 1)[1])     # after the title
    ours, theirs = opening(md), opening(readme)
    assert len(theirs) >= 2
    extra = [p for p in ours if p not in theirs and not p.startswith('This page is where to start')]
    assert not extra, f"nbs/index.ipynb's opening has paragraphs the README's lacks: {extra}"
    missing = [p for p in theirs if p not in ours]
    assert not missing, f"nbs/index.ipynb's opening lacks the README's paragraphs: {missing}"

def test_index_links_every_chapter():
    "The index's 'Where to go next' links every notebook, so a new chapter cannot be left out of the way in"
    nb = json.loads((ROOT / 'nbs' / 'index.ipynb').read_text())
    nexts = [
        ''.join(
            c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown' and ''.join(c['source']).startswith('## Where to go next')]
    assert len(nexts) == 1
    linked = set(re.findall(r'\]\((\w+)\.ipynb\)', nexts[0]))
    chapters = {p.stem for p in (ROOT / 'nbs').glob('*.ipynb')} - {'index'}
    assert chapters == linked, f"not linked: {sorted(chapters - linked)}; no such notebook: {sorted(linked - chapters)}"

def test_every_python_block_in_the_readme_is_a_cell_that_nbdev_test_runs():
    ("Every ```python block of the README runs as written: it is a code cell of the getting-started notebook, which "
     "`nbdev-test` runs in `make test`")
    readme = (ROOT / 'README.md').read_text()
    nb = json.loads((ROOT / 'nbs' / 'index.ipynb').read_text())
    code = [
        ''.join(
            c['source']).strip() for c in nb['cells'] if c['cell_type'] == 'code' and not ''.join(c['source']).lstrip().startswith('#|')]
    for block in re.findall(r'```python\n(.*?)```', readme, re.S):
        assert block.strip() in code, f"this README block is not run by any test:\n{block[:300]}"

def test_the_user_chapters_keep_their_outputs():
    # every chapter: the docs show what its lessons printed
    for p in sorted((ROOT / 'nbs').glob('*.ipynb')):
        cells = [c for c in json.loads(p.read_text())['cells'] if c['cell_type'] == 'code' and not ''.join(c['source']).lstrip().startswith('#|')]
        shown = [c for c in cells if c.get('outputs')]
        assert shown or not cells, (f"{p.name}: no code cell keeps its output; run .ci/run_notebooks.py "
                                    f"{p.relative_to(ROOT)}")

def test_the_docs_site_builds_offline_with_working_links(tmp_path):
    ("`make docs`: every notebook and Markdown page to HTML, and every relative link between them resolves (the "
     "builder exits otherwise)")
    import shutil, subprocess, sys
    # then also as a reader sees it
    browser = any(shutil.which(b) for b in ('chromium', 'chromium-browser', 'google-chrome'))
    r = subprocess.run([sys.executable, str(ROOT / '.ci' / 'build_docs.py'),
                        str(tmp_path)] + ['--screenshots'] * browser,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    pages = {p.name for p in tmp_path.glob('*.html')}
    assert {'index.html', 'readme.html', '01_recipes.html', 'design.html', 'results.html',
            'contributing.html'} <= pages, pages
    index = (tmp_path / 'index.html').read_text()
    assert 'href="01_recipes.html"' in index and 'to_fp16' in index
    assert "jp-InputArea-prompt\">In [" not in index, "execution prompts (all empty) beside the kept outputs"
    if browser: check_screenshots(tmp_path / 'screenshots')

def check_screenshots(folder):
    ("Headless Chromium's PNGs of the index and a recipe page: full-size, and a rendered page (text, code, a plot), "
     "not a blank or an error page")
    from PIL import Image
    for name in ('index.png', '01_recipes.png'):
        img = Image.open(folder / name).convert('RGB')
        assert img.size == (1280, 2400), (name, img.size)
        colours = img.getcolors(1 << 20)
        assert colours is None or len(colours) > 200, f"{name}: {len(colours)} colours, a blank or plain page"
        white = max(colours or [(0, None)])[0] / (img.size[0] * img.size[1])
        assert white < 0.97, f"{name}: {white:.0%} one colour"
