"""COCO bbox scoring behind one interface: faster-coco-eval when installed, pycocotools otherwise.

``score(gt, results, image_ids)`` returns a :class:`Scores`: the 12 standard numbers by
name (``STAT_NAMES``), AP and AP50 per class, the printed summary, and the accumulated
precision / score tables the PR and F1 curves are drawn from (``fastdet.eval.plots``).

``gt`` is an annotation file or a COCO document already in memory (YOLO and VOC sets,
``CocoDataset.coco_gt``). ``load_gt`` builds the ground truth once; a scorer that runs
at every evaluation (``fastdet.eval.async_scoring``) keeps it.

Back ends (``FASTDET_COCO_EVAL=auto|faster|pycocotools``, or ``backend=``):
``faster`` is faster-coco-eval's C++ ``COCOeval_faster`` (same algorithm, same 12
numbers: ``tests/test_scoring.py`` holds them equal on the demo and on a hostile set),
``pycocotools`` the reference. ``auto`` takes faster-coco-eval when it imports.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from fastdet.data.coco_fields import fill_coco_defaults, grouping_categories

log = logging.getLogger("fastdet")

STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
BACKENDS = ("auto", "faster", "pycocotools")


def resolve_backend(choice: Optional[str] = None) -> str:
    """``"faster"`` or ``"pycocotools"`` for ``choice`` (default: ``$FASTDET_COCO_EVAL`` or ``auto``)."""
    choice = choice or os.environ.get("FASTDET_COCO_EVAL", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"FASTDET_COCO_EVAL must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        try:
            import faster_coco_eval  # noqa: F401  (optional back end: is it installed?)
        except ImportError:
            return "pycocotools"
        return "faster"
    if choice == "faster":
        import faster_coco_eval  # noqa: F401  (raises the ImportError the user asked for)
    return choice


@dataclass
class GroundTruth:
    """A loaded ground truth for one back end (``coco`` is that back end's COCO object)."""

    backend: str
    coco: Any
    cat_ids: list[int]
    class_names: list[str]


def load_gt(gt: str | Path | dict, backend: Optional[str] = None) -> GroundTruth:
    """The ground truth of an annotation file or an in-memory COCO document."""
    backend = resolve_backend(backend)
    if isinstance(gt, dict):
        doc = copy.deepcopy(gt)
    else:
        with open(gt, "rb") as f:
            doc = json.load(f)
    # iscrowd / area / id that many tools leave out, as COCO defines them (load_coco counts them).
    fill_coco_defaults(doc)
    # Not classes: the loader leaves them out of the labels (fastdet.data.coco.load_coco_doc).
    groups = [c["id"] for c in grouping_categories(doc)]
    doc["categories"] = [c for c in doc["categories"] if c.get("id") not in groups]
    # COCOeval marks a detection's match with the ground truth's annotation id, 0 meaning
    # "unmatched", and indexes annotations by id: a box with id 0 (Roboflow numbers from 0)
    # matches as a false positive, boxes sharing an id are scored as one of them. Results
    # never refer to annotation ids, so they are numbered 1..N here, whatever the file says.
    for k, a in enumerate(doc["annotations"], 1):
        a["id"] = k
    with contextlib.redirect_stdout(io.StringIO()):
        if backend == "faster":
            from faster_coco_eval import COCO  # the back end chosen at run time (may be absent)

            coco = COCO(doc)
        else:
            from pycocotools.coco import COCO  # the back end chosen at run time

            coco = COCO()
            coco.dataset = doc
            coco.createIndex()
    cats = coco.dataset["categories"]
    return GroundTruth(backend, coco, [c["id"] for c in cats], [c["name"] for c in cats])


@dataclass
class Scores:
    """What one scoring produced.

    ``precision`` [T=10, R=101, K, A=4, M=3] and ``pr_scores`` (the score at each recall
    threshold, same shape) are COCOeval's accumulated tables (-1: no ground truth), K in
    the order of ``cat_ids``; None when there was nothing to score.
    """

    stats: dict[str, float]
    per_class: dict[str, dict[str, float]] = field(default_factory=dict)
    summary: str = ""
    precision: Optional[np.ndarray] = None
    pr_scores: Optional[np.ndarray] = None
    cat_ids: list[int] = field(default_factory=list)
    class_names: list[str] = field(default_factory=list)
    backend: str = ""
    # [K+1, K+1] counts, rows predicted class, columns true class, index K background
    # (``confusion_matrix``); None when there was nothing to score.
    confusion: Optional[np.ndarray] = None

    def per_class_table(self) -> str:
        """A text table: class, AP, AP50 (``-`` where the class has no ground truth)."""
        if not self.per_class:
            return ""
        width = max(8, *(len(n) for n in self.per_class))
        lines = [f"{'class':<{width}}  {'AP':>6}  {'AP50':>6}"]
        for name, v in self.per_class.items():
            ap, ap50 = (f"{v[k]:.4f}" if v[k] >= 0 else "     -" for k in ("AP", "AP50"))
            lines.append(f"{name:<{width}}  {ap:>6}  {ap50:>6}")
        return "\n".join(lines)


def _mean_valid(a: np.ndarray) -> float:
    a = a[a > -1]
    return float(a.mean()) if a.size else -1.0


def score(gt: GroundTruth | str | Path | dict, results: list[dict], image_ids: list[int],
          backend: Optional[str] = None) -> Scores:
    """COCOeval (bbox) of ``results`` on ``image_ids``: the 12 numbers, per class, and the tables."""
    if not isinstance(gt, GroundTruth):
        gt = load_gt(gt, backend)
    if not results:
        return Scores({k: 0.0 for k in STAT_NAMES}, cat_ids=gt.cat_ids, class_names=gt.class_names,
                      backend=gt.backend,
                      per_class={n: {"AP": 0.0, "AP50": 0.0} for n in gt.class_names},
                      confusion=confusion_matrix(gt, [], image_ids))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        if gt.backend == "faster":
            from faster_coco_eval import COCOeval_faster as COCOeval  # chosen at run time (may be absent)

            dt = gt.coco.loadRes(copy.deepcopy(results))
            ev = COCOeval(gt.coco, dt, "bbox", print_function=print)
        else:
            from pycocotools.cocoeval import COCOeval  # the back end chosen at run time

            dt = gt.coco.loadRes(copy.deepcopy(results))
            ev = COCOeval(gt.coco, dt, "bbox")
        ev.params.imgIds = sorted(image_ids)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = {k: float(v) for k, v in zip(STAT_NAMES, ev.stats[:12])}
    precision = np.asarray(ev.eval["precision"])  # [T, R, K, A, M]
    pr_scores = np.asarray(ev.eval["scores"])
    order = {c: k for k, c in enumerate(ev.params.catIds)}
    per_class = {}
    for name, cat in zip(gt.class_names, gt.cat_ids):
        k = order[cat]
        per_class[name] = {"AP": _mean_valid(precision[:, :, k, 0, -1]),
                           "AP50": _mean_valid(precision[0, :, k, 0, -1])}
    # Tables in the order of the categories array (COCOeval sorts by id).
    idx = [order[c] for c in gt.cat_ids]
    return Scores(stats, per_class, buf.getvalue().rstrip(), precision[:, :, idx], pr_scores[:, :, idx],
                  gt.cat_ids, gt.class_names, gt.backend, confusion_matrix(gt, results, image_ids))


CONF_THRESH = 0.25  # detections counted in the confusion matrix (ultralytics' default)
CONF_IOU = 0.5


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU [N, M] of xywh boxes ``a`` [N, 4] and ``b`` [M, 4]."""
    ax1, ay1 = a[:, 0] + a[:, 2], a[:, 1] + a[:, 3]
    bx1, by1 = b[:, 0] + b[:, 2], b[:, 1] + b[:, 3]
    iw = np.clip(np.minimum(ax1[:, None], bx1[None]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    ih = np.clip(np.minimum(ay1[:, None], by1[None]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = iw * ih
    union = (a[:, 2] * a[:, 3])[:, None] + (b[:, 2] * b[:, 3])[None] - inter
    return inter / np.maximum(union, 1e-9)


def confusion_matrix(gt: GroundTruth, results: list[dict], image_ids: list[int],
                     conf: float = CONF_THRESH, iou: float = CONF_IOU) -> np.ndarray:
    """``[K+1, K+1]`` counts: rows predicted class, columns true class, K = background.

    Per image, detections scoring at least ``conf`` are matched to the (non-crowd) ground
    truth class-agnostically, one to one, highest IoU first, IoU above ``iou``: a matched
    pair counts at (predicted, true); an unmatched box at (background, true); an unmatched
    detection at (predicted, background), unless it lies inside a crowd region (ignored,
    as COCO ignores it).
    """
    K = len(gt.cat_ids)
    col = {c: k for k, c in enumerate(gt.cat_ids)}
    m = np.zeros((K + 1, K + 1), np.int64)
    dets: dict[int, list[dict]] = {}
    for r in results:
        if r["score"] >= conf and r["category_id"] in col:
            dets.setdefault(r["image_id"], []).append(r)
    for img in image_ids:
        anns = gt.coco.imgToAnns.get(img, []) if hasattr(gt.coco, "imgToAnns") else []
        boxes = [a for a in anns if not a.get("iscrowd", 0)]
        crowd = [a for a in anns if a.get("iscrowd", 0)]
        d = dets.get(img, [])
        g_cls = np.array([col[a["category_id"]] for a in boxes], np.int64)
        d_cls = np.array([col[r["category_id"]] for r in d], np.int64)
        matched_g, matched_d = set(), set()
        if boxes and d:
            ious = _iou(np.array([r["bbox"] for r in d], np.float64), np.array([a["bbox"] for a in boxes], np.float64))
            pairs = np.argwhere(ious > iou)
            for i, j in sorted(pairs.tolist(), key=lambda p: -ious[p[0], p[1]]):
                if i in matched_d or j in matched_g:
                    continue
                matched_d.add(i)
                matched_g.add(j)
                m[d_cls[i], g_cls[j]] += 1
        for j, c in enumerate(g_cls):
            if j not in matched_g:
                m[K, c] += 1
        rest = [i for i in range(len(d)) if i not in matched_d]
        if rest and crowd:
            db = np.array([d[i]["bbox"] for i in rest], np.float64)
            cb = np.array([a["bbox"] for a in crowd], np.float64)
            # Intersection over the detection's area, as COCO matches crowd regions.
            x0 = np.maximum(db[:, None, 0], cb[None, :, 0])
            y0 = np.maximum(db[:, None, 1], cb[None, :, 1])
            x1 = np.minimum((db[:, 0] + db[:, 2])[:, None], (cb[:, 0] + cb[:, 2])[None])
            y1 = np.minimum((db[:, 1] + db[:, 3])[:, None], (cb[:, 1] + cb[:, 3])[None])
            ioa = (np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)) / np.maximum(db[:, 2:3] * db[:, 3:4], 1e-9)
            rest = [i for i, hit in zip(rest, (ioa > iou).any(1)) if not hit]
        for i in rest:
            m[d_cls[i], K] += 1
    return m
