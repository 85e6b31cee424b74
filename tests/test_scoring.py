"""The scoring interface: faster-coco-eval and pycocotools give the same numbers.

Checked on the demo val set and on a hostile set: crowd regions (matched and not),
images without ground truth, images without detections, more detections per image than
every ``maxDets`` (1, 10, 100), tied scores, a category without ground truth, boxes
straddling the small/medium/large area limits.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from fastdet.eval import scoring
from fastdet.eval.scoring import STAT_NAMES, load_gt, resolve_backend, score

pytest.importorskip("faster_coco_eval")


def demo_results(doc: dict, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    cats = [c["id"] for c in doc["categories"]]
    out = []
    for a in doc["annotations"]:
        x, y, w, h = a["bbox"]
        for _ in range(3):
            out.append({"image_id": a["image_id"], "category_id": a["category_id"] if rng.random() < 0.8
                        else int(rng.choice(cats)),
                        "bbox": [x + rng.normal() * 4, y + rng.normal() * 4, w * rng.uniform(0.7, 1.3),
                                 h * rng.uniform(0.7, 1.3)], "score": float(rng.random())})
    return out


def hostile_set(seed: int = 1) -> tuple[dict, list[dict], list[int]]:
    """A ground truth and results made to hit COCOeval's corner cases."""
    rng = np.random.default_rng(seed)
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 640, "height": 480} for i in range(1, 13)]
    cats = [{"id": 1, "name": "a"}, {"id": 5, "name": "b"}, {"id": 9, "name": "no_gt"}]
    anns, res = [], []

    def gt(img, cat, box, crowd=0):
        anns.append({"id": len(anns) + 1, "image_id": img, "category_id": cat, "bbox": box,
                     "area": box[2] * box[3], "iscrowd": crowd})

    def det(img, cat, box, s):
        res.append({"image_id": img, "category_id": cat, "bbox": box, "score": s})

    for img in range(1, 9):  # ordinary images, sizes across the 32^2 / 96^2 limits
        for side in (20, 31.9, 32.1, 50, 95.9, 96.1, 200):
            x, y = rng.uniform(0, 400), rng.uniform(0, 250)
            cat = int(rng.choice([1, 5]))
            gt(img, cat, [x, y, side, side])
            det(img, cat, [x + rng.normal() * 3, y + rng.normal() * 3, side * 1.05, side], float(rng.random()))
    gt(2, 1, [0, 0, 300, 300], crowd=1)  # a crowd region with detections inside it
    for _ in range(5):
        det(2, 1, [rng.uniform(0, 250), rng.uniform(0, 250), 40, 40], float(rng.random()))
    gt(3, 5, [100, 100, 50, 50], crowd=1)  # a crowd region nothing matches
    for _ in range(150):  # image 4: more detections than maxDets=100, with tied scores
        det(4, 1, [rng.uniform(0, 600), rng.uniform(0, 440), 30, 30], round(float(rng.random()), 1))
    for _ in range(12):  # image 9: no ground truth, only false positives (> maxDets 10)
        det(9, 5, [rng.uniform(0, 600), rng.uniform(0, 440), 60, 60], float(rng.random()))
    gt(10, 1, [10, 10, 80, 80])  # image 10: ground truth, no detection at all
    det(5, 9, [10, 10, 50, 50], 0.99)  # a category without ground truth
    # images 11, 12: neither ground truth nor detections
    return {"images": images, "annotations": anns, "categories": cats}, res, [im["id"] for im in images]


def _both(gt, results, ids):
    py = score(gt, results, ids, backend="pycocotools")
    fast = score(gt, results, ids, backend="faster")
    return py, fast


def _assert_same(py, fast):
    assert list(py.stats) == list(STAT_NAMES)
    for k in STAT_NAMES:
        assert fast.stats[k] == pytest.approx(py.stats[k], abs=1e-12), k
    np.testing.assert_allclose(fast.precision, py.precision, atol=1e-12)
    assert list(fast.per_class) == list(py.per_class)
    for name, v in py.per_class.items():
        assert fast.per_class[name] == pytest.approx(v, abs=1e-12), name


def test_both_back_ends_agree_on_the_demo(demo_paths):
    doc = json.loads(demo_paths.val_ann.read_text())
    ids = [im["id"] for im in doc["images"]]
    py, fast = _both(str(demo_paths.val_ann), demo_results(doc), ids)
    assert (py.backend, fast.backend) == ("pycocotools", "faster")
    assert 0.05 < py.stats["AP"] < 0.9  # an informative comparison, not 0 = 0
    _assert_same(py, fast)


def test_both_back_ends_agree_on_a_hostile_set():
    doc, results, ids = hostile_set()
    py, fast = _both(doc, results, ids)
    assert all(0 < py.stats[k] < 1 for k in ("AP", "AP50", "APs", "APm", "APl", "AR1", "AR10", "AR100"))
    assert py.stats["AR1"] < py.stats["AR10"] <= py.stats["AR100"]  # the maxDets limits bite
    _assert_same(py, fast)
    assert py.per_class["no_gt"] == {"AP": -1.0, "AP50": -1.0}
    # Restricting the images (skipped ones are not scored) agrees too.
    _assert_same(*_both(doc, results, ids[:6]))


def test_the_ground_truth_is_loaded_once_and_reused():
    doc, results, ids = hostile_set()
    for backend in ("pycocotools", "faster"):
        gt = load_gt(doc, backend)
        a = score(gt, results, ids)
        b = score(gt, results, ids)  # loadRes must not have altered the loaded ground truth
        assert a.stats == b.stats and a.backend == backend
    assert len(doc["annotations"]) == len(hostile_set()[0]["annotations"])  # the caller's dict untouched


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_annotation_ids_from_0_or_repeated_score_as_numbered_from_1(backend):
    """Both back ends read annotation id 0 as "unmatched" and index boxes by id; a file
    numbered from 0 (Roboflow's) or with repeated ids scores the same as one numbered 1..N."""
    doc, results, ids = hostile_set()
    right = score(doc, results, ids, backend=backend).stats
    for renumber in (lambda k: k, lambda k: k // 3):  # from 0; then three boxes an id
        other = json.loads(json.dumps(doc))
        for k, a in enumerate(other["annotations"]):
            a["id"] = renumber(k)
        assert score(other, results, ids, backend=backend).stats == right


def test_no_results_scores_zero_and_the_table_prints():
    doc, results, ids = hostile_set()
    s = score(doc, [], ids)
    assert s.stats == {k: 0.0 for k in STAT_NAMES}
    table = score(doc, results, ids).per_class_table()
    assert table.splitlines()[0].split() == ["class", "AP", "AP50"] and "no_gt" in table


def test_backend_choice(monkeypatch):
    assert resolve_backend("auto") == "faster"
    with monkeypatch.context() as m:  # faster-coco-eval not installed: pycocotools, or a clear ImportError
        m.setitem(sys.modules, "faster_coco_eval", None)
        assert resolve_backend("auto") == "pycocotools"
        with pytest.raises(ImportError):
            resolve_backend("faster")
    monkeypatch.setenv("FASTDET_COCO_EVAL", "pycocotools")
    assert resolve_backend() == "pycocotools"
    monkeypatch.setenv("FASTDET_COCO_EVAL", "fast")
    with pytest.raises(ValueError, match="FASTDET_COCO_EVAL must be one of"):
        resolve_backend()
    monkeypatch.setattr(scoring, "resolve_backend", lambda choice=None: "pycocotools")
    assert score(*hostile_set()).backend == "pycocotools"
