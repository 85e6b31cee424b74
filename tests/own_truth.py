"""Ground truth made of a checkpoint's own detections, so that an evaluation of a model
trained a few steps (or of random weights) has an AP far from 0 to compare.

Such a model scores AP 0 on the demo's boxes, and two evaluations that both print 0 agree
whatever weights, preprocessing or class map either used. The model's own best boxes (at
the evaluation's input size and post-processing) score high with its weights and low with
other weights, so an evaluation that loads other weights, or these wrongly, disagrees.
The method of tests/test_class_names.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from PIL import Image

PER_IMAGE = 3  # ground-truth boxes per image: the model's best detections


def own_detections(ckpt: str | Path, images: list[Path], img_size: int, *, ema: bool = True,
                   per_image: int = PER_IMAGE) -> list[list[tuple[int, float, float, float, float]]]:
    """Per image ``(label, x0, y0, x1, y1)`` of the ``per_image`` best detections of
    ``ckpt``'s EMA (its plain weights with ``ema=False``, or without an EMA) in the image's
    pixels, under the recipe's post-processing (what the evaluation scores)."""
    import fastdet

    det = fastdet.load_detector(ckpt, ema=ema, fuse=False)
    truth = []
    for d in fastdet.detect(det, [Image.open(p).convert("RGB") for p in images], img_size=img_size):
        best = d["scores"].argsort(descending=True)[:per_image].tolist()
        truth.append([(int(d["labels"][k]), *(float(v) for v in d["boxes"][k])) for k in best])
    assert sum(map(len, truth)) >= len(images), f"{ckpt} detects too little to make ground truth of"
    return truth


def rewrite_coco(ann: Path, images_dir: Path, ckpt: str | Path, img_size: int, out: Path, *,
                 cat_ids: list[int], ema: bool = True) -> Path:
    """``ann`` (a COCO json of images in ``images_dir``) written to ``out`` with its boxes
    replaced by ``ckpt``'s own detections (label ``i`` -> category ``cat_ids[i]``); its
    images and categories kept."""
    doc = json.loads(ann.read_text())
    truth = own_detections(ckpt, [images_dir / im["file_name"] for im in doc["images"]], img_size, ema=ema)
    boxes = [(im["id"], box) for im, image_boxes in zip(doc["images"], truth) for box in image_boxes]
    doc["annotations"] = [
        {"id": n + 1, "image_id": image_id, "category_id": int(cat_ids[c]), "bbox": [x0, y0, x1 - x0, y1 - y0],
         "area": (x1 - x0) * (y1 - y0), "iscrowd": 0} for n, (image_id, (c, x0, y0, x1, y1)) in enumerate(boxes)]
    out.write_text(json.dumps(doc))
    return out


def demo_with_own_truth(demo: Path, root: Path, ckpt: str | Path, img_size: int) -> Path:
    """A COCO-layout copy of ``demo`` at ``root`` (images linked, train boxes kept) whose val
    boxes are ``ckpt``'s own EMA detections (its plain weights' without an EMA), each label written as the demo's category of the
    checkpoint's class name (a checkpoint trained on the demo's YOLO or VOC form has ids
    0..3, the demo 1, 3, 7, 12); returns ``root``."""
    from fastdet.runtime.checkpoint import load_checkpoint

    (root / "annotations").mkdir(parents=True)
    for split in ("train", "val"):
        (root / f"{split}2017").symlink_to((demo / f"{split}2017").resolve(), target_is_directory=True)
    shutil.copy(demo / "annotations" / "instances_train2017.json", root / "annotations")
    val_ann = demo / "annotations" / "instances_val2017.json"
    by_name = {c["name"]: c["id"] for c in json.loads(val_ann.read_text())["categories"]}
    cat_ids = [by_name[n] for n in load_checkpoint(ckpt, mmap=True)["class_names"]]
    rewrite_coco(val_ann, demo / "val2017", ckpt, img_size, root / "annotations" / "instances_val2017.json",
                 cat_ids=cat_ids)
    return root


def distinct_predictors_(weights: dict, arch: str, seed: int, num_classes: int | None = None) -> dict:
    """``weights`` (a state dict) with the head's last convolutions drawn so that the boxes
    and classes differ from place to place and image to image, and scores are high (the
    head a few steps from its initialisation puts out the same box, often the whole image,
    everywhere at the score threshold): in place, returned. ``seed``: other seeds, other
    boxes. ``num_classes``: PP-YOLO's (its output rows are per anchor, after ``na`` IoU
    rows when IoU-aware)."""
    g = torch.Generator().manual_seed(seed)

    def randn(t, std):  # std per unit of input: the outputs' std ~ std over inputs of std ~1
        return torch.randn(t.shape, generator=g) * std / (t[0].numel() ** 0.5)

    for name, t in weights.items():
        if arch == "ppyoloe" and name.startswith(("head.pred_cls.", "head.pred_reg.")):
            if name.endswith("weight"):  # logits of std ~2 over the ~1 of a 3x3 conv's inputs
                t.copy_(randn(t, 2.0))
            elif name.startswith("head.pred_cls."):
                t.zero_()
            else:  # DFL bins 0..reg_max per side: distances of ~1-3 strides, not the 8 of equal bins
                t.copy_(-0.7 * torch.arange(t.numel()).remainder(t.numel() // 4))
        elif arch == "yolox" and name.startswith("head.cls_preds."):
            t.copy_(torch.randn(t.shape, generator=g) * 3.0 if t.dim() > 1 else torch.zeros(t.shape))
        elif arch == "yolox" and name.startswith("head.obj_preds.") and name.endswith("bias"):
            t.fill_(4.0)
        elif arch == "fcos" and name.startswith(("head.cls_logits.", "head.bbox_reg.", "head.centerness.")):
            # Inputs: the towers' GroupNorm + ReLU, ~0.4 +- 0.58 per channel. Zero-mean rows:
            # the common 0.4 would otherwise add one offset per class everywhere.
            if name.endswith("weight"):
                w = randn(t, {"cls_logits": 4.0, "bbox_reg": 0.4, "centerness": 3.0}[name.split(".")[1]] / 0.58)
                t.copy_(w - w.mean((1, 2, 3), keepdim=True))
            elif "bbox_reg" in name:  # ltrb ~1.5 x 8 px at every level (head.scales below)
                t.fill_(1.5)
            elif "centerness" in name:  # few points pass the score threshold: sparse detections
                t.fill_(-4.0)
            else:
                t.zero_()
        elif arch == "fcos" and name == "head.scales":  # level i's distances x stride_i: 8 px units
            t.copy_(0.5 ** torch.arange(t.numel(), dtype=t.dtype))
        elif arch == "ppyolo" and name.startswith("head.outputs."):
            if num_classes is None:
                raise ValueError("distinct_predictors_: PP-YOLO needs num_classes")
            per = 5 + num_classes  # x, y, w, h, obj, classes per anchor, after the IoU rows
            iou = t.shape[0] % per  # IoU-aware: na (< per) leading IoU-logit rows, else 0
            na = (t.shape[0] - iou) // per
            role = torch.cat([torch.full((iou,), -1), torch.arange(na * per) % per])  # [R] -1 IoU, 0..per-1
            # Inputs: the neck's, ~4 +- 7 two steps from initialisation (BatchNorm statistics)
            # and image to image, so no threshold on them holds a count: objectness is on at one
            # anchor of the coarsest level only (at 64 px 2 x 2 candidates an image), off elsewhere.
            if name.endswith("weight"):  # offsets, log sizes and classes vary by place and image
                std = torch.tensor([1.5, 1.5, 0.6, 0.6, 0.5] + [3.0] * num_classes)[role.clamp(min=0)]
                w = randn(t, 1.0 / 7.0) * std.view(-1, 1, 1, 1)
                t.copy_(w - w.mean((1, 2, 3), keepdim=True))
            else:  # sizes under the anchors' (81-344 px at the coarsest level, over a small input);
                # objectness off (sigmoid(-20)), IoU logits high
                bias = torch.tensor([0.0, 0.0, -2.0, -2.0, -20.0] + [0.0] * num_classes)[role.clamp(min=0)]
                t.copy_(torch.where(role == -1, 4.0, bias))
                if name.startswith("head.outputs.0."):  # the first anchor's objectness on: ~0.98
                    t[iou + 4] = 4.0
    return weights


def _as_read(ema: dict, average: dict) -> dict:
    """``average`` (raw tensors of the checkpoint's debiased EMA, whose state dict is ``ema``)
    as ``ModelEMA.averaged`` reads them (divided by ``1 - d^n``)."""
    from fastdet.ops.ema import ModelEMA

    holder = torch.nn.Module()
    for i, t in enumerate(average.values()):
        holder.register_buffer(f"t{i}", t.clone())
    e = ModelEMA(holder, ema["decay"], ema["kind"])
    for dst, src in zip(e.module.buffers(), average.values()):
        dst.copy_(src)
    e.updates.fill_(int(ema["updates"]))
    return {k: b.clone() for k, b in zip(average, e.averaged().buffers())}


def redraw_run_predictors(run: Path, arch: str) -> dict:
    """The run in folder ``run`` with :func:`distinct_predictors_` in its ``latest.pth``
    (the EMA drawn with seed 0, the plain weights with seed 1: other boxes; without an EMA,
    FCOS's recipe, the plain weights with seed 0) and its
    ``eval.jsonl`` emptied, so that resumed, it evaluates its last step again; returns the
    checkpoint written."""
    from fastdet.runtime.checkpoint import load_checkpoint, save_checkpoint

    ck = load_checkpoint(run / "latest.pth")
    n, ema = len(ck["class_names"]), ck["ema"]
    if ema is not None:  # FCOS's recipe keeps none: its plain weights are the evaluated ones
        before = {k: v.clone() for k, v in ema["module"].items()}
        distinct_predictors_(ema["module"], arch, seed=0, num_classes=n)
        if "average" in ema:  # debiased (PP-YOLO's Paddle EMA): a resumed run reads the raw average
            drawn = [k for k, v in ema["module"].items() if not torch.equal(v, before[k])]
            scale = float(_as_read(ema, {"one": torch.ones(())})["one"])
            raw = {k: ema["module"][k] / scale for k in drawn}
            ema["average"].update(raw)
            ema["module"].update(_as_read(ema, raw))  # what the resumed run evaluates, exactly
    distinct_predictors_(ck["model"], arch, seed=1 if ema is not None else 0, num_classes=n)
    save_checkpoint(run / "latest.pth", ck)
    (run / "eval.jsonl").write_text("")
    return ck
