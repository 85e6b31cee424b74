"""Datasets as users have them: COCO files, YOLO-format folders and Pascal VOC.

``--data`` says where the set is and its form says which format it is
(:func:`data_format`):

- ``demo``, a directory with ``annotations/instances_{train,val}2017.json`` (or the
  subsets ``train``/``val`` or CVAT's ``Train``/``Validation``, images in ``<subset>/`` or
  ``images/<subset>/``), or Roboflow's COCO export (``train/``, ``valid/``, each with its
  images and ``_annotations.coco.json``): COCO (``fastdet.data.coco.split_paths``);
- a ``.yaml``/``.yml`` file, or a directory holding ``data.yaml``: ultralytics' YOLO
  layout (``path``, ``train``, ``val``, ``names``; one ``labels/*.txt`` per image with
  ``class cx cy w h`` normalised to 0..1; an image without a txt, or an empty one, is
  background; a line of more than 5 values is a polygon ``class x1 y1 x2 y2 ...`` and
  its bounding box is used);
- a ``.data`` file, or a directory holding ``obj.data``: darknet's layout as CVAT's
  "YOLO 1.1" export writes it (``obj.data``: ``names = obj.names``, ``train = train.txt``,
  ``valid = valid.txt``; the lists name images in ``obj_<subset>_data/``, each with its
  txt beside it), read as the data.yaml it stands for (:func:`_read_darknet`);
- a directory with ``Annotations/`` and ``ImageSets/Main/``: Pascal VOC
  (``ImageSets/Main/{train,val}.txt`` list the image ids, ``Annotations/<id>.xml`` their
  objects, ``JPEGImages/<id>.jpg`` the pictures). Classes: ``label_list.txt`` in the root
  (one name a line, PaddleDetection's file) when present, else the 20 VOC classes when
  every name is one of them, else the sorted names found. ``difficult`` objects are
  ``iscrowd`` regions: never trained on, ignored when scoring (as VOC scores them).
  VOC boxes are 1-based inclusive pixels: ``[xmin - 1, ymin - 1, xmax, ymax]``.
  The same XMLs kept beside their images, one folder per split (``train/``, ``valid/`` or
  ``val/``, ``test/``, at any depth, ``.xml`` in any case: Roboflow's Pascal VOC export,
  LabelImg's saves sorted by split) are read as a VOC set too, unless the folder is a COCO
  root: an image without an XML is read as background and counted, an XML without an
  image is counted and named (:func:`_voc_split`). Every split takes the classes of
  train and val, so a test split's class that neither has is an error naming its XML.

YOLO and VOC sets are turned into a COCO document in memory and read by
:func:`fastdet.data.coco.load_coco_doc`, so they get the same records, the same report
and the same clipping and skip rules; the document is kept on the dataset
(``CocoDataset.coco_gt``) and the evaluator scores against it. Category ids are the
contiguous labels (0..C-1, the YOLO class ids); image ids count from 1 in list order.

Sets are read as annotation tools export them: text files with a BOM or CRLF, in UTF-8
or GBK (:func:`read_text`; an XML in the encoding it declares), ``names`` keyed by
quoted numbers, Roboflow's ``train: ../train/images`` (retried inside the set's root, as
ultralytics does), YOLO coordinates up to 0.01 past an edge (clipped), VOC XMLs without
``<size>`` (the image's header gives it), ``.jfif`` JPEGs. The report counts what was
changed (boxes clipped to the image) and what was not read (label files without an
image, a phone's HEIC/DNG pictures, files of other types in an image folder), with
examples that name the file and line (YOLO) or XML and object (VOC). Exports that name no
splits (LabelImg's and Label Studio's YOLO ``classes.txt`` folders, LabelImg's XMLs beside
the images in one folder, a folder holding a COCO export's JSON) are refused by :func:`export_hint` in
one line saying what to write or pass instead, and the ``fastdet.data split`` command that
splits them (``fastdet.data.split``).

Bad input is one :class:`~fastdet.data.coco.DataError` line naming the file (and line):
a label line that is not numbers, a class id not in ``names``, a coordinate further
outside 0..1, an XML that does not parse, an object whose name is not a class, a text
file in neither UTF-8 nor GBK. Images that are missing or do not open are counted
skips, as for COCO.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from fastdet.config import DataConfig
from fastdet.data import coco, demo
from fastdet.data.coco import CocoDataset, DataError

# ".jfif" and ".jpe": JPEGs as Windows and some cameras name them.
IMAGE_EXTS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".webp", ".tif", ".tiff")
CAMERA_EXTS = (".heic", ".heif", ".dng")  # pictures a phone saves that are not read: counted as such
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
               "train", "tvmonitor")
# How far past 0..1 a YOLO coordinate may lie and still be read (the box is then clipped to
# the image and counted): converters that take VOC's 1-based pixels as 0-based write a
# full-width box as w = 1 + 1/W (1.0016 at 640 px). Further out is an error.
_TOL = 0.01
SPLITS = ("train", "val", "test")

log = logging.getLogger(__name__)


def data_format(data: str) -> str:
    """``"coco"``, ``"yolo"`` or ``"voc"`` for the value of ``--data``."""
    if data == "demo":
        return "coco"
    p = Path(data).expanduser()
    if p.suffix in (".yaml", ".yml", ".data"):
        return "yolo"
    if p.is_dir():
        if _is_voc_root(p):
            return "voc"
        if ((p / "data.yaml").is_file() or (p / "obj.data").is_file()) and not (p / "annotations").is_dir():
            return "yolo"
        if coco.coco_layout_of(p) is None and not (p / "annotations").is_dir() and is_voc_folders(p):
            return "voc"
    return "coco"


def export_hint(data: str, split: str) -> Optional[str]:
    """For a ``--data`` directory that is no COCO root (no
    ``annotations/instances_<split>2017.json``) but an annotation tool's export fastdet does
    not read as it is: one line saying what to change; None otherwise."""
    root = Path(data).expanduser()
    if data == "demo" or not root.is_dir() or coco.coco_layout_of(root):
        return None  # a COCO-format root, whole or missing a split: resolve_data says which file is missing
    split_it = (f"python -m fastdet.data split --data {shlex.quote(str(root))} --output-dir "
                f"{shlex.quote(str(root.absolute()) + '_split')}")
    dangling = _dangling_link(root)
    if dangling is not None:
        return (f"--data {data}: {dangling} links to {os.readlink(dangling)}, which is missing: the export a "
                "split linked has moved; split it again from where it is now (python -m fastdet.data split "
                f"--data <the export> --output-dir {shlex.quote(str(root))} --overwrite)")
    classes = yolo_classes_file(root)
    if classes is not None:
        names = [ln.strip() for ln in read_text(classes).splitlines() if ln.strip()]
        images = "images" if (root / "images").is_dir() else "."
        return (f"--data {data}: a YOLO export without a data.yaml ({classes.name}: LabelImg's or Label Studio's "
                f"YOLO export), which names no train and val images; split its images into train and val: "
                f"{split_it}, or write {root / 'data.yaml'} with 'train: {images}', 'val: <held-out images>' and "
                f"'names: {names}'")
    yamls = sorted(y.name for y in (*root.glob("*.yaml"), *root.glob("*.yml")))
    if yamls:
        return (f"--data {data}: no data.yaml; it holds {', '.join(yamls[:3])}: if that is the set's YOLO "
                f"description, pass it itself: --data {root / yamls[0]}")
    if next(root.glob("*.[xX][mM][lL]"), None) or next(root.glob("*/*.[xX][mM][lL]"), None):
        return (f"--data {data}: VOC XMLs beside their images (LabelImg's PascalVOC save), not a VOC root; "
                f"split them into train and val: {split_it}, or put the images of each split with their XMLs "
                "in train/ and val/, or arrange a VOC root: "
                "Annotations/<id>.xml, JPEGImages/<id>.jpg, and ImageSets/Main/train.txt and val.txt "
                "listing the ids of each split")
    found = coco_export_files(root)
    if found:
        jsons, images = found
        ann = jsons[0]
        return (f"--data {data}: not a COCO root (no annotations/instances_{split}2017.json); it holds "
                f"{', '.join(str(j.relative_to(root)) for j in jsons[:3])} (CVAT's COCO export writes annotations/instances_default.json, Label "
                "Studio's result.json): name a COCO export's files with --train-ann/--train-images and "
                "--val-ann/--val-images, or split one into train and val: python -m fastdet.data split --ann "
                f"{shlex.quote(str(ann))} --images {shlex.quote(str(images))} --output-dir "
                f"{shlex.quote(str(root.absolute()) + '_split')}")
    return None


def _dangling_link(root: Path) -> Optional[Path]:
    """A link in a split folder of ``root`` whose target is gone (a VOC split's links to an
    export that moved), or None."""
    for name in (n for names in coco.SPLIT_FOLDERS.values() for n in names):
        folder = root / name
        if folder.is_dir():
            for f in folder.rglob("*"):
                if f.is_symlink() and not f.exists():
                    return f
    return None


def coco_export_files(root: Path) -> Optional[tuple[list[Path], Path]]:
    """A single-split COCO export in ``root`` (no COCO root): its JSON files, the export's
    own first, and the folder their ``file_name`` are relative to, as the tools write them;
    None without a JSON."""
    jsons = sorted((str(j.relative_to(root)) for j in [*root.glob("annotations/*.json"), *root.glob("*.json")]),
                   key=lambda j: (Path(j).name not in ("instances_default.json", "result.json"), j))
    if not jsons:
        return None
    # CVAT's file is in annotations/ with its images in images/ (images/default/ in some
    # versions); Label Studio's names them images/x.jpg from the folder it is in.
    images = root
    if jsons[0].startswith("annotations") and (root / "images").is_dir():
        images = root / "images" / "default" if (root / "images" / "default").is_dir() else root / "images"
    return [root / j for j in jsons], images


def yolo_classes_file(root: Path) -> Optional[Path]:
    """LabelImg's or Label Studio's class list of a YOLO export without a data.yaml."""
    return next((c for c in (root / "classes.txt", root / "labels" / "classes.txt") if c.is_file()), None)


def has_yolo_labels(root: Path) -> bool:
    """Whether an image under ``root`` has its label file where ultralytics' rule puts it."""
    return any(yolo_label_path(f).is_file() for f in root.rglob("*") if f.suffix.lower() in IMAGE_EXTS)


def yolo_single_split(data: str) -> tuple[Path, list[str], Path, Any, Any]:
    """A YOLO export that names no val images, to be split in two (``fastdet.data split``):
    ``(the file that describes it, names, root, its images' entry, its test entry or None)``. It is a folder with
    ``classes.txt`` (LabelImg's save beside the images; Label Studio's ``images/`` and
    ``labels/``), or a data.yaml / ``obj.data`` without a val entry (CVAT's task without a
    Validation subset); one naming val images is refused."""
    p = Path(data).expanduser()
    classes = yolo_classes_file(p) if p.is_dir() and not (p / "data.yaml").is_file() \
        and not (p / "obj.data").is_file() else None
    if classes is not None:
        names = [ln.strip() for ln in read_text(classes).splitlines() if ln.strip()]
        if not names:
            raise DataError(f"{classes}: no class names")
        return classes, names, p, "images" if (p / "images").is_dir() else ".", None
    path = _yolo_yaml(data)
    doc = _read_darknet(path) if path.suffix == ".data" else _read_yaml(path)
    names, root = yolo_names(path, doc), yolo_root(path, doc)
    if doc.get("val") is not None:
        raise DataError(f"{path}: already names its val images (val: {doc['val']}): train on it as it is")
    if doc.get("train") is None:
        raise DataError(f"{path}: no 'train' entry (the images to split)")
    return path, names, root, doc["train"], doc.get("test")


def load_split(data_cfg: DataConfig, split: str, *, train: Optional[bool] = None,
               check_images: Optional[str] = None) -> CocoDataset:
    """The ``"train"``, ``"val"`` or ``"test"`` set of ``--data``, whatever its format.

    ``train`` (default: ``split == "train"``) picks the training rules (empty images only
    with ``data_cfg.keep_empty_train``); ``check_images`` defaults to ``data_cfg``'s. The
    test split is ``--data``'s own (``test/`` of a Roboflow export, ``test:`` of a data.yaml,
    ``ImageSets/Main/test.txt``, ``instances_test2017.json``); the ``--val-ann`` style flags
    name only the train and val sets.
    """
    if split not in SPLITS:
        raise DataError(f"no split {split!r}: a set has {', '.join(SPLITS)}")
    train = split == "train" if train is None else train
    check = data_cfg.check_images if check_images is None else check_images
    keep_empty = data_cfg.keep_empty_train if train else None
    fmt = data_format(data_cfg.data)
    if fmt == "coco" and split == "test":
        if data_cfg.data == "demo":
            raise DataError("--data demo: the demo set has no test split (it has train and val)")
        root = Path(data_cfg.data).expanduser()
        if not root.is_dir():
            raise DataError(f"--data {data_cfg.data}: {'a file, not a folder' if root.is_file() else 'no such directory'}")
        hint = export_hint(data_cfg.data, split)
        if hint:
            raise DataError(hint)
        ann, images = coco.split_paths(root, "test")
        if not ann.is_file():
            raise DataError(f"--data {data_cfg.data}: annotation file {ann} not found (the test split)")
        return coco.load_coco(ann, images, train=train, keep_empty=keep_empty, check_images=check,
                              cache_dir=data_cfg.cache_dir)
    if fmt == "coco":
        hint = None if getattr(data_cfg, f"{split}_ann") else export_hint(data_cfg.data, split)
        if hint:
            raise DataError(hint)
        paths = coco.resolve_data(data_cfg, splits=(split,))
        return coco.load_coco(getattr(paths, f"{split}_ann"), getattr(paths, f"{split}_images"), train=train,
                              keep_empty=keep_empty, check_images=check, cache_dir=data_cfg.cache_dir)
    explicit = [f for f in ("train_ann", "train_images", "val_ann", "val_images") if getattr(data_cfg, f)]
    if explicit:
        flag = "--" + explicit[0].replace("_", "-")
        raise DataError(f"{flag} is for COCO files; --data {data_cfg.data} is a {fmt.upper()} set "
                        "that names its own splits")
    reader = load_yolo if fmt == "yolo" else load_voc
    return reader(data_cfg.data, split, train=train, keep_empty=keep_empty, check_images=check,
                  cache_dir=data_cfg.cache_dir)


def train_num_classes(data_cfg: DataConfig) -> int:
    """The number of classes training on ``--data`` has, whatever its format: what the
    trainer sets ``model.num_classes`` to, for the commands that build the model before (or
    without) reading the whole set (``fastdet.compile``, ``--print-config``).

    The demo set's are known without generating it; every other set's come from its own
    reader (``load_split`` without opening images), so the count cannot differ from training's.
    """
    if data_cfg.data == "demo" and data_cfg.train_ann is None:
        return len(demo.CATEGORIES)
    return load_split(data_cfg, "train", check_images="none").num_classes


# --------------------------------------------------------------------------- shared

def _probe_sizes(files: list[Path], check_images: str, cache_dir
                 ) -> tuple[list[tuple[int, int] | None], list[tuple[str, str]], list[str]]:
    """Each image's upright (width, height) read from its header (EXIF orientation applied),
    or None; ``(reason, path)`` skips; and the paths of the images stored sideways or flipped."""
    root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else Path("/")
    names = [str(f.relative_to(root)) for f in files]
    level = "decode" if check_images == "decode" else "open"
    checks = coco._check_images(root, names, level, cache_dir)
    sizes: list[tuple[int, int] | None] = []
    skips, turned = [], []
    for f, (status, w, h, _, orientation) in zip(files, checks):
        if status == "ok":
            sizes.append((w, h))
            if orientation != 1:
                turned.append(str(f))
        else:
            sizes.append(None)
            skips.append((status, str(f)))
    return sizes, skips, turned


def _finish(doc: dict, source: Path, files: list[Path], *, train: bool, keep_empty, check_images: str,
            cache_dir, prior_skips, crowd_reason: str = "crowd", ann_where=None, ignored_files=(),
            turned_upright=()) -> CocoDataset:
    """Read the in-memory document through the COCO layer (file names relative to the images' common root)."""
    root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else source.parent
    for im in doc["images"]:
        im["file_name"] = str(Path(im["file_name"]).relative_to(root))
    # The headers were read to get the sizes ("open"); "decode" is checked again, cached.
    check = "decode" if check_images == "decode" else "none"
    return coco.load_coco_doc(doc, source, root, train=train, keep_empty=keep_empty, check_images=check,
                              cache_dir=cache_dir, in_memory=True, prior_skips=prior_skips,
                              crowd_reason=crowd_reason, ann_where=ann_where, ignored_files=ignored_files,
                              turned_upright=turned_upright)


def _categories(names: list[str]) -> list[dict]:
    return [{"id": i, "name": n, "supercategory": ""} for i, n in enumerate(names)]


def _annotation(ann_id: int, image_id: int, cat: int, x0: float, y0: float, x1: float, y1: float,
                crowd: int = 0) -> dict:
    x0, y0, w, h = float(x0), float(y0), float(x1 - x0), float(y1 - y0)
    return {"id": ann_id, "image_id": image_id, "category_id": cat, "bbox": [x0, y0, w, h],
            "area": max(0.0, w) * max(0.0, h), "iscrowd": crowd}


def read_text(path: Path) -> str:
    """A text file of a set as editors and tools leave them: UTF-8 with or without a BOM
    (Notepad), UTF-16 with its BOM, or else GB18030 (GBK: Chinese class names saved in a
    Chinese Windows locale), logged; CRLF is read as LF. Anything else: one line naming the file."""
    raw = path.read_bytes()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return raw.decode("utf-16")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        bad = e.start
    try:
        text = raw.decode("gb18030")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{raw[bad]:02x} at offset {bad}) and not GBK either: "
                        "save it as UTF-8") from None
    log.warning("%s: not UTF-8; read as GB18030 (GBK)", path)
    return text


# --------------------------------------------------------------------------- YOLO

def _yolo_yaml(data: str) -> Path:
    p = Path(data).expanduser()
    if p.is_dir():
        p = p / "obj.data" if (p / "obj.data").is_file() and not (p / "data.yaml").is_file() else p / "data.yaml"
    if not p.is_file():
        raise DataError(f"--data {data}: {p} not found")
    return p


def _read_yaml(path: Path) -> dict:
    try:
        doc = yaml.safe_load(read_text(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise DataError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: expected a mapping with path, train, val, names")
    return doc


def _darknet_path(root: Path, value: str) -> Path:
    """A path in darknet's files: relative to darknet's working directory, which holds the
    set in ``data/`` (``data/obj.names``, ``data/obj_train_data/x.jpg``, as older CVAT
    versions write them); tried as written inside the set's root, then without ``data/``."""
    p = Path(value).expanduser()
    p = p if p.is_absolute() else root / p
    if not p.exists() and value.startswith("data/"):
        p = root / value[len("data/"):]
    return p


def _read_darknet(path: Path) -> dict:
    """darknet's ``obj.data`` (CVAT's "YOLO 1.1" export): ``key = value`` lines naming the
    class list (``names``) and the ``train`` and ``valid`` image lists, as the data.yaml
    document they stand for (``path``: the file's folder; ``val``: ``valid``)."""
    path = path.absolute()  # its lists are joined to its folder once (a relative folder twice: a wrong path)
    fields: dict[str, str] = {}
    for n, line in enumerate(read_text(path).splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" not in line:
            raise DataError(f"{path}:{n}: expected 'key = value' (names, train, valid), got {line!r}")
        key, value = (t.strip() for t in line.split("=", 1))
        fields[key] = value
    for key in ("names", "train"):
        if not fields.get(key):
            raise DataError(f"{path}: no '{key} = ...' line")
    names_file = _darknet_path(path.parent, fields["names"])
    if not names_file.is_file():
        raise DataError(f"{path}: names = {fields['names']}: {names_file} not found")
    names = [ln.strip() for ln in read_text(names_file).splitlines() if ln.strip()]
    doc: dict[str, Any] = {"path": str(path.parent), "names": names,
                           "train": str(_darknet_path(path.parent, fields["train"]))}
    if fields.get("valid"):
        doc["val"] = str(_darknet_path(path.parent, fields["valid"]))
    if fields.get("classes", "").isdigit():
        doc["nc"] = int(fields["classes"])
    return doc


def yolo_names(path: Path, doc: dict) -> list[str]:
    names = doc.get("names")
    if isinstance(names, dict):
        # Keys as written by hand or by tools: 0, or '0' (quoted).
        as_int = {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v for k, v in names.items()}
        keys = sorted(as_int, key=str)
        if not all(isinstance(k, int) and not isinstance(k, bool) for k in keys) or \
                sorted(keys) != list(range(len(keys))):
            raise DataError(f"{path}: field 'names' as a mapping must have the keys 0..N-1, got {keys[:5]}")
        names = [as_int[k] for k in range(len(keys))]
    if not isinstance(names, list) or not names:
        raise DataError(f"{path}: field 'names' must be a non-empty list or mapping of class names")
    names = [str(n) for n in names]
    nc = doc.get("nc")
    if nc is not None and nc != len(names):
        raise DataError(f"{path}: field 'nc' is {nc} but 'names' has {len(names)} entries")
    return names


def yolo_root(path: Path, doc: dict) -> Path:
    """The set's root: ``path`` as written if absolute; else relative to the yaml's folder,
    or to the working directory as ultralytics also reads it; absent: the yaml's folder."""
    raw = doc.get("path")
    if raw is None:
        return path.parent
    if not isinstance(raw, str):
        raise DataError(f"{path}: field 'path' must be a directory, got {raw!r}")
    p = Path(raw).expanduser()
    if p.is_absolute():
        candidates = [p]
    else:
        candidates = [path.parent / p, Path.cwd() / p]
    for c in candidates:
        if c.is_dir():
            return c
    raise DataError(f"{path}: field 'path': no directory {' or '.join(str(c) for c in candidates)}")


def yolo_images(path: Path, root: Path, split: str, entry: Any) -> tuple[list[Path], list[tuple[str, str]]]:
    """The image files of a split entry (a folder, a txt list of images, or a list of those),
    and ``(reason, path)`` of the files in its folders that are not read: other file types,
    and label files whose image is not there."""
    entries = entry if isinstance(entry, list) else [entry]
    files: list[Path] = []
    ignored: list[tuple[str, str]] = []
    for e in entries:
        if not isinstance(e, str):
            raise DataError(f"{path}: field '{split}' must be a path or a list of paths, got {e!r}")
        p = yolo_entry_path(root, e)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file())
            images = [f for f in found if f.suffix.lower() in IMAGE_EXTS]
            labels = {yolo_label_path(f) for f in images}
            files += images
            stems = {f.with_suffix("") for f in images}
            ignored += [(_not_read(f, stems), str(f)) for f in found if f.suffix.lower() not in IMAGE_EXTS
                        and f not in labels]
            label_dir = yolo_label_path(p / "x.jpg").parent  # where this folder's images have their labels
            if label_dir != p and label_dir.is_dir():
                ignored += [("label file without an image", str(t)) for t in sorted(label_dir.rglob("*.txt"))
                            if t not in labels]
        elif p.is_file() and p.suffix == ".txt":
            for line in read_text(p).splitlines():
                line = line.strip()
                if line:
                    q = Path(line)
                    q = q if q.is_absolute() else (p.parent / q if line.startswith("./") else root / q)
                    if not q.exists() and line.startswith("data/"):  # darknet's, as CVAT writes them
                        q = _darknet_path(root, line)
                    files.append(q)
        else:
            raise DataError(f"{path}: field '{split}': {p} is neither an image folder nor a .txt list")
    if not files:
        raise DataError(f"{path}: field '{split}': no images ({', '.join(map(str, entries))})")
    return [f.absolute() for f in files], ignored


def _not_read(f: Path, image_stems: set[Path]) -> str:
    """Why a file in a YOLO image folder is not read: a camera format; a label file beside its
    image where ultralytics' rule looks elsewhere (``images/`` -> ``labels/``); a label file
    without an image (a txt whose first line is ``class cx cy w h``); else not an image file."""
    if f.suffix.lower() in CAMERA_EXTS:
        return coco.CAMERA_FORMAT
    if f.suffix.lower() != ".txt":
        return "not an image file"
    if f.with_suffix("") in image_stems:
        return coco.LABEL_BESIDE
    try:
        first = next((ln.split() for ln in read_text(f).splitlines() if ln.strip()), [])
        looks = len(first) >= 5 and all(np.isfinite(float(v)) for v in first)
    except (DataError, ValueError):
        looks = False
    return "label file without an image" if looks else "not an image file"


def yolo_entry_path(root: Path, entry: str) -> Path:
    """A data.yaml split entry's path: as written if absolute, else inside ``root``; Roboflow
    writes ``train: ../train/images`` beside its data.yaml, which ultralytics retries inside
    the set's root, and so do we."""
    p = Path(entry).expanduser()
    p = p if p.is_absolute() else root / p
    if not p.exists() and entry.startswith("../"):
        p = root / entry[3:]
    return p


def yolo_label_path(image: Path) -> Path:
    """ultralytics' rule: the last ``/images/`` of the path becomes ``/labels/``, the suffix ``.txt``."""
    s = str(image)
    a, b = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    if a in s:
        s = b.join(s.rsplit(a, 1))
    return Path(s).with_suffix(".txt")


def yolo_boxes(label: Path, num_classes: int) -> list[tuple[int, int, float, float, float, float]]:
    """``(line, class, cx, cy, w, h)`` per box line of one label file (normalised)."""
    out = []
    for n, line in enumerate(read_text(label).splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            vals = [float(v) for v in parts]
        except ValueError:
            raise DataError(f"{label}:{n}: expected 'class cx cy w h' numbers, got {line.strip()!r}") from None
        if len(vals) < 5 or (len(vals) > 5 and len(vals) % 2 == 0):
            raise DataError(f"{label}:{n}: expected 'class cx cy w h' (or a polygon 'class x1 y1 x2 y2 ...'), "
                            f"got {len(vals)} values")
        cls = vals[0]
        if cls != int(cls) or not 0 <= cls < num_classes:
            raise DataError(f"{label}:{n}: class {parts[0]} is not in names (0..{num_classes - 1})")
        coords = np.array(vals[1:], np.float64)
        if not np.isfinite(coords).all() or (coords < -_TOL).any() or (coords > 1 + _TOL).any():
            raise DataError(f"{label}:{n}: coordinates must be normalised to 0..1 (up to {_TOL:g} past an edge "
                            f"is clipped), got {' '.join(parts[1:])}")
        if len(vals) > 5:  # polygon: its bounding box
            xs, ys = coords[0::2], coords[1::2]
            x0, x1, y0, y1 = xs.min(), xs.max(), ys.min(), ys.max()
            out.append((n, int(cls), (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0))
        else:
            out.append((n, int(cls), *coords.tolist()))
    return out


def load_yolo(data: str, split: str, *, train: bool, keep_empty=None, check_images: str = "open",
              cache_dir=None) -> CocoDataset:
    """One split of an ultralytics ``data.yaml`` set (see the module docstring)."""
    path = _yolo_yaml(data)
    darknet = path.suffix == ".data"
    doc = _read_darknet(path) if darknet else _read_yaml(path)
    names = yolo_names(path, doc)
    root = yolo_root(path, doc)
    if split not in doc or doc[split] is None:
        if darknet:  # CVAT writes valid.txt only for a task with a Validation subset
            raise DataError(f"{path}: no 'valid = ...' line (the val images): add one naming a list of "
                            "held-out images, e.g. 'valid = valid.txt' as CVAT writes it for a Validation subset, "
                            f"or split the train images: python -m fastdet.data split --data {shlex.quote(str(path))} "
                            f"--output-dir {shlex.quote(str(path.parent.absolute()) + '_split')}")
        raise DataError(f"{path}: no '{split}' entry (the {split} images)")
    return yolo_dataset(path, names, root, split, doc[split], train=train, keep_empty=keep_empty,
                        check_images=check_images, cache_dir=cache_dir)


def yolo_dataset(path: Path, names: list[str], root: Path, split: str, entry: Any, *, train: bool,
                 keep_empty=None, check_images: str = "open", cache_dir=None) -> CocoDataset:
    """The images of one split ``entry`` (a folder, a txt list, or a list of those, relative to
    ``root``) with their label files, ``path`` being the file that names them (in messages)."""
    files, ignored = yolo_images(path, root, split, entry)
    sizes, skips, turned = _probe_sizes(files, check_images, cache_dir)
    images, anns, kept = [], [], []
    where: dict[int, str] = {}
    for i, (f, size) in enumerate(zip(files, sizes)):
        if size is None:
            continue
        w, h = size
        image_id = i + 1
        images.append({"id": image_id, "file_name": str(f), "width": w, "height": h})
        kept.append(f)
        label = yolo_label_path(f)
        if not label.is_file():
            continue
        for line, c, cx, cy, bw, bh in yolo_boxes(label, len(names)):
            anns.append(_annotation(len(anns) + 1, image_id, c, (cx - bw / 2) * w, (cy - bh / 2) * h,
                                    (cx + bw / 2) * w, (cy + bh / 2) * h))
            where[len(anns)] = f"{label}:{line}"
    coco_doc = {"images": images, "annotations": anns, "categories": _categories(names)}
    return _finish(coco_doc, path, kept or files, train=train, keep_empty=keep_empty, check_images=check_images,
                   cache_dir=cache_dir, prior_skips=skips, ann_where=where, ignored_files=ignored,
                   turned_upright=turned)


# --------------------------------------------------------------------------- VOC

def _voc_ids(root: Path, split: str) -> tuple[Path, list[str]]:
    lst = root / "ImageSets" / "Main" / f"{split}.txt"
    if not lst.is_file():
        raise DataError(f"--data {root}: {lst} not found (the {split} image ids of a VOC set)")
    ids = [line.split()[0] for line in read_text(lst).splitlines() if line.strip()]
    if not ids:
        raise DataError(f"{lst}: no image ids")
    return lst, ids


def _xml_text(xml: Path, node: ET.Element, tag: str, where: str) -> str:
    child = node.find(tag)
    if child is None or child.text is None or not child.text.strip():
        raise DataError(f"{xml}: {where}<{tag}> missing")
    return child.text.strip()


def _xml_number(xml: Path, node: ET.Element, tag: str, where: str) -> float:
    text = _xml_text(xml, node, tag, where)
    try:
        v = float(text)
    except ValueError:
        raise DataError(f"{xml}: {where}<{tag}> must be a number, got {text!r}") from None
    if not np.isfinite(v):
        raise DataError(f"{xml}: {where}<{tag}> must be finite, got {text!r}")
    return v


_XML_ENCODING = re.compile(rb"^\s*<\?xml[^>]*encoding=[\"']([A-Za-z0-9_.-]+)[\"']")


def _parse_xml(xml: Path) -> ET.Element:
    """The root of an annotation XML. expat reads UTF-8/16 and Latin-1 itself (a BOM is
    fine); an XML in another encoding (labelImg on a Chinese Windows saves GBK) is decoded
    here, by its declaration or, without one, as :func:`read_text` decodes text."""
    raw = xml.read_bytes()
    m = _XML_ENCODING.match(raw.lstrip(b"\xef\xbb\xbf"))
    declared = m.group(1).decode().lower() if m else None
    try:
        if declared in ("utf-8", "utf8", "utf-16", "iso-8859-1", "latin-1", "us-ascii", "ascii"):
            return ET.fromstring(raw)
        if declared is None:
            text = read_text(xml)
        else:
            try:
                text = raw.decode(declared)
            except LookupError:
                raise DataError(f"{xml}: declares encoding {declared!r}, which Python does not know") from None
            except UnicodeDecodeError as e:
                raise DataError(f"{xml}: not valid {declared} (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
        # Parsed as text, without its declaration (ElementTree refuses a str that declares one).
        return ET.fromstring(re.sub(r"^\s*<\?xml[^>]*\?>", "", text.lstrip("\ufeff"), count=1))
    except ET.ParseError as e:
        line, col = e.position
        raise DataError(f"{xml}: invalid XML at line {line} column {col}") from None


def _parse_voc_xml(xml: Path) -> tuple[int, int, list[tuple[str, float, float, float, float, int]], Optional[str]]:
    """``(width, height, [(name, xmin, ymin, xmax, ymax, difficult)], filename)`` of one XML."""
    if not xml.is_file():
        raise DataError(f"{xml}: annotation file not found")
    top = _parse_xml(xml)
    size = top.find("size")
    w = h = 0.0  # no <size>, an empty one or 0 x 0: the image's own header says (load_voc)
    given = [size is not None and (size.findtext(t) or "").strip() != "" for t in ("width", "height")]
    if any(given):  # one of the two alone is a broken file, named below
        w, h = (_xml_number(xml, size, t, "<size>") for t in ("width", "height"))
    if (w, h) != (0, 0) and (w <= 0 or h <= 0 or w != int(w) or h != int(h)):
        raise DataError(f"{xml}: <size> must be positive integers (or 0, or absent: read from the image), "
                        f"got {w:g}x{h:g}")
    objects = []
    for k, obj in enumerate(top.findall("object")):
        where = f"object {k}: "
        name = _xml_text(xml, obj, "name", where)
        box = obj.find("bndbox")
        if box is None:
            raise DataError(f"{xml}: {where}<bndbox> missing")
        coords = [_xml_number(xml, box, t, f"{where}<bndbox>") for t in ("xmin", "ymin", "xmax", "ymax")]
        diff = obj.find("difficult")
        difficult = 0
        if diff is not None and diff.text is not None and diff.text.strip():
            if diff.text.strip() not in ("0", "1"):
                raise DataError(f"{xml}: {where}<difficult> must be 0 or 1, got {diff.text.strip()!r}")
            difficult = int(diff.text.strip())
        objects.append((name, *coords, difficult))
    fn = top.find("filename")
    return int(w), int(h), objects, (fn.text.strip() if fn is not None and fn.text else None)


def voc_class_names(root: Path, found: set[str]) -> list[str]:
    """``label_list.txt`` if present; else the 20 VOC classes if they cover ``found``; else sorted ``found``."""
    lst = root / "label_list.txt"
    if lst.is_file():
        names = [line.strip() for line in read_text(lst).splitlines() if line.strip()]
        if not names:
            raise DataError(f"{lst}: no class names")
        return names
    if found <= set(VOC_CLASSES):
        return list(VOC_CLASSES)
    return sorted(found)


def _voc_image(root: Path, image_id: str, fname: Optional[str]) -> Path:
    """``JPEGImages/<id>.jpg``, or the XML's ``<filename>`` where that is not there."""
    f = root / "JPEGImages" / f"{image_id}.jpg"
    return root / "JPEGImages" / fname if not f.is_file() and fname else f


def _voc_folder(root: Path, split: str) -> Path:
    """The split's folder of a VOC set kept as folders of images with their XMLs beside
    them (Roboflow's Pascal VOC export: ``train/``, ``valid/``, ``test/``; LabelImg's saves
    sorted into ``train/`` and ``val/``)."""
    names = coco.SPLIT_FOLDERS[split]
    folder = next((root / n for n in names if (root / n).is_dir()), None)
    if folder is None:
        raise DataError(f"--data {root}: no {' or '.join(n + '/' for n in names)} folder (the {split} images "
                        "with their VOC XMLs beside them)")
    return folder


def _is_voc_root(root: Path) -> bool:
    """A Pascal VOC root: ``Annotations/`` and ``ImageSets/`` (its lists name the splits, even
    where split folders of images are there too)."""
    return (root / "Annotations").is_dir() and (root / "ImageSets").is_dir()


def _is_xml(f: Path) -> bool:
    return f.suffix.lower() == ".xml" and f.is_file()


def is_voc_folders(root: Path) -> bool:
    """Whether ``root`` holds a VOC set as folders (see :func:`_voc_folder`): a split's
    folder (``train/``, ``valid/``, ``val/``, ``test/``) with XMLs in it, at any depth."""
    folders = {root / n for names in coco.SPLIT_FOLDERS.values() for n in names}
    return any(next(filter(_is_xml, d.rglob("*")), None) is not None for d in folders if d.is_dir())


def _voc_split(root: Path, split: str) -> tuple[Path, list[Optional[Path]], Optional[list[Path]], list, list]:
    """What one split of a VOC set is made of: the file that describes it (the ids' list, or
    the folder), each image's XML (None: an image without one, read as background), the image
    files (None: found from the XMLs, ``_voc_image``), ``(reason, path)`` of the files not
    read, and the images read as background for want of an XML (counted in the report: a
    Roboflow export writes an XML for every image, so there one means lost labels)."""
    if _is_voc_root(root) or not is_voc_folders(root):
        lst, ids = _voc_ids(root, split)
        return lst, [root / "Annotations" / f"{i}.xml" for i in ids], None, [], []
    folder = _voc_folder(root, split)
    return (folder, *voc_pairs(root, folder))


def voc_pairs(root: Path, folder: Path) -> tuple[list[Optional[Path]], list[Path], list, list]:
    """The images under ``folder`` (subfolders too, as the YOLO reader) and the XML beside
    each (None: none), the files not read and the images without an XML (see :func:`_voc_split`)."""
    found = sorted(f for f in folder.rglob("*") if f.is_file())
    images = [f for f in found if f.suffix.lower() in IMAGE_EXTS]
    xmls = {f.with_suffix(""): f for f in found if f.suffix.lower() == ".xml"}  # by folder and stem
    if not images:
        raise DataError(f"--data {root}: no images in {folder}")
    taken = [xmls.get(f.with_suffix("")) for f in images]
    paired = set(taken)
    ignored = [("label file without an image", str(x)) for x in xmls.values() if x not in paired]
    ignored += [(coco.CAMERA_FORMAT if f.suffix.lower() in CAMERA_EXTS else "not an image file", str(f))
                for f in found if f.suffix.lower() not in (*IMAGE_EXTS, ".xml")]
    background = [str(f) for f, x in zip(images, taken) if x is None]
    return taken, images, ignored, background


def voc_objects(xml: Optional[Path]) -> list[tuple[str, float, float, float, float, int]]:
    """``(name, xmin, ymin, xmax, ymax, difficult)`` of each object of an XML (None: an image without one)."""
    return [] if xml is None else _parse_voc_xml(xml)[2]


def load_voc(data: str, split: str, *, train: bool, keep_empty=None, check_images: str = "open",
             cache_dir=None) -> CocoDataset:
    """One split of a Pascal VOC set: a VOC root, or folders of images with their XMLs (see
    the module docstring)."""
    root = Path(data).expanduser().absolute()
    source, xmls, listed, ignored, background = _voc_split(root, split)
    parsed = [_parse_voc_xml(x) if x is not None else (0, 0, [], None) for x in xmls]
    # Class names come from the train and val splits, so that train, val and test get the
    # same labels (a set with neither: from this split).
    listed_names = (root / "label_list.txt").is_file()
    found: set[str] = set()
    if not listed_names:
        this = {o[0] for p in parsed for o in p[2]}
        for other in ("train", "val"):
            if other == split:
                found |= this
                continue
            try:
                other_xmls = _voc_split(root, other)[1]
            except DataError:  # no such split: the names of the others
                continue
            found |= {o[0] for x in other_xmls for o in voc_objects(x)}
        found = found or this
    # A VOC root's classes default to VOC's 20 (a VOC year's subset); a set kept as folders is
    # a set of its own: the names found.
    names = voc_class_names(root, found) if listed is None or listed_names else sorted(found)
    where_names = (f"not in {root / 'label_list.txt'}" if listed_names
                   else "in no train or val XML: a model trained on this set does not know it")
    return _voc_dataset(root, source, xmls, parsed, listed, ignored, background, names, where_names, train=train,
                        keep_empty=keep_empty, check_images=check_images, cache_dir=cache_dir)


def load_voc_folder(folder: Path, *, check_images: str = "open", cache_dir=None) -> CocoDataset:
    """Every image under ``folder`` with the XML beside it, as one set whose classes are the
    names found (LabelImg's PascalVOC saves in one folder, before ``fastdet.data split``)."""
    folder = folder.expanduser().absolute()
    xmls, images, ignored, background = voc_pairs(folder, folder)
    parsed = [_parse_voc_xml(x) if x is not None else (0, 0, [], None) for x in xmls]
    names = sorted({o[0] for p in parsed for o in p[2]})
    return _voc_dataset(folder, folder, xmls, parsed, images, ignored, background, names, "", train=False,
                        check_images=check_images, cache_dir=cache_dir)


def _voc_dataset(root: Path, source: Path, xmls: list[Optional[Path]], parsed: list, listed: Optional[list[Path]],
                 ignored: list, background: list, names: list[str], where_names: str, *, train: bool,
                 keep_empty=None, check_images: str = "open", cache_dir=None) -> CocoDataset:
    """The images and parsed XMLs of one VOC split (see :func:`_voc_split`) as a dataset of ``names``."""
    label = {n: i for i, n in enumerate(names)}
    images, anns, files = [], [], []
    skips = []
    where: dict[int, str] = {}
    image_files = listed or [_voc_image(root, x.stem, p[3]) for x, p in zip(xmls, parsed)]
    # Images whose XML gives no size: their headers, read in one pass.
    unsized = [f for f, p in zip(image_files, parsed) if p[:2] == (0, 0) and f.is_file()]
    probed = dict(zip(unsized, _probe_sizes(unsized, "open", cache_dir)[0]))  # upright, as load_coco_doc checks
    for n, (xml, f, (w, h, objects, _)) in enumerate(zip(xmls, image_files, parsed)):
        if not f.is_file():
            skips.append(("missing file", str(f)))
            continue
        if (w, h) == (0, 0):
            if probed.get(f) is None:
                skips.append(("corrupt", str(f)))
                continue
            w, h = probed[f]
        image_id = n + 1
        images.append({"id": image_id, "file_name": str(f), "width": w, "height": h})
        files.append(f)
        for k, (name, x0, y0, x1, y1, difficult) in enumerate(objects):
            if name not in label:
                raise DataError(f"{xml}: object {k}: class {name!r} is {where_names}")
            anns.append(_annotation(len(anns) + 1, image_id, label[name], x0 - 1, y0 - 1, x1, y1, difficult))
            where[len(anns)] = f"{xml} object {k}"
    doc = {"images": images, "annotations": anns, "categories": _categories(names)}
    if not files:
        raise DataError(f"{source}: none of the listed images is in {root / 'JPEGImages'}" if listed is None
                        else f"{source}: none of its images could be read ({len(skips)} corrupt)")
    # The XML sizes are checked against the files as COCO's are (size mismatch: skipped).
    root_dir = Path(os.path.commonpath([str(x.parent) for x in files]))
    for im in doc["images"]:
        im["file_name"] = str(Path(im["file_name"]).relative_to(root_dir))
    return coco.load_coco_doc(doc, source, root_dir, train=train, keep_empty=keep_empty, check_images=check_images,
                              cache_dir=cache_dir, in_memory=True, prior_skips=skips, crowd_reason="difficult",
                              ann_where=where, ignored_files=ignored,
                              changed_images=[(coco.NO_XML, f) for f in background])
