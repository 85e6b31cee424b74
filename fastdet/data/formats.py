"""Datasets as users have them: COCO files, YOLO-format folders and Pascal VOC.

``--data`` says where the set is and its form says which format it is
(:func:`data_format`):

- ``demo`` or a directory with ``annotations/instances_{train,val}2017.json``: COCO
  (``fastdet.data.coco``);
- a ``.yaml``/``.yml`` file, or a directory holding ``data.yaml``: ultralytics' YOLO
  layout (``path``, ``train``, ``val``, ``names``; one ``labels/*.txt`` per image with
  ``class cx cy w h`` normalised to 0..1; an image without a txt, or an empty one, is
  background; a line of more than 5 values is a polygon ``class x1 y1 x2 y2 ...`` and
  its bounding box is used);
- a directory with ``Annotations/`` and ``ImageSets/Main/``: Pascal VOC
  (``ImageSets/Main/{train,val}.txt`` list the image ids, ``Annotations/<id>.xml`` their
  objects, ``JPEGImages/<id>.jpg`` the pictures). Classes: ``label_list.txt`` in the root
  (one name a line, PaddleDetection's file) when present, else the 20 VOC classes when
  every name is one of them, else the sorted names found. ``difficult`` objects are
  ``iscrowd`` regions: never trained on, ignored when scoring (as VOC scores them).
  VOC boxes are 1-based inclusive pixels: ``[xmin - 1, ymin - 1, xmax, ymax]``.

YOLO and VOC sets are turned into a COCO document in memory and read by
:func:`fastdet.data.coco.load_coco_doc`, so they get the same records, the same report
and the same clipping and skip rules; the document is kept on the dataset
(``CocoDataset.coco_gt``) and the evaluator scores against it. Category ids are the
contiguous labels (0..C-1, the YOLO class ids); image ids count from 1 in list order.

Bad input is one :class:`~fastdet.data.coco.DataError` line naming the file (and line):
a label line that is not numbers, a class id not in ``names``, a coordinate outside
0..1, an XML that does not parse or has no ``<size>``, an object whose name is not a
class. Images that are missing or do not open are counted skips, as for COCO.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from fastdet.config import DataConfig
from fastdet.data import coco
from fastdet.data.coco import CocoDataset, DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
               "train", "tvmonitor")
FORMATS = ("coco", "yolo", "voc")
_TOL = 1e-6  # YOLO coordinates written with 6 decimals may round a hair past 0 or 1


def data_format(data: str) -> str:
    """``"coco"``, ``"yolo"`` or ``"voc"`` for the value of ``--data``."""
    if data == "demo":
        return "coco"
    p = Path(data).expanduser()
    if p.suffix in (".yaml", ".yml"):
        return "yolo"
    if p.is_dir():
        if (p / "Annotations").is_dir() and (p / "ImageSets").is_dir():
            return "voc"
        if (p / "data.yaml").is_file() and not (p / "annotations").is_dir():
            return "yolo"
    return "coco"


def load_split(data_cfg: DataConfig, split: str, *, train: Optional[bool] = None,
               check_images: Optional[str] = None) -> CocoDataset:
    """The ``"train"`` or ``"val"`` set of ``--data``, whatever its format.

    ``train`` (default: ``split == "train"``) picks the training rules (empty images only
    with ``data_cfg.keep_empty_train``); ``check_images`` defaults to ``data_cfg``'s.
    """
    train = split == "train" if train is None else train
    check = data_cfg.check_images if check_images is None else check_images
    keep_empty = data_cfg.keep_empty_train if train else None
    fmt = data_format(data_cfg.data)
    if fmt == "coco":
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
        from fastdet.data.demo import CATEGORIES  # demo imports the image writers, needed only here

        return len(CATEGORIES)
    return load_split(data_cfg, "train", check_images="none").num_classes


# --------------------------------------------------------------------------- shared

def _probe_sizes(files: list[Path], check_images: str, cache_dir) -> tuple[list[tuple[int, int] | None],
                                                                          list[tuple[str, str]]]:
    """Each image's (width, height) read from its header, or None; and ``(reason, path)`` skips."""
    root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else Path("/")
    names = [str(f.relative_to(root)) for f in files]
    level = "decode" if check_images == "decode" else "open"
    checks = coco._check_images(root, names, level, cache_dir)
    sizes: list[tuple[int, int] | None] = []
    skips = []
    for f, (status, w, h, _) in zip(files, checks):
        if status == "ok":
            sizes.append((w, h))
        else:
            sizes.append(None)
            skips.append((status, str(f)))
    return sizes, skips


def _finish(doc: dict, source: Path, files: list[Path], *, train: bool, keep_empty, check_images: str,
            cache_dir, prior_skips, crowd_reason: str = "crowd") -> CocoDataset:
    """Read the in-memory document through the COCO layer (file names relative to the images' common root)."""
    root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else source.parent
    for im in doc["images"]:
        im["file_name"] = str(Path(im["file_name"]).relative_to(root))
    # The headers were read to get the sizes ("open"); "decode" is checked again, cached.
    check = "decode" if check_images == "decode" else "none"
    return coco.load_coco_doc(doc, source, root, train=train, keep_empty=keep_empty, check_images=check,
                              cache_dir=cache_dir, in_memory=True, prior_skips=prior_skips,
                              crowd_reason=crowd_reason)


def _categories(names: list[str]) -> list[dict]:
    return [{"id": i, "name": n, "supercategory": ""} for i, n in enumerate(names)]


def _annotation(ann_id: int, image_id: int, cat: int, x0: float, y0: float, x1: float, y1: float,
                crowd: int = 0) -> dict:
    x0, y0, w, h = float(x0), float(y0), float(x1 - x0), float(y1 - y0)
    return {"id": ann_id, "image_id": image_id, "category_id": cat, "bbox": [x0, y0, w, h],
            "area": max(0.0, w) * max(0.0, h), "iscrowd": crowd}


# --------------------------------------------------------------------------- YOLO

def _yolo_yaml(data: str) -> Path:
    p = Path(data).expanduser()
    if p.is_dir():
        p = p / "data.yaml"
    if not p.is_file():
        raise DataError(f"--data {data}: {p} not found")
    return p


def _read_yaml(path: Path) -> dict:
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise DataError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: expected a mapping with path, train, val, names")
    return doc


def yolo_names(path: Path, doc: dict) -> list[str]:
    names = doc.get("names")
    if isinstance(names, dict):
        keys = sorted(names)
        if not all(isinstance(k, int) for k in keys) or keys != list(range(len(keys))):
            raise DataError(f"{path}: field 'names' as a mapping must have the keys 0..N-1, got {keys[:5]}")
        names = [names[k] for k in keys]
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


def _yolo_images(path: Path, root: Path, split: str, entry: Any) -> list[Path]:
    """The image files of a split entry: a folder, a txt list of images, or a list of those."""
    entries = entry if isinstance(entry, list) else [entry]
    files: list[Path] = []
    for e in entries:
        if not isinstance(e, str):
            raise DataError(f"{path}: field '{split}' must be a path or a list of paths, got {e!r}")
        p = Path(e).expanduser()
        p = p if p.is_absolute() else root / p
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_EXTS)
        elif p.is_file() and p.suffix == ".txt":
            for line in p.read_text().splitlines():
                line = line.strip()
                if line:
                    q = Path(line)
                    files.append(q if q.is_absolute() else (p.parent / q if line.startswith("./") else root / q))
        else:
            raise DataError(f"{path}: field '{split}': {p} is neither an image folder nor a .txt list")
    if not files:
        raise DataError(f"{path}: field '{split}': no images ({', '.join(map(str, entries))})")
    return [f.absolute() for f in files]


def yolo_label_path(image: Path) -> Path:
    """ultralytics' rule: the last ``/images/`` of the path becomes ``/labels/``, the suffix ``.txt``."""
    s = str(image)
    a, b = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    if a in s:
        s = b.join(s.rsplit(a, 1))
    return Path(s).with_suffix(".txt")


def _yolo_boxes(label: Path, num_classes: int) -> list[tuple[int, float, float, float, float]]:
    """``(class, cx, cy, w, h)`` per line of one label file (normalised)."""
    out = []
    try:
        text = label.read_text()
    except UnicodeDecodeError:
        raise DataError(f"{label}: not a text file") from None
    for n, line in enumerate(text.splitlines(), 1):
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
            raise DataError(f"{label}:{n}: coordinates must be normalised to 0..1, got {' '.join(parts[1:])}")
        if len(vals) > 5:  # polygon: its bounding box
            xs, ys = coords[0::2], coords[1::2]
            x0, x1, y0, y1 = xs.min(), xs.max(), ys.min(), ys.max()
            out.append((int(cls), (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0))
        else:
            out.append((int(cls), *coords.tolist()))
    return out


def load_yolo(data: str, split: str, *, train: bool, keep_empty=None, check_images: str = "open",
              cache_dir=None) -> CocoDataset:
    """One split of an ultralytics ``data.yaml`` set (see the module docstring)."""
    path = _yolo_yaml(data)
    doc = _read_yaml(path)
    names = yolo_names(path, doc)
    root = yolo_root(path, doc)
    if split not in doc or doc[split] is None:
        raise DataError(f"{path}: no '{split}' entry (the {split} images)")
    files = _yolo_images(path, root, split, doc[split])
    sizes, skips = _probe_sizes(files, check_images, cache_dir)
    images, anns, kept = [], [], []
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
        for c, cx, cy, bw, bh in _yolo_boxes(label, len(names)):
            anns.append(_annotation(len(anns) + 1, image_id, c, (cx - bw / 2) * w, (cy - bh / 2) * h,
                                    (cx + bw / 2) * w, (cy + bh / 2) * h))
    coco_doc = {"images": images, "annotations": anns, "categories": _categories(names)}
    return _finish(coco_doc, path, kept or files, train=train, keep_empty=keep_empty, check_images=check_images,
                   cache_dir=cache_dir, prior_skips=skips)


# --------------------------------------------------------------------------- VOC

def _voc_ids(root: Path, split: str) -> tuple[Path, list[str]]:
    lst = root / "ImageSets" / "Main" / f"{split}.txt"
    if not lst.is_file():
        raise DataError(f"--data {root}: {lst} not found (the {split} image ids of a VOC set)")
    ids = [line.split()[0] for line in lst.read_text().splitlines() if line.strip()]
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


def _parse_voc_xml(xml: Path) -> tuple[int, int, list[tuple[str, float, float, float, float, int]], Optional[str]]:
    """``(width, height, [(name, xmin, ymin, xmax, ymax, difficult)], filename)`` of one XML."""
    if not xml.is_file():
        raise DataError(f"{xml}: annotation file not found")
    try:
        top = ET.parse(xml).getroot()
    except ET.ParseError as e:
        line, col = e.position
        raise DataError(f"{xml}: invalid XML at line {line} column {col}") from None
    size = top.find("size")
    if size is None:
        raise DataError(f"{xml}: no <size> (the image's width and height)")
    w, h = (_xml_number(xml, size, t, "<size>") for t in ("width", "height"))
    if w <= 0 or h <= 0 or w != int(w) or h != int(h):
        raise DataError(f"{xml}: <size> must be positive integers, got {w:g}x{h:g}")
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
        names = [line.strip() for line in lst.read_text().splitlines() if line.strip()]
        if not names:
            raise DataError(f"{lst}: no class names")
        return names
    if found <= set(VOC_CLASSES):
        return list(VOC_CLASSES)
    return sorted(found)


def load_voc(data: str, split: str, *, train: bool, keep_empty=None, check_images: str = "open",
             cache_dir=None) -> CocoDataset:
    """One split of a Pascal VOC root (see the module docstring)."""
    root = Path(data).expanduser().absolute()
    lst, ids = _voc_ids(root, split)
    parsed = [_parse_voc_xml(root / "Annotations" / f"{i}.xml") for i in ids]
    # Class names come from both splits, so train and val get the same labels.
    found: set[str] = set()
    for s in ("train", "val"):
        if s == split:
            found |= {o[0] for p in parsed for o in p[2]}
        elif (root / "ImageSets" / "Main" / f"{s}.txt").is_file() and not (root / "label_list.txt").is_file():
            for i in _voc_ids(root, s)[1]:
                found |= {o[0] for o in _parse_voc_xml(root / "Annotations" / f"{i}.xml")[2]}
    names = voc_class_names(root, found)
    label = {n: i for i, n in enumerate(names)}
    images, anns, files = [], [], []
    skips = []
    for n, (image_id_str, (w, h, objects, fname)) in enumerate(zip(ids, parsed)):
        xml = root / "Annotations" / f"{image_id_str}.xml"
        f = root / "JPEGImages" / f"{image_id_str}.jpg"
        if not f.is_file() and fname:
            f = root / "JPEGImages" / fname
        if not f.is_file():
            skips.append(("missing file", str(f)))
            continue
        image_id = n + 1
        images.append({"id": image_id, "file_name": str(f), "width": w, "height": h})
        files.append(f)
        for k, (name, x0, y0, x1, y1, difficult) in enumerate(objects):
            if name not in label:
                raise DataError(f"{xml}: object {k}: class {name!r} is not in {root / 'label_list.txt'}")
            anns.append(_annotation(len(anns) + 1, image_id, label[name], x0 - 1, y0 - 1, x1, y1, difficult))
    doc = {"images": images, "annotations": anns, "categories": _categories(names)}
    if not files:
        raise DataError(f"{lst}: none of the listed images is in {root / 'JPEGImages'}")
    # The XML sizes are checked against the files as COCO's are (size mismatch: skipped).
    root_dir = Path(os.path.commonpath([str(x.parent) for x in files]))
    for im in doc["images"]:
        im["file_name"] = str(Path(im["file_name"]).relative_to(root_dir))
    return coco.load_coco_doc(doc, lst, root_dir, train=train, keep_empty=keep_empty, check_images=check_images,
                              cache_dir=cache_dir, in_memory=True, prior_skips=skips, crowd_reason="difficult")
