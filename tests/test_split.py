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
import yaml
from test_exports import (cvat_coco_subsets, cvat_yolo, labelimg_voc, labelimg_voc_in_one_folder,  # tests/ on sys.path
                          labelimg_yolo_in_one_folder, labelstudio_yolo_export)


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
    boxed = doc["annotations"][0]["image_id"]
    one.write_text(json.dumps({**doc, "images": [im for im in doc["images"] if im["id"] == boxed],
                               "annotations": [a for a in doc["annotations"] if a["image_id"] == boxed]}))
    cases = [
        (["--ann", str(ann), "--images", str(images), "--output-dir", str(tmp_path / "a"), "--val-fraction", "1"],
         "--val-fraction must be between 0 and 1, got 1"),
        (["--ann", str(tmp_path / "nope.json"), "--images", str(images), "--output-dir", str(tmp_path / "b")],
         "annotation file not found"),
        (["--ann", str(one), "--images", str(images), "--output-dir", str(tmp_path / "c")],
         f"{one}: 1 image(s) that read (images sharing a label file count as one): a split needs at least 2"),
        (["--ann", str(ann), "--images", str(images), "--output-dir", str(mine), "--overwrite"],
         f"holds {mine / 'train'}, which is not this format's (COCO)"),
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


def _listed(out: Path, split: str) -> list[str]:
    """The image file names of one split of a YOLO or VOC split's output."""
    if (out / "data.yaml").is_file():
        return [Path(line).name for line in (out / f"{split}.txt").read_text().splitlines()]
    return [f.name for f in (out / split).rglob("*") if f.suffix != ".xml"]


def test_images_sharing_a_label_file_land_in_one_split(demo_small, tmp_path, capsys):
    """``a.jpg`` and ``a.png`` beside one ``a.txt`` / ``a.xml``: the same split for every seed
    (the VOC split linked the XML twice and failed half-written; YOLO put the pair apart)."""
    from PIL import Image

    for make in (labelimg_yolo_in_one_folder, labelimg_voc_in_one_folder):
        root = tmp_path / make.__name__
        make(demo_small, root)
        jpgs = [j for j in sorted((root / "all").glob("*.jpg"))[:6]  # with a label file (LabelImg's VOC: boxes)
                if j.with_suffix(".txt").is_file() or j.with_suffix(".xml").is_file()]
        for j in jpgs:
            Image.open(j).save(j.with_suffix(".png"))
        for seed in range(6):
            out = tmp_path / f"{make.__name__}_{seed}"
            rc, _, err = run(capsys, "--data", str(root), "--output-dir", str(out), "--seed", str(seed),
                             "--val-fraction", "0.5")
            assert rc == 0, err
            val = set(_listed(out, "val"))
            assert all((j.name in val) == (j.with_suffix(".png").name in val) for j in jpgs), (seed, val)


def test_what_the_export_does_not_read_decides_before_writing(demo_small, tmp_path, capsys):
    """XMLs with a classes.txt beside them and no YOLO label: a VOC export; YOLO labels where
    ultralytics' rule does not look: refused, not split into a set of no box; an unreadable
    image stays in train (counted there again), never alone in val."""
    voc = tmp_path / "voc"
    labelimg_voc_in_one_folder(demo_small, voc)
    (voc / "all" / "classes.txt").write_text("circle\nrectangle\ntriangle\ncross\n")
    rc, out, err = run(capsys, "--data", str(voc), "--output-dir", str(tmp_path / "voc_out"))
    assert rc == 0 and "149 boxes" in out and (tmp_path / "voc_out" / "val").is_dir(), out + err
    beside = tmp_path / "beside"
    labelimg_yolo_in_one_folder(demo_small, beside)
    shutil.move(beside / "all", beside / "images")  # txt files beside the images in images/
    rc, _, err = run(capsys, "--data", str(beside), "--output-dir", str(tmp_path / "beside_out"))
    assert rc == 1 and "not one box" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "beside_out").exists()
    broken = tmp_path / "broken"
    labelimg_yolo_in_one_folder(demo_small, broken)
    (broken / "all" / "zz.jpg").write_bytes(b"not a jpeg")
    for seed in range(4):
        out_dir = tmp_path / f"broken_{seed}"
        rc, out, err = run(capsys, "--data", str(broken), "--output-dir", str(out_dir), "--seed", str(seed),
                           "--val-fraction", "0.5")
        assert rc == 0 and "zz.jpg" in _listed(out_dir, "train") and "zz.jpg" not in _listed(out_dir, "val"), err


def test_split_data_takes_a_train_split_alone_and_keeps_a_test_entry(demo_small, tmp_path, capsys, monkeypatch):
    """A CVAT project's Train subset without Validation, a VOC train/ folder alone: their
    train split is split; a data.yaml's test entry is kept; CVAT's obj.data named by a
    relative path reads (its lists were joined to its folder twice)."""
    subsets = tmp_path / "subsets"
    cvat_coco_subsets(demo_small, subsets)
    (subsets / "annotations" / "instances_Validation.json").unlink()
    assert run(capsys, "--data", str(subsets), "--output-dir", str(tmp_path / "s_out"))[0] == 0
    assert data_main(["check", "--data", str(tmp_path / "s_out")]) == 0
    folders = tmp_path / "folders"
    labelimg_voc(demo_small, folders)
    shutil.rmtree(folders / "val")
    assert run(capsys, "--data", str(folders), "--output-dir", str(tmp_path / "f_out"))[0] == 0
    assert data_main(["check", "--data", str(tmp_path / "f_out")]) == 0
    capsys.readouterr()
    yolo = tmp_path / "yolo"
    labelstudio_yolo_export(demo_small, yolo)
    (yolo / "data.yaml").write_text(yaml.safe_dump({"train": "images/train", "test": "images/val",
                                                    "names": ["circle", "rectangle", "triangle", "cross"]}))
    assert run(capsys, "--data", str(yolo), "--output-dir", str(tmp_path / "y_out"))[0] == 0
    assert data_main(["check", "--data", str(tmp_path / "y_out"), "--splits", "test"]) == 0
    assert "8 images" in capsys.readouterr().out
    cvat = tmp_path / "cvat"
    cvat_yolo(demo_small, cvat)
    monkeypatch.chdir(tmp_path)
    assert data_main(["check", "--data", "cvat"]) == 0


def test_an_earlier_split_moved_or_of_another_format_is_said(demo_small, tmp_path, capsys):
    """--overwrite replaces a split of the same format only: one of another would be read in
    place of the new one; a VOC split whose export moved says so, instead of calling its
    links an export to split; a COCO export's folder may not hold its own split; LabelImg's
    XMLs saved apart from the images are one line."""
    yolo, voc = tmp_path / "yolo", tmp_path / "voc"
    labelstudio_yolo_export(demo_small, yolo)
    labelimg_voc_in_one_folder(demo_small, voc)
    out = tmp_path / "out"
    assert run(capsys, "--data", str(yolo), "--output-dir", str(out))[0] == 0
    rc, _, err = run(capsys, "--data", str(voc), "--output-dir", str(out), "--overwrite")
    assert rc == 1 and f"holds {out / 'data.yaml'}, which is not this format's (VOC)" in err, err
    assert run(capsys, "--data", str(voc), "--output-dir", str(tmp_path / "v_out"))[0] == 0
    shutil.move(voc, tmp_path / "moved")
    rc = data_main(["check", "--data", str(tmp_path / "v_out")])
    err = capsys.readouterr().err
    assert rc == 1 and "which is missing: the export a split linked has moved" in err, err
    ann, images = export(demo_small, tmp_path / "cvat")
    rc, _, err = run(capsys, "--data", str(tmp_path / "cvat"), "--output-dir", str(tmp_path / "cvat"))
    assert rc == 1 and "is inside the export" in err, err
    apart = tmp_path / "apart"
    labelimg_voc_in_one_folder(demo_small, apart)
    (apart / "annotations").mkdir()
    for x in (apart / "all").glob("*.xml"):
        shutil.move(x, apart / "annotations" / x.name)
    rc, _, err = run(capsys, "--data", str(apart), "--output-dir", str(tmp_path / "a_out"))
    assert rc == 1 and "has an XML beside it" in err and "is elsewhere" in err, err


def test_layouts_with_a_test_split_keep_it_and_untrue_lines_are_gone(demo_small, tmp_path, capsys, monkeypatch):
    """A VOC train/ + test/ set and a COCO Train + test set: their test split is linked into
    the output; a YOLO test list of relative lines, named from a relative --data, reads from
    the output; an output inside the export (even in its missing val/) is refused; a layout
    with no train split, a COCO export without a box and a folder of another format's split
    are said as they are; a txt beside its image in images/ is named as such."""
    folders = tmp_path / "folders"
    labelimg_voc(demo_small, folders)
    shutil.copytree(folders / "val", folders / "test")
    shutil.rmtree(folders / "val")
    rc, _, err = run(capsys, "--data", str(folders), "--output-dir", str(folders / "val"))
    assert rc == 1 and "is inside the export" in err, err
    assert run(capsys, "--data", str(folders), "--output-dir", str(tmp_path / "f_out"))[0] == 0
    assert data_main(["check", "--data", str(tmp_path / "f_out"), "--splits", "train,val,test"]) == 0
    assert (tmp_path / "f_out" / "test").is_symlink()
    subsets = tmp_path / "subsets"
    cvat_coco_subsets(demo_small, subsets)
    (subsets / "annotations" / "instances_Validation.json").rename(subsets / "annotations" / "instances_Test.json")
    (subsets / "images" / "Validation").rename(subsets / "images" / "Test")
    assert run(capsys, "--data", str(subsets), "--output-dir", str(tmp_path / "s_out"))[0] == 0
    assert data_main(["check", "--data", str(tmp_path / "s_out"), "--splits", "train,val,test"]) == 0
    # The VOC split's train/ is a folder where COCO links one: another format's, said so.
    rc, _, err = run(capsys, "--data", str(subsets), "--output-dir", str(tmp_path / "f_out"), "--overwrite")
    assert rc == 1 and f"holds {tmp_path / 'f_out' / 'train'}, which is not this format's (COCO)" in err, err
    val_only = tmp_path / "val_only"
    (val_only / "annotations").mkdir(parents=True)
    shutil.copy(demo_small / "annotations" / "instances_val2017.json", val_only / "annotations")
    shutil.copytree(demo_small / "val2017", val_only / "val2017")
    rc, _, err = run(capsys, "--data", str(val_only), "--output-dir", str(tmp_path / "v_out"))
    assert rc == 1 and "a COCO layout without a train split" in err, err
    ann, images = export(demo_small, tmp_path / "cvat")
    doc = json.loads(ann.read_text())
    ann.write_text(json.dumps({**doc, "annotations": []}))
    rc, _, err = run(capsys, "--ann", str(ann), "--images", str(images), "--output-dir", str(tmp_path / "n_out"))
    assert rc == 1 and "not one box" in err and not (tmp_path / "n_out").exists(), err
    yolo = tmp_path / "yolo"
    labelstudio_yolo_export(demo_small, yolo)
    for split in ("train", "val"):
        (yolo / f"{split}.txt").write_text("".join(f"images/{split}/{f.name}\n"
                                                   for f in sorted((yolo / "images" / split).iterdir())))
    (yolo / "data.yaml").write_text(yaml.safe_dump({"train": "train.txt", "test": "val.txt",
                                                    "names": ["circle", "rectangle", "triangle", "cross"]}))
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "--data", "yolo/data.yaml", "--output-dir", "y_out")[0] == 0
    assert data_main(["check", "--data", str(tmp_path / "y_out"), "--splits", "test"]) == 0
    beside = tmp_path / "beside"
    labelimg_yolo_in_one_folder(demo_small, beside)
    shutil.move(beside / "all", beside / "images")
    (beside / "images" / "README.txt").write_text("exported by hand\n")
    rc, _, err = run(capsys, "--data", str(beside), "--output-dir", str(tmp_path / "b_out"))
    assert rc == 1 and "label file beside its image, where ultralytics' rule does not look" in err, err
    assert "README.txt" in err.split("not an image file (")[1], err  # not called a label file


def test_check_reads_every_pixel_and_finds_a_jpeg_cut_short(demo_small, tmp_path, capsys):
    """A JPEG cut short has a header that reads: only its pixels show it. `data check`
    decodes every image by default and names it; with --check-images open it would pass."""
    data = tmp_path / "data"
    shutil.copytree(demo_small, data)
    bad = sorted((data / "train2017").glob("*.jpg"))[3]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 3])
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert data_main(["check", "--data", str(data), *cache]) == 0
    out = capsys.readouterr().out
    assert "images: every pixel read" in out and f"1 corrupt ({bad})" in out, out
    assert data_main(["check", "--data", str(data), "--check-images", "open", *cache[:1], str(tmp_path / "c2")]) == 0
    out = capsys.readouterr().out
    assert "headers read" in out and "corrupt" not in out, out
