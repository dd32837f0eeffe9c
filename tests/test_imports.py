"""The import structure of eagle3/, read from the source: no circle among its modules, and the
low layers (the settings schema, the drafter) import nothing from the layers above."""

from __future__ import annotations

import ast
from pathlib import Path

import eagle3

ROOT = Path(eagle3.__file__).parent
# Circles still to be opened; none may be added.
KNOWN_CIRCLES = {frozenset({"eagle3.k8s.backend", "eagle3.k8s.serving"})}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the eagle3 modules it imports (at the top or inside a function)."""
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]


def test_no_new_import_circle_among_eagle3_modules():
    new = [sorted(c) for c in circles(import_graph()) if c not in KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"


def _layer(module: str) -> str:
    """``eagle3.train.loop`` -> ``train``; the package root -> ''."""
    return module.split(".")[1] if "." in module else ""


def test_the_settings_and_the_drafter_import_downward_only():
    """The settings are the config's schema and the drafter is architecture: neither reaches up
    into a stage, the stage runtime or the orchestration."""
    graph = import_graph()
    allowed = {"eagle3.settings": {"errors", "processes", "settings"},
               "eagle3.drafter": {"errors", "settings", "drafter"}}
    for prefix, ok in allowed.items():
        for module in (m for m in graph if m == prefix or m.startswith(prefix + ".")):
            up = sorted(d for d in graph[module] if _layer(d) not in ok)
            assert not up, f"{module} imports {up}"
