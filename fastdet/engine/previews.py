"""Predictions while training: the model's detections on a fixed set of val images.

At every evaluation the trainer calls :func:`log_val_predictions` (rank 0): the same
``NUM_IMAGES`` val images, preprocessed as evaluation does (each on its orientation's
canvas, as ``fastdet.detect``: one batch per canvas), go through ``model.predict``;
each is drawn twice, side by side: its ground truth (class names) and the detections
scoring above ``SCORE_THRESH`` (class and score, the same colour per class), each tile
titled, and "no box scores above 0.30" written on a prediction tile without any box.
The pairs are tiled into one grid (two pairs a row), logged to TensorBoard
(``val/predictions``) and written to ``val_predictions.jpg`` in the run folder (the last
evaluation's set stays there).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torchvision.utils import make_grid

from fastdet.data.augment import ImageDecodeError, decode_image
from fastdet.data.preprocess import Preprocess, boxes_to_original, by_canvas
from fastdet.visualize import draw_detections, draw_ground_truth, fit_tile, save_image, titled

log = logging.getLogger("fastdet")

NUM_IMAGES = 8
SCORE_THRESH = 0.3  # as fastdet.predict draws
FILE_NAME = "val_predictions.jpg"
TILE = 320  # px: each image fitted into a square of this side
TAG = "val/predictions"


def preview_records(records: Sequence[Any], n: int = NUM_IMAGES) -> list[Any]:
    """``n`` records spread evenly over the val set: the same ones at every evaluation."""
    if len(records) <= n:
        return list(records)
    step = len(records) / n
    return [records[int(i * step)] for i in range(n)]


@torch.no_grad()
def log_val_predictions(model: nn.Module, records: Sequence[Any], preprocess: Preprocess, img_size: int,
                        predict_kwargs: dict[str, Any], class_names: Sequence[str], tb: Any,
                        out_dir: Path, step: int) -> Path | None:
    """Draw the ground truth and ``model``'s detections of the preview records; the written
    file, or None if none decoded.

    Args:
        model: the evaluated (EMA) model; put in eval mode here.
        records: the val set's ``ImageRecord``s (``.file``).
        tb: ``fastdet.runtime.logging.TensorBoard`` (``image(tag, chw_uint8, step)``).
    """
    imgs, kept = [], []
    for rec in preview_records(records):
        try:
            imgs.append(decode_image(rec.file))
            kept.append(rec)
        except ImageDecodeError:  # already counted as a skip by the val set's report
            continue
    if not imgs:
        return None
    model.eval()
    device = next(model.parameters()).device
    kw = {**predict_kwargs, "score_thresh": max(SCORE_THRESH, predict_kwargs.get("score_thresh", 0.0))}
    dets: list[dict] = [{} for _ in imgs]
    scales: list[tuple[float, float]] = [(1.0, 1.0)] * len(imgs)
    for canvas, idx in by_canvas([img.shape for img in imgs], preprocess, img_size).items():
        inputs, group_scales = zip(*(preprocess(imgs[i], canvas) for i in idx))
        for i, d, s in zip(idx, model.predict(torch.stack(inputs).to(device), **kw), group_scales):
            dets[i], scales[i] = d, s  # fp32: 8 images, not the hot path
    tiles = []
    for rec, img, det, s in zip(kept, imgs, dets, scales):
        gt = draw_ground_truth(img, torch.as_tensor(rec.boxes), torch.as_tensor(rec.labels), class_names)
        tiles.append(titled(fit_tile(gt, TILE), f"ground truth: {len(rec.boxes)} boxes"))
        boxes = boxes_to_original(det["boxes"].float().cpu(), s, img.shape[:2])
        pred = draw_detections(img, boxes, det["scores"].cpu(), det["labels"].cpu(), class_names)
        n = len(det["scores"])
        note = None if n else f"no box scores above {kw['score_thresh']:.2f}"
        tiles.append(titled(fit_tile(pred, TILE), f"predictions (score >= {kw['score_thresh']:.2f}): {n}", note))
    picture = make_grid(tiles, nrow=4, padding=2, pad_value=255)  # [3, H, W] uint8: pairs side by side
    tb.image(TAG, picture, step)
    path = Path(out_dir) / FILE_NAME
    save_image(picture, path)
    return path
