"""The data layer has no import loops (issue 14): a module two others need sits below both.

Module-level imports (those run at import time) and imports inside functions both
count: a lazy import still ties the two modules together. ``fastdet.data.loader``
dispatching to a back end is the one permitted downward edge, and no back end
imports it back.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fastdet.data": ROOT / "fastdet" / "data", "fastdet.pipelines": ROOT / "pipelines"}


def _graph() -> dict[str, set[str]]:
    mods = {f"{pkg}.{p.stem}": p for pkg, d in PACKAGES.items() for p in d.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_loops_in_data_and_pipelines():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_layout_and_schedule_sit_at_the_bottom():
    graph = _graph()
    assert graph["fastdet.data.layout"] == set()
    assert graph["fastdet.data.schedule"] == set()
    for back_end in ("fastdet.data.torch_backend", "fastdet.data.augment", "fastdet.pipelines.adapter",
                     "fastdet.pipelines.sources", "fastdet.pipelines.detection", "fastdet.pipelines.stages"):
        assert "fastdet.data.loader" not in graph[back_end], back_end


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_loader_base_sits_below_both_back_ends():
    """Both back ends are loader_base's subclasses; the base reaches neither of them, nor the dispatcher."""
    graph = _graph()
    above = {"fastdet.data.loader", "fastdet.data.torch_backend"}
    above |= {m for m in graph if m.startswith("fastdet.pipelines.")}
    assert not _reachable(graph, "fastdet.data.loader_base") & above
    assert "fastdet.data.loader_base" in graph["fastdet.data.torch_backend"]
    assert "fastdet.data.loader_base" in graph["fastdet.pipelines.adapter"]
