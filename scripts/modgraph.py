#!/usr/bin/env python3
"""Import cycles between the modules of each crate: which module's code
names which other module (`crate::a::b`, `super::x`, `use` or inline),
and the cycles among them, at two grains: the crate's top-level modules,
and every module (edges between a module and its own parent or child are
left out: a parent naming its children, or a child its parent's items, is
how Rust modules nest). Where the top-level modules have no cycle, their
layers are printed: each module imports only from the layers below it, so
no import runs back up.

    scripts/modgraph.py crates/agent/src [more crate src folders]
"""
import os, re, sys
from collections import defaultdict

PATH = re.compile(r'\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)')
GROUP = re.compile(r'\b(crate|super)::\{([^}]*)\}')


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ('lib', 'main', 'mod'):
        rel = rel[:-1]
    return tuple(rel)


def code(text):
    """The text less comments and string literals (roughly)."""
    text = re.sub(r'//[^\n]*', '', text)
    text = re.sub(r'/\*.*?\*/', '', text, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def graph(src):
    mods = {}
    for root, _, files in os.walk(src):
        for f in files:
            if f.endswith('.rs'):
                p = os.path.join(root, f)
                mods[module_of(src, p)] = code(open(p).read())
    # Test modules inside files are part of them; `#[cfg(test)] mod tests`
    # bodies are dropped so test-only imports do not count.
    for m, t in mods.items():
        i = t.find('#[cfg(test)]\nmod tests')
        if i >= 0:
            mods[m] = t[:i]
    known = set(mods)
    edges = defaultdict(set)
    for m, text in mods.items():
        paths = []
        for kind, rest in PATH.findall(text):
            paths.append((kind, rest.strip(':').split('::')))
        for kind, inner in GROUP.findall(text):
            for part in inner.split(','):
                part = part.strip().split(' ')[0]
                if part:
                    paths.append((kind, part.split('::')))
        for kind, parts in paths:
            base = list(m) if kind == 'crate' else None
            if kind == 'crate':
                target = []
            else:
                # `super` from a file module `a/b.rs` (module a::b) is a.
                target = list(m[:-1])
                while parts and parts[0] == 'super':
                    target = target[:-1]
                    parts = parts[1:]
            best = tuple(target)
            for p in parts:
                cand = tuple(target + [p])
                if cand in known:
                    target.append(p)
                    best = cand
                else:
                    break
            if best != m and best in known and best != ():
                edges[m].add(best)
    return known, edges


def sccs(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def name(m):
    return '::'.join(m) or 'crate'


def main():
    for src in sys.argv[1:]:
        known, edges = graph(src)
        top = defaultdict(set)
        for a, bs in edges.items():
            for b in bs:
                if a and b and a[0] != b[0]:
                    top[(a[0],)].add((b[0],))
        fine = defaultdict(set)
        for a, bs in edges.items():
            for b in bs:
                nested = a[:len(b)] == b or b[:len(a)] == a
                if not nested:
                    fine[a].add(b)
        tops = {(m[0],) for m in known if m}
        print(f"{src}: {len(known)} modules")
        cyc = sccs(tops, top)
        print(f"  cycles among top-level modules: {len(cyc)}")
        for c in cyc:
            print("    " + " <-> ".join(name(m) for m in c))
            for a in c:
                for b in sorted(top[a]):
                    if b in c:
                        who = sorted(x for x in edges if x and x[0] == a[0] and any(y and y[0] == b[0] for y in edges[x]))
                        print(f"      {name(a)} -> {name(b)} (from {', '.join(name(w) for w in who)})")
        if not cyc:
            # No cycle: every top-level module sits on a layer above all it
            # imports, so no import runs back up. The layers, lowest first.
            level = {}

            def depth(v):
                if v not in level:
                    level[v] = 1 + max((depth(w) for w in top.get(v, ())), default=-1)
                return level[v]

            for v in tops:
                depth(v)
            print("  layers of top-level modules (each imports only from layers below):")
            for n in range(max(level.values(), default=-1) + 1):
                on = sorted(name(v) for v in tops if level[v] == n)
                print(f"    {n}: {' '.join(on)}")
        cyc = sccs(known, fine)
        print(f"  cycles among all modules (parent/child edges left out): {len(cyc)}")
        for c in cyc:
            print("    " + " <-> ".join(name(m) for m in c))


if __name__ == '__main__':
    main()
