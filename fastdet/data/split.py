"""Splitting a single-split export into train and val (``python -m fastdet.data split``).

Annotation tools export one set, with no held-out images: CVAT's task export
(``annotations/instances_default.json``), Label Studio's (``result.json``, or
``classes.txt`` with ``images/`` and ``labels/``), LabelImg's saves beside the images (YOLO
txt files and ``classes.txt``, or Pascal VOC XMLs), a CVAT "YOLO 1.1" task without a
Validation subset (``obj.data`` without ``valid``). Training needs a val split. This writes
the two halves in the export's own format, in a folder that ``--data`` reads as it is,
copying no image:

- COCO (``--ann JSON --images DIR``, or ``--data`` a folder holding the export's JSON) ->
  MMDetection's layout (``coco.split_paths``)::

    OUT/annotations/instances_train.json    the train images and their boxes
    OUT/annotations/instances_val.json      the val images and their boxes
    OUT/train -> IMAGES, OUT/val -> IMAGES  links to the export's image folder

  Both files keep every category and every other field of the export (``info``,
  ``licenses``, the images' and annotations' own fields), so both splits have the same
  class list.
- YOLO (``--data`` a ``classes.txt`` folder, a data.yaml or an ``obj.data``) -> an
  ultralytics data.yaml whose splits are lists of the export's images (each keeps its
  label file where it is)::

    OUT/data.yaml                           train: train.txt, val: val.txt, names: the export's
    OUT/train.txt, OUT/val.txt              the absolute paths of each split's images

- VOC XMLs beside their images (``--data`` LabelImg's folder) -> a VOC set kept as folders
  (``formats._voc_split``)::

    OUT/train/<path>, OUT/val/<path>        links to each image and to the XML beside it,
                                            at the path they have under the export's folder

Images (not boxes) are drawn at random with ``seed``: each image and all its boxes land in
one split. The export is read and checked like any set before anything is written (image
headers opened, every label file parsed), and nothing existing is replaced unless asked.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import yaml

from fastdet.data import coco, formats
from fastdet.runtime.outputs import refuse_replacing

Splits = tuple[coco.CocoDataset, coco.CocoDataset, coco.CocoDataset]  # the export as read, its train, its val


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


def _check_values(val_fraction: float, seed: int, out: Path) -> None:
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {val_fraction:g}")
    if seed < 0:
        raise ValueError(f"--seed must be 0 or more, got {seed}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {out} is a file, not a folder")


def split_export(ann: Path, images: Path, out: Path, val_fraction: float, seed: int, overwrite: bool) -> Splits:
    """Write ``out`` from a COCO export (see the module docstring); return the export as read
    (its report: what training will skip) and its two splits as read back. Every check comes
    before the first write: the flags, the file, its images under ``images`` (headers read: a
    wrong folder is one line naming it), what ``out`` already holds."""
    _check_values(val_fraction, seed, out)
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


def export_kind(data: str) -> str:
    """``"coco"``, ``"yolo"`` or ``"voc"``: the format of the single-split export ``--data``
    names; one line where it holds no such export (a set that already has its splits, or
    nothing fastdet reads)."""
    p = Path(data).expanduser()
    if not p.exists():
        raise coco.DataError(f"--data {data}: no such file or folder")
    if p.is_file():
        if p.suffix in (".yaml", ".yml", ".data"):
            return "yolo"
        raise coco.DataError(f"--data {data}: a file; give the export's folder, a data.yaml or obj.data, "
                             "or a COCO file with --ann and its image folder with --images")
    if (p / "data.yaml").is_file() or (p / "obj.data").is_file() or formats.yolo_classes_file(p):
        return "yolo"
    if formats._is_voc_root(p) or coco.coco_layout_of(p) or formats.is_voc_folders(p):
        raise coco.DataError(f"--data {data}: already holds its splits ({formats.data_format(data).upper()}); "
                             f"train on it as it is: python -m fastdet.data check --data {data}")
    if next((f for f in p.rglob("*") if f.suffix.lower() == ".xml" and f.is_file()), None) is not None:
        return "voc"
    if formats.coco_export_files(p):
        return "coco"
    raise coco.DataError(f"--data {data}: no export to split (a YOLO folder with classes.txt, a data.yaml or "
                         "obj.data, LabelImg's VOC XMLs beside their images, or a COCO export's JSON)")


def split_data(data: str, out: Path, val_fraction: float, seed: int, overwrite: bool) -> Splits:
    """Write ``out`` from the single-split export ``--data`` names, in its own format (see
    the module docstring and :func:`export_kind`)."""
    _check_values(val_fraction, seed, out)
    kind = export_kind(data)
    if kind == "coco":
        jsons, images = formats.coco_export_files(Path(data).expanduser())
        return split_export(jsons[0], images, out, val_fraction, seed, overwrite)
    return (split_yolo if kind == "yolo" else split_voc)(data, out, val_fraction, seed, overwrite)


def _outside(out: Path, source: Path) -> None:
    """The output may not lie inside the export: a later split or read of it would take the
    links and lists as the export's own files."""
    if out.resolve().is_relative_to(source.resolve()):
        raise ValueError(f"--output-dir {out} is inside the export ({source}); choose a folder outside it")


def _draw(classes: list[set], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """The indices of train and val among images of ``classes`` (each image's set of class
    names or ids), drawn as :func:`split_images` draws a COCO file's."""
    doc = {"images": [{"id": i} for i in range(len(classes))],
           "annotations": [{"image_id": i, "category_id": c} for i, cs in enumerate(classes) for c in cs]}
    train, val = split_images(doc, val_fraction, seed)
    return sorted(train), sorted(val)


def split_yolo(data: str, out: Path, val_fraction: float, seed: int, overwrite: bool) -> Splits:
    """A YOLO export into ``out/data.yaml`` with ``train.txt`` and ``val.txt`` (module docstring)."""
    path, names, root, entry = formats.yolo_single_split(data)
    _outside(out, root)
    export = formats.yolo_dataset(path, names, root, "train", entry, train=False, check_images="open")
    files, _ = formats.yolo_images(path, root, "train", entry)
    labels = [formats.yolo_label_path(f) for f in files]
    classes = [{b[1] for b in formats.yolo_boxes(t, len(names))} if t.is_file() else set() for t in labels]
    train, val = _draw(classes, val_fraction, seed)
    spec = yaml.safe_dump({"train": "train.txt", "val": "val.txt", "names": names}, sort_keys=False,
                          allow_unicode=True)
    written = {out / "data.yaml": f"# python -m fastdet.data split of {path} (seed {seed}, val fraction "
                                  f"{val_fraction:g}): each image's label file is where the export has it\n{spec}",
               out / "train.txt": "".join(f"{files[i]}\n" for i in train),
               out / "val.txt": "".join(f"{files[i]}\n" for i in val)}
    if not overwrite:
        refuse_replacing(written, f"--output-dir {out}", "--overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for p, text in written.items():
        p.write_text(text, encoding="utf-8")
    spec_file = str(out / "data.yaml")
    return (export, *(formats.load_yolo(spec_file, s, train=False, check_images="none") for s in ("train", "val")))


def split_voc(data: str, out: Path, val_fraction: float, seed: int, overwrite: bool) -> Splits:
    """VOC XMLs beside their images into ``out/train/`` and ``out/val/`` of links (module docstring)."""
    root = Path(data).expanduser().absolute()
    _outside(out, root)
    export = formats.load_voc_folder(root, check_images="open")
    xmls, images, _, _ = formats.voc_pairs(root, root)
    train, val = _draw([{o[0] for o in formats.voc_objects(x)} for x in xmls], val_fraction, seed)
    folders = {out / "train": train, out / "val": val}
    if overwrite:  # an earlier split's folders hold links only: anything else is the user's
        for folder in folders:
            own = [f for f in folder.rglob("*") if not f.is_symlink() and not f.is_dir()] if folder.is_dir() else []
            if folder.exists() and (not folder.is_dir() or folder.is_symlink() or own):
                raise ValueError(f"--output-dir {out}: {folder} is not a folder of links an earlier split made "
                                 f"({own[0] if own else folder}); choose another folder")
    else:
        refuse_replacing(folders, f"--output-dir {out}", "--overwrite")
    for folder, chosen in folders.items():
        if folder.exists():
            shutil.rmtree(folder)  # links only (checked above): their targets stay
        for i in chosen:
            rel = images[i].relative_to(root)
            pair = [(images[i], rel)] + ([(xmls[i], rel.parent / xmls[i].name)] if xmls[i] is not None else [])
            for target, name in pair:
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(target.resolve(), folder / name)
    return (export, *(formats.load_voc(str(out), s, train=False, check_images="none") for s in ("train", "val")))
