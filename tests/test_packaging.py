"""The package installs as built: a wheel from this tree holds every source file and runs.

Every other test runs on the editable install, which reads the tree itself, so a
package missing from the wheel (``fastdet.convert`` once was) shows only here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Tree folder -> its package path in the wheel (pyproject's package-dir).
LAYOUT = {"fastdet": "fastdet", "pipelines": "fastdet/pipelines", "csrc": "fastdet/_csrc"}
SOURCES = {".py", ".cpp", ".cu", ".h", ".cuh"}


def _sources() -> set[str]:
    """Every source file of the tree, as the path it must have inside the wheel."""
    out = set()
    for folder, pkg in LAYOUT.items():
        for f in (ROOT / folder).rglob("*"):
            if f.suffix in SOURCES and "__pycache__" not in f.parts:
                out.add(f"{pkg}/{f.relative_to(ROOT / folder).as_posix()}")
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy of what a clone holds: setuptools reuses a tree's build/lib, which
    # still holds the files of an earlier build and would hide a package left out now.
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in (*LAYOUT, "pyproject.toml", "setup.py", "README.md"):
        if not (ROOT / name).exists():
            continue
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("fastdet-*.whl")
    return whl


def test_the_wheel_holds_every_source_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = _sources()
    assert len(sources) > 100  # the walk found the tree
    missing = sorted(sources - names)
    assert not missing, f"{len(missing)} source file(s) not in {wheel.name}: {missing[:10]}"


def test_the_convert_cli_runs_from_an_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    # Outside the tree, with the installed copy first: the editable install must not answer.
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import fastdet.convert; print(fastdet.convert.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(target)
    cli = subprocess.run([sys.executable, "-m", "fastdet.convert", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert "--from" in cli.stdout and "--arch" in cli.stdout


def test_the_tree_tracks_no_build_output():
    """Only sources are committed. An extension build folder was (``.ext-lead/``: ninja's
    objects and state, torch's lock file, a second copy of csrc/): it travels with every
    clone and every device call, and its copies of the sources are code nothing reads. No
    tracked file is a compiled object or ninja's state, and none matches ``.gitignore``."""
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"not a git checkout ({r.stderr.decode().strip()[:200]}): what is tracked is unknown")
    tracked = [f for f in r.stdout.decode().split("\0") if f]
    built = [f for f in tracked if Path(f).suffix in {".o", ".so", ".pyd", ".obj", ".pyc"}
             or Path(f).name in {"build.ninja", ".ninja_deps", ".ninja_log"}]
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--ignored", "--exclude-standard"], cwd=ROOT,
                       capture_output=True, timeout=60)
    ignored = [f for f in r.stdout.decode().split("\0") if f]
    assert not built and not ignored, (built + ignored)[:5]
