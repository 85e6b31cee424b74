"""YOLOv3 grid targets on the device: PaddleDetection's ``Gt2YoloTarget`` from padded boxes.

PaddleDetection builds these grids per image in its CPU data workers
(ppdet/data/transform/batch_operators.py ``Gt2YoloTarget``); here they are built from the
batch's padded ground truth inside the training step, with static shapes.

Semantics (Paddle's loop, box by box, ``iou_thresh`` 1.0 as both PP-YOLO configs use):

- a box is skipped when padded (``gt_mask`` false), without area or with a score <= 0;
- its best anchor over *all* anchors is the first with the highest shape-only IoU
  (both boxes at the origin, sizes normalised by the image); the box is assigned only
  at the level whose mask holds that anchor, in cell ``(int(cy * gh), int(cx * gw))``;
- channels: ``tx = cx * gw - gi``, ``ty``, ``tw = log(w_px / anchor_w)``, ``th``,
  ``tscale = 2 - w * h`` (normalised), ``tobj`` = the box's score (1, or the mixup
  weight), then the one-hot class;
- two boxes on one anchor and cell: the later box's six values stay and both class
  channels are 1 (Paddle's loop overwrites the values and sets the new class's 1
  without clearing the old one).

This module holds the torch reference (the truth the C++ and CUDA kernels are tested
against) and the public function, which dispatches like every fastdet op.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from fastdet.ops.dispatch import backend_for

_MAX_ANCHORS, _MAX_LEVELS = 32, 8  # csrc/yolo_targets.h


def anchor_tables(num_anchors: int, anchor_masks: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Per anchor: the level whose mask holds it (-1 if none) and its index in that mask."""
    level, slot = [-1] * num_anchors, [-1] * num_anchors
    for lvl, mask in enumerate(anchor_masks):
        for j, k in enumerate(mask):
            if not 0 <= k < num_anchors:
                raise ValueError(f"fastdet.ops.yolo_targets: anchor mask {list(mask)} names anchor {k}, "
                                 f"but there are {num_anchors} anchors")
            if level[k] != -1:
                raise ValueError(f"fastdet.ops.yolo_targets: anchor {k} is in two masks")
            level[k], slot[k] = lvl, j
    return level, slot


# (values, dtype, device) -> the values as a device tensor, made once (see _device_table).
_TABLES: dict[tuple, Tensor] = {}


def _device_table(values: Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A constant table (anchor sizes, anchor levels) on ``device``, copied from the host
    once per process and reused: a copy per call would be a pageable host-to-device copy
    in every step, which a CUDA-graph capture refuses and ``--sync-debug`` rejects. The
    first call is in the warm-up, before any capture. Under ``torch.compile`` the table is
    a constant of the graph instead."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    key = (tuple(map(tuple, values)) if values and isinstance(values[0], (tuple, list)) else tuple(values),
           dtype, str(device))
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def yolo_targets_reference(
    gt_boxes: Tensor,
    gt_labels: Tensor,
    gt_mask: Tensor,
    gt_scores: Tensor,
    anchors: Sequence[tuple[float, float]],
    anchor_masks: Sequence[Sequence[int]],
    strides: Sequence[int],
    img_hw: tuple[int, int],
    num_classes: int,
) -> list[Tensor]:
    """Plain-torch ``yolo_targets`` (float32), batched with static shapes and deterministic.

    Duplicates are resolved without a racy scatter: each cell's winner is the scatter
    *maximum* of the indices of the boxes that land there (order-free), the six values are
    then gathered from the winner, and the class channels are a scatter maximum of 1s.
    Every float operation matches csrc/yolo_targets.h (divisions by full tensors, not by
    scalars, which CUDA would turn into multiplications by a reciprocal).
    """
    B, M = gt_labels.shape
    H, W = (int(v) for v in img_hw)
    dev = gt_boxes.device
    level_of, slot_of = anchor_tables(len(anchors), anchor_masks)
    boxes = gt_boxes.float()
    x1, y1, x2, y2 = boxes.unbind(-1)  # [B, M]
    Wt, Ht = torch.full_like(x1, W), torch.full_like(x1, H)
    score = gt_scores.float()
    gw, gh = (x2 - x1) / Wt, (y2 - y1) / Ht
    valid = gt_mask.bool() & (gw > 0) & (gh > 0) & (score > 0)
    cx, cy = (x1 + x2) * 0.5 / Wt, (y1 + y2) * 0.5 / Ht

    an = _device_table(anchors, torch.float32, dev)  # [K, 2] px
    K = an.shape[0]
    aw = an[:, 0] / torch.full((K,), W, dtype=torch.float32, device=dev)
    ah = an[:, 1] / torch.full((K,), H, dtype=torch.float32, device=dev)
    inter = torch.minimum(gw[..., None], aw) * torch.minimum(gh[..., None], ah)  # [B, M, K]
    iou = inter / ((gw * gh)[..., None] + aw * ah - inter)
    best = torch.nan_to_num(iou, nan=-1.0).argmax(-1)  # [B, M]; argmax keeps the first maximum
    best_level = _device_table(level_of, torch.int64, dev)[best]
    best_slot = _device_table(slot_of, torch.int64, dev)[best]
    tw = torch.log(gw * Wt / an[best, 0])
    th = torch.log(gh * Ht / an[best, 1])
    tscale = 2.0 - gw * gh
    labels = gt_labels.long().clamp(0, num_classes - 1)
    box_index = torch.arange(M, device=dev).expand(B, M)

    out = []
    for lvl, s in enumerate(strides):
        nh, nw = H // s, W // s
        na = sum(1 for v in level_of if v == lvl)
        cells = na * nh * nw
        on = valid & (best_level == lvl)  # [B, M]
        gx, gy = cx * float(nw), cy * float(nh)
        gi = gx.long().clamp(0, nw - 1)  # truncation, as Paddle's int()
        gj = gy.long().clamp(0, nh - 1)
        cell = torch.where(on, (best_slot.clamp(min=0) * nh + gj) * nw + gi, 0)  # [B, M]
        winner = torch.full((B, cells), -1, dtype=torch.long, device=dev)
        winner = winner.scatter_reduce(1, cell, torch.where(on, box_index, -1), "amax")  # [B, cells]
        values = torch.stack([gx - gi.float(), gy - gj.float(), tw, th, tscale, score], dim=-1)  # [B, M, 6]
        # Row M is all zeros: the cells no box claimed gather it.
        values = torch.cat([torch.where(on[..., None], values, 0.0), values.new_zeros(B, 1, 6)], dim=1)
        winner = torch.where(winner >= 0, winner, M)
        picked = values.gather(1, winner[..., None].expand(B, cells, 6))  # [B, cells, 6]
        one_hot = torch.zeros(B, cells * num_classes, device=dev)
        one_hot = one_hot.scatter_reduce(1, cell * num_classes + labels, on.float(), "amax")
        grid = torch.cat([picked, one_hot.view(B, cells, num_classes)], dim=-1)  # [B, cells, 6 + C]
        out.append(grid.view(B, na, nh, nw, 6 + num_classes).permute(0, 1, 4, 2, 3).contiguous())
    return out


def yolo_targets(
    gt_boxes: Tensor,
    gt_labels: Tensor,
    gt_mask: Tensor,
    gt_scores: Tensor | None,
    anchors: Sequence[Sequence[float]] | Tensor,
    anchor_masks: Sequence[Sequence[int]],
    strides: Sequence[int],
    img_hw: tuple[int, int],
    num_classes: int,
    iou_thresh: float = 1.0,
) -> list[Tensor]:
    """Gt2YoloTarget grids, one ``[B, len(mask), 6 + C, H/s, W/s]`` float32 tensor per level.

    Args:
        gt_boxes: [B, M, 4] xyxy input px; gt_labels [B, M] in [0, C); gt_mask [B, M] bool;
            gt_scores [B, M] (None: all ones).
        anchors: [K, 2] (w, h) px, constants (a list or a CPU tensor); anchor_masks: the
            anchors of each level; strides: each level's stride; img_hw: the input size.
        iou_thresh: Paddle's extra-anchor threshold; only 1.0 (no extra anchors, the
            PP-YOLO setting) is supported, because Paddle's rule for lower values depends on
            which cells earlier boxes already filled, which has no order-free form.
    """
    if iou_thresh != 1.0:
        raise ValueError(f"fastdet.ops.yolo_targets: only iou_thresh=1.0 is supported (PP-YOLO's setting), "
                         f"got {iou_thresh}")
    if gt_boxes.dim() != 3 or gt_boxes.shape[-1] != 4:
        raise ValueError(f"fastdet.ops.yolo_targets: gt_boxes must be [B, M, 4], got {tuple(gt_boxes.shape)}")
    if len(anchor_masks) != len(strides):
        raise ValueError(f"fastdet.ops.yolo_targets: {len(anchor_masks)} anchor masks but {len(strides)} strides")
    pairs = [tuple(float(v) for v in a) for a in (anchors.tolist() if isinstance(anchors, Tensor) else anchors)]
    if gt_scores is None:
        gt_scores = gt_mask.float()
    backend = backend_for("yolo_targets", gt_boxes.device.type, torch.compiler.is_compiling())
    if backend not in ("cpp", "cuda") or len(pairs) > _MAX_ANCHORS or len(strides) > _MAX_LEVELS:
        return yolo_targets_reference(gt_boxes, gt_labels, gt_mask, gt_scores, pairs, anchor_masks, strides,
                                      img_hw, num_classes)
    level, slot = anchor_tables(len(pairs), anchor_masks)
    flat = [v for a in pairs for v in a]
    return torch.ops.fastdet.yolo_targets(
        gt_boxes.detach().float(), gt_labels.long(), gt_mask.bool(), gt_scores.detach().float(), flat, level, slot,
        [int(s) for s in strides], int(img_hw[0]), int(img_hw[1]), int(num_classes))
