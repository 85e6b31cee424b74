"""Evaluation detail: the confusion matrix, the F1 curve's reading of COCOeval's tables,
the plots as files, and the validation pictures (ground truth beside predictions, and the
note when nothing scores)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from fastdet.data.coco import load_coco
from fastdet.data.preprocess import Preprocess
from fastdet.engine import previews
from fastdet.eval import plots
from fastdet.eval.scoring import confusion_matrix, load_gt, score


def _doc(anns, n_images=3, cats=("a", "b")):
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 200, "height": 200} for i in range(1, n_images + 1)]
    out = []
    for k, (img, cat, box, crowd) in enumerate(anns):
        out.append({"id": k + 1, "image_id": img, "category_id": cat, "bbox": box, "area": box[2] * box[3],
                    "iscrowd": crowd})
    return {"images": images, "annotations": out,
            "categories": [{"id": i + 1, "name": n} for i, n in enumerate(cats)]}


def test_confusion_matrix_counts():
    doc = _doc([(1, 1, [10, 10, 50, 50], 0),  # a, found as a
                (1, 2, [100, 100, 50, 50], 0),  # b, found as a
                (2, 2, [10, 10, 40, 40], 0),  # b, missed
                (3, 1, [0, 0, 150, 150], 1)])  # a crowd region
    res = [{"image_id": 1, "category_id": 1, "bbox": [12, 10, 50, 50], "score": 0.9},
           {"image_id": 1, "category_id": 1, "bbox": [100, 102, 50, 50], "score": 0.8},
           {"image_id": 1, "category_id": 2, "bbox": [14, 14, 50, 50], "score": 0.7},  # a looser duplicate on a: false b
           {"image_id": 2, "category_id": 2, "bbox": [150, 150, 40, 40], "score": 0.6},  # false b
           {"image_id": 2, "category_id": 2, "bbox": [10, 10, 40, 40], "score": 0.1},  # below 0.25: not counted
           {"image_id": 3, "category_id": 2, "bbox": [20, 20, 30, 30], "score": 0.9}]  # inside the crowd: ignored
    for backend in ("pycocotools", "faster"):
        m = confusion_matrix(load_gt(doc, backend), res, [1, 2, 3])
        #             true a  true b  background
        expect = [[1, 1, 0],  # predicted a
                  [0, 0, 2],  # predicted b
                  [0, 1, 0]]  # background (missed)
        np.testing.assert_array_equal(m, expect)


def test_f1_curve_reads_the_coco_tables():
    # One class, 10 boxes on 10 images; 5 found with score 0.9, then 5 false detections at 0.5.
    anns = [(i, 1, [20, 20, 60, 60], 0) for i in range(1, 11)]
    doc = _doc(anns, n_images=10, cats=("a",))
    res = [{"image_id": i, "category_id": 1, "bbox": [20, 20, 60, 60], "score": 0.9} for i in range(1, 6)]
    res += [{"image_id": i, "category_id": 1, "bbox": [120, 120, 60, 60], "score": 0.5} for i in range(1, 6)]
    s = score(doc, res, list(range(1, 11)), backend="pycocotools")
    f1 = plots.f1_by_threshold(s, 0, np.array([0.0, 0.7, 0.95]))
    # Precision 1 up to recall 0.5 (COCO's precision at a recall is the best at or beyond it),
    # so F1 = 2 * 1 * 0.5 / 1.5 where the 0.9 detections count, and 0 above their score.
    np.testing.assert_allclose(f1, [2 / 3, 2 / 3, 0.0], atol=1e-9)
    assert s.per_class["a"]["AP50"] == pytest.approx(0.5, abs=0.01)


def test_evaluation_and_results_pictures(tmp_path):
    doc = _doc([(1, 1, [10, 10, 50, 50], 0), (2, 2, [60, 60, 80, 80], 0), (3, 1, [100, 20, 40, 90], 0)])
    res = [{"image_id": a["image_id"], "category_id": a["category_id"],
            "bbox": [v + 2 for v in a["bbox"]], "score": 0.8} for a in doc["annotations"]]
    s = score(doc, res, [1, 2, 3])
    paths = plots.draw_evaluation(s, tmp_path, step=7)
    assert set(paths) == {"PR_curve", "F1_curve", "confusion_matrix"}
    for p in paths.values():
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size[0] > 500 and im.size[1] > 400
    assert plots.read_png(paths["PR_curve"]).shape[0] == 3
    # Nothing detected: the three files are still drawn (empty curves, all boxes missed).
    empty = score(doc, [], [1, 2, 3])
    assert empty.confusion[-1].sum() == 3
    assert set(plots.draw_evaluation(empty, tmp_path / ".", step=8)) == set(paths)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 31):
            f.write(json.dumps({"epoch": step // 10, "step": step, "lr": 0.01 * step / 30, "images_per_s": 5.0,
                                "total_loss": 3 - step / 20, "loss_cls": 1 - step / 60}) + "\n")
    with open(tmp_path / "eval.jsonl", "w") as f:
        for step in (10, 20, 30):
            f.write(json.dumps({"epoch": step // 10, "step": step, "AP": step / 100, "AP50": step / 50,
                                "AP75": step / 200}) + "\n")
    out = plots.plot_results(tmp_path)
    with Image.open(out) as im:
        assert out.name == "results.png" and im.size[0] >= 800
    assert plots.plot_results(tmp_path / "nothing") is None


class FixedDetections(nn.Module):
    """A stand-in model: ``predict`` returns the given detections (input pixels) for every image."""

    def __init__(self, boxes, scores, labels):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))
        self.det = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                    "scores": torch.tensor(scores, dtype=torch.float32), "labels": torch.tensor(labels)}

    def predict(self, images, **kw):
        keep = self.det["scores"] >= kw.get("score_thresh", 0)
        return [{k: v[keep] for k, v in self.det.items()} for _ in range(len(images))]


class FakeTB:
    def __init__(self):
        self.images = {}

    def image(self, tag, img, step):
        self.images[tag] = (img, step)


def _tiles(picture, n):
    """The tiles of the preview grid (4 a row, 2 px padding), each [3, H, W]."""
    th = (picture.shape[1] - 2) // -(-n // 4) - 2
    tw = (picture.shape[2] - 2) // 4 - 2
    return [picture[:, 2 + r * (th + 2): 2 + r * (th + 2) + th, 2 + c * (tw + 2): 2 + c * (tw + 2) + tw]
            for r in range(-(-n // 4)) for c in range(4)][:n]


@pytest.mark.parametrize("detections", ["none", "some"])
def test_val_pictures_show_ground_truth_beside_predictions(demo_paths, tmp_path, detections):
    val = load_coco(demo_paths.val_ann, demo_paths.val_images, train=False)
    pre = Preprocess(resize="stretch")
    model = (FixedDetections([], [], []) if detections == "none"
             else FixedDetections([[8, 8, 40, 40]], [0.9], [2]))
    tb = FakeTB()
    path = previews.log_val_predictions(model, val.records, pre, 64, {"score_thresh": 0.0}, val.class_names, tb,
                                        tmp_path, step=3)
    picture, step = tb.images[previews.TAG]
    assert step == 3 and path.is_file()
    tiles = _tiles(picture, 2 * len(val.records))
    red = torch.tensor([255, 80, 80], dtype=torch.uint8)[:, None, None]
    for rec, gt_tile, pred_tile in zip(val.records, tiles[0::2], tiles[1::2]):
        body_gt, body_pred = gt_tile[:, 18:], pred_tile[:, 18:]  # below the title bar
        # The note's outline (red) appears on a prediction tile exactly when nothing scored.
        noted = (pred_tile == red).all(0).sum() > 20
        assert bool(noted) == (detections == "none")
        assert not (gt_tile == red).all(0).any()
        # The ground-truth side differs from the prediction side where there are boxes.
        if detections == "none" and len(rec.boxes):
            assert (body_gt != body_pred).any()
        if detections == "none" and not len(rec.boxes):  # an empty image: equal but for the note
            same = (body_gt == body_pred).all(0).float().mean()
            assert same > 0.8


def test_val_pictures_feed_each_image_as_evaluation_does(demo_paths, tmp_path):
    """Keep-ratio (FCOS): each preview image goes to the model on the canvas of its
    orientation, as evaluation and fastdet.detect feed it, not on a square S x S one."""
    from fastdet.data.augment import decode_image

    val = load_coco(demo_paths.val_ann, demo_paths.val_images, train=False)
    pre = Preprocess(resize="keep_ratio", short=800, max_long=1333, interp="linear")
    fed = []

    class Recording(FixedDetections):
        def predict(self, images, **kw):
            fed.extend(images)
            return super().predict(images, **kw)

    previews.log_val_predictions(Recording([], [], []), val.records, pre, 64, {"score_thresh": 0.0},
                                 val.class_names, FakeTB(), tmp_path, step=1)
    recs = previews.preview_records(val.records)
    assert len(fed) == len(recs)
    want = [pre(decode_image(r.file), pre.canvas(r.height, r.width, 64))[0] for r in recs]
    assert {tuple(x.shape[-2:]) for x in want} == {(64, 128), (128, 64), (64, 64)}  # the demo set has all three
    for x in want:
        assert sum(f.shape == x.shape and torch.equal(f, x) for f in fed) >= 1
