"""Label assignment for PP-YOLOE in plain torch: ATSS and the task-aligned assigner (TAL).

These are the references (the truth) that faster kernels behind the same names are
tested against. They follow PaddleDetection's ``ATSSAssigner`` and
``TaskAlignedAssigner`` (ppdet/modeling/assigners) step by step, written with static
shapes: no ``.item()``, ``nonzero()``, boolean-mask indexing or per-image loops, so
they trace into one graph. Where Paddle branches on a data-dependent condition
(``if mask_positive_sum.max() > 1``) the branch is taken unconditionally through
``torch.where``, which gives the same result.

Shapes: B images, M padded ground-truth slots, A anchors over all levels, C classes.
Boxes are xyxy pixels. Background is ``bg_index`` (PP-YOLOE passes ``num_classes``).
Both return ``(assigned_labels [B,A] int64, assigned_bboxes [B,A,4], assigned_scores
[B,A,C])``; for anchors left as background the label is ``bg_index``, the scores row is
zero and the box is that of GT slot 0 (unused by the loss, as in Paddle), a zero box when
there is no slot (M = 0). Half and bfloat16 inputs are computed in float32 (as the kernels
do) and the boxes and scores returned in the input's dtype.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "atss_assign",
    "task_aligned_assign",
    "pairwise_iou",
    "points_inside_boxes",
]


def pairwise_iou(a: Tensor, b: Tensor, eps: float = 1e-9) -> Tensor:
    """IoU ``[..., N, 4] x [..., K, 4] -> [..., N, K]`` as Paddle's ``batch_iou_similarity``.

    ``overlap / (area_a + area_b - overlap + eps)`` with areas clipped at 0, so
    empty (padded, all-zero) boxes give IoU 0.
    """
    a = a[..., :, None, :]
    b = b[..., None, :, :]
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    overlap = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).clamp(min=0).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).clamp(min=0).prod(-1)
    return overlap / (area_a + area_b - overlap + eps)


def points_inside_boxes(points: Tensor, boxes: Tensor, eps: float = 1e-9) -> Tensor:
    """``[A, 2]`` points x ``[B, M, 4]`` boxes -> ``[B, M, A]`` float, 1 where strictly inside.

    PaddleDetection ``check_points_inside_bboxes``: ``min(l, t, r, b) > eps``.
    """
    x = points[:, 0]  # [A]
    y = points[:, 1]
    x1, y1, x2, y2 = (boxes[..., i, None] for i in range(4))  # each [B, M, 1]
    ltrb = torch.stack([x - x1, y - y1, x2 - x, y2 - y], dim=-1)  # [B, M, A, 4]
    return (ltrb.amin(dim=-1) > eps).to(boxes.dtype)


def topk_mask(x: Tensor, k: int, largest: bool = True) -> Tensor:
    """``[..., n]`` -> bool ``[..., n]`` marking the ``k`` best entries of each row, ties going to
    the lower index, as the kernels' packed (value, index) keys and the loop references order
    them. ``Tensor.topk`` leaves exact ties to its partial sort (CPU and CUDA differ), and ties
    are common: integer-cornered boxes put GT centres at exact distances from the grid, and
    anchors outside a GT all score 0.

    The k-th value comes from ``topk``; all entries better than it are taken, then the first
    ``k - (number better)`` entries equal to it (a running count), so exactly ``k`` per row.
    """
    kth = x.topk(k, dim=-1, largest=largest).values[..., -1:]  # [..., 1]
    better = x > kth if largest else x < kth
    tied = x == kth
    need = k - better.sum(dim=-1, keepdim=True)  # [..., 1], >= 1
    return better | (tied & (tied.cumsum(dim=-1) <= need))


def _max_iou_gt_onehot(ious: Tensor) -> Tensor:
    """``[B, M, A]`` -> one-hot over M of the GT with the largest IoU per anchor (first on ties)."""
    idx = ious.argmax(dim=-2, keepdim=True)  # [B, 1, A]
    return torch.zeros_like(ious).scatter_(-2, idx, 1.0)


def _resolve_and_gather(
    mask_positive: Tensor,
    ious: Tensor,
    pad_gt_mask: Tensor,
    gt_labels: Tensor,
    gt_bboxes: Tensor,
    bg_index: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Give each anchor at most one GT and gather its label and box.

    Args:
        mask_positive: [B, M, A] 0/1 candidate matrix.
        ious: [B, M, A] used to break ties: an anchor that is positive for several GTs
            goes to the GT of highest IoU (Paddle ``compute_max_iou_anchor``: the argmax
            runs over all real GT slots, as in Paddle). Padded slots are masked out of
            it, which changes nothing for zero-padded boxes (IoU 0) and keeps padded
            slots unmatched whatever their boxes hold.
        pad_gt_mask: [B, M, 1].
    Returns:
        mask_positive [B, M, A] (one 1 per positive column), assigned_labels [B, A]
        int64 (``bg_index`` where no GT), assigned_bboxes [B, A, 4].
    """
    multiple = mask_positive.sum(dim=-2, keepdim=True) > 1  # [B, 1, A]
    mask_positive = torch.where(multiple, _max_iou_gt_onehot(ious * pad_gt_mask), mask_positive)
    fg = mask_positive.sum(dim=-2) > 0  # [B, A]
    gt_index = mask_positive.argmax(dim=-2)  # [B, A]; 0 for background anchors
    labels = torch.gather(gt_labels.squeeze(-1).long(), 1, gt_index)  # [B, A]
    labels = torch.where(fg, labels, torch.full_like(labels, bg_index))
    bboxes = torch.gather(gt_bboxes, 1, gt_index[..., None].expand(-1, -1, 4))  # [B, A, 4]
    return mask_positive, labels, bboxes


def _all_background(B: int, A: int, C: int, bg_index: int, dtype: torch.dtype, device: torch.device
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """What the kernels return with no GT slot (M = 0): labels ``bg_index`` [B, A], zero boxes
    [B, A, 4] and scores [B, A, C]. M is a shape, so the branch to this is taken while tracing."""
    return (torch.full((B, A), bg_index, dtype=torch.int64, device=device),
            torch.zeros(B, A, 4, dtype=dtype, device=device), torch.zeros(B, A, C, dtype=dtype, device=device))


def _one_hot_without_bg(labels: Tensor, num_classes: int, bg_index: int, dtype: torch.dtype) -> Tensor:
    """``[B, A]`` labels in ``0..num_classes`` -> ``[B, A, num_classes]``; the bg column is dropped."""
    classes = torch.arange(num_classes + 1, device=labels.device)
    one_hot = (labels[..., None] == classes).to(dtype)  # [B, A, C + 1]
    keep = [c for c in range(num_classes + 1) if c != bg_index]
    if keep == list(range(num_classes)):
        return one_hot[..., :num_classes]
    return one_hot[..., keep]


@torch.no_grad()
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
    """ATSS (Zhang et al. 2020) as PaddleDetection's ``ATSSAssigner`` (force_gt_matching off).

    1. IoU of every GT with every anchor box; L2 distance of their centres.
    2. Per pyramid level, the ``topk`` anchors nearest each GT centre are candidates
       (``min(topk, anchors in the level)`` when a level is smaller, e.g. tiny inputs).
    3. Threshold per GT = mean + std (unbiased) of its candidates' IoUs; keep IoU > threshold.
    4. Keep candidates whose centre lies inside the GT; padded GTs never match.
    5. An anchor positive for several GTs goes to the one of highest IoU.
    Soft scores: one-hot label, times IoU(predicted box, its GT) when ``pred_bboxes``
    is given (PP-YOLOE passes it), else 1.

    Args:
        anchors: [A, 4] anchor boxes (PP-YOLOE: squares of side 5*stride on each point).
        num_anchors_list: anchors per level, summing to A (level-major order of ``anchors``).
        gt_labels: [B, M, 1] int labels; gt_bboxes: [B, M, 4]; pad_gt_mask: [B, M, 1] float.
        bg_index: label given to background anchors.
        pred_bboxes: optional [B, A, 4] predicted boxes in pixels (detached).
        num_classes: C of the scores; defaults to ``bg_index`` (background = C).
    """
    num_classes = bg_index if num_classes is None else num_classes
    B, M, _ = gt_bboxes.shape
    A = anchors.shape[0]
    if sum(num_anchors_list) != A:
        raise ValueError(f"atss_assign: num_anchors_list sums to {sum(num_anchors_list)}, anchors has {A} rows")
    out_dtype = gt_bboxes.dtype
    if M == 0:
        return _all_background(B, A, num_classes, bg_index, out_dtype, gt_bboxes.device)
    dtype = torch.promote_types(out_dtype, torch.float32)  # half boxes computed in float32, as the kernels do
    gt_bboxes, anchors = gt_bboxes.to(dtype), anchors.to(dtype)
    pad_gt_mask = pad_gt_mask.to(dtype)

    ious = pairwise_iou(gt_bboxes, anchors[None].expand(B, -1, -1))  # [B, M, A]
    gt_centers = (gt_bboxes[..., :2] + gt_bboxes[..., 2:]) / 2  # [B, M, 2]
    anchor_centers = (anchors[:, :2] + anchors[:, 2:]) / 2  # [A, 2]
    distances = (gt_centers[:, :, None, :] - anchor_centers[None, None]).norm(dim=-1)  # [B, M, A]

    is_in_topk_levels = []
    start = K = 0
    for n in num_anchors_list:
        k = min(topk, n)
        is_in = topk_mask(distances[..., start : start + n], k, largest=False).to(dtype)  # [B, M, n]
        is_in_topk_levels.append(is_in * pad_gt_mask)
        start += n
        K += k
    is_in_topk = torch.cat(is_in_topk_levels, dim=-1)  # [B, M, A], K ones per real GT

    # Mean + unbiased std of the K candidates' IoUs (Paddle gathers them; a masked sum over
    # the anchors gives the same statistics without the indices).
    iou_candidates = ious * is_in_topk
    mean = iou_candidates.sum(dim=-1, keepdim=True) / K  # [B, M, 1]
    var = ((ious - mean).square() * is_in_topk).sum(dim=-1, keepdim=True) / (K - 1)
    threshold = mean + var.sqrt()
    is_in_topk = torch.where(iou_candidates > threshold, is_in_topk, torch.zeros_like(is_in_topk))

    is_in_gts = points_inside_boxes(anchor_centers, gt_bboxes)
    mask_positive = is_in_topk * is_in_gts * pad_gt_mask  # [B, M, A]

    mask_positive, labels, bboxes = _resolve_and_gather(mask_positive, ious, pad_gt_mask, gt_labels, gt_bboxes, bg_index)
    scores = _one_hot_without_bg(labels, num_classes, bg_index, dtype)  # [B, A, C]
    if pred_bboxes is not None:
        pred_ious = pairwise_iou(gt_bboxes, pred_bboxes.to(dtype)) * mask_positive  # [B, M, A]
        scores = scores * pred_ious.amax(dim=-2)[..., None]
    return labels, bboxes.to(out_dtype), scores.to(out_dtype)


@torch.no_grad()
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
    """Task-aligned assignment (TOOD, Feng et al. 2021) as PaddleDetection's ``TaskAlignedAssigner``.

    1. metric = s^alpha * IoU^beta, s the predicted probability of the GT's class and
       IoU that of the predicted box with the GT.
    2. The ``topk`` anchors of largest metric among those whose point lies inside the GT
       (jointly over all levels) are candidates; they must lie inside the GT; padded GTs
       never match.
    3. An anchor positive for several GTs goes to the one of highest IoU.
    Soft scores: one-hot label x metric / max metric of that GT x max IoU of that GT.

    Args:
        pred_scores: [B, A, C] class probabilities (detached); pred_bboxes: [B, A, 4] pixels.
        anchor_points: [A, 2] anchor centres in pixels.
        gt_labels: [B, M, 1] int; gt_bboxes: [B, M, 4]; pad_gt_mask: [B, M, 1] float.
        bg_index: label of background anchors (PP-YOLOE: C).
    """
    B, A, C = pred_scores.shape
    out_dtype = pred_scores.dtype
    if gt_bboxes.shape[1] == 0:
        return _all_background(B, A, C, bg_index, out_dtype, pred_scores.device)
    # Half and bfloat16 in float32, as the kernels compute: IoU^6 and the areas of large boxes
    # leave fp16's range, and the labels came out different.
    dtype = torch.promote_types(out_dtype, torch.float32)
    pred_scores, anchor_points = pred_scores.to(dtype), anchor_points.to(dtype)
    gt_bboxes = gt_bboxes.to(dtype)
    pad_gt_mask = pad_gt_mask.to(dtype)

    ious = pairwise_iou(gt_bboxes, pred_bboxes.to(dtype))  # [B, M, A]
    batch_idx = torch.arange(B, device=pred_scores.device)[:, None]  # [B, 1]
    # [B, C, A] indexed by (image, GT class) -> [B, M, A]: each GT's class score at every anchor.
    cls_scores = pred_scores.transpose(1, 2)[batch_idx, gt_labels.squeeze(-1).long()]
    metrics = cls_scores.pow(alpha) * ious.pow(beta)  # [B, M, A]

    is_in_gts = points_inside_boxes(anchor_points, gt_bboxes)  # [B, M, A]
    is_in_topk = topk_mask(metrics * is_in_gts, min(topk, A)).to(dtype) * pad_gt_mask  # [B, M, A]
    mask_positive = is_in_topk * is_in_gts * pad_gt_mask  # [B, M, A]

    mask_positive, labels, bboxes = _resolve_and_gather(mask_positive, ious, pad_gt_mask, gt_labels, gt_bboxes, bg_index)
    scores = _one_hot_without_bg(labels, C, bg_index, dtype)  # [B, A, C]

    metrics = metrics * mask_positive
    max_metric = metrics.amax(dim=-1, keepdim=True)  # [B, M, 1]
    max_iou = (ious * mask_positive).amax(dim=-1, keepdim=True)
    norm = (metrics / (max_metric + eps) * max_iou).amax(dim=-2)  # [B, A]
    return labels, bboxes.to(out_dtype), (scores * norm[..., None]).to(out_dtype)
