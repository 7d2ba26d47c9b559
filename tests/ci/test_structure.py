"""The dependency rules docs/architecture.md states ("How the folders depend on each other"),
read from the code's imports (every ``import``, in functions and under TYPE_CHECKING too):
no import circle among the modules of engine/, server/ and kernels/; server/protocol/ imports
no server logic; engine wings import each other only where the page says why; the Platform is
made in two places; no class passes 300 lines."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "server", "kernels")
# wings that import each other, each with the reason docs/architecture.md gives
WING_PAIRS = {("model", "platform")}
MAX_CLASS_LINES = 300


def _module_of(path: Path) -> str:
    """``engine/sched/scheduler.py`` -> ``paged_serve.engine.sched.scheduler``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["paged_serve", *parts])


@cache
def _modules() -> dict[str, Path]:
    files = {}
    for top in FOLDERS:
        for path in (ROOT / top).rglob("*.py"):
            if "paged_serve" not in path.relative_to(ROOT).parts:  # the package's face
                files[_module_of(path)] = path
    return files


@cache
def _imports() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a name imported from a package counts as its
    submodule when one of that name exists)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets |= {name for name in names if name in modules and name != module}
        graph[module] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def test_no_import_circles() -> None:
    assert _circles(_imports()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_protocol_imports_no_server_logic() -> None:
    logic = {
        (module, target)
        for module, targets in _imports().items()
        if module.startswith("paged_serve.server.protocol")
        for target in targets
        if target.startswith("paged_serve.server.")
        and not target.startswith("paged_serve.server.protocol")
    }
    assert logic == set()


def _wing(module: str) -> str | None:
    parts = module.split(".")
    is_package = (ROOT / "engine" / parts[2]).is_dir() if len(parts) > 2 else False
    return parts[2] if parts[1] == "engine" and len(parts) > 3 and is_package else None


def test_engine_wings_import_each_other_only_where_the_docs_say_why() -> None:
    edges = {
        (_wing(module), _wing(target))
        for module, targets in _imports().items()
        for target in targets
        if _wing(module) and _wing(target) and _wing(module) != _wing(target)
    }
    pairs = {tuple(sorted(edge)) for edge in edges if edge[::-1] in edges}
    assert pairs == WING_PAIRS


def test_the_platform_is_made_where_the_device_is_resolved() -> None:
    makers = sorted(
        str(path.relative_to(ROOT))
        for path in _modules().values()
        if any(
            isinstance(node, ast.Call) and getattr(node.func, "id", None) == "platform_for"
            for node in ast.walk(ast.parse(path.read_text()))
        )
    )
    assert makers == ["engine/executor/rank.py", "engine/llm_engine.py"]


def test_no_class_is_longer_than_300_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert long == []
