"""Record PaddleDetection's training losses for tests/test_authors_losses.py (so `make test`
needs no paddle; Megvii's YOLOX is compared live there).

Runs PaddleDetection 2.6's own model, loss, assigner and target-builder files (its source
tree, given with --ppdet; ppdet/__init__ and the package __init__ files are not run) under
paddlepaddle, in train mode (BatchNorm on batch statistics), on a small fixed batch, and
writes ``tests/fixtures/paddle/loss_<case>.npz`` holding:

- the model's key order and shapes and the seed that fills its weights
  (``record_paddle_fixtures.fill``, which the test repeats), and the case's options;
- the batch: images (stored as uint8, used as ``u8 / 255``), ground-truth boxes (xyxy px),
  classes, and per case its extras (mixup scores);
- each loss component the authors' code returns, and the gradients of a few parameters
  from head to stem (``grad/<paddle name>``; for a large parameter its leading block
  ``grad[:n0, :n1, ...]``, of the parameter's rank), in float64 where the authors' code
  runs in float64.

Cases (all float64):

- ``fcos_r50``: FCOS r50 with centre sampling (``Gt2FCOSTarget``, ``FCOSLoss``; its one-hot
  labels cast to float64 for paddle's focal loss);
- ``ppyoloe``: PP-YOLOE-s at width 0.125, ``PPYOLOEHead.get_loss`` in both assigner phases
  (``loss_ppyoloe_atss``, ``loss_ppyoloe_tal``);
- ``ppyolo_r18vd`` and ``ppyolo_r50vd_dcn``: PP-YOLO's two configs (r50vd_dcn at full width:
  ResNet50-vd with DCNv2 in res5, CoordConv, SPP, the IoU-aware branch with
  ``IouAwareLoss``), ``YOLOv3Loss`` + ``IouLoss`` on ``Gt2YoloTarget``'s targets with mixup
  scores and DropBlock at keep_prob 1.

Regenerate (CPU is enough):

    pip install paddlepaddle==3.3.1 'numpy<2' pyyaml six scipy opencv-python-headless Pillow typeguard
    # numpy < 2: Gt2FCOSTarget calls np.reshape(..., newshape=...)
    git clone --branch v2.6.0 https://github.com/PaddlePaddle/PaddleDetection /tmp/PaddleDetection
    python tools/record_loss_fixtures.py --ppdet /tmp/PaddleDetection [--only ppyolo_r50vd_dcn ...]

Each case is reproducible bit for bit (paddlepaddle 3.3.1 on the CPU, numpy 1.26).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_paddle_fixtures import fill  # noqa: E402  (the weights the test rebuilds)

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "paddle"
DTYPE = "float64"


def import_ppdet_training(root: Path) -> None:
    """Make PaddleDetection's model, loss, assigner and batch-target files importable without
    the package __init__ files (which import every model and data source): the packages
    are empty shells over their folders, and the names the heads import from
    ``ppdet.modeling.losses`` / ``assigners`` are set from the few files needed."""
    assert (root / "ppdet").is_dir(), f"--ppdet {root}: no ppdet/ folder"
    for name in ("ppdet", "ppdet.modeling", "ppdet.modeling.backbones", "ppdet.modeling.necks",
                 "ppdet.modeling.heads", "ppdet.modeling.assigners", "ppdet.modeling.losses", "ppdet.data",
                 "ppdet.data.transform"):
        m = types.ModuleType(name)
        m.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = m
    reader = types.ModuleType("ppdet.data.reader")  # operators.py imports its Compose; unused here
    reader.Compose = object
    sys.modules["ppdet.data.reader"] = reader
    for package, files in (("losses", ("iou_loss", "fcos_loss", "yolo_loss", "iou_aware_loss")),
                           ("assigners", ("utils", "atss_assigner", "task_aligned_assigner"))):
        shell = sys.modules[f"ppdet.modeling.{package}"]
        for file in files:
            mod = importlib.import_module(f"ppdet.modeling.{package}.{file}")
            for k in getattr(mod, "__all__", []):
                setattr(shell, k, getattr(mod, k))


def images(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 images; the models see ``u8 / 255`` (float64 exactly representable in float32)."""
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def run(model, dtype: str, weights: dict, x: np.ndarray, loss_fn, grad_names: list[str],
        blocks: dict[str, tuple[int, ...]] | None = None):
    """Fill ``model`` with ``weights`` in ``dtype``, train mode; ``loss_fn(model, x)`` -> dict of
    loss tensors (with a ``total`` key that is backpropagated) -> ({name: value}, {grad name: array}).
    ``blocks``: for a large parameter, the leading block of its gradient to keep
    (``grad[:n0, :n1, ...]``), which keeps the fixture small."""
    import paddle

    model.to(dtype=dtype)
    model.set_state_dict({k: paddle.to_tensor(v.astype(dtype)) for k, v in weights.items()})
    model.train()
    losses = loss_fn(model, paddle.to_tensor((x / 255.0).astype(dtype)))
    losses["total"].backward()
    params = dict(model.named_parameters())
    grads = {k: params[k].grad.numpy().astype(np.float64) for k in grad_names}
    for k, block in (blocks or {}).items():
        grads[k] = grads[k][tuple(slice(0, n) for n in block)]
    return {k: float(v) for k, v in losses.items()}, grads


def save(name: str, model, seed: int, options: dict, batch: dict, losses: dict, grads: dict, dtype: str) -> None:
    sd = model.state_dict()
    out = dict(names=np.array(list(sd)), shapes=np.array(json.dumps([list(v.shape) for v in sd.values()])),
               seed=seed, options=np.array(json.dumps(options)), dtype=np.array(dtype), **batch)
    out.update({f"loss/{k}": np.float64(v) for k, v in losses.items()})
    out.update({f"grad/{k}": v.astype(np.float64 if dtype == "float64" else np.float32) for k, v in grads.items()})
    path = OUT / f"loss_{name}.npz"
    np.savez_compressed(path, **out)
    print(f"{name} ({dtype}): {', '.join(f'{k} {v:.6g}' for k, v in losses.items())}; "
          f"{len(grads)} gradients; {path.stat().st_size / 1024:.0f} KB")


@contextlib.contextmanager
def float64_focal_labels():
    """FCOSLoss builds its one-hot labels in float32 (``F.one_hot``), which paddle's
    ``sigmoid_focal_loss`` refuses beside float64 logits: cast them to the logits' dtype (a
    dtype shim, the same values) for the float64 run."""
    import paddle.nn.functional as F
    from ppdet.modeling.losses import fcos_loss

    focal = F.sigmoid_focal_loss
    shim = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("_")})
    shim.sigmoid_focal_loss = lambda logit, label, *a, **k: focal(logit, label.astype(logit.dtype), *a, **k)
    fcos_loss.F = shim
    try:
        yield
    finally:
        fcos_loss.F = F


# --------------------------------------------------------------------------- FCOS

# A 96 x 128 batch with size boundaries [24, 32, 40, 48] (PaddleDetection's [64, 128, 256,
# 512] do not fit a small image), whose boxes give positives on every level (P3 .. P7:
# 12 x 16, 6 x 8, 3 x 4, 2 x 2, 1 x 1 points): 11, 1, 2, 1, 1 in the first image, 1, 2,
# 3, 1, 1 in the second. P3's range reaches 3 strides, so that centre sampling decides
# there: radius 1.0 instead of 1.5 leaves 3 of its 11 positives. The second image's last
# slot is padding (class -1).
FCOS = dict(hw=[96, 128], num_classes=4, boundaries=[24, 32, 40, 48], radius=1.5,
            boxes=[[[2, 2, 126, 94], [35, 39, 43, 59], [76, 2, 124, 52], [43, 9, 119, 60], [10, 20, 75, 35],
                    [8, 8, 32, 32]],
                   [[0, 0, 128, 96], [15, 6, 23, 51], [48, 30, 92, 78], [43, 43, 100, 86], [20, 18, 47, 78],
                    [0, 0, 0, 0]]],
            classes=[[0, 1, 2, 3, 0, 1], [2, 0, 1, 3, 2, -1]])
FCOS_GRADS = ["fcos_head.fcos_head_reg.bias", "fcos_head.fcos_head_cls.bias",
              "fcos_head.fcos_head_centerness.bias"] + [f"fcos_head.p{i}_feat.scale_reg" for i in range(3, 8)] + [
              "fcos_head.fcos_feat.fcos_head_reg_tower_conv_0.norm.weight",
              "fcos_head.fcos_feat.fcos_head_cls_tower_conv_0.conv.bias",
              "neck.fpn_inner_res5_sum.bias", "neck.fpn_6.bias",
              "backbone.res5.res5c.branch2c.norm.weight", "backbone.conv1.conv1.norm.weight"]


def fcos_model():
    """configs/fcos/_base_/fcos_r50_fpn.yml with a 4-class head and a trainable backbone
    (freeze_at -1, BatchNorm not frozen: fastdet's ``from_scratch`` form)."""
    from ppdet.modeling.backbones.resnet import ResNet
    from ppdet.modeling.heads.fcos_head import FCOSFeat, FCOSHead
    from ppdet.modeling.losses.fcos_loss import FCOSLoss
    from ppdet.modeling.necks.fpn import FPN
    import paddle

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.backbone = ResNet(depth=50, variant="b", norm_type="bn", freeze_at=-1, freeze_norm=False,
                                   return_idx=[1, 2, 3], num_stages=4)
            self.neck = FPN(in_channels=[s.channels for s in self.backbone.out_shape], out_channel=256,
                            spatial_scales=[0.125, 0.0625, 0.03125], has_extra_convs=True, extra_stage=2,
                            use_c5=False, relu_before_extra_convs=True)
            self.fcos_head = FCOSHead(
                fcos_feat=FCOSFeat(feat_in=256, feat_out=256, num_convs=4, norm_type="gn", use_dcn=False),
                num_classes=FCOS["num_classes"], fpn_stride=[8, 16, 32, 64, 128], prior_prob=0.01,
                norm_reg_targets=True, centerness_on_reg=True, num_shift=0.5,
                fcos_loss=FCOSLoss(loss_alpha=0.25, loss_gamma=2.0, iou_loss_type="giou", reg_weights=1.0), nms=None)

        def forward(self, x, targets):
            return self.fcos_head(self.neck(self.backbone({"image": x})), targets)

    return Model()


def record_fcos(seed: int = 46) -> None:
    """FCOSHead's training forward (loss_cls, loss_box, loss_quality, loss) on targets from
    ``Gt2FCOSTarget`` (the TrainReader's batch transform) with centre sampling. Seed 46: its
    weights leave a positive distance (past the ReLU) at some positive of every level, so
    each per-level scale gets a gradient (seeds 41-45 leave one or two levels at zero)."""
    from ppdet.data.transform.batch_operators import Gt2FCOSTarget
    import paddle

    h, w = FCOS["hw"]
    x = images(seed + 1, (2, 3, h, w))
    boxes, classes = np.array(FCOS["boxes"]), np.array(FCOS["classes"])
    target = Gt2FCOSTarget(object_sizes_boundary=FCOS["boundaries"], center_sampling_radius=FCOS["radius"],
                           downsample_ratios=[8, 16, 32, 64, 128], norm_reg_targets=True)

    def loss_fn(model, xt):
        samples = [{"image": np.zeros((3, h, w), np.float32), "gt_bbox": boxes[i][classes[i] >= 0].astype(np.float32),
                    "gt_class": classes[i][classes[i] >= 0, None].astype(np.int32)} for i in range(2)]
        samples = target(samples)
        dtype = str(xt.numpy().dtype)  # reg_target / centerness in the model's dtype, labels int32
        targets = {k: paddle.to_tensor(np.stack([s[k] for s in samples]).astype(
            np.int32 if k.startswith("labels") else dtype)) for k in samples[0] if k != "image"}
        out = model(xt, targets)
        return {"loss_cls": out["loss_cls"], "loss_box": out["loss_box"], "loss_quality": out["loss_quality"],
                "total": out["loss"]}

    model = fcos_model()
    sd = model.state_dict()
    weights = fill(list(sd), [tuple(v.shape) for v in sd.values()], seed)
    with float64_focal_labels():
        losses, grads = run(model, "float64", weights, x, loss_fn, FCOS_GRADS)
    save("fcos_r50", model, seed, FCOS, {"x": x}, losses, grads, "float64")


# --------------------------------------------------------------------------- PP-YOLOE

# PP-YOLOE-s at width 0.125 (tiny channels, s depth) with a 4-class head on a 2 x 96 x 128
# batch (strides 32, 16, 8: 3 x 4, 6 x 8, 12 x 16 anchors; ATSS takes 9 per level, so the
# coarsest needs 9); the second image's last slot is padding, as PadGT leaves it (zeros,
# pad_gt_mask 0). Box corners off the integer grid: ATSS ranks anchors by centre distance,
# and a box centred on a grid line ties two anchors, which paddle.topk and torch.topk break
# alike (by their partial-sort order) and fastdet's C++ kernel by the lower index.
PPYOLOE = dict(hw=[96, 128], num_classes=4, width=0.125, depth=0.33,
               boxes=[[[8.3, 10.6, 60.2, 70.9], [50.7, 20.2, 120.4, 90.1], [20.1, 60.4, 44.8, 86.3],
                       [90.6, 4.2, 110.3, 30.7], [2.5, 3.1, 125.7, 93.4]],
                      [[4.4, 4.9, 100.2, 80.6], [64.2, 40.3, 96.9, 72.4], [10.8, 50.1, 30.5, 70.2],
                       [1.2, 0.7, 127.1, 95.8], [0, 0, 0, 0]]],
               classes=[[0, 3, 1, 2, 3], [2, 0, 1, 3, -1]])
PPYOLOE_GRADS = ["yolo_head.pred_cls.0.bias", "yolo_head.pred_cls.2.bias",
                 "yolo_head.pred_reg.1.bias", "yolo_head.pred_reg.2.bias",
                 "yolo_head.stem_cls.2.fc.bias", "yolo_head.stem_reg.2.conv.bn.weight",
                 "neck.fpn_stages.0.0.convs.0.conv1.bn.weight", "backbone.stages.3.conv3.bn.weight",
                 "backbone.stem.conv1.bn.weight", "backbone.stem.conv1.conv.weight"]


def ppyoloe_model():
    """configs/ppyoloe/_base_/ppyoloe_crn.yml (ATSSAssigner topk 9, TaskAlignedAssigner topk
    13, alpha 1, beta 6; static_assigner_epoch 100 of the 300e config) at PPYOLOE's width."""
    from ppdet.modeling.assigners.atss_assigner import ATSSAssigner
    from ppdet.modeling.assigners.task_aligned_assigner import TaskAlignedAssigner
    from ppdet.modeling.backbones.cspresnet import CSPResNet
    from ppdet.modeling.heads.ppyoloe_head import PPYOLOEHead
    from ppdet.modeling.necks.custom_pan import CustomCSPPAN
    import paddle

    w, d, C = PPYOLOE["width"], PPYOLOE["depth"], PPYOLOE["num_classes"]

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.backbone = CSPResNet(layers=[3, 6, 6, 3], channels=[64, 128, 256, 512, 1024], return_idx=[1, 2, 3],
                                      use_large_stem=True, width_mult=w, depth_mult=d, act="swish")
            self.neck = CustomCSPPAN(in_channels=[s.channels for s in self.backbone.out_shape],
                                     out_channels=[768, 384, 192], stage_num=1, block_num=3, act="swish", spp=True,
                                     width_mult=w, depth_mult=d)
            self.yolo_head = PPYOLOEHead(in_channels=[s.channels for s in self.neck.out_shape], num_classes=C,
                                         fpn_strides=[32, 16, 8], grid_cell_scale=5.0, grid_cell_offset=0.5,
                                         static_assigner_epoch=100, use_varifocal_loss=True,
                                         loss_weight={"class": 1.0, "iou": 2.5, "dfl": 0.5},
                                         static_assigner=ATSSAssigner(topk=9, num_classes=C),
                                         assigner=TaskAlignedAssigner(topk=13, alpha=1.0, beta=6.0), nms=None)

        def forward(self, x, targets):
            return self.yolo_head(self.neck(self.backbone({"image": x})), targets)

    return Model()


def record_ppyoloe(seed: int = 51) -> None:
    """PPYOLOEHead.get_loss (loss, loss_cls, loss_iou, loss_dfl) in both assigner phases:
    ``epoch_id`` 0 (ATSS, before static_assigner_epoch) and 100 (task-aligned), on PadGT's
    padded ground truth (gt_class [B, M, 1], gt_bbox [B, M, 4] px, pad_gt_mask [B, M, 1])."""
    import paddle

    h, w = PPYOLOE["hw"]
    x = images(seed + 1, (2, 3, h, w))
    boxes, classes = np.array(PPYOLOE["boxes"], np.float64), np.array(PPYOLOE["classes"])
    for phase, epoch in (("atss", 0), ("tal", 100)):
        def loss_fn(model, xt):
            dtype = str(xt.numpy().dtype)
            targets = {"gt_class": paddle.to_tensor(np.maximum(classes, 0)[..., None].astype(np.int64)),
                       "gt_bbox": paddle.to_tensor(boxes.astype(dtype)),
                       "pad_gt_mask": paddle.to_tensor((classes >= 0)[..., None].astype(dtype)), "epoch_id": epoch}
            out = model(xt, targets)
            return {"loss_cls": out["loss_cls"], "loss_iou": out["loss_iou"], "loss_dfl": out["loss_dfl"],
                    "total": out["loss"]}

        model = ppyoloe_model()
        sd = model.state_dict()
        weights = fill(list(sd), [tuple(v.shape) for v in sd.values()], seed)
        losses, grads = run(model, DTYPE, weights, x, loss_fn, PPYOLOE_GRADS)
        save(f"ppyoloe_{phase}", model, seed, PPYOLOE, {"x": x}, losses, grads, DTYPE)


# --------------------------------------------------------------------------- PP-YOLO

# PP-YOLO r18vd (configs/ppyolo/_base_/ppyolo_r18vd.yml) with a 4-class head on a 2 x 96 x 128
# batch (strides 32, 16: 3 x 4 and 6 x 8 cells); mixup weights (gt_score) below 1 on some
# boxes; the second image's last slot is padding (PadBox: zeros). DropBlock stays in the
# model at keep_prob 1, where Paddle's (and fastdet's) pass the input through: the train-mode
# draw is the only random step, and it has no weights.
PPYOLO = dict(hw=[96, 128], num_classes=4, size="r18vd",
              boxes=[[[6.3, 8.7, 70.2, 80.9], [60.4, 20.1, 110.6, 60.3], [20.2, 50.8, 36.7, 66.1],
                      [84.9, 5.3, 122.1, 90.6]],
                     [[3.6, 2.2, 124.8, 93.3], [70.1, 40.7, 93.2, 70.4], [10.6, 60.2, 30.3, 74.9], [0, 0, 0, 0]]],
              classes=[[0, 3, 1, 2], [2, 0, 1, -1]],
              scores=[[1.0, 0.7, 0.7, 1.0], [0.4, 0.6, 0.6, 0.0]])
PPYOLO_GRADS = ["yolo_head.yolo_output.0.bias", "yolo_head.yolo_output.1.bias",
                "neck.yolo_block.0.tip.batch_norm.weight", "neck.yolo_block.1.conv_module.route.batch_norm.weight",
                "backbone.res5.res5a.branch2b.norm.weight",
                "backbone.conv1.conv1_1.norm.weight", "backbone.conv1.conv1_1.conv.weight"]


# PP-YOLO r50vd_dcn (configs/ppyolo/ppyolo_r50vd_dcn_1x_coco.yml: its _base_/ppyolo_r50vd_dcn.yml
# model, the same in the 2x config) on the same batch: strides 32, 16, 8 (3 x 4, 6 x 8, 12 x 16
# cells) with the COCO anchors, by which Gt2YoloTarget spreads the 7 boxes over all levels (s32: the
# whole-image box, score 0.4; s16: three boxes; s8: three). Full width (47 M weights, filled
# from the seed, not stored); DCNv2 in res5 (res5a's 3x3 at stride 2, res5b/c at 1), whose
# offset/mask convs the seeded fill makes non-zero, so that the sampling is off the grid.
# Paddle's deformable conv runs in float64 on the CPU.
PPYOLO_R50 = dict(PPYOLO, size="r50vd_dcn")
PPYOLO_R50_GRADS = ["yolo_head.yolo_output.0.bias", "yolo_head.yolo_output.1.bias", "yolo_head.yolo_output.2.bias",
                    "neck.yolo_block.2.tip.conv.batch_norm.weight",
                    "neck.yolo_block.0.conv_module.spp.conv.batch_norm.weight",
                    "backbone.res5.res5c.branch2b.conv_offset.bias",
                    "backbone.res5.res5a.branch2b.conv_offset.weight", "backbone.res5.res5a.branch2b.conv_offset.bias",
                    "backbone.res5.res5a.branch2b.conv.weight", "backbone.res5.res5a.branch2b.norm.weight",
                    "backbone.conv1.conv1_1.norm.weight", "backbone.conv1.conv1_1.conv.weight"]
# Leading blocks of the DCN's large gradients: every offset and mask row of its offset conv
# for 16 input channels; 4 output channels x 64 input channels of the deformable conv.
PPYOLO_R50_BLOCKS = {"backbone.res5.res5a.branch2b.conv_offset.weight": (27, 16, 3, 3),
                     "backbone.res5.res5a.branch2b.conv.weight": (4, 64, 3, 3)}

# The two configs' model sections (configs/ppyolo/_base_/ppyolo_r18vd.yml, ppyolo_r50vd_dcn.yml).
PPYOLO_MODELS = {
    "r18vd": dict(depth=18, return_idx=[2, 3], dcn=[-1], coord_conv=False, spp=False, conv_block_num=0,
                  iou_aware=False, anchors=[[10, 14], [23, 27], [37, 58], [81, 82], [135, 169], [344, 319]],
                  masks=[[3, 4, 5], [0, 1, 2]], downsample=[32, 16]),
    "r50vd_dcn": dict(depth=50, return_idx=[1, 2, 3], dcn=[3], coord_conv=True, spp=True, conv_block_num=2,
                      iou_aware=True, anchors=[[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119],
                                               [116, 90], [156, 198], [373, 326]],
                      masks=[[6, 7, 8], [3, 4, 5], [0, 1, 2]], downsample=[32, 16, 8]),
}


def ppyolo_model(size: str):
    """The config's ResNet (vd, nothing frozen), PPYOLOFPN (DropBlock at keep_prob 1),
    YOLOv3Head and YOLOv3Loss (ignore_thresh 0.7, no label smoothing, scale_x_y 1.05,
    IouLoss 2.5 squared; r50vd_dcn: the IoU-aware branch, factor 0.4, IouAwareLoss 1.0)."""
    from ppdet.modeling.backbones.resnet import ResNet
    from ppdet.modeling.heads.yolo_head import YOLOv3Head
    from ppdet.modeling.losses.iou_aware_loss import IouAwareLoss
    from ppdet.modeling.losses.iou_loss import IouLoss
    from ppdet.modeling.losses.yolo_loss import YOLOv3Loss
    from ppdet.modeling.necks.yolo_fpn import PPYOLOFPN
    import paddle

    c, C = PPYOLO_MODELS[size], PPYOLO["num_classes"]

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.backbone = ResNet(depth=c["depth"], variant="d", return_idx=c["return_idx"], dcn_v2_stages=c["dcn"],
                                   freeze_at=-1, freeze_norm=False, norm_decay=0.0)
            self.neck = PPYOLOFPN(in_channels=[s.channels for s in self.backbone.out_shape], coord_conv=c["coord_conv"],
                                  drop_block=True, block_size=3, keep_prob=1.0, spp=c["spp"],
                                  conv_block_num=c["conv_block_num"])
            loss = YOLOv3Loss(num_classes=C, ignore_thresh=0.7, label_smooth=False, downsample=c["downsample"],
                              scale_x_y=1.05, iou_loss=IouLoss(loss_weight=2.5, loss_square=True),
                              iou_aware_loss=IouAwareLoss(loss_weight=1.0) if c["iou_aware"] else None)
            self.yolo_head = YOLOv3Head(in_channels=[s.channels for s in self.neck.out_shape], anchors=c["anchors"],
                                        anchor_masks=c["masks"], num_classes=C, loss=loss, iou_aware=c["iou_aware"],
                                        iou_aware_factor=0.4)

        def forward(self, x, targets):
            return self.yolo_head(self.neck(self.backbone({"image": x})), targets)

    return Model()


def record_ppyolo(case: dict, grad_names: list[str], blocks: dict | None = None, seed: int = 61) -> None:
    """YOLOv3Head's training forward (YOLOv3Loss with IouLoss: loss_xy, loss_wh, loss_iou,
    (loss_iou_aware,) loss_obj, loss_cls) on ``Gt2YoloTarget``'s grid targets, built as the
    TrainReader's batch transforms leave the boxes (NormalizeBox, PadBox, BboxXYXY2XYWH:
    normalised cx, cy, w, h) with per-box gt_score."""
    from ppdet.data.transform.batch_operators import Gt2YoloTarget
    import paddle

    c = PPYOLO_MODELS[case["size"]]
    h, w = case["hw"]
    x = images(seed + 1, (2, 3, h, w))
    boxes = np.array(case["boxes"], np.float64)
    classes, scores = np.array(case["classes"]), np.array(case["scores"], np.float64)
    norm = boxes / np.array([w, h, w, h])
    cxcywh = np.concatenate([(norm[..., :2] + norm[..., 2:]) / 2, norm[..., 2:] - norm[..., :2]], -1)
    target = Gt2YoloTarget(anchors=c["anchors"], anchor_masks=c["masks"], downsample_ratios=c["downsample"],
                           num_classes=case["num_classes"])
    levels = [f"target{i}" for i in range(len(c["masks"]))]

    def loss_fn(model, xt):
        dtype = str(xt.numpy().dtype)
        samples = [{"image": np.zeros((3, h, w), np.float32), "gt_bbox": cxcywh[i].astype(np.float32),
                    "gt_class": np.maximum(classes[i], 0).astype(np.int32),
                    "gt_score": scores[i][:, None].astype(np.float32)} for i in range(2)]
        samples = target(samples)
        print("positives per level:", [int((np.stack([s[k] for s in samples])[:, :, 5] > 0).sum()) for k in levels])
        targets = {k: paddle.to_tensor(np.stack([s[k] for s in samples]).astype(dtype)) for k in levels + ["gt_bbox"]}
        out = model(xt, targets)
        names = ("loss_xy", "loss_wh", "loss_iou") + (("loss_iou_aware",) if c["iou_aware"] else ()) + (
            "loss_obj", "loss_cls")
        return {**{k: out[k] for k in names}, "total": out["loss"]}

    model = ppyolo_model(case["size"])
    sd = model.state_dict()
    weights = fill(list(sd), [tuple(v.shape) for v in sd.values()], seed)
    losses, grads = run(model, DTYPE, weights, x, loss_fn, grad_names, blocks)
    save(f"ppyolo_{case['size']}", model, seed, case, {"x": x}, losses, grads, DTYPE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ppdet", required=True, type=Path, help="a PaddleDetection v2.6 source tree")
    ap.add_argument("--only", nargs="*", default=None, help="cases to record (default: all)")
    args = ap.parse_args()
    import_ppdet_training(args.ppdet)
    OUT.mkdir(parents=True, exist_ok=True)
    cases = {"fcos_r50": record_fcos, "ppyoloe": record_ppyoloe,
             "ppyolo_r18vd": lambda: record_ppyolo(PPYOLO, PPYOLO_GRADS),
             "ppyolo_r50vd_dcn": lambda: record_ppyolo(PPYOLO_R50, PPYOLO_R50_GRADS, PPYOLO_R50_BLOCKS)}
    for name, record in cases.items():
        if args.only is None or name in args.only:
            record()


if __name__ == "__main__":
    main()
