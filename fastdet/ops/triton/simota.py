"""Triton kernels of SimOTA (reference: fastdet/ops/simota.py; same plan as the C++ and CUDA
kernels, csrc/simota_math.h, csrc/simota.cu), no ``[B, M, A]`` tensor:

0. one program per block of points: candidate flag (inside any real GT box or centre
   square) and ``sum_c BCE(sqrt(score_c), 0)``, summed over classes in order;
1. one program per real GT scans the points in chunks with two running top-k lists of
   int64 keys (``tl.topk``): IoUs, ``(IoU bits << 32) | (0xFFFFFFFF - point)``, whose float64
   sum gives the dynamic k; and costs, ``(in box and centre << 62) | (inverted
   order-preserving cost bits << 30) | (0x3FFFFFFF - point)``, larger = cheaper, ties to the
   lower point. Claimed points are counted with atomics;
2. one program per block of points resolves each point: one claim -> that GT; several ->
   the GT of largest key over all real GTs (the first on ties).

Float32 only (the dispatch routes other dtypes to the reference); topk <= 32; A < 2^30.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from fastdet.ops.triton._common import NAMESPACE, _div, check_device, interpreting
from fastdet.ops.triton.assign import MAX_TOPK, _kp, _merge_topk

_CHUNK = 1024  # points per top-k step
_BLOCK = 256  # points per program in the per-point kernels


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    # tl.log is an approximation on the GPU; libdevice's is accurate (the interpreter's is numpy's).
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log1p(x)
    else:
        # The interpreter has no libdevice: log(u) * x / (u - 1) with u = 1 + x is accurate
        # to a few ulps where log(1 + x) is not (Goldberg 1991, Theorem 4).
        u = 1.0 + x
        exact = u == 1.0
        return tl.where(exact, x, _log(tl.where(exact, 2.0, u), LIBDEVICE) * (x / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def _inside(x, y, s, gx1, gy1, gx2, gy2, radius):
    in_box = (x - gx1 > 0.0) & (y - gy1 > 0.0) & (gx2 - x > 0.0) & (gy2 - y > 0.0)
    cx = (gx1 + gx2) / 2.0
    cy = (gy1 + gy2) / 2.0
    r = radius * s
    in_ctr = (x - (cx - r) > 0.0) & (y - (cy - r) > 0.0) & ((cx + r) - x > 0.0) & ((cy + r) - y > 0.0)
    return in_box, in_ctr


@triton.jit
def _iou(gx1, gy1, gx2, gy2, px1, py1, px2, py2):
    """reference.box_iou: inter / max(union, 1e-9), areas with sides clamped at 0."""
    w = tl.maximum(tl.minimum(gx2, px2) - tl.maximum(gx1, px1), 0.0)
    h = tl.maximum(tl.minimum(gy2, py2) - tl.maximum(gy1, py1), 0.0)
    inter = w * h
    area_g = tl.maximum(gx2 - gx1, 0.0) * tl.maximum(gy2 - gy1, 0.0)
    area_p = tl.maximum(px2 - px1, 0.0) * tl.maximum(py2 - py1, 0.0)
    return _div(inter, tl.maximum(area_g + area_p - inter, 1e-9))


@triton.jit
def _cost(S, NEG, ba, C, label, iou, iou_weight, mask, LIBDEVICE: tl.constexpr):
    q = tl.sqrt_rn(tl.load(S + ba * C + label, mask=mask, other=0.5))
    bce0 = tl.minimum(-_log1p(-q, LIBDEVICE), 100.0)
    bce1 = tl.minimum(-_log(q, LIBDEVICE), 100.0)
    cls = (tl.load(NEG + ba, mask=mask, other=0.0) - bce0) + bce1
    return cls + iou_weight * (-_log(iou + 1e-8, LIBDEVICE))


@triton.jit
def _cost_key(cost, both, idx):
    bits = cost.to(tl.int32, bitcast=True)
    u = bits.to(tl.int64) & 0xFFFFFFFF
    ordered = tl.where(bits < 0, (~u) & 0xFFFFFFFF, u | 0x80000000)  # order-preserving float -> uint32
    return (both.to(tl.int64) << 62) | ((0xFFFFFFFF - ordered) << 30) | (0x3FFFFFFF - idx)


@triton.jit
def _point_kernel(S, PTS, STR, GTB, GTM, cand, neg_sum, total, A, C, M, radius, LIBDEVICE: tl.constexpr,
                  BLOCK: tl.constexpr):
    ba = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = ba < total
    b = ba // A
    a = ba % A
    x = tl.load(PTS + a * 2, mask=mask, other=0.0)
    y = tl.load(PTS + a * 2 + 1, mask=mask, other=0.0)
    s = tl.load(STR + a, mask=mask, other=0.0)
    c = tl.zeros([BLOCK], tl.int32)
    for m in range(0, M):
        g = GTB + (b * M + m) * 4
        valid = tl.load(GTM + b * M + m, mask=mask, other=0) != 0
        in_box, in_ctr = _inside(x, y, s, tl.load(g + 0, mask=mask, other=0.0), tl.load(g + 1, mask=mask, other=0.0),
                                 tl.load(g + 2, mask=mask, other=0.0), tl.load(g + 3, mask=mask, other=0.0), radius)
        c = tl.maximum(c, ((in_box | in_ctr) & valid).to(tl.int32))
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(0, C):  # in class order, as the CPU kernel
        q = tl.sqrt_rn(tl.load(S + ba * C + k, mask=mask, other=0.0))
        acc += tl.minimum(-_log1p(-q, LIBDEVICE), 100.0)
    tl.store(cand + ba, c.to(tl.int8), mask=mask)
    tl.store(neg_sum + ba, acc, mask=mask)


@triton.jit
def _gt_kernel(S, P, PTS, STR, GTB, GTL, GTM, cand, NEG, count, owner, A, C, M, k, radius, iou_weight,
               KP: tl.constexpr, CHUNK: tl.constexpr, SORT: tl.constexpr, LIBDEVICE: tl.constexpr):
    bm = tl.program_id(0).to(tl.int64)
    b = bm // M
    m = bm % M
    if tl.load(GTM + bm) != 0:
        gx1 = tl.load(GTB + bm * 4 + 0)
        gy1 = tl.load(GTB + bm * 4 + 1)
        gx2 = tl.load(GTB + bm * 4 + 2)
        gy2 = tl.load(GTB + bm * 4 + 3)
        label = tl.minimum(tl.maximum(tl.load(GTL + bm), 0), C - 1)
        best_iou = tl.full([KP], -1, tl.int64)
        best_cost = tl.full([KP], -1, tl.int64)
        for start in range(0, A, CHUNK):
            offs = start + tl.arange(0, CHUNK).to(tl.int64)
            amask = offs < A
            ok = amask & (tl.load(cand + b * A + offs, mask=amask, other=0) != 0)
            x = tl.load(PTS + offs * 2, mask=ok, other=0.0)
            y = tl.load(PTS + offs * 2 + 1, mask=ok, other=0.0)
            s = tl.load(STR + offs, mask=ok, other=0.0)
            in_box, in_ctr = _inside(x, y, s, gx1, gy1, gx2, gy2, radius)
            q = P + (b * A + offs) * 4
            iou = _iou(gx1, gy1, gx2, gy2, tl.load(q + 0, mask=ok, other=0.0), tl.load(q + 1, mask=ok, other=0.0),
                       tl.load(q + 2, mask=ok, other=0.0), tl.load(q + 3, mask=ok, other=0.0))
            cost = _cost(S, NEG, b * A + offs, C, label, iou, iou_weight, ok, LIBDEVICE)
            ikeys = (iou.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0xFFFFFFFF - offs)
            best_iou = _merge_topk(best_iou, tl.where(ok, ikeys, -1), KP, SORT)
            best_cost = _merge_topk(best_cost, tl.where(ok, _cost_key(cost, in_box & in_ctr, offs), -1), KP, SORT)
        j = tl.arange(0, KP)
        top = ((best_iou >> 32) & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        top = tl.where((j < k) & (best_iou >= 0), top, 0.0).to(tl.float64)
        dyn_k = tl.maximum(tl.floor(tl.sum(top, axis=0)), 1.0)
        sel = (j < k) & (j.to(tl.float64) < dyn_k) & (best_cost >= 0)
        a = 0x3FFFFFFF - (best_cost & 0x3FFFFFFF)
        tl.atomic_add(count + b * A + a, 1, mask=sel)
        tl.atomic_xchg(owner + b * A + a, m.to(tl.int32), mask=sel)


@triton.jit
def _resolve_kernel(S, P, PTS, STR, GTB, GTL, GTM, NEG, count, owner, out_gt, out_iou, total, A, C, M, radius,
                    iou_weight, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
    ba = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = ba < total
    b = ba // A
    a = ba % A
    n = tl.load(count + ba, mask=mask, other=0)
    g_idx = tl.where(n == 1, tl.load(owner + ba, mask=mask, other=0).to(tl.int64), -1)
    px1 = tl.load(P + ba * 4 + 0, mask=mask, other=0.0)
    py1 = tl.load(P + ba * 4 + 1, mask=mask, other=0.0)
    px2 = tl.load(P + ba * 4 + 2, mask=mask, other=0.0)
    py2 = tl.load(P + ba * 4 + 3, mask=mask, other=0.0)
    multi = mask & (n > 1)
    if tl.max(multi.to(tl.int32), axis=0) > 0:
        x = tl.load(PTS + a * 2, mask=multi, other=0.0)
        y = tl.load(PTS + a * 2 + 1, mask=multi, other=0.0)
        s = tl.load(STR + a, mask=multi, other=0.0)
        best = tl.full([BLOCK], -1, tl.int64)
        for j in range(0, M):
            gm = b * M + j
            valid = multi & (tl.load(GTM + gm, mask=multi, other=0) != 0)
            g = GTB + gm * 4
            gx1 = tl.load(g + 0, mask=valid, other=0.0)
            gy1 = tl.load(g + 1, mask=valid, other=0.0)
            gx2 = tl.load(g + 2, mask=valid, other=0.0)
            gy2 = tl.load(g + 3, mask=valid, other=0.0)
            in_box, in_ctr = _inside(x, y, s, gx1, gy1, gx2, gy2, radius)
            iou = _iou(gx1, gy1, gx2, gy2, px1, py1, px2, py2)
            label = tl.minimum(tl.maximum(tl.load(GTL + gm, mask=valid, other=0), 0), C - 1)
            cost = _cost(S, NEG, ba, C, label, iou, iou_weight, valid, LIBDEVICE)
            key = tl.where(valid, _cost_key(cost, in_box & in_ctr, tl.zeros([BLOCK], tl.int64) + j), -1)
            better = key > best
            best = tl.where(better, key, best)
            g_idx = tl.where(multi & better, j, g_idx)
    fg = mask & (g_idx >= 0)
    g = GTB + (b * M + tl.where(fg, g_idx, 0)) * 4
    iou = _iou(tl.load(g + 0, mask=fg, other=0.0), tl.load(g + 1, mask=fg, other=0.0),
               tl.load(g + 2, mask=fg, other=0.0), tl.load(g + 3, mask=fg, other=0.0), px1, py1, px2, py2)
    tl.store(out_gt + ba, g_idx, mask=mask)
    tl.store(out_iou + ba, tl.where(fg, iou, 0.0), mask=mask)


@torch.library.custom_op(f"{NAMESPACE}::simota_assign", mutates_args=())
def simota_assign(pred_scores: Tensor, pred_boxes: Tensor, anchor_points: Tensor, strides: Tensor, gt_boxes: Tensor,
                  gt_labels: Tensor, gt_mask: Tensor, center_radius: float, topk: int,
                  iou_weight: float) -> tuple[Tensor, Tensor]:
    check_device("simota_assign", pred_scores, pred_boxes, anchor_points, strides, gt_boxes)
    B, A, C = pred_scores.shape
    M = gt_boxes.shape[1]
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"fastdet.ops.simota_assign (triton): topk must be in [1, {MAX_TOPK}], got {topk}")
    if A >= 1 << 30:
        raise ValueError(f"fastdet.ops.simota_assign (triton): at most 2^30 points, got {A}")
    dev = pred_scores.device
    out_gt = torch.full((B, A), -1, dtype=torch.int64, device=dev)
    out_iou = torch.zeros((B, A), dtype=torch.float32, device=dev)
    if B * A == 0 or M == 0 or C == 0:
        return out_gt, out_iou
    f32 = torch.float32
    S = pred_scores.to(f32).contiguous()
    P = pred_boxes.to(f32).contiguous()
    pts = anchor_points.to(f32).contiguous()
    st = strides.to(f32).contiguous()
    G = gt_boxes.to(f32).contiguous()
    L = gt_labels.reshape(B, M).to(torch.int64).contiguous()
    V = gt_mask.reshape(B, M).to(torch.int8).contiguous()
    cand = torch.empty((B, A), dtype=torch.int8, device=dev)
    neg = torch.empty((B, A), dtype=f32, device=dev)
    count = torch.zeros((B, A), dtype=torch.int32, device=dev)
    owner = torch.zeros((B, A), dtype=torch.int32, device=dev)
    lib = not interpreting()
    k = min(topk, A)
    grid = (triton.cdiv(B * A, _BLOCK),)
    _point_kernel[grid](S, pts, st, G, V, cand, neg, B * A, A, C, M, center_radius, LIBDEVICE=lib, BLOCK=_BLOCK)
    _gt_kernel[(B * M,)](S, P, pts, st, G, L, V, cand, neg, count, owner, A, C, M, k, center_radius, iou_weight,
                         KP=_kp(k), CHUNK=_CHUNK, SORT=lib, LIBDEVICE=lib)
    _resolve_kernel[grid](S, P, pts, st, G, L, V, neg, count, owner, out_gt, out_iou, B * A, A, C, M, center_radius,
                          iou_weight, LIBDEVICE=lib, BLOCK=_BLOCK)
    return out_gt, out_iou


@simota_assign.register_fake
def _simota_fake(pred_scores, pred_boxes, anchor_points, strides, gt_boxes, gt_labels, gt_mask, center_radius, topk,
                 iou_weight):
    B, A = pred_scores.shape[:2]
    return (pred_scores.new_empty((B, A), dtype=torch.int64), pred_scores.new_empty((B, A), dtype=torch.float32))
