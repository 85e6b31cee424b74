"""Imports point one way.

- The packages' layers (issue 40): the import-linter contracts in pyproject.toml hold
  (``lint-imports``), and every top-level package has a place in them.
- Imports inside functions only for an optional or heavy dependency, each saying why in
  a comment on its line (or the line above).
- The data layer has no import loops (issue 14): a module two others need sits below both.
  ``fastdet.data.loader`` dispatching to a back end is the one permitted downward edge,
  and no back end imports it back.

Module-level imports (those run at import time) and imports inside functions both
count: a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "fastdet"
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _lint_imports(*args: str) -> subprocess.CompletedProcess:
    """``lint-imports`` run by this interpreter (the one that imports this worktree's fastdet)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_import_contracts_are_kept():
    r = _lint_imports()
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert f"{len(CONTRACTS)} kept, 0 broken" in r.stdout, r.stdout[-3000:]


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The same tool on the same code with two layers swapped (api sits above convert and
    imports it: ``load_detector`` converts released files) reports the edge."""
    config = tmp_path / "swapped.toml"
    config.write_text('[tool.importlinter]\nroot_package = "fastdet"\n\n[[tool.importlinter.contracts]]\n'
                      'name = "swapped"\ntype = "layers"\nlayers = ["fastdet.convert", "fastdet.api"]\n')
    r = _lint_imports("--config", str(config))
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout[-3000:]
    assert "fastdet.api -> fastdet.convert" in r.stdout, r.stdout[-3000:]


def test_every_top_level_package_has_a_layer():
    layers = next(c for c in CONTRACTS if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    found = {f"fastdet.{p.stem if p.is_file() else p.name}" for p in PKG.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert found - placed == set(), "place these in pyproject.toml's layers contract"
    assert placed - found == set(), "the layers contract names packages that do not exist"


def _comment_lines(source: str) -> dict[int, bool]:
    """Line number -> whether the line is a comment only, for each line holding a comment."""
    return {tok.start[0]: tok.line.strip().startswith("#")
            for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}


def function_level_imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, module, says_why)`` for each import of a fastdet or third-party module inside a
    function (the standard library is not counted); ``says_why``: a comment on its lines or
    a comment line just above."""
    source = path.read_text()
    comments = _comment_lines(source)
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    modules = [a.name for a in child.names]
                else:
                    modules = ["." * child.level + (child.module or "")]
                for module in modules:
                    if module.startswith(".") or module.split(".")[0] not in sys.stdlib_module_names:
                        says_why = (any(line in comments for line in range(child.lineno, child.end_lineno + 1))
                                    or comments.get(child.lineno - 1, False))
                        found.append((child.lineno, module, says_why))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def test_function_level_imports_say_why():
    offenders, checked = [], 0
    for path in sorted([*PKG.rglob("*.py"), *(ROOT / "pipelines").glob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for line, module, says_why in function_level_imports(path):
            checked += 1
            if not says_why:
                offenders.append(f"{rel}:{line} {module}")
    assert checked, "no function-level import found at all: is the walk looking at fastdet/?"
    assert not offenders, ("imports inside functions without a comment saying why (optional or heavy "
                           "dependency; otherwise move it to the module's top):\n" + "\n".join(offenders))


def test_the_import_check_sees_what_it_should(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import json\nimport torch\n\n\ndef f():\n    import numpy\n    from fastdet import api\n"
                   "    import onnx  # optional: the export extra\n    # heavy: builds the extension\n"
                   "    from fastdet.ops import _ext\n    import os\n    return lambda: __import__('x')\n")
    assert function_level_imports(src) == [(6, "numpy", False), (7, "fastdet", False), (8, "onnx", True),
                                           (10, "fastdet.ops", True)]

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


def fastdet_imports(path: Path) -> list[str]:
    """Every fastdet module ``path`` imports, at module level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [m for m in found if m.split(".")[0] == "fastdet"]


def test_the_dali_pipelines_sit_in_the_data_layer():
    """``fastdet.pipelines`` is installed from ``pipelines/``, outside ``fastdet/``, where
    lint-imports does not look: its imports are checked here against the layers contract,
    as a part of the data layer (the DALI back end of its loaders)."""
    layers = [l.replace("|", ":").split(":") for l in next(c for c in CONTRACTS if c["type"] == "layers")["layers"]]
    layers = [{n.strip() for n in l} for l in layers]
    data = next(i for i, l in enumerate(layers) if "fastdet.data" in l)
    allowed = {"fastdet.pipelines"} | {n for l in layers[data:] for n in l}
    found = {(p.name, m) for p in sorted((ROOT / "pipelines").glob("*.py")) for m in fastdet_imports(p)}
    assert any(m.startswith("fastdet.data") for _, m in found), "no import of the data layer found: wrong folder?"
    upward = sorted(f"pipelines/{f} imports {m}" for f, m in found
                    if not any(m == a or m.startswith(a + ".") for a in allowed))
    assert not upward, "\n".join(upward)
    assert "fastdet.engine" not in allowed and "fastdet.models" not in allowed  # the check can fail


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
