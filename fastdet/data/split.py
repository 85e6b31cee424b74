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

import copy
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
                 overwrite: bool) -> tuple[coco.CocoDataset, coco.CocoDataset, coco.CocoDataset]:
    """Write ``out`` (see the module docstring); return the export as read (its report: what
    training will skip) and its two splits as read back. Every check comes before the first
    write: the flags, the file, its images under ``images`` (headers read: a wrong folder is
    one line naming it), what ``out`` already holds."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {val_fraction:g}")
    if seed < 0:
        raise ValueError(f"--seed must be 0 or more, got {seed}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {out} is a file, not a folder")
    images = images.expanduser().resolve()  # the links hold this: the same from any working directory
    doc = coco._read_json(ann)
    export = coco.load_coco_doc(copy.deepcopy(doc), ann, images, train=False, check_images="open")
    train_ids, val_ids = split_images(doc, val_fraction, seed)
    files = {out / "annotations" / "instances_train.json": subset(doc, train_ids),
             out / "annotations" / "instances_val.json": subset(doc, val_ids)}
    links = [out / "train", out / "val"]
    if overwrite:  # what an earlier split wrote: its files, and links (to wherever they pointed)
        for link in links:
            if link.exists() and not link.is_symlink():
                raise ValueError(f"--output-dir {out}: {link} is not a link an earlier split made; "
                                 "choose another folder")
    else:
        refuse_replacing([*files, *links], f"--output-dir {out}", "--overwrite")
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    for path, part in files.items():
        path.write_text(json.dumps(part))
    for link in links:
        if link.is_symlink():
            link.unlink()
        os.symlink(images, link, target_is_directory=True)
    train, val = (coco.load_coco(path, link, train=False, check_images="none") for path, link in zip(files, links))
    return export, train, val
