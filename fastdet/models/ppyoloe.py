"""PP-YOLOE (Xu et al. 2022): CustomCSPPAN neck, PPYOLOEHead with its loss, and its recipe (s/m/l/x presets, demo, phases).

Follows PaddleDetection (configs/ppyoloe/_base_/ppyoloe_crn.yml;
ppdet/modeling/necks/custom_pan.py, heads/ppyoloe_head.py). The backbone is
:class:`fastdet.models.backbones.cspresnet.CSPResNet`.

Feature maps, anchors and predictions are ordered as in Paddle: stride 32, 16, 8
(A = sum of H_l * W_l, coarsest level first). The loss is computed in stride units
(boxes divided by their level's stride), the assigners see pixels.

Across ranks (README "Losses across ranks"): the losses divide by the sum of the assigned
scores averaged over the ranks, then clamped at 1, as Paddle's head all-reduces it; with
DDP's averaged gradients N ranks train as one process on their batches together (while
that mean is at least 1), a rank without positives included.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdet.config import Config
from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD
from fastdet.data.stages import Distort, ExpandCrop, Flip, Normalize, Resize
from fastdet.losses import all_reduce_mean, distribution_focal_loss, giou_loss, loss_float, varifocal_loss
from fastdet.models.backbones.cspresnet import CSPResNet, scale_channels, scale_depths
from fastdet.models.detector import ArchFamily, Detector, WeightSource
from fastdet.models.layers import SPP, BasicBlock, ConvBNAct
from fastdet.models.paddle_names import NAME_TABLE, bn_name, dfl_projection_checked, load_paddle_backbone
from fastdet.models.recipe import DEMO_CPU, PaddleNMSOptions, Phase, Recipe, check_probabilities, paddle_nms_kwargs
from fastdet.ops import atss_assign, task_aligned_assign

# size -> (depth_mult, width_mult), PaddleDetection configs/ppyoloe/ppyoloe_crn_{s,m,l,x}_300e_coco.yml
SIZES: dict[str, tuple[float, float]] = {
    "s": (0.33, 0.50),
    "m": (0.67, 0.75),
    "l": (1.00, 1.00),
    "x": (1.33, 1.25),
}


# --------------------------------------------------------------------------- neck


class CSPStage(nn.Module):
    """Two 1x1 branches of ``c_out // 2``; one through ``n`` BasicBlocks (no residual) with an
    SPP after block ``(n - 1) // 2`` when ``spp``; concat; 1x1 to ``c_out``."""

    def __init__(self, c_in: int, c_out: int, n: int, act: str = "swish", spp: bool = False, alpha: bool = False):
        super().__init__()
        c_mid = c_out // 2
        self.conv1 = ConvBNAct(c_in, c_mid, 1, act=act)
        self.conv2 = ConvBNAct(c_in, c_mid, 1, act=act)
        blocks: list[nn.Module] = []
        for i in range(n):
            blocks.append(BasicBlock(c_mid, c_mid, act=act, shortcut=False, alpha=alpha))
            if spp and i == (n - 1) // 2:
                blocks.append(SPP(c_mid * 4, c_mid, 1, (5, 9, 13), act=act))
        self.convs = nn.Sequential(*blocks)
        self.conv3 = ConvBNAct(c_mid * 2, c_out, 1, act=act)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv3(torch.cat([self.conv1(x), self.convs(self.conv2(x))], dim=1))


class CustomCSPPAN(nn.Module):
    """FPN top-down then PAN bottom-up over CSPStages (``stage_num`` 1, transformer off).

    Args:
        in_channels: backbone widths, finest first (e.g. strides 8, 16, 32).
        out_channels: output widths, coarsest first (l: 768, 384, 192), before ``width_mult``.
    Returns (forward): features coarsest first (strides 32, 16, 8).
    """

    def __init__(
        self,
        in_channels: Sequence[int],
        out_channels: Sequence[int] = (768, 384, 192),
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        block_num: int = 3,
        act: str = "swish",
        spp: bool = True,
        use_alpha: bool = False,
    ):
        super().__init__()
        out_ch = scale_channels(out_channels, width_mult)
        n = scale_depths([block_num], depth_mult)[0]
        in_ch = list(in_channels)[::-1]  # coarsest first
        self.num_levels = len(in_ch)
        self.out_channels = out_ch

        self.fpn_stages = nn.ModuleList()
        self.fpn_routes = nn.ModuleList()
        ch_pre = 0
        for i, (c_in, c_out) in enumerate(zip(in_ch, out_ch)):
            if i > 0:
                c_in += ch_pre // 2
            self.fpn_stages.append(CSPStage(c_in, c_out, n, act=act, spp=spp and i == 0, alpha=use_alpha))
            if i < self.num_levels - 1:
                self.fpn_routes.append(ConvBNAct(c_out, c_out // 2, 1, act=act))
            ch_pre = c_out

        # PAN modules are indexed by the level they produce (0 = coarsest), as in Paddle.
        pan_stages, pan_routes = [], []
        for i in reversed(range(self.num_levels - 1)):
            pan_routes.append(ConvBNAct(out_ch[i + 1], out_ch[i + 1], 3, stride=2, act=act))
            pan_stages.append(CSPStage(out_ch[i] + out_ch[i + 1], out_ch[i], n, act=act, alpha=use_alpha))
        self.pan_stages = nn.ModuleList(pan_stages[::-1])
        self.pan_routes = nn.ModuleList(pan_routes[::-1])

    def forward(self, feats: Sequence[Tensor]) -> list[Tensor]:
        fpn = []
        route = None
        for i, block in enumerate(list(feats)[::-1]):
            if route is not None:
                block = torch.cat([route, block], dim=1)
            route = self.fpn_stages[i](block)
            fpn.append(route)
            if i < self.num_levels - 1:
                route = F.interpolate(self.fpn_routes[i](route), scale_factor=2.0, mode="nearest")
        pan = [fpn[-1]]
        route = fpn[-1]
        for i in reversed(range(self.num_levels - 1)):
            route = self.pan_stages[i](torch.cat([self.pan_routes[i](route), fpn[i]], dim=1))
            pan.append(route)
        return pan[::-1]


# --------------------------------------------------------------------------- head


class ESEAttn(nn.Module):
    """``ConvBNAct1x1(feat * sigmoid(fc(mean(feat))))``; fc initialised N(0, 0.001)."""

    def __init__(self, channels: int, act: str = "swish"):
        super().__init__()
        self.fc = nn.Conv2d(channels, channels, 1)
        self.conv = ConvBNAct(channels, channels, 1, act=act)
        nn.init.normal_(self.fc.weight, std=0.001)
        nn.init.zeros_(self.fc.bias)

    def forward(self, feat: Tensor, avg_feat: Tensor) -> Tensor:
        return self.conv(feat * self.fc(avg_feat).sigmoid())


class PPYOLOEHead(nn.Module):
    """Decoupled head with ESE attention per level, varifocal classification and DFL regression.

    Args:
        in_channels: neck widths in ``strides`` order (coarsest first).
        strides: (32, 16, 8).
        reg_max: DFL bins are 0..reg_max (17 for 16); distances in stride units.
        grid_cell_scale / grid_cell_offset: ATSS anchor side (x stride) and point offset.
        static_topk / topk, alpha, beta: ATSS and task-aligned assigner settings.
        loss_weights: class (VFL), iou (GIoU), dfl.
    """

    # Its layers with one output row per class (fine-tuning maps them by class name:
    # fastdet.engine.finetune): per level a 3x3 conv, weight [C, c, 3, 3], bias [C].
    class_layers = ("pred_cls",)

    def __init__(
        self,
        in_channels: Sequence[int],
        num_classes: int = 80,
        strides: Sequence[int] = (32, 16, 8),
        reg_max: int = 16,
        grid_cell_scale: float = 5.0,
        grid_cell_offset: float = 0.5,
        static_topk: int = 9,
        topk: int = 13,
        alpha: float = 1.0,
        beta: float = 6.0,
        loss_weights: Mapping[str, float] | None = None,
        act: str = "swish",
    ):
        super().__init__()
        if len(in_channels) != len(strides):
            raise ValueError(f"PPYOLOEHead: {len(in_channels)} input levels but {len(strides)} strides")
        self.num_classes = num_classes
        self.strides = tuple(strides)
        self.reg_max = reg_max
        self.grid_cell_scale = grid_cell_scale
        self.grid_cell_offset = grid_cell_offset
        self.static_topk, self.topk, self.alpha, self.beta = static_topk, topk, alpha, beta
        self.loss_weights = dict(loss_weights or {"class": 1.0, "iou": 2.5, "dfl": 0.5})

        self.stem_cls = nn.ModuleList(ESEAttn(c, act) for c in in_channels)
        self.stem_reg = nn.ModuleList(ESEAttn(c, act) for c in in_channels)
        self.pred_cls = nn.ModuleList(nn.Conv2d(c, num_classes, 3, padding=1) for c in in_channels)
        self.pred_reg = nn.ModuleList(nn.Conv2d(c, 4 * (reg_max + 1), 3, padding=1) for c in in_channels)
        prior_bias = -math.log((1 - 0.01) / 0.01)  # sigmoid(bias) = 0.01
        for cls_conv, reg_conv in zip(self.pred_cls, self.pred_reg):
            nn.init.zeros_(cls_conv.weight)
            nn.init.constant_(cls_conv.bias, prior_bias)
            nn.init.zeros_(reg_conv.weight)
            nn.init.constant_(reg_conv.bias, 1.0)
        # Paddle's proj_conv: a fixed 1x1 conv with weights 0..reg_max, never trained. A
        # buffer here, so optimisers and weight decay never see it.
        self.register_buffer("proj", torch.linspace(0, reg_max, reg_max + 1), persistent=False)

    # ------------------------------------------------------------------ shared pieces

    def raw_outputs(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """-> cls logits [B, A, C], distance logits [B, A, 4, reg_max + 1] (float32, float64 for
        a float64 model)."""
        cls_list, reg_list = [], []
        for i, feat in enumerate(feats):
            avg = feat.mean((2, 3), keepdim=True)
            cls_logit = self.pred_cls[i](self.stem_cls[i](feat, avg) + feat)  # [B, C, H, W]
            reg = self.pred_reg[i](self.stem_reg[i](feat, avg))  # [B, 4 * bins, H, W]
            cls_list.append(cls_logit.flatten(2).transpose(1, 2))
            reg_list.append(reg.flatten(2).transpose(1, 2))
        cls = loss_float(torch.cat(cls_list, dim=1))
        reg = loss_float(torch.cat(reg_list, dim=1))
        return cls, reg.reshape(reg.shape[0], reg.shape[1], 4, self.reg_max + 1)

    def anchors(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor, list[int], Tensor]:
        """-> anchor boxes [A, 4] px (side grid_cell_scale * stride), points [A, 2] px,
        anchors per level, stride per anchor [A, 1]."""
        boxes, points, counts, strides = [], [], [], []
        for feat, s in zip(feats, self.strides):
            h, w = feat.shape[-2:]
            dev = feat.device
            ys = (torch.arange(h, device=dev, dtype=torch.float32) + self.grid_cell_offset) * s
            xs = (torch.arange(w, device=dev, dtype=torch.float32) + self.grid_cell_offset) * s
            yy, xx = torch.meshgrid(ys, xs, indexing="ij")
            p = torch.stack([xx, yy], dim=-1).reshape(-1, 2)
            half = self.grid_cell_scale * s / 2
            boxes.append(torch.cat([p - half, p + half], dim=-1))
            points.append(p)
            counts.append(h * w)
            strides.append(torch.full((h * w, 1), float(s), device=dev))
        return torch.cat(boxes), torch.cat(points), counts, torch.cat(strides)

    def decode_distances(self, dist_logits: Tensor) -> Tensor:
        """[B, A, 4, bins] -> expected ltrb distances [B, A, 4] (stride units), in fp32.

        A multiply-and-sum, not ``@ proj``: autocast runs matmuls in bf16, whose 8-bit
        mantissa rounds a distance of 8..16 bins to 1/16 of a bin (2 px at stride 32),
        and these boxes feed the IoU loss and the assigners.
        """
        return (loss_float(dist_logits).softmax(dim=-1) * loss_float(self.proj)).sum(-1)

    @staticmethod
    def distance_to_box(points: Tensor, ltrb: Tensor) -> Tensor:
        return torch.cat([points - ltrb[..., :2], points + ltrb[..., 2:]], dim=-1)

    # ------------------------------------------------------------------ inference

    def inference(self, feats: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """-> boxes [B, A, 4] xyxy input px, scores [B, A, C] probabilities."""
        cls, dist = self.raw_outputs(feats)
        _, points, _, stride = self.anchors(feats)
        boxes = self.distance_to_box(points / stride, self.decode_distances(dist)) * stride
        return boxes, cls.sigmoid()

    # ------------------------------------------------------------------ training

    def loss(self, feats: Sequence[Tensor], targets: Mapping[str, Tensor], static_assigner: bool = False) -> dict[str, Tensor]:
        """Named losses; ``static_assigner`` picks ATSS (True) or the task-aligned assigner.

        targets: ``gt_boxes`` [B, M, 4] xyxy input px, ``gt_labels`` [B, M], ``gt_mask`` [B, M] bool.
        """
        C = self.num_classes
        cls_logits, dist = self.raw_outputs(feats)  # [B, A, C], [B, A, 4, bins]
        anchor_boxes, points, counts, stride = self.anchors(feats)
        points_s = points / stride  # [A, 2] stride units
        pred_boxes = self.distance_to_box(points_s, self.decode_distances(dist))  # [B, A, 4] stride units
        pred_scores = cls_logits.sigmoid()

        mask = targets["gt_mask"].bool()
        pad_mask = mask[..., None].to(dist.dtype)  # [B, M, 1]
        gt_boxes = targets["gt_boxes"].to(dist.dtype) * pad_mask  # padded slots are exactly zero, as Paddle assumes
        gt_labels = torch.where(mask, targets["gt_labels"].long(), 0)[..., None]  # [B, M, 1]
        pred_boxes_px = pred_boxes.detach() * stride
        if static_assigner:
            labels, boxes, scores = atss_assign(
                anchor_boxes, counts, gt_labels, gt_boxes, pad_mask, bg_index=C,
                topk=self.static_topk, pred_bboxes=pred_boxes_px, num_classes=C,
            )
        else:
            labels, boxes, scores = task_aligned_assign(
                pred_scores.detach(), pred_boxes_px, points, gt_labels, gt_boxes, pad_mask, bg_index=C,
                topk=self.topk, alpha=self.alpha, beta=self.beta,
            )
        boxes = boxes / stride  # [B, A, 4] stride units

        one_hot = (labels[..., None] == torch.arange(C, device=labels.device)).to(cls_logits.dtype)  # bg (= C) -> all 0
        # Normaliser: sum of soft targets, mean over ranks, at least 1.
        norm = all_reduce_mean(scores.sum().detach()).clamp(min=1.0)
        loss_cls = varifocal_loss(cls_logits, scores, one_hot) / norm

        fg = labels != C  # [B, A]
        fg_f = fg.to(dist.dtype)
        weight = scores.sum(-1) * fg_f  # [B, A]
        # Negatives get their own (detached) prediction as target: zero loss, finite gradient.
        safe_boxes = torch.where(fg[..., None], boxes, pred_boxes.detach())
        loss_iou = (giou_loss(pred_boxes, safe_boxes) * weight).sum() / norm
        ltrb = torch.cat([points_s - safe_boxes[..., :2], safe_boxes[..., 2:] - points_s], dim=-1)
        ltrb = ltrb.clamp(0.0, self.reg_max - 0.01)
        loss_dfl = (distribution_focal_loss(dist, ltrb).mean(-1) * weight).sum() / norm
        with torch.no_grad():  # logged only, as in Paddle
            # Positives averaged over ranks, as the normaliser above: the ranks' mean of
            # the logged value is then the L1 over all their positives (a rank with none
            # would otherwise halve it on 2 ranks).
            num_pos = all_reduce_mean(fg_f.sum())
            loss_l1 = ((pred_boxes - safe_boxes).abs().sum(-1) * fg_f).sum() / (4 * num_pos).clamp(min=1.0)

        w = self.loss_weights
        total = w["class"] * loss_cls + w["iou"] * loss_iou + w["dfl"] * loss_dfl
        return {
            "total_loss": total,
            "loss_cls": loss_cls,
            "loss_iou": loss_iou,
            "loss_dfl": loss_dfl,
            "loss_l1": loss_l1,
        }


# --------------------------------------------------------------------------- model


class PPYOLOE(Detector):
    """PP-YOLOE: the base detector with the PP-YOLOE head. What changes over training
    (the assigner) is the recipe's :func:`ppyoloe_phase`."""

    def load_backbone_weights(self, path: str) -> None:
        """The authors' ImageNet CSPResNetb file (``CSPResNetb_s_pretrained.pdparams``, the
        PP-YOLOE recipe's start), with or without a ``backbone.`` prefix; its classifier is
        ignored and named (``fastdet.models.paddle_names.load_paddle_backbone``)."""
        load_paddle_backbone(self.backbone, path, _paddle_backbone_name)

    # ppyoloe_crn.yml's MultiClassNMS (see PPYOLOEOptions)
    predict_defaults = {"score_thresh": 0.01, "iou_thresh": 0.6, "max_det": 100, "pre_nms_topk": 1000,
                        "per_class_topk": True}


def build_ppyoloe(
    size: str,
    num_classes: int = 80,
    *,
    use_alpha: bool = False,
    width_mult: float | None = None,
    depth_mult: float | None = None,
) -> PPYOLOE:
    """PP-YOLOE of ``size`` in s/m/l/x (CSPResNet + CustomCSPPAN + PPYOLOEHead).

    ``use_alpha`` gives the PP-YOLOE+ RepVGG scale; ``width_mult`` / ``depth_mult`` override
    the size's multipliers (e.g. a narrower model for quick experiments).
    """
    d, w = SIZES[size]
    d = d if depth_mult is None else depth_mult
    w = w if width_mult is None else width_mult
    backbone = CSPResNet(width_mult=w, depth_mult=d, return_idx=(1, 2, 3), use_large_stem=True, use_alpha=use_alpha)
    neck = CustomCSPPAN(backbone.out_channels, (768, 384, 192), width_mult=w, depth_mult=d, use_alpha=use_alpha)
    head = PPYOLOEHead(neck.out_channels, num_classes=num_classes, strides=(32, 16, 8))
    return PPYOLOE(backbone, neck, head)


# --------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class PPYOLOEOptions(PaddleNMSOptions):
    """The ``family`` config section of PP-YOLOE (``--set family.<field>=value``).

    Post-processing is the authors' eval config of the crn models as released, the one
    their published APs (s 42.7, m 48.6, l 50.9, x 51.9) were measured with
    (PaddleDetection configs/ppyoloe/_base_/ppyoloe_crn.yml of 2022-03, MultiClassNMS):
    score 0.01, pre-NMS top 1000 per class, IoU 0.6, keep 100. From 2022-06-30
    (PaddleDetection #6315; releases 2.4 to 2.6) that config keeps 300 at IoU 0.7 and
    reports 43.0, 49.0, 51.4, 52.3 for the same weight files, as PP-YOLOE+ does:
    ``--set family.nms_iou=0.7 --set family.max_det=300``.
    """

    nms_iou: float = 0.6
    max_det: int = 100

    # Epochs trained with the static (ATSS) assigner before the task-aligned one takes
    # over (PP-YOLOE 300e recipe: 100; PP-YOLOE+ 80e: 30).
    static_assigner_epoch: int = 100
    # The training augmentation, stage by stage (PaddleDetection ppyoloe_reader.yml):
    # colour distortion, zoom-out onto a mean-filled canvas, IoU-constrained crop, flip.
    distort_prob: float = 0.5
    expand_prob: float = 0.5
    expand_max_ratio: float = 4.0
    crop: bool = True
    flip_prob: float = 0.5


def ppyoloe_phase(epoch: int, epochs: int, cfg: Config) -> Phase:
    """ATSS before ``static_assigner_epoch``, then task-aligned; the same augmentation
    throughout: distort, expand + crop, flip, a stretch resize at a random interpolation
    per batch (BatchRandomResize), ImageNet normalisation; each stage at the
    probabilities of the options (the demo turns all but the flip off)."""
    o = cfg.family
    check_probabilities(o, "distort_prob", "expand_prob", "flip_prob")
    if o.expand_max_ratio < 1.0:
        raise ValueError(f"family.expand_max_ratio: expected >= 1, got {o.expand_max_ratio}")
    # A zero-probability Distort is left out (as the loaders always did: it would
    # still draw from the sample's random stream and change every later draw).
    distort = (Distort(o.distort_prob),) if o.distort_prob > 0 else ()
    stages = distort + (
        ExpandCrop(o.expand_prob, o.expand_max_ratio, o.crop),
        Flip(o.flip_prob),
        Resize("stretch", interp="random"),
        Normalize(IMAGENET_MEAN, IMAGENET_STD),
    )
    return Phase({"static_assigner": epoch < o.static_assigner_epoch}, stages)


RECIPE = Recipe(
    options=PPYOLOEOptions,
    phase=ppyoloe_phase,
    # PaddleDetection configs/ppyoloe/ppyoloe_crn_{s,m,l,x}_300e_coco.yml and _base_/:
    # momentum SGD with L2 5e-4, 300 epochs of a cosine over 360, EMA 0.9998 (threshold),
    # BatchRandomResize over 320..768 step 32, evaluation at 640.
    base={
        "optim.optimizer": "sgd", "optim.momentum": 0.9, "optim.weight_decay": 5e-4,
        "optim.epochs": 300, "optim.schedule": "cosine", "optim.cosine_epochs": 360,
        "optim.warmup_start_factor": 0.001, "optim.ema_type": "threshold", "optim.ema_decay": 0.9998,
        "data.train_sizes": tuple(range(320, 769, 32)), "data.img_size": 640,
        "model.sync_bn": True,  # _base_/ppyoloe_crn.yml: norm_type sync_bn
    },
    # Images per GPU (8 GPUs), the base LR and the global batch it is given for, warm-up
    # steps. s: lr 0.04 at 8x32, warm-up 2300; m/l/x: 0.03 at 8x20, 3000.
    sizes={
        "s": {"data.batch_size": 32, "optim.base_lr": 0.04, "optim.ref_batch": 256, "optim.warmup_steps": 2300},
        "m": {"data.batch_size": 28, "optim.base_lr": 0.03, "optim.ref_batch": 160, "optim.warmup_steps": 3000},
        "l": {"data.batch_size": 20, "optim.base_lr": 0.03, "optim.ref_batch": 160, "optim.warmup_steps": 3000},
        "x": {"data.batch_size": 16, "optim.base_lr": 0.03, "optim.ref_batch": 160, "optim.warmup_steps": 3000},
    },
    # So that the README's main job learns in minutes on a 2-core CPU: PP-YOLOE-s from
    # scratch at 192 px (~29 img/s there), 24 epochs of the 384 train images. A
    # from-scratch run this short learns far faster with AdamW than with the recipe's SGD
    # (AP50 0.57 vs 0.38 after 28 epochs, measured); horizontal flips are the one
    # augmentation that pays at this length (0.74 with them): the zoom-out / crop of the
    # recipe slows learning, colours carry no label here. Gradient clipping keeps the
    # early steps stable. Explicit user overrides win.
    demo={
        **DEMO_CPU,
        "data.augment": True,
        "family.distort_prob": 0.0,
        "family.expand_prob": 0.0,
        "family.crop": False,
        "family.flip_prob": 0.5,
        "optim.base_lr": 0.002,
        "optim.epochs": 24,
        "optim.cosine_epochs": 28,
        "optim.warmup_steps": 150,
        "family.static_assigner_epoch": 8,
        "run.eval_interval": 8,
    },
    # The ImageNet files the authors' configs start from (pretrain_weights).
    backbone_files={"s": "CSPResNetb_s_pretrained.pdparams", "m": "CSPResNetb_m_pretrained.pdparams",
                    "l": "CSPResNetb_l_pretrained.pdparams", "x": "CSPResNetb_x_pretrained.pdparams"},
    predict=paddle_nms_kwargs,
)

# --------------------------------------------------------------------------- released weights


def _paddle_backbone_name(name: str) -> str:
    """A CSPResNet name without ``backbone.``: ``stem.conv1..3`` -> ``stem.0..2``, the rest as is."""
    if m := re.match(r"stem\.conv(\d)\.(.*)", name):
        return f"stem.{int(m[1]) - 1}.{m[2]}"
    return name


def from_paddle(state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """PaddleDetection PP-YOLOE (crn) ``.pdparams`` names -> fastdet's.

    ``backbone.stem.conv1..3`` -> ``stem.0..2``; the neck's ``{fpn,pan}_stages.N.0.`` lose
    their one-stage ``0.`` level; inside a CSPStage Paddle names the SPP ``convs.spp`` after
    block ``(n - 1) // 2``, which fastdet's ``convs`` Sequential holds at that index + 1
    (later blocks of that stage shift by one; the stages without an SPP, all but the first
    FPN stage, keep their indices); ``yolo_head.`` -> ``head.``; BatchNorm ``_mean`` /
    ``_variance`` -> running statistics; RepVGG blocks stay unfused as stored; the fixed
    DFL projection ``yolo_head.proj_conv`` is checked and dropped.
    """
    state = {k: v for k, v in state.items() if k != NAME_TABLE}
    # Blocks per neck stage (n), from the stored indices, to place the SPP; and the stages
    # that hold one (the first FPN stage): in the others Paddle's blocks keep their indices.
    blocks: dict[str, int] = {}
    spp_stages: set[str] = set()
    for k in state:
        m = re.match(r"neck\.((?:fpn|pan)_stages\.\d+)\.0\.convs\.(\d+|spp)\.", k)
        if m and m[2] == "spp":
            spp_stages.add(m[1])
        elif m:
            blocks[m[1]] = max(blocks.get(m[1], 0), int(m[2]) + 1)
    out: dict[str, Any] = {}
    for k, v in state.items():
        name = bn_name(k)
        if name == "yolo_head.proj_conv.weight":
            dfl_projection_checked(v, k)
            continue
        if name.startswith("yolo_head."):
            name = "head." + name[len("yolo_head."):]
        elif name.startswith("backbone.stem.conv"):
            i, rest = name[len("backbone.stem.conv"):].split(".", 1)
            name = f"backbone.stem.{int(i) - 1}.{rest}"
        elif name.startswith("neck."):
            m = re.match(r"neck\.((?:fpn|pan)_stages\.\d+)\.(\d+)\.(.*)", name)
            if m:
                if m[2] != "0":
                    raise KeyError(f"{k} (a second CSPStage per level: stage_num 1 in the crn configs)")
                stage, rest = m[1], m[3]
                spp_at = (blocks.get(stage, 1) - 1) // 2 + 1
                c = re.match(r"convs\.(spp|\d+)\.(.*)", rest)
                if c:
                    j = spp_at if c[1] == "spp" else int(c[1]) + (stage in spp_stages and int(c[1]) >= spp_at)
                    rest = f"convs.{j}.{c[2]}"
                name = f"neck.{stage}.{rest}"
        elif not name.startswith("backbone."):
            raise KeyError(f"{k} (PP-YOLOE names start with backbone., neck. or yolo_head.)")
        out[name] = v
    if "head.pred_cls.0.weight" not in out:
        raise KeyError("yolo_head.pred_cls.0.weight (absent: not a PP-YOLOE model)")
    return out, int(out["head.pred_cls.0.weight"].shape[0])


FAMILY = ArchFamily(build=build_ppyoloe, sizes=tuple(SIZES), recipe=RECIPE,
                      weight_sources={"paddle": WeightSource(from_paddle, file_format="paddle")})
