"""The package's shape, as docs/architecture.md describes it: no import cycles (imports
inside functions and for type checking counted: each is a dependency a reader must
follow), no module over 600 lines, at most 15 modules at the top of src/meshfit, and
every module named in docs/architecture.md."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "src", "meshfit")
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")


def _modules() -> dict[str, str]:
    """{dotted name: path} of every module of the package (a package by its __init__)."""
    found = {}
    for where, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(where, file)
                name = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, wherever in it the import is."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(owner(full) if full in modules else owner(base))
        graph[name] = {m for m in found if m and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = _imports(_modules())
    # a package's __init__ that re-exports its modules is imported by them only through
    # their own dotted names, never the other way round: any cycle is a real one
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    """Negative control: two modules importing each other, inside functions."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_module_over_600_lines() -> None:
    long = {}
    for name, path in _modules().items():
        with open(path) as f:
            lines = sum(1 for _ in f)
        if lines > 600:
            long[name] = lines
    assert long == {}


def test_at_most_15_modules_at_the_top() -> None:
    top = sorted(
        f
        for f in os.listdir(PACKAGE)
        if f.endswith(".py") and f not in ("__init__.py", "__main__.py")
    )
    assert len(top) <= 15, top


def test_every_module_is_named_in_the_architecture_page() -> None:
    """docs/architecture.md names every module of the package by its path below
    src/meshfit (a package's __init__ by the package's path with a slash)."""
    with open(ARCHITECTURE) as f:
        text = f.read()
    missing = []
    for path in _modules().values():
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        if rel in ("__init__.py", "__main__.py"):
            continue
        shown = rel.removesuffix("__init__.py") if rel.endswith("/__init__.py") else rel
        if shown not in text:
            missing.append(shown)
    assert missing == [], f"docs/architecture.md does not name: {missing}"
