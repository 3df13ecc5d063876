#!/usr/bin/env python3
"""The lengths of the product functions of the Rust sources under the given
folders: lines from `fn` to its closing brace. Comments, strings (escaped
quotes and raw strings too) and character literals are skipped when
matching braces; tests are left out (`#[cfg(test)]` modules and
`#[test]`/`#[tokio::test]` functions). Prints the longest (`TOP=N`,
default 10), then how many are over 100 lines and the median.

    scripts/fn-lengths.py crates/*/src
"""
import os, re, sys

FN = re.compile(r'\b(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+"[^"]*"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)')


def blank(text):
    """`text` with comments, strings and char literals replaced by spaces
    (newlines kept), so braces and lines can be counted."""
    out = list(text)
    i, n = 0, len(text)

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != '\n':
                out[k] = ' '

    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith('/*', i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith('/*', j):
                    depth, j = depth + 1, j + 2
                elif text.startswith('*/', j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif c == 'r' and re.match(r'r(#*)"', text[i:i + 40]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == '_')):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            wipe(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == '\\' else 1
            wipe(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1f}'), not a lifetime ('a).
            m = re.match(r"'(\\(u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'", text[i:i + 12])
            if m:
                wipe(i, i + m.end())
                i += m.end()
            else:
                i += 1
        else:
            i += 1
    return ''.join(out)


def close_of(clean, start):
    """Index of the brace closing the one at `start`."""
    depth = 0
    for k in range(start, len(clean)):
        if clean[k] == '{':
            depth += 1
        elif clean[k] == '}':
            depth -= 1
            if depth == 0:
                return k
    return len(clean) - 1


def functions(path):
    text = open(path, encoding='utf8', errors='replace').read()
    clean = blank(text)
    # Spans of test code: a `#[cfg(test)]` item, a `#[test]` function.
    tests = []
    for m in re.finditer(r'#\[(cfg\(test\)|test|tokio::test[^\]]*)\]', clean):
        b = clean.find('{', m.end())
        semi = clean.find(';', m.end())
        if b >= 0 and (semi < 0 or b < semi):
            tests.append((m.start(), close_of(clean, b)))
    line_of = lambda k: clean.count('\n', 0, k) + 1
    for m in FN.finditer(clean):
        if any(a <= m.start() <= b for a, b in tests):
            continue
        b = clean.find('{', m.end())
        semi = clean.find(';', m.end())
        if b < 0 or (0 <= semi < b):
            continue  # a declaration without a body
        end = close_of(clean, b)
        yield line_of(end) - line_of(m.start()) + 1, path, line_of(m.start()), m.group(1)


def main():
    res = []
    for root in sys.argv[1:]:
        for dp, _, fs in os.walk(root):
            if 'target' in dp or '/fuzz' in dp:
                continue
            for f in fs:
                if f.endswith('.rs'):
                    res.extend(functions(os.path.join(dp, f)))
    res.sort(reverse=True)
    for n, p, l, name in res[:int(os.environ.get('TOP', '10'))]:
        print(f"{n:5d}  {name}  {p}:{l}")
    lengths = sorted(r[0] for r in res)
    if lengths:
        print(f"{len(lengths)} functions; {sum(1 for x in lengths if x > 100)} over 100 lines; "
              f"median {lengths[len(lengths) // 2]} lines")


if __name__ == '__main__':
    main()
