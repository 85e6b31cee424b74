"""COCO evaluation, gathered across ranks, scored by ``fastdet.eval.scoring``.

Every rank predicts on its shard of the val set; detections are mapped back to the
original image sizes, converted to COCO results (category ids restored from the
contiguous labels), gathered on rank 0, de-duplicated by image id and scored by
``COCOeval`` against the original annotation file, or the in-memory document of a YOLO or VOC set (crowd
and difficult boxes included, as COCO scores them), with faster-coco-eval or pycocotools.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable

import numpy as np
import torch
from torch import Tensor, nn

from fastdet.data.preprocess import boxes_to_original
from fastdet.runtime import dist
from fastdet.eval.scoring import score

log = logging.getLogger("fastdet")



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


def coco_eval(ann_file: str | dict, results: list[dict], image_ids: list[int]) -> dict[str, float]:
    """COCOeval (bbox) on an annotation file or in-memory COCO document: the 12 stats by name."""
    scores = score(ann_file, results, image_ids)
    if scores.summary:
        log.info("COCO bbox evaluation (%s):\n%s", scores.backend, scores.summary)
        log.info("per-class AP:\n%s", scores.per_class_table())
    return scores.stats


def gt_source(dataset) -> str | dict:
    """What ``dataset`` is scored against: its in-memory COCO document (YOLO, VOC) or its file."""
    gt = getattr(dataset, "coco_gt", None)
    return gt if gt is not None else str(dataset.ann_file)


def left_out_ids(loader, dataset) -> set[int]:
    """The ids of ``dataset``'s images this rank's ``loader`` left out, each counted and said
    in its report: files that did not decode while read (``loader.skipped``) and records the
    loader was not given (DALI's decode check before it)."""
    by_file = {r.file: r.image_id for r in dataset.records}
    lost = {by_file[f] for f in getattr(loader, "skipped", {}) if f in by_file}
    given = getattr(loader, "records", None)
    if given is not None:
        lost |= set(by_file.values()) - {r.image_id for r in given}
    return lost


def gather_predictions(model: nn.Module, loader, dataset, amp_dtype: torch.dtype | None,
                       predict_kwargs: dict[str, Any]) -> tuple[list[dict], list[int]] | None:
    """Every rank predicts its shard; rank 0 gets ``(results, image ids)``, the others None.
    An image that does not decode is left out of the scoring (counted and named by the
    loader, and said here); any other image missing is a loader's fault and raises."""
    results, seen = predict_coco(model, loader, dataset.cat_ids, amp_dtype, predict_kwargs)
    gathered = dist.all_gather_objects((results, sorted(seen), sorted(left_out_ids(loader, dataset))))
    if _rank() != 0:
        return None
    all_seen: set[int] = set()
    merged: list[dict] = []
    lost: set[int] = set()
    for res, ids, left_out in gathered:
        new = set(ids) - all_seen  # a duplicated image (padding) counts once
        merged += [r for r in res if r["image_id"] in new]
        all_seen |= new
        lost |= set(left_out)
    expected = {r.image_id for r in dataset.records}
    missing = expected - all_seen
    if missing - lost:
        raise RuntimeError(f"evaluation saw {len(all_seen)} of {len(expected)} val images "
                           f"({len(missing - lost)} missing that decode): the eval loader dropped images")
    if missing:
        log.warning("%d of %d val images do not decode and are left out of this evaluation (scored on the other "
                    "%d; the log names each file)", len(missing), len(expected), len(all_seen))
    return merged, sorted(all_seen)


def evaluate(model: nn.Module, loader, dataset, amp_dtype: torch.dtype | None,
             predict_kwargs: dict[str, Any]) -> dict[str, float]:
    """Evaluate on every rank's shard; rank 0 scores, every rank gets the stats."""
    gathered = gather_predictions(model, loader, dataset, amp_dtype, predict_kwargs)
    stats: dict[str, float] | None = None
    if gathered is not None:
        stats = coco_eval(gt_source(dataset), *gathered)
    return dist.broadcast_object(stats)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
