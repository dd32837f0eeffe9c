"""The import structure of eagle3/, read from the source: no circle among its modules, every import
runs down the layers (the store, settings and drafter at the bottom, the CLI at the top), the two
orchestration packages never import each other, no stage package imports either, and no function
is longer than 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import eagle3

ROOT = Path(eagle3.__file__).parent
# The top-level modules and packages of eagle3/, bottom first: each imports only from its own layer
# and those below it. The stage packages follow the DAG.
LAYERS: list[set[str]] = [
    {"errors", "signals", "processes", "progress"},
    {"store", "settings", "vllm_version", "vllm_env"},
    {"config", "inputs", "drafter"},
    {"stages"},
    {"manifest"},
    {"runs", "contract"},
    {"context"},
    {"targets"},
    {"serve"},
    {"generate"},
    {"vocab"},
    {"extract"},
    {"train"},
    {"export"},
    {"evaluate"},
    {"backend"},
    {"verify"},
    {"pipeline", "k8s"},
    {"cli"},
    {"__main__"},
]
STAGE_PACKAGES = {"context", "targets", "serve", "generate", "vocab", "extract", "train", "export", "evaluate"}
ORCHESTRATION = {"pipeline", "k8s"}
MAX_FUNCTION_LINES = 80


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


def test_no_import_circle_among_eagle3_modules():
    found = [sorted(c) for c in circles(import_graph())]
    assert not found, f"import circles: {found}"


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


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer to a higher one (``LAYERS``), as ``module -> module``."""
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    return [f"{m} -> {d}" for m in sorted(graph) for d in sorted(graph[m])
            if _layer(m) and _layer(d) and rank[_layer(d)] > rank[_layer(m)]]


def test_every_module_has_a_layer():
    named = set().union(*LAYERS)
    assert not {_layer(m) for m in import_graph() if _layer(m)} - named


def test_a_climb_is_found():
    assert climbs({"eagle3.store.base": {"eagle3.cli.app"}, "eagle3.cli.app": {"eagle3.store.base"}}) == [
        "eagle3.store.base -> eagle3.cli.app"]


def test_every_import_runs_down_the_layers():
    assert not climbs(import_graph())


def test_the_orchestration_packages_never_import_each_other_and_no_stage_imports_them():
    """The pipeline and Kubernetes backends meet only in the CLI (which chooses the backend) and
    through the interface below them (``eagle3.backend``); a stage knows nothing of either."""
    graph = import_graph()
    crossing = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
                if {_layer(m), _layer(d)} == ORCHESTRATION]
    assert not crossing
    up = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
          if _layer(m) in STAGE_PACKAGES and _layer(d) in ORCHESTRATION]
    assert not up


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` for every function or method over ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_a_long_function_is_found(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_function_in_eagle3_is_over_80_lines():
    assert not long_functions()
