"""Detection losses: varifocal, distribution focal, GIoU (through ``fastdet.ops``), and the
cross-rank normaliser they share.

All take float32 inputs; callers cast head outputs up before calling (AMP-safe), and
the binary terms work on logits (``binary_cross_entropy_with_logits``), which equals
Paddle's BCE on sigmoid probabilities without its log clamp and is allowed under autocast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fastdet.ops import giou_loss

__all__ = ["varifocal_loss", "distribution_focal_loss", "giou_loss", "all_reduce_mean"]


def varifocal_loss(logits: Tensor, gt_score: Tensor, label: Tensor, alpha: float = 0.75, gamma: float = 2.0) -> Tensor:
    """Varifocal loss (Zhang et al. 2021, VarifocalNet), summed; PP-YOLOE ``_varifocal_loss``.

    ``BCE(p, q) * (alpha * p^gamma * (1 - label) + q * label)`` with ``p = sigmoid(logits)``.
    As in PaddleDetection the weight is not detached.

    Args:
        logits: [..., C] classification logits.
        gt_score: [..., C] soft targets q (IoU-aware scores from the assigner, 0 on negatives).
        label: [..., C] 1 for the assigned class of positive anchors, else 0.
    """
    p = logits.sigmoid()
    weight = alpha * p.pow(gamma) * (1.0 - label) + gt_score * label
    return (F.binary_cross_entropy_with_logits(logits, gt_score, reduction="none") * weight).sum()


def distribution_focal_loss(pred_dist: Tensor, target: Tensor) -> Tensor:
    """Distribution focal loss (Li et al. 2020, GFL), elementwise; PP-YOLOE ``_df_loss``.

    ``CE(left) * (right - t) + CE(right) * (t - left)`` with ``left = floor(t)``.

    Args:
        pred_dist: [..., n_bins] logits over the integer distances 0..n_bins-1.
        target: [...] distances in bin units, within ``[0, n_bins - 1)``.
    Returns:
        [...] loss per distance.
    """
    n_bins = pred_dist.shape[-1]
    # A non-finite target (a diverged model) must give a non-finite loss, which the trainer
    # reports, not an out-of-range gather index (a crash on the CPU, a device assert on CUDA).
    left = torch.nan_to_num(target.floor(), nan=0.0).clamp(0, n_bins - 2).long()
    right = left + 1
    w_left = right.to(target.dtype) - target
    w_right = 1.0 - w_left
    logp = pred_dist.log_softmax(dim=-1)
    nll_left = -logp.gather(-1, left[..., None]).squeeze(-1)
    nll_right = -logp.gather(-1, right[..., None]).squeeze(-1)
    return nll_left * w_left + nll_right * w_right


def all_reduce_mean(x: Tensor) -> Tensor:
    """Mean of ``x`` over ranks (SUM then / world size) when a process group of more than
    one rank is up; ``x`` unchanged otherwise.

    Uses the functional collective, which dynamo traces into the graph (no graph break,
    unlike ``dist.all_reduce`` on a tensor that is then read). ``x`` must not require grad:
    it is a normaliser (the sum of assigned scores), not a path for gradients.
    """
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world > 1:
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(x, "sum", dist.group.WORLD) / world
    return x
