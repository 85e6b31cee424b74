"""Triton kernel of ``fastdet.ops.fcos_assign`` (reference: fastdet/ops/fcos.py).

Same plan as the C++/CUDA kernels (csrc/fcos_cpu.cpp, csrc/fcos.cu): one program per
block of points of one image; it walks the image's M ground-truth slots and keeps, per
point, the smallest box the point is positive for. Only ``[BLOCK]`` vectors live in the
program: no ``[B, M, A]`` tensor is formed. Float32, the reference's operations in its
order (``x * 0.5`` is ``x / 2`` exactly, and needs no IEEE-division care on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastdet.ops.triton._common import NAMESPACE, check_device

_BLOCK = 256  # points per program


@triton.jit
def _fcos_assign_kernel(PTS, STR, RNG, GTB, GTL, GTM, OUT_GT, OUT_LABEL, A, M, radius, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    amask = offs < A
    px = tl.load(PTS + offs * 2, mask=amask, other=0.0)
    py = tl.load(PTS + offs * 2 + 1, mask=amask, other=0.0)
    rs = tl.load(STR + offs, mask=amask, other=0.0) * radius
    lo = tl.load(RNG + offs * 2, mask=amask, other=0.0)
    hi = tl.load(RNG + offs * 2 + 1, mask=amask, other=0.0)
    best = tl.full([BLOCK], -1, tl.int64)
    best_area = tl.full([BLOCK], 0.0, tl.float32)
    for m in range(M):
        bm = b * M + m
        if tl.load(GTM + bm) != 0:
            x1 = tl.load(GTB + bm * 4 + 0)
            y1 = tl.load(GTB + bm * 4 + 1)
            x2 = tl.load(GTB + bm * 4 + 2)
            y2 = tl.load(GTB + bm * 4 + 3)
            l = px - x1  # noqa: E741
            t = py - y1
            r = x2 - px
            bt = y2 - py
            inside = tl.minimum(tl.minimum(l, t), tl.minimum(r, bt)) > 0.0
            cx = (x1 + x2) * 0.5
            cy = (y1 + y2) * 0.5
            near = tl.maximum(tl.abs(px - cx), tl.abs(py - cy)) < rs
            far = tl.maximum(tl.maximum(l, t), tl.maximum(r, bt))
            ok = inside & near & (far > lo) & (far < hi)
            area = (x2 - x1) * (y2 - y1)
            # Strictly smaller: the first slot wins on equal areas, as argmin does.
            take = ok & ((best < 0) | (area < best_area))
            best = tl.where(take, m, best)
            best_area = tl.where(take, area, best_area)
    label = tl.load(GTL + b * M + tl.maximum(best, 0), mask=amask & (best >= 0), other=-1)
    tl.store(OUT_GT + b * A + offs, best, mask=amask)
    tl.store(OUT_LABEL + b * A + offs, tl.where(best >= 0, label, -1), mask=amask)


@torch.library.custom_op(f"{NAMESPACE}::fcos_assign", mutates_args=())
def fcos_assign(points: Tensor, strides: Tensor, size_ranges: Tensor, gt_boxes: Tensor, gt_labels: Tensor,
                gt_mask: Tensor, radius: float) -> tuple[Tensor, Tensor]:
    check_device("fcos_assign", points, gt_boxes)
    A = points.shape[0]
    B, M = gt_boxes.shape[:2]
    if points.shape != (A, 2) or strides.shape != (A,) or size_ranges.shape != (A, 2):
        raise ValueError(f"fastdet.ops.fcos_assign: points [A, 2], strides [A] and size_ranges [A, 2] expected, got "
                         f"{tuple(points.shape)}, {tuple(strides.shape)} and {tuple(size_ranges.shape)}")
    dev = gt_boxes.device
    assigned = torch.empty((B, A), dtype=torch.int64, device=dev)
    labels = torch.empty((B, A), dtype=torch.int64, device=dev)
    if B * A == 0:
        return assigned, labels
    f32 = torch.float32
    _fcos_assign_kernel[(triton.cdiv(A, _BLOCK), B)](
        points.to(f32).contiguous(), strides.to(f32).contiguous(), size_ranges.to(f32).contiguous(),
        gt_boxes.to(f32).contiguous(), gt_labels.reshape(B, M).to(torch.int64).contiguous(),
        gt_mask.reshape(B, M).to(torch.uint8).contiguous(), assigned, labels, A, M, float(radius), BLOCK=_BLOCK)
    return assigned, labels


@fcos_assign.register_fake
def _fcos_fake(points, strides, size_ranges, gt_boxes, gt_labels, gt_mask, radius):
    B, A = gt_boxes.shape[0], points.shape[0]
    return gt_boxes.new_empty((B, A), dtype=torch.int64), gt_boxes.new_empty((B, A), dtype=torch.int64)
