"""Public ops API. Callers never choose a back end: see ``fastdet.ops`` dispatch."""

from fastdet.ops.reference import box_iou, ema_update_, generalized_box_iou, giou_loss

__all__ = ["box_iou", "generalized_box_iou", "giou_loss", "ema_update_"]
