"""Public ops API: IoU family, GIoU loss, fused EMA update and the label assigners.

Callers never choose a back end: each function asks ``fastdet.ops.dispatch`` which one
runs tensors of its device (Triton, CUDA or C++ kernels, or the plain-torch references
in ``reference.py`` / ``assigners.py``, which stay the truth every kernel is tested
against). All kernels are torch custom ops with fake implementations, so a
``torch.compile(fullgraph=True)`` step traces through them without a graph break.

Boxes are xyxy. Shapes: ``box_iou`` / ``generalized_box_iou`` take ``[N,4] x [M,4] ->
[N,M]`` or ``[B,N,4] x [B,M,4] -> [B,N,M]``; ``giou_loss`` is paired and elementwise,
``[...,4] x [...,4] -> [...]``, with its backward. The pairwise IoUs are differentiable
too: their kernels run without a gradient, the reference with one.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from fastdet.ops import assigners as _assigners
from fastdet.ops import fcos as _fcos
from fastdet.ops import reference as _reference
from fastdet.ops import simota as _simota
from fastdet.ops.dispatch import backend_for, set_backend, use_backend
from fastdet.ops.yolo import yolo_targets

__all__ = [
    "box_iou",
    "generalized_box_iou",
    "giou_loss",
    "ema_update_",
    "task_aligned_assign",
    "atss_assign",
    "yolo_targets",
    "fcos_assign",
    "simota_assign",
    "backend_for",
    "set_backend",
    "use_backend",
]

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _backend(op: str, t: Tensor) -> str:
    return backend_for(op, t.device.type, torch.compiler.is_compiling())


def _ns(backend: str):
    return torch.ops.fastdet_triton if backend == "triton" else torch.ops.fastdet


def _check_boxes(op: str, name: str, t: Tensor) -> None:
    if t.dim() < 1 or t.shape[-1] != 4:
        raise ValueError(f"fastdet.ops.{op}: {name} must have shape [..., 4] (xyxy boxes), got {tuple(t.shape)}")


def _pairwise(op: str, a: Tensor, b: Tensor, eps: float) -> Tensor:
    _check_boxes(op, "a", a)
    _check_boxes(op, "b", b)
    if not ((a.dim() == 2 and b.dim() == 2) or (a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0])):
        raise ValueError(f"fastdet.ops.{op}: expected a [N,4] and b [M,4], or a [B,N,4] and b [B,M,4]; "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    dtype = torch.promote_types(a.dtype, b.dtype)
    backend = _backend(op, a)
    # The kernels have no backward: when a gradient is wanted the reference runs, which is
    # torchvision's formula and differentiates as it does. Training asks for IoUs under
    # no_grad (the assigners), where the kernels serve. requires_grad and the grad mode are
    # metadata: a constant to torch.compile, no sync.
    wants_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if backend == "torch" or wants_grad or dtype not in _KERNEL_DTYPES:
        return getattr(_reference, op)(a, b, eps)
    return getattr(_ns(backend), op)(a.to(dtype), b.to(dtype), eps)


def box_iou(a: Tensor, b: Tensor, eps: float = 1e-9) -> Tensor:
    """Pairwise IoU of xyxy boxes; 0 where the union is empty (``inter / max(union, eps)``).

    Differentiable (as ``torchvision.ops.box_iou``): with a gradient wanted it runs the torch
    reference, the kernels only without one."""
    return _pairwise("box_iou", a, b, eps)


def generalized_box_iou(a: Tensor, b: Tensor, eps: float = 1e-9) -> Tensor:
    """Pairwise generalized IoU (Rezatofighi et al. 2019) of xyxy boxes; differentiable as
    :func:`box_iou` is."""
    return _pairwise("generalized_box_iou", a, b, eps)


def giou_loss(pred: Tensor, target: Tensor, eps: float = 1e-10) -> Tensor:
    """Elementwise ``1 - GIoU`` of paired boxes ``[..., 4]`` (PaddleDetection GIoULoss).

    Differentiable in both arguments; the kernels compute the backward in one pass
    without saving intermediates (only the two box tensors are kept for it).
    """
    _check_boxes("giou_loss", "pred", pred)
    _check_boxes("giou_loss", "target", target)
    backend = _backend("giou_loss", pred)
    dtype = torch.promote_types(pred.dtype, target.dtype)
    if backend == "torch" or dtype not in _KERNEL_DTYPES:
        return _reference.giou_loss(pred, target, eps)
    if pred.shape != target.shape:
        pred, target = torch.broadcast_tensors(pred, target)
    return _ns(backend).giou_loss(pred.to(dtype), target.to(dtype), eps)


def ema_update_(ema_tensors: Sequence[Tensor], tensors: Sequence[Tensor], decay: Union[Tensor, float]) -> None:
    """``ema = decay * ema + (1 - decay) * t`` for floating tensors, a copy for the rest.

    One fused update over all tensors (a launch or two on CUDA). Pass ``decay`` as a
    0-d tensor on the tensors' device so the update can live in a CUDA graph and a
    changing decay does not recompile a compiled step. A Python decay must lie in [0, 1]
    (a tensor's value is not checked: reading it would sync); paired tensors must have one
    shape (``ValueError``).
    """
    ema_tensors = list(ema_tensors)
    tensors = list(tensors)
    _reference.check_ema(ema_tensors, tensors, decay)  # every back end, before any tensor is written
    if not ema_tensors:
        return
    device = ema_tensors[0].device
    if not isinstance(decay, Tensor):
        decay = torch.tensor(float(decay), dtype=torch.float32, device=device)
    backend = _backend("ema_update_", ema_tensors[0])
    with torch.no_grad():  # no autograd graph: model parameters may require grad
        if backend == "torch":
            _reference.ema_lerp_(ema_tensors, tensors, decay)  # checked above
        else:
            _ns(backend).ema_update_(ema_tensors, tensors, decay)


def task_aligned_assign(
    pred_scores: Tensor,
    pred_bboxes: Tensor,
    anchor_points: Tensor,
    gt_labels: Tensor,
    gt_bboxes: Tensor,
    pad_gt_mask: Tensor,
    bg_index: int,
    topk: int = 13,
    alpha: float = 1.0,
    beta: float = 6.0,
    eps: float = 1e-9,
) -> tuple[Tensor, Tensor, Tensor]:
    """Task-aligned assignment (TOOD / PP-YOLOE); semantics of ``assigners.task_aligned_assign``.

    Returns ``(labels [B,A] int64, bboxes [B,A,4], scores [B,A,C])``. The kernels never
    form a ``[B, M, A]`` tensor; they compute in float32 (float64 too on the CPU) and
    return the dtype of ``pred_scores``.
    """
    backend = _backend("task_aligned_assign", pred_scores)
    C = pred_scores.shape[-1]
    dtype = pred_scores.dtype
    usable = (
        backend != "torch"
        and 0 <= bg_index <= C
        and 1 <= topk <= 32
        and dtype in _KERNEL_DTYPES
        and (backend == "cpp" or dtype != torch.float64)
    )
    if not usable:
        return _assigners.task_aligned_assign(pred_scores, pred_bboxes, anchor_points, gt_labels, gt_bboxes,
                                              pad_gt_mask, bg_index, topk, alpha, beta, eps)
    kdtype = torch.float64 if dtype == torch.float64 else torch.float32
    labels, bboxes, scores = _ns(backend).task_aligned_assign(
        pred_scores.detach().to(kdtype), pred_bboxes.detach().to(kdtype), anchor_points.detach().to(kdtype),
        gt_labels, gt_bboxes.detach().to(kdtype), pad_gt_mask.detach().to(kdtype), bg_index, topk, alpha, beta, eps)
    return labels, bboxes.to(dtype), scores.to(dtype)


def atss_assign(
    anchors: Tensor,
    num_anchors_list: Sequence[int],
    gt_labels: Tensor,
    gt_bboxes: Tensor,
    pad_gt_mask: Tensor,
    bg_index: int,
    topk: int = 9,
    pred_bboxes: Optional[Tensor] = None,
    num_classes: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """ATSS assignment; semantics of ``assigners.atss_assign`` (``num_classes`` defaults to ``bg_index``).

    Returns ``(labels [B,A] int64, bboxes [B,A,4], scores [B,A,C])``.
    """
    C = bg_index if num_classes is None else num_classes
    backend = _backend("atss_assign", gt_bboxes)
    dtype = gt_bboxes.dtype
    # Under a dynamic-shape compile the counts are SymInts (h * w of each level): the op's
    # schema takes SymInt[], and int() here would guard them back to one size.
    counts = [n if isinstance(n, torch.SymInt) else int(n) for n in num_anchors_list]
    usable = (
        backend != "torch"
        and 0 <= bg_index <= C
        and 1 <= topk <= 32
        and 1 <= len(counts) <= 8
        and dtype in _KERNEL_DTYPES
        and (backend == "cpp" or dtype != torch.float64)
    )
    if not usable:
        return _assigners.atss_assign(anchors, num_anchors_list, gt_labels, gt_bboxes, pad_gt_mask, bg_index, topk,
                                      pred_bboxes, num_classes)
    if all(isinstance(n, int) for n in counts) and sum(counts) != anchors.shape[0]:
        raise ValueError(f"fastdet.ops.atss_assign: num_anchors_list sums to {sum(counts)}, anchors has "
                         f"{anchors.shape[0]} rows")
    kdtype = torch.float64 if dtype == torch.float64 else torch.float32
    pred = pred_bboxes.detach().to(kdtype) if pred_bboxes is not None else None
    labels, bboxes, scores = _ns(backend).atss_assign(
        anchors.detach().to(kdtype), counts, gt_labels, gt_bboxes.detach().to(kdtype),
        pad_gt_mask.detach().to(kdtype), pred, bg_index, C, topk, 1e-9)
    return labels, bboxes.to(dtype), scores.to(dtype)


def fcos_assign(
    points: Tensor,
    strides: Tensor,
    size_ranges: Tensor,
    gt_boxes: Tensor,
    gt_labels: Tensor,
    gt_mask: Tensor,
    radius: float = 1.5,
) -> tuple[Tensor, Tensor]:
    """FCOS assignment (centre sampling, level ranges, smallest box); semantics of ``fcos.fcos_assign``.

    ``points [A, 2]`` px, ``strides [A]``, ``size_ranges [A, 2]`` (lo, hi) px, ``gt_boxes
    [B, M, 4]`` xyxy px, ``gt_labels [B, M]``, ``gt_mask [B, M]``. Returns ``(assigned_gt
    [B, A] int64, assigned_labels [B, A] int64)``, -1 for background. The kernels work
    point by point (no ``[B, M, A]`` tensor) in float32; other box dtypes use the reference.
    """
    A = points.shape[0]
    if points.dim() != 2 or points.shape[1] != 2:
        raise ValueError(f"fastdet.ops.fcos_assign: points must be [A, 2], got {tuple(points.shape)}")
    if strides.shape != (A,) or size_ranges.shape != (A, 2):
        raise ValueError(f"fastdet.ops.fcos_assign: strides must be [{A}] and size_ranges [{A}, 2], got "
                         f"{tuple(strides.shape)} and {tuple(size_ranges.shape)}")
    if gt_boxes.dim() != 3 or gt_boxes.shape[-1] != 4:
        raise ValueError(f"fastdet.ops.fcos_assign: gt_boxes must be [B, M, 4], got {tuple(gt_boxes.shape)}")
    B, M = gt_boxes.shape[:2]
    if gt_labels.numel() != B * M or gt_mask.numel() != B * M:
        raise ValueError(f"fastdet.ops.fcos_assign: gt_labels and gt_mask must be [{B}, {M}], got "
                         f"{tuple(gt_labels.shape)} and {tuple(gt_mask.shape)}")
    backend = _backend("fcos_assign", gt_boxes)
    if backend == "torch" or gt_boxes.dtype != torch.float32:
        return _fcos.fcos_assign(points, strides, size_ranges, gt_boxes, gt_labels, gt_mask, radius)
    f32 = torch.float32
    return _ns(backend).fcos_assign(
        points.detach().to(f32), strides.detach().to(f32), size_ranges.detach().to(f32), gt_boxes.detach(),
        gt_labels.reshape(B, M).long(), gt_mask.reshape(B, M).bool(), float(radius))


def simota_assign(
    pred_scores: Tensor,
    pred_boxes: Tensor,
    anchor_points: Tensor,
    strides: Tensor,
    gt_boxes: Tensor,
    gt_labels: Tensor,
    gt_mask: Tensor,
    center_radius: float = 2.5,
    topk: int = 10,
    iou_weight: float = 3.0,
) -> tuple[Tensor, Tensor]:
    """SimOTA (YOLOX); semantics of ``fastdet.ops.simota.simota_assign``.

    Args: pred_scores [B,A,C] sigmoid(cls) x sigmoid(obj); pred_boxes [B,A,4] xyxy px;
    anchor_points [A,2] cell centres px; strides [A]; gt_boxes [B,M,4]; gt_labels [B,M];
    gt_mask [B,M] bool. Returns ``(assigned_gt [B,A] int64, -1 for background;
    assigned_iou [B,A])``. The kernels never form a ``[B, M, A]`` tensor; they compute in
    float32 (float64 too on the CPU) and return the dtype of ``pred_boxes``.
    """
    backend = _backend("simota_assign", pred_scores)
    dtype = pred_scores.dtype
    usable = (
        backend != "torch"
        and 1 <= topk <= 32
        and dtype in _KERNEL_DTYPES
        and (backend == "cpp" or dtype != torch.float64)
    )
    if not usable:
        # The reference computes half inputs in float32 and returns that; the kernels' dtype.
        assigned, iou = _simota.simota_assign(pred_scores, pred_boxes, anchor_points, strides, gt_boxes, gt_labels,
                                              gt_mask, center_radius, topk, iou_weight)
        return assigned, iou.to(pred_boxes.dtype)
    kdtype = torch.float64 if dtype == torch.float64 else torch.float32
    assigned, iou = _ns(backend).simota_assign(
        pred_scores.detach().to(kdtype), pred_boxes.detach().to(kdtype), anchor_points.detach().to(kdtype),
        strides.detach().to(kdtype), gt_boxes.detach().to(kdtype), gt_labels.long(), gt_mask.bool(),
        center_radius, topk, iou_weight)
    return assigned, iou.to(pred_boxes.dtype)
