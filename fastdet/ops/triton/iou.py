"""Triton kernels of the IoU family: pairwise IoU / GIoU and the paired GIoU loss.

Formulas follow fastdet/ops/reference.py term by term (see csrc/box_math.h for the C++
twin). Registered as ``fastdet_triton::*`` custom ops with fake implementations, and
``giou_loss`` with its autograd formula.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastdet.ops.triton._common import NAMESPACE, _area, _div, _inter, acc_dtype, check_device


@triton.jit
def _pairwise_kernel(a_ptr, b_ptr, out_ptr, N, M, eps, GIOU: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), B); a [B, N, 4], b [B, M, 4], out [B, N, M]
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    bi = tl.program_id(2).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mn = rn < N
    mm = rm < M
    pa = a_ptr + (bi * N + rn) * 4
    pb = b_ptr + (bi * M + rm) * 4
    ax1 = tl.load(pa + 0, mask=mn, other=0.0).to(ACC)[:, None]
    ay1 = tl.load(pa + 1, mask=mn, other=0.0).to(ACC)[:, None]
    ax2 = tl.load(pa + 2, mask=mn, other=0.0).to(ACC)[:, None]
    ay2 = tl.load(pa + 3, mask=mn, other=0.0).to(ACC)[:, None]
    bx1 = tl.load(pb + 0, mask=mm, other=0.0).to(ACC)[None, :]
    by1 = tl.load(pb + 1, mask=mm, other=0.0).to(ACC)[None, :]
    bx2 = tl.load(pb + 2, mask=mm, other=0.0).to(ACC)[None, :]
    by2 = tl.load(pb + 3, mask=mm, other=0.0).to(ACC)[None, :]
    inter = _inter(ax1, ay1, ax2, ay2, bx1, by1, bx2, by2)
    union = _area(ax1, ay1, ax2, ay2) + _area(bx1, by1, bx2, by2) - inter
    iou = _div(inter, tl.maximum(union, eps))
    if GIOU:
        ew = tl.maximum(tl.maximum(ax2, bx2) - tl.minimum(ax1, bx1), 0.0)
        eh = tl.maximum(tl.maximum(ay2, by2) - tl.minimum(ay1, by1), 0.0)
        enclose = ew * eh
        iou = iou - _div(enclose - union, tl.maximum(enclose, eps))
    out = out_ptr + bi * N * M + rn.to(tl.int64)[:, None] * M + rm[None, :]
    tl.store(out, iou.to(out_ptr.dtype.element_ty), mask=mn[:, None] & mm[None, :])


def _pairwise(a: Tensor, b: Tensor, eps: float, giou: bool) -> Tensor:
    op = "generalized_box_iou" if giou else "box_iou"
    check_device(op, a, b)
    batched = a.dim() == 3
    a3 = (a if batched else a[None]).contiguous()
    b3 = (b if batched else b[None]).contiguous()
    B, N, M = a3.shape[0], a3.shape[1], b3.shape[1]
    out = torch.empty((B, N, M), dtype=a.dtype, device=a.device)
    if out.numel():
        BLOCK_N, BLOCK_M = 32, 128
        grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M), B)
        _pairwise_kernel[grid](a3, b3, out, N, M, eps, GIOU=giou, ACC=acc_dtype(a.dtype),
                               BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M)
    return out if batched else out[0]


@torch.library.custom_op(f"{NAMESPACE}::box_iou", mutates_args=())
def box_iou(a: Tensor, b: Tensor, eps: float) -> Tensor:
    return _pairwise(a, b, eps, giou=False)


@torch.library.custom_op(f"{NAMESPACE}::generalized_box_iou", mutates_args=())
def generalized_box_iou(a: Tensor, b: Tensor, eps: float) -> Tensor:
    return _pairwise(a, b, eps, giou=True)


@box_iou.register_fake
@generalized_box_iou.register_fake
def _pairwise_fake(a: Tensor, b: Tensor, eps: float) -> Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-2]))


# ----------------------------------------------------------------------------- GIoU loss


@triton.jit
def _giou_terms(px1, py1, px2, py2, tx1, ty1, tx2, ty2, eps):
    iw_raw = tl.minimum(px2, tx2) - tl.maximum(px1, tx1)
    ih_raw = tl.minimum(py2, ty2) - tl.maximum(py1, ty1)
    iw = tl.maximum(iw_raw, 0.0)
    ih = tl.maximum(ih_raw, 0.0)
    inter = iw * ih
    pw = px2 - px1
    ph = py2 - py1
    tw = tx2 - tx1
    th = ty2 - ty1
    union = pw * ph + tw * th - inter + eps
    ew = tl.maximum(px2, tx2) - tl.minimum(px1, tx1)
    eh = tl.maximum(py2, ty2) - tl.minimum(py1, ty1)
    enclose = ew * eh + eps
    return iw_raw, ih_raw, iw, ih, inter, pw, ph, tw, th, union, ew, eh, enclose


@triton.jit
def _load_boxes(p_ptr, t_ptr, offs, mask, ACC: tl.constexpr):
    px1 = tl.load(p_ptr + offs * 4 + 0, mask=mask, other=0.0).to(ACC)
    py1 = tl.load(p_ptr + offs * 4 + 1, mask=mask, other=0.0).to(ACC)
    px2 = tl.load(p_ptr + offs * 4 + 2, mask=mask, other=1.0).to(ACC)
    py2 = tl.load(p_ptr + offs * 4 + 3, mask=mask, other=1.0).to(ACC)
    tx1 = tl.load(t_ptr + offs * 4 + 0, mask=mask, other=0.0).to(ACC)
    ty1 = tl.load(t_ptr + offs * 4 + 1, mask=mask, other=0.0).to(ACC)
    tx2 = tl.load(t_ptr + offs * 4 + 2, mask=mask, other=1.0).to(ACC)
    ty2 = tl.load(t_ptr + offs * 4 + 3, mask=mask, other=1.0).to(ACC)
    return px1, py1, px2, py2, tx1, ty1, tx2, ty2


@triton.jit
def _giou_loss_kernel(p_ptr, t_ptr, out_ptr, n, eps, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    px1, py1, px2, py2, tx1, ty1, tx2, ty2 = _load_boxes(p_ptr, t_ptr, offs, mask, ACC)
    _, _, _, _, inter, _, _, _, _, union, _, _, enclose = _giou_terms(px1, py1, px2, py2, tx1, ty1, tx2, ty2, eps)
    iou = _div(inter, union)
    loss = 1.0 - (iou - _div(enclose - union, enclose))
    tl.store(out_ptr + offs, loss.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dmax(a, b):
    # d max(a, b) / da as autograd defines it (1/2 on ties).
    return tl.where(a > b, 1.0, tl.where(a < b, 0.0, 0.5))


@triton.jit
def _dmin(a, b):
    return tl.where(a < b, 1.0, tl.where(a > b, 0.0, 0.5))


@triton.jit
def _giou_loss_backward_kernel(g_ptr, p_ptr, t_ptr, gp_ptr, gt_ptr, n, eps, ACC: tl.constexpr, BLOCK: tl.constexpr):
    # The chain rule of _giou_loss_kernel, as csrc/box_math.h giou_loss_bwd.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    px1, py1, px2, py2, tx1, ty1, tx2, ty2 = _load_boxes(p_ptr, t_ptr, offs, mask, ACC)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    iw_raw, ih_raw, iw, ih, inter, pw, ph, tw, th, union, ew, eh, enclose = _giou_terms(
        px1, py1, px2, py2, tx1, ty1, tx2, ty2, eps)
    g_uni = _div(g * inter, union * union) - _div(g, enclose)
    g_enclose = _div(g * union, enclose * enclose)
    g_inter = -_div(g, union) - g_uni
    g_iw = tl.where(iw_raw > 0.0, g_inter * ih, 0.0)
    g_ih = tl.where(ih_raw > 0.0, g_inter * iw, 0.0)
    g_ew = g_enclose * eh
    g_eh = g_enclose * ew
    gp0 = -g_iw * _dmax(px1, tx1) - g_ew * _dmin(px1, tx1) - g_uni * ph
    gt0 = -g_iw * _dmax(tx1, px1) - g_ew * _dmin(tx1, px1) - g_uni * th
    gp1 = -g_ih * _dmax(py1, ty1) - g_eh * _dmin(py1, ty1) - g_uni * pw
    gt1 = -g_ih * _dmax(ty1, py1) - g_eh * _dmin(ty1, py1) - g_uni * tw
    gp2 = g_iw * _dmin(px2, tx2) + g_ew * _dmax(px2, tx2) + g_uni * ph
    gt2 = g_iw * _dmin(tx2, px2) + g_ew * _dmax(tx2, px2) + g_uni * th
    gp3 = g_ih * _dmin(py2, ty2) + g_eh * _dmax(py2, ty2) + g_uni * pw
    gt3 = g_ih * _dmin(ty2, py2) + g_eh * _dmax(ty2, py2) + g_uni * tw
    dt = gp_ptr.dtype.element_ty
    tl.store(gp_ptr + offs * 4 + 0, gp0.to(dt), mask=mask)
    tl.store(gp_ptr + offs * 4 + 1, gp1.to(dt), mask=mask)
    tl.store(gp_ptr + offs * 4 + 2, gp2.to(dt), mask=mask)
    tl.store(gp_ptr + offs * 4 + 3, gp3.to(dt), mask=mask)
    tl.store(gt_ptr + offs * 4 + 0, gt0.to(dt), mask=mask)
    tl.store(gt_ptr + offs * 4 + 1, gt1.to(dt), mask=mask)
    tl.store(gt_ptr + offs * 4 + 2, gt2.to(dt), mask=mask)
    tl.store(gt_ptr + offs * 4 + 3, gt3.to(dt), mask=mask)


_BLOCK = 512


@torch.library.custom_op(f"{NAMESPACE}::giou_loss", mutates_args=())
def giou_loss(pred: Tensor, target: Tensor, eps: float) -> Tensor:
    check_device("giou_loss", pred, target)
    p, t = pred.contiguous(), target.contiguous()
    out = torch.empty(p.shape[:-1], dtype=p.dtype, device=p.device)
    n = out.numel()
    if n:
        _giou_loss_kernel[(triton.cdiv(n, _BLOCK),)](p, t, out, n, eps, ACC=acc_dtype(p.dtype), BLOCK=_BLOCK)
    return out


@giou_loss.register_fake
def _giou_loss_fake(pred: Tensor, target: Tensor, eps: float) -> Tensor:
    return pred.new_empty(pred.shape[:-1])


@torch.library.custom_op(f"{NAMESPACE}::giou_loss_backward", mutates_args=())
def giou_loss_backward(grad: Tensor, pred: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    check_device("giou_loss", grad, pred, target)
    p, t = pred.contiguous(), target.contiguous()
    g = grad.to(p.dtype).contiguous()
    gp, gt = torch.empty_like(p), torch.empty_like(t)
    n = g.numel()
    if n:
        _giou_loss_backward_kernel[(triton.cdiv(n, _BLOCK),)](g, p, t, gp, gt, n, eps, ACC=acc_dtype(p.dtype),
                                                              BLOCK=_BLOCK)
    return gp, gt


@giou_loss_backward.register_fake
def _giou_loss_backward_fake(grad: Tensor, pred: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(pred), torch.empty_like(target)


def _setup_context(ctx, inputs, output):
    pred, target, eps = inputs
    ctx.save_for_backward(pred, target)
    ctx.eps = eps


def _backward(ctx, grad):
    pred, target = ctx.saved_tensors
    gp, gt = giou_loss_backward(grad, pred, target, ctx.eps)
    return gp, gt, None


giou_loss.register_autograd(_backward, setup_context=_setup_context)
