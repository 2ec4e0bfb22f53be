#!/usr/bin/env python3
"""The architecture numbers of experiments/architecture.md, for a checkout of ember.

    python3 scripts/arch-report.py [REPO]          # REPO defaults to the current directory

Standard library only (Python 3.11 or later, for tomllib). It reads the sources as text, so a path
or a name spelled in a comment counts too, except where a section says otherwise. It prints, in
order:

1. Crate graph. One row per workspace crate (each `crates/*/Cargo.toml`, by its package name): the
   workspace crates it depends on, i.e. the keys starting with `ember-` in `[dependencies]` (and
   `[target.*.dependencies]`), then apart those of `[dev-dependencies]` and
   `[build-dependencies]`. `(optional)` marks a dependency behind a feature.
2. Module graph. For every crate, which top-level module imports which (`crate::x` paths in
   non-test code), and the pairs of modules that import each other.
3. `pub` items per crate: the lines of `crates/<c>/src/**/*.rs` matching
   `^\\s*pub (fn|struct|enum|trait|type|const|static|mod|use|unsafe fn|async fn)`, test modules
   included. `pub(crate)`, `pub(super)` and the like do not match, nor do fields, methods of a
   trait (no `pub` there) or variants.
4. Source files over 700 lines: every `crates/*/src/**/*.rs` (tests in `#[cfg(test)]` modules
   included: the file a reader opens), counted as `wc -l` would; those of `crates/kernels` are
   marked "kernels crate".
5. Longest functions: from the `fn` line to its closing brace at the same indentation; `#[cfg(test)]`
   items and the CPU kernels (`ops/kernels.rs`, or anything in `crates/kernels`) apart.
6. Global mutable state outside tests: every `static` whose declared type names `Atomic*`,
   `Mutex`, `RwLock`, `Cell`, `RefCell`, `OnceLock`, `OnceCell`, `LazyLock` or `Lazy`; every
   `static mut`; and every `static` declared inside a `thread_local!` block (whatever its type).
   The type is read as spelled at the declaration: a type of our own that holds an atomic inside
   is not seen; such statics are listed apart, uncounted.
7. Environment reads outside tests: lines with `env::var(`, `var_os(` or `env::vars` (which covers
   `std::env::var(`, `std::env::var_os(`, `std::env::vars()`), comment lines left out; the variable
   is the string literal passed, where there is one. A read through a helper of our own (a
   closure `var(k)` wrapping `var_os`) counts once, where the helper calls `var_os`.

Sections 6 and 7 each list the binary crate (`crates/cli`) apart from the others. "Outside tests"
means: only `crates/*/src` (not `crates/*/tests`, `crates/*/benches` or the top-level `tests/`),
and without the items under a `#[cfg(test)]` attribute. Such an item runs from the attribute to
the line that closes it at the item's own indentation (the code is rustfmt'ed), or is the one line
when that line ends in `;` or `}`: a `mod tests { … }`, a test helper, a `thread_local!` block or
one statement inside a function. `#[cfg(all(test, …))]` and other spellings are not recognised.
"""

import collections
import os
import re
import sys
import tomllib

ROOT = sys.argv[1] if len(sys.argv) > 1 else "."
KERNELS_CRATE = "kernels"  # the directory name, crates/kernels
BINARY_CRATE = "cli"  # crates/cli: the binary, where environment reads and globals belong
LONG_FILE = 700

PUB_ITEM = re.compile(r"^\s*pub (fn|struct|enum|trait|type|const|static|mod|use|unsafe fn|async fn)")
STATIC = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?static\s+(mut\s+)?(\w+)\s*:\s*(.*)")
INTERIOR = re.compile(r"\b(Atomic\w*|Mutex|RwLock|Cell|RefCell|OnceLock|OnceCell|LazyLock|Lazy)\b")
ENV_READ = re.compile(r"env::var\(|var_os\(|env::vars")
ENV_NAME = re.compile(r"(?:env::var|var_os)\(\s*\"([^\"]+)\"")


def rel(path):
    return os.path.relpath(path, ROOT)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


# ---------------------------------------------------------------------------------------------
# Crates


def crates():
    """(directory name, package name, {section: [(dependency, optional)]}) of every workspace crate."""
    found = []
    for crate in sorted(os.listdir(os.path.join(ROOT, "crates"))):
        manifest = os.path.join(ROOT, "crates", crate, "Cargo.toml")
        if not os.path.isfile(manifest):
            continue
        with open(manifest, "rb") as f:
            toml = tomllib.load(f)
        sections = {"dependencies": dict(toml.get("dependencies", {}))}
        for target in toml.get("target", {}).values():
            sections["dependencies"].update(target.get("dependencies", {}))
        sections["dev-dependencies"] = toml.get("dev-dependencies", {})
        sections["build-dependencies"] = toml.get("build-dependencies", {})
        deps = {}
        for section, table in sections.items():
            deps[section] = sorted(
                (spec.get("package", name) if isinstance(spec, dict) else name,
                 isinstance(spec, dict) and bool(spec.get("optional")))
                for name, spec in table.items()
                if (spec.get("package", name) if isinstance(spec, dict) else name).startswith("ember-")
            )
        found.append((crate, toml["package"]["name"], deps))
    return found


def sources():
    for crate in sorted(os.listdir(os.path.join(ROOT, "crates"))):
        src = os.path.join(ROOT, "crates", crate, "src")
        for dirpath, dirnames, files in os.walk(src):
            dirnames.sort()
            for name in sorted(files):
                if name.endswith(".rs"):
                    path = os.path.join(dirpath, name)
                    parts = os.path.relpath(path, src)[:-3].split(os.sep)
                    module = parts[0] if parts[0] not in ("lib", "main") else "(root)"
                    yield crate, module, path


# ---------------------------------------------------------------------------------------------
# Test code


def indent_of(line):
    return line[: len(line) - len(line.lstrip())]


def block_end(lines, start):
    """The last line of the item or statement that begins at `start` (rustfmt'ed code): `start`
    itself when it ends in `;` or `}`, else the first later line at the same indentation that
    begins with a closing bracket."""
    first = lines[start].rstrip()
    if first.endswith(";") or first.endswith("}"):
        return start
    indent = indent_of(lines[start])
    for j in range(start + 1, len(lines)):
        line = lines[j]
        if indent_of(line) == indent and line[len(indent):][:1] in ("}", ")", "]"):
            return j
    return len(lines) - 1


def test_lines(lines):
    """Indices of the lines that belong to `#[cfg(test)]` items (attribute included)."""
    hidden = set()
    i = 0
    while i < len(lines):
        if not lines[i].strip().startswith("#[cfg(test)]"):
            i += 1
            continue
        start = i
        rest = lines[i].strip()[len("#[cfg(test)]"):].strip()
        if not rest:  # the item starts on a later line: skip attributes, doc comments, blanks
            start = i + 1
            while start < len(lines) and (
                not lines[start].strip() or lines[start].strip().startswith(("#[", "//"))
            ):
                start += 1
        end = block_end(lines, min(start, len(lines) - 1))
        hidden.update(range(i, end + 1))
        i = end + 1
    return hidden


def non_test(text):
    """The file with the lines of its `#[cfg(test)]` items blanked (line numbers kept)."""
    lines = text.split("\n")
    hidden = test_lines(lines)
    return "\n".join("" if i in hidden else line for i, line in enumerate(lines))


# ---------------------------------------------------------------------------------------------
# Modules and functions


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


def is_kernel(path):
    return path.endswith("ops/kernels.rs") or rel(path).startswith(os.path.join("crates", KERNELS_CRATE, ""))


def functions():
    found = []
    for crate, module, path in sources():
        lines = read_lines(path)
        tests = test_lines(lines)
        for i, line in enumerate(lines):
            m = re.match(r"^(\s*)(?:pub(?:\([a-z]+\))? )?(?:const )?(?:unsafe )?fn (\w+)", line)
            if not m:
                continue
            indent, j = m.group(1), i + 1
            # A signature alone (a trait's method without a default body) ends at its `;`, on the
            # fn line or on the line that closes its arguments.
            bodiless = lambda k: lines[k].startswith(indent + ")") and lines[k].rstrip().endswith(";")
            while j < len(lines) and lines[j] != indent + "}" and not bodiless(j) and not (
                lines[i].rstrip().endswith(";") or lines[i].rstrip().endswith("}")
            ):
                j += 1
            kind = "test" if i in tests else ("kernel" if is_kernel(path) else "code")
            found.append((j - i + 1, rel(path), m.group(2), kind))
    return sorted(found, reverse=True)


# ---------------------------------------------------------------------------------------------
# Counts


def pub_items():
    counts = collections.Counter()
    for crate, _, path in sources():
        counts[crate] += sum(1 for line in read_lines(path) if PUB_ITEM.match(line))
    return counts


def long_files():
    found = []
    for crate, _, path in sources():
        with open(path, encoding="utf-8") as f:
            n = f.read().count("\n")
        if n > LONG_FILE:
            found.append((n, rel(path), crate == KERNELS_CRATE))
    return sorted(found, reverse=True)


def thread_local_lines(lines):
    """Indices of the lines inside `thread_local! { … }` blocks."""
    inside = set()
    for i, line in enumerate(lines):
        if line.strip().startswith("thread_local!"):
            inside.update(range(i, block_end(lines, i) + 1))
    return inside


def globals_and_env():
    """([(path:line, kind, line)] of mutable statics, [… of other statics], [… of env reads])."""
    statics, others, env = [], [], []
    for crate, _, path in sources():
        lines = read_lines(path)
        tests = test_lines(lines)
        local = thread_local_lines(lines)
        for i, line in enumerate(lines):
            if i in tests or line.strip().startswith("//"):
                continue
            where = (crate, f"{rel(path)}:{i + 1}", line.strip())
            m = STATIC.match(line)
            if m:
                declared = m.group(3)
                k = i
                while "=" not in declared and ";" not in declared and k + 1 < len(lines):
                    k += 1  # a type written over several lines
                    declared += " " + lines[k].strip()
                kind = "thread_local" if i in local else ("static mut" if m.group(1) else None)
                interior = INTERIOR.search(declared.split("=")[0])
                if kind or interior:
                    statics.append(where + (kind or interior.group(1),))
                else:
                    others.append(where + ("",))
            if ENV_READ.search(line):
                name = ENV_NAME.search(line)
                env.append(where + (name.group(1) if name else "(name from a variable)",))
    return statics, others, env


# ---------------------------------------------------------------------------------------------
# Output


def cell(text):
    """Code in a Markdown table cell."""
    text = text.replace("|", "\\|")
    return f"``{text}``" if "`" in text else f"`{text}`"


def places_table(rows, what, column):
    """Rows (crate, place, line, note) as Markdown tables, the binary crate's apart; `column` names
    the notes."""
    for title, part in (
        (f"in the binary crate (crates/{BINARY_CRATE})", [r for r in rows if r[0] == BINARY_CRATE]),
        ("in the other crates", [r for r in rows if r[0] != BINARY_CRATE]),
    ):
        print(f"\n{what} {title}: {len(part)}")
        if part:
            print(f"\n| place | {column} | line |\n| --- | --- | --- |")
            for _, place, line, note in part:
                print(f"| {place} | {note} | {cell(line)} |")


def main():
    print("## Crate graph (workspace crates each depends on)\n")
    print("| crate | directory | depends on | dev-dependencies | build-dependencies |")
    print("| --- | --- | --- | --- | --- |")
    named = lambda deps: ", ".join(n + (" (optional)" if o else "") for n, o in deps) or "-"
    for crate, package, deps in crates():
        print(
            f"| {package} | crates/{crate} | {named(deps['dependencies'])} "
            f"| {named(deps['dev-dependencies'])} | {named(deps['build-dependencies'])} |"
        )

    graph, modules = module_graph()
    print("\n## Module graph (crate: module -> modules it imports)")
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

    counts = pub_items()
    package = {crate: name for crate, name, _ in crates()}
    print("\n## `pub` items per crate (lines matching `^\\s*pub (fn|struct|enum|...)`)\n")
    print("| crate | pub items |\n| --- | ---: |")
    for crate in sorted(counts):
        print(f"| {package.get(crate, crate)} | {counts[crate]} |")
    print(f"| total | {sum(counts.values())} |")

    files = long_files()
    outside = [f for f in files if not f[2]]
    print(f"\n## Source files over {LONG_FILE} lines: {len(files)} ({len(outside)} outside the kernels crate)\n")
    if files:
        print("| file | lines | |\n| --- | ---: | --- |")
        for n, path, kernels in files:
            print(f"| {path} | {n} | {'kernels crate' if kernels else ''} |")

    code = [f for f in functions() if f[3] == "code"]
    over = [f for f in code if f[0] > 80]
    print(f"\n## Functions over 80 lines (tests and kernels apart): {len(over)}")
    for n, path, name, _ in code[:15]:
        print(f"  {n:4d}  {path}  {name}")

    statics, others, env = globals_and_env()
    print("\n## `static`s with interior mutability, `static mut`s and `thread_local!`s (outside tests)")
    places_table(statics, "Statics", "kind")
    if others:
        print("\nOther statics (not counted; their declared type names no interior mutability):")
        for _, place, line, _ in others:
            print(f"  {place}  {line}")
    print("\n## Environment reads (outside tests)")
    places_table(env, "Reads", "variable")


if __name__ == "__main__":
    main()
