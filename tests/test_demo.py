"""The demo set: deterministic, idempotent, atomic, loadable by pycocotools, as specified."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from fastdet.data import demo
from fastdet.data.demo import make_demo


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generation_is_byte_identical(tmp_path):
    a = make_demo(tmp_path / "a", num_train=5, num_val=3, seed=4)
    b = make_demo(tmp_path / "b", num_train=5, num_val=3, seed=4)
    ta, tb = tree_bytes(a), tree_bytes(b)
    assert len(ta) == 5 + 3 + 2 + 1  # images, two annotation files, the manifest
    assert ta == tb
    c = make_demo(tmp_path / "c", num_train=5, num_val=3, seed=5)
    tc = tree_bytes(c)
    assert tc.keys() == ta.keys() and tc["train2017/000000000001.jpg"] != ta["train2017/000000000001.jpg"]


def test_pycocotools_loads_it_and_scores_perfect_detections_1(demo_paths):
    # Imported here: a machine without pycocotools (the bare GPU machine) still collects
    # and runs the other tests of this file.
    COCO = pytest.importorskip("pycocotools.coco").COCO
    COCOeval = pytest.importorskip("pycocotools.cocoeval").COCOeval
    doc = json.loads(demo_paths.val_ann.read_text())
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(demo_paths.val_ann))
        assert gt.getCatIds() == [1, 3, 7, 12]
        assert len(gt.getImgIds()) == len(doc["images"]) == 8
        assert len(gt.getAnnIds()) == len(doc["annotations"])
        # The ground truth given back as detections must score AP 1.0: boxes, areas and
        # iscrowd are all in the form COCOeval expects.
        dets = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
                for a in doc["annotations"]]
        ev = COCOeval(gt, gt.loadRes(dets), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    assert ev.stats[0] == pytest.approx(1.0) and ev.stats[1] == pytest.approx(1.0)


def test_content_follows_the_spec(demo_paths):
    for split, ann in (("train", demo_paths.train_ann), ("val", demo_paths.val_ann)):
        doc = json.loads(ann.read_text())
        per_image = {im["id"]: [] for im in doc["images"]}
        for a in doc["annotations"]:
            per_image[a["image_id"]].append(a)
            assert a["iscrowd"] == 0 and 0 < a["area"] <= a["bbox"][2] * a["bbox"][3]
        sizes = {(im["width"], im["height"]) for im in doc["images"]}
        assert sizes <= set(demo.IMAGE_SIZES)
        for i, im in enumerate(doc["images"]):
            n = len(per_image[im["id"]])
            if i % demo.EMPTY_EVERY == demo.EMPTY_AT:
                assert n == 0
            else:
                assert demo.MIN_OBJECTS <= n <= demo.MAX_OBJECTS
            for a in per_image[im["id"]]:
                x, y, w, h = a["bbox"]
                assert x >= 0 and y >= 0 and x + w <= im["width"] and y + h <= im["height"]
    doc = json.loads(demo_paths.train_ann.read_text())
    assert {a["category_id"] for a in doc["annotations"]} == {1, 3, 7, 12}
    sides = [max(a["bbox"][2], a["bbox"][3]) for a in doc["annotations"]]
    assert min(sides) <= 16  # small objects ...
    assert max(sides) >= 0.3 * 288  # ... up to large ones
    assert len({a["image_id"] for a in doc["annotations"]}) < len(doc["images"])  # empty images exist


def test_boxes_are_tight_to_the_drawn_pixels(monkeypatch):
    # Black background and white objects make the drawn pixels recoverable by a threshold
    # (the added noise has sigma <= 8, far from the 128 threshold).
    monkeypatch.setattr(demo, "_background", lambda rng, w, h: np.zeros((h, w, 3), np.float32))
    monkeypatch.setattr(demo, "_shade", lambda rng, mask, colour: np.full((int(mask.sum()), 3), 255.0, np.float32))
    monkeypatch.setattr(demo, "_pick_colour", lambda rng, bg, under: np.full(3, 255.0, np.float32))
    for seed in range(6):
        rng = np.random.default_rng(seed)
        pixels, objects = demo.render_image(rng, 352, 352, 8)
        drawn = pixels.mean(axis=2) > 128
        covered = np.zeros_like(drawn)
        assert objects
        for label, (x0, y0, x1, y1), area in objects:
            assert 0 <= label < len(demo.CATEGORIES)
            box = drawn[y0:y1, x0:x1]
            # Each edge row / column of the box holds drawn pixels: the box is tight.
            assert box[0].any() and box[-1].any() and box[:, 0].any() and box[:, -1].any()
            assert area <= box.sum()
            covered[y0:y1, x0:x1] = True
        assert not (drawn & ~covered).any()  # and no drawn pixel lies outside every box


def test_make_demo_is_idempotent_and_regenerates_on_new_params(tmp_path):
    root = make_demo(tmp_path / "d", num_train=3, num_val=2)
    ann = demo.ann_path(root, "train")
    stamp = ann.stat().st_mtime_ns
    assert make_demo(tmp_path / "d", num_train=3, num_val=2) == root
    assert ann.stat().st_mtime_ns == stamp  # not rewritten
    make_demo(tmp_path / "d", num_train=4, num_val=2)
    assert len(json.loads(ann.read_text())["images"]) == 4
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["num_train"] == 4 and manifest["generator_version"] == demo.GENERATOR_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == [".d.lock", "d"]  # no temporaries left


def test_a_failed_generation_leaves_nothing_behind(tmp_path, monkeypatch):
    real = demo._write_split

    def crash_on_val(root, split, n, seed):
        if split == "val":
            raise KeyboardInterrupt
        return real(root, split, n, seed)

    monkeypatch.setattr(demo, "_write_split", crash_on_val)
    with pytest.raises(KeyboardInterrupt):
        make_demo(tmp_path / "d", num_train=2, num_val=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".d.lock"]


def test_make_demo_never_overwrites_other_data(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a fastdet demo set"):
        make_demo(tmp_path / "mine", num_train=2, num_val=1)
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep me"


def test_this_file_collects_without_pycocotools():
    """The bare GPU machine has no pycocotools: importing this module must not need it
    (a module-level import made the whole file a collection error there)."""
    import os
    import subprocess
    import sys

    tests = Path(__file__).resolve().parent
    script = "import sys; sys.modules['pycocotools'] = None; import test_demo; print('ok')"
    r = subprocess.run([sys.executable, "-c", script], cwd=tests, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tests)})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
