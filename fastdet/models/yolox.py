"""YOLOX (Ge et al. 2021): PAFPN neck, decoupled head with SimOTA and its loss, nano ... x.

Follows Megvii's YOLOX (yolox/models/yolo_pafpn.py, yolo_head.py, exps/default/yolox_*.py)
as the published weights were trained (the SimOTA of @f7f7c71, see
``fastdet.ops.simota``). The backbone is :class:`~fastdet.models.backbones.cspdarknet.CSPDarknet`.

Levels, points and predictions are ordered as in Megvii: stride 8, 16, 32 (finest
first; A = sum of H_l * W_l). The head predicts per point ``(tx, ty, tw, th)``, an
objectness logit and C class logits; boxes decode as ``xy = (t_xy + cell) * stride``,
``wh = exp(t_wh) * stride`` (cell = integer grid index, no +0.5), while SimOTA sees the
cell centres ``(cell + 0.5) * stride``.

Across ranks (README "Losses across ranks"): the losses divide by the foreground count
averaged over the ranks, then clamped at 1, where Megvii divides by each rank's own count:
with DDP's averaged gradients N ranks then train as one process on their batches together,
and a rank without foreground does not divide its objectness loss by 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

from fastdet.config import Config
from fastdet.data.preprocess import Preprocess
from fastdet.data.stages import HSV, Flip, MixUp, Mosaic, Normalize, RandomAffine, Resize
from fastdet.losses import all_reduce_mean, loss_float
from fastdet.models.backbones.cspdarknet import CSPDarknet, CSPLayer, base_conv, conv
from fastdet.models.detector import ArchFamily, Detector, WeightSource
from fastdet.models.recipe import DEMO_CPU, POSTPROCESS_RANGES, NMSOptions, Phase, Recipe, check_probabilities
from fastdet.ops import simota_assign

# size -> (depth, width, depthwise), Megvii exps/default/yolox_{nano,tiny,s,m,l,x}.py
SIZES: dict[str, tuple[float, float, bool]] = {
    "nano": (0.33, 0.25, True),
    "tiny": (0.33, 0.375, False),
    "s": (0.33, 0.50, False),
    "m": (0.67, 0.75, False),
    "l": (1.00, 1.00, False),
    "x": (1.33, 1.25, False),
}
# The exps' test_size: nano and tiny are evaluated at 416, the rest at 640.
TEST_SIZES: dict[str, int] = {"nano": 416, "tiny": 416, "s": 640, "m": 640, "l": 640, "x": 640}
STRIDES = (8, 16, 32)
BN_EPS, BN_MOMENTUM = 1e-3, 0.03  # Megvii init_yolo
PRIOR_PROB = 0.01  # head.initialize_biases(1e-2)
NMS_IOU = 0.65  # yolox_base.py nmsthre


# --------------------------------------------------------------------------- neck


class YOLOPAFPN(nn.Module):
    """Top-down FPN then bottom-up PAN over CSP layers (all without residuals).

    Args:
        in_channels: the backbone's widths for strides 8, 16, 32 (``int(w * (256, 512, 1024))``).
    Returns (forward): features for strides 8, 16, 32 with the same widths.
    """

    def __init__(self, in_channels: Sequence[int], depth: float, depthwise: bool = False, act: str = "silu"):
        super().__init__()
        c3, c4, c5 = in_channels
        n = round(3 * depth)
        self.lateral_conv0 = base_conv(c5, c4, 1, act=act)
        self.C3_p4 = CSPLayer(2 * c4, c4, n, False, depthwise, act)
        self.reduce_conv1 = base_conv(c4, c3, 1, act=act)
        self.C3_p3 = CSPLayer(2 * c3, c3, n, False, depthwise, act)
        self.bu_conv2 = conv(c3, c3, 3, 2, depthwise, act)
        self.C3_n3 = CSPLayer(2 * c3, c4, n, False, depthwise, act)
        self.bu_conv1 = conv(c4, c4, 3, 2, depthwise, act)
        self.C3_n4 = CSPLayer(2 * c4, c5, n, False, depthwise, act)
        self.out_channels = [c3, c4, c5]

    @staticmethod
    def _up(x: Tensor) -> Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest")

    def forward(self, feats: Sequence[Tensor]) -> list[Tensor]:
        x2, x1, x0 = feats  # strides 8, 16, 32
        fpn_out0 = self.lateral_conv0(x0)  # [B, c4, H/32, W/32]
        f_out0 = self.C3_p4(torch.cat([self._up(fpn_out0), x1], dim=1))  # [B, c4, H/16, W/16]
        fpn_out1 = self.reduce_conv1(f_out0)  # [B, c3, H/16, W/16]
        pan_out2 = self.C3_p3(torch.cat([self._up(fpn_out1), x2], dim=1))  # [B, c3, H/8, W/8]
        pan_out1 = self.C3_n3(torch.cat([self.bu_conv2(pan_out2), fpn_out1], dim=1))  # [B, c4, H/16, W/16]
        pan_out0 = self.C3_n4(torch.cat([self.bu_conv1(pan_out1), fpn_out0], dim=1))  # [B, c5, H/32, W/32]
        return [pan_out2, pan_out1, pan_out0]


# --------------------------------------------------------------------------- head


def iou_loss(pred: Tensor, target: Tensor) -> Tensor:
    """Megvii ``IOUloss(loss_type="iou")``: ``1 - IoU^2`` of paired cxcywh boxes ``[..., 4] -> [...]``."""
    tl = torch.maximum(pred[..., :2] - pred[..., 2:] / 2, target[..., :2] - target[..., 2:] / 2)
    br = torch.minimum(pred[..., :2] + pred[..., 2:] / 2, target[..., :2] + target[..., 2:] / 2)
    area_p = pred[..., 2:].prod(-1)
    area_g = target[..., 2:].prod(-1)
    overlap = (tl < br).to(pred.dtype).prod(-1)
    area_i = (br - tl).prod(-1) * overlap
    iou = area_i / (area_p + area_g - area_i + 1e-16)
    return 1 - iou**2


def xyxy_to_cxcywh(b: Tensor) -> Tensor:
    return torch.cat([(b[..., :2] + b[..., 2:]) / 2, b[..., 2:] - b[..., :2]], dim=-1)


class YOLOXHead(nn.Module):
    """Decoupled head: per level a 1x1 stem, then two 3x3 convs for classes and two for box
    and objectness (DWConv when ``depthwise``), then 1x1 predictors.

    Args:
        in_channels: neck widths for ``strides``; width: the head's ``int(256 * width)`` channels.
        loss_weights: ``iou`` (5.0 in Megvii), ``obj``, ``cls``, ``l1`` (1.0).
        center_radius, topk, iou_weight: SimOTA's settings.
    """

    # Its layers with one output row per class (fine-tuning maps them by class name:
    # fastdet.engine.finetune): per level a 1x1 conv, weight [C, width, 1, 1], bias [C].
    class_layers = ("cls_preds",)

    def __init__(
        self,
        in_channels: Sequence[int],
        num_classes: int = 80,
        width: float = 1.0,
        strides: Sequence[int] = STRIDES,
        depthwise: bool = False,
        act: str = "silu",
        center_radius: float = 2.5,
        topk: int = 10,
        iou_weight: float = 3.0,
        loss_weights: Mapping[str, float] | None = None,
    ):
        super().__init__()
        if len(in_channels) != len(strides):
            raise ValueError(f"YOLOXHead: {len(in_channels)} input levels but {len(strides)} strides")
        self.num_classes = num_classes
        self.strides = tuple(strides)
        self.center_radius, self.topk, self.iou_weight = center_radius, topk, iou_weight
        self.loss_weights = dict(loss_weights or {"iou": 5.0, "obj": 1.0, "cls": 1.0, "l1": 1.0})
        c = int(256 * width)
        self.stems = nn.ModuleList(base_conv(ch, c, 1, act=act) for ch in in_channels)
        self.cls_convs = nn.ModuleList(
            nn.Sequential(conv(c, c, 3, 1, depthwise, act), conv(c, c, 3, 1, depthwise, act)) for _ in in_channels)
        self.reg_convs = nn.ModuleList(
            nn.Sequential(conv(c, c, 3, 1, depthwise, act), conv(c, c, 3, 1, depthwise, act)) for _ in in_channels)
        self.cls_preds = nn.ModuleList(nn.Conv2d(c, num_classes, 1) for _ in in_channels)
        self.reg_preds = nn.ModuleList(nn.Conv2d(c, 4, 1) for _ in in_channels)
        self.obj_preds = nn.ModuleList(nn.Conv2d(c, 1, 1) for _ in in_channels)
        prior_bias = -math.log((1 - PRIOR_PROB) / PRIOR_PROB)  # sigmoid(bias) = 0.01
        for p in list(self.cls_preds) + list(self.obj_preds):
            nn.init.constant_(p.bias, prior_bias)

    # ------------------------------------------------------------------ shared pieces

    def raw_outputs(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """-> box offsets [B, A, 4], objectness logits [B, A], class logits [B, A, C] (float32,
        float64 for a float64 model)."""
        regs, objs, clss = [], [], []
        for i, feat in enumerate(feats):
            x = self.stems[i](feat)
            cls_feat = self.cls_convs[i](x)
            reg_feat = self.reg_convs[i](x)
            regs.append(self.reg_preds[i](reg_feat).flatten(2).transpose(1, 2))  # [B, HW, 4]
            objs.append(self.obj_preds[i](reg_feat).flatten(2).transpose(1, 2))  # [B, HW, 1]
            clss.append(self.cls_preds[i](cls_feat).flatten(2).transpose(1, 2))  # [B, HW, C]
        reg = loss_float(torch.cat(regs, dim=1))
        obj = loss_float(torch.cat(objs, dim=1)).squeeze(-1)
        cls = loss_float(torch.cat(clss, dim=1))
        return reg, obj, cls

    def grid(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """-> integer cell coordinates (x, y) [A, 2] and stride per point [A] (float32)."""
        cells, strides = [], []
        for feat, s in zip(feats, self.strides):
            h, w = feat.shape[-2:]
            ys = torch.arange(h, device=feat.device, dtype=torch.float32)
            xs = torch.arange(w, device=feat.device, dtype=torch.float32)
            yy, xx = torch.meshgrid(ys, xs, indexing="ij")
            cells.append(torch.stack([xx, yy], dim=-1).reshape(-1, 2))
            strides.append(torch.full((h * w,), float(s), device=feat.device))
        return torch.cat(cells), torch.cat(strides)

    @staticmethod
    def decode(reg: Tensor, cells: Tensor, stride: Tensor) -> Tensor:
        """[B, A, 4] offsets -> cxcywh px."""
        s = stride[:, None]
        return torch.cat([(reg[..., :2] + cells) * s, reg[..., 2:].exp() * s], dim=-1)

    # ------------------------------------------------------------------ inference

    def inference(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """-> boxes [B, A, 4] xyxy input px, scores [B, A, C] = sigmoid(obj) * sigmoid(cls)."""
        reg, obj, cls = self.raw_outputs(feats)
        cells, stride = self.grid(feats)
        box = self.decode(reg, cells, stride)
        boxes = torch.cat([box[..., :2] - box[..., 2:] / 2, box[..., :2] + box[..., 2:] / 2], dim=-1)
        return boxes, cls.sigmoid() * obj.sigmoid()[..., None]

    # ------------------------------------------------------------------ training

    def loss(self, feats: Sequence[Tensor], targets: Mapping[str, Tensor], use_l1: bool = False) -> dict[str, Tensor]:
        """Named losses; ``use_l1`` adds the L1 loss on the raw box offsets (the no-aug phase).

        targets: ``gt_boxes`` [B, M, 4] xyxy input px, ``gt_labels`` [B, M], ``gt_mask`` [B, M]
        bool, optionally ``gt_scores`` [B, M] (mixup weights; all ones when absent).
        """
        C = self.num_classes
        reg, obj, cls = self.raw_outputs(feats)  # [B, A, 4], [B, A], [B, A, C]
        cells, stride = self.grid(feats)
        pred = self.decode(reg, cells, stride)  # [B, A, 4] cxcywh px
        pred_xyxy = torch.cat([pred[..., :2] - pred[..., 2:] / 2, pred[..., :2] + pred[..., 2:] / 2], dim=-1)

        mask = targets["gt_mask"].bool()
        gt_boxes = targets["gt_boxes"].to(reg.dtype)
        gt_labels = targets["gt_labels"].long()
        gt_scores = targets.get("gt_scores")
        points = (cells + 0.5) * stride[:, None]  # [A, 2] cell centres px
        with torch.no_grad():
            scores = cls.sigmoid() * obj.sigmoid()[..., None]
        assigned, assigned_iou = simota_assign(
            scores, pred_xyxy.detach(), points, stride, gt_boxes, gt_labels, mask,
            center_radius=self.center_radius, topk=self.topk, iou_weight=self.iou_weight,
        )
        fg = assigned >= 0  # [B, A]
        fg_f = fg.to(reg.dtype)
        gt_idx = assigned.clamp(min=0)
        matched = torch.gather(gt_boxes, 1, gt_idx[..., None].expand(-1, -1, 4))  # [B, A, 4] xyxy
        label = torch.gather(gt_labels, 1, gt_idx).clamp(0, C - 1)  # [B, A]
        weight = assigned_iou * fg_f
        if gt_scores is not None:
            weight = weight * torch.gather(gt_scores.to(reg.dtype), 1, gt_idx)

        # Megvii's normaliser is the number of foreground points (at least 1); here the mean
        # over ranks, so every rank divides by the same number.
        num_fg = all_reduce_mean(fg_f.sum().detach()).clamp(min=1.0)

        target = xyxy_to_cxcywh(matched)
        # Background points get their own (detached) prediction as target: zero loss, finite gradient.
        safe = torch.where(fg[..., None], target, pred.detach())
        loss_iou = (iou_loss(pred, safe) * fg_f).sum() / num_fg
        loss_obj = F.binary_cross_entropy_with_logits(obj, fg_f, reduction="sum") / num_fg
        one_hot = (label[..., None] == torch.arange(C, device=label.device)).to(cls.dtype)
        cls_target = one_hot * weight[..., None]  # [B, A, C]: one-hot x IoU on foreground
        loss_cls = (F.binary_cross_entropy_with_logits(cls, cls_target, reduction="none") * fg_f[..., None]).sum() / num_fg
        w = self.loss_weights
        total = w["iou"] * loss_iou + w["obj"] * loss_obj + w["cls"] * loss_cls
        if use_l1:
            s = stride[:, None]
            l1_target = torch.cat([safe[..., :2] / s - cells, torch.log(safe[..., 2:] / s + 1e-8)], dim=-1)
            l1_target = torch.where(fg[..., None], l1_target, reg.detach())
            loss_l1 = ((reg - l1_target).abs().sum(-1) * fg_f).sum() / num_fg
            total = total + w["l1"] * loss_l1
        else:
            loss_l1 = total.new_zeros(())
        return {
            "total_loss": total,
            "loss_iou": loss_iou,
            "loss_obj": loss_obj,
            "loss_cls": loss_cls,
            "loss_l1": loss_l1,
        }


# --------------------------------------------------------------------------- model


def yolox_postprocess(
    boxes: Tensor,
    scores: Tensor,
    score_thresh: float = 0.01,
    iou_thresh: float = NMS_IOU,
    max_det: int = 300,
    pre_nms_topk: int = 0,
) -> list[dict[str, Tensor]]:
    """Megvii ``postprocess``: one label per point (its best class), score = obj x that class's
    probability >= ``score_thresh``, class-aware NMS (``batched_nms``) at ``iou_thresh``.

    As Megvii's COCO evaluation, every point that passes the threshold enters the NMS
    (``pre_nms_topk`` 0, the default); a positive ``pre_nms_topk`` keeps only that many best
    points. The ``max_det`` best survivors are kept. boxes [B, A, 4] xyxy, scores [B, A, C].
    """
    out = []
    for b in range(boxes.shape[0]):
        conf, labels = scores[b].max(dim=-1)  # [A]
        k = conf.numel() if pre_nms_topk <= 0 else min(pre_nms_topk, conf.numel())
        top, idx = conf.topk(k)
        keep = top >= score_thresh
        top, idx = top[keep], idx[keep]
        cand = boxes[b][idx].float()
        lab = labels[idx]
        kept = torchvision.ops.batched_nms(cand, top.float(), lab, iou_thresh)[:max_det]
        out.append({"boxes": cand[kept], "scores": top[kept], "labels": lab[kept]})
    return out


class YOLOX(Detector):
    """YOLOX. The L1 loss is a loss argument (``use_l1``) that the recipe's phase turns on
    for the last ``optim.no_aug_epochs`` epochs (:func:`yolox_phase`)."""

    nms_form = "best_class"  # yolox_postprocess: each point's best class, class-aware NMS

    @torch.no_grad()
    def predict(
        self,
        images: Tensor,
        score_thresh: float = 0.01,
        iou_thresh: float = NMS_IOU,
        max_det: int = 300,
        pre_nms_topk: int = 0,
    ) -> list[dict[str, Tensor]]:
        """Detections per image: ``{"boxes" [K,4] xyxy input px, "scores" [K], "labels" [K]}``."""
        boxes, scores = self(images)
        return yolox_postprocess(boxes, scores, score_thresh, iou_thresh, max_det, pre_nms_topk)


def build_yolox(
    size: str,
    num_classes: int = 80,
    *,
    width_mult: float | None = None,
    depth_mult: float | None = None,
) -> YOLOX:
    """YOLOX of ``size`` in nano/tiny/s/m/l/x (CSPDarknet + YOLOPAFPN + YOLOXHead).

    ``width_mult`` / ``depth_mult`` override the size's multipliers (e.g. a narrower model
    for quick experiments).
    """
    d, w, depthwise = SIZES[size]
    d = d if depth_mult is None else depth_mult
    w = w if width_mult is None else width_mult
    backbone = CSPDarknet(d, w, depthwise=depthwise)
    neck = YOLOPAFPN(backbone.out_channels, d, depthwise=depthwise)
    head = YOLOXHead(neck.out_channels, num_classes, width=w, depthwise=depthwise)
    model = YOLOX(backbone, neck, head)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps, m.momentum = BN_EPS, BN_MOMENTUM
    return model


# --------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class YOLOXOptions(NMSOptions):
    """The ``family`` config section of YOLOX (``--set family.<field>=value``).

    Post-processing (Megvii ``postprocess`` with yolox_base.py's test_conf and nmsthre, its
    COCO eval): one class per point, score obj x cls >= 0.01, every such point into a
    class-aware NMS at 0.65 (no pre-NMS top-k). The augmentation is Megvii's ``yolox_base.py``: mosaic (prob
    1.0) then random affine (±10° rotation, ±0.1 translation, scale U(0.1, 2), ±2° shear),
    mixup (prob 1.0, partner scale U(0.5, 1.5)), HSV (prob 1.0), flip 0.5, a top-left
    letterbox padded with 114, raw 0..255 pixels. nano and tiny: mosaic scale (0.5, 1.5),
    no mixup; nano also mosaic prob 0.5. The last ``optim.no_aug_epochs`` (15) epochs drop
    mosaic, affine and mixup and add the L1 loss; the LR holds flat then (quadratic_warmcos).
    """

    # Megvii's eval keeps every point above test_conf (yolox_base.py): no top-k before NMS,
    # which ``pre_nms_topk`` 0 says (yolox_postprocess, the ONNX export's best-class form).
    postprocess_ranges: ClassVar[Mapping[str, tuple[Callable[[float], bool], str]]] = {
        **POSTPROCESS_RANGES, "pre_nms_topk": (lambda v: v >= 0, ">= 0 (0: every candidate)")}
    nms_iou: float = NMS_IOU
    pre_nms_topk: int = 0
    mosaic_prob: float = 1.0
    mixup_prob: float = 1.0
    hsv_prob: float = 1.0
    flip_prob: float = 0.5
    degrees: float = 10.0
    translate: float = 0.1
    mosaic_scale: tuple[float, float] = (0.1, 2.0)
    mixup_scale: tuple[float, float] = (0.5, 1.5)
    shear: float = 2.0


def yolox_phase(epoch: int, epochs: int, cfg: Config) -> Phase:
    """Megvii's two phases. Before the last ``optim.no_aug_epochs`` epochs: Mosaic,
    RandomAffine (on mosaicked samples, as Megvii applies it inside the mosaic branch),
    MixUp, HSV, Flip, letterbox; after: HSV, Flip, letterbox, the L1 loss on and an
    evaluation every epoch (Megvii ``trainer.py``). Zero-probability stages are left out
    (they would still draw from the sample's random stream)."""
    o = cfg.family
    check_probabilities(o, "mosaic_prob", "mixup_prob", "hsv_prob", "flip_prob")
    for name in ("mosaic_scale", "mixup_scale"):
        lo, hi = getattr(o, name)
        if not 0 < lo <= hi:
            raise ValueError(f"family.{name}: expected 0 < low <= high, got {(lo, hi)}")
    late = epoch >= epochs - cfg.optim.no_aug_epochs
    tail = ((HSV(prob=o.hsv_prob),) if o.hsv_prob > 0 else ()) + (
        Flip(o.flip_prob),
        Resize("letterbox", pad_value=114.0, interp="linear"),
        Normalize(None, None),
    )
    if late:
        return Phase({"use_l1": True}, tail, eval_interval=1)
    head: tuple = ()
    if o.mosaic_prob > 0:
        head += (Mosaic(o.mosaic_prob, pad_value=114.0),
                 RandomAffine(o.degrees, o.translate, tuple(o.mosaic_scale), o.shear, pad_value=114.0))
    if o.mixup_prob > 0:
        head += (MixUp("scaled_crop", o.mixup_prob, scale=tuple(o.mixup_scale)),)
    return Phase({"use_l1": False}, head + tail)


def _sizes(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(range(lo, hi + 1, 32))


RECIPE = Recipe(
    options=YOLOXOptions,
    phase=yolox_phase,
    # Megvii yolox/exp/yolox_base.py: 300 epochs, SGD nesterov momentum 0.9, weight decay
    # 5e-4 (not on BatchNorm weights and biases), lr 0.01 per 64 images (README: 8 GPUs x 8),
    # quadratic_warmcos, Megvii's yoloxwarmcos (5 warm-up epochs from 0, cosine to 0.05 lr, flat for the last 15),
    # ModelEMA 0.9998 ramp, max_labels 120, a new size every 10 iterations from
    # 32 * randint(input/32 +- 5) (480..800 at 640), evaluation at 640.
    base={
        "optim.optimizer": "sgd", "optim.momentum": 0.9, "optim.nesterov": True, "optim.weight_decay": 5e-4,
        "optim.base_lr": 0.01, "optim.ref_batch": 64, "optim.epochs": 300, "optim.schedule": "quadratic_warmcos",
        "optim.warmup_epochs": 5.0, "optim.warmup_start_factor": 0.0, "optim.min_lr_ratio": 0.05,
        "optim.no_aug_epochs": 15, "optim.ema_type": "ramp", "optim.ema_decay": 0.9998,
        "data.batch_size": 8, "data.img_size": 640, "data.train_sizes": _sizes(480, 800),
        "data.size_period": 10, "data.max_boxes": 120,
        # Plain BatchNorm per GPU, statistics averaged over the GPUs before each evaluation
        # and checkpoint (yolox/core/trainer.py: all_reduce_norm).
        "model.all_reduce_bn_stats": True,
    },
    sizes={
        # exps/default/yolox_nano.py: input 416, random_size (10, 20) -> 320..640, mosaic
        # scale (0.5, 1.5), mosaic prob 0.5, no mixup, test at 416.
        "nano": {"data.img_size": 416, "data.train_sizes": _sizes(320, 640), "family.mosaic_scale": (0.5, 1.5),
                 "family.mosaic_prob": 0.5, "family.mixup_prob": 0.0},
        # yolox_tiny.py sets `input_scale` (unused, a typo), so training keeps input 640's
        # settings but random_size (10, 20) -> 320..640; mosaic scale (0.5, 1.5), no mixup,
        # test at 416.
        "tiny": {"data.img_size": 416, "data.train_sizes": _sizes(320, 640), "family.mosaic_scale": (0.5, 1.5),
                 "family.mixup_prob": 0.0},
        "s": {}, "m": {}, "l": {}, "x": {},
    },
    # The built-in demo set on a 2-core CPU, from scratch, as PP-YOLOE's demo: 192 px, AdamW,
    # flips only (mosaic, affine and mixup slow a run this short; they stay available with
    # --set family.mosaic_prob=1 ...), cosine decay, the L1 phase for the last 4 epochs.
    # Measured 2026-12-03 on the 2-core CPU: 18 min 6 s end to end, AP 0.606 / AP50 0.818
    # (AP50 0.545 at epoch 8, 0.785 at 16).
    demo={
        **DEMO_CPU,
        "data.size_period": 1,
        "data.augment": True,
        "family.mosaic_prob": 0.0,
        "family.mixup_prob": 0.0,
        "family.hsv_prob": 0.0,
        "family.flip_prob": 0.5,
        "optim.nesterov": False,
        "optim.base_lr": 0.002,
        "optim.epochs": 24,
        "optim.schedule": "cosine",
        "optim.cosine_epochs": 28,
        "optim.warmup_epochs": 0.0,
        "optim.warmup_steps": 150,
        "optim.warmup_start_factor": 0.001,
        "optim.no_aug_epochs": 4,
        "optim.ema_type": "threshold",
        "run.eval_interval": 8,
    },
)

# --------------------------------------------------------------------------- released weights


# Megvii trains and evaluates on BGR pixels (``cv2.imread``, no channel swap in ``preproc``);
# fastdet feeds RGB. The Focus stem's first conv sees 4 space-to-depth patches of 3 channels
# each ([C_out, 12, k, k]): reversing each patch's 3 input channels makes it read RGB as
# Megvii's reads BGR.
STEM_WEIGHT = "backbone.stem.conv.conv.weight"
BGR_TO_RGB = [3 * patch + c for patch in range(4) for c in (2, 1, 0)]


def from_megvii(state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Megvii's names -> fastdet's: ``backbone.backbone.*`` (CSPDarknet) -> ``backbone.*``,
    the PAFPN's own ``backbone.*`` -> ``neck.*``, ``head.*`` unchanged (same module tree);
    the stem's input channels from BGR to RGB (``BGR_TO_RGB``). BatchNorm eps/momentum are
    not in the file; :func:`build_yolox` sets Megvii's."""
    out = {}
    for k, v in state.items():
        if k.startswith("backbone.backbone."):
            out["backbone." + k[len("backbone.backbone."):]] = v
        elif k.startswith("backbone."):
            out["neck." + k[len("backbone."):]] = v
        elif k.startswith("head."):
            out[k] = v
        else:
            raise KeyError(f"{k} (Megvii YOLOX names start with backbone. or head.)")
    if "head.cls_preds.0.weight" not in out:
        raise KeyError("head.cls_preds.0.weight (absent: not a Megvii YOLOX model)")
    if STEM_WEIGHT in out and out[STEM_WEIGHT].dim() == 4 and out[STEM_WEIGHT].shape[1] == len(BGR_TO_RGB):
        out[STEM_WEIGHT] = out[STEM_WEIGHT][:, BGR_TO_RGB].contiguous()
    return out, int(out["head.cls_preds.0.weight"].shape[0])


FAMILY = ArchFamily(
    build=build_yolox,
    weight_sources={"megvii": WeightSource(from_megvii)},
    sizes=tuple(SIZES),
    # Megvii preproc: content int(h * r) x int(w * r) on a 114 canvas; its evaluator divides boxes by r.
    preprocess=Preprocess(resize="letterbox", pad_value=114.0, mean=None, std=None, interp="linear",
                          box_scale="ratio"),
    recipe=RECIPE,
)
