"""YOLO-format and Pascal VOC sets: the same records, report, errors and AP as the COCO set they encode.

The small demo set (COCO) is rewritten here as an ultralytics folder (``data.yaml``,
``images/``, ``labels/*.txt``) and as a VOC root (``Annotations/``, ``ImageSets/Main/``,
``JPEGImages/``), the images linked, so every comparison is against the COCO reading of
the same boxes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from in_process import main_in_process  # tests/ is on sys.path (rootdir conftest)

from fastdet.config import DataConfig
from fastdet.data.coco import DataError, load_coco
from fastdet.data.formats import data_format, load_split, yolo_label_path
from fastdet.eval.scoring import score

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS: tests/conftest.py


# ----------------------------------------------------------------------------- writers

def _coco(demo_small: Path, split: str) -> dict:
    return json.loads((demo_small / "annotations" / f"instances_{split}2017.json").read_text())


def make_yolo(demo_small: Path, root: Path, *, names_as_dict: bool = False) -> Path:
    """The demo set as an ultralytics folder; returns ``data.yaml``."""
    for split in ("train", "val"):
        doc = _coco(demo_small, split)
        label = {c["id"]: i for i, c in enumerate(doc["categories"])}
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        by_image: dict[int, list] = {}
        for a in doc["annotations"]:
            by_image.setdefault(a["image_id"], []).append(a)
        for im in doc["images"]:
            img = root / "images" / split / im["file_name"]
            if not img.exists():
                img.symlink_to(demo_small / f"{split}2017" / im["file_name"])
            anns = by_image.get(im["id"], [])
            if not anns:  # background: no txt at all
                continue
            W, H = im["width"], im["height"]
            lines = [f"{label[a['category_id']]} {(a['bbox'][0] + a['bbox'][2] / 2) / W!r} "
                     f"{(a['bbox'][1] + a['bbox'][3] / 2) / H!r} {a['bbox'][2] / W!r} {a['bbox'][3] / H!r}"
                     for a in anns]
            yolo_label_path(img).write_text("\n".join(lines) + "\n")
    names = [c["name"] for c in _coco(demo_small, "train")["categories"]]
    spec = {"path": ".", "train": "images/train", "val": "images/val",
            "names": dict(enumerate(names)) if names_as_dict else names}
    (root / "data.yaml").write_text(yaml.safe_dump(spec))
    return root / "data.yaml"


def make_voc(demo_small: Path, root: Path, difficult: set[int] = frozenset()) -> Path:
    """The demo set as a VOC root (annotation ids in ``difficult`` marked difficult)."""
    for d in ("Annotations", "ImageSets/Main", "JPEGImages"):
        (root / d).mkdir(parents=True, exist_ok=True)
    names = [c["name"] for c in _coco(demo_small, "train")["categories"]]
    (root / "label_list.txt").write_text("\n".join(names) + "\n")
    for split in ("train", "val"):
        doc = _coco(demo_small, split)
        cat = {c["id"]: c["name"] for c in doc["categories"]}
        ids = []
        for im in doc["images"]:
            stem = Path(im["file_name"]).stem
            ids.append(stem)
            img = root / "JPEGImages" / f"{stem}.jpg"
            if not img.exists():
                img.symlink_to(demo_small / f"{split}2017" / im["file_name"])
            objs = []
            for a in doc["annotations"]:
                if a["image_id"] != im["id"]:
                    continue
                x, y, w, h = a["bbox"]
                objs.append(f"<object><name>{cat[a['category_id']]}</name>"
                            f"<difficult>{int(a['id'] in difficult)}</difficult><bndbox>"
                            f"<xmin>{x + 1!r}</xmin><ymin>{y + 1!r}</ymin><xmax>{x + w!r}</xmax>"
                            f"<ymax>{y + h!r}</ymax></bndbox></object>")
            (root / "Annotations" / f"{stem}.xml").write_text(
                f"<annotation><filename>{stem}.jpg</filename><size><width>{im['width']}</width>"
                f"<height>{im['height']}</height><depth>3</depth></size>{''.join(objs)}</annotation>")
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root


@pytest.fixture(scope="module")
def yolo_yaml(demo_small, tmp_path_factory) -> Path:
    return make_yolo(demo_small, tmp_path_factory.mktemp("yolo"))


@pytest.fixture(scope="module")
def voc_root(demo_small, tmp_path_factory) -> Path:
    return make_voc(demo_small, tmp_path_factory.mktemp("voc"))


def cfg_for(data: Path | str, **kw) -> DataConfig:
    return replace(DataConfig(), data=str(data), cache_dir=str(Path(data).parent / "cache"), **kw)


def same_records(a, b, atol=1e-3):
    assert len(a.records) == len(b.records)
    for ra, rb in zip(a.records, b.records):
        assert Path(ra.file).resolve() == Path(rb.file).resolve()
        assert (ra.width, ra.height) == (rb.width, rb.height)
        np.testing.assert_allclose(ra.boxes, rb.boxes, atol=atol)
        np.testing.assert_array_equal(ra.labels, rb.labels)
    assert a.class_names == b.class_names


# ----------------------------------------------------------------------------- detection

def test_format_is_detected_from_what_data_points_at(demo_small, yolo_yaml, voc_root):
    assert data_format("demo") == "coco" and data_format(str(demo_small)) == "coco"
    assert data_format(str(yolo_yaml)) == "yolo" and data_format(str(yolo_yaml.parent)) == "yolo"
    assert data_format(str(voc_root)) == "voc"


# ----------------------------------------------------------------------------- same records

@pytest.mark.parametrize("fmt", ["yolo", "voc"])
@pytest.mark.parametrize("split, train", [("train", True), ("val", False)])
def test_records_and_report_equal_the_coco_reading(fmt, split, train, demo_small, yolo_yaml, voc_root):
    data = yolo_yaml if fmt == "yolo" else voc_root
    ds = load_split(cfg_for(data), split, train=train)
    ref = load_coco(demo_small / "annotations" / f"instances_{split}2017.json", demo_small / f"{split}2017",
                    train=train)
    same_records(ds, ref)
    assert ds.report.summary() == ref.report.summary()
    assert (ds.report.images_kept, ds.report.boxes_kept) == (ref.report.images_kept, ref.report.boxes_kept)
    assert ds.cat_ids == list(range(4)) and ds.coco_gt is not None


def test_yolo_names_as_a_mapping_and_polygons(demo_small, tmp_path):
    data = make_yolo(demo_small, tmp_path / "y", names_as_dict=True)
    ds = load_split(cfg_for(data), "val")
    assert ds.class_names == ["circle", "rectangle", "triangle", "cross"]
    # A polygon line is read as its bounding box.
    lbl = next(iter(sorted((tmp_path / "y" / "labels" / "val").glob("*.txt"))))
    lbl.write_text("2 0.1 0.2 0.5 0.2 0.5 0.6 0.1 0.6\n")
    ds = load_split(cfg_for(data), "val")
    rec = next(r for r in ds.records if Path(r.file).stem == lbl.stem)
    np.testing.assert_allclose(rec.boxes, [[0.1 * rec.width, 0.2 * rec.height, 0.5 * rec.width, 0.6 * rec.height]],
                               rtol=1e-5)
    assert rec.labels.tolist() == [2]


# ----------------------------------------------------------------------------- AP the same way

def _fake_results(doc: dict, cat_map: dict[int, int], image_map: dict[int, int]) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for a in doc["annotations"]:
        x, y, w, h = a["bbox"]
        for _ in range(2):
            out.append({"image_id": image_map[a["image_id"]], "category_id": cat_map[a["category_id"]],
                        "bbox": [x + rng.normal() * 3, y + rng.normal() * 3, w * rng.uniform(0.8, 1.2), h],
                        "score": float(rng.random())})
    return out


@pytest.mark.parametrize("fmt", ["yolo", "voc"])
def test_ap_from_the_in_memory_ground_truth_equals_the_coco_file(fmt, demo_small, yolo_yaml, voc_root):
    data = yolo_yaml if fmt == "yolo" else voc_root
    ds = load_split(cfg_for(data), "val")
    doc = _coco(demo_small, "val")
    cat_map = {c["id"]: i for i, c in enumerate(doc["categories"])}
    by_file = {Path(r.file).stem: r.image_id for r in ds.records}
    image_map = {im["id"]: by_file[Path(im["file_name"]).stem] for im in doc["images"]}
    ours = score(ds.coco_gt, _fake_results(doc, cat_map, image_map), ds.image_ids, backend="pycocotools")
    # YOLO and VOC have boxes only, so the area that sorts small/medium/large is the box's
    # (the demo file's is the shape's).
    for a in doc["annotations"]:
        a["area"] = a["bbox"][2] * a["bbox"][3]
    ref = score(doc, _fake_results(doc, {c: c for c in cat_map}, {i: i for i in image_map}),
                [im["id"] for im in doc["images"]], backend="pycocotools")
    assert ours.stats["AP"] > 0.1
    for k, v in ref.stats.items():
        assert ours.stats[k] == pytest.approx(v, abs=2e-3), k


def test_voc_difficult_boxes_are_ignore_regions(demo_small, tmp_path):
    doc = _coco(demo_small, "val")
    hard = {doc["annotations"][0]["id"], doc["annotations"][3]["id"]}
    root = make_voc(demo_small, tmp_path / "voc", difficult=hard)
    train = load_split(cfg_for(root), "val", train=True)
    assert train.report.box_skips["difficult"] == 2
    val = load_split(cfg_for(root), "val")
    assert "2 difficult (scored as ignore regions)" in val.report.summary()
    crowd = [a for a in val.coco_gt["annotations"] if a["iscrowd"]]
    assert len(crowd) == 2
    # Scored as the COCO file with those boxes marked iscrowd: the same 12 numbers.
    for a in doc["annotations"]:
        a["iscrowd"] = int(a["id"] in hard)
        a["area"] = a["bbox"][2] * a["bbox"][3]
    ref_file = tmp_path / "crowd.json"
    ref_file.write_text(json.dumps(doc))
    cat_map = {c["id"]: i for i, c in enumerate(doc["categories"])}
    by_file = {Path(r.file).stem: r.image_id for r in val.records}
    image_map = {im["id"]: by_file[Path(im["file_name"]).stem] for im in doc["images"]}
    ours = score(val.coco_gt, _fake_results(doc, cat_map, image_map), val.image_ids, backend="pycocotools")
    ref = score(str(ref_file), _fake_results(doc, {c: c for c in cat_map}, {i: i for i in image_map}),
                [im["id"] for im in doc["images"]], backend="pycocotools")
    for k, v in ref.stats.items():
        assert ours.stats[k] == pytest.approx(v, abs=2e-3), k


# ----------------------------------------------------------------------------- bad input

def _one_line(match: str, cfg: DataConfig, split: str = "val") -> str:
    with pytest.raises(DataError, match=match) as e:
        load_split(cfg, split)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("line, match", [
    ("0 0.5 0.5 1.7 0.2", r":2: coordinates must be normalised to 0\.\.1"),
    ("9 0.5 0.5 0.1 0.2", r":2: class 9 is not in names \(0\.\.3\)"),
    ("1 0.5 abc 0.1 0.2", r":2: expected 'class cx cy w h' numbers"),
    ("1 0.5 0.5 0.1", r":2: expected 'class cx cy w h'"),
])
def test_bad_yolo_label_lines_name_file_and_line(demo_small, tmp_path, line, match):
    data = make_yolo(demo_small, tmp_path / "y")
    lbl = sorted((tmp_path / "y" / "labels" / "val").glob("*.txt"))[0]
    lbl.write_text("0 0.5 0.5 0.1 0.1\n" + line + "\n")
    msg = _one_line(match, cfg_for(data))
    assert str(lbl) in msg


def test_bad_yolo_yaml(demo_small, tmp_path):
    data = make_yolo(demo_small, tmp_path / "y")
    spec = yaml.safe_load(data.read_text())
    data.write_text(yaml.safe_dump({**spec, "nc": 7}))
    _one_line(r"field 'nc' is 7 but 'names' has 4", cfg_for(data))
    data.write_text(yaml.safe_dump({**spec, "val": "nope"}))
    _one_line(r"field 'val': .*nope is neither an image folder", cfg_for(data))
    data.write_text(yaml.safe_dump({k: v for k, v in spec.items() if k != "names"}))
    _one_line(r"field 'names' must be", cfg_for(data))
    data.write_text(yaml.safe_dump({**spec, "path": "missing_root"}))
    _one_line(r"field 'path': no directory .*missing_root", cfg_for(data))
    data.write_text(yaml.safe_dump(spec))
    _one_line(r"--val-ann is for COCO files", cfg_for(data, val_ann="x.json"))


def test_yolo_path_relative_to_the_yaml_or_absolute(demo_small, tmp_path):
    data = make_yolo(demo_small, tmp_path / "y")
    spec = yaml.safe_load(data.read_text())
    elsewhere = tmp_path / "configs" / "set.yaml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(yaml.safe_dump({**spec, "path": "../y"}))
    a = load_split(cfg_for(elsewhere), "val")
    elsewhere.write_text(yaml.safe_dump({**spec, "path": str(tmp_path / "y")}))
    b = load_split(cfg_for(elsewhere), "val")
    same_records(a, b, atol=0)
    assert len(a) == 8


def test_missing_and_corrupt_yolo_images_are_counted_skips(demo_small, tmp_path):
    data = make_yolo(demo_small, tmp_path / "y")
    imgs = sorted((tmp_path / "y" / "images" / "val").glob("*.jpg"))
    imgs[0].unlink()
    imgs[0].write_bytes(b"not a jpeg")
    ds = load_split(cfg_for(data), "val")
    assert ds.report.image_skips["corrupt"] == 1 and len(ds) == 7
    assert str(imgs[0]) in ds.report.summary()


@pytest.mark.parametrize("xml, match", [
    # No <size> is read from the image; the object's box is what is missing.
    ("<annotation><object><name>circle</name></object></annotation>", r"object 0: <bndbox> missing"),
    ("<annotation><size><width>64</width></size></annotation>", r"<size><height> missing"),
    ("<annotation><size><width>64</width><height>48</height></size><object><name>dog</name>"
     "<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax><ymax>9</ymax></bndbox></object></annotation>",
     r"object 0: class 'dog' is not in"),
    ("<annotation><size><width>64</width><height>48</height></size><object><name>circle</name>"
     "<bndbox><xmin>1</xmin><ymin>x</ymin></bndbox></object></annotation>", r"object 0: <bndbox><ymin> must be a number"),
    ("<annotation><size>", r"invalid XML at line 1 column"),
])
def test_bad_voc_xml_is_one_line_naming_the_file(demo_small, tmp_path, xml, match):
    root = make_voc(demo_small, tmp_path / "v")
    first = (root / "ImageSets" / "Main" / "val.txt").read_text().split()[0]
    (root / "Annotations" / f"{first}.xml").write_text(xml)
    msg = _one_line(match, cfg_for(root))
    assert f"{first}.xml" in msg


# ----------------------------------------------------------------------------- the check command

def test_check_command_prints_the_dataset_report(yolo_yaml, voc_root, tmp_path):
    for data in (yolo_yaml, voc_root):
        r = subprocess.run([sys.executable, "-m", "fastdet.data", "check", "--data", str(data),
                            "--cache-dir", str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=120)
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "train:" in out and "val:" in out and "boxes per class:" in out and "box size" in out
        val = load_split(cfg_for(data), "val")
        n_circle = sum(int((rec.labels == 0).sum()) for rec in val.records)
        val_part = out[out.index("val:"):]
        assert re.search(rf"\n    circle +{n_circle}\n", val_part), val_part
        assert f"{val.report.images_kept} images (1 without boxes)" in val_part
    bad = subprocess.run([sys.executable, "-m", "fastdet.data", "check", "--data", str(tmp_path / "none.yaml")],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "none.yaml" in bad.stderr


# ----------------------------------------------------------------------------- training

@pytest.mark.parametrize("fmt, loader", [("yolo", "torch"), ("voc", "dali")])
def test_training_and_eval_cli_on_yolo_and_voc(fmt, loader, yolo_yaml, voc_root, demo_small, tmp_path, capsys,
                                               caplog):
    """Training on the form reads it (the per-class table, the confusion matrix); the eval
    CLI gives the trainer's AP on it, and on the same val images in the other two forms
    (classes matched by name), with an AP far from 0. Two steps score AP 0 on the demo's
    boxes whatever the class map: a copy of the run gets head predictors of distinct boxes
    (tests/own_truth.py), the val boxes become its EMA's own detections, written in the
    three forms; the copy, resumed on the form trained on with its last step's evaluation
    dropped, evaluates them."""
    from own_truth import demo_with_own_truth, redraw_run_predictors

    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    data = yolo_yaml if fmt == "yolo" else voc_root
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fastdet.train", "--arch", "ppyoloe", "--size", "s",
                        "--data", str(data), "--device", "cpu", "--img-size", "64", "--no-multiscale",
                        "--batch-size", "4", "--epochs", "1", "--max-steps", "2", "--output-dir", str(out),
                        "--workers", "0", "--loader", loader, "--set", "optim.warmup_steps=2",
                        "--set", f"data.cache_dir={tmp_path / 'cache'}"],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"loader {loader}" in r.stdout and "COCO AP" in r.stdout
    assert "per-class AP at step 2" in r.stdout and (out / "confusion_matrix.png").is_file()

    redraw_run_predictors(out, "ppyoloe")
    own = demo_with_own_truth(demo_small, tmp_path / "own", out / "latest.pth", img_size=64)
    forms = {"coco": own, "yolo": make_yolo(own, tmp_path / "own_yolo"), "voc": make_voc(own, tmp_path / "own_voc")}
    rr = subprocess.run([sys.executable, "-m", "fastdet.train", "--resume", "--output-dir", str(out),
                         "--data", str(forms[fmt]), "--device", "cpu", "--workers", "0", "--loader", loader],
                        capture_output=True, text=True, env=ENV, timeout=600)
    assert rr.returncode == 0 and "evaluating it now" in rr.stdout, rr.stdout[-3000:] + rr.stderr[-3000:]
    trained = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert trained["step"] == 2 and trained["AP"] > 0.5, trained
    # latest.pth, rewritten with the new best AP, names the form it was evaluated on.
    ev = subprocess.run([sys.executable, "-m", "fastdet.eval", "--ckpt", str(out / "latest.pth"),
                         "--device", "cpu", "--loader", loader], capture_output=True, text=True, env=ENV,
                        timeout=300)
    assert ev.returncode == 0, ev.stderr
    ap_line = next(l for l in ev.stdout.splitlines() if l.startswith("COCO AP"))
    assert float(ap_line.split()[2]) == pytest.approx(trained["AP"], abs=1e-4)
    assert "per-class AP" in ev.stdout and "triangle" in ev.stdout  # the table, by class name
    # The same val images in the other two forms: classes matched by name, the same AP
    # (fastdet.eval's main() in this process: its command line ran as a process above).
    other = {"yolo": "voc", "voc": "yolo"}[fmt]
    for form in (forms["coco"], forms[other]):
        code, said, err = main_in_process(["--ckpt", str(out / "latest.pth"), "--data", str(form), "--device", "cpu",
                                           "--loader", loader], capsys, caplog, "fastdet.eval")
        assert code == 0, err
        line = next(l for l in said.splitlines() if l.startswith("COCO AP"))
        assert float(line.split()[2]) == pytest.approx(trained["AP"], abs=1e-3), form


def test_eval_matches_a_checkpoints_classes_to_a_set_by_name(yolo_yaml, demo_small):
    """COCO ids (1, 3, 7, 12) and YOLO ids (0..3) of the same names map label for label; a set
    listing them in another order is mapped by name; a real mismatch names both sides."""
    from fastdet.eval.__main__ import category_ids_by_name

    coco = load_coco(demo_small / "annotations" / "instances_val2017.json", demo_small / "val2017", train=False)
    yolo = load_split(cfg_for(yolo_yaml), "val", check_images="none")
    ck = {"class_names": list(coco.class_names), "cat_ids": list(coco.cat_ids)}
    assert coco.cat_ids != yolo.cat_ids and coco.class_names == yolo.class_names
    assert category_ids_by_name(ck, 4, yolo) == [0, 1, 2, 3]
    assert category_ids_by_name(ck, 4, coco) == list(coco.cat_ids)
    shuffled = replace(yolo, class_names=yolo.class_names[::-1])
    assert category_ids_by_name(ck, 4, shuffled) == [3, 2, 1, 0]
    renamed = replace(yolo, class_names=["circle", "square", "triangle", "cross"])
    with pytest.raises(ValueError, match=r"only in the checkpoint \['rectangle'\], only in this set \['square'\]"):
        category_ids_by_name(ck, 4, renamed)
    # A name twice is said as such (not "only in the checkpoint none, only in this set none").
    twice = replace(yolo, class_names=["circle", "circle", "triangle", "cross"])
    with pytest.raises(ValueError, match=r"names the class 'circle' twice"):
        category_ids_by_name(ck, 4, twice)
    # A checkpoint that trained Roboflow's project entry as a class: the line says why it differs.
    project = {"class_names": [*coco.class_names, "shapes"], "cat_ids": [*coco.cat_ids, 0]}
    yolo.report.categories_left_out.append("'shapes' (id 0)")
    with pytest.raises(ValueError, match=r"only in the checkpoint \['shapes'\], only in this set none \('shapes' "
                                         r"groups every other category of the file and has no box"):
        category_ids_by_name(project, 5, yolo)
    # A checkpoint without names is matched by id, and a different id is refused.
    assert category_ids_by_name({"cat_ids": list(coco.cat_ids)}, 4, coco) == list(coco.cat_ids)
    with pytest.raises(ValueError, match="keeps no class names"):
        category_ids_by_name({"cat_ids": list(coco.cat_ids)}, 4, yolo)


def test_every_command_counts_a_sets_classes_as_training_does(demo_small, tmp_path, monkeypatch, caplog, capsys):
    """``fastdet.compile`` and ``--print-config`` count a YOLO or VOC set's classes with its own
    reader (they read COCO's JSON only before: a data.yaml reached COCO's error)."""
    import logging

    from fastdet import compile as compile_cli
    from fastdet.data.formats import train_num_classes
    from fastdet.engine.compile_workers import CompileWorkers
    from fastdet.train import main as train_main

    data = make_yolo(demo_small, tmp_path / "yolo")
    spec = yaml.safe_load(data.read_text())
    spec["names"] = list(spec["names"]) + ["unused"]  # a fifth class: no COCO count gives 5
    data.write_text(yaml.safe_dump(spec))
    voc = make_voc(demo_small, tmp_path / "voc")
    for d, n in ((data, 5), (voc, 4), ("demo", 4)):
        cfg = DataConfig(data=str(d))
        assert train_num_classes(cfg) == n == load_split(cfg, "train", check_images="none").num_classes
    assert train_main(["--arch", "yolox", "--size", "nano", "--data", str(data), "--print-config"]) == 0
    assert "num_classes: 5" in capsys.readouterr().out

    # The graphs' compilation is not what this checks: no worker starts, none is waited for.
    monkeypatch.setattr(CompileWorkers, "start", lambda self, ready_dir: None)
    monkeypatch.setattr(CompileWorkers, "wait", lambda self: True)
    with caplog.at_level(logging.INFO, logger="fastdet"):
        rc = compile_cli.main(["--arch", "yolox", "--size", "nano", "--batch-size", "2", "--device", "cpu",
                               "--data", str(data), "--set", f"compile.cache_dir={tmp_path / 'cache'}"])
    assert rc == 0
    assert re.search(r"yolox-nano, 5 classes", caplog.text), caplog.text[-2000:]


# ----------------------------------------------------------------------------- sets as tools export them

def test_a_roboflow_style_yolo_export_reads_as_ultralytics_reads_it(demo_small, tmp_path):
    """Roboflow's ``../`` split paths, a data.yaml with a BOM, CRLF and quoted name keys, label
    files with a BOM and CRLF, a full-width box written 1-based (w = 1.0016), a ``.jfif``
    JPEG; and what is not read (a label without an image, a file of another type) counted."""
    data = make_yolo(demo_small, tmp_path / "rf")
    root = data.parent
    names = [c["name"] for c in _coco(demo_small, "train")["categories"]]
    data.write_bytes(("\ufefftrain: ../images/train\r\nval: ../images/val\r\nnc: 4\r\nnames:\r\n"
                      + "".join(f"  '{i}': {n}\r\n" for i, n in enumerate(names))).encode("utf-8"))
    labels = sorted((root / "labels" / "val").glob("*.txt"))
    lbl = labels[0]
    lines = lbl.read_text().splitlines() + ["0 0.5 0.5 1.0016 0.3"]
    lbl.write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode("utf-8"))
    first_image = root / "images" / "val" / f"{lbl.stem}.jpg"
    (root / "images" / "val" / "phone.jfif").symlink_to(first_image.resolve())
    (root / "labels" / "val" / "phone.txt").write_text("1 0.5 0.5 0.2 0.2\n")
    (root / "labels" / "val" / "ghost.txt").write_text("1 0.5 0.5 0.2 0.2\n")
    (root / "images" / "val" / "README.md").write_text("exported by a tool\n")

    ds = load_split(cfg_for(data), "val")
    assert ds.class_names == names
    assert len(ds.records) == 9  # the 8 images and the .jfif
    rep = ds.report
    assert rep.files_ignored == {"label file without an image": 1, "not an image file": 1}
    assert rep.examples["label file without an image"] == [str(root / "labels" / "val" / "ghost.txt")]
    assert rep.examples["not an image file"] == [str(root / "images" / "val" / "README.md")]
    assert rep.box_changes == {"clipped to the image": 1}
    assert rep.examples["clipped to the image"] == [f"{lbl}:{len(lines)}"]
    summary = rep.summary()
    assert "ghost.txt" in summary and f"{lbl}:{len(lines)}" in summary and "nothing" not in summary
    rec = next(r for r in ds.records if Path(r.file).stem == lbl.stem)
    assert rec.boxes[-1][0] == 0 and rec.boxes[-1][2] == rec.width  # clipped to the full width
    assert len(rec.boxes) == len(lines)


def test_yolo_text_in_gbk_is_read_and_undecodable_text_is_one_line(demo_small, tmp_path):
    data = make_yolo(demo_small, tmp_path / "y")
    spec = yaml.safe_load(data.read_text())
    chinese = ["圆形", "矩形", "三角形", "十字"]
    data.write_bytes(yaml.safe_dump({**spec, "names": chinese}, allow_unicode=True).encode("gbk"))
    assert load_split(cfg_for(data), "val").class_names == chinese
    data.write_bytes(yaml.safe_dump(spec).encode() + b"# \x80\x80\xff\n")
    msg = _one_line(r"not UTF-8 text \(byte 0x80 at offset \d+\) and not GBK either", cfg_for(data))
    assert str(data) in msg


def test_a_labelimg_style_voc_export_with_gbk_bom_crlf_and_no_size(demo_small, tmp_path, voc_root):
    """Chinese class names in a GBK label_list.txt and XMLs that declare GBK, an ImageSets
    list with a BOM and CRLF, an XML without <size> (read from the image): the same records
    as the plain set; a box's report example names its XML and object."""
    root = make_voc(demo_small, tmp_path / "v")
    names = [c["name"] for c in _coco(demo_small, "train")["categories"]]
    chinese = dict(zip(names, ["圆形", "矩形", "三角形", "十字"]))
    (root / "label_list.txt").write_bytes("\r\n".join(chinese.values()).encode("gbk"))
    xmls = sorted((root / "Annotations").glob("*.xml"))
    for k, xml in enumerate(xmls):
        text = xml.read_text()
        for en, zh in chinese.items():
            text = text.replace(f"<name>{en}</name>", f"<name>{zh}</name>")
        if k % 2:
            xml.write_bytes(('<?xml version="1.0" encoding="GBK"?>\r\n' + text).encode("gbk"))
        else:
            xml.write_bytes(("\ufeff" + text).encode("utf-8"))
    lst = root / "ImageSets" / "Main" / "val.txt"
    ids = lst.read_text().split()
    lst.write_bytes(("\ufeff" + "\r\n".join(ids) + "\r\n").encode("utf-8"))
    no_size = root / "Annotations" / f"{ids[0]}.xml"
    no_size.write_bytes(re.sub(rb"<size>.*?</size>", b"", no_size.read_bytes()))

    ds = load_split(cfg_for(root), "val")
    ref = load_split(cfg_for(voc_root), "val")
    assert ds.class_names == list(chinese.values())
    for a, b in zip(ds.records, ref.records):
        assert (a.width, a.height) == (b.width, b.height)
        np.testing.assert_array_equal(a.boxes, b.boxes)
        np.testing.assert_array_equal(a.labels, b.labels)
    assert len(ds.records) == len(ref.records) == len(ids)
    # A degenerate box is named by its XML and object, not by an id that exists only in memory.
    xml = root / "Annotations" / f"{ids[1]}.xml"
    raw = xml.read_bytes()
    objects = raw.count(b"<object>")
    xml.write_bytes(raw.replace(b"</annotation>", "<object><name>圆形</name><bndbox><xmin>5</xmin><ymin>5</ymin>"
                                "<xmax>4.5</xmax><ymax>9</ymax></bndbox></object></annotation>".encode("gbk")))
    ds = load_split(cfg_for(root), "val")
    assert ds.report.examples["degenerate"] == [f"{xml} object {objects}"]


def _sideways_photo_set(root: Path) -> Path:
    """A phone's photo stored sideways (EXIF orientation 6: turn 90° clockwise to view) and
    an upright one, with YOLO labels drawn on the upright pictures: white objects on black."""
    from PIL import Image

    (root / "images" / "val").mkdir(parents=True)
    (root / "labels" / "val").mkdir(parents=True)
    upright = np.zeros((96, 64, 3), np.uint8)  # [H, W]: portrait as the phone was held
    upright[60:88, 8:24] = 255
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)  # 96 x 64 landscape pixels
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(root / "images" / "val" / "phone.jpg", exif=exif.tobytes(), quality=95)
    Image.fromarray(upright).save(root / "images" / "val" / "plain.jpg", quality=95)
    for name in ("phone", "plain"):  # x 8..24 of 64, y 60..88 of 96
        (root / "labels" / "val" / f"{name}.txt").write_text(f"0 {16 / 64!r} {74 / 96!r} {16 / 64!r} {28 / 96!r}\n")
    (root / "data.yaml").write_text(yaml.safe_dump({"path": ".", "train": "images/val", "val": "images/val",
                                                    "names": ["object"]}))
    return root / "data.yaml"


@pytest.mark.parametrize("loader", ["torch", "dali"])
def test_a_sideways_stored_photo_is_read_upright_under_its_labels(tmp_path, loader):
    """EXIF orientation is applied to the pixels and to the size labels are normalised
    against, in both loaders and in predict's decoder; the report counts the turned image."""
    from fastdet.data.augment import decode_image
    from fastdet.data.loader import build_eval_loader
    from fastdet.data.preprocess import Preprocess

    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    data = _sideways_photo_set(tmp_path / "set")
    ds = load_split(replace(cfg_for(data), loader=loader), "val")
    phone = next(r for r in ds.records if Path(r.file).stem == "phone")
    assert (phone.width, phone.height) == (64, 96)
    assert ds.report.image_changes == {"turned upright by their EXIF orientation": 1}
    assert "1 turned upright by their EXIF orientation" in ds.report.summary() and "phone.jpg" in ds.report.summary()
    assert decode_image(phone.file).shape == (96, 64, 3)  # predict and the torch back end decode this way
    cfg = replace(cfg_for(data), loader=loader, img_size=64, eval_batch_size=2, num_workers=0)
    batch = next(iter(build_eval_loader(cfg, ds, preprocess=Preprocess(mean=None, std=None), rank=0,
                                        world_size=1, device="cpu")))
    images = batch["images"].float()  # [2, 3, 64, 64], 0..255
    for b in range(2):
        x0, y0, x1, y1 = (int(round(float(v))) for v in batch["gt_boxes"][b, 0])
        inside = images[b, :, y0 + 1:y1 - 1, x0 + 1:x1 - 1].mean()
        outside = images[b].sum() - images[b, :, y0:y1, x0:x1].sum()
        assert inside > 200 and outside / images[b].numel() < 30, (b, float(inside))




@pytest.mark.parametrize("loader", ["torch", "dali"])
def test_a_16_bit_grayscale_png_keeps_its_high_byte_in_every_decoder(tmp_path, loader):
    """A 16-bit grayscale PNG (a depth or medical camera's, a scanner's) reads as its high
    byte, as DALI's decoder reads it, in both loaders, predict's decoder and ``fastdet.detect``
    on a PIL image: PIL's ``convert("RGB")`` clips every value above 255, so the picture was
    all white."""
    from PIL import Image

    from fastdet.api import as_rgb_images
    from fastdet.data.augment import decode_image
    from fastdet.data.loader import build_eval_loader
    from fastdet.data.preprocess import Preprocess

    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    root = tmp_path / "set"
    (root / "images" / "val").mkdir(parents=True)
    (root / "labels" / "val").mkdir(parents=True)
    pixels = np.full((64, 64), 40 * 256 + 100, np.uint16)  # high byte 40 left, 200 right
    pixels[:, 32:] = 200 * 256 + 255
    for name in ("a", "b"):
        Image.fromarray(pixels).save(root / "images" / "val" / f"{name}.png")
        (root / "labels" / "val" / f"{name}.txt").write_text("0 0.25 0.5 0.25 0.5\n")
    (root / "data.yaml").write_text(yaml.safe_dump({"path": ".", "train": "images/val", "val": "images/val",
                                                    "names": ["object"]}))
    png = root / "images" / "val" / "a.png"
    high = np.repeat((pixels >> 8).astype(np.uint8)[:, :, None], 3, axis=2)
    assert Image.open(png).mode.startswith("I")
    assert np.array_equal(decode_image(str(png)), high)
    assert np.array_equal(as_rgb_images(Image.open(png))[0], high)
    ds = load_split(cfg_for(root / "data.yaml"), "val")
    cfg = replace(cfg_for(root / "data.yaml"), loader=loader, img_size=64, eval_batch_size=2, num_workers=0)
    batch = next(iter(build_eval_loader(cfg, ds, preprocess=Preprocess(mean=None, std=None), rank=0,
                                        world_size=1, device="cpu")))
    images = batch["images"].float()  # [2, 3, 64, 64], 0..255, the image at its own size
    assert images[:, :, :, 2:30].sub(40).abs().max() <= 1 and images[:, :, :, 34:62].sub(200).abs().max() <= 1
