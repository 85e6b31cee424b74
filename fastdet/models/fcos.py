"""FCOS R50-FPN (Tian et al. 2019): FPN with P6/P7, the shared FCOS head with its loss, the r50 preset.

Follows PaddleDetection's fcos_r50_fpn_1x (configs/fcos/_base_/fcos_r50_fpn.yml;
ppdet/modeling/necks/fpn.py, heads/fcos_head.py, losses/fcos_loss.py,
data/transform/batch_operators.py ``Gt2FCOSTarget``), built from torchvision's ResNet-50
(:mod:`fastdet.models.backbones.resnet`). Where torchvision's ``fcos_resnet50_fpn``
differs (no per-level scale, sqrt score, GIoU not centerness-weighted, the plain GIoU where
Paddle's IoU adds 1 to intersection and union) Paddle is followed; torchvision's plain
GIoU stays an option (``box_loss="giou"``).

Levels are ordered finest first: strides 8, 16, 32, 64, 128 (A = sum of H_l * W_l).
Points sit at ``(i + 0.5) * stride`` (Paddle ``num_shift`` 0.5). Regression is in stride
units (``norm_reg_targets``): the head predicts ``relu(scale_l * conv)`` = ltrb / stride.
Targets are built on the device inside the loss from the padded ground truth
(``fastdet.ops.fcos_assign``), not in data-loader workers.

Across ranks (README "Losses across ranks"): the positive count and the centerness sum
that normalise the losses are averaged over the ranks, where Paddle uses each rank's own:
with DDP's averaged gradients N ranks then train as one process on their batches together,
and a rank without positives does not divide its negatives' loss by 1.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import sigmoid_focal_loss

from fastdet.config import Config
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD
from fastdet.data.stages import Flip, Normalize, Resize
from fastdet.losses import all_reduce_mean, giou_loss, loss_float, smoothed_giou_loss_ltrb
from fastdet.losses import sigmoid_focal_loss as fused_focal_loss
from fastdet.models.backbones.resnet import ResNetBackbone, load_backbone_weights
from fastdet.models.detector import ArchFamily, Detector, WeightSource
from fastdet.models.paddle_names import NAME_TABLE, bn_name, load_paddle_backbone
from fastdet.models.recipe import DEMO_CPU, PaddleNMSOptions, Phase, Recipe, check_probabilities, paddle_nms_kwargs
from fastdet.ops import fcos_assign
from fastdet.runtime.checkpoint import is_torch_file

SIZES = {"r50": 50}
STRIDES = (8, 16, 32, 64, 128)
DECODES = ("paddle", "torchvision")
# The box loss: Paddle's FCOSLoss IoU, smoothed by +1 (fastdet.losses.smoothed_giou_loss_ltrb),
# or torchvision's plain GIoU (fastdet.ops.giou_loss).
BOX_LOSSES = ("paddle", "giou")
# Paddle object_sizes_boundary [64, 128, 256, 512]: the range of max(l, t, r, b) per level.
SIZE_RANGES = ((0.0, 64.0), (64.0, 128.0), (128.0, 256.0), (256.0, 512.0), (512.0, math.inf))


def xavier_uniform_(conv: nn.Conv2d, fan_out: int) -> None:
    """Paddle ``XavierUniform(fan_out=...)``: U(+-sqrt(6 / (fan_in + fan_out))), zero bias."""
    fan_in = conv.in_channels * math.prod(conv.kernel_size)
    a = math.sqrt(6.0 / (fan_in + fan_out))
    nn.init.uniform_(conv.weight, -a, a)
    nn.init.zeros_(conv.bias)


def feature_shapes(h: int, w: int, strides: Sequence[int] = STRIDES) -> list[tuple[int, int]]:
    """(H, W) of every level for an ``h`` x ``w`` input (multiples of 32): ``h / s`` up to
    stride 32, then halved with rounding up by the stride-2 P6/P7 convs."""
    shapes = []
    for s in strides:
        if s <= 32:
            shapes.append((h // s, w // s))
        else:
            ph, pw = shapes[-1]
            shapes.append((-(-ph // 2), -(-pw // 2)))
    return shapes


def level_points(shapes: Sequence[Sequence[int]], strides: Sequence[int] = STRIDES,
                 size_ranges: Sequence[tuple[float, float]] = SIZE_RANGES,
                 device: Optional[torch.device] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> points [A, 2] px at ``(i + 0.5) * stride``, stride per point [A], size range per point [A, 2].

    Every tensor is made on ``device`` by fill and arange kernels, never from host data:
    this runs in every loss, inside a captured CUDA graph (a ``torch.tensor(list,
    device=...)`` is a pageable host-to-device copy, which a capture refuses).
    """
    points, stride_list, ranges = [], [], []
    for (h, w), s, (lo, hi) in zip(shapes, strides, size_ranges):
        h, w = int(h), int(w)
        ys = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) * s
        xs = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) * s
        yy, xx = torch.meshgrid(ys, xs, indexing="ij")
        points.append(torch.stack([xx, yy], dim=-1).reshape(-1, 2))
        stride_list.append(torch.full((h * w,), float(s), device=device))
        ranges.append(torch.stack([torch.full((h * w,), float(lo), device=device),
                                   torch.full((h * w,), float(hi), device=device)], dim=-1))
    return torch.cat(points), torch.cat(stride_list), torch.cat(ranges)


# --------------------------------------------------------------------------- neck


class FPN(nn.Module):
    """FPN over C3-C5 plus P6 (3x3 s2 on P5) and P7 (3x3 s2 on ReLU(P6)); no norm.

    Paddle ``FPN(has_extra_convs=True, extra_stage=2, use_c5=False,
    relu_before_extra_convs=True)``: 1x1 laterals, nearest x2 top-down sums, 3x3 outputs.

    Args:
        in_channels: backbone widths, finest first (512, 1024, 2048).
    Returns (forward): [P3, P4, P5, P6, P7], ``out_channels`` each, strides 8..128.
    """

    def __init__(self, in_channels: Sequence[int], out_channels: int = 256):
        super().__init__()
        self.out_channels = out_channels
        self.lateral = nn.ModuleList(nn.Conv2d(c, out_channels, 1) for c in in_channels)
        self.output = nn.ModuleList(nn.Conv2d(out_channels, out_channels, 3, padding=1) for _ in in_channels)
        self.p6 = nn.Conv2d(out_channels, out_channels, 3, stride=2, padding=1)
        self.p7 = nn.Conv2d(out_channels, out_channels, 3, stride=2, padding=1)
        for conv, c in zip(self.lateral, in_channels):
            xavier_uniform_(conv, fan_out=c)
        for conv in (*self.output, self.p6, self.p7):
            xavier_uniform_(conv, fan_out=out_channels * 9)

    def forward(self, feats: Sequence[Tensor]) -> list[Tensor]:
        lat = [conv(f) for conv, f in zip(self.lateral, feats)]
        for i in range(len(lat) - 1, 0, -1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], scale_factor=2.0, mode="nearest")
        outs = [conv(x) for conv, x in zip(self.output, lat)]
        p6 = self.p6(outs[-1])
        return outs + [p6, self.p7(F.relu(p6))]


# --------------------------------------------------------------------------- head


def _tower(channels: int, num_convs: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(num_convs):
        conv = nn.Conv2d(channels, channels, 3, padding=1)
        nn.init.normal_(conv.weight, std=0.01)
        nn.init.zeros_(conv.bias)
        layers += [conv, nn.GroupNorm(32, channels), nn.ReLU()]
    return nn.Sequential(*layers)


class FCOSHead(nn.Module):
    """The FCOS head, shared by every level, with its loss.

    Two towers of ``num_convs`` x (3x3 conv -> GroupNorm(32) -> ReLU); class logits on the
    classification tower; ltrb distances and centerness on the regression tower
    (``centerness_on_reg``); a learnable scale per level on the distances.

    Args:
        channels: FPN width (256).
        strides / size_ranges: per level, finest first.
        radius: centre-sampling radius in strides (1.5).
        focal_alpha, focal_gamma: sigmoid focal loss (0.25, 2).
        decode: ``"paddle"`` or ``"torchvision"`` (see :meth:`inference`).
        box_loss: ``"paddle"``, PaddleDetection's ``FCOSLoss`` IoU with its +1 smoothing, or
            ``"giou"``, torchvision's plain GIoU (both weighted by the centerness targets).
    """

    # Its layers with one output row per class (fine-tuning maps them by class name:
    # fastdet.engine.finetune): one 3x3 conv shared by the levels, weight [C, 256, 3, 3], bias [C].
    class_layers = ("cls_logits",)

    def __init__(
        self,
        channels: int = 256,
        num_classes: int = 80,
        strides: Sequence[int] = STRIDES,
        size_ranges: Sequence[tuple[float, float]] = SIZE_RANGES,
        num_convs: int = 4,
        radius: float = 1.5,
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
        prior_prob: float = 0.01,
        decode: str = "paddle",
        box_loss: str = "paddle",
    ):
        super().__init__()
        if decode not in DECODES:
            raise ValueError(f"FCOSHead: decode must be one of {', '.join(DECODES)}, got {decode!r}")
        if box_loss not in BOX_LOSSES:
            raise ValueError(f"FCOSHead: box_loss must be one of {', '.join(BOX_LOSSES)}, got {box_loss!r}")
        if len(strides) != len(size_ranges):
            raise ValueError(f"FCOSHead: {len(strides)} strides but {len(size_ranges)} size ranges")
        self.num_classes = num_classes
        self.strides = tuple(strides)
        self.size_ranges = tuple(size_ranges)
        self.radius = radius
        self.focal_alpha, self.focal_gamma = focal_alpha, focal_gamma
        self.cls_tower = _tower(channels, num_convs)
        self.reg_tower = _tower(channels, num_convs)
        self.cls_logits = nn.Conv2d(channels, num_classes, 3, padding=1)
        self.bbox_reg = nn.Conv2d(channels, 4, 3, padding=1)
        self.centerness = nn.Conv2d(channels, 1, 3, padding=1)
        for conv in (self.cls_logits, self.bbox_reg, self.centerness):
            nn.init.normal_(conv.weight, std=0.01)
            nn.init.zeros_(conv.bias)
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - prior_prob) / prior_prob))  # sigmoid = 0.01
        self.scales = nn.Parameter(torch.ones(len(self.strides)))
        self.decode = decode
        self.box_loss = box_loss
        if decode == "torchvision":  # torchvision's head has no per-level scales: they stay 1
            self.scales.requires_grad_(False)

    def tower_bias_names(self) -> list[str]:
        """The tower convs' biases, which Paddle trains at twice the LR (ConvNormLayer lr_scale 2)."""
        return [f"{tower}.{i}.bias" for tower in ("cls_tower", "reg_tower")
                for i, m in enumerate(getattr(self, tower)) if isinstance(m, nn.Conv2d)]

    # ------------------------------------------------------------------ shared pieces

    def raw_outputs(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """-> class logits [B, A, C], ltrb / stride [B, A, 4] (>= 0), centerness logits [B, A]
        (float32, float64 for a float64 model)."""
        if len(feats) != len(self.strides):
            raise ValueError(f"FCOSHead: {len(feats)} feature maps for {len(self.strides)} strides")
        cls_list, reg_list, ctr_list = [], [], []
        for i, feat in enumerate(feats):
            cls_feat = self.cls_tower(feat)
            reg_feat = self.reg_tower(feat)
            cls_list.append(self.cls_logits(cls_feat).flatten(2).transpose(1, 2))  # [B, HW, C]
            reg = self.bbox_reg(reg_feat)  # [B, 4, H, W]
            reg = F.relu(reg if self.decode == "torchvision" else self.scales[i] * reg)
            reg_list.append(reg.flatten(2).transpose(1, 2))
            ctr_list.append(self.centerness(reg_feat).flatten(1))  # [B, HW]
        return (loss_float(torch.cat(cls_list, 1)), loss_float(torch.cat(reg_list, 1)),
                loss_float(torch.cat(ctr_list, 1)))

    def points(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """-> points [A, 2] px, stride per point [A], size range per point [A, 2] px."""
        return level_points([f.shape[-2:] for f in feats], self.strides, self.size_ranges, feats[0].device)

    # ------------------------------------------------------------------ inference

    def torchvision_points(self, feats: Sequence[Tensor]) -> Tensor:
        """torchvision's anchor centres [A, 2] px: ``j * (W // w_l)``, no half-stride offset and
        an integer stride per level (``AnchorGenerator``: 320 // 3 = 106 at P7 of 320 px)."""
        H, W = feats[0].shape[-2] * self.strides[0], feats[0].shape[-1] * self.strides[0]
        points = []
        for f in feats:
            h, w = f.shape[-2:]
            ys = torch.arange(h, device=f.device, dtype=torch.float32) * (H // h)
            xs = torch.arange(w, device=f.device, dtype=torch.float32) * (W // w)
            yy, xx = torch.meshgrid(ys, xs, indexing="ij")
            points.append(torch.stack([xx, yy], dim=-1).reshape(-1, 2))
        return torch.cat(points)

    def inference(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """-> boxes [B, A, 4] xyxy input px, scores [B, A, C].

        Paddle's decode (``decode="paddle"``): points at ``(j + 0.5) * stride``, scores
        ``sigmoid(cls) * sigmoid(centerness)``; torchvision's (weights converted from
        torchvision): points from :meth:`torchvision_points`, distances times the level's
        anchor size (8 .. 128, ``BoxLinearCoder(normalize_by_size=True)``), scores
        ``sqrt(sigmoid(cls) * sigmoid(centerness))``."""
        cls, ltrb, ctr = self.raw_outputs(feats)
        points, strides, _ = self.points(feats)
        scores = cls.sigmoid() * ctr.sigmoid()[..., None]
        if self.decode == "torchvision":
            points, scores = self.torchvision_points(feats), scores.sqrt()
        d = ltrb * strides[:, None]  # [B, A, 4] px
        boxes = torch.cat([points - d[..., :2], points + d[..., 2:]], dim=-1)
        return boxes, scores

    # ------------------------------------------------------------------ training

    def loss(self, feats: Sequence[Tensor], targets: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Named losses: focal (cls), centerness-weighted GIoU (box, :attr:`box_loss`), centerness BCE.

        targets: ``gt_boxes`` [B, M, 4] xyxy input px, ``gt_labels`` [B, M], ``gt_mask`` [B, M] bool.
        """
        C = self.num_classes
        cls_logits, ltrb, ctr_logits = self.raw_outputs(feats)  # [B, A, C], [B, A, 4], [B, A]
        points, strides, ranges = self.points(feats)
        gt_boxes = targets["gt_boxes"].to(ltrb.dtype)
        assigned, labels = fcos_assign(points, strides, ranges, gt_boxes.float(), targets["gt_labels"],
                                       targets["gt_mask"], self.radius)  # [B, A] each, -1 = background
        fg = assigned >= 0
        fg_f = fg.to(ltrb.dtype)

        # Targets from the assignment: ltrb of the assigned box in stride units, its centerness.
        boxes = gt_boxes.gather(1, assigned.clamp(min=0)[..., None].expand(-1, -1, 4))  # [B, A, 4]
        tgt = torch.cat([points - boxes[..., :2], boxes[..., 2:] - points], dim=-1) / strides[:, None]
        tgt = torch.where(fg[..., None], tgt, 1.0)  # background: any positive value (masked below)
        lr, tb = tgt[..., 0::2], tgt[..., 1::2]
        ctr_t = ((lr.amin(-1) / lr.amax(-1)) * (tb.amin(-1) / tb.amax(-1))).sqrt() * fg_f  # [B, A]

        # Normalisers, averaged over ranks (every rank divides by the same numbers).
        num_pos = all_reduce_mean(fg_f.sum()).clamp(min=1.0)
        ctr_sum = all_reduce_mean(ctr_t.sum()).clamp(min=1e-6)

        one_hot = (labels[..., None] == torch.arange(C, device=labels.device)).to(cls_logits.dtype)  # background: all 0
        # The faster form in each mode (bench/kernels.py --only focal, fwd+bwd over [2, 22400, 80]
        # on one CPU thread): torchvision's in eager code (552 ms vs 1123 ms for the fused one,
        # which recomputes its terms in the backward), the fused one-node form under
        # torch.compile (124 ms vs 242 ms). Both give the same values (tests/test_fcos.py).
        if torch.compiler.is_compiling():
            loss_cls = fused_focal_loss(cls_logits, one_hot, self.focal_alpha, self.focal_gamma)
        else:
            loss_cls = sigmoid_focal_loss(cls_logits, one_hot, self.focal_alpha, self.focal_gamma, "sum")
        loss_cls = loss_cls / num_pos

        # GIoU on the distances (stride units), weighted by the centerness targets. Background
        # points compare the constant box 1 with itself: zero loss, no gradient (Paddle masks
        # both sides to 0 and the loss after).
        if self.box_loss == "paddle":
            pred = torch.where(fg[..., None], ltrb, 1.0)
            per_point = smoothed_giou_loss_ltrb(pred, tgt)  # [B, A]
        else:
            # torchvision's: boxes relative to their point, (-l, -t, r, b); background points
            # take their own detached prediction as target.
            pred_box = torch.cat([-ltrb[..., :2], ltrb[..., 2:]], dim=-1)
            tgt_box = torch.where(fg[..., None], torch.cat([-tgt[..., :2], tgt[..., 2:]], dim=-1), pred_box.detach())
            per_point = giou_loss(pred_box, tgt_box)
        loss_box = (per_point * ctr_t).sum() / ctr_sum
        loss_ctr = (F.binary_cross_entropy_with_logits(ctr_logits, ctr_t, reduction="none") * fg_f).sum() / num_pos
        return {
            "total_loss": loss_cls + loss_box + loss_ctr,
            "loss_cls": loss_cls,
            "loss_box": loss_box,
            "loss_ctr": loss_ctr,
        }


# --------------------------------------------------------------------------- model


class FCOS(Detector):
    """FCOS. ``predict`` is the base multiclass NMS (so ``fastdet.export --nms`` reproduces
    it) at Paddle's fcos_r50_fpn.yml values: score 0.025, top 1000 per class, NMS 0.6, 100."""

    predict_defaults = {"score_thresh": 0.025, "iou_thresh": 0.6, "max_det": 100, "pre_nms_topk": 1000,
                        "per_class_topk": True}

    def load_backbone_weights(self, path: str) -> None:
        """``--backbone-weights``: a torchvision-format ResNet-50 state dict, or the authors'
        Paddle ImageNet ResNet-50 ``.pdparams`` (``ResNet50_cos_pretrained``, the FCOS
        recipe's start; names as in :func:`from_paddle`, classifier ignored and named)."""
        if is_torch_file(path):
            load_backbone_weights(self.backbone, path)
        else:
            load_paddle_backbone(self.backbone, path, _paddle_backbone_name)

    def lr_multipliers(self) -> dict[str, float]:
        """Read by ``fastdet.engine.optim.build_param_groups``: tower biases at 2x LR, as Paddle."""
        return {f"head.{n}": 2.0 for n in self.head.tower_bias_names()}


def build_fcos(
    size: str,
    num_classes: int = 80,
    *,
    from_scratch: bool = False,
    backbone_weights: Optional[str | Path] = None,
    decode: str = "paddle",
    box_loss: str = "paddle",
) -> FCOS:
    """FCOS of ``size`` r50 (ResNet-50 + FPN P3-P7 + FCOSHead).

    ``from_scratch``: trainable BatchNorm and no frozen stages in the backbone (see
    :mod:`fastdet.models.backbones.resnet` for why a from-scratch run needs both);
    ``backbone_weights``: a local torchvision-format ResNet-50 state dict to start from;
    ``decode``: ``"paddle"`` (PaddleDetection's FCOS, the recipe) or ``"torchvision"``
    (weights converted from torchvision's ``fcos_resnet50_fpn``, see :class:`FCOSHead`);
    ``box_loss``: ``"paddle"`` (the smoothed IoU of Paddle's ``FCOSLoss``, the recipe) or
    ``"giou"`` (torchvision's plain GIoU).
    """
    backbone = ResNetBackbone(SIZES[size], pretrained_form=not from_scratch, freeze_at=0)
    if backbone_weights is not None:
        load_backbone_weights(backbone, backbone_weights)
    neck = FPN(backbone.out_channels, 256)
    head = FCOSHead(256, num_classes=num_classes, decode=decode, box_loss=box_loss)
    return FCOS(backbone, neck, head)


# --------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class FCOSOptions(PaddleNMSOptions):
    """The ``family`` config section of FCOS (``--set family.<field>=value``).

    Post-processing is Paddle's MultiClassNMS of fcos_r50_fpn.yml: score 0.025, top 1000
    per class before NMS, IoU 0.6, keep 100 (scores are sigmoid(cls) * sigmoid(centerness)).
    """

    score_thresh: float = 0.025
    nms_iou: float = 0.6
    max_det: int = 100
    pre_nms_topk: int = 1000
    flip_prob: float = 0.5
    # Train the backbone's BatchNorm and its first stages too (a from-scratch run, e.g.
    # the demo): see fastdet/models/backbones/resnet.py for why frozen ones need weights.
    from_scratch: bool = False
    # How boxes and scores decode: "paddle" (this recipe) or "torchvision" (weights converted
    # from torchvision's fcos_resnet50_fpn: FCOSHead.inference).
    decode: str = "paddle"
    # The box loss: "paddle" (PaddleDetection's FCOSLoss IoU, (inter + 1) / (union + 1); this
    # recipe) or "giou" (torchvision's plain GIoU): FCOSHead.loss.
    box_loss: str = "paddle"


def fcos_phase(epoch: int, epochs: int, cfg: Config) -> Phase:
    """The same every epoch (Paddle fcos_reader.yml): flip, keep-ratio resize (short side
    800, long side at most 1333 at the 800 scale, linear) into the fixed keep-ratio
    canvases, ImageNet normalisation; no loss arguments."""
    check_probabilities(cfg.family, "flip_prob")
    return Phase({}, (Flip(cfg.family.flip_prob), Resize("keep_ratio", interp="linear", short=800, max_long=1333),
                      Normalize(IMAGENET_MEAN, IMAGENET_STD)))


RECIPE = Recipe(
    options=FCOSOptions,
    phase=fcos_phase,
    # PaddleDetection configs/fcos/fcos_r50_fpn_1x_coco.yml and _base_/: 8 GPUs x 2 images,
    # momentum SGD with L2 1e-4, lr 0.01 for 16 images, linear warm-up over 500 iterations
    # from 1/3, x0.1 at epochs 8 and 11 of 12; no EMA; single-scale 800 (keep-ratio).
    base={
        "optim.optimizer": "sgd", "optim.momentum": 0.9, "optim.weight_decay": 1e-4,
        "optim.base_lr": 0.01, "optim.ref_batch": 16, "optim.epochs": 12,
        "optim.schedule": "piecewise", "optim.milestones": (8, 11), "optim.gamma": 0.1,
        "optim.warmup_steps": 500, "optim.warmup_start_factor": 1.0 / 3.0, "optim.ema": False,
        "data.batch_size": 2, "data.eval_batch_size": 2, "data.img_size": 800, "data.train_sizes": (800,),
        "data.multiscale": False,
    },
    # The demo trains from scratch (nothing to load here), so the backbone's statistics and
    # early stages train too; a shorter schedule; AdamW, which learns a short from-scratch
    # run far faster than the recipe's SGD (PP-YOLOE's demo measured it), with clipping for
    # the first steps and an EMA of the weights. Short side 128, not the other demos' 192:
    # R50-FCOS costs about ten times PP-YOLOE-s per image (its GN towers run at every FPN
    # level), 1.5 img/s at 192x256 against 3.4 at 128x160 here (batch 8, channels-last no
    # faster), so a 192 px run of 8 epochs would take over half an hour. Measured
    # 2026-12-03: 18 min 13 s end to end, AP 0.066 / AP50 0.126 (AP50 0.089 at epoch 6):
    # short of issue 16's AP50 0.5, which a from-scratch ResNet-50 does not reach in the
    # ~3,000 images that 20 minutes of this CPU can train on. Not an implementation gap:
    # torchvision's FCOS on this recipe (bench/fcos_torchvision.py) ends at AP50 0.142.
    # Three times the schedule (24 epochs, x0.1 at 18 and 22; 50 min 44 s) ends at AP 0.303
    # / AP50 0.445 (AP50 0.146, 0.242, 0.332, 0.393 at epochs 8, 12, 16, 20).
    demo={
        **DEMO_CPU,
        "family.from_scratch": True,
        "data.img_size": 128,
        "data.train_sizes": (128,),
        "optim.base_lr": 0.002,
        "optim.epochs": 8,
        "optim.milestones": (6, 7),
        "optim.warmup_steps": 100,
        "optim.warmup_start_factor": 0.001,
        "optim.ema": True,
        "run.eval_interval": 6,
    },
    # The ImageNet files the authors' configs start from (pretrain_weights).
    backbone_files={"r50": "ResNet50_cos_pretrained.pdparams (Paddle) or torchvision resnet50 IMAGENET1K_V1"},
    predict=paddle_nms_kwargs,
)

# --------------------------------------------------------------------------- released weights


def _tv_fpn(rest: str) -> str:
    """torchvision FPN names (``inner_blocks.i.0.weight``; before 0.13 ``inner_blocks.i.weight``)."""
    for tv, ours in (("inner_blocks.", "lateral."), ("layer_blocks.", "output.")):
        if rest.startswith(tv):
            i, *tail = rest[len(tv):].split(".")
            if len(tail) == 2 and tail[0] == "0":
                tail = tail[1:]
            return f"neck.{ours}{i}.{'.'.join(tail)}"
    if rest.startswith("extra_blocks."):
        return "neck." + rest[len("extra_blocks."):]
    raise KeyError(f"backbone.fpn.{rest} (not a torchvision FPN name)")


_TV_HEAD = {
    "head.classification_head.conv.": "head.cls_tower.",
    "head.classification_head.cls_logits.": "head.cls_logits.",
    "head.regression_head.conv.": "head.reg_tower.",
    "head.regression_head.bbox_reg.": "head.bbox_reg.",
    "head.regression_head.bbox_ctrness.": "head.centerness.",
}


def from_torchvision(state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """torchvision ``fcos_resnet50_fpn`` names -> fastdet's: ``backbone.body.*`` -> ``backbone.*``
    (the same torchvision ResNet), ``backbone.fpn.*`` -> ``neck.*``, the two heads' towers and
    predictors -> ``head.*``; the per-level scales torchvision lacks are created at 1 (the
    torchvision decode never reads them)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if k.startswith("backbone.body."):
            out["backbone." + k[len("backbone.body."):]] = v
        elif k.startswith("backbone.fpn."):
            out[_tv_fpn(k[len("backbone.fpn."):])] = v
        else:
            prefix = next((p for p in _TV_HEAD if k.startswith(p)), None)
            if prefix is None:
                raise KeyError(f"{k} (not a torchvision fcos_resnet50_fpn name)")
            out[_TV_HEAD[prefix] + k[len(prefix):]] = v
    if "head.cls_logits.weight" not in out:
        raise KeyError("head.classification_head.cls_logits.weight (absent: not a torchvision FCOS)")
    out["head.scales"] = torch.ones(len(STRIDES))
    return out, int(out["head.cls_logits.weight"].shape[0])


_PADDLE_BRANCH = {"branch2a.conv.": "conv1.", "branch2a.norm.": "bn1.", "branch2b.conv.": "conv2.",
                  "branch2b.norm.": "bn2.", "branch2c.conv.": "conv3.", "branch2c.norm.": "bn3.",
                  "short.conv.": "downsample.0.", "short.norm.": "downsample.1."}
_PADDLE_FPN = {"fpn_inner_res3_sum_lateral.": "lateral.0.", "fpn_inner_res4_sum_lateral.": "lateral.1.",
               "fpn_inner_res5_sum.": "lateral.2.", "fpn_res3_sum.": "output.0.", "fpn_res4_sum.": "output.1.",
               "fpn_res5_sum.": "output.2.", "fpn_6.": "p6.", "fpn_7.": "p7."}
_PADDLE_HEAD = {"fcos_head_cls.": "cls_logits.", "fcos_head_reg.": "bbox_reg.", "fcos_head_centerness.": "centerness."}


def _paddle_backbone_name(name: str) -> str | None:
    """A Paddle ResNet (variant b) name without ``backbone.`` -> torchvision's; None otherwise."""
    if name.startswith("conv1.conv1."):
        rest = name[len("conv1.conv1."):]
        return ("conv1." + rest[5:]) if rest.startswith("conv.") else ("bn1." + rest[5:]) if rest.startswith("norm.") else None
    if m := re.match(r"res(\d)\.res\d([a-z])\.(.*)", name):
        part = next((p for p in _PADDLE_BRANCH if m[3].startswith(p)), None)
        if part is not None:
            return f"layer{int(m[1]) - 1}.{ord(m[2]) - ord('a')}.{_PADDLE_BRANCH[part]}{m[3][len(part):]}"
    return None


def from_paddle(state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """PaddleDetection ``fcos_r50_fpn_1x_coco.pdparams`` names -> fastdet's.

    ResNet variant b ``conv1.conv1`` -> ``conv1`` / ``bn1``, ``resN.resN<letter>.branch2{a,b,c}``
    -> torchvision's ``layer{N-1}.<i>.conv{1,2,3}`` / ``bn{1,2,3}``, ``short`` -> ``downsample``;
    the FPN's ``fpn_inner_*`` / ``fpn_res*_sum`` / ``fpn_6``, ``fpn_7`` -> ``lateral`` /
    ``output`` / ``p6``, ``p7``; tower ``fcos_head_{cls,reg}_tower_conv_i.{conv,norm}`` ->
    ``{cls,reg}_tower.{3i, 3i+1}``; the five ``p{3..7}_feat.scale_reg`` -> ``head.scales``.
    Checked against the key manifest of PaddleDetection 2.6's own model (324 keys); its
    outputs are not yet compared with Paddle's.
    """
    out: dict[str, Any] = {}
    scales: dict[int, Any] = {}
    for k, v in state.items():
        if k == NAME_TABLE:
            continue
        name = bn_name(k)
        if name.startswith("backbone."):
            b = _paddle_backbone_name(name[len("backbone."):])
            if b is None:
                raise KeyError(f"{k} (not a ResNet-b name)")
            name = "backbone." + b
        elif name.startswith("neck."):
            rest = name[len("neck."):]
            part = next((p for p in _PADDLE_FPN if rest.startswith(p)), None)
            if part is None:
                raise KeyError(f"{k} (not a PaddleDetection FCOS FPN name)")
            name = "neck." + _PADDLE_FPN[part] + rest[len(part):]
        elif m := re.match(r"fcos_head\.fcos_feat\.fcos_head_(cls|reg)_tower_conv_(\d+)\.(conv|norm)\.(.*)", name):
            name = f"head.{m[1]}_tower.{3 * int(m[2]) + (m[3] == 'norm')}.{m[4]}"
        elif m := re.match(r"fcos_head\.p(\d)_feat\.scale_reg$", name):
            scales[int(m[1]) - 3] = v.reshape(())
            continue
        elif name.startswith("fcos_head.") and any(name[len("fcos_head."):].startswith(p) for p in _PADDLE_HEAD):
            rest = name[len("fcos_head."):]
            part = next(p for p in _PADDLE_HEAD if rest.startswith(p))
            name = "head." + _PADDLE_HEAD[part] + rest[len(part):]
        else:
            raise KeyError(f"{k} (not a PaddleDetection FCOS name)")
        out[name] = v
    if "head.cls_logits.weight" not in out or sorted(scales) != list(range(len(STRIDES))):
        raise KeyError("fcos_head.fcos_head_cls.weight / p3..p7_feat.scale_reg (absent: not a Paddle FCOS)")
    out["head.scales"] = torch.stack([torch.as_tensor(scales[i]) for i in range(len(STRIDES))])
    return out, int(out["head.cls_logits.weight"].shape[0])


# Paddle fcos_reader.yml: Resize [800, 1333] keep_ratio, interp 1 (linear); ImageNet mean/std. The content
# size and map-back are torchvision's GeneralizedRCNNTransform's: floor(h * r) (interpolate with
# recompute_scale_factor) and boxes by the resized size's true ratio to the original (resize_boxes).
FAMILY = ArchFamily(
    build=build_fcos,
    sizes=tuple(SIZES),
    config_fields=("from_scratch", "decode", "box_loss"),
    preprocess=Preprocess(resize="keep_ratio", short=800, max_long=1333, interp="linear", box_scale="content"),
    recipe=RECIPE,
    # torchvision's FCOS evaluates with its constructor's defaults: score 0.2, top 1000
    # candidates, NMS 0.6, 100 detections.
    weight_sources={"paddle": WeightSource(from_paddle, file_format="paddle"),
                    "torchvision": WeightSource(from_torchvision, options={"decode": "torchvision", "score_thresh": 0.2},
                                                classes="coco91")},
)
