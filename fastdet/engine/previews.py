"""Predictions while training: the model's detections on a fixed set of val images.

At every evaluation the trainer calls :func:`log_val_predictions` (rank 0): the same
``NUM_IMAGES`` val images, preprocessed as evaluation does, go through ``model.predict``;
their detections above ``SCORE_THRESH`` are drawn on the original images, tiled into one
grid, logged to TensorBoard (``val/predictions``) and written to ``val_predictions.jpg``
in the run folder (the last evaluation's set stays there).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from fastdet.data.augment import ImageDecodeError, decode_image
from fastdet.data.preprocess import Preprocess, boxes_to_original
from fastdet.visualize import draw_detections, grid, save_image

log = logging.getLogger("fastdet")

NUM_IMAGES = 8
SCORE_THRESH = 0.3  # as fastdet.predict draws
FILE_NAME = "val_predictions.jpg"
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
    """Draw ``model``'s detections on the preview records; the written file, or None if none decoded.

    Args:
        model: the evaluated (EMA) model; put in eval mode here.
        records: the val set's ``ImageRecord``s (``.file``).
        tb: ``fastdet.engine.logging.TensorBoard`` (``image(tag, chw_uint8, step)``).
    """
    imgs = []
    for rec in preview_records(records):
        try:
            imgs.append(decode_image(rec.file))
        except ImageDecodeError:  # already counted as a skip by the val set's report
            continue
    if not imgs:
        return None
    model.eval()
    device = next(model.parameters()).device
    inputs, scales = zip(*(preprocess(img, (img_size, img_size)) for img in imgs))
    kw = {**predict_kwargs, "score_thresh": max(SCORE_THRESH, predict_kwargs.get("score_thresh", 0.0))}
    dets = model.predict(torch.stack(inputs).to(device), **kw)  # fp32: 8 images, not the hot path
    drawn = []
    for img, det, s in zip(imgs, dets, scales):
        boxes = boxes_to_original(det["boxes"].float().cpu(), s, img.shape[:2])
        drawn.append(draw_detections(img, boxes, det["scores"].cpu(), det["labels"].cpu(), class_names))
    picture = grid(drawn)  # [3, H, W] uint8
    tb.image(TAG, picture, step)
    path = Path(out_dir) / FILE_NAME
    save_image(picture, path)
    return path
