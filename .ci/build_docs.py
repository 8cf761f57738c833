"""Build the docs site offline: each notebook (with its kept outputs, not run again) and the Markdown pages to HTML, with
links between them, then check that every relative link points at a page or file that exists.
Usage: python .ci/build_docs.py OUT_FOLDER [--screenshots]   (what `make docs` runs; open OUT_FOLDER/index.html)
--screenshots: also look at the site as a reader would, with headless Chromium from the system packages: the index and
one recipe page as PNGs in OUT_FOLDER/screenshots/ (`make screenshots`)."""
import copy, html, json, re, shutil, subprocess, sys
from pathlib import Path
import markdown
import nbformat
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
PAGES = {'README.md': 'readme.html', 'CONTRIBUTING.md': 'contributing.html', 'CHANGELOG.md': 'changelog.html',
         'nbs/DESIGN.md': 'design.html', 'bench/RESULTS.md': 'results.html'}
FILES = {'LICENSE': 'LICENSE.txt'}                       # copied as they are

def page_of(path:str) -> str:
    "The HTML page a repository path becomes, or None"
    path = path.removeprefix('./')
    if path in PAGES: return PAGES[path]
    if path in FILES: return FILES[path]
    m = re.fullmatch(r'(?:nbs/)?(\w+)\.ipynb', path)
    return f"{m.group(1)}.html" if m else None

def relink(text:str, base:str='') -> str:
    "Markdown `[..](path)` links to repository files turned into links to their pages; code spans naming a notebook or page become links too"
    def link(m):
        target = page_of((base + m.group(2)).replace('nbs/../', '')) or page_of(m.group(2))
        return f"[{m.group(1)}]({target})" if target else m.group(0)
    text = re.sub(r'\[([^\]]+)\]\(([^)#:]+)\)', link, text)
    def span(m):
        target = page_of(m.group(1))
        return f"[`{m.group(1)}`]({target})" if target else m.group(0)
    return re.sub(r'(?<!\[)`((?:nbs/)?\w+\.ipynb|README\.md|CONTRIBUTING\.md|CHANGELOG\.md|nbs/DESIGN\.md|bench/RESULTS\.md|LICENSE)`(?!\])', span, text)

def nav(pages:list) -> str:
    "The bar of links at the top of every page"
    return '<nav style="font:14px sans-serif;padding:8px;border-bottom:1px solid #ccc">' + ' · '.join(
        f'<a href="{href}">{html.escape(title)}</a>' for href, title in pages) + '</nav>'

def notebook_html(path:Path, exporter:HTMLExporter) -> tuple:
    "A notebook as HTML (its title, the page): `#|hide` cells dropped, nbdev's directive lines removed, links to other pages"
    nb = nbformat.read(path, as_version=4)
    cells = []
    for c in nb.cells:
        src = c.source
        if c.cell_type == 'code' and re.match(r'\s*#\|\s*hide', src): continue
        if c.cell_type == 'code' and re.match(r'\s*#\|\s*default_exp', src): continue
        c = copy.deepcopy(c)
        if c.cell_type == 'code': c.source = '\n'.join(l for l in src.split('\n') if not l.lstrip().startswith('#|'))
        else: c.source = relink(src, 'nbs/')
        cells.append(c)
    nb.cells = cells
    nb.metadata['language_info'] = {'name': 'python', 'pygments_lexer': 'python3'}   # plain Python highlighting: no IPython needed
    title = next((re.match(r'#\s+(.*)', c.source).group(1) for c in cells if c.cell_type == 'markdown' and re.match(r'#\s+', c.source)), path.stem)
    body, _ = exporter.from_notebook_node(nb, resources={'metadata': {'name': title}})
    return title, body

def markdown_html(path:Path, title:str) -> str:
    "A Markdown file as a page"
    base = str(path.parent.relative_to(ROOT)) + '/' if path.parent != ROOT else ''
    body = markdown.markdown(relink(path.read_text(), base), extensions=['tables', 'fenced_code'])
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            '<style>body{max-width:980px;margin:auto;font:15px/1.5 sans-serif;padding:0 16px} pre{background:#f6f8fa;padding:8px;overflow:auto}'
            'code{background:#f6f8fa} table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:2px 6px}</style>'
            f'</head><body>{body}</body></html>')

# Long code lines scroll instead of being cut off at the page's edge
WIDE_CODE = '<style>.jp-InputArea-editor, .jp-OutputArea-output pre, .highlight pre {overflow-x:auto}</style>'

def add_nav(page:str, bar:str) -> str:
    page = page.replace('</head>', WIDE_CODE + '</head>', 1)
    return re.sub(r'(<body[^>]*>)', lambda m: m.group(1) + bar, page, count=1)

SCREENSHOT_PAGES = ('index.html', '01_recipes.html')
BROWSERS = ('chromium', 'chromium-browser', 'google-chrome')

def screenshots(out:Path, pages=SCREENSHOT_PAGES, size=(1280, 2400)) -> list:
    "PNGs of `pages` as headless Chromium renders them, in out/screenshots/"
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None: sys.exit(f"--screenshots needs Chromium ({' or '.join(BROWSERS)} on the PATH): install it from the system packages, "
                                 "for example `apt-get install chromium`")
    (out / 'screenshots').mkdir(exist_ok=True)
    shots = []
    for page in pages:
        png = out / 'screenshots' / page.replace('.html', '.png')
        png.unlink(missing_ok=True)
        subprocess.run([browser, '--headless', '--no-sandbox', '--disable-gpu', '--hide-scrollbars', f'--screenshot={png}',
                        f'--window-size={size[0]},{size[1]}', (out / page).as_uri()], capture_output=True, timeout=120)
        if not png.exists(): sys.exit(f"{browser} wrote no screenshot of {page}")
        shots.append(png)
    return shots

def check_links(out:Path) -> list:
    "Relative links in the built pages whose target does not exist"
    bad = []
    for f in sorted(out.glob('*.html')):
        for href in re.findall(r'href="([^"#]+)(?:#[^"]*)?"', f.read_text()):
            if re.match(r'[a-z]+:|//', href): continue
            if not (out / href).exists(): bad.append(f"{f.name} -> {href}")
    return bad

def main(out:str='_docs', *flags):
    out = (ROOT / out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name='lab', exclude_input_prompt=True, exclude_output_prompt=True)   # no "In [ ]:" beside kept outputs
    built = {}
    for nb in sorted((ROOT / 'nbs').glob('*.ipynb')):
        title, body = notebook_html(nb, exporter)
        built[page_of(f'nbs/{nb.name}')] = (nb.stem if nb.stem != 'index' else 'mixedprec', body)
    for src, page in PAGES.items():
        title = src.split('/')[-1].removesuffix('.md').title()
        built[page] = (title, markdown_html(ROOT / src, title))
    for src, dst in FILES.items(): (out / dst).write_text((ROOT / src).read_text())
    order = ['index.html', 'readme.html'] + sorted(p for p in built if p not in ('index.html', 'readme.html') and not p.endswith('.md'))
    bar = nav([(p, built[p][0]) for p in order])
    for page, (_, body) in built.items(): (out / page).write_text(add_nav(body, bar))
    bad = check_links(out)
    if bad: sys.exit("broken links in the docs:\n  " + "\n  ".join(bad))
    print(f"docs: {len(built)} pages in {out}, every link resolves; open {out / 'index.html'}")
    if '--screenshots' in flags:
        print("screenshots, as headless Chromium shows the pages:", ', '.join(str(p) for p in screenshots(out)))

if __name__ == '__main__': main(*sys.argv[1:])
