"""Plain-torch reference implementations: the truth every kernel is tested against.

Boxes are xyxy. Pairwise functions accept ``[N,4] x [M,4] -> [N,M]`` or batched
``[B,N,4] x [B,M,4] -> [B,N,M]``. Half and bfloat16 boxes are computed in float32, as the
kernels do, and the result returned in their dtype: the area of a box over 256 px a side
exceeds fp16's largest value (65504) and ``eps`` underflows to 0, which gave NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _dtypes(a: Tensor, b: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """``(dtype to compute in, dtype to return)``: float32 at least (float64 stays float64);
    the boxes' dtype back, float32 for integer boxes. Casts only: no host sync in a compiled step."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    work = torch.promote_types(dtype, torch.float32)
    return work, (dtype if dtype.is_floating_point else work)


def _pairwise_inter_union(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    area_a = (a[..., 2] - a[..., 0]).clamp(min=0) * (a[..., 3] - a[..., 1]).clamp(min=0)  # [.., N]
    area_b = (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)  # [.., M]
    lt = torch.maximum(a[..., :, None, :2], b[..., None, :, :2])  # [.., N, M, 2]
    rb = torch.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]  # [.., N, M]
    union = area_a[..., :, None] + area_b[..., None, :] - inter
    return inter, union


def box_iou(a: Tensor, b: Tensor, eps: float = 1e-9) -> Tensor:
    """IoU of every box in ``a`` with every box in ``b``; 0 where the union is empty."""
    work, out = _dtypes(a, b)
    inter, union = _pairwise_inter_union(a.to(work), b.to(work))
    return (inter / union.clamp(min=eps)).to(out)


def generalized_box_iou(a: Tensor, b: Tensor, eps: float = 1e-9) -> Tensor:
    """Generalized IoU (Rezatofighi et al. 2019), pairwise like :func:`box_iou`."""
    work, out = _dtypes(a, b)
    a, b = a.to(work), b.to(work)
    inter, union = _pairwise_inter_union(a, b)
    iou = inter / union.clamp(min=eps)
    lt = torch.minimum(a[..., :, None, :2], b[..., None, :, :2])
    rb = torch.maximum(a[..., :, None, 2:], b[..., None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    enclose = wh[..., 0] * wh[..., 1]
    return (iou - (enclose - union) / enclose.clamp(min=eps)).to(out)


def giou_loss(pred: Tensor, target: Tensor, eps: float = 1e-10) -> Tensor:
    """Elementwise ``1 - GIoU`` of paired boxes ``[..., 4]`` (PaddleDetection GIoULoss)."""
    work, out = _dtypes(pred, target)
    pred, target = pred.to(work), target.to(work)
    x1 = torch.maximum(pred[..., 0], target[..., 0])
    y1 = torch.maximum(pred[..., 1], target[..., 1])
    x2 = torch.minimum(pred[..., 2], target[..., 2])
    y2 = torch.minimum(pred[..., 3], target[..., 3])
    inter = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    area_p = (pred[..., 2] - pred[..., 0]) * (pred[..., 3] - pred[..., 1])
    area_t = (target[..., 2] - target[..., 0]) * (target[..., 3] - target[..., 1])
    union = area_p + area_t - inter + eps
    iou = inter / union
    ex1 = torch.minimum(pred[..., 0], target[..., 0])
    ey1 = torch.minimum(pred[..., 1], target[..., 1])
    ex2 = torch.maximum(pred[..., 2], target[..., 2])
    ey2 = torch.maximum(pred[..., 3], target[..., 3])
    enclose = (ex2 - ex1) * (ey2 - ey1) + eps
    return (1.0 - (iou - (enclose - union) / enclose)).to(out)


def check_ema(ema_tensors: list[Tensor], tensors: list[Tensor], decay: Tensor | float) -> None:
    """``ValueError`` in the kernels' words for lists of other lengths, a pair of other shapes
    (``lerp_`` would broadcast a ``[3]`` model tensor into a ``[2, 3]`` EMA one) or a Python
    decay outside [0, 1]. Metadata only: a tensor decay's value is not read (that would sync;
    it is what the compiled step passes)."""
    if len(ema_tensors) != len(tensors):
        raise ValueError(f"fastdet.ops.ema_update_: {len(ema_tensors)} EMA tensors but {len(tensors)} model tensors")
    for i, (e, t) in enumerate(zip(ema_tensors, tensors)):
        if e.shape != t.shape:
            raise ValueError(f"fastdet.ops.ema_update_: tensor {i} has shape {list(e.shape)} in the EMA but "
                             f"{list(t.shape)} in the model")
    if not isinstance(decay, Tensor) and not 0.0 <= float(decay) <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"fastdet.ops.ema_update_: decay must be in [0, 1], got {decay}")


@torch.no_grad()
def ema_update_(ema_tensors: list[Tensor], tensors: list[Tensor], decay: Tensor | float) -> None:
    """``ema = decay * ema + (1 - decay) * t`` for floating tensors, a copy for the rest."""
    check_ema(ema_tensors, tensors, decay)
    ema_lerp_(ema_tensors, tensors, decay)


def ema_lerp_(ema_tensors: list[Tensor], tensors: list[Tensor], decay: Tensor | float) -> None:
    """:func:`ema_update_` of lists :func:`check_ema` has passed (``fastdet.ops.ema_update_``
    checks once, for every back end)."""
    for e, t in zip(ema_tensors, tensors):
        if e.is_floating_point():
            e.lerp_(t.to(e.dtype), 1.0 - decay)
        else:
            e.copy_(t)
