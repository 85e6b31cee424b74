"""The base detector (backbone -> neck -> head) and the post-processing every family shares.

A family subclasses :class:`Detector` only for what differs (e.g. its own ``predict``);
its head computes the loss (``head.loss(feats, targets, **kwargs) -> dict``) and the dense
predictions (``head.inference(feats) -> (boxes [B,A,4] xyxy px, scores [B,A,C])``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
import torchvision
from torch import Tensor, nn

from fastdet.data.layout import REQUIRED_TARGET_KEYS
from fastdet.data.preprocess import Preprocess

if TYPE_CHECKING:
    from fastdet.models.recipe import Recipe


@dataclass(frozen=True)
class WeightSource:
    """How a family reads one source's released weight files (``fastdet.convert``).

    ``convert(state) -> (state, num_classes)``: the authors' ``{name: tensor}`` (after the
    file's layout is unwrapped) to fastdet's names, with the class count read from the
    head's shapes; a key the family does not know raises ``KeyError`` naming it.
    ``options``: the family options (config ``family`` section) these weights need, e.g.
    their own decode. ``classes``: the label set of the released COCO models, ``"coco80"``
    or ``"coco91"`` (torchvision's indexing, label = COCO category id).
    ``file_format``: ``"torch"`` or ``"paddle"``.
    """

    convert: Callable[[dict[str, Any]], tuple[dict[str, Any], int]]
    file_format: str = "torch"
    options: Mapping[str, Any] = field(default_factory=dict)
    classes: str = "coco80"


@dataclass(frozen=True)
class ArchFamily:
    """What the registry knows of an architecture family.

    ``build(size, num_classes, **options) -> Detector``; ``config_fields`` names the
    fields of the family's options (the config's ``family`` section) that ``build``
    takes as keyword options (see ``fastdet.models.build_model_from_config``);
    ``preprocess`` is how evaluation, prediction and export feed the network
    (``fastdet.data.preprocess``); ``recipe`` is how the family trains (presets, demo,
    options, phases, post-processing: ``fastdet.models.recipe``); ``weight_sources``: the
    authors' released files it converts (:class:`WeightSource`, ``fastdet.convert``).
    """

    build: Callable[..., "Detector"]
    sizes: tuple[str, ...]
    config_fields: tuple[str, ...] = field(default_factory=tuple)
    preprocess: Preprocess = field(default_factory=Preprocess)
    recipe: Optional["Recipe"] = None
    # Released weights this family reads, by source name ("megvii", "paddle", "torchvision").
    weight_sources: Mapping[str, WeightSource] = field(default_factory=dict)


class Detector(nn.Module):
    """``backbone -> neck -> head``.

    ``model(images, targets, **phase.loss_kwargs)`` (the family recipe's phase of the
    epoch, ``fastdet.models.recipe``) returns the head's dict of named losses (including ``total_loss``); ``model(images)`` returns the dense
    predictions ``(boxes [B,A,4] xyxy input px, scores [B,A,C] probabilities)``, and
    :meth:`predict` adds multiclass NMS. Both paths have static shapes and no host syncs.
    """

    size_divisor = 32  # inputs must be multiples of the largest stride
    # The defaults of :meth:`predict` (the multiclass NMS that ``fastdet.export --nms``
    # reproduces); a family with other published post-processing values sets its own
    # here, and one with another NMS (Matrix NMS, YOLOX's) overrides ``predict`` instead.
    predict_defaults: ClassVar[Mapping[str, Any]] = {"score_thresh": 0.01, "iou_thresh": 0.7, "max_det": 300,
                                                     "pre_nms_topk": 1000, "per_class_topk": False}
    # The form of :meth:`predict`'s NMS that ``fastdet.export --nms`` rebuilds from the ONNX
    # NonMaxSuppression op, declared by the class that defines ``predict``: "multiclass"
    # (every (anchor, class) pair is a candidate), "best_class" (one per anchor: its best
    # class, YOLOX's), or None where the op cannot reproduce it (Matrix NMS).
    nms_form: ClassVar[str | None] = "multiclass"

    def __init__(self, backbone: nn.Module, neck: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.neck = neck
        self.head = head

    def load_backbone_weights(self, path: str) -> None:
        """Start the backbone from a local state dict (``--backbone-weights``); a family whose
        backbone has a public checkpoint format overrides this."""
        raise ValueError(f"--backbone-weights: {type(self).__name__} has no torchvision-format backbone to load "
                         f"{path} into")

    def features(self, images: Tensor) -> list[Tensor]:
        return self.neck(self.backbone(images))

    def forward(self, images: Tensor, targets: Mapping[str, Tensor] | None = None, **loss_kwargs: Any):
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [B, 3, H, W], got {list(images.shape)}")
        h, w = images.shape[-2:]
        if h % self.size_divisor or w % self.size_divisor:
            raise ValueError(f"image size {h}x{w} must be a multiple of {self.size_divisor}")
        feats = self.features(images)
        if targets is None:
            return self.head.inference(feats)
        missing = [k for k in REQUIRED_TARGET_KEYS if k not in targets]
        if missing:
            raise ValueError(f"targets lack {', '.join(missing)} (expected keys {', '.join(REQUIRED_TARGET_KEYS)})")
        return self.head.loss(feats, targets, **loss_kwargs)

    @torch.no_grad()
    def predict(
        self,
        images: Tensor,
        score_thresh: float | None = None,
        iou_thresh: float | None = None,
        max_det: int | None = None,
        pre_nms_topk: int | None = None,
        per_class_topk: bool | None = None,
    ) -> list[dict[str, Tensor]]:
        """Detections per image: ``{"boxes" [K,4] xyxy input px, "scores" [K], "labels" [K]}``.

        An argument left at None takes the class's ``predict_defaults``. Call in eval mode
        (BatchNorm statistics). Host syncs are fine here: this is not the training hot path.
        """
        given = {"score_thresh": score_thresh, "iou_thresh": iou_thresh, "max_det": max_det,
                 "pre_nms_topk": pre_nms_topk, "per_class_topk": per_class_topk}
        kw = {k: self.predict_defaults.get(k, False) if v is None else v for k, v in given.items()}
        boxes, scores = self(images)
        return multiclass_nms(boxes, scores, kw["score_thresh"], kw["iou_thresh"], kw["max_det"], kw["pre_nms_topk"],
                              kw["per_class_topk"])

    @torch.no_grad()
    def fuse(self) -> "Detector":
        """Fuse re-parameterisable blocks (RepVGG branches, then conv+BN) for inference.

        Eval-mode outputs stay the same; the fused model can no longer be trained.
        """
        # Multi-branch blocks (``fuse_first``, e.g. RepVGG) fold their own conv+BN children,
        # so they go first; the remaining conv+BN pairs are folded after.
        for first in (True, False):
            for m in list(self.modules()):
                if m is not self and hasattr(m, "fuse") and getattr(m, "fuse_first", False) == first:
                    m.fuse()
        return self


def multiclass_nms(
    boxes: Tensor,
    scores: Tensor,
    score_thresh: float = 0.01,
    iou_thresh: float = 0.7,
    max_det: int = 300,
    pre_nms_topk: int = 1000,
    per_class_topk: bool = False,
) -> list[dict[str, Tensor]]:
    """Class-aware NMS over dense predictions.

    Per image: candidates are the (anchor, class) scores above ``score_thresh`` among the
    ``pre_nms_topk`` highest, over all classes (at most ``pre_nms_topk`` boxes go through
    NMS), or with ``per_class_topk`` the ``pre_nms_topk`` highest of each class
    (PaddleDetection's MultiClassNMS ``nms_top_k``, the authors' eval of PP-YOLOE and
    FCOS; up to ``pre_nms_topk * C`` boxes). Then ``torchvision.ops.batched_nms`` (per
    class, IoU ``iou_thresh``), and the best ``max_det`` over all classes are kept, by
    score. The two agree whenever fewer than ``pre_nms_topk`` candidates pass the threshold.

    Args:
        boxes: [B, A, 4] xyxy; scores: [B, A, C].
    """
    out = []
    num_anchors, num_classes = scores.shape[-2:]
    for b in range(boxes.shape[0]):
        if per_class_topk:
            k = min(pre_nms_topk, num_anchors)
            top_s, top_a = scores[b].topk(k, dim=0)  # [k, C] each: per class, best first
            keep = top_s > score_thresh
            top_s, anchor = top_s[keep], top_a[keep]
            labels = torch.arange(num_classes, device=scores.device).expand(k, -1)[keep]
        else:
            s = scores[b].reshape(-1)  # [A * C], anchor-major
            k = min(pre_nms_topk, s.numel())
            top_s, top_i = s.topk(k)
            keep = top_s > score_thresh
            top_s, top_i = top_s[keep], top_i[keep]
            anchor = torch.div(top_i, num_classes, rounding_mode="floor")
            labels = top_i % num_classes
        cand = boxes[b][anchor].float()
        kept = torchvision.ops.batched_nms(cand, top_s.float(), labels, iou_thresh)[:max_det]
        out.append({"boxes": cand[kept], "scores": top_s[kept], "labels": labels[kept]})
    return out


def rescale_boxes(boxes: Tensor, input_hw: Sequence[int], orig_hw: Sequence[int] | Tensor) -> Tensor:
    """Map ``[K, 4]`` xyxy boxes from the network input to the original image and clip.

    x scales by ``orig_w / input_w``, y by ``orig_h / input_h`` (eval resizes without
    keeping the aspect ratio, as PP-YOLOE does); ``orig_hw`` is ``(height, width)`` as in
    the batch's ``orig_sizes``.
    """
    in_h, in_w = (float(v) for v in input_hw)
    o_h, o_w = (float(v) for v in orig_hw)
    scale = boxes.new_tensor([o_w / in_w, o_h / in_h, o_w / in_w, o_h / in_h])
    out = boxes * scale
    out[:, 0::2] = out[:, 0::2].clamp(0, o_w)
    out[:, 1::2] = out[:, 1::2].clamp(0, o_h)
    return out
