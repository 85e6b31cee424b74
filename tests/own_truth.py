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
    ``ckpt``'s EMA (its plain weights with ``ema=False``) in the image's pixels, under the
    recipe's post-processing (what the evaluation scores)."""
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
    boxes are ``ckpt``'s own EMA detections, each label written as the demo's category of the
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


def distinct_predictors_(weights: dict, arch: str, seed: int) -> dict:
    """``weights`` (a state dict) with the head's last convolutions drawn so that the boxes
    and classes differ from place to place and image to image, and scores are high (the
    head a few steps from its initialisation puts out the same box, often the whole image,
    everywhere at the score threshold): in place, returned. ``seed``: other seeds, other
    boxes."""
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if arch == "ppyoloe" and name.startswith(("head.pred_cls.", "head.pred_reg.")):
            if name.endswith("weight"):  # logits of std ~2 over the ~1 of a 3x3 conv's inputs
                t.copy_(torch.randn(t.shape, generator=g) * 2.0 / (t[0].numel() ** 0.5))
            elif name.startswith("head.pred_cls."):
                t.zero_()
            else:  # DFL bins 0..reg_max per side: distances of ~1-3 strides, not the 8 of equal bins
                t.copy_(-0.7 * torch.arange(t.numel()).remainder(t.numel() // 4))
        elif arch == "yolox" and name.startswith("head.cls_preds."):
            t.copy_(torch.randn(t.shape, generator=g) * 3.0 if t.dim() > 1 else torch.zeros(t.shape))
        elif arch == "yolox" and name.startswith("head.obj_preds.") and name.endswith("bias"):
            t.fill_(4.0)
    return weights


def redraw_run_predictors(run: Path, arch: str) -> dict:
    """The run in folder ``run`` with :func:`distinct_predictors_` in its ``latest.pth``
    (the EMA drawn with seed 0, the plain weights with seed 1: other boxes) and its
    ``eval.jsonl`` emptied, so that resumed, it evaluates its last step again; returns the
    checkpoint written."""
    from fastdet.runtime.checkpoint import load_checkpoint, save_checkpoint

    ck = load_checkpoint(run / "latest.pth")
    distinct_predictors_(ck["ema"]["module"], arch, seed=0)
    distinct_predictors_(ck["model"], arch, seed=1)
    save_checkpoint(run / "latest.pth", ck)
    (run / "eval.jsonl").write_text("")
    return ck
