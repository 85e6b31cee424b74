"""COCO evaluation with pycocotools, gathered across ranks.

Every rank predicts on its shard of the val set; detections are mapped back to the
original image sizes, converted to COCO results (category ids restored from the
contiguous labels), gathered on rank 0, de-duplicated by image id and scored by
``COCOeval`` against the original annotation file (crowd boxes included, as COCO
scores them).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from typing import Any, Iterable

import numpy as np
import torch
from torch import Tensor, nn

from fastdet.data.coco import fill_coco_defaults
from fastdet.data.preprocess import boxes_to_original
from fastdet.engine import dist

log = logging.getLogger("fastdet")

STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


@torch.no_grad()
def predict_coco(model: nn.Module, loader: Iterable[dict[str, Tensor]], cat_ids: list[int],
                 amp_dtype: torch.dtype | None, predict_kwargs: dict[str, Any]
                 ) -> tuple[list[dict], set[int]]:
    """COCO-format detections of this rank, and the image ids it saw."""
    results: list[dict] = []
    seen: set[int] = set()
    model.eval()
    device = next(model.parameters()).device
    amp = (torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None
           else contextlib.nullcontext())
    cat_ids_arr = np.asarray(cat_ids, dtype=np.int64)
    for batch in loader:
        images = batch["images"]
        if images.shape[0] == 0:  # a short rank's empty last batch
            continue
        with amp:
            dets = model.predict(images, **predict_kwargs)
        ids = batch["image_ids"].tolist()
        sizes = batch["orig_sizes"].cpu()
        scales = batch["scale_factors"].cpu()  # [B, 2] (sx, sy): letterbox and keep-ratio map back too
        for det, image_id, orig, scale in zip(dets, ids, sizes, scales):
            seen.add(int(image_id))
            boxes = boxes_to_original(det["boxes"].float().cpu(), scale, orig)
            xywh = boxes.numpy().astype(np.float64)
            xywh[:, 2:] -= xywh[:, :2]
            scores = det["scores"].float().cpu().numpy()
            labels = cat_ids_arr[det["labels"].cpu().numpy()]
            for b, s, c in zip(xywh, scores, labels):
                results.append({"image_id": int(image_id), "category_id": int(c),
                                "bbox": [round(float(v), 3) for v in b], "score": round(float(s), 5)})
    return results, seen


def coco_ground_truth(ann_file: str):
    """pycocotools' ``COCO`` of ``ann_file`` with the fields it needs and many tools leave
    out (``iscrowd``, ``area``, ``id``) filled in as COCO defines them (as ``load_coco`` does)."""
    from pycocotools.coco import COCO

    with open(ann_file, "rb") as f:
        doc = json.load(f)
    fill_coco_defaults(doc)
    gt = COCO()
    gt.dataset = doc
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt


def coco_eval(ann_file: str, results: list[dict], image_ids: list[int]) -> dict[str, float]:
    """Run COCOeval (bbox) and return the 12 standard stats by name."""
    from pycocotools.cocoeval import COCOeval

    gt = coco_ground_truth(ann_file)
    if not results:
        return {k: 0.0 for k in STAT_NAMES}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        dt = gt.loadRes(results)
        ev = COCOeval(gt, dt, "bbox")
        ev.params.imgIds = sorted(image_ids)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    log.info("COCO bbox evaluation:\n%s", buf.getvalue().rstrip())
    return {k: float(v) for k, v in zip(STAT_NAMES, ev.stats)}


def evaluate(model: nn.Module, loader, dataset, amp_dtype: torch.dtype | None,
             predict_kwargs: dict[str, Any]) -> dict[str, float]:
    """Evaluate on every rank's shard; rank 0 scores, every rank gets the stats."""
    results, seen = predict_coco(model, loader, dataset.cat_ids, amp_dtype, predict_kwargs)
    gathered = dist.all_gather_objects((results, sorted(seen)))
    stats: dict[str, float] | None = None
    if _rank() == 0:
        all_seen: set[int] = set()
        merged: list[dict] = []
        for res, ids in gathered:
            new = set(ids) - all_seen  # a duplicated image (padding) counts once
            merged += [r for r in res if r["image_id"] in new]
            all_seen |= new
        expected = {r.image_id for r in dataset.records}
        if all_seen != expected:
            missing = len(expected - all_seen)
            raise RuntimeError(f"evaluation saw {len(all_seen)} of {len(expected)} val images "
                               f"({missing} missing): the eval loader dropped images")
        stats = coco_eval(dataset.ann_file, merged, sorted(all_seen))
    return dist.broadcast_object(stats)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
