"""What runs at the end of training runs at the start, on a tiny input.

Before the first training step the trainer evaluates its (untrained) weights on a few val
images per rank (:func:`preflight_images`, all of one canvas: :func:`tiny_subset`) through the real path (the eval loader with the family's preprocessing,
``model.predict``, the gather across ranks, the COCO scorer on the val annotation file:
faster-coco-eval, or pycocotools, ``fastdet.eval.scoring``), scores a made-up detection per
image so that the scorer's ``loadRes`` / ``evaluate`` / ``accumulate`` run even when the
untrained model detects nothing, and writes (then
removes) a checkpoint of the full state next to the run. A dataset, environment or disk
problem then fails in the first minute with one line, not at the first evaluation hours in.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from fastdet.data.coco import CocoDataset
from fastdet.data.schedule import Canvases
from fastdet.runtime.checkpoint import rng_state, save_checkpoint, set_rng_state
from fastdet.eval import coco as coco_eval_mod

log = logging.getLogger("fastdet")


class PreflightError(RuntimeError):
    """The evaluation or checkpoint path fails before training; one line."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The COCO table of a made-up result is noise in the log."""
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def preflight_images(eval_batch_size: int, device: torch.device) -> int:
    """Val images per rank that the check evaluates. On a GPU a whole eval batch: it also
    shows that the batch fits in device memory, in well under a second (the images are of
    one canvas, the largest, :func:`one_canvas`). On the CPU an image at the eval size costs
    up to a second of eager forward (PP-YOLO r50vd_dcn at 608 px: a 16-image batch took 12 s
    of a warm ``--compile`` launch's 30 s to its first step), so two: still a batch, so
    collation and padding of unequal images run."""
    return eval_batch_size if device.type == "cuda" else min(2, eval_batch_size)


def one_canvas(aspects: np.ndarray, n: int, canvases: Canvases, size: int) -> np.ndarray:
    """[<= n] int64 indices, in file order, of records (``aspects`` w / h [N]) that all get one
    canvas at ``size``: the largest-area canvas with ``n`` of them, else the most populated
    (ties: the larger). Evaluation batches hold one canvas (``EvalSchedule``), so the first
    ``n`` records of a keep-ratio set (FCOS: landscape, portrait, square) would split into
    smaller batches than the evaluation's largest, and the check's batch would not show
    that one fits in memory. One canvas (stretch, letterbox): the first ``n``."""
    buckets = canvases.buckets(size)
    own = canvases.own(aspects)  # [N] each record's canvas, an index into buckets
    counts = np.bincount(own, minlength=len(buckets))
    area = [h * w for h, w in buckets]
    full = [k for k in range(len(buckets)) if counts[k] >= n]
    k = (max(full, key=lambda k: area[k]) if full
         else max(range(len(buckets)), key=lambda k: (counts[k], area[k])))
    return np.flatnonzero(own == k)[:n]


def tiny_subset(dataset: CocoDataset, n: int, canvases: Canvases = Canvases(), size: int = 1) -> CocoDataset:
    """``n`` records of ``dataset`` on one canvas (:func:`one_canvas`; one canvas: the first
    ``n``), same annotation file and categories. Split strided over ranks by the eval loader,
    each rank's share is one batch of that canvas."""
    aspects = np.array([r.width / r.height for r in dataset.records], np.float64)
    return replace(dataset, records=[dataset.records[i] for i in one_canvas(aspects, n, canvases, size)])


def preflight_set(val_set: CocoDataset, eval_batch_size: int, device: torch.device, world_size: int,
                  canvases: Canvases, size: int) -> CocoDataset:
    """The val images the check evaluates: :func:`preflight_images` per rank, of one canvas
    (:func:`tiny_subset`: the largest the val set fills), so each rank's share is one batch as
    large as the evaluation's largest."""
    return tiny_subset(val_set, preflight_images(eval_batch_size, device) * world_size, canvases, size)


def fake_results(dataset: CocoDataset) -> list[dict[str, Any]]:
    """One made-up detection per image (a 16 px box of the first category), COCO results format."""
    return [{"image_id": r.image_id, "category_id": dataset.cat_ids[0],
             "bbox": [0.0, 0.0, float(min(16, r.width)), float(min(16, r.height))], "score": 0.5}
            for r in dataset.records]


def check_end_of_run_path(model: nn.Module, val_set: CocoDataset, build_loader: Callable[[CocoDataset], Any],
                          amp_dtype: torch.dtype | None, predict_kwargs: dict[str, Any], tiny: CocoDataset,
                          state: Callable[[], dict[str, Any]], out: Path, is_main: bool) -> float:
    """Run the evaluation and checkpoint paths once on the val images ``tiny``
    (:func:`tiny_subset` of ``val_set``); returns the seconds it took. Raises
    :class:`PreflightError` (one line naming the stage) on failure. The random streams are
    left as they were (a resumed run repeats exactly)."""
    t = time.perf_counter()
    rng = rng_state()
    stage = "building the eval loader"
    try:
        loader = build_loader(tiny)
        stage = "evaluating a val batch"
        with _quiet():
            coco_eval_mod.evaluate(model, loader, tiny, amp_dtype, predict_kwargs)
            if is_main:
                stage = f"scoring against the ground truth of {val_set.ann_file}"
                coco_eval_mod.coco_eval(coco_eval_mod.gt_source(val_set), fake_results(tiny), tiny.image_ids)
        if is_main:
            stage = f"writing a checkpoint into {out}"
            probe = out / ".preflight.pth"
            try:
                save_checkpoint(probe, state())
            finally:
                probe.unlink(missing_ok=True)
    except Exception as e:
        raise PreflightError(f"the end-of-run path fails before training, {stage}: {_first_line(e)}") from e
    finally:
        set_rng_state(rng)
    return time.perf_counter() - t
