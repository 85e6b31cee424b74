"""Splitting a single-split COCO export into train and val (``python -m fastdet.data split``).

CVAT's task export (``annotations/instances_default.json``) and Label Studio's
(``result.json``) hold one set, with no held-out images; training needs a val split. This
writes the two halves as a COCO root that ``--data`` reads as it is (MMDetection's layout,
``coco.split_paths``)::

    OUT/annotations/instances_train.json    the train images and their boxes
    OUT/annotations/instances_val.json      the val images and their boxes
    OUT/train -> IMAGES, OUT/val -> IMAGES  links to the export's image folder (nothing copied)

Images (not boxes) are drawn at random with ``seed``: each image and all its boxes land in
one split. Both files keep every category and every other field of the export (``info``,
``licenses``, the images' and annotations' own fields), so both splits have the same class
list. The split is checked like any COCO file before anything is written, and nothing
existing is replaced unless asked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fastdet.data import coco
from fastdet.runtime.outputs import refuse_replacing


def split_images(doc: dict, val_fraction: float, seed: int) -> tuple[set, set]:
    """The image ids of train and val: ``round(val_fraction * N)`` images drawn for val (at
    least 1, at most N - 1), the same for the same ``seed`` and file; then, for each class
    whose every image was drawn for val, its first drawn image goes back to train (a class
    the model never sees in training cannot be learned; one missing from val only goes
    unscored, and is said)."""
    ids = [im["id"] for im in doc["images"]]
    if len(ids) < 2:
        raise coco.DataError(f"{len(ids)} image(s): a split needs at least 2")
    n_val = min(len(ids) - 1, max(1, round(val_fraction * len(ids))))
    order = np.random.default_rng(seed).permutation(len(ids))
    drawn = [ids[i] for i in order[:n_val]]
    val = set(drawn)
    images_of: dict = {}
    for a in doc["annotations"]:
        images_of.setdefault(a["category_id"], set()).add(a["image_id"])
    for cat in sorted(images_of, key=str):
        if images_of[cat] <= val and len(val) > 1:
            val.discard(next(i for i in drawn if i in images_of[cat]))
    return set(ids) - val, val


def subset(doc: dict, image_ids: set) -> dict:
    """``doc`` with only the images of ``image_ids`` and their annotations (every other key kept)."""
    out = {k: v for k, v in doc.items() if k not in ("images", "annotations")}
    out["images"] = [im for im in doc["images"] if im["id"] in image_ids]
    out["annotations"] = [a for a in doc["annotations"] if a["image_id"] in image_ids]
    return out


def split_export(ann: Path, images: Path, out: Path, val_fraction: float, seed: int,
                 overwrite: bool) -> tuple[coco.CocoDataset, coco.CocoDataset]:
    """Write ``out`` (see the module docstring) and return its two splits as read back."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {val_fraction:g}")
    images = images.expanduser().absolute()
    doc = coco._read_json(ann)
    coco.load_coco_doc(json.loads(json.dumps(doc)), ann, images, train=False, check_images="none")
    train_ids, val_ids = split_images(doc, val_fraction, seed)
    files = {out / "annotations" / "instances_train.json": subset(doc, train_ids),
             out / "annotations" / "instances_val.json": subset(doc, val_ids)}
    links = [out / "train", out / "val"]
    if overwrite:  # only what this command wrote: links to the same folder, or files
        for link in links:
            if link.exists() and not (link.is_symlink() and link.resolve() == images.resolve()):
                raise ValueError(f"--output-dir {out}: {link} exists and is not a link to {images}; "
                                 "choose another folder")
    else:
        refuse_replacing([*files, *links], f"--output-dir {out}", "--overwrite")
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    for path, part in files.items():
        path.write_text(json.dumps(part))
    for link in links:
        if not link.is_symlink():
            os.symlink(images, link, target_is_directory=True)
    return tuple(coco.load_coco(path, link, train=False, check_images="none")  # type: ignore[return-value]
                 for path, link in zip(files, links))
