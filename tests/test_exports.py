"""Sets shaped as annotation tools and phones leave them, made here from the small demo set:
Roboflow's YOLO, COCO and Pascal VOC exports, CVAT's COCO 1.0 (per task, and a project's
Train/Validation subsets) and YOLO 1.1 exports, MMDetection's COCO layout,
LabelImg's VOC XMLs beside the images and its YOLO txt + classes.txt, Label Studio's COCO and YOLO exports, and a
phone's JPEGs (.jpg/.JPG/.jpeg, one stored sideways, one .HEIC).

Each goes through ``python -m fastdet.data check`` (what the report says: counts, and
examples naming the files), or is refused in one line saying what to change, after which
the set as changed is read; the exports that name no splits are split by the
``fastdet.data split`` command their refusal gives; one slow test trains every readable
form (two of them as split) for two steps.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from fastdet.config import DataConfig
from fastdet.data.__main__ import main as data_main
from fastdet.data.formats import load_split

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS: tests/conftest.py
SPLITS = ("train", "val")


def _coco(demo_small: Path, split: str) -> dict:
    return json.loads((demo_small / "annotations" / f"instances_{split}2017.json").read_text())


def _names(demo_small: Path) -> list[str]:
    return [c["name"] for c in _coco(demo_small, "train")["categories"]]


def _yolo_lines(doc: dict, im: dict) -> str:
    label = {c["id"]: i for i, c in enumerate(doc["categories"])}
    W, H = im["width"], im["height"]
    return "".join(f"{label[a['category_id']]} {(a['bbox'][0] + a['bbox'][2] / 2) / W!r} "
                   f"{(a['bbox'][1] + a['bbox'][3] / 2) / H!r} {a['bbox'][2] / W!r} {a['bbox'][3] / H!r}\n"
                   for a in doc["annotations"] if a["image_id"] == im["id"])


def _copy(demo_small: Path, split: str, im: dict, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(demo_small / f"{split}2017" / im["file_name"], dst)


def _counts(demo_small: Path) -> dict[str, tuple[int, int]]:
    """(images, boxes) per split of the demo set."""
    return {s: (len(d["images"]), len(d["annotations"])) for s in SPLITS for d in [_coco(demo_small, s)]}


# ----------------------------------------------------------------------------- the exports

def roboflow(demo_small: Path, root: Path) -> list[str]:
    """Roboflow's "YOLOv8" export: ``train/``, ``valid/`` each with ``images/`` and
    ``labels/``, renamed files (``<stem>_jpg.rf.<hash>.jpg``), README files, and a data.yaml
    whose split paths start with ``../`` and that carries a ``roboflow:`` block."""
    for split, folder in zip(SPLITS, ("train", "valid")):
        doc = _coco(demo_small, split)
        for k, im in enumerate(doc["images"]):
            stem = f"{Path(im['file_name']).stem}_jpg.rf.{k:08x}ab12cd34"
            _copy(demo_small, split, im, root / folder / "images" / f"{stem}.jpg")
            lines = _yolo_lines(doc, im)
            (root / folder / "labels").mkdir(parents=True, exist_ok=True)
            if lines:
                (root / folder / "labels" / f"{stem}.txt").write_text(lines)
    (root / "README.roboflow.txt").write_text("Exported via roboflow.com\n")
    (root / "data.yaml").write_text(
        "train: ../train/images\nval: ../valid/images\ntest: ../test/images\n\n"
        f"nc: 4\nnames: {_names(demo_small)!r}\n\nroboflow:\n  workspace: ws\n  project: shapes\n"
        "  version: 1\n  license: CC BY 4.0\n  url: https://universe.roboflow.com/ws/shapes/dataset/1\n")
    return ["--data", str(root / "data.yaml")]


def _roboflow_name(im: dict, k: int) -> str:
    return f"{Path(im['file_name']).stem}_jpg.rf.{k:08x}ab12cd34.jpg"


def roboflow_coco(demo_small: Path, root: Path) -> list[str]:
    """Roboflow's "COCO" export: ``train/``, ``valid/``, ``test/`` each holding its renamed
    images and ``_annotations.coco.json``, ids from 0, and Roboflow's first category: the
    project (id 0, supercategory "none"), named as the supercategory of every class and
    given to no box."""
    for split, folder in (("train", "train"), ("val", "valid"), ("val", "test")):
        doc = _coco(demo_small, split)
        cats = [{"id": 0, "name": "shapes-xyz", "supercategory": "none"}]
        cats += [{"id": i + 1, "name": c["name"], "supercategory": "shapes-xyz"}
                 for i, c in enumerate(doc["categories"])]
        cat = {c["id"]: i + 1 for i, c in enumerate(doc["categories"])}
        image = {im["id"]: k for k, im in enumerate(doc["images"])}
        images = []
        for k, im in enumerate(doc["images"]):
            _copy(demo_small, split, im, root / folder / _roboflow_name(im, k))
            images.append({"id": k, "license": 1, "file_name": _roboflow_name(im, k), "height": im["height"],
                           "width": im["width"], "date_captured": "2026-12-07T08:00:00+00:00"})
        anns = [{"id": j, "image_id": image[a["image_id"]], "category_id": cat[a["category_id"]], "bbox": a["bbox"],
                 "area": a["area"], "segmentation": [], "iscrowd": a.get("iscrowd", 0)}
                for j, a in enumerate(doc["annotations"])]
        (root / folder / "_annotations.coco.json").write_text(json.dumps(
            {"info": {"year": "2026", "version": "1", "description": "Exported from roboflow.com"},
             "licenses": [{"id": 1, "url": "https://creativecommons.org/licenses/by/4.0/", "name": "CC BY 4.0"}],
             "categories": cats, "images": images, "annotations": anns}))
    (root / "README.roboflow.txt").write_text("Exported via roboflow.com\n")
    return ["--data", str(root)]


def _voc_xml(doc: dict, im: dict, file_name: str, folder: str) -> str:
    """A VOC XML of one demo image (1-based inclusive pixels, as VOC writes them)."""
    cat = {c["id"]: c["name"] for c in doc["categories"]}
    objs = "".join(f"<object><name>{cat[a['category_id']]}</name><difficult>0</difficult><bndbox>"
                   f"<xmin>{a['bbox'][0] + 1}</xmin><ymin>{a['bbox'][1] + 1}</ymin>"
                   f"<xmax>{a['bbox'][0] + a['bbox'][2]}</xmax><ymax>{a['bbox'][1] + a['bbox'][3]}</ymax>"
                   f"</bndbox></object>" for a in doc["annotations"] if a["image_id"] == im["id"])
    return (f"<annotation><folder>{folder}</folder><filename>{file_name}</filename><size><width>"
            f"{im['width']}</width><height>{im['height']}</height><depth>3</depth></size>{objs}</annotation>")


def roboflow_voc(demo_small: Path, root: Path) -> list[str]:
    """Roboflow's "Pascal VOC" export: ``train/``, ``valid/``, ``test/`` each holding its
    renamed images with an XML beside each (an image without objects has one too)."""
    for split, folder in (("train", "train"), ("val", "valid"), ("val", "test")):
        doc = _coco(demo_small, split)
        for k, im in enumerate(doc["images"]):
            name = _roboflow_name(im, k)
            _copy(demo_small, split, im, root / folder / name)
            (root / folder / name).with_suffix(".xml").write_text(_voc_xml(doc, im, name, ""))
    (root / "README.roboflow.txt").write_text("Exported via roboflow.com\n")
    return ["--data", str(root)]


def cvat_coco(demo_small: Path, root: Path) -> list[str]:
    """CVAT's "COCO 1.0": one export per task, ``annotations/instances_default.json`` (with
    attributes, empty segmentations, licence fields) beside ``images/``."""
    args = []
    for split in SPLITS:
        doc = _coco(demo_small, split)
        task = root / f"task_{split}"
        for im in doc["images"]:
            _copy(demo_small, split, im, task / "images" / im["file_name"])
            im.update(license=0, flickr_url="", coco_url="", date_captured=0)
        for a in doc["annotations"]:
            a.update(attributes={"occluded": False}, segmentation=[])
        doc.update(licenses=[{"name": "", "id": 0, "url": ""}], info={"contributor": "", "version": ""})
        (task / "annotations").mkdir()
        (task / "annotations" / "instances_default.json").write_text(json.dumps(doc))
        args += [f"--{split}-ann", str(task / "annotations" / "instances_default.json"),
                 f"--{split}-images", str(task / "images")]
    return args


def cvat_coco_subsets(demo_small: Path, root: Path) -> list[str]:
    """CVAT's "COCO 1.0" of a project whose tasks are in the subsets Train and Validation:
    ``annotations/instances_<subset>.json`` and ``images/<subset>/``."""
    for split, subset in zip(SPLITS, ("Train", "Validation")):
        doc = _coco(demo_small, split)
        for im in doc["images"]:
            _copy(demo_small, split, im, root / "images" / subset / im["file_name"])
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{subset}.json").write_text(json.dumps(doc))
    return ["--data", str(root)]


def mmdet_coco(demo_small: Path, root: Path) -> list[str]:
    """MMDetection's custom COCO layout: ``annotations/instances_{train,val}.json`` and the
    images in ``train/`` and ``val/``."""
    for split in SPLITS:
        doc = _coco(demo_small, split)
        for im in doc["images"]:
            _copy(demo_small, split, im, root / split / im["file_name"])
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(doc))
    return ["--data", str(root)]


def cvat_yolo(demo_small: Path, root: Path) -> list[str]:
    """CVAT's "YOLO 1.1" (darknet): ``obj.data``, ``obj.names``, ``obj_<subset>_data/``
    holding each image with its txt, and ``train.txt`` / ``valid.txt`` listing the images
    (the valid list in older CVAT's ``data/`` form)."""
    for split, subset in zip(SPLITS, ("train", "valid")):
        doc = _coco(demo_small, split)
        listed = []
        for im in doc["images"]:
            img = root / f"obj_{subset}_data" / im["file_name"]
            _copy(demo_small, split, im, img)
            img.with_suffix(".txt").write_text(_yolo_lines(doc, im))  # CVAT writes empty ones too
            listed.append(f"{'data/' if subset == 'valid' else ''}obj_{subset}_data/{im['file_name']}")
        (root / f"{subset}.txt").write_text("\n".join(listed) + "\n")
    (root / "obj.names").write_text("\n".join(_names(demo_small)) + "\n")
    (root / "obj.data").write_text("classes = 4\ntrain = data/train.txt\nvalid = data/valid.txt\n"
                                   "names = data/obj.names\nbackup = backup/\n")
    return ["--data", str(root)]


def labelimg_yolo(demo_small: Path, root: Path) -> list[str]:
    """LabelImg saving YOLO beside the images: ``<stem>.txt`` per image and ``classes.txt``,
    one folder per split here."""
    for split in SPLITS:
        doc = _coco(demo_small, split)
        for im in doc["images"]:
            _copy(demo_small, split, im, root / split / im["file_name"])
            (root / split / im["file_name"]).with_suffix(".txt").write_text(_yolo_lines(doc, im))
        (root / split / "classes.txt").write_text("\n".join(_names(demo_small)) + "\n")
    shutil.copy(root / "train" / "classes.txt", root / "classes.txt")
    return ["--data", str(root)]


def labelimg_voc(demo_small: Path, root: Path) -> list[str]:
    """LabelImg saving Pascal VOC: ``<stem>.xml`` beside each image (no Annotations/ or
    ImageSets/), the images of each split in a folder of its own; an image without objects
    has no XML (LabelImg saves none)."""
    for split in SPLITS:
        doc = _coco(demo_small, split)
        boxed = {a["image_id"] for a in doc["annotations"]}
        for im in doc["images"]:
            _copy(demo_small, split, im, root / split / im["file_name"])
            if im["id"] in boxed:
                (root / split / im["file_name"]).with_suffix(".xml").write_text(
                    _voc_xml(doc, im, im["file_name"], split))
    return ["--data", str(root)]


def labelstudio_coco(demo_small: Path, root: Path) -> list[str]:
    """Label Studio's "COCO" export: ``result.json`` beside ``images/``, file names with
    that folder, category ids from 0, no ``area``; one export per project here."""
    args = []
    for split in SPLITS:
        doc = _coco(demo_small, split)
        project = root / f"project_{split}"
        remap = {c["id"]: i for i, c in enumerate(doc["categories"])}
        for c in doc["categories"]:
            c["id"] = remap[c["id"]]
        for a in doc["annotations"]:
            a["category_id"] = remap[a["category_id"]]
            a.pop("area")
        for im in doc["images"]:
            _copy(demo_small, split, im, project / "images" / im["file_name"])
            im["file_name"] = f"images/{im['file_name']}"
        (project / "result.json").write_text(json.dumps(doc))
        args += [f"--{split}-ann", str(project / "result.json"), f"--{split}-images", str(project)]
    return args


def labelstudio_yolo(demo_small: Path, root: Path) -> list[str]:
    """Label Studio's "YOLO" export: ``classes.txt``, ``images/``, ``labels/``, ``notes.json``."""
    for split in SPLITS:
        doc = _coco(demo_small, split)
        for im in doc["images"]:
            _copy(demo_small, split, im, root / "images" / split / im["file_name"])
            (root / "labels" / split).mkdir(parents=True, exist_ok=True)
            (root / "labels" / split / im["file_name"]).with_suffix(".txt").write_text(_yolo_lines(doc, im))
    (root / "classes.txt").write_text("\n".join(_names(demo_small)) + "\n")
    (root / "notes.json").write_text(json.dumps({"categories": [{"id": i, "name": n} for i, n in
                                                                enumerate(_names(demo_small))],
                                                 "info": {"year": 2026, "version": "1.0"}}))
    return ["--data", str(root)]


def phone(demo_small: Path, root: Path) -> list[str]:
    """A phone's pictures copied off the camera roll: ``.jpg``, ``.JPG`` and ``.jpeg``
    names, one picture stored sideways (EXIF orientation 6) under labels of the upright
    picture, and one ``.HEIC`` (not read: counted)."""
    for split in SPLITS:
        doc = _coco(demo_small, split)
        for k, im in enumerate(doc["images"]):
            name = f"IMG_{k:04d}" + (".jpg", ".JPG", ".jpeg")[k % 3]
            dst = root / "images" / split / name
            _copy(demo_small, split, im, dst)
            if k == 1:  # stored sideways: turn 90° clockwise to view
                upright = Image.open(dst)
                exif = Image.Exif()
                exif[0x0112] = 6
                upright.transpose(Image.Transpose.ROTATE_90).save(dst, format="JPEG", exif=exif.tobytes(), quality=95)
            (root / "labels" / split).mkdir(parents=True, exist_ok=True)
            (root / "labels" / split / name).with_suffix(".txt").write_text(_yolo_lines(doc, im))
        (root / "images" / split / "IMG_9999.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic" + bytes(64))
    (root / "data.yaml").write_text(yaml.safe_dump({"path": str(root), "train": "images/train", "val": "images/val",
                                                    "names": _names(demo_small)}))
    return ["--data", str(root / "data.yaml")]


def check(capsys, args: list[str]) -> tuple[int, str, str]:
    rc = data_main(["check", *args, "--cache-dir", str(Path(args[1]).parent / "cache")])
    out = capsys.readouterr()
    return rc, out.out, out.err


def split_parts(out: str) -> dict[str, str]:
    return {"train": out[out.index("train:"):out.index("\nval:")], "val": out[out.index("\nval:"):]}


def assert_counts(out: str, counts: dict[str, tuple[int, int]]) -> None:
    for split, (n_images, n_boxes) in counts.items():
        part = split_parts(out)[split]
        assert re.search(rf"\n  {n_images} images \(\d+ without boxes\), {n_boxes} boxes, 4 classes\n", part), part


def read_as_it_is(capsys, args: list[str], fmt: str, demo_small: Path) -> str:
    """``fastdet.data check`` of a form read as it is: exit 0, named by its format, the demo
    set's images and boxes in each split with its 4 classes; returns the output."""
    rc, out, err = check(capsys, args)
    assert rc == 0, err
    assert f"{fmt} format" in out, out
    assert_counts(out, _counts(demo_small))
    return out


# ----------------------------------------------------------------------------- check, as they are

def test_roboflow_export_checks_as_it_is(demo_small, tmp_path, capsys):
    args = roboflow(demo_small, tmp_path / "rf")
    out = read_as_it_is(capsys, args, "YOLO", demo_small)
    assert out.count("problems: nothing dropped or skipped") == 2, out


def test_roboflow_coco_export_checks_as_it_is_with_its_project_category_left_out(demo_small, tmp_path, capsys):
    from fastdet.eval.scoring import score

    root = tmp_path / "rfc"
    args = roboflow_coco(demo_small, root)
    out = read_as_it_is(capsys, args, "COCO", demo_small)  # 4 classes, not 5
    from fastdet.config import DataConfig
    from fastdet.data.formats import load_split

    described = load_split(DataConfig(data=str(root), cache_dir=str(tmp_path / "cache")), "val").describe()
    assert described.startswith("valid/_annotations.coco.json: "), described  # which split, in the log
    for split, folder in zip(SPLITS, ("train", "valid")):
        part = split_parts(out)[split]
        assert str(root / folder / "_annotations.coco.json") in part, part
        assert ("problems: left out 1 category without boxes that groups the others (the supercategory of the "
                "classes): 'shapes-xyz' (id 0)") in part, part
        assert "shapes-xyz" not in part[part.index("boxes per class:"):], part
    # The scorer leaves it out too: the AP table has the same 4 classes as the labels.
    ann = root / "valid" / "_annotations.coco.json"
    doc = json.loads(ann.read_text())
    results = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9}
               for a in doc["annotations"]]
    scores = score(ann, results, [im["id"] for im in doc["images"]], backend="pycocotools")
    assert list(scores.per_class) == _names(demo_small), scores.per_class
    assert scores.stats["AP"] == 1.0, scores.per_class  # the boxes themselves, annotation ids from 0 included
    assert scores.confusion.shape == (5, 5)
    # Without a valid/ split: one line naming the file that is missing.
    shutil.rmtree(root / "valid")
    rc, out, err = check(capsys, args)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"annotation file {root / 'valid' / '_annotations.coco.json'} not found" in err, err


def test_roboflow_voc_export_checks_as_it_is(demo_small, tmp_path, capsys):
    root = tmp_path / "rfv"
    args = roboflow_voc(demo_small, root)
    out = read_as_it_is(capsys, args, "VOC", demo_small)
    assert out.count("problems: nothing dropped or skipped") == 2, out
    assert str(root / "valid") in split_parts(out)["val"], out
    # Its test split, as fastdet.eval --split test reads it.
    rc, out, err = check(capsys, args + ["--splits", "test"])
    assert rc == 0 and f"test: {root / 'test'}\n" in out, err
    n_images, n_boxes = _counts(demo_small)["val"]
    assert f"  {n_images} images" in out and f"{n_boxes} boxes, 4 classes" in out, out
    rc, out, err = check(capsys, args + ["--splits", "train,tests"])
    assert rc == 1 and "--splits takes train, val, test, got tests" in err, err


def test_roboflow_voc_as_users_keep_it_subfolders_upper_case_no_train_and_a_lost_xml(demo_small, tmp_path, capsys):
    """Roboflow's VOC export moved about: images and XMLs in a subfolder are read, .JPG/.XML
    names too; an image whose XML went missing is read as background and counted; without
    train/ the val and test splits still read (what fastdet.eval needs)."""
    root = tmp_path / "rfv"
    args = roboflow_voc(demo_small, root)
    (root / "train" / "sub").mkdir()
    for f in sorted((root / "train").glob("*"))[:6]:
        if f.is_file():
            f.rename(root / "train" / "sub" / (f.stem + f.suffix.upper()))
    lost = sorted((root / "valid").glob("*.xml"))[0]
    lost.unlink()
    rc, out, err = check(capsys, args)
    assert rc == 0, err
    assert_counts(out, {"train": _counts(demo_small)["train"]})
    assert f"\n  {_counts(demo_small)['val'][0]} images" in split_parts(out)["val"], out  # its boxes are lost
    assert f"1 as background: no XML beside them ({lost.with_suffix('.jpg')})" in split_parts(out)["val"], out
    shutil.rmtree(root / "train")
    rc, out, err = check(capsys, args + ["--splits", "val,test"])
    assert rc == 0 and "VOC format" in out, err
    rc, out, err = check(capsys, args)
    assert rc == 1 and f"--data {root}: no train/ folder" in err, err


def test_a_test_split_keeps_the_classes_of_train_and_val(demo_small, tmp_path, capsys):
    root = tmp_path / "rfv"
    args = roboflow_voc(demo_small, root)
    xml = sorted((root / "test").glob("*.xml"))[0]
    xml.write_text(xml.read_text().replace("</size>", "</size><object><name>blob</name><bndbox><xmin>1</xmin>"
                                           "<ymin>1</ymin><xmax>9</xmax><ymax>9</ymax></bndbox></object>"))
    rc, out, err = check(capsys, args + ["--splits", "test"])
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"{xml}: object 0: class 'blob' is in no train or val XML" in err, err


def test_one_layout_for_every_split_and_a_coco_root_stays_coco(demo_small, tmp_path, capsys):
    """A COCO 2017 root that also holds a Roboflow export (or a VOC folder set) is read as
    the COCO root, every split: its missing test split is named as COCO 2017 names it."""
    root = tmp_path / "both"
    shutil.copytree(demo_small, root)
    roboflow_coco(demo_small, root)
    rc, out, err = check(capsys, ["--data", str(root)])
    assert rc == 0 and f"train: {root / 'annotations' / 'instances_train2017.json'}" in out, err
    assert "left out" not in out, out  # the COCO files, not Roboflow's
    rc, out, err = check(capsys, ["--data", str(root), "--splits", "test"])
    assert rc == 1 and f"annotation file {root / 'annotations' / 'instances_test2017.json'} not found" in err, err
    voc = tmp_path / "both_voc"
    shutil.copytree(demo_small, voc)
    roboflow_voc(demo_small, voc)
    rc, out, err = check(capsys, ["--data", str(voc)])
    assert rc == 0 and "COCO format" in out, err
    # A Roboflow export without train/: its missing split is named in its own scheme.
    rf = tmp_path / "rf_notrain"
    roboflow_coco(demo_small, rf)
    shutil.rmtree(rf / "train")
    rc, out, err = check(capsys, ["--data", str(rf)])
    assert rc == 1 and f"annotation file {rf / 'train' / '_annotations.coco.json'} not found" in err, err


def test_train_and_val_with_other_classes_say_which(demo_small, tmp_path):
    """The trainer refuses a set whose val classes differ from train's naming both sides,
    and the category one file left out as grouping the others (a val box on Roboflow's
    project category keeps it a class there)."""
    from fastdet.config import DataConfig
    from fastdet.data.coco import categories_diff
    from fastdet.data.formats import load_split

    root = tmp_path / "rfc"
    roboflow_coco(demo_small, root)
    ann = root / "valid" / "_annotations.coco.json"
    doc = json.loads(ann.read_text())
    doc["annotations"][0]["category_id"] = 0
    ann.write_text(json.dumps(doc))
    cfg = DataConfig(data=str(root), cache_dir=str(tmp_path / "cache"))
    train, val = load_split(cfg, "train"), load_split(cfg, "val")
    assert categories_diff(train, val) == ("only in train none, only in val 'shapes-xyz' (id 0); train left out "
                                           "'shapes-xyz' (id 0): it groups every other category and has no box there")


def test_a_voc_root_with_split_folders_beside_it_reads_its_lists(demo_small, tmp_path, capsys):
    """A VOC root's ImageSets name its splits even with a train/ folder of XMLs beside them;
    a set kept as folders is a set of its own: the classes found, not VOC's 20."""
    root = tmp_path / "vr"
    labelimg_voc(demo_small, root)
    for d in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / d).mkdir(parents=True)
    ids = []
    for xml in sorted((root / "val").glob("*.xml")):
        shutil.copy(xml, root / "Annotations" / xml.name)
        shutil.copy(xml.with_suffix(".jpg"), root / "JPEGImages" / xml.with_suffix(".jpg").name)
        ids.append(xml.stem)
    for split in SPLITS:
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    rc, out, err = check(capsys, ["--data", str(root)])
    assert rc == 0 and f"train: {root / 'ImageSets' / 'Main' / 'train.txt'}" in out, out + err
    # VOC class names on a folder set: the 4 found (a VOC root takes VOC's 20 for them).
    folders = tmp_path / "vf"
    args = labelimg_voc(demo_small, folders)
    for xml in folders.rglob("*.xml"):
        xml.write_text(xml.read_text().replace(">circle<", ">person<").replace(">rectangle<", ">car<")
                       .replace(">triangle<", ">dog<").replace(">cross<", ">cat<"))
    rc, out, err = check(capsys, args)
    assert rc == 0 and "4 classes" in out and "20 classes" not in out, out + err


def test_a_coco_root_takes_the_split_folder_that_holds_the_images(demo_small, tmp_path, capsys):
    root = tmp_path / "coco"
    shutil.copytree(demo_small, root)
    (root / "images" / "train2017").mkdir(parents=True)  # empty, as a tool may leave it
    rc, out, err = check(capsys, ["--data", str(root)])
    assert rc == 0 and "problems: nothing dropped or skipped" in split_parts(out)["train"], out + err
    # And the other way round: CVAT's images/<subset>/ full beside an empty <subset>/.
    cvat = tmp_path / "cvat"
    cvat_coco_subsets(demo_small, cvat)
    (cvat / "Train").mkdir()
    rc, out, err = check(capsys, ["--data", str(cvat)])
    assert rc == 0 and "problems: nothing dropped or skipped" in split_parts(out)["train"], out + err


def test_hints_read_no_unreadable_folder_and_name_a_yaml_of_another_name(tmp_path, capsys, monkeypatch):
    root = tmp_path / "set"
    (root / "lost+found").mkdir(parents=True)
    (root / "dataset.yaml").write_text("train: images\nval: images\nnames: [a]\n")
    real = Path.iterdir

    def iterdir(self):
        if self.name == "lost+found":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    rc, out, err = check(capsys, ["--data", str(root)])
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"pass it itself: --data {root / 'dataset.yaml'}" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--splits", ""], "--splits takes train, val, test, got ''"),
    (["--splits", "train", "--val-ann", "v.json"], "--val-ann names a split --splits does not check (train)"),
    (["--splits", "test", "--data", "/nonexistent"], "--data /nonexistent: no such directory"),
])
def test_check_flags_that_cannot_work_are_one_line(capsys, argv, message):
    assert data_main(["check", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_cvat_coco_export_checks_as_it_is_and_its_root_is_a_hint(demo_small, tmp_path, capsys):
    args = cvat_coco(demo_small, tmp_path / "cvat")
    rc, out, err = check(capsys, args)
    assert rc == 0, err
    assert out.count("problems: nothing dropped or skipped") == 2, out
    assert_counts(out, _counts(demo_small))
    rc, out, err = check(capsys, ["--data", str(tmp_path / "cvat" / "task_val")])
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "it holds annotations/instances_default.json (CVAT's COCO export" in err and "--val-ann" in err, err
    # Split as the line says: a COCO root --data reads, every image in one split only.
    split = shlex.split(err[err.index("python -m fastdet.data split "):])[4:]  # pasted as it is
    assert split == ["--ann", str(tmp_path / "cvat" / "task_val" / "annotations" / "instances_default.json"),
                     "--images", str(tmp_path / "cvat" / "task_val" / "images"),
                     "--output-dir", str(tmp_path / "cvat" / "task_val") + "_split"], split
    assert data_main(["split", *split]) == 0
    assert "train on it with --data" in capsys.readouterr().out
    shutil.move(str(tmp_path / "cvat" / "task_val") + "_split", tmp_path / "cvat_split")
    rc, out, err = check(capsys, ["--data", str(tmp_path / "cvat_split")])
    assert rc == 0 and out.count("problems: nothing dropped or skipped") == 2, out + err
    parts = [json.loads((tmp_path / "cvat_split" / "annotations" / f"instances_{s}.json").read_text()) for s in SPLITS]
    names = [{im["file_name"] for im in d["images"]} for d in parts]
    n_val = _counts(demo_small)["val"][0]
    assert not names[0] & names[1] and len(names[0]) + len(names[1]) == n_val and len(names[1]) == round(0.2 * n_val)
    assert sum(len(d["annotations"]) for d in parts) == _counts(demo_small)["val"][1]
    assert parts[0]["categories"] == parts[1]["categories"] == _coco(demo_small, "val")["categories"]
    rc, out, err = check(capsys, args[:4])  # train alone, no --data: one line saying what is missing
    assert rc == 1 and "give --data, or COCO files with --val-ann and --val-images" in err, err


@pytest.mark.parametrize("make, files", [
    (cvat_coco_subsets, ("annotations/instances_Train.json", "annotations/instances_Validation.json")),
    (mmdet_coco, ("annotations/instances_train.json", "annotations/instances_val.json"))])
def test_coco_roots_with_other_split_names_check_as_they_are(demo_small, tmp_path, capsys, make, files):
    root = tmp_path / make.__name__
    args = make(demo_small, root)
    out = read_as_it_is(capsys, args, "COCO", demo_small)
    assert out.count("problems: nothing dropped or skipped") == 2, out
    for split, f in zip(SPLITS, files):
        assert f"{split}: {root / f}\n" in out, out
    # Without its val split: one line naming the file, in the set's own names.
    (root / files[1]).unlink()
    rc, out, err = check(capsys, args)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"annotation file {root / files[1]} not found" in err, err


def test_cvat_yolo_export_checks_as_it_is(demo_small, tmp_path, capsys):
    args = cvat_yolo(demo_small, tmp_path / "cvat_yolo")
    out = read_as_it_is(capsys, args, "YOLO", demo_small)
    assert out.count("problems: nothing dropped or skipped") == 2, out
    # Without a validation subset CVAT writes no valid.txt: one line saying what to add.
    data = tmp_path / "cvat_yolo" / "obj.data"
    data.write_text(data.read_text().replace("valid = data/valid.txt\n", ""))
    rc, out, err = check(capsys, args)
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert f"{data}: no 'valid = ...' line" in err and "valid = valid.txt" in err, err


def test_labelstudio_coco_export_checks_as_it_is_with_its_missing_areas_counted(demo_small, tmp_path, capsys):
    args = labelstudio_coco(demo_small, tmp_path / "ls")
    rc, out, err = check(capsys, args)
    assert rc == 0, err
    n = _counts(demo_small)
    assert_counts(out, n)
    for split, (_, boxes) in n.items():
        assert f"problems: filled in {boxes} missing 'area'" in split_parts(out)[split], out
    rc, out, err = check(capsys, ["--data", str(tmp_path / "ls" / "project_train")])
    assert rc == 1 and "it holds result.json (CVAT's COCO export" in err and "--train-ann" in err, err
    # Its split command, pasted as it is, gives a set --data reads (file names images/x.jpg).
    assert data_main(["split", *shlex.split(err[err.index("python -m fastdet.data split "):])[4:]]) == 0
    capsys.readouterr()
    rc, out, err = check(capsys, ["--data", str(tmp_path / "ls" / "project_train") + "_split"])
    assert rc == 0, out + err
    assert sum(int(n) for n in re.findall(r"\n  (\d+) images", out)) == _counts(demo_small)["train"][0], out


def test_phone_pictures_check_with_the_heic_counted_and_the_sideways_one_turned(demo_small, tmp_path, capsys):
    args = phone(demo_small, tmp_path / "phone")
    rc, out, err = check(capsys, args)
    assert rc == 0, err
    assert_counts(out, _counts(demo_small))
    for split in SPLITS:
        part = split_parts(out)[split]
        heic = tmp_path / "phone" / "images" / split / "IMG_9999.HEIC"
        assert "1 turned upright by their EXIF orientation" in part and "IMG_0001.JPG" in part, part
        assert "ignored 1 file: 1 camera format not read (HEIC, HEIF, DNG: save as JPEG)" in part, part
        assert f"camera format not read (HEIC, HEIF, DNG: save as JPEG): {heic}" in part, part


# ----------------------------------------------------------------------------- refused, then read as told

def _data_yaml_from_hint(err: str, root: Path, val: str | None = None) -> Path:
    """The data.yaml the one-line refusal asks for, written as it says."""
    m = re.search(r"write (\S+) with 'train: (\S+)', 'val: <held-out images>' and 'names: (\[.*\])'", err)
    assert m, err
    train, names = m.group(2), yaml.safe_load(m.group(3))
    Path(m.group(1)).write_text(yaml.safe_dump({"train": train, "val": val or train, "names": names}))
    assert Path(m.group(1)).parent == root
    return Path(m.group(1))


def test_labelstudio_yolo_export_is_refused_saying_what_to_write_then_reads(demo_small, tmp_path, capsys):
    root = tmp_path / "lsy"
    args = labelstudio_yolo(demo_small, root)
    rc, out, err = check(capsys, args)
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "a YOLO export without a data.yaml (classes.txt: LabelImg's or Label Studio's YOLO export)" in err
    _data_yaml_from_hint(err, root)
    spec = yaml.safe_load((root / "data.yaml").read_text())
    assert spec["names"] == _names(demo_small) and spec["train"] == "images"
    spec.update(train="images/train", val="images/val")
    (root / "data.yaml").write_text(yaml.safe_dump(spec))
    rc, out, err = check(capsys, args)
    assert rc == 0, err
    assert_counts(out, _counts(demo_small))
    assert out.count("problems: nothing dropped or skipped") == 2, out


def test_labelimg_yolo_is_refused_saying_what_to_write_then_reads_with_classes_txt_counted(demo_small, tmp_path,
                                                                                            capsys):
    root = tmp_path / "liy"
    args = labelimg_yolo(demo_small, root)
    rc, out, err = check(capsys, args)
    assert rc == 1 and "classes.txt: LabelImg's or Label Studio's YOLO export" in err, err
    _data_yaml_from_hint(err, root)
    spec = yaml.safe_load((root / "data.yaml").read_text())
    assert spec["train"] == "." and spec["names"] == _names(demo_small)
    spec.update(train="train", val="val")
    (root / "data.yaml").write_text(yaml.safe_dump(spec))
    rc, out, err = check(capsys, args)
    assert rc == 0, err
    assert_counts(out, _counts(demo_small))
    for split in SPLITS:  # LabelImg's classes.txt beside the images: not an image, counted and named
        assert f"not an image file: {root / split / 'classes.txt'}" in split_parts(out)[split], out


def test_labelimg_voc_in_split_folders_reads_as_it_is_and_in_one_folder_is_refused(demo_small, tmp_path, capsys):
    root = tmp_path / "liv"
    args = labelimg_voc(demo_small, root)
    out = read_as_it_is(capsys, args, "VOC", demo_small)  # the images without an XML are background images, counted
    for split in SPLITS:
        doc = _coco(demo_small, split)
        empty = [im["file_name"] for im in doc["images"] if im["id"] not in {a["image_id"] for a in doc["annotations"]}]
        assert empty, "the demo set has an image without boxes in each split"
        assert (f"problems: read {len(empty)} image{'s' * (len(empty) > 1)}: {len(empty)} as background: no XML "
                f"beside them ({root / split / empty[0]}") in split_parts(out)[split], out
    # A stray XML is counted and named, not dropped in silence.
    (root / "train" / "orphan.xml").write_text("<annotation/>")
    rc, out, err = check(capsys, args)
    assert rc == 0 and f"label file without an image: {root / 'train' / 'orphan.xml'}" in out, out
    # Every image and XML in one folder names no split: one line saying how to arrange it.
    (root / "train" / "orphan.xml").unlink()
    (root / "all").mkdir()
    for split in SPLITS:
        for f in (root / split).iterdir():
            shutil.move(f, root / "all" / f.name)
        (root / split).rmdir()
    rc, out, err = check(capsys, args)
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "VOC XMLs beside their images (LabelImg's PascalVOC save)" in err, err
    assert "in train/ and val/" in err and "Annotations/<id>.xml" in err and "ImageSets/Main/train.txt" in err


# ----------------------------------------------------------------------------- one folder, split as told

def _one_folder(make, demo_small: Path, root: Path) -> None:
    """``make``'s export with the split folders' files moved into one folder, ``all/``, as a
    tool saves them before anyone sorts them."""
    make(demo_small, root)
    (root / "all").mkdir()
    for split in SPLITS:
        for f in (root / split).iterdir():
            shutil.move(f, root / "all" / f.name)
        (root / split).rmdir()


def _total(demo_small: Path) -> tuple[int, int]:
    """(images, boxes) of the demo set's train and val together."""
    counts = _counts(demo_small).values()
    return sum(n for n, _ in counts), sum(b for _, b in counts)


def labelimg_yolo_in_one_folder(demo_small: Path, root: Path) -> tuple[int, int]:
    _one_folder(labelimg_yolo, demo_small, root)
    return _total(demo_small)


def labelimg_voc_in_one_folder(demo_small: Path, root: Path) -> tuple[int, int]:
    _one_folder(labelimg_voc, demo_small, root)
    return _total(demo_small)


def labelstudio_yolo_export(demo_small: Path, root: Path) -> tuple[int, int]:
    labelstudio_yolo(demo_small, root)
    return _total(demo_small)


def cvat_yolo_without_validation(demo_small: Path, root: Path) -> tuple[int, int]:
    """A CVAT "YOLO 1.1" task without a Validation subset: no ``valid`` line, no valid.txt."""
    cvat_yolo(demo_small, root)
    (root / "obj.data").write_text((root / "obj.data").read_text().replace("valid = data/valid.txt\n", ""))
    (root / "valid.txt").unlink()
    shutil.rmtree(root / "obj_valid_data")
    return _counts(demo_small)["train"]


@pytest.mark.parametrize("make, fmt", [(labelstudio_yolo_export, "YOLO"), (labelimg_yolo_in_one_folder, "YOLO"),
                                       (cvat_yolo_without_validation, "YOLO"), (labelimg_voc_in_one_folder, "VOC")])
def test_a_single_split_export_splits_by_the_command_its_refusal_gives(make, fmt, demo_small, tmp_path, capsys):
    """The refusal's split command, pasted as it is, writes train and val in the export's
    format: every image in one split only, every box with its image, the same split for the
    same seed, and ``--data`` reads it with nothing dropped."""
    root = tmp_path / "export"
    n_images, n_boxes = make(demo_small, root)
    rc, out, err = check(capsys, ["--data", str(root)])
    assert rc == 1 and "python -m fastdet.data split --data " in err, err
    argv = shlex.split(err[err.index("python -m fastdet.data split "):].split(", or ")[0])[4:]
    out_dir = Path(argv[argv.index("--output-dir") + 1])
    assert out_dir == Path(str(root) + "_split")
    assert data_main(["split", *argv]) == 0
    said = capsys.readouterr().out
    assert f"{n_images} images, {n_boxes} boxes" in said and f"train on it with --data {out_dir}" in said, said
    rc, out, err = check(capsys, ["--data", str(out_dir), "--check-images", "decode"])
    assert rc == 0 and f"{fmt} format" in out, out + err
    if fmt == "YOLO":
        assert out.count("problems: nothing dropped or skipped") == 2, out
    else:  # LabelImg saves no XML for an image without boxes: read as background, counted in its split
        empty = sum(len(_coco(demo_small, s)["images"]) - len({a["image_id"] for a in _coco(demo_small, s)["annotations"]})
                    for s in SPLITS)
        assert sum(map(int, re.findall(r"(\d+) as background: no XML beside them", out))) == empty, out
    sets = {s: load_split(DataConfig(data=str(out_dir)), s, check_images="none") for s in SPLITS}
    names = {s: sorted(Path(im["file_name"]).name for im in ds.coco_gt["images"]) for s, ds in sets.items()}
    assert not set(names["train"]) & set(names["val"])
    assert len(names["train"]) + len(names["val"]) == n_images and len(names["val"]) == round(0.2 * n_images)
    assert sum(len(ds.coco_gt["annotations"]) for ds in sets.values()) == n_boxes
    names_in_order = _names(demo_small) if fmt == "YOLO" else sorted(_names(demo_small))  # VOC: the names found
    assert sets["train"].class_names == sets["val"].class_names == names_in_order
    # The same seed again: the same val images (replacing needs --overwrite); another seed: others.
    assert data_main(["split", *argv]) == 1 and "add --overwrite" in capsys.readouterr().err
    assert data_main(["split", *argv, "--overwrite"]) == 0
    again = load_split(DataConfig(data=str(out_dir)), "val", check_images="none")
    assert sorted(Path(im["file_name"]).name for im in again.coco_gt["images"]) == names["val"]
    assert data_main(["split", *argv, "--overwrite", "--seed", "1"]) == 0
    other = load_split(DataConfig(data=str(out_dir)), "val", check_images="none")
    assert sorted(Path(im["file_name"]).name for im in other.coco_gt["images"]) != names["val"]
    assert make is not labelimg_voc_in_one_folder or not [
        f for f in (out_dir / "train").rglob("*") if not f.is_symlink() and not f.is_dir()]  # links, no copies


def _split(make, demo_small: Path, root: Path) -> list[str]:
    make(demo_small, root / "export")
    assert data_main(["split", "--data", str(root / "export"), "--output-dir", str(root / "split")]) == 0
    return ["--data", str(root / "split")]


def labelimg_voc_split(demo_small: Path, root: Path) -> list[str]:
    """LabelImg's VOC XMLs in one folder, split by ``fastdet.data split``: folders of links."""
    return _split(labelimg_voc_in_one_folder, demo_small, root)


def labelstudio_yolo_split(demo_small: Path, root: Path) -> list[str]:
    """Label Studio's YOLO export split by ``fastdet.data split``: a data.yaml of image lists."""
    return _split(labelstudio_yolo_export, demo_small, root)


# ----------------------------------------------------------------------------- a short training on each

# Each readable form and the loaders its short training runs with: the loaders alternate
# over the forms (a DALI run on the CPU costs about a minute here, and every form reaches the
# loaders as the same records), and the phone's pictures, whose sideways one each loader must
# decode upright, run both.
TRAININGS = [(roboflow, "torch"), (roboflow_coco, "dali"), (roboflow_voc, "torch"), (cvat_coco_subsets, "torch"),
             (cvat_coco, "dali"), (cvat_yolo, "torch"), (labelstudio_coco, "dali"),
             (labelimg_voc_split, "dali"), (labelstudio_yolo_split, "torch"), (phone, "torch"), (phone, "dali")]


@pytest.mark.slow
def test_every_readable_export_trains_a_few_steps(demo_small, tmp_path):
    """Two steps of ``python -m fastdet.train`` on each form (DALI on the CPU, skipped as
    tests/test_formats.py skips it: without nvidia.dali); each run after the first
    fine-tunes from the previous one's checkpoint, its classes matched by name."""
    try:
        import nvidia.dali  # noqa: F401  (optional: the DALI runs need it)
        has_dali = True
    except ImportError:
        has_dali = False
    previous, made = None, {}
    for make, loader in TRAININGS:
        if loader == "dali" and not has_dali:
            continue
        name = make.__name__
        if name not in made:
            made[name] = make(demo_small, tmp_path / name)
        out = tmp_path / "runs" / f"{name}_{loader}"
        cmd = [sys.executable, "-m", "fastdet.train", "--arch", "yolox", "--size", "nano", *made[name],
               "--device", "cpu", "--img-size", "64", "--no-multiscale", "--batch-size", "4", "--epochs", "1",
               "--max-steps", "2", "--output-dir", str(out), "--workers", "0", "--loader", loader,
               "--set", "optim.warmup_steps=2", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
        if previous is not None:
            cmd += ["--ckpt", str(previous)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 0, (name, loader, r.stdout[-3000:] + r.stderr[-3000:])
        assert f"loader {loader}" in r.stdout and "COCO AP" in r.stdout, (name, loader)
        if previous is not None:
            assert f"fine-tuning from {previous}; 4 of 4 classes matched by name to the checkpoint's 4" in r.stdout, \
                (name, r.stdout[-3000:])
        previous = out / "latest.pth"
        assert previous.is_file()
