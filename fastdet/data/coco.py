"""Reading COCO-format ``instances`` files into per-image records, with a report.

``resolve_data`` turns the data section of the config into four paths;
``load_coco`` reads one annotation file into :class:`CocoDataset`.

What the records hold (``fastdet.data.records.ImageRecord``):

- boxes converted from COCO ``[x, y, w, h]`` to ``[x0, y0, x1, y1]`` pixels and clipped
  to the image; boxes narrower or lower than 1 px after clipping are dropped
  ("degenerate"), boxes with no overlap with the image are dropped ("outside image");
- crowd boxes (``iscrowd: 1``) are never in the records. Training must not learn them
  as objects; evaluation scores against the ORIGINAL annotation file through
  pycocotools, which treats crowd regions as "ignore", so nothing is lost there;
- images without boxes are kept for evaluation; for training only with ``keep_empty``;
- labels are contiguous ``0..C-1`` in the order of the file's ``categories`` array;
  ``CocoDataset.cat_ids[label]`` maps back to the COCO category id. A category that only
  groups the others (named as their ``supercategory``, with no box: Roboflow's first) is
  no class; the report names it (``coco_fields.grouping_categories``).

Errors that make the file unusable raise :class:`DataError` with one line naming the
file and the field: a missing annotation file or image directory, invalid JSON (with
line and column), a missing or mistyped top-level key or field, an annotation whose
``image_id`` or ``category_id`` is not declared, a ``bbox`` that is not 4 finite numbers.
Problems training can go on with are counted in :class:`DataReport` and summarised
in one line: dropped boxes (crowd, degenerate, outside image) and skipped images
(missing file, corrupt: the file does not open or decode, size mismatch: the file's
size differs from the JSON ``width``/``height``, so the boxes cannot be trusted;
without boxes: training images left empty when ``keep_empty`` is off). The boxes of a
skipped image are not counted again as dropped boxes.

Image checks (``check_images``): ``"none"`` trusts the JSON; ``"open"`` (default)
checks that each file exists, that Pillow reads its header and that the size matches;
``"decode"`` also decodes every pixel. With a ``cache_dir`` the results are stored in
``<cache_dir>/image_checks/<hash of the image dir>.json`` keyed by file name, size and
modification time, so a COCO-sized set is verified once. A result from a stricter check
is reused by a weaker one (a file found corrupt by ``"decode"`` stays skipped).

Skipped images are absent from ``records``; an evaluator should restrict pycocotools to
``CocoDataset.image_ids`` so they are not scored as misses (the report says they were skipped).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath
from typing import Any, Iterable, Optional

import numpy as np
from PIL import Image

from fastdet.config import DataConfig
from fastdet.data import demo
from fastdet.data.coco_fields import fill_coco_defaults, grouping_categories, is_number as _is_number
from fastdet.data.records import ImageRecord

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A problem with the user's data; the message is one line naming the file and field."""


@dataclass(frozen=True)
class DataPaths:
    train_ann: Path
    train_images: Path
    val_ann: Path
    val_images: Path


def coco_layout(root: str | Path) -> DataPaths:
    """The standard COCO 2017 layout under ``root`` (also the demo set's)."""
    root = Path(root)
    return DataPaths(
        train_ann=demo.ann_path(root, "train"),
        train_images=demo.image_dir(root, "train"),
        val_ann=demo.ann_path(root, "val"),
        val_images=demo.image_dir(root, "val"),
    )


# The names a split goes by in COCO-format exports, in the order they are looked for: COCO
# 2017's (train2017/), MMDetection's and Roboflow's (train/, valid/), CVAT's subsets (Train,
# Validation). Position i < 3 of train, val and test is one naming scheme (the names a
# missing split is reported under); the val names after the third are only looked for.
COCO_SUBSETS = {"train": ("train2017", "train", "Train"),
                "val": ("val2017", "val", "Validation", "valid", "Val", "validation"),
                "test": ("test2017", "test", "Test")}
_VAL_ALIAS_SCHEME = {"valid": 1, "Val": 2, "validation": 1}
# Roboflow's COCO export: one folder per split (train, valid, test), each holding its images and this file.
ROBOFLOW_ANN = "_annotations.coco.json"
# The folders of a set kept as one folder per split (Roboflow's COCO and VOC exports, VOC
# XMLs sorted by split): each split's names, the first the one a missing split is named by.
SPLIT_FOLDERS = {"train": ("train",), "val": ("valid", "val"), "test": ("test",)}


def find_split(root: Path, split: str, kind: Optional[str] = None) -> Optional[tuple[str, str]]:
    """How ``split`` is laid out under a COCO-format ``root``: ``("roboflow", name)`` for
    ``<name>/_annotations.coco.json``, ``("instances", name)`` for
    ``annotations/instances_<name>.json`` (only that ``kind`` when given); None when it is
    not there."""
    for name in COCO_SUBSETS[split]:
        if kind in (None, "roboflow") and (root / name / ROBOFLOW_ANN).is_file():
            return "roboflow", name
        if kind in (None, "instances") and (root / "annotations" / f"instances_{name}.json").is_file():
            return "instances", name
    return None


def coco_layout_of(root: Path) -> Optional[tuple[str, str, str]]:
    """``(kind, split, name)`` of the first of train, val, test found under ``root``
    (:func:`find_split`): the layout every split of the set is read in; None: no COCO layout."""
    for split in COCO_SUBSETS:
        found = find_split(root, split)
        if found is not None:
            return found[0], split, found[1]
    return None


def split_paths(root: str | Path, split: str) -> tuple[Path, Path]:
    """The annotation file and image folder of ``split`` (train, val, test) under a
    COCO-format ``root``:

    - ``annotations/instances_<name>.json`` with the images in ``<name>/`` (COCO 2017:
      ``train2017/``; MMDetection's) or, where there is none, ``images/<name>/`` (CVAT's and
      Datumaro's COCO export);
    - ``<name>/_annotations.coco.json`` with the images beside it (Roboflow's COCO export);

    ``<name>`` one of :data:`COCO_SUBSETS`. Every split is read in the layout of the first
    one found (:func:`coco_layout_of`: a COCO root with a Roboflow export inside is read as
    the COCO root). A split that is not there is given the paths its name has in that
    layout's scheme (COCO 2017's when there is none), for the caller to name as missing.
    """
    root = Path(root)
    layout = coco_layout_of(root)
    kind = layout[0] if layout else "instances"
    found = find_split(root, split, kind)
    if found is None:
        if kind == "roboflow":
            found = kind, SPLIT_FOLDERS[split][0]
        else:
            name = layout[2] if layout else "train2017"
            index = COCO_SUBSETS[layout[1] if layout else "train"].index(name)
            found = kind, COCO_SUBSETS[split][_VAL_ALIAS_SCHEME.get(name, index) if index >= 3 else index]
    kind, name = found
    if kind == "roboflow":
        return root / name / ROBOFLOW_ANN, root / name
    # COCO 2017's and MMDetection's <name>/ (or a link of fastdet.data split's, even broken:
    # then named as missing), unless it is empty beside CVAT's and Datumaro's images/<name>/.
    own, nested = root / name, root / "images" / name
    if own.is_symlink() or not nested.is_dir():
        images = own
    else:
        images = own if own.is_dir() and next(own.iterdir(), None) is not None else nested
    return root / "annotations" / f"instances_{name}.json", images


_FLAGS = {
    "train_ann": "--train-ann",
    "train_images": "--train-images",
    "val_ann": "--val-ann",
    "val_images": "--val-images",
}


def resolve_data(data_cfg: DataConfig, splits: tuple[str, ...] = ("train", "val")) -> DataPaths:
    """Where the training and validation annotations and images are.

    ``data_cfg.data`` is ``"demo"`` (the built-in set, generated on first use under
    ``data_cfg.cache_dir``) or a COCO-format root: ``annotations/instances_{train,val}2017.json``
    and ``{train,val}2017/`` as COCO 2017 has them, or another export's names
    (:func:`split_paths`). Each of ``train_ann``, ``train_images``, ``val_ann``,
    ``val_images`` that is set overrides the root's path. Every path is checked; a
    missing one raises :class:`DataError` naming the flag and the path. Only the
    ``splits`` asked for are resolved (evaluation needs no training set); the others are None.
    """
    wanted = [k for k in _FLAGS if k.split("_")[0] in splits]
    explicit = {k: getattr(data_cfg, k) for k in _FLAGS}
    base: DataPaths | None = None
    if any(explicit[k] is None for k in wanted):
        root = demo.demo_root(data_cfg.cache_dir) if data_cfg.data == "demo" else Path(data_cfg.data).expanduser()
        if not root.is_dir():
            what = ("a file, not a folder: a COCO file goes with --train-ann/--val-ann and its images with "
                    "--train-images/--val-images; --data takes 'demo', a set's folder, a data.yaml or obj.data"
                    if root.is_file() else "no such directory (expected 'demo' or a COCO root with "
                    "annotations/ and train2017/, val2017/)")
            raise DataError(f"--data {data_cfg.data}: {what}")
        base = DataPaths(*split_paths(root, "train"), *split_paths(root, "val"))
    out: dict[str, Any] = {k: None for k in _FLAGS}
    for key in wanted:
        flag = _FLAGS[key]
        if explicit[key] is not None:
            path, origin = Path(explicit[key]).expanduser(), flag
        else:
            assert base is not None
            path, origin = getattr(base, key), f"--data {data_cfg.data}"
        is_ann = key.endswith("_ann")
        if is_ann and path.is_dir():
            raise DataError(f"{origin}: {path} is a directory; expected the COCO annotation JSON file")
        if is_ann and not path.is_file():
            raise DataError(f"{origin}: annotation file {path} not found")
        if not is_ann and not path.is_dir():
            raise DataError(f"{origin}: image directory {path} not found")
        out[key] = path
    return DataPaths(**out)


# --------------------------------------------------------------------------- report

CHECK_MODES = ("none", "open", "decode")
# Reasons in the order the summary lists them.
BOX_REASONS = ("crowd", "difficult", "degenerate", "outside image")
IMAGE_REASONS = ("missing file", "corrupt", "size mismatch", "without boxes")
# Boxes kept but changed, and files of a set's folders that the reader did not take.
CHANGE_REASONS = ("clipped to the image",)
UPRIGHT = "turned upright by their EXIF orientation"
NO_XML = "as background: no XML beside them"  # VOC sets kept as folders (fastdet.data.formats)
IMAGE_CHANGE_REASONS = (UPRIGHT, NO_XML)
# Phones save HEIC (iPhone) or DNG (raw) pictures beside JPEGs; no decoder here reads them.
CAMERA_FORMAT = "camera format not read (HEIC, HEIF, DNG: save as JPEG)"
# A YOLO txt beside its image in an images/ folder: ultralytics' rule reads labels/ for it.
LABEL_BESIDE = "label file beside its image, where ultralytics' rule does not look (images/ -> labels/)"
FILE_REASONS = ("label file without an image", LABEL_BESIDE, CAMERA_FORMAT, "not an image file")
_SHOWN_EXAMPLES = 3  # image paths named per reason in the summary


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}es" if word.endswith(("x", "s")) else f"{n} {word}s"


@dataclass
class DataReport:
    """What :func:`load_coco` dropped or skipped, and why.

    ``box_skips`` / ``image_skips`` count per reason (``BOX_REASONS`` / ``IMAGE_REASONS``);
    ``box_changes`` the boxes kept but changed (``CHANGE_REASONS``), ``image_changes`` the
    images read otherwise than stored (``IMAGE_CHANGE_REASONS``); ``files_ignored`` the
    files in a set's image or label folders that the reader did not take (``FILE_REASONS``,
    YOLO sets). ``examples`` holds the first few image paths (image and file reasons) or
    annotations (box reasons: ``file:line`` of a YOLO label, the XML and object of a VOC
    one, the annotation id of a COCO file) per reason.
    """

    ann_file: str
    train: bool
    images_in_file: int = 0
    boxes_in_file: int = 0
    images_kept: int = 0
    boxes_kept: int = 0
    box_skips: Counter = field(default_factory=Counter)
    image_skips: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    filled: Counter = field(default_factory=Counter)  # annotation fields filled in (fill_coco_defaults)
    box_changes: Counter = field(default_factory=Counter)
    image_changes: Counter = field(default_factory=Counter)
    files_ignored: Counter = field(default_factory=Counter)
    # Categories that are no class: they group the others and have no box (grouping_categories).
    categories_left_out: list[str] = field(default_factory=list)

    def count(self, counter: Counter, reason: str, n: int = 1, examples: Iterable[str] = ()) -> None:
        """Add ``n`` to ``counter[reason]`` (``box_skips``, ``image_skips``, ``box_changes`` or
        ``files_ignored``), keeping a few examples."""
        counter[reason] += n
        shown = self.examples.setdefault(reason, [])
        for ex in examples:
            if len(shown) >= _SHOWN_EXAMPLES:
                break
            shown.append(ex)

    @property
    def dropped_boxes(self) -> int:
        return sum(self.box_skips.values())

    @property
    def skipped_images(self) -> int:
        return sum(self.image_skips.values())

    def summary(self) -> str:
        """One line, e.g. ``dropped 3 boxes: 2 degenerate, 1 outside image; skipped 1 image: 1 corrupt (/d/a.jpg)``."""
        parts = []
        if self.categories_left_out:
            n = len(self.categories_left_out)
            parts.append(f"left out {n} {'category' if n == 1 else 'categories'} without boxes that "
                         f"{'groups' if n == 1 else 'group'} the others (the supercategory of the classes): "
                         + ", ".join(self.categories_left_out))
        if self.filled:
            parts.append("filled in " + ", ".join(f"{n} missing '{k}'" for k, n in sorted(self.filled.items()))
                         + " as COCO defines them")
        if self.dropped_boxes:
            reasons = []
            for r in BOX_REASONS:
                if self.box_skips[r]:
                    note = ""
                    if r in ("crowd", "difficult") and not self.train:
                        note = " (scored as ignore regions)" if r == "difficult" else " (scored from the annotation file)"
                    reasons.append(f"{self.box_skips[r]} {r}{note}")
            parts.append(f"dropped {_plural(self.dropped_boxes, 'box')}: " + ", ".join(reasons))
        if self.skipped_images:
            reasons = []
            for r in IMAGE_REASONS:
                n = self.image_skips[r]
                if not n:
                    continue
                shown = self.examples.get(r, []) if r != "without boxes" else []
                more = f", +{n - len(shown)} more" if shown and n > len(shown) else ""
                reasons.append(f"{n} {r}" + (f" ({', '.join(shown)}{more})" if shown else ""))
            parts.append(f"skipped {_plural(self.skipped_images, 'image')}: " + ", ".join(reasons))
        for counter, reasons, verb, noun in ((self.box_changes, CHANGE_REASONS, "changed", "box"),
                                             (self.image_changes, IMAGE_CHANGE_REASONS, "read", "image"),
                                             (self.files_ignored, FILE_REASONS, "ignored", "file")):
            total = sum(counter.values())
            if not total:
                continue
            shown_parts = []
            for r in reasons:
                n = counter[r]
                if n:
                    shown = self.examples.get(r, [])
                    more = f", +{n - len(shown)} more" if shown and n > len(shown) else ""
                    shown_parts.append(f"{n} {r}" + (f" ({', '.join(shown)}{more})" if shown else ""))
            parts.append(f"{verb} {_plural(total, noun)}: " + ", ".join(shown_parts))
        if not parts:
            parts.append("nothing dropped or skipped")
        return "; ".join(parts)


# --------------------------------------------------------------------------- dataset

@dataclass(frozen=True)
class CocoDataset:
    """The records of one annotation file and the category mapping."""

    records: list[ImageRecord]
    cat_ids: list[int]  # contiguous label -> COCO category id (order of the file's `categories`)
    class_names: list[str]
    ann_file: Path
    image_dir: Path
    report: DataReport
    train: bool
    # The COCO ground truth as a dict when the set was not read from a COCO file (YOLO,
    # VOC: built in memory by fastdet.data.formats); None: score against ``ann_file``.
    coco_gt: Optional[dict] = field(default=None, repr=False, compare=False)
    _labels: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_labels", {c: i for i, c in enumerate(self.cat_ids)})

    @property
    def num_classes(self) -> int:
        return len(self.cat_ids)

    @property
    def image_ids(self) -> list[int]:
        return [r.image_id for r in self.records]

    def label_of(self, cat_id: int) -> int:
        """Contiguous label of a COCO category id."""
        try:
            return self._labels[cat_id]
        except KeyError:
            raise KeyError(f"category id {cat_id} is not declared in {self.ann_file}") from None

    def cat_id_of(self, label: int) -> int:
        """COCO category id of a contiguous label (``cat_ids[label]``)."""
        return self.cat_ids[label]

    def __len__(self) -> int:
        return len(self.records)

    def describe(self) -> str:
        """One line for the log: what was read and what the report counted."""
        r = self.report
        # Roboflow's files share one name: their split folder says which one this is.
        name = f"{self.ann_file.parent.name}/{ROBOFLOW_ANN}" if self.ann_file.name == ROBOFLOW_ANN \
            else self.ann_file.name
        return (
            f"{name}: {_plural(r.images_kept, 'image')}, {_plural(r.boxes_kept, 'box')}, "
            f"{_plural(self.num_classes, 'class')}; {r.summary()}"
        )


# --------------------------------------------------------------------------- validation helpers

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read_json(ann_file: Path) -> dict:
    if not ann_file.is_file():
        raise DataError(f"{ann_file}: annotation file not found")
    try:
        with open(ann_file, "rb") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{ann_file}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{ann_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{ann_file}: top level must be a JSON object with images, annotations, categories")
    for key in ("images", "annotations", "categories"):
        if key not in doc:
            raise DataError(f"{ann_file}: missing top-level key '{key}'")
        if not isinstance(doc[key], list):
            raise DataError(f"{ann_file}: top-level key '{key}' must be a list, got {type(doc[key]).__name__}")
    return doc


def _parse_categories(ann_file: Path, cats: list) -> tuple[list[int], list[str]]:
    if not cats:
        raise DataError(f"{ann_file}: 'categories' is empty")
    ids, names, seen = [], [], set()
    for i, c in enumerate(cats):
        where = f"{ann_file}: categories[{i}]"
        if not isinstance(c, dict):
            raise DataError(f"{where}: must be an object with 'id' and 'name'")
        if not _is_int(c.get("id")):
            raise DataError(f"{where}: field 'id' must be an integer, got {c.get('id')!r}")
        if c["id"] in seen:
            raise DataError(f"{where}: duplicate category id {c['id']}")
        name = c.get("name")
        if not isinstance(name, str):
            raise DataError(f"{where} (id {c['id']}): field 'name' must be a string, got {name!r}")
        seen.add(c["id"])
        ids.append(c["id"])
        names.append(name)
    return ids, names


def _parse_images(ann_file: Path, images: list) -> list[tuple[int, str, int, int]]:
    out, seen = [], set()
    for i, im in enumerate(images):
        where = f"{ann_file}: images[{i}]"
        if not isinstance(im, dict):
            raise DataError(f"{where}: must be an object with id, file_name, width, height")
        if not _is_int(im.get("id")):
            raise DataError(f"{where}: field 'id' must be an integer, got {im.get('id')!r}")
        where = f"{where} (id {im['id']})"
        if im["id"] in seen:
            raise DataError(f"{where}: duplicate image id")
        if not isinstance(im.get("file_name"), str) or not im["file_name"]:
            raise DataError(f"{where}: field 'file_name' must be a non-empty string, got {im.get('file_name')!r}")
        for key in ("width", "height"):
            if not _is_int(im.get(key)) or im[key] <= 0:
                raise DataError(f"{where}: field '{key}' must be a positive integer, got {im.get(key)!r}")
        seen.add(im["id"])
        out.append((im["id"], im["file_name"], im["width"], im["height"]))
    return out


def _check_annotation(
    ann_file: Path, i: int, a: Any, image_index: dict[int, int], label_of: dict[int, int]
) -> None:
    """Raise the one-line :class:`DataError` for annotation ``i`` if it is invalid."""
    if not isinstance(a, dict):
        raise DataError(f"{ann_file}: annotations[{i}]: must be an object")
    aid = a.get("id")
    where = f"{ann_file}: annotation id {aid}" if _is_int(aid) else f"{ann_file}: annotations[{i}]"
    image_id = a.get("image_id")
    if not _is_int(image_id):
        raise DataError(f"{where}: field 'image_id' must be an integer, got {image_id!r}")
    if image_id not in image_index:
        raise DataError(f"{where}: image_id {image_id} is not in 'images'")
    cat = a.get("category_id")
    if not _is_int(cat):
        raise DataError(f"{where}: field 'category_id' must be an integer, got {cat!r}")
    if cat not in label_of:
        raise DataError(f"{where}: category_id {cat} is not in 'categories'")
    bbox = a.get("bbox")
    if not isinstance(bbox, list) or len(bbox) != 4 or not all(_is_number(v) for v in bbox):
        raise DataError(f"{where}: field 'bbox' must be 4 finite numbers [x, y, w, h], got {bbox!r}")
    iscrowd = a.get("iscrowd", 0)
    if type(iscrowd) is not int or iscrowd not in (0, 1):
        raise DataError(f"{where}: field 'iscrowd' must be 0 or 1, got {iscrowd!r}")


def _parse_annotations(
    ann_file: Path, anns: list, image_index: dict[int, int], label_of: dict[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate every annotation; return per-annotation arrays.

    Returns ``img`` [A] int64 (index into the images list), ``xywh`` [A, 4] float64,
    ``label`` [A] int64, ``crowd`` [A] bool, ``ann_id`` [A] int64 (-1 when absent).

    The whole list is checked column by column (COCO train has 860k annotations); only
    when a check fails are the annotations walked one by one to name the first bad one.
    """
    n = len(anns)
    try:
        if {type(a) for a in anns} - {dict}:
            raise _Invalid
        image_ids = [a.get("image_id") for a in anns]
        cats = [a.get("category_id") for a in anns]
        bboxes = [a.get("bbox") for a in anns]
        crowd_raw = [a.get("iscrowd", 0) for a in anns]
        if {type(v) for v in image_ids} - {int} or {type(v) for v in cats} - {int}:
            raise _Invalid
        if {type(v) for v in crowd_raw} - {int} or set(crowd_raw) - {0, 1}:
            raise _Invalid
        if {type(b) for b in bboxes} - {list} or {len(b) for b in bboxes} - {4}:
            raise _Invalid
        flat = [v for b in bboxes for v in b]
        if {type(v) for v in flat} - {int, float}:
            raise _Invalid
        xywh = np.array(flat, np.float64).reshape(n, 4)
        if not np.isfinite(xywh).all():
            raise _Invalid
        img = np.array([image_index.get(v, -1) for v in image_ids], np.int64)
        label = np.array([label_of.get(v, -1) for v in cats], np.int64)
        if (img < 0).any() or (label < 0).any():
            raise _Invalid
    except _Invalid:
        for i, a in enumerate(anns):
            _check_annotation(ann_file, i, a, image_index, label_of)
        raise AssertionError("an annotation failed the column checks but passed the per-item check") from None
    crowd = np.array(crowd_raw, bool)
    ann_id = np.array([a["id"] if type(a.get("id")) is int else -1 for a in anns], np.int64)
    return img, xywh, label, crowd, ann_id


class _Invalid(Exception):
    """Some annotation is invalid; which one is found by the per-item check."""


# --------------------------------------------------------------------------- image checks

_LEVEL = {"open": 1, "decode": 2}


# EXIF orientations that turn the picture a quarter: its upright width and height swap.
_QUARTER_TURNS = (5, 6, 7, 8)


def _probe(path: Path, level: int) -> tuple[str, int, int, int, int, str, int]:
    """Check one file: ``(status, size, mtime_ns, width, height, detail, orientation)``.

    ``status`` is ``"ok"``, ``"missing file"`` or ``"corrupt"``; level 1 reads the header,
    level 2 decodes all pixels. ``width, height`` are the upright picture's, after its EXIF
    orientation (1..8, 1 = as stored), which every decoder here applies (as OpenCV's
    imread, ultralytics and a photo viewer do): a phone's sideways-stored photo is labelled
    upright.
    """
    try:
        st = path.stat()
    except OSError:
        return "missing file", -1, -1, 0, 0, "", 1
    try:
        with Image.open(path) as im:
            w, h = im.size
            orientation = int(im.getexif().get(0x0112, 1) or 1)
            if level >= 2:
                im.load()
    except Exception as e:  # noqa: BLE001 - any failure to read the file means it does not decode
        return "corrupt", st.st_size, st.st_mtime_ns, 0, 0, f"{type(e).__name__}: {e}"[:200], 1
    if orientation not in range(1, 9):
        orientation = 1  # out of range: viewers and PIL's exif_transpose leave the picture as stored
    if orientation in _QUARTER_TURNS:
        w, h = h, w
    return "ok", st.st_size, st.st_mtime_ns, w, h, "", orientation


def _cache_file(cache_dir: str | Path, image_dir: Path) -> Path:
    key = hashlib.sha1(str(image_dir.resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "image_checks" / f"{key}.json"


def _load_cache(path: Path, image_dir: Path) -> dict[str, list]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("image_dir") != str(image_dir.resolve()):
        return {}
    entries = doc.get("entries")
    return entries if isinstance(entries, dict) else {}


def _save_cache(path: Path, image_dir: Path, entries: dict[str, list]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"image_dir": str(image_dir.resolve()), "entries": entries}))
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written cache
    except OSError as e:  # a read-only cache only costs the next run another check
        log.warning("could not write the image-check cache %s: %s", path, e)
        if tmp.is_file():
            tmp.unlink()


def _check_images(
    image_dir: Path, file_names: list[str], mode: str, cache_dir: str | Path | None
) -> list[tuple[str, int, int, str, int]]:
    """``(status, width, height, detail, orientation)`` per file (upright sizes, see
    :func:`_probe`), reusing cached results when valid."""
    level = _LEVEL[mode]
    cache_path = _cache_file(cache_dir, image_dir) if cache_dir is not None else None
    cache = _load_cache(cache_path, image_dir) if cache_path is not None else {}
    results: list[tuple[str, int, int, str, int] | None] = [None] * len(file_names)
    todo = []
    for i, name in enumerate(file_names):
        entry = cache.get(name)
        # 8 fields: a cache written before orientations were kept holds stored sizes, re-probed.
        if entry is not None and len(entry) == 8 and entry[2] >= level:
            size, mtime, _, w, h, status, detail, orientation = entry
            try:
                st = (image_dir / name).stat()
            except OSError:
                st = None
            if st is not None and st.st_size == size and st.st_mtime_ns == mtime:
                results[i] = (status, w, h, detail, orientation)
                continue
        todo.append(i)
    if todo:
        paths = [image_dir / file_names[i] for i in todo]
        # Pillow releases the GIL while reading and decoding, so threads scale here.
        workers = min(16, os.cpu_count() or 1, max(1, len(todo) // 64))
        if workers > 1:
            with ThreadPoolExecutor(workers) as ex:
                probed = list(ex.map(lambda p: _probe(p, level), paths, chunksize=64))
        else:
            probed = [_probe(p, level) for p in paths]
        for i, (status, size, mtime, w, h, detail, orientation) in zip(todo, probed):
            results[i] = (status, w, h, detail, orientation)
            if status != "missing file":
                cache[file_names[i]] = [size, mtime, level, w, h, status, detail, orientation]
        if cache_path is not None:
            _save_cache(cache_path, image_dir, cache)
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------- load_coco

def load_coco(
    ann_file: str | Path,
    image_dir: str | Path,
    *,
    train: bool,
    keep_empty: Optional[bool] = None,
    check_images: str = "open",
    cache_dir: str | Path | None = None,
) -> CocoDataset:
    """Read a COCO ``instances`` file into records.

    Args:
        ann_file: the JSON annotation file.
        image_dir: the folder the images' ``file_name`` are relative to.
        train: training records (crowd boxes dropped; images without boxes only with
            ``keep_empty``) or evaluation records (images without boxes kept).
        keep_empty: keep images without boxes; default False for training, True for evaluation.
        check_images: ``"none"``, ``"open"`` or ``"decode"`` (see the module docstring).
        cache_dir: where image-check results are cached (``~`` expanded); None: no cache.

    Raises:
        DataError: one line naming the file and field, for input that cannot be used.
    """
    ann_file = Path(ann_file).expanduser()
    if check_images not in CHECK_MODES:
        raise DataError(f"check_images must be one of {', '.join(CHECK_MODES)}, got {check_images!r}")
    doc = _read_json(ann_file)
    return load_coco_doc(doc, ann_file, image_dir, train=train, keep_empty=keep_empty,
                         check_images=check_images, cache_dir=cache_dir)


def load_coco_doc(
    doc: dict,
    ann_file: str | Path,
    image_dir: str | Path,
    *,
    train: bool,
    keep_empty: Optional[bool] = None,
    check_images: str = "open",
    cache_dir: str | Path | None = None,
    in_memory: bool = False,
    prior_skips: Iterable[tuple[str, str]] = (),
    crowd_reason: str = "crowd",
    ann_where: Optional[dict[int, str]] = None,
    ignored_files: Iterable[tuple[str, str]] = (),
    turned_upright: Iterable[str] = (),
    changed_images: Iterable[tuple[str, str]] = (),
) -> CocoDataset:
    """:func:`load_coco` on an already-read COCO document.

    The YOLO and VOC readers (``fastdet.data.formats``) build ``doc`` in memory and pass
    ``in_memory=True``: the dataset then keeps it as ``coco_gt``, the ground truth the
    evaluator scores against (``ann_file`` names the file the set was described by, for
    messages). ``prior_skips`` are ``(reason, image path)`` of images the reader already
    found unusable (left out of ``doc``): they are counted in the report like the others.
    ``crowd_reason`` names the ``iscrowd`` boxes in the report (VOC: ``"difficult"``).
    ``ann_where`` names an annotation id's source for the report's examples (an in-memory
    id means nothing to the user: ``labels/x.txt:3``); ``ignored_files`` are ``(reason,
    path)`` of the files the reader did not take (``FILE_REASONS``); ``turned_upright`` the
    images whose EXIF orientation the reader's size check already applied; ``changed_images``
    ``(reason, path)`` of the images the reader read otherwise (``IMAGE_CHANGE_REASONS``).
    """
    ann_file = Path(ann_file).expanduser()
    image_dir = Path(image_dir).expanduser().absolute()
    if check_images not in CHECK_MODES:
        raise DataError(f"check_images must be one of {', '.join(CHECK_MODES)}, got {check_images!r}")
    if keep_empty is None:
        keep_empty = not train
    filled = fill_coco_defaults(doc)
    if not image_dir.is_dir():
        raise DataError(f"{image_dir}: image directory not found (images of {ann_file})")
    cat_ids, class_names = _parse_categories(ann_file, doc["categories"])
    # Categories that only group the others (Roboflow's first one) are no class; the scorer
    # leaves the same ones out of the ground truth (fastdet.eval.scoring.load_gt).
    left_out = {c["id"]: c["name"] for c in grouping_categories(doc)}
    class_names = [n for i, n in zip(cat_ids, class_names) if i not in left_out]
    cat_ids = [i for i in cat_ids if i not in left_out]
    groups = [f"'{name}' (id {i})" for i, name in left_out.items()]
    # Classes are told apart by name wherever two class lists meet (fine-tuning's head rows,
    # evaluation's category ids, a resume's check): two of one name would be matched to one.
    named: dict[str, int] = {}
    for i, name in zip(cat_ids, class_names):
        if name in named:
            raise DataError(f"{ann_file}: categories {named[name]} and {i} are both named {name!r}: classes are "
                            "matched by name (fine-tuning, evaluation, resuming), so each needs its own: rename one")
        named[name] = i
    images = _parse_images(ann_file, doc["images"])
    image_index = {im[0]: i for i, im in enumerate(images)}
    label_of = {c: i for i, c in enumerate(cat_ids)}
    img, xywh, label, crowd, ann_id = _parse_annotations(ann_file, doc["annotations"], image_index, label_of)
    gt = doc if in_memory else None
    del doc

    prior_skips = list(prior_skips)
    report = DataReport(ann_file=str(ann_file), train=train, images_in_file=len(images) + len(prior_skips),
                        boxes_in_file=len(img), filled=filled, categories_left_out=groups)
    for reason, path in prior_skips:
        report.count(report.image_skips, reason, examples=[path])
    for reason, path in ignored_files:
        report.count(report.files_ignored, reason, examples=[path])
    turned_upright = dict.fromkeys(turned_upright)  # in order, for the examples
    for path in turned_upright:
        report.count(report.image_changes, UPRIGHT, examples=[path])
    for reason, path in changed_images:
        report.count(report.image_changes, reason, examples=[path])
    where = ann_where or {}

    def named(ids: np.ndarray) -> Iterable[str]:
        return (where.get(int(a), f"annotation id {a}") for a in ids[:_SHOWN_EXAMPLES])
    # Image sizes: [I] as decoded (checked) or as declared (check_images="none").
    widths = np.array([im[2] for im in images], np.float64)
    heights = np.array([im[3] for im in images], np.float64)
    usable = np.ones(len(images), bool)
    if check_images != "none":
        checks = _check_images(image_dir, [im[1] for im in images], check_images, cache_dir)
        for i, ((_, name, w, h), (status, fw, fh, detail, orientation)) in enumerate(zip(images, checks)):
            path = str(image_dir / name)
            if status == "ok" and (fw, fh) != (w, h):
                turned = " upright (EXIF orientation {})".format(orientation) if orientation != 1 else ""
                status, detail = "size mismatch", f"{path}: file is {fw}x{fh}{turned}, JSON says {w}x{h}"
            if status == "ok" and orientation != 1 and path not in turned_upright:  # a reader's probe counted it
                report.count(report.image_changes, UPRIGHT, examples=[path])
            if status != "ok":
                usable[i] = False
                report.count(report.image_skips, status, examples=[path])
                if detail:
                    log.debug("%s: %s", status, detail)

    # Boxes of usable images only; reasons in precedence order crowd > degenerate/outside.
    keep_ann = usable[img]
    img, xywh, label, crowd, ann_id = img[keep_ann], xywh[keep_ann], label[keep_ann], crowd[keep_ann], ann_id[keep_ann]
    W, H = widths[img], heights[img]
    x0, y0 = xywh[:, 0], xywh[:, 1]
    x1, y1 = x0 + xywh[:, 2], y0 + xywh[:, 3]
    cx0, cy0 = np.clip(x0, 0, W), np.clip(y0, 0, H)
    cx1, cy1 = np.clip(x1, 0, W), np.clip(y1, 0, H)
    cw, ch = cx1 - cx0, cy1 - cy0
    tiny = (xywh[:, 2] < 1) | (xywh[:, 3] < 1)
    outside = ~crowd & ~tiny & ((x1 <= 0) | (y1 <= 0) | (x0 >= W) | (y0 >= H))
    degenerate = ~crowd & ~outside & (tiny | (cw < 1) | (ch < 1))
    for reason, m in ((crowd_reason, crowd), ("degenerate", degenerate), ("outside image", outside)):
        n = int(m.sum())
        if n:
            report.count(report.box_skips, reason, n, named(ann_id[m]))
    kept = ~(crowd | degenerate | outside)
    clipped = kept & ((cx0 != x0) | (cy0 != y0) | (cx1 != x1) | (cy1 != y1))
    if clipped.any():
        report.count(report.box_changes, "clipped to the image", int(clipped.sum()), named(ann_id[clipped]))
    boxes = np.stack([cx0, cy0, cx1, cy1], axis=1)[kept].astype(np.float32)  # [K, 4]
    labels = label[kept]
    owner = img[kept]
    order = np.argsort(owner, kind="stable")  # keeps the file's annotation order per image
    boxes, labels, owner = boxes[order], labels[order], owner[order]
    starts = np.searchsorted(owner, np.arange(len(images) + 1))

    records = []
    for i, (image_id, name, w, h) in enumerate(images):
        if not usable[i]:
            continue
        b, e = starts[i], starts[i + 1]
        if b == e and not keep_empty:
            report.count(report.image_skips, "without boxes")
            continue
        records.append(ImageRecord(
            image_id=image_id,
            file=str(image_dir / name),
            width=w,
            height=h,
            boxes=boxes[b:e].copy(),
            labels=labels[b:e].copy(),
        ))
    report.images_kept = len(records)
    report.boxes_kept = int(sum(len(r.boxes) for r in records))
    dataset = CocoDataset(
        records=records,
        cat_ids=cat_ids,
        class_names=class_names,
        ann_file=ann_file,
        image_dir=image_dir,
        report=report,
        train=train,
        coco_gt=gt,
    )
    if not records:
        hint = _missing_images_hint(image_dir, [im[1] for im in images]) \
            if images and report.image_skips["missing file"] == len(images) else ""
        raise DataError(f"{ann_file}: no usable images in {image_dir} ({report.summary()}){hint}")
    log.info("%s", dataset.describe())
    return dataset


def categories_diff(train: CocoDataset, val: CocoDataset) -> str:
    """What differs between the train and val sets' classes (ids and names), for the line
    that refuses them; with the category a file left out as grouping the others, if any."""
    a, b = list(zip(train.cat_ids, train.class_names)), list(zip(val.cat_ids, val.class_names))
    only = [[f"{n!r} (id {i})" for i, n in x if (i, n) not in y] for x, y in ((a, b), (b, a))]
    text = (f"only in train {', '.join(only[0][:5]) or 'none'}, only in val {', '.join(only[1][:5]) or 'none'}"
            if any(only) else "the same categories in another order")
    for split, ds in (("train", train), ("val", val)):
        if ds.report.categories_left_out:
            text += (f"; {split} left out {', '.join(ds.report.categories_left_out)}: it groups every other "
                     "category and has no box there")
    return text


def _missing_images_hint(image_dir: Path, names: list[str]) -> str:
    """Why none of ``names`` is under ``image_dir``, when the first one shows it: names that
    already start with the folder's own name (Label Studio's ``images/x.jpg`` with the
    ``images`` folder given), or paths of the annotating machine whose base names are here."""
    first = names[0]
    parts = Path(first).parts
    if len(parts) > 1 and parts[0] == image_dir.name and (image_dir.parent / first).is_file():
        return (f"; the file names start with '{parts[0]}/', the images folder's own name: give its parent "
                f"{image_dir.parent} as the images folder")
    windows = PureWindowsPath(first)
    base = windows.name if "\\" in first else Path(first).name
    if base != first and (image_dir / base).is_file():
        if Path(first).is_absolute() or windows.drive:
            return (f"; the file names are paths on the machine that wrote the file ({first}), and the images "
                    f"are in {image_dir} by their base names: write the base names into 'file_name'")
        return (f"; the file names hold folders ({first}) that {image_dir} does not have: the images are there "
                "by their base names; put them in those folders, or write the base names into 'file_name'")
    return ""
