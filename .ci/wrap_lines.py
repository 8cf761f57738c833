"""Wrap lines over the house limit (120 characters) in the notebooks' code cells and in Python files, where it is safe
to do so mechanically: a string literal is split into implicitly concatenated pieces at spaces (outside an f-string's
braces; parenthesised where it is not inside brackets already), a comment is wrapped onto lines of its own above its
code. Code itself is left as it is: the report lists what remains.

    python .ci/wrap_lines.py nbs/*.ipynb tests/*.py [--check]

`--check`: change nothing; exit 1 and list the files that would change.
"""
import io, json, re, sys, textwrap, tokenize

LIMIT = 120

def _split_body(body:str, is_f:bool, first:int, rest:int) -> list:
    "Pieces of a string literal's body, each ending with a space where split: the first at most `first` long, the others `rest`"
    spots, depth, i = [], 0, 0
    while i < len(body):
        c = body[i]
        if is_f and body.startswith(('{{', '}}'), i): i += 2; continue
        if is_f and c == '{': depth += 1
        elif is_f and c == '}': depth -= 1
        elif c == '\\': i += 2; continue
        elif c == ' ' and depth == 0: spots.append(i + 1)          # split after the space
        i += 1
    pieces, start, width = [], 0, first
    while len(body) - start > width:
        cut = max((s for s in spots if start < s <= start + width), default=None)
        if cut is None: break
        pieces.append(body[start:cut]); start, width = cut, rest
    pieces.append(body[start:])
    return pieces if len(pieces) > 1 else None

def _string_fix(tok, depth:int):
    "The replacement text of a one-line string token that runs past the limit, or None"
    m = re.match(r"([rRbBfFuU]*)('|\")", tok.string)
    if not m or tok.string.startswith(m.group(0) * 3) or tok.start[0] != tok.end[0]: return None
    prefix, q = m.group(1), m.group(2)
    body = tok.string[len(prefix) + 1:-1]
    is_f = 'f' in prefix.lower()
    col = tok.start[1] + (0 if depth else 1)
    over = 4                                                       # room for the quotes, a prefix and a closing bracket
    pieces = _split_body(body, is_f, LIMIT - col - len(prefix) - over, LIMIT - col - len(prefix) - over)
    if pieces is None: return None
    def lit(b):
        p = prefix if not is_f or '{' in b or '}' in b else prefix.replace('f', '').replace('F', '')
        return f"{p}{q}{b}{q}"
    text = ('\n' + ' ' * col).join(lit(b) for b in pieces)
    return text if depth else f"({text})"

def wrap_source(src:str) -> str:
    "`src` with its long string literals split and its long comments wrapped"
    try: toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError): return src
    lines = src.split('\n')
    edits, depth = [], 0
    for t in toks:
        if t.type == tokenize.OP and t.string in '([{': depth += 1
        elif t.type == tokenize.OP and t.string in ')]}': depth -= 1
        elif t.type == tokenize.STRING and t.end[1] > LIMIT and len(lines[t.start[0] - 1]) > LIMIT:
            new = _string_fix(t, depth)
            if new is not None: edits.append((t.start, t.end, new))
        elif t.type == tokenize.COMMENT and t.end[1] > LIMIT and not t.string.startswith('#|'):
            edits.append((t.start, t.end, None))
    for (r0, c0), (r1, c1), new in reversed(edits):
        line = lines[r0 - 1]
        if new is not None: lines[r0 - 1] = line[:c0] + new + line[c1:]; continue
        code, comment = line[:c0].rstrip(), line[c0:].lstrip('#').strip()
        indent = len(line) - len(line.lstrip())
        wrapped = [' ' * indent + '# ' + w for w in textwrap.wrap(comment, LIMIT - indent - 2)]
        lines[r0 - 1:r0] = wrapped + ([code] if code else [])
    out = '\n'.join(lines)
    try: compile(out, '<wrapped>', 'exec')
    except SyntaxError:
        try: compile(src, '<original>', 'exec')
        except SyntaxError: return out                              # (a cell with magics: not Python to begin with)
        return src                                                  # never break what compiled
    return out

def wrap_notebook(path) -> bool:
    "Wrap the code cells of the notebook at `path` in place; True if it changed"
    nb = json.load(open(path))
    changed = False
    for c in nb['cells']:
        if c['cell_type'] != 'code': continue
        src = ''.join(c['source'])
        new = wrap_source(src)
        if new != src: c['source'], changed = new.splitlines(keepends=True), True
    if changed:
        with open(path, 'w') as f: json.dump(nb, f, indent=1, ensure_ascii=False); f.write('\n')
    return changed

def long_lines(text:str) -> int: return sum(len(l) > LIMIT for l in text.splitlines())

if __name__ == '__main__':
    check = '--check' in sys.argv
    changed = []
    for path in [a for a in sys.argv[1:] if a != '--check']:
        if path.endswith('.ipynb'):
            if check:
                nb = json.load(open(path))
                if any(wrap_source(''.join(c['source'])) != ''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code'): changed.append(path)
            elif wrap_notebook(path): changed.append(path)
        else:
            src = open(path).read(); new = wrap_source(src)
            if new != src:
                changed.append(path)
                if not check: open(path, 'w').write(new)
    print(('would change: ' if check else 'changed: ') + (', '.join(changed) or 'nothing'))
    sys.exit(1 if check and changed else 0)
