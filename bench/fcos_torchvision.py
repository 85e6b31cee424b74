"""Train torchvision's FCOS through fastdet's trainer: a side-by-side check of our FCOS.

``python bench/fcos_torchvision.py [fastdet.train arguments]`` registers one more
architecture, ``fcos_tv``, and runs ``fastdet.train`` with the arguments given, e.g.::

    python bench/fcos_torchvision.py --arch fcos_tv --size r50 --data demo --output-dir runs/fcos-tv
    python -m fastdet.train          --arch fcos    --size r50 --data demo --output-dir runs/fcos

``fcos_tv`` is ``torchvision.models.detection.fcos_resnet50_fpn`` (weights=None): its
backbone, FPN, head, point-to-box matching and losses, unchanged. Everything else is
fastdet's and the same for both runs: the data, its order and augmentation (the FCOS
recipe, demo preset included), the optimiser and schedule, the EMA, the multiclass NMS
and the COCO evaluation. So the two runs' losses and AP compare the two
implementations of the model, the assignment and the loss, and nothing else.

What differs on purpose (torchvision's own choices, ARCHS.md §3): no learnable scale
per level, GIoU not weighted by centerness, points at ``k * stride`` (ours: Paddle's
``k * stride + stride / 2``), no 2x LR on the tower biases. Both backbones are
torchvision's ResNet-50 with trainable BatchNorm and nothing frozen when trained from
scratch (``family.from_scratch``, the demo).

The matching copies each image's boxes out of the padded targets (a host sync per
image): this is a reference to compare with, not a fast path.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import Tensor, nn
from torchvision.models.detection import fcos_resnet50_fpn
from torchvision.models.detection.image_list import ImageList

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastdet.models import ARCHITECTURES, fcos  # noqa: E402
from fastdet.models.detector import ArchFamily, Detector  # noqa: E402


class _Levels(nn.Module):
    """torchvision's BackboneWithFPN returns an OrderedDict of P3..P7; the head takes a list."""

    def forward(self, feats: Mapping[str, Tensor]) -> list[Tensor]:
        return list(feats.values())


class TorchvisionFCOSHead(nn.Module):
    """torchvision's FCOS head, anchors, matching and loss behind fastdet's head interface."""

    def __init__(self, tv: nn.Module, num_classes: int):
        super().__init__()
        self.head = tv.head
        self.anchor_generator = tv.anchor_generator
        self.box_coder = tv.box_coder
        self._tv = [tv]  # compute_loss lives on the FCOS module; a list keeps it out of the state dict
        self.num_classes = num_classes

    def _anchors(self, feats: Sequence[Tensor]) -> list[Tensor]:
        b = feats[0].shape[0]
        h, w = feats[0].shape[-2] * 8, feats[0].shape[-1] * 8  # P3 has stride 8
        images = ImageList(feats[0].new_empty(b, 0, h, w), [(h, w)] * b)
        return self.anchor_generator(images, list(feats))

    def inference(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """-> boxes [B, A, 4] xyxy input px, scores [B, A, C] = sigmoid(cls) * sigmoid(centerness)."""
        out = self.head(list(feats))
        anchors = torch.stack(self._anchors(feats))  # [B, A, 4]
        boxes = self.box_coder.decode(out["bbox_regression"], anchors)
        return boxes, out["cls_logits"].sigmoid() * out["bbox_ctrness"].sigmoid()

    def loss(self, feats: Sequence[Tensor], targets: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out = self.head(list(feats))
        anchors = self._anchors(feats)
        per_level = [f.shape[-2] * f.shape[-1] for f in feats]
        mask = targets["gt_mask"]
        tv_targets = [{"boxes": targets["gt_boxes"][i][mask[i]].float(), "labels": targets["gt_labels"][i][mask[i]].long()}
                      for i in range(mask.shape[0])]
        losses = self._tv[0].compute_loss(tv_targets, out, anchors, per_level)
        cls, box, ctr = losses["classification"], losses["bbox_regression"], losses["bbox_ctrness"]
        return {"total_loss": cls + box + ctr, "loss_cls": cls, "loss_box": box, "loss_ctr": ctr}


class TorchvisionFCOS(Detector):
    predict_defaults = fcos.FCOS.predict_defaults


def build_torchvision_fcos(size: str, num_classes: int = 80, *, from_scratch: bool = False) -> TorchvisionFCOS:
    """torchvision's fcos_resnet50_fpn with no weights: trainable BatchNorm, nothing frozen
    (torchvision's choice without pretrained weights, and ours with ``from_scratch``)."""
    if not from_scratch:
        raise ValueError("fcos_tv: torchvision's fcos_resnet50_fpn without weights trains its BatchNorm and every "
                         "stage, i.e. fastdet's from-scratch form: set family.from_scratch=true (the demo does)")
    tv = fcos_resnet50_fpn(weights=None, weights_backbone=None, num_classes=num_classes)
    return TorchvisionFCOS(tv.backbone, _Levels(), TorchvisionFCOSHead(tv, num_classes))


ARCHITECTURES["fcos_tv"] = ArchFamily(
    build=build_torchvision_fcos,
    sizes=("r50",),
    config_fields=("from_scratch",),
    preprocess=fcos.FAMILY.preprocess,
    recipe=fcos.RECIPE,
)

if __name__ == "__main__":
    from fastdet.train import main

    raise SystemExit(main(sys.argv[1:]))
