"""The package stacks in floors: a folder imports only the folders below it, lazy imports included.

The floors, top to bottom, written once: the package root (`dsaserve/__init__.py`, `__main__.py`) and
cli -> bench -> quality -> server -> engine -> model -> ledger -> training -> weights -> distributed -> kernels ->
config -> errors -> common.
`common/` is the ground floor (shared vocabulary: counters, KV layouts, sampling parameters, causal counts,
environment switches) and imports nothing of the package. An upward arrow, or a circle between folders
or between modules, fails this test with the importing file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dsaserve"
FLOORS = ("root", "cli", "bench", "quality", "server", "engine", "model", "ledger", "training", "weights",
          "distributed", "kernels", "config", "errors", "common")


def _folder(module: str) -> str:
    """dsaserve.engine.kv_pool -> engine; dsaserve.config -> config; dsaserve / dsaserve.__main__ -> root."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "root"
    return parts[1].removesuffix(".py")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module of the package, line) of every import in the file, at any depth (functions
    included); `from pkg import name` names the submodule pkg.name when there is one."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out += [(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m == "dsaserve" or m.startswith("dsaserve.")]


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """(from folder, to folder) -> ["file:line", ...] over every module of the package."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _folder(_module_name(path) if path.name != "__main__.py" else "dsaserve.__main__")
        for module, line in _imports(path):
            dst = _folder(module)
            if dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def test_every_folder_has_a_floor():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.rglob("*.py"))} - {"configs"}
    folders |= {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert folders <= set(FLOORS), f"give these a floor in FLOORS: {sorted(folders - set(FLOORS))}"


def test_no_import_runs_up_a_floor():
    rank = {f: i for i, f in enumerate(FLOORS)}
    upward = {f"{a} -> {b}": where for (a, b), where in folder_edges().items() if rank[b] <= rank[a]}
    assert not upward, f"imports that run up a floor: {upward}"


def _assert_no_circle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"circle: {' -> '.join(path + [node, nxt])}"
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_folder_graph_has_no_circle():
    graph: dict[str, set[str]] = {}
    for a, b in folder_edges():
        graph.setdefault(a, set()).add(b)
    _assert_no_circle(graph)


def test_the_module_graph_has_no_circle():
    """Module to module (a package's __init__ counts as a module; `import a.b` first runs `a`, which is not
    counted as an arrow). The notes' catalogue was tied in one through a lazy import."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        graph[name] = {m for m, _ in _imports(path) if m in MODULES and m != name}
    _assert_no_circle(graph)


def test_the_ground_floor_imports_nothing_of_the_package():
    assert not [k for k in folder_edges() if k[0] == "common"]
