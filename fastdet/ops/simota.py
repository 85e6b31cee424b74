"""SimOTA label assignment (YOLOX, Ge et al. 2021) in plain torch: the reference the kernels
behind ``fastdet.ops.simota_assign`` are tested against.

Semantics of the published YOLOX weights (Megvii yolox/models/yolo_head.py at f7f7c71,
``get_in_boxes_info`` and ``dynamic_k_matching``), written with static shapes (no
per-image loop, ``nonzero``, boolean indexing or host sync), so it traces into one graph:

1. A point (anchor centre ``(i + 0.5) * stride``) is a *candidate* of its image if it lies
   strictly inside any real GT box or inside any GT's centre square (half side
   ``center_radius * stride``). Only candidates are ever assigned.
2. cost[m, a] = sum_c BCE(sqrt(score[a, c]), onehot(label_m)[c])
   + ``iou_weight`` * -log(IoU(gt_m, pred_a) + 1e-8)
   + 1e5 if the point is not both inside box m and inside its centre square.
   BCE clamps its logs at -100 as ``F.binary_cross_entropy`` does. The sum over classes is
   computed as sum_c BCE(q_c, 0) - BCE(q_l, 0) + BCE(q_l, 1), which needs no
   ``[B, M, A, C]`` tensor (Megvii forms ``[num_gt, num_candidates, C]``).
3. dynamic k[m] = max(1, floor(sum of the ``topk`` largest candidate IoUs of GT m)); with
   fewer than ``topk`` candidates the missing ones add 0, which is Megvii's
   ``min(10, #candidates)``. The sum is taken in float64, so it does not depend on the
   order of the additions (Megvii's float32 sum can differ in the last bit).
4. Each GT claims its k cheapest candidates; a point claimed by several GTs goes to the
   GT of least cost at that point (over all real GTs of the image, as Megvii's
   ``cost[:, multiple].min(0)``), the first on ties.

The cost plus penalty is compared in float64 (``cost + 1e5`` in float32 rounds to a
multiple of 2^-7, which would make most penalised points tie); it is the same order as
Megvii's wherever float32 keeps the costs apart. Ties in the cost go to the lower point
index (Megvii's ``torch.topk`` leaves their order unspecified).

Shapes: B images, M padded GT slots, A points, C classes. Returns ``assigned_gt [B, A]``
int64 (the GT slot, -1 for background) and ``assigned_iou [B, A]`` (IoU of the point's
predicted box with its GT, 0 for background; YOLOX's classification target).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastdet.ops import reference

PENALTY = 1e5  # added to the cost of a point outside box or centre square
BCE_LOG_CLAMP = 100.0  # F.binary_cross_entropy clamps log(p) and log(1 - p) at -100


def candidate_masks(anchor_points: Tensor, strides: Tensor, gt_boxes: Tensor, gt_mask: Tensor,
                    center_radius: float) -> tuple[Tensor, Tensor]:
    """-> in_box [B, M, A] and in_centre [B, M, A] bool (False for padded slots)."""
    x = anchor_points[:, 0]  # [A]
    y = anchor_points[:, 1]
    x1, y1, x2, y2 = (gt_boxes[..., i, None] for i in range(4))  # each [B, M, 1]
    valid = gt_mask[..., None]
    in_box = (x - x1 > 0) & (y - y1 > 0) & (x2 - x > 0) & (y2 - y > 0) & valid
    cx = (x1 + x2) / 2
    cy = (y1 + y2) / 2
    r = center_radius * strides  # [A]
    in_ctr = (x - (cx - r) > 0) & (y - (cy - r) > 0) & ((cx + r) - x > 0) & ((cy + r) - y > 0) & valid
    return in_box, in_ctr


def class_cost_terms(pred_scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, A, C]`` scores -> (sum_c BCE(q_c, 0) [B, A], BCE(q, 0) [B, A, C], BCE(q, 1) [B, A, C]), q = sqrt(score)."""
    q = pred_scores.sqrt()
    bce0 = (-torch.log1p(-q)).clamp(max=BCE_LOG_CLAMP)
    bce1 = (-torch.log(q)).clamp(max=BCE_LOG_CLAMP)
    return bce0.sum(-1), bce0, bce1


@torch.no_grad()
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
    """SimOTA; see the module docstring.

    Args:
        pred_scores: [B, A, C] sigmoid(cls) * sigmoid(obj), before the square root.
        pred_boxes: [B, A, 4] decoded predictions, xyxy px.
        anchor_points: [A, 2] point centres px; strides: [A].
        gt_boxes: [B, M, 4] xyxy px; gt_labels: [B, M] int; gt_mask: [B, M] bool.
    """
    B, A, C = pred_scores.shape
    M = gt_boxes.shape[1]
    dtype = torch.float64 if pred_scores.dtype == torch.float64 else torch.float32
    if M == 0:  # no GT slot: all background, as the kernels return (a shape: decided while tracing)
        return (torch.full((B, A), -1, dtype=torch.int64, device=pred_scores.device),
                torch.zeros(B, A, dtype=dtype, device=pred_scores.device))
    scores = pred_scores.to(dtype)
    preds = pred_boxes.to(dtype)
    gts = gt_boxes.to(dtype)
    valid = gt_mask.bool()
    in_box, in_ctr = candidate_masks(anchor_points.to(dtype), strides.to(dtype), gts, valid, center_radius)
    cand = (in_box | in_ctr).any(dim=1)  # [B, A]
    usable = cand[:, None, :] & valid[..., None]  # [B, M, A]

    ious = reference.box_iou(gts, preds)  # [B, M, A]
    neg_sum, bce0, bce1 = class_cost_terms(scores)
    labels = gt_labels.long().clamp(0, C - 1)[..., None].expand(B, M, A)
    cost_cls = (neg_sum[:, None, :] - bce0.transpose(1, 2).gather(1, labels)) + bce1.transpose(1, 2).gather(1, labels)
    cost = cost_cls + iou_weight * (-torch.log(ious + 1e-8))  # [B, M, A]
    key = cost.double() + PENALTY * (~(in_box & in_ctr)).double()
    key = torch.where(usable, key, torch.inf)

    k_max = min(topk, A)
    top_ious = torch.where(usable, ious, 0).topk(k_max, dim=-1).values  # [B, M, k_max]
    dynamic_k = top_ious.double().sum(-1).floor().clamp(min=1).long()  # [B, M]
    # A stable sort, not topk: equal costs go to the lower point index on every device.
    top_key, top_idx = (t[..., :k_max] for t in key.sort(dim=-1, stable=True))  # [B, M, k_max], cheapest first
    take = (torch.arange(k_max, device=key.device) < dynamic_k[..., None]) & torch.isfinite(top_key)
    matching = torch.zeros(B, M, A, dtype=torch.bool, device=key.device).scatter_(-1, top_idx, take)

    count = matching.sum(dim=1)  # [B, A]
    cheapest = key.argmin(dim=1)  # [B, A]; first on ties
    assigned = torch.where(count > 1, cheapest, matching.long().argmax(dim=1))
    assigned = torch.where(count > 0, assigned, -1)
    iou = ious.gather(1, assigned.clamp(min=0)[:, None, :]).squeeze(1)
    return assigned, torch.where(count > 0, iou, 0)
