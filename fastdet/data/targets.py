"""Padding per-image ground truth to the fixed ``[B, M, ...]`` layout every model consumes.

``M = DataConfig.max_boxes`` for every batch, so compiled steps see static shapes
(``fastdet.data.layout`` describes the batch). An image with more than ``M`` boxes
keeps its ``M`` largest by area, in their original order, and the number dropped is
returned so the loader can report it. Padded slots hold zero boxes, label 0 and
``mask = False``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _check(boxes: np.ndarray, labels: np.ndarray, max_boxes: int) -> None:
    if max_boxes < 1:
        raise ValueError(f"max_boxes must be >= 1, got {max_boxes}")
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(f"boxes must be [N, 4], got shape {tuple(boxes.shape)}")
    if labels.shape != (boxes.shape[0],):
        raise ValueError(f"labels must be [N] with N = {boxes.shape[0]}, got shape {tuple(labels.shape)}")


def keep_largest(boxes: np.ndarray, max_boxes: int) -> np.ndarray:
    """Indices (ascending) of the ``max_boxes`` largest boxes by area; all when there are fewer.

    Ties are broken by position (the earlier box wins), so the choice is deterministic.
    """
    n = boxes.shape[0]
    if n <= max_boxes:
        return np.arange(n)
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    largest = np.argsort(-area, kind="stable")[:max_boxes]
    return np.sort(largest)


def pad_one(
    boxes: np.ndarray, labels: np.ndarray, max_boxes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Pad one image's ground truth (for DataLoader workers).

    Args:
        boxes: [N, 4] xyxy pixels.
        labels: [N] contiguous labels.
        max_boxes: M.

    Returns:
        ``(boxes [M, 4] float32, labels [M] int64, mask [M] bool, overflow)`` where
        ``overflow = max(N - M, 0)`` boxes were dropped (the smallest ones).
    """
    boxes = np.asarray(boxes, dtype=np.float32)
    if boxes.size == 0:
        boxes = boxes.reshape(0, 4)  # an image without boxes may arrive as shape [0] or [0, 4]
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    _check(boxes, labels, max_boxes)
    idx = keep_largest(boxes, max_boxes)
    k = len(idx)
    out_boxes = np.zeros((max_boxes, 4), np.float32)
    out_labels = np.zeros(max_boxes, np.int64)
    out_mask = np.zeros(max_boxes, bool)
    out_boxes[:k] = boxes[idx]
    out_labels[:k] = labels[idx]
    out_mask[:k] = True
    return out_boxes, out_labels, out_mask, boxes.shape[0] - k


def pad_targets(
    boxes_list: Sequence[np.ndarray], labels_list: Sequence[np.ndarray], max_boxes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Pad a batch of per-image ground truth.

    Args:
        boxes_list: B arrays [N_i, 4] xyxy pixels.
        labels_list: B arrays [N_i] contiguous labels.
        max_boxes: M.

    Returns:
        ``(gt_boxes [B, M, 4] float32, gt_labels [B, M] int64, gt_mask [B, M] bool, overflow)``
        with ``overflow`` the total number of boxes dropped over the batch.
    """
    if len(boxes_list) != len(labels_list):
        raise ValueError(f"{len(boxes_list)} box arrays but {len(labels_list)} label arrays")
    B = len(boxes_list)
    gt_boxes = np.zeros((B, max_boxes, 4), np.float32)
    gt_labels = np.zeros((B, max_boxes), np.int64)
    gt_mask = np.zeros((B, max_boxes), bool)
    overflow = 0
    for i, (b, l) in enumerate(zip(boxes_list, labels_list)):
        gt_boxes[i], gt_labels[i], gt_mask[i], o = pad_one(b, l, max_boxes)
        overflow += o
    return gt_boxes, gt_labels, gt_mask, overflow

