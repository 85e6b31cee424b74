"""Record PaddleDetection fixtures for tests/test_convert_paddle.py (so `make test` needs no paddle).

Runs PaddleDetection 2.6's own modules (its source tree, given with --ppdet; only the
model files are imported, not ppdet/__init__) under paddlepaddle, and writes to
tests/fixtures/paddle/, for each model of :data:`MODELS` (PP-YOLOE crn s, m, l and x;
PP-YOLO r50vd_dcn and r18vd; FCOS r50):

- ``<model>_manifest.json``: every key of the full-size model's state dict in Paddle's
  order with its shape (what a released ``.pdparams`` holds), for the key-count checks;
- ``<model>_tiny.npz``: a tiny model's key order and shapes, the seed that fills its
  weights (:func:`fill`, which the test repeats), a fixed input, and Paddle's dense
  outputs on it (boxes, scores) in float32 and float64: every point or anchor before
  NMS, decoded by Paddle's own post-processing with scale factor 1 (input pixels).
  PP-YOLOE's tiny models are width 0.125 at their size's depth (the same blocks per
  stage as the released model); PP-YOLO's and FCOS's are the full model on a small input.

Regenerate (CPU is enough; a few seconds a model), in a venv of its own:

    pip install paddlepaddle==3.3.1 numpy pyyaml six  # ppdet's model files import yaml and six
    pip download --no-deps paddledet==2.6.0 && python -m zipfile -e paddledet-2.6.0-py3-none-any.whl /tmp/ppdet
    # or: git clone --branch v2.6.0 https://github.com/PaddlePaddle/PaddleDetection /tmp/ppdet
    # (the wheel's ppdet/*.py are the tag's, file for file)
    python tools/record_paddle_fixtures.py --ppdet /tmp/ppdet [--only ppyoloe_crn_m,ppyoloe_crn_l]

The manifests and everything but Paddle's outputs re-record bit for bit anywhere. The
outputs re-record bit for bit on the same machine, but depend on the CPU's kernel paths at
rounding level (MKL_ENABLE_INSTRUCTIONS alone changes them): PP-YOLOE s, PP-YOLO and FCOS
were recorded on an earlier machine and re-record here (an AVX-512 Xeon) within 1.5e-6
relative in float32 and 4.5e-15 in float64, far inside the test's bounds; ``--only``
records new models without rewriting those.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "paddle"


def fill(names: list[str], shapes: list[tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Deterministic weights with non-trivial BatchNorm statistics, from names and shapes only
    (the test rebuilds the same arrays without paddle)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in zip(names, shapes):
        if name.endswith("_variance"):
            a = rng.random(shape) + 0.5
        elif name.endswith(("_mean", "bias")):
            a = rng.standard_normal(shape) * 0.1
        elif len(shape) == 1:
            a = rng.random(shape) + 0.5
        elif name.endswith("proj_conv.weight"):
            a = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        out[name] = a.astype(np.float32)
    return out


def import_ppdet(root: Path) -> None:
    """Make ``ppdet.modeling.*`` importable without running ppdet/__init__ (data, engine,
    metrics and their dependencies are not needed to build a model)."""
    pkg = root / "ppdet"
    for name in ("ppdet", "ppdet.modeling", "ppdet.modeling.backbones", "ppdet.modeling.necks",
                 "ppdet.modeling.heads", "ppdet.modeling.assigners", "ppdet.modeling.losses"):
        m = types.ModuleType(name)
        m.__path__ = [str(root / name.replace(".", "/"))]
        if name in ("ppdet.modeling.assigners", "ppdet.modeling.losses"):  # training only
            m.__getattr__ = lambda attr: type(attr, (), {"__init__": lambda self, *a, **k: None})
        sys.modules[name] = m
    assert pkg.is_dir(), f"--ppdet {root}: no ppdet/ folder"


def ppyoloe(width: float, depth: float):
    from ppdet.modeling.backbones.cspresnet import CSPResNet
    from ppdet.modeling.heads.ppyoloe_head import PPYOLOEHead
    from ppdet.modeling.necks.custom_pan import CustomCSPPAN
    import paddle

    class Model(paddle.nn.Layer):  # PaddleDetection's YOLOv3 architecture wrapper: names as released
        def __init__(self):
            super().__init__()
            self.backbone = CSPResNet(layers=[3, 6, 6, 3], channels=[64, 128, 256, 512, 1024], return_idx=[1, 2, 3],
                                      use_large_stem=True, width_mult=width, depth_mult=depth, act="swish")
            chans = [s.channels for s in self.backbone.out_shape]
            self.neck = CustomCSPPAN(in_channels=chans, out_channels=[768, 384, 192], stage_num=1, block_num=3,
                                     act="swish", spp=True, width_mult=width, depth_mult=depth)
            self.yolo_head = PPYOLOEHead(in_channels=[s.channels for s in self.neck.out_shape], num_classes=80,
                                         fpn_strides=[32, 16, 8], grid_cell_scale=5.0, grid_cell_offset=0.5,
                                         static_assigner_epoch=100, use_varifocal_loss=True,
                                         exclude_post_process=True, nms=None)

        def forward(self, x):
            outs = self.yolo_head(self.neck(self.backbone({"image": x})))
            dense, _, _ = self.yolo_head.post_process(outs, None)
            return dense[..., :4], dense[..., 4:]  # [B, A, 4] xyxy px, [B, A, 80]

    return Model()


COCO_ANCHORS = [[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]
# configs/ppyolo/_base_/ppyolo_r50vd_dcn.yml and ppyolo_r18vd.yml (backbone, neck, head, YOLOBox)
PPYOLO = {
    "r50vd_dcn": dict(depth=50, return_idx=[1, 2, 3], dcn=[3], coord_conv=True, spp=True, iou_aware=True,
                      anchors=COCO_ANCHORS, masks=[[6, 7, 8], [3, 4, 5], [0, 1, 2]], conf=0.01, blocks=2),
    "r18vd": dict(depth=18, return_idx=[2, 3], dcn=[-1], coord_conv=False, spp=False, iou_aware=False,
                  anchors=[[10, 14], [23, 27], [37, 58], [81, 82], [135, 169], [344, 319]],
                  masks=[[3, 4, 5], [0, 1, 2]], conf=0.01, blocks=0),
}


def ppyolo(size: str):
    from ppdet.modeling.backbones.resnet import ResNet
    from ppdet.modeling.heads.yolo_head import YOLOv3Head
    from ppdet.modeling.layers import YOLOBox
    from ppdet.modeling.necks.yolo_fpn import PPYOLOFPN
    import paddle

    c = PPYOLO[size]

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.backbone = ResNet(depth=c["depth"], variant="d", return_idx=c["return_idx"], dcn_v2_stages=c["dcn"],
                                   freeze_at=-1, freeze_norm=False, norm_decay=0.0)
            self.neck = PPYOLOFPN(in_channels=[s.channels for s in self.backbone.out_shape], coord_conv=c["coord_conv"],
                                  drop_block=True, block_size=3, keep_prob=0.9, spp=c["spp"],
                                  conv_block_num=c["blocks"])
            self.yolo_head = YOLOv3Head(in_channels=[s.channels for s in self.neck.out_shape], anchors=c["anchors"],
                                        anchor_masks=c["masks"], loss="YOLOv3Loss", iou_aware=c["iou_aware"],
                                        iou_aware_factor=0.4)
            self.box = YOLOBox(num_classes=80, conf_thresh=c["conf"], downsample_ratio=32, clip_bbox=True,
                               scale_x_y=1.05)

        def forward(self, x):
            outs = self.yolo_head(self.neck(self.backbone({"image": x})))
            n = x.shape[0]
            hw = paddle.to_tensor([list(x.shape[-2:])] * n, dtype=x.dtype)
            boxes, scores = self.box(outs, self.yolo_head.mask_anchors, hw, paddle.ones([n, 2], dtype=x.dtype))
            return boxes, scores.transpose([0, 2, 1])  # [B, A, 4] xyxy px, [B, A, 80]

    return Model()


def fcos_r50():
    """FCOSHead.post_process decodes (points at (j + 0.5) * stride, ltrb = relu(scale * reg) *
    stride, score sigmoid(cls) * sigmoid(centerness)) and clips nothing; :func:`dense` stands
    in for its MultiClassNMS."""
    from ppdet.modeling.backbones.resnet import ResNet
    from ppdet.modeling.heads.fcos_head import FCOSFeat, FCOSHead
    from ppdet.modeling.necks.fpn import FPN
    import paddle

    class Model(paddle.nn.Layer):  # configs/fcos/_base_/fcos_r50_fpn.yml
        def __init__(self):
            super().__init__()
            self.backbone = ResNet(depth=50, variant="b", norm_type="bn", freeze_at=0, return_idx=[1, 2, 3],
                                   num_stages=4)
            self.neck = FPN(in_channels=[s.channels for s in self.backbone.out_shape], out_channel=256,
                            spatial_scales=[0.125, 0.0625, 0.03125], has_extra_convs=True, extra_stage=2,
                            use_c5=False, relu_before_extra_convs=True)
            self.fcos_head = FCOSHead(fcos_feat=FCOSFeat(feat_in=256, feat_out=256, num_convs=4, norm_type="gn",
                                                         use_dcn=False),
                                      num_classes=80, fpn_stride=[8, 16, 32, 64, 128], prior_prob=0.01,
                                      norm_reg_targets=True, centerness_on_reg=True, num_shift=0.5,
                                      fcos_loss=None, nms=dense)

        def forward(self, x):
            outs = self.fcos_head(self.neck(self.backbone({"image": x})))
            boxes, scores = self.fcos_head.post_process(outs, paddle.ones([x.shape[0], 2], dtype=x.dtype))
            return boxes, scores.transpose([0, 2, 1])  # [B, A, 4] xyxy px, [B, A, 80]

    return Model()


def dense(boxes, scores):
    """In MultiClassNMS's place: FCOSHead.post_process's decoded boxes and scores, unfiltered."""
    return boxes, scores, None


def record(name: str, build, full: tuple, tiny: tuple, seed: int, hw=(64, 96)) -> None:
    """``build(*full)``: the released model (its key manifest); ``build(*tiny)``: the one whose
    outputs are recorded (a narrower PP-YOLOE; PP-YOLO and FCOS at full width on a small
    input, where FCOS's 64 x 96 still gives P7 a point: A = 96 + 24 + 6 + 2 + 1)."""
    import paddle

    model = build(*full)
    sd = model.state_dict()
    manifest = [[k, list(v.shape)] for k, v in sd.items()]
    (OUT / f"{name}_manifest.json").write_text(json.dumps(manifest, indent=0))
    model = build(*tiny)
    model.eval()
    sd = model.state_dict()
    names, shapes = list(sd), [tuple(v.shape) for v in sd.values()]
    weights = fill(names, shapes, seed)
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})
    x = np.random.default_rng(seed + 1).random((1, 3) + hw).astype(np.float32)
    with paddle.no_grad():
        b32, s32 = (t.numpy() for t in model(paddle.to_tensor(x)))
    model64 = build(*tiny)
    model64.eval()
    model64.to(dtype="float64")
    model64.set_state_dict({k: paddle.to_tensor(v.astype(np.float64)) for k, v in weights.items()})
    with paddle.no_grad():
        b64, s64 = (t.numpy() for t in model64(paddle.to_tensor(x.astype(np.float64))))
    np.savez_compressed(OUT / f"{name}_tiny.npz", names=np.array(names), shapes=np.array(json.dumps(shapes)),
                        seed=seed, options=np.array(json.dumps(tiny)), x=x, boxes32=b32, scores32=s32, boxes64=b64,
                        scores64=s64)
    print(f"{name}: {len(manifest)} keys (full size), tiny outputs {b32.shape} {s32.shape}")


# name: (builder, its full-size arguments, the recorded tiny model's, fill seed, input h x w).
# PP-YOLOE crn s/m/l/x: (width_mult, depth_mult) of configs/ppyoloe/ppyoloe_crn_{s,m,l,x}_300e_coco.yml;
# each tiny model at width 0.125 keeps its size's depth, so every size's block counts (the
# backbone's [1, 2, 2, 1] / [2, 4, 4, 2] / [3, 6, 6, 3] / [4, 8, 8, 4] blocks per stage at s/m/l/x, the
# neck's 1 / 2 / 3 / 4 per stage with the SPP among the first FPN stage's) run.
MODELS = {
    "ppyoloe_crn_s": (ppyoloe, (0.50, 0.33), (0.125, 0.33), 25, (64, 96)),
    "ppyoloe_crn_m": (ppyoloe, (0.75, 0.67), (0.125, 0.67), 28, (64, 96)),
    "ppyoloe_crn_l": (ppyoloe, (1.0, 1.0), (0.125, 1.0), 29, (64, 96)),
    "ppyoloe_crn_x": (ppyoloe, (1.25, 1.33), (0.125, 1.33), 30, (64, 96)),
    **{f"ppyolo_{size}": (ppyolo, (size,), (size,), 26, (64, 64)) for size in PPYOLO},
    "fcos_r50": (fcos_r50, (), (), 27, (64, 96)),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ppdet", required=True, type=Path, help="a PaddleDetection v2.6 source tree")
    ap.add_argument("--only", default=",".join(MODELS),
                    help="comma-separated models to record (default: all): " + ", ".join(MODELS))
    args = ap.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in only if n not in MODELS]
    if unknown or not only:
        ap.error(f"--only {args.only!r}: {'no model named' if not unknown else f'no model {unknown[0]!r}'}; "
                 f"known: {', '.join(MODELS)}")
    import_ppdet(args.ppdet)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in only:
        build, full, tiny, seed, hw = MODELS[name]
        record(name, build, full=full, tiny=tiny, seed=seed, hw=hw)


if __name__ == "__main__":
    main()
