"""Synthetic, PP-YOLOE-shaped inputs for the kernel tests and ``bench/kernels.py``.

Anchors follow PP-YOLOE (``generate_anchors_for_grid_cell``: points at cell centres of
strides 8/16/32, anchor boxes of side ``5 * stride``); ground truth is padded to ``M``
slots with zero boxes and label 0, as the loaders pad it; predicted boxes are spread
around each anchor point like a partly trained head's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor


@dataclass
class AssignInputs:
    pred_scores: Tensor  # [B, A, C] probabilities
    pred_bboxes: Tensor  # [B, A, 4] xyxy px
    anchor_points: Tensor  # [A, 2] px
    anchors: Tensor  # [A, 4] anchor boxes px
    num_anchors_list: list[int]
    gt_labels: Tensor  # [B, M, 1] int64
    gt_bboxes: Tensor  # [B, M, 4] xyxy px, zeros in padded slots
    pad_gt_mask: Tensor  # [B, M, 1] float 0/1
    num_classes: int

    def tal_args(self) -> tuple:
        return (self.pred_scores, self.pred_bboxes, self.anchor_points, self.gt_labels, self.gt_bboxes,
                self.pad_gt_mask, self.num_classes)

    def simota_args(self) -> tuple:
        """SimOTA's inputs: the points are YOLOX's cell centres (strides 8, 16, 32, finest first)."""
        strides = torch.cat([torch.full((n,), float(s), device=self.anchor_points.device)
                             for n, s in zip(self.num_anchors_list, (8, 16, 32))])
        return (self.pred_scores, self.pred_bboxes, self.anchor_points, strides, self.gt_bboxes,
                self.gt_labels.squeeze(-1), self.pad_gt_mask.squeeze(-1) > 0)

    def atss_args(self) -> tuple:
        return (self.anchors, self.num_anchors_list, self.gt_labels, self.gt_bboxes, self.pad_gt_mask,
                self.num_classes)


def anchor_grid(img_size: int, strides: Sequence[int] = (8, 16, 32), cell: float = 5.0,
                device: Optional[torch.device] = None) -> tuple[Tensor, Tensor, list[int]]:
    """PP-YOLOE anchors for a square input: boxes [A, 4], points [A, 2], anchors per level."""
    boxes, points, counts = [], [], []
    for s in strides:
        n = img_size // s
        c = (torch.arange(n, dtype=torch.float32, device=device) + 0.5) * s
        y, x = torch.meshgrid(c, c, indexing="ij")
        p = torch.stack([x.reshape(-1), y.reshape(-1)], dim=-1)
        half = cell * s / 2
        boxes.append(torch.cat([p - half, p + half], dim=-1))
        points.append(p)
        counts.append(n * n)
    return torch.cat(boxes), torch.cat(points), counts


def assign_inputs(batch: int, max_boxes: int, num_classes: int, img_size: int, *,
                  valid: Optional[Sequence[int]] = None, seed: int = 0,
                  device: Optional[torch.device] = None) -> AssignInputs:
    """Random assigner inputs; ``valid[b]`` real GTs in image b (default: random in [0, M])."""
    g = torch.Generator().manual_seed(seed)
    anchors, points, counts = anchor_grid(img_size)
    A = points.shape[0]
    B, M, C = batch, max_boxes, num_classes
    if valid is None:
        valid = torch.randint(0, M + 1, (B,), generator=g).tolist()
    mask = torch.zeros(B, M, 1)
    for b, n in enumerate(valid):
        mask[b, :n] = 1.0
    wh = img_size * (0.03 + 0.5 * torch.rand(B, M, 2, generator=g))
    ctr = img_size * torch.rand(B, M, 2, generator=g)
    gt = torch.cat([ctr - wh / 2, ctr + wh / 2], dim=-1).clamp(0, img_size) * mask
    labels = torch.randint(0, C, (B, M, 1), generator=g) * mask.long()
    stride = torch.cat([torch.full((n,), float(s)) for n, s in zip(counts, (8, 16, 32))])[:, None]
    ltrb = torch.rand(B, A, 4, generator=g) * 6 * stride[None]  # distances up to 6 strides
    pred = torch.cat([points[None] - ltrb[..., :2], points[None] + ltrb[..., 2:]], dim=-1)
    scores = torch.sigmoid(torch.randn(B, A, C, generator=g) * 2 - 2)
    to = dict(device=device)
    return AssignInputs(scores.to(**to), pred.to(**to), points.to(**to), anchors.to(**to), counts,
                        labels.to(**to), gt.to(**to), mask.to(**to), C)


def random_boxes(*shape: int, size: float = 100.0, seed: int = 0, device: Optional[torch.device] = None) -> Tensor:
    """``[*shape, 4]`` xyxy boxes with positive width and height."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(*shape, 2, generator=g) * size
    wh = torch.rand(*shape, 2, generator=g) * size / 2 + 1e-3
    return torch.cat([xy, xy + wh], dim=-1).to(device)


def ema_tensor_shapes() -> list[tuple[int, ...]]:
    """Parameter and buffer shapes like PP-YOLOE-s (~8.3 M values in 474 tensors: conv
    weights, each with BatchNorm weight, bias, running mean and var, and a 0-d
    ``num_batches_tracked``). For benchmarks when the model itself is not at hand; 0-d
    entries stand for the int64 counters."""
    convs = ([(16, 3, 3), (16, 16, 3), (32, 16, 3)]
             + [(c, c, k) for c in (32, 64, 128, 256) for k in (3, 1, 3, 1, 1) for _ in range(2)]
             + [(c * 2, c, 3) for c in (32, 64, 128)]
             + [(c, c, 3) for c in (96, 192, 384)]
             + [(c, c, 1) for c in (96, 192, 384) for _ in range(8)]
             + [(80, c, 3) for c in (96, 192, 384)] + [(68, c, 3) for c in (96, 192, 384)])
    shapes: list[tuple[int, ...]] = []
    for o, i, k in convs:
        shapes.append((o, i, k, k))
        shapes += [(o,), (o,), (o,), (o,), ()]
    return shapes
