"""PP-YOLO (Long et al. 2020): ResNet-vd backbone, PPYOLOFPN neck, the YOLOv3 head with its
loss, Matrix NMS, and its recipe (``r50vd_dcn`` and ``r18vd`` presets, demo, phases).

Follows PaddleDetection 2.6 (configs/ppyolo/_base_/ppyolo_r50vd_dcn.yml and
ppyolo_r18vd.yml; ppdet/modeling/necks/yolo_fpn.py ``PPYOLOFPN``, heads/yolo_head.py
``YOLOv3Head``, losses/yolo_loss.py ``YOLOv3Loss``, iou_loss.py, iou_aware_loss.py,
layers.py ``YOLOBox`` / ``MatrixNMS``). The backbone is
:class:`fastdet.models.backbones.resnet_vd.ResNetVd`.

Levels are ordered coarsest first (stride 32, 16(, 8)), as in Paddle. Each level's head
output is ``[B, na (IoU logits, iou_aware only) + na * (5 + C), H, W]``; the grid targets
come from :func:`fastdet.ops.yolo_targets` (Paddle's ``Gt2YoloTarget``) inside the step.

Across ranks (README "Losses across ranks"): as Paddle, each image's loss is summed and
the batch averaged, no positive count, so N ranks of equal batches train as one process
on their batches together.

Parameters and FLOPs (80 classes, 608x608, ``fastdet.models.flops``; BatchNorm running
statistics are buffers, not counted; FLOPs = 2 x MACs of convolutions, DCN counted as
the convolution it modulates):

==========  =========  ===================  =====================  ==========================
preset      params     PaddleDetection 2.6  GFLOPs@608 (2 x MAC)   GMACs@608
==========  =========  ===================  =====================  ==========================
r50vd_dcn   47.046 M   47.05 M              102.00                 51.00 (paper: "45.12 G")
r18vd       13.136 M   13.14 M              32.76                  16.38 (not published)
==========  =========  ===================  =====================  ==========================

``tests/test_ppyolo.py::test_params_and_flops_table`` prints the measured table. The paper's
table (and PaddleDetection's configs/ppyolo/README.md) lists 44.93 M for R50vd-DCN; we
match 47.05 M, the model PaddleDetection 2.6 actually builds from the released config,
because that is the model whose weights and training recipe are published and which
the 1 % check can be run against. The paper's figure comes from its ablation table
(rows I-K); no released config builds a model of that size, so it cannot be checked.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdet.config import Config, FamilyOptions
from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD
from fastdet.data.stages import Distort, ExpandCrop, Flip, MixUp, Normalize, Resize
from fastdet.losses import loss_float
from fastdet.models.backbones.resnet_vd import ResNetVd
from fastdet.models.detector import ArchFamily, Detector, WeightSource
from fastdet.models.layers import SPP, ConvBNAct, paddle_conv_init_
from fastdet.models.paddle_names import NAME_TABLE, bn_name, load_paddle_backbone
from fastdet.models.recipe import DEMO_CPU, Phase, Recipe, check_probabilities
from fastdet.ops import box_iou, yolo_targets


@dataclass(frozen=True)
class PPYOLOPreset:
    """One PaddleDetection config's model section."""

    depth: int
    return_idx: tuple[int, ...]
    dcn_stages: tuple[int, ...]
    coord_conv: bool
    spp: bool
    conv_block_num: int
    iou_aware: bool
    anchors: tuple[tuple[int, int], ...]
    anchor_masks: tuple[tuple[int, ...], ...]  # coarsest level first
    strides: tuple[int, ...]


COCO_ANCHORS = ((10, 13), (16, 30), (33, 23), (30, 61), (62, 45), (59, 119), (116, 90), (156, 198), (373, 326))

SIZES: dict[str, PPYOLOPreset] = {
    # smallest first (the contract tests and the CLI tests build the first size)
    # configs/ppyolo/_base_/ppyolo_r18vd.yml: no CoordConv, no SPP, no IoU-aware branch
    "r18vd": PPYOLOPreset(
        depth=18, return_idx=(2, 3), dcn_stages=(), coord_conv=False, spp=False, conv_block_num=0,
        iou_aware=False, anchors=((10, 14), (23, 27), (37, 58), (81, 82), (135, 169), (344, 319)),
        anchor_masks=((3, 4, 5), (0, 1, 2)), strides=(32, 16)),
    # configs/ppyolo/_base_/ppyolo_r50vd_dcn.yml
    "r50vd_dcn": PPYOLOPreset(
        depth=50, return_idx=(1, 2, 3), dcn_stages=(3,), coord_conv=True, spp=True, conv_block_num=2,
        iou_aware=True, anchors=COCO_ANCHORS, anchor_masks=((6, 7, 8), (3, 4, 5), (0, 1, 2)), strides=(32, 16, 8)),
}


# --------------------------------------------------------------------------- neck


def conv_bn(c_in: int, c_out: int, k: int) -> ConvBNAct:
    """Paddle darknet ``ConvBNLayer``: conv (no bias) + BN + LeakyReLU(0.1)."""
    return ConvBNAct(c_in, c_out, k, act="leaky")


class CoordConv(nn.Module):
    """``conv_bn(cat(x, gx, gy))`` with PaddleDetection 2.6's coordinate ramps.

    Paddle's ``add_coord`` (ppdet/modeling/necks/yolo_fpn.py) computes
    ``arange(n) / ((n - 1) * 2) - 1``, which runs from -1 to -0.5 across the width and
    height, not the -1..1 of Liu et al. 2018; the released weights were trained with it,
    and with -1..1 their dense outputs move by up to 23 %. Needs at least 2 pixels per side."""

    def __init__(self, c_in: int, c_out: int, k: int):
        super().__init__()
        self.conv = conv_bn(c_in + 2, c_out, k)

    def forward(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        gx = torch.arange(w, device=x.device, dtype=x.dtype) / ((w - 1.0) * 2.0) - 1.0
        gy = torch.arange(h, device=x.device, dtype=x.dtype) / ((h - 1.0) * 2.0) - 1.0
        coords = torch.stack([gx.expand(h, w), gy[:, None].expand(h, w)])  # [2, H, W]
        return self.conv(torch.cat([x, coords.expand(b, 2, h, w)], dim=1))


class DropBlock(nn.Module):
    """DropBlock (Ghiasi et al. 2018), training only: Paddle yolo_fpn ``DropBlock``.

    Seeds are drawn with probability ``gamma = (1 - keep) / bs^2 * prod(s / (s - bs + 1))``,
    grown to ``bs x bs`` blocks by a stride-1 max-pool, and the kept activations rescaled
    by ``numel / kept`` (one factor over the whole batch, as in Paddle).

    The seeds come from ``torch.rand_like``, i.e. the default generator of the tensor's
    device, with no host round trip, so the step stays one graph and CUDA-graph capturable:
    on CUDA that generator is Philox, and when a graph is captured torch records the RNG
    as a device-side (seed, offset) that each replay advances by the captured amount, so
    every replay draws a fresh mask (under ``torch.compile`` inductor lowers the draw to
    its own Philox kernel seeded from the same generator, equally captured). Under a fixed
    ``torch.manual_seed`` the masks repeat exactly (tests/test_ppyolo.py).
    """

    def __init__(self, block_size: int = 3, keep_prob: float = 0.9):
        super().__init__()
        self.block_size, self.keep_prob = block_size, keep_prob

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.keep_prob >= 1.0:
            return x
        bs = self.block_size
        gamma = (1.0 - self.keep_prob) / bs**2
        for s in x.shape[2:]:
            gamma *= s / max(s - bs + 1, 1)  # Paddle divides by zero on maps smaller than a block
        seeds = (torch.rand_like(x) < gamma).to(x.dtype)  # [B, C, H, W]
        mask = 1.0 - F.max_pool2d(seeds, bs, stride=1, padding=bs // 2)
        # Paddle divides by mask.sum() unguarded; the clamp only matters if every unit dropped.
        return x * mask * (mask.numel() / mask.sum().clamp(min=1.0))


class PPYOLODetBlock(nn.Module):
    """A sequence of layers giving the ``route``, then the ``tip`` (3x3, doubles the width)."""

    def __init__(self, layers: Sequence[nn.Module], tip: nn.Module):
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.tip = tip

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        route = self.layers(x)
        return route, self.tip(route)


class PPYOLOFPN(nn.Module):
    """PP-YOLO's FPN: per level (coarsest first) a detection block; its route goes through
    a 1x1 transition, nearest x2 upsampling and is concatenated with the next finer map.

    Args:
        in_channels: backbone widths, finest first (R50: 512, 1024, 2048; R18: 256, 512).
        coord_conv / spp / drop_block / conv_block_num: Paddle ``PPYOLOFPN`` options.
    Returns (forward): ``tip`` features coarsest first, widths ``out_channels``
    (R50: 1024, 512, 256; R18: 512, 256).
    """

    def __init__(self, in_channels: Sequence[int], coord_conv: bool, spp: bool, conv_block_num: int,
                 drop_block: bool = True, block_size: int = 3, keep_prob: float = 0.9):
        super().__init__()
        if conv_block_num not in (0, 2):
            raise ValueError(f"PPYOLOFPN: conv_block_num must be 0 or 2 (Paddle's layouts), got {conv_block_num}")
        n = len(in_channels)
        conv = CoordConv if coord_conv else conv_bn

        def dropblock() -> list[nn.Module]:
            return [DropBlock(block_size, keep_prob)] if drop_block else []

        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        self.out_channels = []
        for i, c_in in enumerate(list(in_channels)[::-1]):
            if i > 0:
                c_in += 512 // 2**i  # the upsampled route of the level above
            c = 64 * 2**n // 2**i  # R50: 512, 256, 128; R18: 256, 128
            if conv_block_num == 2:
                # conv0 (1x1), conv1 (3x3), conv2 (1x1), conv3 (3x3); SPP after conv2 on the
                # coarsest level, DropBlock after conv3 there and after conv1 below it.
                layers: list[nn.Module] = [conv(c_in, c, 1), conv_bn(c, 2 * c, 3)]
                if i == 0:
                    layers += [conv(2 * c, c, 1)]
                    layers += [SPP(4 * c, c, 1, (5, 9, 13), act="leaky")] if spp else []
                    layers += [conv_bn(c, 2 * c, 3)] + dropblock()
                else:
                    layers += dropblock() + [conv(2 * c, c, 1), conv_bn(c, 2 * c, 3)]
                layers += [conv(2 * c, c, 1)]  # route
            else:
                layers = ([SPP(4 * c_in, c_in, 1, (5, 9, 13), act="leaky")] if spp and i == 0 else [])
                layers += dropblock() + [conv(c_in, c, 1)]
            self.blocks.append(PPYOLODetBlock(layers, conv(c, 2 * c, 3)))
            self.out_channels.append(2 * c)
            if i < n - 1:
                self.transitions.append(conv_bn(c, 256 // 2**i, 1))

    def forward(self, feats: Sequence[Tensor]) -> list[Tensor]:
        outs = []
        route = None
        for i, x in enumerate(list(feats)[::-1]):
            if route is not None:
                x = torch.cat([route, x], dim=1)
            route, tip = self.blocks[i](x)
            outs.append(tip)
            if i < len(self.transitions):
                route = F.interpolate(self.transitions[i](route), scale_factor=2.0, mode="nearest")
        return outs


# --------------------------------------------------------------------------- head


def _iou_paired(a: Tensor, b: Tensor, eps: float = 1e-9) -> Tensor:
    """IoU of paired xyxy boxes ``[..., 4]``: Paddle ``bbox_iou`` (areas clamped, ``+ eps``)."""
    w = (torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    h = (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(min=0)
    inter = w * h
    area_a = ((a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])).clamp(min=0)
    area_b = ((b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])).clamp(min=0)
    return inter / (area_a + area_b - inter + eps)


# Log-sizes are clamped to +-10 (a box e^10 = 22026 times its anchor) before exp(): no
# real prediction comes near, but an untrained model in eval mode (BatchNorm statistics
# still at their initial values) can overflow exp() to inf and turn the IoU into NaN.
_LOG_SIZE_LIMIT = 10.0


def _size(t: Tensor) -> Tensor:
    return t.clamp(-_LOG_SIZE_LIMIT, _LOG_SIZE_LIMIT).exp()


def _per_image(v: Tensor) -> Tensor:
    """[B, ...] -> summed over anchors and cells, averaged over the batch (Paddle's reduction)."""
    return v.flatten(1).sum(1).mean()


def _cxcywh_to_xyxy(cx: Tensor, cy: Tensor, w: Tensor, h: Tensor) -> Tensor:
    return torch.stack([cx - w * 0.5, cy - h * 0.5, cx + w * 0.5, cy + h * 0.5], dim=-1)


class YOLOv3Head(nn.Module):
    """One 1x1 conv per level; loss = Paddle ``YOLOv3Loss`` (+ ``IouLoss``, ``IouAwareLoss``).

    Args:
        in_channels: neck widths, coarsest first.
        anchors: (w, h) px; anchor_masks: each level's anchors; strides: each level's stride.
        iou_aware / iou_aware_factor: an IoU logit per anchor (the first ``na`` channels),
            used at inference as ``obj^(1 - f) * iou^f``.
        scale_x_y: grid-sensitive centre ``scale * sigmoid(t) - (scale - 1) / 2``.
        ignore_thresh: a prediction whose best IoU with any ground-truth box exceeds it is
            no negative for the objectness loss.
        iou_loss_weight / iou_aware_loss_weight: 2.5 (``loss_square``) and 1.0.
        conf_thresh: inference drops predictions whose (rescored) objectness is below it.
    """

    def __init__(
        self,
        in_channels: Sequence[int],
        num_classes: int,
        anchors: Sequence[tuple[int, int]],
        anchor_masks: Sequence[Sequence[int]],
        strides: Sequence[int],
        iou_aware: bool = True,
        iou_aware_factor: float = 0.4,
        scale_x_y: float = 1.05,
        ignore_thresh: float = 0.7,
        iou_loss_weight: float = 2.5,
        iou_aware_loss_weight: float = 1.0,
        conf_thresh: float = 0.01,
    ):
        super().__init__()
        if not len(in_channels) == len(anchor_masks) == len(strides):
            raise ValueError(f"YOLOv3Head: {len(in_channels)} levels, {len(anchor_masks)} anchor masks and "
                             f"{len(strides)} strides")
        self.num_classes = num_classes
        self.anchors = tuple(tuple(a) for a in anchors)
        self.anchor_masks = tuple(tuple(m) for m in anchor_masks)
        self.strides = tuple(strides)
        self.iou_aware, self.iou_aware_factor = iou_aware, iou_aware_factor
        self.scale_x_y, self.ignore_thresh, self.conf_thresh = scale_x_y, ignore_thresh, conf_thresh
        self.iou_loss_weight, self.iou_aware_loss_weight = iou_loss_weight, iou_aware_loss_weight
        self.outputs = nn.ModuleList()
        for c, mask in zip(in_channels, self.anchor_masks):
            na = len(mask)
            conv = nn.Conv2d(c, na * (num_classes + 5) + (na if iou_aware else 0), 1)
            paddle_conv_init_(conv)
            self.outputs.append(conv)

    def class_rows(self, num_classes: int) -> dict[str, Tensor]:
        """Fine-tuning's map of the class channels (``fastdet.engine.finetune``): for each
        output conv's weight and bias, the rows holding each class, ``[C, na]`` (one per anchor).
        Channels are ``[iou x na] + na x [x, y, w, h, obj, class 0..C-1]`` (``_level``)."""
        out = {}
        for i, mask in enumerate(self.anchor_masks):
            na = len(mask)
            first = na if self.iou_aware else 0
            rows = first + torch.arange(na)[None, :] * (num_classes + 5) + 5 + torch.arange(num_classes)[:, None]
            out[f"outputs.{i}.weight"] = out[f"outputs.{i}.bias"] = rows
        return out

    def _level(self, i: int, feat: Tensor) -> tuple[Tensor | None, Tensor]:
        """-> IoU logits [B, na, H, W] (or None), predictions [B, na, 5 + C, H, W] (float32, float64
        for a float64 model)."""
        out = loss_float(self.outputs[i](feat))
        b, _, h, w = out.shape
        na = len(self.anchor_masks[i])
        ioup = None
        if self.iou_aware:
            ioup, out = out[:, :na], out[:, na:]
        return ioup, out.reshape(b, na, self.num_classes + 5, h, w)

    def _decode(self, p: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Grid-sensitive centre (cell units, offset in the cell), log sizes, and the grid.

        -> x, y [B, na, H, W] in the cell, w, h raw logs, gx, gy [H, W] cell indices."""
        s = self.scale_x_y
        x = s * p[:, :, 0].sigmoid() - 0.5 * (s - 1.0)
        y = s * p[:, :, 1].sigmoid() - 0.5 * (s - 1.0)
        h, w = p.shape[-2:]
        gy, gx = torch.meshgrid(torch.arange(h, device=p.device, dtype=p.dtype),
                                torch.arange(w, device=p.device, dtype=p.dtype), indexing="ij")
        return x, y, p[:, :, 2], p[:, :, 3], gx, gy

    def _sizes(self, i: int, tw: Tensor, th: Tensor, unit: float = 1.0) -> tuple[Tensor, Tensor]:
        """Widths and heights [B, na, H, W] of level ``i``'s anchors scaled by ``exp(tw, th)``,
        in px / ``unit``. The anchors are Python constants, not buffers: an EMA that averages
        buffers (PaddleDetection's starts from zeros) must not average them."""
        anchors = [self.anchors[k] for k in self.anchor_masks[i]]
        w = torch.stack([_size(tw[:, a]) * (aw / unit) for a, (aw, _) in enumerate(anchors)], dim=1)
        h = torch.stack([_size(th[:, a]) * (ah / unit) for a, (_, ah) in enumerate(anchors)], dim=1)
        return w, h

    def _boxes(self, i: int, x: Tensor, y: Tensor, tw: Tensor, th: Tensor, gx: Tensor, gy: Tensor) -> Tensor:
        """xyxy boxes [B, na, H, W, 4] in px from cell offsets and log sizes."""
        s = float(self.strides[i])
        w, h = self._sizes(i, tw, th)
        return _cxcywh_to_xyxy((x + gx) * s, (y + gy) * s, w, h)

    # ------------------------------------------------------------------ inference

    def inference(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """-> boxes [B, A, 4] xyxy input px (clipped), scores [B, A, C] = obj' * sigmoid(cls).

        obj' is the IoU-aware rescoring ``sigmoid(obj)^(1 - f) * sigmoid(iou)^f`` (Paddle
        turns it back into a logit that YOLOBox applies the sigmoid to: the same value);
        predictions with obj' below ``conf_thresh`` score 0, as YOLOBox does.
        """
        all_boxes, all_scores = [], []
        for i, feat in enumerate(feats):
            ioup, p = self._level(i, feat)
            x, y, tw, th, gx, gy = self._decode(p)
            obj = p[:, :, 4].sigmoid()  # [B, na, H, W]
            if ioup is not None:
                f = self.iou_aware_factor
                obj = obj.pow(1.0 - f) * ioup.sigmoid().pow(f)
            scores = obj[:, :, None] * p[:, :, 5:].sigmoid()  # [B, na, C, H, W]
            scores = torch.where((obj >= self.conf_thresh)[:, :, None], scores, 0.0)
            boxes = self._boxes(i, x, y, tw, th, gx, gy)
            b = p.shape[0]
            all_boxes.append(boxes.reshape(b, -1, 4))
            all_scores.append(scores.permute(0, 1, 3, 4, 2).reshape(b, -1, self.num_classes))
        boxes = torch.cat(all_boxes, dim=1)
        h, w = (feats[0].shape[-2] * self.strides[0], feats[0].shape[-1] * self.strides[0])
        # Paddle's yolo_box (clip_bbox) clips one-sided: x1, y1 >= 0 and x2 <= w - 1, y2 <= h - 1.
        lo = boxes.new_tensor([0.0, 0.0, -math.inf, -math.inf])
        hi = boxes.new_tensor([math.inf, math.inf, w - 1.0, h - 1.0])
        return torch.minimum(torch.maximum(boxes, lo), hi), torch.cat(all_scores, dim=1)

    # ------------------------------------------------------------------ training

    def loss(self, feats: Sequence[Tensor], targets: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Named losses of Paddle's ``YOLOv3Loss``: each term summed over anchors and cells,
        averaged over the batch, summed over levels; ``total_loss`` is their sum.

        targets: ``gt_boxes`` [B, M, 4] xyxy input px, ``gt_labels`` [B, M], ``gt_mask``
        [B, M] bool, optional ``gt_scores`` [B, M] (mixup weights; all ones if absent).
        """
        mask = targets["gt_mask"].bool()
        dtype = loss_float(feats[0]).dtype
        gt_boxes = torch.where(mask[..., None], targets["gt_boxes"].to(dtype), 0.0)  # padded slots -> empty boxes
        scores = targets.get("gt_scores")
        scores = mask.to(dtype) if scores is None else torch.where(mask, scores.to(dtype), 0.0)
        img_hw = (feats[0].shape[-2] * self.strides[0], feats[0].shape[-1] * self.strides[0])
        grids = yolo_targets(gt_boxes, targets["gt_labels"], mask, scores, self.anchors, self.anchor_masks,
                             self.strides, img_hw, self.num_classes)  # per level [B, na, 6 + C, H, W]

        levels = [self._level(i, feat) for i, feat in enumerate(feats)]
        decoded = [self._decode(p) for _, p in levels]
        # The ignore rule: the best IoU of each decoded prediction with any ground truth,
        # over all levels at once: [B, sum(na*H*W), M] by one batched box_iou.
        with torch.no_grad():
            pred_px = torch.cat([self._boxes(i, *d).reshape(gt_boxes.shape[0], -1, 4)
                                 for i, d in enumerate(decoded)], dim=1)
            if gt_boxes.shape[1] > 0:
                max_iou = box_iou(pred_px, gt_boxes).amax(-1)  # [B, sum(na*H*W)]
            else:
                max_iou = pred_px.new_zeros(pred_px.shape[:2])
            not_ignored = (max_iou <= self.ignore_thresh).to(dtype)

        names = ["loss_xy", "loss_wh", "loss_iou", "loss_obj", "loss_cls"] + (["loss_iou_aware"] if self.iou_aware else [])
        sums = {k: [] for k in names}
        start = 0
        for i, ((ioup, p), (x, y, w, h, gx, gy), t) in enumerate(zip(levels, decoded, grids)):
            tx, ty, tw, th, tscale, tobj = t[:, :, 0], t[:, :, 1], t[:, :, 2], t[:, :, 3], t[:, :, 4], t[:, :, 5]
            tcls = t[:, :, 6:]  # [B, na, C, H, W]
            weight = tscale * tobj  # [B, na, H, W]
            # scale_x_y != 1: L1 on the centre (Paddle uses BCE only when the scale is 1).
            sums["loss_xy"].append(_per_image(weight * ((x - tx).abs() + (y - ty).abs())))
            sums["loss_wh"].append(_per_image(weight * ((w - tw).abs() + (h - th).abs())))
            # IoU of decoded prediction and target, both in cell units (IoU is scale-free; only
            # _iou_paired's eps is not: Paddle adds it to a union in normalised image units,
            # which lowers an IoU by the fraction eps / union there: 2.8e-6 for a 10 x 13 px box at
            # 608 px, 3e-9 of loss_iou in tests/test_authors_losses.py).
            unit = float(self.strides[i])  # cell units
            pbox = _cxcywh_to_xyxy(x + gx, y + gy, *self._sizes(i, w, h, unit))
            tbox = _cxcywh_to_xyxy(tx + gx, ty + gy, *self._sizes(i, tw, th, unit))
            iou = _iou_paired(pbox, tbox)  # [B, na, H, W]
            sums["loss_iou"].append(_per_image(self.iou_loss_weight * (1.0 - iou * iou) * weight))
            if ioup is not None:
                bce = F.binary_cross_entropy_with_logits(ioup, iou.detach(), reduction="none")
                sums["loss_iou_aware"].append(_per_image(self.iou_aware_loss_weight * bce * tobj))
            n = x[0].numel()
            keep_neg = not_ignored[:, start:start + n].reshape(tobj.shape)
            start += n
            pos = (tobj > 0).to(dtype)
            bce_obj = F.binary_cross_entropy_with_logits(p[:, :, 4], pos, reduction="none")
            sums["loss_obj"].append(_per_image(bce_obj * tobj + bce_obj * (1.0 - pos) * keep_neg))
            bce_cls = F.binary_cross_entropy_with_logits(p[:, :, 5:], tcls, reduction="none")
            sums["loss_cls"].append(_per_image(bce_cls * tobj[:, :, None]))
        losses = {k: torch.stack(v).sum() for k, v in sums.items()}
        losses["total_loss"] = torch.stack(list(losses.values())).sum()
        return losses


# --------------------------------------------------------------------------- post-processing


def _matrix_iou(a: Tensor, b: Tensor, normalized: bool) -> Tensor:
    """Pairwise IoU [B, K, K] of Paddle's ``JaccardOverlap``: ``+1`` on every side unless
    ``normalized``; 0 for disjoint boxes (touching ones still overlap by the +1)."""
    norm = 0.0 if normalized else 1.0
    x1 = torch.maximum(a[..., :, None, 0], b[..., None, :, 0])
    y1 = torch.maximum(a[..., :, None, 1], b[..., None, :, 1])
    x2 = torch.minimum(a[..., :, None, 2], b[..., None, :, 2])
    y2 = torch.minimum(a[..., :, None, 3], b[..., None, :, 3])
    overlap = (x2 >= x1) & (y2 >= y1)
    inter = (x2 - x1 + norm) * (y2 - y1 + norm)

    def area(t: Tensor) -> Tensor:
        w, h = t[..., 2] - t[..., 0], t[..., 3] - t[..., 1]
        return torch.where((w < 0) | (h < 0), 0.0, (w + norm) * (h + norm))

    union = area(a)[..., :, None] + area(b)[..., None, :] - inter
    return torch.where(overlap, inter / union, 0.0)


@torch.no_grad()
def matrix_nms(
    boxes: Tensor,
    scores: Tensor,
    score_thresh: float = 0.01,
    post_thresh: float = 0.01,
    max_det: int = 100,
    pre_nms_topk: int = 1000,
    use_gaussian: bool = False,
    gaussian_sigma: float = 2.0,
    normalized: bool = False,
) -> list[dict[str, Tensor]]:
    """Matrix NMS (SOLOv2, Wang et al. 2020) with PaddleDetection's ``matrix_nms`` semantics,
    batched: one [B, K, K] IoU matrix instead of Paddle's per-class loops.

    Per image and class, candidates (score > ``score_thresh``) are taken by decreasing
    score; candidate i's score decays by ``min(1, min_j (1 - iou_ij) / (1 - maxiou_j))`` over
    the higher-scoring candidates j of its class (``maxiou_j``: j's highest IoU with a
    candidate above it; gaussian: ``exp((maxiou_j^2 - iou_ij^2) * sigma)``); it is kept
    when the decayed score exceeds ``post_thresh``; the best ``max_det`` over all classes
    are returned, by decayed score.

    Paddle's PP-YOLO config has ``nms_top_k -1`` (every candidate). Static shapes need a
    bound: the ``pre_nms_topk`` best (anchor, class) scores over all classes are the
    candidates, which gives Paddle's result whenever fewer pass ``score_thresh``.

    Args:
        boxes: [B, A, 4] xyxy; scores: [B, A, C].
    Returns per image ``{"boxes" [K, 4], "scores" [K], "labels" [K]}``.
    """
    B, A, C = scores.shape
    k = min(pre_nms_topk, A * C)
    top_s, top_i = scores.reshape(B, -1).float().topk(k, dim=1)  # [B, k], decreasing
    valid = top_s > score_thresh
    anchor = torch.div(top_i, C, rounding_mode="floor")
    labels = top_i % C
    cand = boxes.float().gather(1, anchor[..., None].expand(B, k, 4))  # [B, k, 4]
    # pair (j, i): j scores higher than i (j < i), same class, both candidates
    above = torch.ones(k, k, dtype=torch.bool, device=boxes.device).triu(diagonal=1)
    pair = above & (labels[:, :, None] == labels[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    iou = torch.where(pair, _matrix_iou(cand, cand, normalized), 0.0)  # [B, k(j), k(i)]
    max_iou = iou.amax(dim=1)  # [B, k]: each candidate's highest IoU with one above it
    if use_gaussian:
        decay = torch.exp((max_iou[:, :, None] ** 2 - iou**2) * gaussian_sigma)
    else:
        decay = (1.0 - iou) / (1.0 - max_iou[:, :, None])
    # Paddle's loop takes min(1, decays) with std::min, which skips NaN (0 / 0 when both
    # boxes repeat a higher one exactly).
    decay = torch.where(pair & ~decay.isnan(), decay, 1.0)
    decayed = top_s * decay.amin(dim=1).clamp(max=1.0)
    keep = valid & (decayed > post_thresh)
    final = torch.where(keep, decayed, -1.0)
    n = min(max_det, k)
    best_s, order = final.topk(n, dim=1)  # [B, n]
    out = []
    for b in range(B):
        sel = order[b][best_s[b] > 0]
        out.append({"boxes": cand[b, sel], "scores": decayed[b, sel], "labels": labels[b, sel]})
    return out


# --------------------------------------------------------------------------- model


class PPYOLO(Detector):
    """PP-YOLO; :meth:`predict` uses Matrix NMS, as PaddleDetection's config does."""

    nms_form = None  # Matrix NMS decays scores; ONNX's NonMaxSuppression cannot

    def load_backbone_weights(self, path: str) -> None:
        """The authors' ImageNet ResNet-vd file (``ResNet50_vd_ssld_pretrained.pdparams``,
        ``ResNet18_vd_pretrained.pdparams``), with or without ``backbone.``; the classifier is
        ignored and named (``fastdet.models.paddle_names.load_paddle_backbone``)."""
        load_paddle_backbone(self.backbone, path, _paddle_backbone_name)

    @torch.no_grad()
    def predict(
        self,
        images: Tensor,
        score_thresh: float = 0.01,
        max_det: int = 100,
        pre_nms_topk: int = 1000,
        post_thresh: float = 0.01,
    ) -> list[dict[str, Tensor]]:
        """Detections per image after Matrix NMS, which decays scores instead of cutting at
        an IoU: there is no ``iou_thresh`` (one passed is a TypeError, not ignored)."""
        boxes, scores = self(images)
        return matrix_nms(boxes, scores, score_thresh, post_thresh, max_det, pre_nms_topk)


def build_ppyolo(size: str, num_classes: int = 80) -> PPYOLO:
    """PP-YOLO ``r50vd_dcn`` (ResNet50-vd with DCNv2 in res5) or ``r18vd``."""
    p = SIZES[size]
    backbone = ResNetVd(p.depth, return_idx=p.return_idx, dcn_stages=p.dcn_stages)
    neck = PPYOLOFPN(backbone.out_channels, coord_conv=p.coord_conv, spp=p.spp, conv_block_num=p.conv_block_num)
    head = YOLOv3Head(neck.out_channels, num_classes, p.anchors, p.anchor_masks, p.strides, iou_aware=p.iou_aware)
    return PPYOLO(backbone, neck, head)


# --------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class PPYOLOOptions(FamilyOptions):
    """The ``family`` config section of PP-YOLO (``--set family.<field>=value``).

    Post-processing is Matrix NMS (ppyolo_*.yml ``MatrixNMS``): the best ``pre_nms_topk``
    candidates above ``score_thresh`` (0.01), kept above ``post_thresh`` (0.01) after the
    decay, the best ``max_det`` (100). It cuts at no IoU, so there is no ``nms_iou``.
    """

    score_thresh: float = 0.01
    max_det: int = 100
    pre_nms_topk: int = 1000
    post_thresh: float = 0.01
    # The reader (PaddleDetection configs/ppyolo/_base_/ppyolo_reader.yml): mixup with
    # lambda ~ Beta(1.5, 1.5) and per-box scores for the first `mixup_epochs` epochs
    # (25000: always), colour distortion, zoom-out + IoU crop, flip.
    mixup_prob: float = 1.0
    mixup_alpha: float = 1.5
    mixup_epochs: int = 25000
    distort_prob: float = 0.5
    expand_prob: float = 0.5
    expand_max_ratio: float = 4.0
    crop: bool = True
    flip_prob: float = 0.5


def ppyolo_phase(epoch: int, epochs: int, cfg: Config) -> Phase:
    """No loss switches; the reader's stages: mixup (while ``epoch < mixup_epochs``),
    distort, expand + crop, flip, a stretch resize at a random interpolation per batch
    (BatchRandomResize over ``data.train_sizes``), ImageNet normalisation."""
    o = cfg.family
    check_probabilities(o, "mixup_prob", "distort_prob", "expand_prob", "flip_prob")
    if o.expand_max_ratio < 1.0:
        raise ValueError(f"family.expand_max_ratio: expected >= 1, got {o.expand_max_ratio}")
    if o.mixup_alpha <= 0:
        raise ValueError(f"family.mixup_alpha: expected > 0, got {o.mixup_alpha}")
    # Zero-probability stages are left out: they would still draw from the sample's
    # random stream and change every later draw.
    mixup = (MixUp("beta_blend", o.mixup_prob, alpha=o.mixup_alpha, beta=o.mixup_alpha),) \
        if o.mixup_prob > 0 and epoch < o.mixup_epochs else ()
    distort = (Distort(o.distort_prob),) if o.distort_prob > 0 else ()
    stages = mixup + distort + (
        ExpandCrop(o.expand_prob, o.expand_max_ratio, o.crop),
        Flip(o.flip_prob),
        Resize("stretch", interp="random"),
        Normalize(IMAGENET_MEAN, IMAGENET_STD),
    )
    return Phase({}, stages)


def ppyolo_predict(o: PPYOLOOptions) -> dict[str, Any]:
    return dict(score_thresh=o.score_thresh, post_thresh=o.post_thresh, max_det=o.max_det,
                pre_nms_topk=o.pre_nms_topk)


RECIPE = Recipe(
    options=PPYOLOOptions,
    phase=ppyolo_phase,
    predict=ppyolo_predict,
    # PaddleDetection configs/ppyolo/ppyolo_r50vd_dcn_2x_coco.yml and _base_/ (optimizer_2x,
    # ppyolo_reader): momentum SGD with L2 5e-4, linear warm-up over 4000 iterations from
    # 0, piecewise x0.1 at epochs 649 and 730 of 811, PaddleDetection's EMA 0.9998 (zero
    # init, bias-corrected), BatchRandomResize over 320..608 step 32, PadBox 50,
    # evaluation at 608.
    base={
        "optim.optimizer": "sgd", "optim.momentum": 0.9, "optim.weight_decay": 5e-4,
        "optim.epochs": 811, "optim.schedule": "piecewise", "optim.milestones": (649, 730), "optim.gamma": 0.1,
        "optim.warmup_steps": 4000, "optim.warmup_start_factor": 0.0,
        "optim.ema_type": "paddle", "optim.ema_decay": 0.9998,
        "data.train_sizes": tuple(range(320, 609, 32)), "data.img_size": 608, "data.max_boxes": 50,
        "model.sync_bn": True,  # _base_/ppyolo_r50vd_dcn.yml, ppyolo_r18vd.yml: norm_type sync_bn
    },
    sizes={
        # 8 GPUs x 24 images, lr 0.01 for those 192.
        "r50vd_dcn": {"data.batch_size": 24, "optim.base_lr": 0.01, "optim.ref_batch": 192},
        # ppyolo_r18vd_coco.yml: 4 GPUs x 32, lr 0.004 for those 128, 270 epochs with
        # decays at 162 and 216, evaluation at 512; mixup_epoch 500 (always on).
        "r18vd": {"data.batch_size": 32, "optim.base_lr": 0.004, "optim.ref_batch": 128, "optim.epochs": 270,
                  "optim.milestones": (162, 216), "data.img_size": 512},
    },
    # The built-in demo set on a 2-core CPU, from scratch, as PP-YOLOE's demo: 192 px,
    # AdamW, flips only (mixup, zoom-out and crop slow a run this short), cosine decay.
    # 16 epochs of PP-YOLOE's 24-epoch cosine (cosine_epochs 28): R18vd-PP-YOLO trains at
    # ~7-8 img/s there (PP-YOLOE-s ~13) and 24 epochs would take ~27 min. Measured
    # 2026-12-03: the 24-epoch run had AP50 0.300 at epoch 8 and 0.533 at 16; a cosine
    # squeezed into 16 epochs (cosine_epochs 19) ended lower, AP50 0.460 (15 min 26 s):
    # this run needs the higher LR of its middle epochs. This recipe, measured 2026-12-03:
    # 14 min 36 s end to end, AP 0.321 / AP50 0.533 (the 24-epoch run's epoch-16 figures
    # exactly: the run is deterministic).
    demo={
        **DEMO_CPU,
        "data.augment": True,
        "family.mixup_prob": 0.0,
        "family.distort_prob": 0.0,
        "family.expand_prob": 0.0,
        "family.crop": False,
        "family.flip_prob": 0.5,
        "optim.base_lr": 0.002,
        "optim.epochs": 16,
        "optim.schedule": "cosine",
        "optim.cosine_epochs": 28,
        "optim.warmup_steps": 150,
        "optim.warmup_start_factor": 0.001,
        "optim.ema_type": "threshold",
        "run.eval_interval": 8,
    },
    # The ImageNet files the authors' configs start from (pretrain_weights).
    backbone_files={"r50vd_dcn": "ResNet50_vd_ssld_pretrained.pdparams", "r18vd": "ResNet18_vd_pretrained.pdparams"}
)

# --------------------------------------------------------------------------- released weights

# Paddle's PPYOLODetBlock children in order; fastdet's ``layers`` index is the position,
# DropBlock ("drop", no weights) included (yolo_fpn.py PPYOLOFPN, drop_block on in both configs).
_BLOCK_ORDER = {
    (2, True): ("conv0", "conv1", "conv2", "spp", "conv3", "drop", "route"),  # coarsest level
    (2, False): ("conv0", "conv1", "drop", "conv2", "conv3", "route"),
    (0, True): ("spp", "drop", "route"),
    (0, False): ("drop", "route"),
}


def _paddle_backbone_name(name: str) -> str | None:
    """A Paddle ResNet-vd name without ``backbone.`` (BatchNorm already ``bn``) -> fastdet's
    ``ResNetVd`` name; None when it is not one (e.g. an ImageNet classifier)."""
    name = name.replace(".norm.", ".bn.")
    if m := re.match(r"conv1\.conv1_(\d)\.(.*)", name):
        return f"stem.{int(m[1]) - 1}.{m[2]}"
    if m := re.match(r"res(\d)\.res\d([a-z])\.(.*)", name):
        rest = re.sub(r"^short\.conv\.(conv|bn)\.", r"short.1.\1.", m[3])
        rest = rest.replace("branch2b.conv_offset.", "branch2b.conv.conv_offset.")
        return f"stages.{int(m[1]) - 2}.{ord(m[2]) - ord('a')}.{rest}"
    return None


def from_paddle(state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """PaddleDetection PP-YOLO (r50vd_dcn, r18vd) ``.pdparams`` names -> fastdet's.

    Backbone ``conv1.conv1_{1,2,3}`` -> ``stem.0..2``, ``resN.resN<letter>`` -> ``stages.N-2.<i>``,
    the vd shortcut ``short.conv.{conv,norm}`` -> ``short.1`` (after its avg-pool), DCN
    ``branch2b.conv_offset`` -> ``branch2b.conv.conv_offset`` (offset/mask channels kept in
    Paddle's order, which fastdet's DeformConv2d uses); neck ``yolo_block.i.conv_module.<name>``
    -> ``blocks.i.layers.<position>`` (:data:`_BLOCK_ORDER`), ``yolo_transition`` ->
    ``transitions``; head ``yolo_head.yolo_output.i`` -> ``head.outputs.i``; ``norm`` /
    ``batch_norm`` -> ``bn``, ``_mean`` / ``_variance`` -> running statistics.
    """
    state = {k: v for k, v in state.items() if k != NAME_TABLE}
    deep = any(k.startswith("neck.yolo_block.0.conv_module.conv0.") for k in state)  # conv_block_num 2
    spp = any(k.startswith("neck.yolo_block.0.conv_module.spp.") for k in state)
    out: dict[str, Any] = {}
    for k, v in state.items():
        name = bn_name(k).replace(".batch_norm.", ".bn.").replace(".norm.", ".bn.")
        if name.startswith("backbone.") and (b := _paddle_backbone_name(name[len("backbone."):])):
            name = "backbone." + b
        elif m := re.match(r"neck\.yolo_block\.(\d+)\.conv_module\.(\w+)\.(.*)", name):
            order = _BLOCK_ORDER[(2 if deep else 0, m[1] == "0" and spp)]
            if m[2] not in order:
                raise KeyError(f"{k} (a PPYOLODetBlock layer fastdet does not have)")
            name = f"neck.blocks.{m[1]}.layers.{order.index(m[2])}.{m[3]}"
        elif m := re.match(r"neck\.yolo_block\.(\d+)\.tip\.(.*)", name):
            name = f"neck.blocks.{m[1]}.tip.{m[2]}"
        elif m := re.match(r"neck\.yolo_transition\.(\d+)\.(.*)", name):
            name = f"neck.transitions.{m[1]}.{m[2]}"
        elif m := re.match(r"yolo_head\.yolo_output\.(\d+)\.(.*)", name):
            name = f"head.outputs.{m[1]}.{m[2]}"
        else:
            raise KeyError(f"{k} (not a PaddleDetection PP-YOLO name)")
        out[name] = v
    if "head.outputs.0.weight" not in out:
        raise KeyError("yolo_head.yolo_output.0.weight (absent: not a PP-YOLO model)")
    # Channels per level: na IoU logits (r50vd_dcn, which has the DCN) + na * (5 + C), na = 3.
    iou_aware = any("conv_offset" in k for k in out)
    per_anchor = out["head.outputs.0.weight"].shape[0] // 3
    return out, int(per_anchor - 5 - (1 if iou_aware else 0))


FAMILY = ArchFamily(build=build_ppyolo, sizes=tuple(SIZES), recipe=RECIPE,
                      weight_sources={"paddle": WeightSource(from_paddle, file_format="paddle")})
