#!/usr/bin/env python3
"""The architecture numbers of experiments/architecture.md, for a checkout of ember.

    python3 scripts/arch-report.py [REPO]          # REPO defaults to the current directory

Prints, for every crate: which top-level module imports which (`crate::x` paths in non-test code),
the pairs of modules that import each other, and the longest functions (from the `fn` line to its
closing brace at the same indentation; test modules and the CPU kernels, `ops/kernels.rs`, apart).
It reads the sources as text: a path spelled in a comment counts too, which is what a reader sees.
"""

import collections
import os
import re
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else "."


def sources():
    for crate in sorted(os.listdir(os.path.join(ROOT, "crates"))):
        src = os.path.join(ROOT, "crates", crate, "src")
        for dirpath, _, files in os.walk(src):
            for name in sorted(files):
                if name.endswith(".rs"):
                    path = os.path.join(dirpath, name)
                    parts = os.path.relpath(path, src)[:-3].split(os.sep)
                    module = parts[0] if parts[0] not in ("lib", "main") else "(root)"
                    yield crate, module, path


def non_test(text):
    """The file without its `#[cfg(test)]` items (everything from the first one on)."""
    return text.split("#[cfg(test)]")[0]


def imports(text):
    """Top-level modules named through `crate::` paths, groups included."""
    names = set()
    for m in re.finditer(r"crate::(\{[^}]*\}|\w+)", text):
        target = m.group(1)
        if target.startswith("{"):
            names.update(re.findall(r"(?:^|[{,\s])(\w+)(?=::|\s*[,}]|\s+as\b)", target))
        else:
            names.add(target)
    return names


def module_graph():
    graph = collections.defaultdict(set)
    modules = collections.defaultdict(set)
    for crate, module, path in sources():
        modules[crate].add(module)
        for target in imports(non_test(open(path, encoding="utf-8").read())):
            if target != module:
                graph[(crate, module)].add(target)
    return graph, modules


def functions():
    found = []
    for crate, module, path in sources():
        lines = open(path, encoding="utf-8").read().split("\n")
        test_from = next((i for i, l in enumerate(lines) if l.strip() == "#[cfg(test)]"), len(lines))
        for i, line in enumerate(lines):
            m = re.match(r"^(\s*)(?:pub(?:\([a-z]+\))? )?(?:const )?(?:unsafe )?fn (\w+)", line)
            if not m:
                continue
            indent, j = m.group(1), i + 1
            while j < len(lines) and lines[j] != indent + "}" and not (
                lines[i].rstrip().endswith(";") or lines[i].rstrip().endswith("}")
            ):
                j += 1
            kind = "test" if i > test_from else ("kernel" if path.endswith("ops/kernels.rs") else "code")
            rel = os.path.relpath(path, ROOT)
            found.append((j - i + 1, rel, m.group(2), kind))
    return sorted(found, reverse=True)


def main():
    graph, modules = module_graph()
    print("## Module graph (crate: module -> modules it imports)")
    for crate in sorted(modules):
        print(f"\n{crate}:")
        for module in sorted(modules[crate]):
            targets = sorted(t for t in graph.get((crate, module), ()) if t in modules[crate])
            if targets:
                print(f"  {module} -> {', '.join(targets)}")
    cycles = sorted(
        (crate, a, b)
        for (crate, a), targets in graph.items()
        for b in targets
        if a < b and a != "(root)" and b in modules[crate] and a in graph.get((crate, b), ())
    )
    print(f"\n## Modules importing each other: {len(cycles)}")
    for crate, a, b in cycles:
        print(f"  {crate}: {a} <-> {b}")
    code = [f for f in functions() if f[3] == "code"]
    over = [f for f in code if f[0] > 80]
    print(f"\n## Functions over 80 lines (tests and kernels apart): {len(over)}")
    for n, path, name, _ in code[:15]:
        print(f"  {n:4d}  {path}  {name}")


if __name__ == "__main__":
    main()
