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
one split, and images that share one label file (``a.jpg`` and ``a.png`` beside ``a.txt``
or ``a.xml``) land in the same one. Val is drawn from the images that read; one that does
not (missing, corrupt) stays in train, where training counts it again. The export is read
and checked like any set before anything is written (image headers opened, every label
file parsed; an export of no boxes is refused), and nothing existing is replaced unless
asked, nor an earlier split of another format left to be read in place of this one. A
layout whose train split is there without a val split (a CVAT project's ``Train`` subset
alone, a VOC ``train/`` folder alone) has that train split split.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fastdet.data import coco, formats
from fastdet.runtime.outputs import refuse_replacing

Splits = tuple[coco.CocoDataset, coco.CocoDataset, coco.CocoDataset]  # the export as read, its train, its val


def draw(classes: list[set], usable: list[bool], val_fraction: float, seed: int, source: Path
         ) -> tuple[list[int], list[int]]:
    """The indices of train and val among units (an image, or the images of one label file),
    each with its set of classes: ``round(val_fraction * N)`` of the N usable units drawn
    for val (at least 1, at most N - 1), the same for the same ``seed``; then, for each
    class whose every unit was drawn for val, its first drawn unit goes back to train (a
    class the model never sees in training cannot be learned; one missing from val only
    goes unscored, and is said). Units that do not read stay in train."""
    ids = [i for i, ok in enumerate(usable) if ok]
    if len(ids) < 2:
        raise coco.DataError(f"{source}: {len(ids)} image(s) that read (images sharing a label file count as one): "
                             "a split needs at least 2")
    n_val = min(len(ids) - 1, max(1, round(val_fraction * len(ids))))
    order = np.random.default_rng(seed).permutation(len(ids))
    drawn = [ids[i] for i in order[:n_val]]
    val = set(drawn)
    units_of: dict = {}
    for i in ids:
        for c in classes[i]:
            units_of.setdefault(c, set()).add(i)
    for c in sorted(units_of, key=str):
        if units_of[c] <= val and len(val) > 1:
            val.discard(next(i for i in drawn if i in units_of[c]))
    return [i for i in range(len(classes)) if i not in val], sorted(val)


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


def _outside(out: Path, source: Path) -> None:
    """The output may not lie inside the export: a later split or read of it would take the
    links and lists as the export's own files."""
    if out.resolve().is_relative_to(source.resolve()):
        raise ValueError(f"--output-dir {out} is inside the export ({source}); choose a folder outside it")


# What each format's split writes in OUT (relative paths).
# (The export's own test split, where it has one, is kept: linked, or listed for YOLO.)
OUTPUTS = {"coco": ("annotations/instances_train.json", "annotations/instances_val.json",
                    "annotations/instances_test.json", "train", "val", "test"),
           "yolo": ("data.yaml", "train.txt", "val.txt", "test.txt"),
           "voc": ("train", "val", "test")}


def _refuse_replacing(out: Path, fmt: str, overwrite: bool) -> None:
    """Nothing existing replaced without ``--overwrite``, and never an earlier split of
    another format (``--data OUT`` would read it in place of this one). COCO's split
    folders are links, VOC's folders of links: the same names, told apart by what they are."""
    mine = [out / p for p in OUTPUTS[fmt]]
    others = [out / p for f, names in OUTPUTS.items() if f != fmt for p in names if out / p not in mine]
    left = [p for p in others if p.exists() or p.is_symlink()]
    left += [p for p in mine if p.name in ("train", "val", "test") and p.exists()  # links where this format links
             and p.is_symlink() != (fmt == "coco" or p.name == "test")]
    if left:
        raise ValueError(f"--output-dir {out} holds {left[0]}, which is not this format's ({fmt.upper()}): an "
                         "earlier split of another format, or a file of yours; choose another folder")
    if not overwrite:
        refuse_replacing(mine, f"--output-dir {out}", "--overwrite")


def _link(links: dict[Path, Path]) -> None:
    """Each ``{link: target}``, an earlier split's link replaced (checked by :func:`_refuse_replacing`)."""
    for link, target in links.items():
        if link.is_symlink():
            link.unlink()
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link, target_is_directory=target.is_dir())


def _no_boxes(export: coco.CocoDataset, source: Path) -> None:
    """An export read without one box is refused: its labels are where this reader does not look."""
    if export.report.boxes_kept == 0:
        raise coco.DataError(f"{source}: {len(export)} images read and not one box; {export.report.summary()}")


def split_export(ann: Path, images: Path, out: Path, val_fraction: float, seed: int, overwrite: bool,
                 source: Path | None = None, test: tuple[Path, Path] | None = None) -> Splits:
    """Write ``out`` from a COCO export (see the module docstring); return the export as read
    (its report: what training will skip) and its two splits as read back. Every check comes
    before the first write: the flags, the file, its images under ``images`` (headers read: a
    wrong folder is one line naming it), what ``out`` already holds. ``source``: the
    export's folder (``--data``), which ``out`` must lie outside, as the image folder;
    ``test``: the layout's test split (JSON, images), linked beside the two."""
    _check_values(val_fraction, seed, out)
    images = images.expanduser().resolve()  # the links hold this: the same from any working directory
    _outside(out, source if source is not None else images)
    doc = coco._read_json(ann)
    export = coco.load_coco_doc(copy.deepcopy(doc), ann, images, train=False, check_images="open")
    _no_boxes(export, ann)
    read = {r.image_id for r in export.records}
    ids = [im["id"] for im in doc["images"]]
    classes = [set() for _ in ids]
    index = {i: k for k, i in enumerate(ids)}
    for a in doc["annotations"]:
        if a.get("image_id") in index:
            classes[index[a["image_id"]]].add(a.get("category_id"))
    train, val = draw(classes, [i in read for i in ids], val_fraction, seed, ann)
    files = {out / "annotations" / "instances_train.json": subset(doc, {ids[k] for k in train}),
             out / "annotations" / "instances_val.json": subset(doc, {ids[k] for k in val})}
    links = [out / "train", out / "val"]
    _refuse_replacing(out, "coco", overwrite)
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    for path, part in files.items():
        path.write_text(json.dumps(part))
    _link({link: images for link in links})
    if test is not None:
        _link({out / "annotations" / "instances_test.json": test[0].resolve(), out / "test": test[1].resolve()})
    return (export, *(coco.load_coco(path, link, train=False, check_images="open")
                      for path, link in zip(files, links)))


def export_kind(data: str) -> tuple[str, Path]:
    """``(format, the export's own folder or file)`` of the single-split export ``--data``
    names: ``"coco"``, ``"yolo"``, ``"voc"``, or ``"coco_train"`` / ``"voc_train"`` (a set's
    layout with its train split and no val: that train split is split); one line where it
    holds no such export (a set that already has its splits, or nothing fastdet reads)."""
    p = Path(data).expanduser()
    if not p.exists():
        raise coco.DataError(f"--data {data}: no such file or folder")
    if p.is_file():
        if p.suffix in (".yaml", ".yml", ".data"):
            return "yolo", p
        raise coco.DataError(f"--data {data}: a file; give the export's folder, a data.yaml or obj.data, "
                             "or a COCO file with --ann and its image folder with --images")
    if ((p / "data.yaml").is_file() or (p / "obj.data").is_file()) and not (p / "annotations").is_dir():
        return "yolo", p  # as formats.data_format tells a YOLO set
    has_xml = next((f for f in p.rglob("*") if f.suffix.lower() == ".xml" and f.is_file()), None) is not None
    if formats.yolo_classes_file(p) and (formats.has_yolo_labels(p) or not has_xml):
        return "yolo", p
    if formats._is_voc_root(p):
        raise coco.DataError(f"--data {data}: a VOC root, whose ImageSets/Main lists name its splits: write "
                             "ImageSets/Main/val.txt with the ids of the held-out images, or train on it as it is")
    layout = coco.coco_layout_of(p)
    if layout or formats.is_voc_folders(p):
        fmt = "coco" if layout else "voc"
        if fmt == "coco":
            has = {s: coco.split_paths(p, s)[0].is_file() for s in ("train", "val")}
        else:
            has = {s: any((p / n).is_dir() for n in coco.SPLIT_FOLDERS[s]) for s in ("train", "val")}
        if has["train"] and has["val"]:
            raise coco.DataError(f"--data {data}: already holds its splits ({fmt.upper()}); train on it as it "
                                 f"is (python -m fastdet.data check --data {data})")
        if not has["train"]:
            raise coco.DataError(f"--data {data}: a {fmt.upper()} layout without a train split; to split one of its "
                                 "splits, name it: " + ("--ann <its JSON> --images <its image folder>" if fmt == "coco"
                                                        else "--data <its folder>"))
        return f"{fmt}_train", p
    if has_xml:
        return "voc", p
    if formats.coco_export_files(p):
        return "coco", p
    raise coco.DataError(f"--data {data}: no export to split (a YOLO folder with classes.txt, a data.yaml or "
                         "obj.data, LabelImg's VOC XMLs beside their images, or a COCO export's JSON)")


def split_data(data: str, out: Path, val_fraction: float, seed: int, overwrite: bool) -> Splits:
    """Write ``out`` from the single-split export ``--data`` names, in its own format (see
    the module docstring and :func:`export_kind`)."""
    _check_values(val_fraction, seed, out)
    kind, where = export_kind(data)
    if where.is_dir():
        _outside(out, where)  # the whole export (a layout's train split is one folder of it)
    if kind == "coco":
        jsons, images = formats.coco_export_files(where)
        return split_export(jsons[0], images, out, val_fraction, seed, overwrite, source=where)
    if kind == "coco_train":
        ann, images = coco.split_paths(where, "train")
        test = coco.split_paths(where, "test")
        return split_export(ann, images, out, val_fraction, seed, overwrite, source=where,
                            test=test if test[0].is_file() else None)
    if kind == "yolo":
        return split_yolo(str(where), out, val_fraction, seed, overwrite)
    if kind == "voc_train":
        test = next((where / n for n in coco.SPLIT_FOLDERS["test"] if (where / n).is_dir()), None)
        return split_voc(formats._voc_folder(where, "train"), out, val_fraction, seed, overwrite, test=test)
    return split_voc(where, out, val_fraction, seed, overwrite)


def _units(keys: list) -> list[list[int]]:
    """Image indices grouped by their label file (``keys``; None: an image alone)."""
    groups: list[list[int]] = []
    first: dict = {}
    for i, k in enumerate(keys):
        g = first.setdefault(k, len(groups)) if k is not None else len(groups)
        if g == len(groups):
            groups.append([])
        groups[g].append(i)
    return groups


def _draw_files(keys: list, classes: list[set], usable: list[bool], val_fraction: float,
                seed: int, source: Path) -> tuple[list[int], list[int]]:
    """The image indices of train and val, drawn by label file (``keys[i]``: image i's, or
    None; images of one label file are one unit: :func:`draw`)."""
    groups = _units(keys)
    train, val = draw([set().union(*(classes[i] for i in g)) for g in groups],
                      [all(usable[i] for i in g) for g in groups], val_fraction, seed, source)
    return sorted(i for g in train for i in groups[g]), sorted(i for g in val for i in groups[g])


def split_yolo(data: str, out: Path, val_fraction: float, seed: int, overwrite: bool) -> Splits:
    """A YOLO export into ``out/data.yaml`` with ``train.txt`` and ``val.txt`` (module docstring)."""
    _check_values(val_fraction, seed, out)
    path, names, root, entry, test = formats.yolo_single_split(data)
    _outside(out, root)
    export = formats.yolo_dataset(path, names, root, "train", entry, train=False, check_images="open")
    _no_boxes(export, path)
    files, _ = formats.yolo_images(path, root, "train", entry)
    test_files = formats.yolo_images(path, root, "test", test)[0] if test is not None else None
    labels = [formats.yolo_label_path(f) for f in files]
    classes = [{b[1] for b in formats.yolo_boxes(t, len(names))} if t.is_file() else set() for t in labels]
    read = {Path(r.file) for r in export.records}
    train, val = _draw_files([t if t.is_file() else None for t in labels], classes,
                             [f in read for f in files], val_fraction, seed, path)
    fields: dict[str, Any] = {"train": "train.txt", "val": "val.txt"}
    if test_files is not None:  # the export's own test images, listed as train and val are
        fields["test"] = "test.txt"
    spec = yaml.safe_dump({**fields, "names": names}, sort_keys=False, allow_unicode=True)
    written = {out / "data.yaml": f"# python -m fastdet.data split of {path} (seed {seed}, val fraction "
                                  f"{val_fraction:g}): each image's label file is where the export has it\n{spec}",
               out / "train.txt": "".join(f"{files[i]}\n" for i in train),
               out / "val.txt": "".join(f"{files[i]}\n" for i in val)}
    if test_files is not None:
        written[out / "test.txt"] = "".join(f"{f}\n" for f in test_files)
    _refuse_replacing(out, "yolo", overwrite)
    out.mkdir(parents=True, exist_ok=True)
    for p, text in written.items():
        p.write_text(text, encoding="utf-8")
    spec_file = str(out / "data.yaml")
    return (export, *(formats.load_yolo(spec_file, s, train=False, check_images="open") for s in ("train", "val")))


def split_voc(root: Path, out: Path, val_fraction: float, seed: int, overwrite: bool,
              test: Path | None = None) -> Splits:
    """VOC XMLs beside their images into ``out/train/`` and ``out/val/`` of links (module
    docstring); ``test``: the layout's test folder, linked beside them."""
    _check_values(val_fraction, seed, out)
    root = root.expanduser().absolute()
    _outside(out, root)
    xmls, images, _, _ = formats.voc_pairs(root, root)
    if not any(x is not None for x in xmls):
        elsewhere = next((f for f in root.rglob("*") if f.suffix.lower() == ".xml" and f.is_file()), None)
        raise coco.DataError(f"--data {root}: none of its {len(images)} images has an XML beside it (of its own "
                             f"name, in its folder){f'; {elsewhere} is elsewhere' if elsewhere else ''}: LabelImg "
                             "saves each XML beside its image")
    export = formats.load_voc_folder(root, check_images="open")
    _no_boxes(export, root)
    read = {Path(r.file) for r in export.records}
    train, val = _draw_files(xmls, [{o[0] for o in formats.voc_objects(x)} for x in xmls],
                             [f in read for f in images], val_fraction, seed, root)
    folders = {out / "train": train, out / "val": val}
    _refuse_replacing(out, "voc", overwrite)
    for folder in folders:  # an earlier split's folders hold links only: anything else is the user's
        own = [f for f in folder.rglob("*") if not f.is_symlink() and not f.is_dir()] if folder.is_dir() else []
        if folder.exists() and (not folder.is_dir() or folder.is_symlink() or own):
            raise ValueError(f"--output-dir {out}: {folder} is not a folder of links an earlier split made "
                             f"({own[0] if own else folder}); choose another folder")
    for folder, chosen in folders.items():
        if folder.exists():
            shutil.rmtree(folder)  # links only (checked above): their targets stay
        for i in chosen:
            rel = images[i].relative_to(root)
            pair = [(images[i], rel)] + ([(xmls[i], rel.parent / xmls[i].name)] if xmls[i] is not None else [])
            for target, name in pair:
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                if not (folder / name).is_symlink():  # an XML two images share: linked once
                    os.symlink(target.resolve(), folder / name)
    if test is not None:
        _link({out / "test": test.resolve()})
    return (export, *(formats.load_voc(str(out), s, train=False, check_images="open") for s in ("train", "val")))
