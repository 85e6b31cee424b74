"""Scoring off the training path: COCOeval in a background process while training goes on.

The ranks predict on their val shards and gather the detections on rank 0 (the only
part that needs the model); rank 0 hands them to :class:`AsyncScorer` and every rank
goes back to training. The scorer's process loads the ground truth once (a file path, or
a YOLO/VOC set's in-memory document) and scores each job in turn with
``fastdet.eval.scoring.score``; finished jobs are collected without blocking
(:meth:`AsyncScorer.poll`) at the trainer's log points, or waited for
(:meth:`AsyncScorer.wait`) before the run exits. Each job carries what the trainer needs
to act on it later: the step and epoch it belongs to and a CPU copy of the evaluated
state, from which ``best.pth`` is written (not from the weights current when the score
arrives). As MLPerf's RetinaNet reference scores: asynchronously, in its own process.

The process is started with ``spawn`` (never ``fork``: the trainer holds CUDA and
threads) and without the trainer's main module, and it imports no torch (scoring and
plots need numpy, the COCO back end and matplotlib); a job that fails comes back as an
error naming it, and a scorer whose process died raises on the next poll instead of hanging.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import queue
import signal
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from fastdet.eval.plots import draw_evaluation
from fastdet.eval.scoring import load_gt

log = logging.getLogger("fastdet")

DEFAULT_SCORE_FN = "fastdet.eval.scoring:score"


@dataclass
class ScoredJob:
    """One evaluation's result, as handed back to the trainer."""

    job_id: int
    meta: dict[str, Any]  # what the submitter attached: step, epoch, the evaluated state ...
    scores: Any = None  # fastdet.eval.scoring.Scores
    error: Optional[str] = None
    seconds: float = 0.0  # time the process spent scoring
    extra: dict[str, Any] = field(default_factory=dict)


def _resolve(fn: str) -> Callable:
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker(gt_source: Any, backend: Optional[str], score_fn: str, plot_dir: Optional[str], jobs: Any,
            done: Any) -> None:
    """The background process: load the ground truth once, then score (and draw) jobs until None."""
    # Ctrl-C reaches the terminal's whole process group: the trainer stops at a step
    # boundary and waits for its scores (or drops them); the scorer must not die under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        gt = load_gt(gt_source, backend)
        fn = _resolve(score_fn)
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
        done.put((-1, None, f"{type(e).__name__}: {e}", 0.0, {}))
        return
    while True:
        job = jobs.get()
        if job is None:
            return
        job_id, results, image_ids, step = job
        t = time.perf_counter()
        try:
            scores = fn(gt, results, image_ids)
        except Exception as e:  # noqa: BLE001 - one failed job is reported, the next still runs
            done.put((job_id, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                      time.perf_counter() - t, {}))
            continue
        seconds = time.perf_counter() - t
        extra: dict[str, Any] = {}
        if plot_dir is not None:
            try:
                extra["plots"] = draw_evaluation(scores, plot_dir, step)
            except Exception as e:  # noqa: BLE001 - a failed drawing must not lose the score
                extra["plot_error"] = f"{type(e).__name__}: {e}"
        done.put((job_id, scores, None, seconds, extra))


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a process is started: ``spawn`` re-runs the parent's main module in the child
    (as ``__mp_main__``, so that what it defines unpickles there). The scorer's target and
    arguments live in fastdet, and the trainer's main module (``python -m fastdet.train``)
    would import torch, torchvision, Dynamo and every family there for nothing: ~2 s of CPU
    beside the training at each launch. A bare stand-in has no ``__spec__`` or ``__file__``,
    so the child runs no main module; the real one is back before ``start()`` returns."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class AsyncScorer:
    """A background scoring process for one ground truth (rank 0 only).

    Args:
        gt_source: an annotation file path or an in-memory COCO document.
        backend: ``fastdet.eval.scoring`` back end (None: ``$FASTDET_COCO_EVAL`` or auto).
        score_fn: ``"module:function"`` called as ``fn(gt, results, image_ids)`` in the
            process (the default is ``fastdet.eval.scoring.score``); the module is imported
            there by name, so it cannot be ``__main__`` (the parent's main module is not run).
        plot_dir: where the process draws each scoring's PR / F1 curves and confusion
            matrix (``fastdet.eval.plots.draw_evaluation``); None: not drawn.
    """

    def __init__(self, gt_source: Any, backend: Optional[str] = None, score_fn: str = DEFAULT_SCORE_FN,
                 plot_dir: Optional[str] = None):
        ctx = mp.get_context("spawn")
        self._jobs = ctx.Queue()
        self._done = ctx.Queue()
        self._proc = ctx.Process(target=_worker, args=(gt_source, backend, score_fn,
                                                                   None if plot_dir is None else str(plot_dir),
                                                                   self._jobs, self._done),
                                 name="fastdet-scorer", daemon=True)
        with _main_module_hidden():
            self._proc.start()
        self._meta: dict[int, dict[str, Any]] = {}
        self._next = 0

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet collected."""
        return len(self._meta)

    def submit(self, results: list[dict], image_ids: list[int], meta: dict[str, Any]) -> int:
        """Queue one scoring; returns its id. ``meta`` stays here and comes back with the result."""
        job_id = self._next
        self._next += 1
        self._meta[job_id] = meta
        self._jobs.put((job_id, results, image_ids, meta.get("step", job_id)))
        return job_id

    def _collect(self, item: tuple) -> ScoredJob:
        job_id, scores, error, seconds, extra = item
        if job_id < 0:
            raise RuntimeError(f"the scoring process could not load the ground truth: {error}")
        return ScoredJob(job_id, self._meta.pop(job_id), scores, error, seconds, extra)

    def poll(self) -> list[ScoredJob]:
        """The jobs finished so far, without waiting (in the order they finished)."""
        out = []
        while self._meta:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                break
            out.append(self._collect(item))
        if self._meta and not self._proc.is_alive() and self._done.empty():
            raise RuntimeError(f"the scoring process exited (code {self._proc.exitcode}) with "
                               f"{len(self._meta)} evaluation(s) unscored")
        return out

    def wait(self, timeout: Optional[float] = None) -> list[ScoredJob]:
        """Every pending job, waiting for them (``timeout`` seconds in all; None: no limit)."""
        out = []
        end = None if timeout is None else time.monotonic() + timeout
        while self._meta:
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                item = self._done.get(timeout=min(5.0, left) if left is not None else 5.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the scoring process exited (code {self._proc.exitcode}) with "
                                       f"{len(self._meta)} evaluation(s) unscored") from None
                if end is not None and time.monotonic() >= end:
                    raise TimeoutError(f"{len(self._meta)} evaluation(s) not scored after {timeout:.0f} s") from None
                continue
            out.append(self._collect(item))
        return out

    def close(self) -> None:
        """Stop the process (after the jobs already queued, which are then lost if not waited for)."""
        if self._proc.is_alive():
            self._jobs.put(None)
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=5)
        self._jobs.close()
        self._done.close()
