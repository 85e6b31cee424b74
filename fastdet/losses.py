"""Detection losses: varifocal, distribution focal, GIoU (through ``fastdet.ops``), FCOS's
smoothed GIoU on distances, and the cross-rank normaliser they share.

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

__all__ = ["varifocal_loss", "distribution_focal_loss", "sigmoid_focal_loss", "giou_loss", "smoothed_giou_loss_ltrb",
           "loss_float", "all_reduce_mean"]


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


class _SigmoidFocalLoss(torch.autograd.Function):
    """Summed sigmoid focal loss with a closed-form backward that keeps only the logits and
    targets (torchvision's autograd graph keeps about six [..., C] intermediates)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, alpha: float, gamma: float) -> Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.alpha, ctx.gamma = alpha, gamma
        return _focal_terms(logits, targets, alpha, gamma)[0].sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, targets = ctx.saved_tensors
        _, p, ce, q, w = _focal_terms(logits, targets, ctx.alpha, ctx.gamma)
        # d/dx [w ce q^g] = w (dce q^g + ce g q^(g-1) dq), dce = p - t, dq = -p (1 - p) (2t - 1)
        g = ctx.gamma
        dq = -p * (1 - p) * (2 * targets - 1)
        d = w * ((p - targets) * q.pow(g) + ce * g * q.pow(g - 1) * dq)
        return grad * d, None, None, None


def _focal_terms(x: Tensor, t: Tensor, alpha: float, gamma: float):
    p = x.sigmoid()
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    q = p + t - 2 * p * t  # 1 - p_t
    w = alpha * t + (1 - alpha) * (1 - t) if alpha >= 0 else torch.ones_like(t)
    return w * ce * q.pow(gamma), p, ce, q, w


def sigmoid_focal_loss(logits: Tensor, targets: Tensor, alpha: float = 0.25, gamma: float = 2.0) -> Tensor:
    """Sigmoid focal loss (Lin et al. 2017), summed; ``torchvision.ops.sigmoid_focal_loss``
    with ``reduction="sum"``, in one fused autograd node (``gamma >= 1``).

    Args:
        logits: [..., C] classification logits; targets: [..., C] in [0, 1] (one-hot).
    """
    if gamma < 1:
        raise ValueError(f"sigmoid_focal_loss: gamma must be >= 1 for the fused backward, got {gamma}")
    return _SigmoidFocalLoss.apply(logits, targets, alpha, gamma)


def smoothed_giou_loss_ltrb(pred: Tensor, target: Tensor) -> Tensor:
    """PaddleDetection's FCOS ``1 - GIoU`` on distances from a shared point (``FCOSLoss``'s
    ``__iou_loss``, ``iou_loss_type="giou"``; ppdet/modeling/losses/fcos_loss.py, 2.6).

    Unlike the plain GIoU (:func:`giou_loss`, torchvision's) the IoU is ``(inter + 1) /
    (union + 1)``, while the enclosing term uses the unsmoothed union and the enclosing
    area + 1e-7. With FCOS's ``norm_reg_targets`` the distances are in strides, so a box is a
    few units wide and the +1 weighs as much as the areas themselves: the plain GIoU moves
    the box loss by percents and the regression gradients by up to a third.

    Args:
        pred, target: [..., 4] distances (l, t, r, b) >= 0 from the same point.
    Returns:
        [...] the loss per point.
    """
    area_p = (pred[..., 0] + pred[..., 2]) * (pred[..., 1] + pred[..., 3])
    area_t = (target[..., 0] + target[..., 2]) * (target[..., 1] + target[..., 3])
    inner, outer = torch.minimum(pred, target), torch.maximum(pred, target)  # [..., 4] each
    inter = (inner[..., 0] + inner[..., 2]) * (inner[..., 1] + inner[..., 3])
    enclose = (outer[..., 0] + outer[..., 2]) * (outer[..., 1] + outer[..., 3]) + 1e-7
    union = area_p + area_t - inter
    iou = (inter + 1.0) / (union + 1.0)
    return 1.0 - (iou - (enclose - union) / enclose)


def loss_float(t: Tensor) -> Tensor:
    """A head output cast up for its loss: float32 from half or bfloat16 (AMP), float64 kept
    (the tests compare the losses with the authors' code in float64)."""
    return t if t.dtype == torch.float64 else t.float()


def all_reduce_mean(x: Tensor) -> Tensor:
    """Mean of ``x`` over ranks (SUM then / world size) when a process group of more than
    one rank is up; ``x`` unchanged otherwise. Out of place and traceable inside compiled
    code (``fastdet.runtime.dist.all_reduce_mean_`` is the blocking, in-place one).

    Uses the functional collective, which dynamo traces into the graph (no graph break,
    unlike ``dist.all_reduce`` on a tensor that is then read). ``x`` must not require grad:
    it is a normaliser (the sum of assigned scores), not a path for gradients.
    """
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world > 1:
            from torch.distributed import _functional_collectives as funcol  # only where dist is built and running

            return funcol.all_reduce(x, "sum", dist.group.WORLD) / world
    return x
