"""The COCO layer: the demo set, handmade broken files, the category mapping, resolve_data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdet.config import DataConfig
from fastdet.data import coco as coco_mod
from fastdet.data import demo
from fastdet.data.coco import DataError, DataPaths, coco_layout, load_coco, resolve_data

# ----------------------------------------------------------------------------- helpers

# Three small images; categories deliberately unsorted and non-contiguous.
IMAGES = [
    {"id": 10, "file_name": "a.jpg", "width": 64, "height": 48},
    {"id": 20, "file_name": "b.jpg", "width": 80, "height": 60},
    {"id": 30, "file_name": "sub/c.jpg", "width": 50, "height": 50},
]
CATEGORIES = [{"id": 7, "name": "cat"}, {"id": 2, "name": "dog"}, {"id": 40, "name": "emu"}]


def good_annotations() -> list[dict]:
    return [
        {"id": 1, "image_id": 10, "category_id": 7, "bbox": [4, 5, 20, 10], "iscrowd": 0, "area": 200},
        {"id": 2, "image_id": 10, "category_id": 40, "bbox": [30.5, 6, 10, 12.25], "iscrowd": 0, "area": 1},
        {"id": 3, "image_id": 20, "category_id": 2, "bbox": [0, 0, 80, 60], "iscrowd": 0, "area": 1},
        {"id": 4, "image_id": 30, "category_id": 7, "bbox": [10, 10, 5, 5], "iscrowd": 0, "area": 1},
    ]


def write_jpeg(path: Path, w: int, h: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(w * 1000 + h)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path, "JPEG", quality=90)


def make_set(root: Path, images=None, annotations=None, categories=None, write_images=True) -> tuple[Path, Path]:
    """Write a COCO file and its JPEGs under ``root``; return (ann_file, image_dir)."""
    images = IMAGES if images is None else images
    img_dir = root / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    if write_images:
        for im in images:
            write_jpeg(img_dir / im["file_name"], im["width"], im["height"])
    doc = {
        "images": images,
        "annotations": good_annotations() if annotations is None else annotations,
        "categories": CATEGORIES if categories is None else categories,
    }
    ann = root / "instances.json"
    ann.write_text(json.dumps(doc, indent=1))
    return ann, img_dir


def raises_one_line(match: str, *args, **kwargs) -> DataError:
    with pytest.raises(DataError, match=match) as e:
        load_coco(*args, **kwargs)
    assert "\n" not in str(e.value)
    return e.value


# ----------------------------------------------------------------------------- the demo set

def test_demo_records_match_the_json(demo_paths: DataPaths):
    doc = json.loads(demo_paths.train_ann.read_text())
    ds = load_coco(demo_paths.train_ann, demo_paths.train_images, train=True)
    assert ds.cat_ids == [c["id"] for c in doc["categories"]] == [1, 3, 7, 12]
    assert ds.class_names == ["circle", "rectangle", "triangle", "cross"]
    assert ds.num_classes == 4
    by_image: dict[int, list[dict]] = {}
    for a in doc["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    # Training drops the images without objects (one in the small set) and says so.
    empty = [im["id"] for im in doc["images"] if im["id"] not in by_image]
    assert len(empty) == 1
    assert len(ds) == len(doc["images"]) - 1 and empty[0] not in ds.image_ids
    assert ds.report.image_skips == {"without boxes": 1}
    assert ds.report.summary() == "skipped 1 image: 1 without boxes"
    sizes = {im["id"]: (im["width"], im["height"]) for im in doc["images"]}
    for r in ds.records:
        anns = by_image[r.image_id]
        expect = np.array([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                           for a in anns], np.float32)
        np.testing.assert_array_equal(r.boxes, expect)
        assert r.boxes.dtype == np.float32 and r.labels.dtype == np.int64
        assert [ds.cat_ids[l] for l in r.labels] == [a["category_id"] for a in anns]
        assert (r.width, r.height) == sizes[r.image_id]
        assert Path(r.file).is_absolute() and Path(r.file).is_file()
    assert ds.report.boxes_kept == len(doc["annotations"])


def test_demo_val_keeps_empty_images(demo_paths: DataPaths):
    ds = load_coco(demo_paths.val_ann, demo_paths.val_images, train=False, check_images="decode")
    doc = json.loads(demo_paths.val_ann.read_text())
    assert ds.image_ids == [im["id"] for im in doc["images"]]
    assert sum(len(r.boxes) == 0 for r in ds.records) == 1
    assert ds.report.summary() == "nothing dropped or skipped"
    assert ds.describe() == (
        f"instances_val2017.json: 8 images, {len(doc['annotations'])} boxes, 4 classes; nothing dropped or skipped"
    )


# ----------------------------------------------------------------------------- category mapping

def test_category_mapping_round_trip(tmp_path):
    ann, img_dir = make_set(tmp_path)
    ds = load_coco(ann, img_dir, train=True)
    # Labels follow the order of the `categories` array, not the numeric order of ids.
    assert ds.cat_ids == [7, 2, 40] and ds.class_names == ["cat", "dog", "emu"]
    for label in range(ds.num_classes):
        assert ds.label_of(ds.cat_id_of(label)) == label
    for cat in (7, 2, 40):
        assert ds.cat_id_of(ds.label_of(cat)) == cat
    with pytest.raises(KeyError, match="category id 3 is not declared"):
        ds.label_of(3)
    rec = {r.image_id: r for r in ds.records}
    assert rec[10].labels.tolist() == [0, 2] and rec[20].labels.tolist() == [1]
    np.testing.assert_array_equal(rec[10].boxes, np.array([[4, 5, 24, 15], [30.5, 6, 40.5, 18.25]], np.float32))
    assert rec[30].file == str(img_dir.absolute() / "sub" / "c.jpg")


@pytest.mark.parametrize("categories, left_out", [
    # Roboflow's: the project groups every class and has no box.
    ([{"id": 0, "name": "pets", "supercategory": "none"}] +
     [{**c, "supercategory": "pets"} for c in CATEGORIES], ["'pets' (id 0)"]),
    # A single-class Roboflow project named after its class: the project entry goes.
    ([{"id": 0, "name": "cat", "supercategory": "none"}, {"id": 7, "name": "cat", "supercategory": "cat"},
      {"id": 2, "name": "dog", "supercategory": "cat"}, {"id": 40, "name": "emu", "supercategory": "cat"}],
     ["'cat' (id 0)"]),
    # COCO's: a class names itself as its supercategory ("person"): a class.
    ([{**c, "supercategory": c["name"]} for c in CATEGORIES] + [{"id": 9, "name": "yak", "supercategory": "yak"}], []),
    # A parent with boxes of its own is a class (emu groups cat and dog here).
    ([{**c, "supercategory": "emu"} for c in CATEGORIES[:2]] + [CATEGORIES[2]], []),
    # A hierarchy's root without boxes here (Roboflow marks its project entry "none"): a class,
    # as another split may have its boxes.
    ([{"id": 60, "name": "animal", "supercategory": "life"}] + [{**c, "supercategory": "animal"} for c in CATEGORIES],
     []),
    # An inner node of a hierarchy (pet groups cat and dog, not emu) is a class even without
    # boxes: a val file without its boxes must keep the train file's classes.
    ([{"id": 60, "name": "pet", "supercategory": "none"}] + [{**c, "supercategory": "pet"} for c in CATEGORIES[:2]]
     + [{**CATEGORIES[2], "supercategory": "bird"}], []),
])
def test_a_category_that_only_groups_the_others_is_no_class(tmp_path, categories, left_out):
    from fastdet.eval.scoring import load_gt

    ann, img_dir = make_set(tmp_path, categories=categories)
    ds = load_coco(ann, img_dir, train=True)
    kept = [c for c in categories if f"'{c['name']}' (id {c['id']})" not in left_out]
    assert ds.cat_ids == [c["id"] for c in kept] and ds.class_names == [c["name"] for c in kept]
    assert ds.report.categories_left_out == left_out
    assert ("left out 1 category without boxes" in ds.report.summary()) == bool(left_out)
    rec = {r.image_id: r for r in ds.records}  # the classes keep their labels in file order
    assert [ds.class_names[k] for k in rec[10].labels] == ["cat", "emu"]
    gt = load_gt(ann, "pycocotools")  # the scorer's categories are the loader's classes
    assert gt.cat_ids == ds.cat_ids and gt.class_names == ds.class_names


def test_a_single_class_roboflow_project_named_after_its_class_is_one_class(tmp_path):
    cats = [{"id": 0, "name": "cat", "supercategory": "none"}, {"id": 7, "name": "cat", "supercategory": "cat"}]
    anns = [a for a in good_annotations() if a["category_id"] == 7]
    ann, img_dir = make_set(tmp_path, categories=cats, annotations=anns)
    ds = load_coco(ann, img_dir, train=False)
    assert ds.cat_ids == [7] and ds.class_names == ["cat"] and ds.report.categories_left_out == ["'cat' (id 0)"]


# ----------------------------------------------------------------------------- errors

def test_missing_annotation_file(tmp_path):
    e = raises_one_line("annotation file not found", tmp_path / "nope.json", tmp_path, train=True)
    assert str(tmp_path / "nope.json") in str(e)


def test_invalid_json_names_line_and_column(tmp_path):
    ann = tmp_path / "bad.json"
    ann.write_text('{\n  "images": [],\n  "annotations": [,]\n}\n')
    e = raises_one_line(r"invalid JSON at line 3 column 19", ann, tmp_path, train=True)
    assert str(ann) in str(e)


@pytest.mark.parametrize("key", ["images", "annotations", "categories"])
def test_missing_top_level_key(tmp_path, key):
    ann, img_dir = make_set(tmp_path)
    doc = json.loads(ann.read_text())
    del doc[key]
    ann.write_text(json.dumps(doc))
    raises_one_line(rf"{ann}: missing top-level key '{key}'", ann, img_dir, train=True)


def test_unknown_image_id_names_the_annotation(tmp_path):
    anns = good_annotations()
    anns[2]["image_id"] = 999
    ann, img_dir = make_set(tmp_path, annotations=anns)
    raises_one_line(rf"{ann}: annotation id 3: image_id 999 is not in 'images'", ann, img_dir, train=False)


def test_unknown_category_id_names_the_annotation(tmp_path):
    anns = good_annotations()
    anns[1]["category_id"] = 3
    ann, img_dir = make_set(tmp_path, annotations=anns)
    raises_one_line(rf"{ann}: annotation id 2: category_id 3 is not in 'categories'", ann, img_dir, train=True)


@pytest.mark.parametrize("bbox", [[1, 2, 3], [1, 2, 3, "4"], [1, 2, 3, float("nan")], {"x": 1}, None, [1, 2, True, 4]])
def test_bbox_must_be_four_numbers(tmp_path, bbox):
    anns = good_annotations()
    anns[0]["bbox"] = bbox
    ann, img_dir = make_set(tmp_path, annotations=anns)
    raises_one_line(r"annotation id 1: field 'bbox' must be 4 finite numbers", ann, img_dir, train=True)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("iscrowd", 2, r"annotation id 3: field 'iscrowd' must be 0 or 1, got 2"),
        ("iscrowd", "1", r"annotation id 3: field 'iscrowd' must be 0 or 1, got '1'"),
        ("image_id", "20", r"annotation id 3: field 'image_id' must be an integer, got '20'"),
        ("category_id", 2.0, r"annotation id 3: field 'category_id' must be an integer, got 2.0"),
        ("id", None, r"annotations\[2\]: field 'bbox' must be 4 finite numbers"),
    ],
)
def test_mistyped_annotation_fields(tmp_path, field, value, message):
    anns = good_annotations()
    anns[2][field] = value
    if field == "id":
        anns[2]["bbox"] = [0, 0, 1]  # without an id the error names the position
    ann, img_dir = make_set(tmp_path, annotations=anns, write_images=False)
    raises_one_line(message, ann, img_dir, train=True)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("width", "64", r"images\[0\] \(id 10\): field 'width' must be a positive integer, got '64'"),
        ("height", 0, r"images\[0\] \(id 10\): field 'height' must be a positive integer, got 0"),
        ("file_name", None, r"images\[0\] \(id 10\): field 'file_name' must be a non-empty string"),
        ("id", "10", r"images\[0\]: field 'id' must be an integer, got '10'"),
    ],
)
def test_mistyped_image_fields(tmp_path, field, value, message):
    images = [dict(im) for im in IMAGES]
    images[0][field] = value
    ann, img_dir = make_set(tmp_path, images=images, write_images=False)
    raises_one_line(message, ann, img_dir, train=True)


def test_duplicate_ids_and_empty_categories(tmp_path):
    images = [dict(im) for im in IMAGES]
    images[1]["id"] = 10
    ann, img_dir = make_set(tmp_path / "a", images=images, write_images=False)
    raises_one_line(r"images\[1\] \(id 10\): duplicate image id", ann, img_dir, train=True)
    ann, img_dir = make_set(tmp_path / "b", categories=[{"id": 1, "name": "x"}, {"id": 1, "name": "y"}],
                            annotations=[], write_images=False)
    raises_one_line(r"categories\[1\]: duplicate category id 1", ann, img_dir, train=True)
    ann, img_dir = make_set(tmp_path / "c", categories=[], annotations=[], write_images=False)
    raises_one_line(r"'categories' is empty", ann, img_dir, train=True)
    # Two classes of one name would take one class's rows when fine-tuning and one category
    # id when evaluating (classes are matched by name).
    ann, img_dir = make_set(tmp_path / "d", categories=[{"id": 1, "name": "cat"}, {"id": 3, "name": "dog"},
                                                        {"id": 4, "name": "cat"}], annotations=[], write_images=False)
    raises_one_line(r"categories 1 and 4 are both named 'cat': classes are matched by name", ann, img_dir, train=True)


def test_missing_image_directory(tmp_path):
    ann, _ = make_set(tmp_path)
    e = raises_one_line(r"image directory not found", ann, tmp_path / "elsewhere", train=True)
    assert str(tmp_path / "elsewhere") in str(e) and str(ann) in str(e)


def test_bad_check_mode(tmp_path):
    ann, img_dir = make_set(tmp_path)
    raises_one_line(r"check_images must be one of none, open, decode, got 'full'", ann, img_dir,
                    train=True, check_images="full")


def test_no_usable_image_is_an_error(tmp_path):
    ann, img_dir = make_set(tmp_path, write_images=False)
    raises_one_line(r"no usable images in .*skipped 3 images: 3 missing file", ann, img_dir, train=True)


# ----------------------------------------------------------------------------- counted skips

def test_box_skips_are_counted_and_boxes_clipped(tmp_path):
    anns = good_annotations() + [
        {"id": 5, "image_id": 10, "category_id": 7, "bbox": [10, 10, 0.5, 20], "iscrowd": 0, "area": 1},  # degenerate
        {"id": 6, "image_id": 10, "category_id": 7, "bbox": [63.5, 10, 10, 10], "iscrowd": 0, "area": 1},  # 0.5 px left
        {"id": 7, "image_id": 20, "category_id": 2, "bbox": [100, 10, 5, 5], "iscrowd": 0, "area": 1},  # outside
        {"id": 8, "image_id": 20, "category_id": 2, "bbox": [-20, -5, 10, 4], "iscrowd": 0, "area": 1},  # outside
        {"id": 9, "image_id": 20, "category_id": 2, "bbox": [5, 5, 30, 30], "iscrowd": 1, "area": 1},  # crowd
        {"id": 10, "image_id": 30, "category_id": 40, "bbox": [-10, 40, 30, 30], "iscrowd": 0, "area": 1},  # clipped
    ]
    ann, img_dir = make_set(tmp_path, annotations=anns)
    ds = load_coco(ann, img_dir, train=True)
    rep = ds.report
    assert rep.box_skips == {"crowd": 1, "degenerate": 2, "outside image": 2}
    assert rep.examples["outside image"] == ["annotation id 7", "annotation id 8"]
    assert rep.box_changes == {"clipped to the image": 1}
    assert rep.summary() == ("dropped 5 boxes: 1 crowd, 2 degenerate, 2 outside image; "
                             "changed 1 box: 1 clipped to the image (annotation id 10)")
    assert (rep.boxes_in_file, rep.boxes_kept, rep.images_kept) == (10, 5, 3)
    rec = {r.image_id: r for r in ds.records}
    np.testing.assert_array_equal(rec[30].boxes, np.array([[10, 10, 15, 15], [0, 40, 20, 50]], np.float32))
    assert rec[30].labels.tolist() == [0, 2]
    for r in ds.records:
        w, h = r.boxes[:, 2] - r.boxes[:, 0], r.boxes[:, 3] - r.boxes[:, 1]
        assert (w >= 1).all() and (h >= 1).all()
        assert (r.boxes >= 0).all() and (r.boxes[:, [0, 2]] <= r.width).all() and (r.boxes[:, [1, 3]] <= r.height).all()
    # Evaluation records never hold crowd boxes either; the summary says where they are scored.
    ev = load_coco(ann, img_dir, train=False)
    assert sum(len(r.boxes) for r in ev.records) == 5
    assert "1 crowd (scored from the annotation file)" in ev.report.summary()


def test_missing_and_corrupt_images_are_skipped(tmp_path):
    images = IMAGES + [
        {"id": 40, "file_name": "gone.jpg", "width": 32, "height": 32},
        {"id": 50, "file_name": "garbage.jpg", "width": 32, "height": 32},
        {"id": 60, "file_name": "truncated.jpg", "width": 64, "height": 64},
        {"id": 70, "file_name": "wrong_size.jpg", "width": 64, "height": 64},
    ]
    anns = good_annotations() + [
        {"id": 11 + i, "image_id": iid, "category_id": 2, "bbox": [1, 1, 8, 8], "iscrowd": 0, "area": 1}
        for i, iid in enumerate((40, 50, 60, 70))
    ]
    ann, img_dir = make_set(tmp_path, images=images, annotations=anns, write_images=False)
    for im in IMAGES:
        write_jpeg(img_dir / im["file_name"], im["width"], im["height"])
    (img_dir / "garbage.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg" * 10)
    write_jpeg(img_dir / "truncated.jpg", 64, 64)
    data = (img_dir / "truncated.jpg").read_bytes()
    (img_dir / "truncated.jpg").write_bytes(data[: len(data) // 2])
    write_jpeg(img_dir / "wrong_size.jpg", 48, 64)

    opened = load_coco(ann, img_dir, train=True, check_images="open")
    gone, garbage, wrong = (str(img_dir.absolute() / n) for n in ("gone.jpg", "garbage.jpg", "wrong_size.jpg"))
    assert opened.report.image_skips == {"missing file": 1, "corrupt": 1, "size mismatch": 1}
    assert opened.report.summary() == (
        f"skipped 3 images: 1 missing file ({gone}), 1 corrupt ({garbage}), 1 size mismatch ({wrong})"
    )
    # The header of the truncated file reads fine; only a full decode finds it.
    assert 60 in opened.image_ids
    decoded = load_coco(ann, img_dir, train=True, check_images="decode")
    assert decoded.report.image_skips["corrupt"] == 2 and 60 not in decoded.image_ids
    assert sorted(decoded.image_ids) == [10, 20, 30]
    # "none" trusts the JSON entirely.
    trusted = load_coco(ann, img_dir, train=True, check_images="none")
    assert sorted(trusted.image_ids) == [10, 20, 30, 40, 50, 60, 70] and trusted.report.skipped_images == 0


@pytest.mark.parametrize("rename, expected", [
    (lambda n: f"images/{n}", "the file names start with 'images/', the images folder's own name: give its parent"),
    (lambda n: "C:\\Users\\ann\\set\\" + n.replace("/", "\\"), "the file names are paths on the machine"),
    (lambda n: f"/home/ann/set/{n}", "the file names are paths on the machine"),
    (lambda n: f"day1/{n}", "the file names hold folders (day1/a.jpg) that"),
])
def test_no_image_found_says_why_when_the_names_show_it(tmp_path, rename, expected):
    images = [{**im, "file_name": rename(im["file_name"].split("/")[-1])} for im in IMAGES]
    ann, img_dir = make_set(tmp_path, write_images=False)
    for im in IMAGES:  # the pictures themselves, flat in the images folder
        write_jpeg(img_dir / im["file_name"].split("/")[-1], im["width"], im["height"])
    doc = json.loads(ann.read_text())
    doc["images"] = images
    ann.write_text(json.dumps(doc))
    err = raises_one_line("no usable images", ann, img_dir, train=True)
    assert expected in str(err), err
    (img_dir / "a.jpg").unlink()  # the first image not there either way: no guess
    assert "file names" not in str(raises_one_line("no usable images", ann, img_dir, train=True))


def test_summary_names_a_few_paths_then_counts(tmp_path):
    images = IMAGES + [{"id": 100 + i, "file_name": f"m{i}.jpg", "width": 8, "height": 8} for i in range(5)]
    ann, img_dir = make_set(tmp_path, images=images, write_images=False)
    for im in IMAGES:
        write_jpeg(img_dir / im["file_name"], im["width"], im["height"])
    ds = load_coco(ann, img_dir, train=False)
    shown = ", ".join(str(img_dir.absolute() / f"m{i}.jpg") for i in range(3))
    assert ds.report.summary() == f"skipped 5 images: 5 missing file ({shown}, +2 more)"


def test_empty_images_for_training_are_configurable(tmp_path):
    anns = [a for a in good_annotations() if a["image_id"] != 20]
    anns.append({"id": 50, "image_id": 30, "category_id": 2, "bbox": [0, 0, 50, 50], "iscrowd": 1, "area": 2500})
    ann, img_dir = make_set(tmp_path, annotations=anns)
    ds = load_coco(ann, img_dir, train=True)
    assert sorted(ds.image_ids) == [10, 30]
    assert ds.report.summary() == "dropped 1 box: 1 crowd; skipped 1 image: 1 without boxes"
    kept = load_coco(ann, img_dir, train=True, keep_empty=True)
    assert sorted(kept.image_ids) == [10, 20, 30] and kept.report.skipped_images == 0
    ev = load_coco(ann, img_dir, train=False)
    assert sorted(ev.image_ids) == [10, 20, 30]


def test_image_checks_are_cached_by_size_and_mtime(tmp_path, monkeypatch):
    ann, img_dir = make_set(tmp_path / "set")
    cache = tmp_path / "cache"
    first = load_coco(ann, img_dir, train=True, check_images="decode", cache_dir=cache)
    files = list((cache / "image_checks").glob("*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["entries"]
    assert sorted(entries) == ["a.jpg", "b.jpg", "sub/c.jpg"]

    calls = []
    real_probe = coco_mod._probe
    monkeypatch.setattr(coco_mod, "_probe", lambda p, level: calls.append(p.name) or real_probe(p, level))
    again = load_coco(ann, img_dir, train=True, check_images="open", cache_dir=cache)
    assert calls == [] and again.image_ids == first.image_ids  # a decode result serves an open check

    # A changed file is checked again: b.jpg now does not decode.
    data = (img_dir / "b.jpg").read_bytes()
    (img_dir / "b.jpg").write_bytes(data[: len(data) // 3])
    after = load_coco(ann, img_dir, train=True, check_images="decode", cache_dir=cache)
    assert calls == ["b.jpg"]
    assert after.report.image_skips == {"corrupt": 1} and 20 not in after.image_ids


# ----------------------------------------------------------------------------- resolve_data

def test_resolve_coco_root_and_explicit_overrides(demo_small: Path, tmp_path):
    paths = resolve_data(DataConfig(data=str(demo_small)))
    assert paths == coco_layout(demo_small)
    other = tmp_path / "other.json"
    other.write_text("{}")
    paths = resolve_data(DataConfig(data=str(demo_small), val_ann=str(other)))
    assert paths.val_ann == other and paths.train_ann == demo.ann_path(demo_small, "train")


def test_resolve_explicit_paths_need_no_root(demo_paths: DataPaths, tmp_path):
    cfg = DataConfig(
        data="demo",
        cache_dir=str(tmp_path / "cache"),
        train_ann=str(demo_paths.train_ann),
        train_images=str(demo_paths.train_images),
        val_ann=str(demo_paths.val_ann),
        val_images=str(demo_paths.val_images),
    )
    assert resolve_data(cfg) == demo_paths
    assert not (tmp_path / "cache").exists()  # nothing was generated


def test_resolve_demo_generates_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setitem(demo.DEFAULT_PARAMS, "num_train", 3)
    monkeypatch.setitem(demo.DEFAULT_PARAMS, "num_val", 2)
    paths = resolve_data(DataConfig(data="demo", cache_dir=str(tmp_path / "c")))
    root = tmp_path / "c" / f"demo-v{demo.GENERATOR_VERSION}"
    assert paths == coco_layout(root)
    assert len(json.loads(paths.val_ann.read_text())["images"]) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(data="/nonexistent/coco"), r"--data /nonexistent/coco: no such directory"),
        (dict(val_ann="/nonexistent/v.json"), r"--val-ann: annotation file /nonexistent/v.json not found"),
        (dict(train_images="/nonexistent/imgs"), r"--train-images: image directory /nonexistent/imgs not found"),
    ],
)
def test_resolve_errors(demo_small: Path, kwargs, message):
    cfg = DataConfig(**{"data": str(demo_small), **kwargs})
    with pytest.raises(DataError, match=message):
        resolve_data(cfg)


def test_data_naming_a_file_says_where_a_coco_file_goes(demo_small: Path):
    ann = demo_small / "annotations" / "instances_val2017.json"
    with pytest.raises(DataError, match=r"a file, not a folder: a COCO file goes with --train-ann/--val-ann"):
        resolve_data(DataConfig(data=str(ann)))


def test_resolve_root_without_val_split(demo_small: Path, tmp_path):
    root = tmp_path / "coco"
    (root / "annotations").mkdir(parents=True)
    (root / "annotations" / "instances_train2017.json").write_text("{}")
    (root / "train2017").mkdir()
    with pytest.raises(DataError, match=r"annotations/instances_val2017.json not found"):
        resolve_data(DataConfig(data=str(root)))


def test_an_unwritable_cache_only_warns(tmp_path, caplog):
    ann, img_dir = make_set(tmp_path / "set")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="fastdet.data.coco"):
        ds = load_coco(ann, img_dir, train=True, check_images="decode", cache_dir=blocker)
    assert sorted(ds.image_ids) == [10, 20, 30]
    assert "could not write the image-check cache" in caplog.text


def test_missing_iscrowd_area_and_id_are_filled_as_coco_defines_them(tmp_path):
    from fastdet.data.coco import fill_coco_defaults
    from fastdet.eval.scoring import load_gt

    anns = [{k: v for k, v in a.items() if k not in ("iscrowd", "area")} for a in good_annotations()]
    del anns[1]["id"]
    ann, img_dir = make_set(tmp_path, annotations=anns)
    ds = load_coco(ann, img_dir, train=False)
    n = len(anns)
    assert ds.report.filled == {"iscrowd": n, "area": n, "id": 1}
    assert ds.report.summary().startswith(f"filled in {n} missing 'area', 1 missing 'id', {n} missing 'iscrowd'")
    gt = load_gt(str(ann), "pycocotools").coco  # the evaluator's; pycocotools indexes it (KeyError: 'iscrowd' before)
    a = gt.loadAnns(gt.getAnnIds())
    assert all(x["iscrowd"] == 0 for x in a)
    assert sorted(x["area"] for x in a) == sorted(x["bbox"][2] * x["bbox"][3] for x in anns)
    assert len({x["id"] for x in a}) == n
    doc = {"annotations": [{"bbox": [0, 0, 2, 3], "iscrowd": 1, "area": 5, "id": 9}]}
    assert fill_coco_defaults(doc) == {} and doc["annotations"][0]["area"] == 5  # given values stay
