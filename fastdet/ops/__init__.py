"""Public ops API. Callers never choose a back end: see ``fastdet.ops`` dispatch."""

from fastdet.ops.assigners import atss_assign, task_aligned_assign
from fastdet.ops.reference import box_iou, ema_update_, generalized_box_iou, giou_loss

__all__ = [
    "box_iou",
    "generalized_box_iou",
    "giou_loss",
    "ema_update_",
    "task_aligned_assign",
    "atss_assign",
]
