"""``python -m fastdet.data split``: a single-split export into train and val (COCO here;
the YOLO and VOC exports' splits, made by the command their refusals give, in
tests/test_exports.py).

What must hold: every image and its boxes land in exactly one split, the same seed gives
the same split, both files keep the export's categories and fields, ``--data OUT`` reads
the result, bad values are one line before anything is written, and nothing existing is
replaced without ``--overwrite`` (and not even then when it is not a split's own output).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from fastdet.data.__main__ import main as data_main
from test_exports import cvat_yolo, labelimg_voc_in_one_folder, labelstudio_yolo_export  # tests/ is on sys.path


def export(demo_small: Path, root: Path) -> tuple[Path, Path]:
    """CVAT's task export of the demo train split, with its own top-level fields."""
    doc = json.loads((demo_small / "annotations" / "instances_train2017.json").read_text())
    doc.update(info={"contributor": "cvat"}, licenses=[{"id": 0, "name": "", "url": ""}])
    shutil.copytree(demo_small / "train2017", root / "images")
    (root / "annotations").mkdir()
    (root / "annotations" / "instances_default.json").write_text(json.dumps(doc))
    return root / "annotations" / "instances_default.json", root / "images"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = data_main(["split", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def val_names(out: Path) -> set[str]:
    return {im["file_name"] for im in json.loads((out / "annotations" / "instances_val.json").read_text())["images"]}


def test_split_is_a_partition_by_image_repeatable_by_seed_and_reads_as_data(demo_small, tmp_path, capsys):
    ann, images = export(demo_small, tmp_path / "cvat")
    doc = json.loads(ann.read_text())
    out = tmp_path / "out"
    rc, stdout, err = run(capsys, "--ann", str(ann), "--images", str(images), "--output-dir", str(out),
                          "--val-fraction", "0.25", "--seed", "3")
    assert rc == 0, err
    parts = [json.loads((out / "annotations" / f"instances_{s}.json").read_text()) for s in ("train", "val")]
    ids = [{im["id"] for im in p["images"]} for p in parts]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == {im["id"] for im in doc["images"]}
    assert len(ids[1]) == round(0.25 * len(doc["images"]))
    for p, own in zip(parts, ids):  # each box with its image, none lost
        assert {a["image_id"] for a in p["annotations"]} <= own
        assert p["categories"] == doc["categories"] and p["info"] == doc["info"] and p["licenses"] == doc["licenses"]
    assert sum(len(p["annotations"]) for p in parts) == len(doc["annotations"])
    assert f"train on it with --data {out}" in stdout
    assert data_main(["check", "--data", str(out), "--check-images", "decode"]) == 0
    assert "problems: nothing dropped or skipped" in capsys.readouterr().out
    # The same seed: the same split; another seed: another one (replacing needs --overwrite).
    first = val_names(out)
    rc, _, err = run(capsys, "--ann", str(ann), "--images", str(images), "--output-dir", str(out),
                     "--val-fraction", "0.25", "--seed", "3")
    assert rc == 1 and "add --overwrite to replace them" in err and val_names(out) == first, err
    assert run(capsys, "--ann", str(ann), "--images", str(images), "--output-dir", str(tmp_path / "again"),
               "--val-fraction", "0.25", "--seed", "3")[0] == 0
    assert val_names(tmp_path / "again") == first
    assert run(capsys, "--ann", str(ann), "--images", str(images), "--output-dir", str(out),
               "--val-fraction", "0.25", "--seed", "4", "--overwrite")[0] == 0
    assert val_names(out) != first


def test_every_class_keeps_a_training_image(demo_small, tmp_path, capsys):
    """A class with a single image: drawn for val it goes back to train (the model must see
    it), and the summary says val has no box of it."""
    ann, images = export(demo_small, tmp_path / "cvat")
    doc = json.loads(ann.read_text())
    rare = doc["annotations"][0]
    doc["categories"].append({"id": 99, "name": "rare", "supercategory": ""})
    doc["annotations"].append({**rare, "id": 10_000, "category_id": 99})
    ann.write_text(json.dumps(doc))
    seeds = []
    for seed in range(40):  # seeds that draw the rare image for val
        out = tmp_path / f"s{seed}"
        rc, stdout, err = run(capsys, "--ann", str(ann), "--images", str(images), "--output-dir", str(out),
                              "--val-fraction", "0.5", "--seed", str(seed))
        assert rc == 0, err
        train = json.loads((out / "annotations" / "instances_train.json").read_text())
        assert 99 in {a["category_id"] for a in train["annotations"]}, seed
        if "no box of 1 class(es) in val: rare (not scored on this val split)" in stdout:
            seeds.append(seed)
    assert seeds  # some seed drew it for val first: the case the rule is for


def test_split_refuses_in_one_line_before_writing(demo_small, tmp_path, capsys):
    ann, images = export(demo_small, tmp_path / "cvat")
    mine = tmp_path / "mine"
    (mine / "train").mkdir(parents=True)  # a folder of the user's, not a split's link
    one = tmp_path / "one.json"
    doc = json.loads(ann.read_text())
    one.write_text(json.dumps({**doc, "images": doc["images"][:1], "annotations": []}))
    cases = [
        (["--ann", str(ann), "--images", str(images), "--output-dir", str(tmp_path / "a"), "--val-fraction", "1"],
         "--val-fraction must be between 0 and 1, got 1"),
        (["--ann", str(tmp_path / "nope.json"), "--images", str(images), "--output-dir", str(tmp_path / "b")],
         "annotation file not found"),
        (["--ann", str(one), "--images", str(images), "--output-dir", str(tmp_path / "c")],
         "1 image(s): a split needs at least 2"),
        (["--ann", str(ann), "--images", str(images), "--output-dir", str(mine), "--overwrite"],
         f"{mine / 'train'} is not a link an earlier split made"),
        (["--ann", str(ann), "--images", str(images.parent), "--output-dir", str(tmp_path / "d")],
         f"no usable images in {images.parent}"),  # the wrong folder: said before writing
        (["--ann", str(ann), "--images", str(images), "--output-dir", str(tmp_path / "e"), "--seed", "-1"],
         "--seed must be 0 or more, got -1"),
        (["--ann", str(ann), "--images", str(images), "--output-dir", str(ann)], f"--output-dir {ann} is a file"),
    ]
    for argv, message in cases:
        rc, _, err = run(capsys, *argv)
        assert rc == 1 and len(err.strip().splitlines()) == 1 and message in err, (argv, err)
    assert not any((tmp_path / d).exists() for d in "abcde") and not (mine / "annotations").exists()


def test_links_survive_the_working_directory_and_overwrite_follows_a_moved_export(demo_small, tmp_path, capsys,
                                                                                   monkeypatch):
    ann, images = export(demo_small, tmp_path / "cvat")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert run(capsys, "--ann", "../cvat/annotations/instances_default.json", "--images", "../cvat/images",
               "--output-dir", "../out")[0] == 0
    assert Path(os.readlink(tmp_path / "out" / "train")) == images.resolve()  # not ../cvat/images from work/
    shutil.move(tmp_path / "cvat", tmp_path / "moved")
    moved = tmp_path / "moved"
    rc, out, err = run(capsys, "--ann", str(moved / "annotations" / "instances_default.json"), "--images",
                       str(moved / "images"), "--output-dir", str(tmp_path / "out"), "--overwrite")
    assert rc == 0, err
    assert Path(os.readlink(tmp_path / "out" / "val")) == (moved / "images").resolve()
    assert data_main(["check", "--data", str(tmp_path / "out")]) == 0


def test_split_data_refuses_in_one_line_before_writing(demo_small, tmp_path, capsys):
    """``--data``: an export that already has its splits, the output inside the export, a bad
    label line, flags given twice or not at all, a user's own file where the links go: one
    line each, nothing written."""
    yolo, voc = tmp_path / "yolo", tmp_path / "voc"
    labelstudio_yolo_export(demo_small, yolo)
    labelimg_voc_in_one_folder(demo_small, voc)
    cvat = tmp_path / "cvat"
    cvat_yolo(demo_small, cvat)  # has its Validation subset
    bad = tmp_path / "bad"
    shutil.copytree(yolo, bad)
    label = sorted((bad / "labels").rglob("*.txt"))[3]
    label.write_text(label.read_text() + "0 0.5 0.5 0.2\n")
    mine = tmp_path / "mine"
    (mine / "val").mkdir(parents=True)
    (mine / "val" / "notes.txt").write_text("the user's")
    cases = [
        (["--data", str(yolo), "--ann", "x.json", "--images", "y", "--output-dir", str(tmp_path / "a")],
         "give the export with --data, or a COCO file with --ann and --images (got --data and --ann and --images)"),
        (["--output-dir", str(tmp_path / "a")], "(got none)"),
        (["--data", str(cvat), "--output-dir", str(tmp_path / "a")],
         f"{cvat / 'obj.data'}: already names its val images"),
        (["--data", str(demo_small), "--output-dir", str(tmp_path / "a")], "already holds its splits (COCO)"),
        (["--data", str(yolo), "--output-dir", str(yolo / "split")], f"--output-dir {yolo / 'split'} is inside"),
        (["--data", str(bad), "--output-dir", str(tmp_path / "a")], f"{label}:"),
        (["--data", str(tmp_path / "nothing"), "--output-dir", str(tmp_path / "a")], "no such file or folder"),
        (["--data", str(voc), "--output-dir", str(mine), "--overwrite"],
         f"{mine / 'val'} is not a folder of links an earlier split made ({mine / 'val' / 'notes.txt'})"),
    ]
    for argv, message in cases:
        rc, _, err = run(capsys, *argv)
        assert rc == 1 and len(err.strip().splitlines()) == 1 and message in err, (argv, err)
    assert not (tmp_path / "a").exists() and not (yolo / "split").exists()
    assert sorted(p.name for p in mine.rglob("*")) == ["notes.txt", "val"]


def test_split_data_of_a_coco_export_folder_is_the_split_of_its_file(demo_small, tmp_path, capsys):
    ann, images = export(demo_small, tmp_path / "cvat")
    assert run(capsys, "--ann", str(ann), "--images", str(images), "--output-dir", str(tmp_path / "by_files"))[0] == 0
    assert run(capsys, "--data", str(tmp_path / "cvat"), "--output-dir", str(tmp_path / "by_folder"))[0] == 0
    assert val_names(tmp_path / "by_folder") == val_names(tmp_path / "by_files")
    assert Path(os.readlink(tmp_path / "by_folder" / "val")) == images.resolve()
