"""The layering the design keeps: no import loop between the trainer and evaluation,
config below everything, and nothing in engine/, data/ or pipelines/ naming a model family."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import fastdet
from fastdet.models import ARCHITECTURES

PKG = Path(fastdet.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every fastdet module ``path`` imports, at any depth of its code (lazy imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastdet"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fastdet"))
    return out


def test_evaluation_does_not_import_the_trainer():
    for path in (PKG / "eval").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("fastdet.engine.trainer")}, path.name


def test_config_imports_no_other_fastdet_module():
    assert not _imports(PKG / "config.py")


def test_engine_data_and_pipelines_name_no_family():
    """No family name as a string literal or a ``models.<family>`` import in engine/, data/
    or the DALI pipelines/ (installed as ``fastdet.pipelines``; located without importing
    DALI). Augmentation variants are named by what they do (``MixUp("scaled_crop")``)."""
    names = set(ARCHITECTURES)
    pipelines = Path(importlib.util.find_spec("fastdet.pipelines").submodule_search_locations[0])
    for folder in (PKG / "engine", PKG / "data", pipelines):
        paths = list(folder.glob("*.py"))
        assert paths, folder
        for path in paths:
            text = path.read_text().lower()
            assert not [n for n in names if f'"{n}"' in text or f"models.{n}" in text], path


def test_eval_cli_loads_without_the_trainer():
    code = ("import sys, fastdet.eval.__main__ as m, fastdet.eval.coco, fastdet.registry, fastdet.data.loader, "
            "fastdet.runtime.dist, fastdet.engine.step, fastdet.runtime.checkpoint; "
            "assert 'fastdet.engine.trainer' not in sys.modules, 'trainer imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_one_weight_file_reader():
    """Checkpoints, released files and backbone weights are all read by runtime/checkpoint.py:
    one ``torch.load(weights_only=True)``, one pickle unpickler, one Paddle name table."""
    readers = {"torch.load(": set(), "Unpickler": set(), '"StructuredToParameterName@@"': set()}
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        for needle, found in readers.items():
            if needle in text:
                found.add(path.relative_to(PKG).as_posix())
    assert readers["torch.load("] == {"runtime/checkpoint.py"}
    assert readers["Unpickler"] == {"runtime/checkpoint.py"}
    assert readers['"StructuredToParameterName@@"'] == {"models/paddle_names.py"}


def test_the_longest_first_files_exist():
    """tests/conftest.py's scheduling list names test files that exist (a renamed file would
    silently fall back to the end of the queue)."""
    from conftest import LONGEST_FIRST  # tests/ is on sys.path (rootdir conftest)

    here = Path(__file__).resolve().parent
    assert [n for n in LONGEST_FIRST if not (here / n).is_file()] == []
