"""Helpers shared by the Triton kernels of fastdet.ops."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

NAMESPACE = "fastdet_triton"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter."""
    for t in tensors:
        if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
            raise RuntimeError(
                f"fastdet.ops.{op} (triton): tensors must be on a CUDA device (or on the CPU with "
                f"TRITON_INTERPRET=1), got {t.device}"
            )


def acc_dtype(dtype: torch.dtype):
    """Accumulation type of a kernel: float64 for double inputs, float32 otherwise."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def _div(a, b):
    # IEEE division: `/` on fp32 compiles to an approximate divide on the GPU (fp64 is exact).
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def _inter(ax1, ay1, ax2, ay2, bx1, by1, bx2, by2):
    w = tl.maximum(tl.minimum(ax2, bx2) - tl.maximum(ax1, bx1), 0.0)
    h = tl.maximum(tl.minimum(ay2, by2) - tl.maximum(ay1, by1), 0.0)
    return w * h


@triton.jit
def _area(x1, y1, x2, y2):
    return tl.maximum(x2 - x1, 0.0) * tl.maximum(y2 - y1, 0.0)


@triton.jit
def paddle_iou(ax1, ay1, ax2, ay2, bx1, by1, bx2, by2):
    """fastdet.ops.assigners.pairwise_iou: overlap / (area_a + area_b - overlap + 1e-9)."""
    overlap = _inter(ax1, ay1, ax2, ay2, bx1, by1, bx2, by2)
    return _div(overlap, _area(ax1, ay1, ax2, ay2) + _area(bx1, by1, bx2, by2) - overlap + 1e-9)


@triton.jit
def point_inside(x, y, x1, y1, x2, y2):
    """fastdet.ops.assigners.points_inside_boxes: min(l, t, r, b) > 1e-9."""
    m = tl.minimum(tl.minimum(x - x1, y - y1), tl.minimum(x2 - x, y2 - y))
    return m > 1e-9


@triton.jit
def score_column(label, bg_index, num_classes):
    """Column of `label` in the assigners' scores (bg dropped from a one-hot over 0..C); -1 if none."""
    col = tl.where(label < bg_index, label, label - 1)
    ok = (label >= 0) & (label <= num_classes) & (label != bg_index) & (col < num_classes)
    return tl.where(ok, col, -1)
