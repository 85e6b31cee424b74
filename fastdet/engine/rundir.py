"""Where a run writes: never into another run's directory unless the user says so.

A new run whose output directory already holds a run (checkpoints, logs, TensorBoard
events) goes to the next free numbered sibling, as ultralytics does: ``runs/ppyoloe_s``
-> ``runs/ppyoloe_s2`` -> ``runs/ppyoloe_s3``; the log says where. ``--exist-ok`` writes
into the directory as it is: ``metrics.jsonl`` and ``eval.jsonl`` start anew, TensorBoard
shows this run's events only (the earlier file stays, purged from view), ``train.log`` is
appended to, the checkpoints are replaced as they are written and the other run's
``latest.pth`` is never this run's fallback; ``--resume`` continues the run in it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

from fastdet.runtime.logging import close_log_file

# What a run leaves in its directory (fastdet.engine.trainer); any of them marks it taken.
RUN_FILES = ("latest.pth", "best.pth", "metrics.jsonl", "eval.jsonl", "train.log", "config.yaml", "tb")
# Which torchrun launch claimed the directory (:func:`launch_key`), for its restarts.
LAUNCH_FILE = ".torchrun_launch"
# What a start writes before its first step (engine.trainer, engine.metrics_log).
START_FILES = {"train.log", "config.yaml", "model_summary.txt", "tb", LAUNCH_FILE}


def holds_run(path: Path) -> bool:
    """Whether ``path`` holds any file a run writes (a file of that name takes it too; a
    link counts as its name, dangling or not)."""
    if os.path.lexists(path) and not path.is_dir():
        return True
    return path.is_dir() and any(os.path.lexists(path / name) for name in RUN_FILES)


def free_run_dir(path: Path) -> Path:
    """``path`` if it holds no run, else the first ``<path><n>`` (n = 2, 3, ...) that holds none.

    A trailing number of ``path`` is kept as part of the name (``exp2`` -> ``exp22`` would
    surprise): the numbering continues from the name without it (``exp2`` -> ``exp3``).
    """
    if not holds_run(path):
        return path
    m = re.fullmatch(r"(.*?[^\d])(\d+)", path.name)
    stem, n = (m.group(1), int(m.group(2)) + 1) if m else (path.name, 2)
    while True:
        cand = path.with_name(f"{stem}{n}")
        if not holds_run(cand):
            return cand
        n += 1


def claim_run_dir(path: Path) -> tuple[Path, bool]:
    """:func:`free_run_dir`, claimed for this start: its ``train.log`` created, which fails if
    another start created it since (two runs of one command started together would otherwise
    both choose ``runs/x2`` and write into it); the loser takes the next free one. Returns the
    directory and whether this start made it (it has no ``train.log`` of its own before)."""
    while True:
        cand = free_run_dir(path)
        made = not cand.exists()
        cand.mkdir(parents=True, exist_ok=True)
        try:
            (cand / "train.log").open("x").close()
        except FileExistsError:
            continue
        return cand, made


def launch_key() -> str | None:
    """This torchrun launch: its agent (the workers' parent, the same process through every
    restart) on this host, and the rendezvous id; None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id is None else f"{socket.gethostname()} {os.getppid()} {run_id}"


def mark_launch(path: Path, key: str | None) -> None:
    """Record in ``path`` that launch ``key`` claimed it (nothing outside torchrun)."""
    if key is not None:
        (path / LAUNCH_FILE).write_text(key + "\n")


def launch_dir(path: Path, key: str | None) -> Path | None:
    """The directory this torchrun launch claimed, ``path`` or a numbered sibling of it
    (:func:`free_run_dir`'s names), for a restart: the same command line, which would
    otherwise continue whatever run ``path`` holds. None if there is none (or no torchrun)."""
    if key is None or not path.parent.is_dir():
        return None
    m = re.fullmatch(r"(.*?[^\d])(\d+)", path.name)
    stem = m.group(1) if m else path.name
    names = re.compile(re.escape(stem) + r"\d*")
    for cand in sorted(p for p in path.parent.iterdir() if names.fullmatch(p.name)):
        f = cand / LAUNCH_FILE
        if f.is_file() and f.read_text().strip() == key:
            return cand
    return None


def log_size(path: Path) -> int | None:
    """The size of ``path/train.log`` before a start writes to it (None: there is none)."""
    f = path / "train.log"
    return f.stat().st_size if f.is_file() else None


def choose_run_dir(asked: Path, keep: bool, restarted: bool) -> tuple[Path, bool, int | None]:
    """Where this start writes (rank 0): ``asked`` as it is when ``keep`` (``--resume``,
    ``--exist-ok``, ``--resume auto``), the directory this torchrun launch claimed when
    ``restarted`` (a numbered sibling when ``asked`` held another run), else a free one
    claimed (:func:`claim_run_dir`, marked with the launch). Returns the directory, whether
    this start made it, and its ``train.log`` size before (:func:`log_size`; None: the log
    is this start's), which a failed start gives back (:func:`forget_failed_start`)."""
    launched = launch_dir(asked, launch_key()) if restarted else None
    if keep or launched is not None:
        out = launched or asked
        made, before = not out.exists(), log_size(out)
        out.mkdir(parents=True, exist_ok=True)
        return out, made, before
    out, made = claim_run_dir(asked)
    mark_launch(out, launch_key())
    return out, made, None


def forget_failed_start(path: Path, made: bool, is_main: bool, log_before: int | None) -> None:
    """A start that fails before its first step (a data file missing, a bad --ckpt, the
    check before training, a refused --resume auto) leaves no trace: a directory this start
    ``made``, holding only what a start writes, goes (the corrected command would be sent to
    a numbered one); one it did not make (another run's, a resumed one's) gets its
    ``train.log`` back as it was (``log_before``: :func:`log_size`). Rank 0 does it; the
    error is printed by the caller."""
    if not is_main or not path.is_dir():
        return
    if made:
        if {p.name for p in path.iterdir()} <= START_FILES:
            close_log_file()
            shutil.rmtree(path, ignore_errors=True)
        return
    close_log_file()
    f = path / "train.log"
    if log_before is None:
        f.unlink(missing_ok=True)
        (path / LAUNCH_FILE).unlink(missing_ok=True)
    elif f.is_file():
        os.truncate(f, log_before)
