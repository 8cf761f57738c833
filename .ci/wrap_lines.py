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
    if LIMIT - col - len(prefix) - over < 40: return None       # too far right: the code is broken first, then the string
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

_COMPOUND = {'def', 'class', 'if', 'elif', 'else', 'for', 'while', 'with', 'try', 'except', 'finally', 'async'}

def _row_tokens(toks, row):
    "The tokens that start on `row`, with the depth of brackets each starts at"
    depth, res = 0, []
    for t in toks:
        if t.start[0] == row: res.append((t, depth))
        if t.type == tokenize.OP and t.string in '([{': depth += 1
        elif t.type == tokenize.OP and t.string in ')]}': depth -= 1
        if t.start[0] > row: break
    return res

def _to_block(line:str, row_toks) -> list:
    "A one-line compound statement (`def f(): \"doc\"; return x`) as a header and a block, or None"
    code = [(t, d) for t, d in row_toks if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
    if not code or code[0][0].string not in _COMPOUND or code[0][1] != 0: return None
    colon = next((t for t, d in code if d == 0 and t.type == tokenize.OP and t.string == ':'), None)
    if colon is None: return None
    after = [t for t, d in code if t.start[1] >= colon.end[1]]
    if not after or after[0].type == tokenize.COMMENT: return None
    cuts = [colon.end[1]] + [t.end[1] for t, d in code if d == 0 and t.type == tokenize.OP and t.string == ';'] + [len(line)]
    indent = len(line) - len(line.lstrip()) + 4
    body = [line[x:y].strip().rstrip(';').strip() for x, y in zip(cuts, cuts[1:])]
    return [line[:colon.end[1]]] + [' ' * indent + b for b in body if b]

def _code_break(src:str, blocks_only:bool=False):
    "`src` with its first code line over the limit broken once: a one-line compound statement made a block, else a break inside brackets (after the last comma that fits, after an open bracket, or before an operator), or None"
    try: toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError): return None
    lines = src.split('\n')
    strings = {t.start[0] for t in toks if t.type == tokenize.STRING and t.start[0] != t.end[0]}
    for row, line in enumerate(lines, 1):
        if len(line) <= LIMIT or row in strings: continue
        rt = _row_tokens(toks, row)
        block = _to_block(line, rt)
        if block is not None and len(block) > 1: return '\n'.join(lines[:row - 1] + block + lines[row:])
        if blocks_only: continue
        indent = len(line) - len(line.lstrip())
        opens, commas, hangs, ops = [], [], [], []
        for i, (t, d) in enumerate(rt):
            nxt = rt[i + 1][0] if i + 1 < len(rt) else None
            last = nxt is None or nxt.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)
            if t.type == tokenize.OP and t.string in '([{':
                opens.append(t)
                if not last and t.end[1] <= LIMIT - 2: hangs.append(t.end[1])
            elif t.type == tokenize.OP and t.string in ')]}':
                if opens: opens.pop()
            elif t.type == tokenize.OP and t.string == ',' and not last and t.end[1] <= LIMIT - 2 and (opens or d > 0):
                commas.append((t.end[1], opens[-1].end[1] if opens else indent + 4))
            elif (t.string in ('+', '-', '*', '|', '&', 'and', 'or', 'if', 'else', 'for') and (opens or d > 0)
                  and indent + 4 < t.start[1] <= LIMIT - 2):
                ops.append(t.start[1])
        fits = [(c, al) for c, al in commas if al <= 70 and al + len(line) - c <= LIMIT or al <= 70 and c == max(x for x, _ in commas)]
        if fits: cut, al = fits[-1]
        elif hangs: cut, al = hangs[0], indent + 4
        elif ops: cut, al = ops[-1], indent + 4
        else: continue
        head, tail = line[:cut].rstrip(), line[cut:].lstrip()
        if not tail or len(head) <= al: continue
        return '\n'.join(lines[:row - 1] + [head, ' ' * al + tail] + lines[row:])
    return None

def _repeat(src:str, step) -> str:
    "`step` applied to `src` while it changes it, compiles, and adds no long line"
    for _ in range(5000):
        new = step(src)
        if new is None or new == src: break
        try: compile(new, '<wrapped>', 'exec')
        except SyntaxError: break
        if long_lines(new) > long_lines(src): break
        src = new
    return src

def _stairs(lines) -> set:
    "Lines where a break made stairs: a bracket opened at the end of a deep continuation line, a call split before its first argument, a comprehension's target split at its comma"
    bad = set()
    for i in range(1, len(lines) - 1):       # a continuation line that opens a bracket at its end: stairs
        prev, a = lines[i - 1].rstrip(), lines[i].rstrip()
        if re.search(r'[\w\]\)][(\[]$', a) and prev.endswith((',', '(', 'or', 'and')) and len(a) - len(a.lstrip()) > 20: bad.add(i)
    for i in range(len(lines) - 1):
        a, b = lines[i].rstrip(), lines[i + 1].lstrip()
        if re.search(r'\w\($', a) and (b.startswith(')') or re.match(r'[\w.]+\($', b.rstrip()) or len(b) < 8): bad.add(i)
        if re.search(r'\bfor [\w]+,$', a): bad.add(i)
        if re.search(r'[\w\]]\[$', a) and len(b) < 12: bad.add(i)
    return bad
def unstair(src:str) -> str:
    "`src` with the statements that `_stairs` finds joined back into one line each (a long line reads better than stairs)"
    try: toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except Exception: return src
    lines = src.split('\n')
    bad = _stairs(lines)
    if not bad: return src
    spans, start = [], None       # logical lines: (first row, last row), 1-based
    for t in toks:
        if start is None and t.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER): start = t.start[0]
        if t.type == tokenize.NEWLINE and start is not None: spans.append((start, t.start[0])); start = None
    for a, b in reversed(spans):
        if a == b or not any(a - 1 <= i < b - 1 for i in bad): continue
        seg = lines[a - 1:b]
        if any('#' in l.split('"')[0].split("'")[0] for l in seg[:-1]): continue     # a comment inside: leave it
        joined = seg[0].rstrip()
        for l in seg[1:]:
            l = l.strip()
            joined += ('' if joined[-1] in '([{' or l[:1] in ')]}' else ' ') + l
        new = lines[:a - 1] + [joined] + lines[b:]
        try: compile('\n'.join(new), '<x>', 'exec')
        except SyntaxError: continue
        lines = new
    return '\n'.join(lines)
def wrap_all(src:str) -> str:
    "`src` within the limit as far as mechanical rewrites go: one-line compound statements over it made blocks, then strings and comments wrapped, then code broken inside brackets"
    try: compile(src, '<original>', 'exec')
    except SyntaxError: return src
    src = _repeat(src, lambda s: _code_break(s, blocks_only=True))
    src = _repeat(wrap_source(src), _code_break)
    return unstair(_repeat(wrap_source(src), _code_break))

def wrap_notebook(path) -> bool:
    "Wrap the code cells of the notebook at `path` in place; True if it changed"
    nb = json.load(open(path))
    changed = False
    for c in nb['cells']:
        if c['cell_type'] != 'code': continue
        src = ''.join(c['source'])
        new = wrap_all(src)
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
                if any(wrap_all(''.join(c['source'])) != ''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code'): changed.append(path)
            elif wrap_notebook(path): changed.append(path)
        else:
            src = open(path).read(); new = wrap_all(src)
            if new != src:
                changed.append(path)
                if not check: open(path, 'w').write(new)
    print(('would change: ' if check else 'changed: ') + (', '.join(changed) or 'nothing'))
    sys.exit(1 if check and changed else 0)
