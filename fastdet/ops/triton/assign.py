"""Triton kernels of the label assigners (reference: fastdet/ops/assigners.py).

Same plan as the C++/CUDA kernels (csrc/assign_cpu.cpp, csrc/ops_cuda.cu), and no
``[B, M, A]`` tensor is formed:

1. one program per ground-truth box picks its candidates with a running top-k over
   anchor chunks. A key packs ``(value bits << 32) | (0xFFFFFFFF - anchor)`` in an int64,
   so ``tl.topk`` on keys orders by value and breaks ties towards the lower anchor index,
   as ``torch.topk`` does on the CPU. Positive candidates are counted per anchor with
   atomics (``count``, ``owner``);
2. one program per block of anchors resolves each anchor (several claimants -> the GT
   of highest IoU x pad mask over all M slots, first on ties), writes label and box, and for the
   task-aligned assigner the per-GT maxima (atomic max);
3. one program per tile of ``[B*A, C]`` writes the scores.

Float32 only (the dispatch routes other dtypes to the reference); topk <= 32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from fastdet.ops.triton._common import NAMESPACE, _div, check_device, interpreting, paddle_iou, point_inside, \
    score_column

MAX_TOPK = 32
_CHUNK = 1024  # anchors per top-k step
_BLOCK_A = 256  # anchors per program in the per-anchor kernels


@triton.jit
def _pow(x, p, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.pow(x, p)
    else:
        # The interpreter has no libdevice: x^p = 2^(p log2 x), with pow's 0^p conventions.
        r = tl.exp2(p * tl.log2(tl.maximum(x, 1e-38)))
        return tl.where(x > 0.0, r, tl.where(p == 0.0, 1.0, 0.0)).to(tl.float32)


@triton.jit
def _merge_topk(best, keys, KP: tl.constexpr, SORT: tl.constexpr):
    """The KP largest of `best` ([KP]) and `keys` ([CHUNK]), largest first (keys are unique
    but for the -1 padding)."""
    if SORT:
        top = tl.topk(keys, KP)
        return tl.topk(tl.reshape(tl.join(best, top), [2 * KP]), KP)
    else:
        # KP rounds of max: the same result, for the interpreter, which runs the sorting
        # network's xor reductions element by element in Python but max through numpy.
        out = tl.full([KP], -1, tl.int64)
        idx = tl.arange(0, KP)
        for r in tl.static_range(KP):
            mx = tl.maximum(tl.max(keys, axis=0), tl.max(best, axis=0))
            out = tl.where(idx == r, mx, out)
            keys = tl.where(keys == mx, -1, keys)
            best = tl.where(best == mx, -1, best)
        return out


@triton.jit
def _key_anchor(key):
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def _tal_candidates_kernel(S, P, PTS, GTB, GTL, GTM, count, owner, A, C, M, k, alpha, beta,
                           KP: tl.constexpr, CHUNK: tl.constexpr, SORT: tl.constexpr,
                           LIBDEVICE: tl.constexpr):
    bm = tl.program_id(0).to(tl.int64)
    b = bm // M
    m = bm % M
    if tl.load(GTM + bm) != 0.0:
        gx1 = tl.load(GTB + bm * 4 + 0)
        gy1 = tl.load(GTB + bm * 4 + 1)
        gx2 = tl.load(GTB + bm * 4 + 2)
        gy2 = tl.load(GTB + bm * 4 + 3)
        label = tl.load(GTL + bm)
        label_ok = (label >= 0) & (label < C)
        best = tl.full([KP], -1, tl.int64)
        for start in range(0, A, CHUNK):
            offs = start + tl.arange(0, CHUNK).to(tl.int64)
            amask = offs < A
            px = tl.load(PTS + offs * 2, mask=amask, other=0.0)
            py = tl.load(PTS + offs * 2 + 1, mask=amask, other=0.0)
            inside = point_inside(px, py, gx1, gy1, gx2, gy2) & amask
            # A chunk without an anchor inside the GT only holds zero keys of higher index
            # than those already kept, so it changes nothing once `best` is full.
            if (tl.max(inside.to(tl.int32), axis=0) > 0) | (tl.min(best, axis=0) < 0):
                q = P + (b * A + offs) * 4
                qx1 = tl.load(q + 0, mask=inside, other=0.0)
                qy1 = tl.load(q + 1, mask=inside, other=0.0)
                qx2 = tl.load(q + 2, mask=inside, other=0.0)
                qy2 = tl.load(q + 3, mask=inside, other=0.0)
                iou = paddle_iou(gx1, gy1, gx2, gy2, qx1, qy1, qx2, qy2)
                s = tl.load(S + (b * A + offs) * C + label, mask=inside & label_ok, other=0.0)
                metric = _pow(s, alpha, LIBDEVICE) * _pow(iou, beta, LIBDEVICE)
                v = tl.where(inside, metric, 0.0).to(tl.float32)
                keys = (v.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0xFFFFFFFF - offs)
                keys = tl.where(amask, keys, -1)
                best = _merge_topk(best, keys, KP, SORT)
        j = tl.arange(0, KP)
        a = _key_anchor(best)
        sel = (j < k) & (best >= 0)
        px = tl.load(PTS + a * 2, mask=sel, other=0.0)
        py = tl.load(PTS + a * 2 + 1, mask=sel, other=0.0)
        ok = sel & point_inside(px, py, gx1, gy1, gx2, gy2)
        tl.atomic_add(count + b * A + a, 1, mask=ok)
        tl.atomic_xchg(owner + b * A + a, m.to(tl.int32), mask=ok)


@triton.jit
def _atss_candidates_kernel(AN, CEN, GTB, GTM, LSTART, LSIZE, cand, cand_iou, M, K, topk, n_levels,
                            KP: tl.constexpr, CHUNK: tl.constexpr, SORT: tl.constexpr):
    bm = tl.program_id(0).to(tl.int64)
    if tl.load(GTM + bm) != 0.0:
        gx1 = tl.load(GTB + bm * 4 + 0)
        gy1 = tl.load(GTB + bm * 4 + 1)
        gx2 = tl.load(GTB + bm * 4 + 2)
        gy2 = tl.load(GTB + bm * 4 + 3)
        gcx = (gx1 + gx2) / 2.0
        gcy = (gy1 + gy2) / 2.0
        j0 = tl.full((), 0, tl.int64)
        for lv in range(0, n_levels):
            start = tl.load(LSTART + lv)
            size = tl.load(LSIZE + lv)
            kl = tl.minimum(size, topk)
            best = tl.full([KP], -1, tl.int64)
            for c0 in range(0, size, CHUNK):
                offs = start + c0 + tl.arange(0, CHUNK).to(tl.int64)
                amask = offs < start + size
                cx = tl.load(CEN + offs * 2, mask=amask, other=0.0)
                cy = tl.load(CEN + offs * 2 + 1, mask=amask, other=0.0)
                dx = (gcx - cx).to(tl.float64)
                dy = (gcy - cy).to(tl.float64)
                d = tl.sqrt(dx * dx + dy * dy).to(tl.float32)  # fp64 sqrt is IEEE
                # Nearer is larger: invert the (non-negative) distance bits.
                keys = ((0x7FFFFFFF - d.to(tl.int32, bitcast=True)).to(tl.int64) << 32) | (0xFFFFFFFF - offs)
                keys = tl.where(amask, keys, -1)
                best = _merge_topk(best, keys, KP, SORT)
            j = tl.arange(0, KP)
            sel = j < kl
            a = _key_anchor(best)
            an = AN + a * 4
            ax1 = tl.load(an + 0, mask=sel, other=0.0)
            ay1 = tl.load(an + 1, mask=sel, other=0.0)
            ax2 = tl.load(an + 2, mask=sel, other=0.0)
            ay2 = tl.load(an + 3, mask=sel, other=0.0)
            iou = paddle_iou(gx1, gy1, gx2, gy2, ax1, ay1, ax2, ay2)
            tl.store(cand + bm * K + j0 + j, a, mask=sel)
            tl.store(cand_iou + bm * K + j0 + j, iou, mask=sel)
            j0 += kl


@triton.jit
def _atss_claim_kernel(CEN, GTB, GTM, cand, cand_iou, thr, count, owner, A, M, K, total, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    bm = i // K
    valid = mask & (tl.load(GTM + bm, mask=mask, other=0.0) != 0.0)
    above = tl.load(cand_iou + i, mask=valid, other=0.0) > tl.load(thr + bm, mask=valid, other=0.0)
    a = tl.load(cand + i, mask=valid, other=0)
    cx = tl.load(CEN + a * 2, mask=valid, other=0.0)
    cy = tl.load(CEN + a * 2 + 1, mask=valid, other=0.0)
    g = GTB + bm * 4
    inside = point_inside(cx, cy, tl.load(g + 0, mask=valid, other=0.0), tl.load(g + 1, mask=valid, other=0.0),
                          tl.load(g + 2, mask=valid, other=0.0), tl.load(g + 3, mask=valid, other=0.0))
    ok = valid & above & inside
    b = bm // M
    tl.atomic_add(count + b * A + a, 1, mask=ok)
    tl.atomic_xchg(owner + b * A + a, (bm - b * M).to(tl.int32), mask=ok)


@triton.jit
def _resolve_kernel(S, P, AN, GTB, GTL, GTM, count, owner, assigned, value, max_metric, max_iou, out_labels, out_bboxes,
                    B, A, C, M, alpha, beta, bg_index, TAL: tl.constexpr, HAS_PRED: tl.constexpr,
                    LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
    ba = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = ba < B * A
    b = ba // A
    a = ba % A
    # The tie-break IoU is with the predicted box (TAL) or the anchor box (ATSS).
    if TAL:
        q = P + ba * 4
    else:
        q = AN + a * 4
    qx1 = tl.load(q + 0, mask=mask, other=0.0)
    qy1 = tl.load(q + 1, mask=mask, other=0.0)
    qx2 = tl.load(q + 2, mask=mask, other=0.0)
    qy2 = tl.load(q + 3, mask=mask, other=0.0)
    c = tl.load(count + ba, mask=mask, other=0)
    own = tl.load(owner + ba, mask=mask, other=0)
    m = tl.where(c == 1, own, -1)
    multi = c > 1
    if tl.max(multi.to(tl.int32), axis=0) > 0:
        best = tl.full([BLOCK], -1.0, tl.float32)
        best_m = tl.zeros([BLOCK], tl.int32)
        for j in range(0, M):
            g = GTB + (b * M + j) * 4
            v = paddle_iou(tl.load(g + 0, mask=mask, other=0.0), tl.load(g + 1, mask=mask, other=0.0),
                           tl.load(g + 2, mask=mask, other=0.0), tl.load(g + 3, mask=mask, other=0.0),
                           qx1, qy1, qx2, qy2) * tl.load(GTM + b * M + j, mask=mask, other=0.0)
            upd = (j == 0) | (v > best)
            best = tl.where(upd, v, best)
            best_m = tl.where(upd, j, best_m)
        m = tl.where(multi, best_m, m)
    tl.store(assigned + ba, m, mask=mask)
    fg = mask & (m >= 0)
    gm = b * M + tl.where(m >= 0, m, 0).to(tl.int64)
    lab = tl.load(GTL + gm, mask=mask, other=0)
    tl.store(out_labels + ba, tl.where(m >= 0, lab, bg_index), mask=mask)
    g = GTB + gm * 4
    gx1 = tl.load(g + 0, mask=mask, other=0.0)
    gy1 = tl.load(g + 1, mask=mask, other=0.0)
    gx2 = tl.load(g + 2, mask=mask, other=0.0)
    gy2 = tl.load(g + 3, mask=mask, other=0.0)
    tl.store(out_bboxes + ba * 4 + 0, gx1, mask=mask)
    tl.store(out_bboxes + ba * 4 + 1, gy1, mask=mask)
    tl.store(out_bboxes + ba * 4 + 2, gx2, mask=mask)
    tl.store(out_bboxes + ba * 4 + 3, gy2, mask=mask)
    if TAL:
        iou = paddle_iou(gx1, gy1, gx2, gy2, qx1, qy1, qx2, qy2)
        s = tl.load(S + ba * C + lab, mask=fg & (lab >= 0) & (lab < C), other=0.0)
        metric = _pow(s, alpha, LIBDEVICE) * _pow(iou, beta, LIBDEVICE)
        tl.store(value + ba, metric, mask=fg)
        tl.atomic_max(max_metric + gm, metric, mask=fg)
        tl.atomic_max(max_iou + gm, iou, mask=fg)
    else:
        if HAS_PRED:
            p = P + ba * 4
            v = paddle_iou(gx1, gy1, gx2, gy2, tl.load(p + 0, mask=fg, other=0.0), tl.load(p + 1, mask=fg, other=0.0),
                           tl.load(p + 2, mask=fg, other=0.0), tl.load(p + 3, mask=fg, other=0.0))
        else:
            v = tl.full([BLOCK], 1.0, tl.float32)
        tl.store(value + ba, v, mask=fg)


@triton.jit
def _scores_kernel(GTL, assigned, value, max_metric, max_iou, scores, A, C, M, total_rows, bg_index, eps,
                   TAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < total_rows
    m = tl.load(assigned + rows, mask=rmask, other=-1)
    fg = rmask & (m >= 0)
    gm = (rows // A) * M + tl.where(m >= 0, m, 0).to(tl.int64)
    col = score_column(tl.load(GTL + gm, mask=fg, other=bg_index), bg_index, C)
    v = tl.load(value + rows, mask=fg, other=0.0)
    if TAL:
        v = _div(v, tl.load(max_metric + gm, mask=fg, other=1.0) + eps) * tl.load(max_iou + gm, mask=fg, other=0.0)
    out = tl.where(fg[:, None] & (col[:, None] == cols[None, :]), v[:, None], 0.0)
    tl.store(scores + rows[:, None] * C + cols[None, :], out, mask=rmask[:, None] & (cols[None, :] < C))


def _kp(k: int) -> int:
    return 16 if k <= 16 else 32


def _empty_outputs(B, A, C, ref: Tensor, bg_index: int, M: int):
    labels = torch.empty((B, A), dtype=torch.int64, device=ref.device)
    bboxes = torch.empty((B, A, 4), dtype=torch.float32, device=ref.device)
    scores = torch.empty((B, A, C), dtype=torch.float32, device=ref.device)
    if M == 0:
        labels.fill_(bg_index)
        bboxes.zero_()
        scores.zero_()
    return labels, bboxes, scores


def _finish(TAL, S, P, AN, G, Lb, V, count, owner, B, A, C, M, alpha, beta, bg_index, eps, labels, bboxes, scores):
    dev = G.device
    assigned = torch.empty((B, A), dtype=torch.int32, device=dev)
    value = torch.zeros((B, A), dtype=torch.float32, device=dev)
    max_metric = torch.zeros((B, M), dtype=torch.float32, device=dev)
    max_iou = torch.zeros((B, M), dtype=torch.float32, device=dev)
    dummy = G  # stands in for pointers a variant does not read
    _resolve_kernel[(triton.cdiv(B * A, _BLOCK_A),)](
        S if S is not None else dummy, P if P is not None else dummy, AN if AN is not None else dummy, G, Lb, V,
        count, owner, assigned, value, max_metric, max_iou, labels, bboxes, B, A, C, M, alpha, beta, bg_index,
        TAL=TAL, HAS_PRED=P is not None, LIBDEVICE=not interpreting(), BLOCK=_BLOCK_A)
    BLOCK_C = min(128, triton.next_power_of_2(max(C, 1)))
    BLOCK_R = max(1, 4096 // BLOCK_C)
    _scores_kernel[(triton.cdiv(B * A, BLOCK_R), triton.cdiv(C, BLOCK_C))](
        Lb, assigned, value, max_metric, max_iou, scores, A, C, M, B * A, bg_index, eps, TAL=TAL,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)


@torch.library.custom_op(f"{NAMESPACE}::task_aligned_assign", mutates_args=())
def task_aligned_assign(pred_scores: Tensor, pred_bboxes: Tensor, anchor_points: Tensor, gt_labels: Tensor,
                        gt_bboxes: Tensor, pad_gt_mask: Tensor, bg_index: int, topk: int, alpha: float,
                        beta: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_device("task_aligned_assign", pred_scores, pred_bboxes, anchor_points, gt_bboxes)
    B, A, C = pred_scores.shape
    M = gt_bboxes.shape[1]
    k = min(topk, A)
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"fastdet.ops.task_aligned_assign (triton): topk must be in [1, {MAX_TOPK}], got {topk}")
    labels, bboxes, scores = _empty_outputs(B, A, C, pred_scores, bg_index, M)
    if B * A == 0 or M == 0:
        return labels, bboxes, scores
    f32 = torch.float32
    S = pred_scores.to(f32).contiguous()
    P = pred_bboxes.to(f32).contiguous()
    pts = anchor_points.to(f32).contiguous()
    G = gt_bboxes.to(f32).contiguous()
    Lb = gt_labels.reshape(B, M).to(torch.int64).contiguous()
    V = pad_gt_mask.reshape(B, M).to(f32).contiguous()
    count = torch.zeros((B, A), dtype=torch.int32, device=G.device)
    owner = torch.empty((B, A), dtype=torch.int32, device=G.device)
    _tal_candidates_kernel[(B * M,)](S, P, pts, G, Lb, V, count, owner, A, C, M, k, alpha, beta,
                                     KP=_kp(k), CHUNK=_CHUNK, SORT=not interpreting(), LIBDEVICE=not interpreting())
    _finish(True, S, P, None, G, Lb, V, count, owner, B, A, C, M, alpha, beta, bg_index, eps, labels, bboxes, scores)
    return labels, bboxes, scores


@task_aligned_assign.register_fake
def _tal_fake(pred_scores, pred_bboxes, anchor_points, gt_labels, gt_bboxes, pad_gt_mask, bg_index, topk, alpha,
              beta, eps):
    B, A, C = pred_scores.shape
    return (pred_scores.new_empty((B, A), dtype=torch.int64), pred_scores.new_empty((B, A, 4), dtype=torch.float32),
            pred_scores.new_empty((B, A, C), dtype=torch.float32))


# (anchors per level, device) -> (level starts [L], level sizes [L]) int64 on the device.
# Made once per size bucket: ``torch.tensor(list, device=cuda)`` is a host-to-device copy
# from pageable memory, which synchronises with the host and is illegal inside a CUDA-graph
# capture. The first call of a bucket happens in eager warm-up, before its capture.
_LEVEL_TABLES: dict[tuple[tuple[int, ...], torch.device], tuple[Tensor, Tensor]] = {}


def _level_tables(counts: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    key = (counts, device)
    hit = _LEVEL_TABLES.get(key)
    if hit is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fastdet.ops.atss_assign (triton): level table for {list(counts)} "
                               "first needed inside a CUDA-graph capture; run the step once "
                               "eagerly before capturing it")
        starts = [sum(counts[:i]) for i in range(len(counts))]
        hit = (torch.tensor(starts, dtype=torch.int64, device=device),
               torch.tensor(counts, dtype=torch.int64, device=device))
        _LEVEL_TABLES[key] = hit
    return hit


@torch.library.custom_op(f"{NAMESPACE}::atss_assign", mutates_args=())
def atss_assign(anchors: Tensor, num_anchors_list: list[int], gt_labels: Tensor, gt_bboxes: Tensor,
                pad_gt_mask: Tensor, pred_bboxes: Optional[Tensor], bg_index: int, num_classes: int, topk: int,
                eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_device("atss_assign", anchors, gt_bboxes)
    A = anchors.shape[0]
    B, M = gt_bboxes.shape[:2]
    if sum(num_anchors_list) != A or min(num_anchors_list, default=0) < 1:
        raise ValueError(f"fastdet.ops.atss_assign: num_anchors_list {list(num_anchors_list)} must be positive "
                         f"and sum to the {A} anchors")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"fastdet.ops.atss_assign (triton): topk must be in [1, {MAX_TOPK}], got {topk}")
    labels, bboxes, scores = _empty_outputs(B, A, num_classes, gt_bboxes, bg_index, M)
    if B * A == 0 or M == 0:
        return labels, bboxes, scores
    f32, dev = torch.float32, gt_bboxes.device
    AN = anchors.to(f32).contiguous()
    CEN = ((AN[:, :2] + AN[:, 2:]) / 2).contiguous()
    G = gt_bboxes.to(f32).contiguous()
    Lb = gt_labels.reshape(B, M).to(torch.int64).contiguous()
    V = pad_gt_mask.reshape(B, M).to(f32).contiguous()
    P = pred_bboxes.to(f32).contiguous() if pred_bboxes is not None else None
    K = sum(min(topk, n) for n in num_anchors_list)
    lstart, lsize = _level_tables(tuple(num_anchors_list), dev)
    cand = torch.zeros((B, M, K), dtype=torch.int64, device=dev)
    cand_iou = torch.zeros((B, M, K), dtype=f32, device=dev)
    _atss_candidates_kernel[(B * M,)](AN, CEN, G, V, lstart, lsize, cand, cand_iou, M, K, topk,
                                      len(num_anchors_list), KP=_kp(topk), CHUNK=_CHUNK, SORT=not interpreting())
    # The threshold with the reference's own reductions, so it agrees to the bit.
    thr = (cand_iou.mean(-1) + cand_iou.std(-1)).contiguous()  # [B, M]
    count = torch.zeros((B, A), dtype=torch.int32, device=dev)
    owner = torch.empty((B, A), dtype=torch.int32, device=dev)
    total = B * M * K
    _atss_claim_kernel[(triton.cdiv(total, 1024),)](CEN, G, V, cand, cand_iou, thr, count, owner, A, M, K, total,
                                                    BLOCK=1024)
    _finish(False, None, P, AN, G, Lb, V, count, owner, B, A, num_classes, M, 0.0, 0.0, bg_index, 0.0, labels, bboxes,
            scores)
    return labels, bboxes, scores


@atss_assign.register_fake
def _atss_fake(anchors, num_anchors_list, gt_labels, gt_bboxes, pad_gt_mask, pred_bboxes, bg_index, num_classes,
               topk, eps):
    B = gt_bboxes.shape[0]
    A = anchors.shape[0]
    return (gt_bboxes.new_empty((B, A), dtype=torch.int64), gt_bboxes.new_empty((B, A, 4), dtype=torch.float32),
            gt_bboxes.new_empty((B, A, num_classes), dtype=torch.float32))
