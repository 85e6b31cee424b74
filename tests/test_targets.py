"""Padding to the fixed [B, M] ground-truth layout; truncation keeps the largest boxes."""

from __future__ import annotations

import numpy as np
import pytest

from fastdet.data.coco import load_coco
from fastdet.data.targets import keep_largest, pad_one, pad_targets


def random_boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    xy = rng.uniform(0, 200, size=(n, 2))
    wh = rng.integers(1, 40, size=(n, 2)).astype(np.float64)  # integer sides: many equal areas (ties)
    return np.concatenate([xy, xy + wh], axis=1).astype(np.float32)


def reference_keep(boxes: np.ndarray, m: int) -> list[int]:
    """The M largest by area, ties to the earlier box, in original order (plain Python)."""
    areas = [float((b[2] - b[0]) * (b[3] - b[1])) for b in boxes]
    ranked = sorted(range(len(boxes)), key=lambda i: (-areas[i], i))
    return sorted(ranked[:m])


def test_padding_fewer_boxes_than_m():
    boxes = np.array([[1, 2, 3, 4], [5, 6, 9, 10]], np.float32)
    labels = np.array([3, 1])
    b, l, m, overflow = pad_one(boxes, labels, 5)
    assert b.shape == (5, 4) and b.dtype == np.float32
    assert l.shape == (5,) and l.dtype == np.int64
    assert m.dtype == bool and m.tolist() == [True, True, False, False, False]
    np.testing.assert_array_equal(b[:2], boxes)
    assert (b[2:] == 0).all() and l.tolist() == [3, 1, 0, 0, 0] and overflow == 0


def test_image_without_boxes():
    for empty in (np.zeros((0, 4), np.float32), np.zeros(0, np.float32), []):
        b, l, m, overflow = pad_one(empty, np.zeros(0, np.int64), 3)
        assert (b == 0).all() and (l == 0).all() and not m.any() and overflow == 0


def test_truncation_keeps_the_largest_in_original_order():
    boxes = np.array([
        [0, 0, 2, 2],    # area 4
        [0, 0, 10, 10],  # 100
        [0, 0, 1, 1],    # 1
        [0, 0, 5, 6],    # 30
        [0, 0, 3, 3],    # 9
    ], np.float32)
    labels = np.array([0, 1, 2, 3, 4])
    b, l, m, overflow = pad_one(boxes, labels, 3)
    assert l.tolist() == [1, 3, 4] and m.all() and overflow == 2
    np.testing.assert_array_equal(b, boxes[[1, 3, 4]])


@pytest.mark.parametrize("m", [1, 4, 16])
def test_batch_matches_reference_and_counts_overflow(m):
    rng = np.random.default_rng(m)
    counts = [0, 3, m, m + 1, 3 * m + 5, 17]
    boxes_list = [random_boxes(rng, n) for n in counts]
    labels_list = [rng.integers(0, 80, n) for n in counts]
    gt_boxes, gt_labels, gt_mask, overflow = pad_targets(boxes_list, labels_list, m)
    assert gt_boxes.shape == (len(counts), m, 4) and gt_labels.shape == gt_mask.shape == (len(counts), m)
    assert overflow == sum(max(n - m, 0) for n in counts)
    for i, (bx, lb) in enumerate(zip(boxes_list, labels_list)):
        keep = reference_keep(bx, m)
        k = len(keep)
        assert gt_mask[i].tolist() == [True] * k + [False] * (m - k)
        np.testing.assert_array_equal(gt_boxes[i, :k], bx[keep])
        np.testing.assert_array_equal(gt_labels[i, :k], lb[keep])
        assert (gt_boxes[i, k:] == 0).all() and (gt_labels[i, k:] == 0).all()
        assert keep_largest(bx, m).tolist() == keep


def test_bad_inputs():
    with pytest.raises(ValueError, match="max_boxes must be >= 1"):
        pad_one(np.zeros((1, 4)), np.zeros(1), 0)
    with pytest.raises(ValueError, match=r"boxes must be \[N, 4\]"):
        pad_one(np.zeros((2, 5)), np.zeros(2), 4)
    with pytest.raises(ValueError, match="labels must be"):
        pad_one(np.zeros((2, 4)), np.zeros(3), 4)
    with pytest.raises(ValueError, match="2 box arrays but 1 label arrays"):
        pad_targets([np.zeros((1, 4))] * 2, [np.zeros(1)], 4)


def test_demo_records_pad(demo_paths):
    ds = load_coco(demo_paths.train_ann, demo_paths.train_images, train=True)
    m = 3
    gt_boxes, gt_labels, gt_mask, overflow = pad_targets([r.boxes for r in ds.records], [r.labels for r in ds.records], m)
    counts = np.array([len(r.boxes) for r in ds.records])
    assert overflow == int(np.maximum(counts - m, 0).sum()) > 0
    assert gt_mask.sum(axis=1).tolist() == np.minimum(counts, m).tolist()
    assert gt_labels[gt_mask].max() < ds.num_classes
