"""FCOS label assignment in plain torch: the reference the kernels are tested against.

Semantics (PaddleDetection ``Gt2FCOSTarget`` with ``center_sampling_radius``, torchvision
``FCOS.compute_loss``): a point ``(x, y)`` of stride ``s`` is positive for a ground-truth
box ``(x1, y1, x2, y2)`` when

- it lies strictly inside the box: ``min(l, t, r, b) > 0`` with ``l = x - x1``,
  ``t = y - y1``, ``r = x2 - x``, ``b = y2 - y``;
- it lies within ``radius * s`` of the box centre in max-norm:
  ``max(|x - cx|, |y - cy|) < radius * s``, ``cx = (x1 + x2) / 2``;
- the largest distance lies inside the point's level range: ``lo < max(l, t, r, b) < hi``
  (FCOS: (0, 64), (64, 128), (128, 256), (256, 512), (512, inf) for strides 8..128).

A point positive for several boxes goes to the smallest box (area ``(x2 - x1) * (y2 - y1)``),
the lowest slot on equal areas. Padded slots (``gt_mask`` False) are never assigned.

Shapes: ``points [A, 2]`` px, ``strides [A]``, ``size_ranges [A, 2]`` (lo, hi) px,
``gt_boxes [B, M, 4]`` xyxy px, ``gt_labels [B, M]`` (or ``[B, M, 1]``), ``gt_mask
[B, M]`` bool. Returns ``(assigned_gt [B, A] int64, assigned_labels [B, A] int64)``, both
-1 for background. Every comparison is made in float32, in the order written above, so
that the kernels (csrc/fcos_cpu.cpp, csrc/fcos.cu, fastdet/ops/triton/fcos.py) agree to
the bit. This reference forms ``[B, M, A]`` tensors; the kernels work per point and form
nothing of that size.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fcos_assign"]


def fcos_assign(points: Tensor, strides: Tensor, size_ranges: Tensor, gt_boxes: Tensor, gt_labels: Tensor,
                gt_mask: Tensor, radius: float = 1.5) -> tuple[Tensor, Tensor]:
    B, M = gt_boxes.shape[:2]
    if M == 0:  # nothing to assign (a shape, so a trace-time branch)
        none = torch.full((B, points.shape[0]), -1, dtype=torch.int64, device=gt_boxes.device)
        return none, none.clone()
    f = torch.float32
    px, py = points[:, 0].to(f), points[:, 1].to(f)  # [A]
    rs = strides.to(f) * float(radius)  # [A]; a Python scalar: no tensor from host data in the step
    lo, hi = size_ranges[:, 0].to(f), size_ranges[:, 1].to(f)
    x1, y1, x2, y2 = (gt_boxes[..., i].to(f)[..., None] for i in range(4))  # each [B, M, 1]
    l, t, r, b = px - x1, py - y1, x2 - px, y2 - py  # each [B, M, A]
    inside = torch.minimum(torch.minimum(l, t), torch.minimum(r, b)) > 0
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    near = torch.maximum((px - cx).abs(), (py - cy).abs()) < rs
    far = torch.maximum(torch.maximum(l, t), torch.maximum(r, b))
    ok = inside & near & (far > lo) & (far < hi) & gt_mask.reshape(B, M, 1).bool()
    area = (x2 - x1) * (y2 - y1)  # [B, M, 1]
    cost = torch.where(ok, area, float("inf"))
    idx = cost.argmin(dim=1)  # [B, A], first slot on ties
    assigned = torch.where(ok.any(dim=1), idx, -1)
    labels = gt_labels.reshape(B, M).long().gather(1, assigned.clamp(min=0))
    return assigned, torch.where(assigned >= 0, labels, -1)
