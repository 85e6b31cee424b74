"""The plain-torch ATSS and task-aligned assigners (``fastdet.ops.assigners``, the
reference the kernels behind ``fastdet.ops`` are tested against): against loop-by-loop
references of PaddleDetection's algorithms, and properties on constructed cases.

The references below walk one image, one GT and one level at a time with Python lists,
so they share no code (and no vectorisation trick) with ``fastdet.ops.assigners``.
Random cases use float coordinates so distances and metrics have no ties; the tie cases
below use integer corners, as annotation tools write them, and the loop references' stable
sort decides: ties go to the lower anchor index, as in the kernels.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

import fastdet.ops as ops
from fastdet.ops.assigners import atss_assign, task_aligned_assign
from fastdet.ops.synthetic import assign_inputs

STRIDES = (32, 16, 8)  # PP-YOLOE level order: coarsest first


def make_anchors(img: int, strides=STRIDES, scale: float = 5.0):
    """-> anchor boxes [A, 4], points [A, 2], anchors per level (as PPYOLOEHead builds them)."""
    boxes, points, counts = [], [], []
    for s in strides:
        n = img // s
        c = (torch.arange(n, dtype=torch.float32) + 0.5) * s
        yy, xx = torch.meshgrid(c, c, indexing="ij")
        p = torch.stack([xx, yy], -1).reshape(-1, 2)
        points.append(p)
        boxes.append(torch.cat([p - scale * s / 2, p + scale * s / 2], -1))
        counts.append(n * n)
    return torch.cat(boxes), torch.cat(points), counts


# --------------------------------------------------------------------------- references


def _iou(a, b, eps=1e-9):
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    area_a = max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1])
    area_b = max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])
    return inter / (area_a + area_b - inter + eps)


def _inside(p, box, eps=1e-9):
    return min(p[0] - box[0], p[1] - box[1], box[2] - p[0], box[3] - p[1]) > eps


def _resolve(pos_sets, real, ious_of, num_anchors):
    """anchor -> GT: the only candidate GT, or (several) the real GT of highest IoU, first on ties."""
    out = {}
    for a in range(num_anchors):
        gts = [g for g in real if a in pos_sets[g]]
        if len(gts) == 1:
            out[a] = gts[0]
        elif len(gts) > 1:
            vals = [ious_of(g, a) for g in real]
            out[a] = real[vals.index(max(vals))]
    return out


def ref_atss(anchors, counts, gt_labels, gt_boxes, pad_mask, bg, topk, pred_boxes, C):
    B, M = gt_boxes.shape[:2]
    A = anchors.shape[0]
    anc = anchors.tolist()
    centers = [((a[0] + a[2]) / 2, (a[1] + a[3]) / 2) for a in anc]
    labels = torch.full((B, A), bg, dtype=torch.long)
    boxes = torch.zeros(B, A, 4)
    scores = torch.zeros(B, A, C)
    for b in range(B):
        gts = gt_boxes[b].tolist()
        real = [g for g in range(M) if pad_mask[b, g, 0] > 0]
        pos = {}
        for g in real:
            gc = ((gts[g][0] + gts[g][2]) / 2, (gts[g][1] + gts[g][3]) / 2)
            cands, start = [], 0
            for n in counts:
                d = [math.dist(gc, centers[start + i]) for i in range(n)]
                cands += [start + i for i in sorted(range(n), key=d.__getitem__)[: min(topk, n)]]
                start += n
            vals = [_iou(gts[g], anc[a]) for a in cands]
            thr = statistics.mean(vals) + statistics.stdev(vals)
            pos[g] = {a for a in cands if _iou(gts[g], anc[a]) > thr and _inside(centers[a], gts[g])}
        match = _resolve(pos, real, lambda g, a: _iou(gts[g], anc[a]), A)
        for a, g in match.items():
            labels[b, a] = int(gt_labels[b, g, 0])
            boxes[b, a] = torch.tensor(gts[g])
            q = _iou(gts[g], pred_boxes[b, a].tolist()) if pred_boxes is not None else 1.0
            scores[b, a, labels[b, a]] = q
    return labels, boxes, scores


def ref_tal(pred_scores, pred_boxes, points, gt_labels, gt_boxes, pad_mask, bg, topk=13, alpha=1.0, beta=6.0, eps=1e-9):
    B, A, C = pred_scores.shape
    M = gt_boxes.shape[1]
    pts = points.tolist()
    labels = torch.full((B, A), bg, dtype=torch.long)
    boxes = torch.zeros(B, A, 4)
    scores = torch.zeros(B, A, C)
    for b in range(B):
        gts = gt_boxes[b].tolist()
        preds = pred_boxes[b].tolist()
        real = [g for g in range(M) if pad_mask[b, g, 0] > 0]
        metric = {}
        pos = {}
        for g in real:
            c = int(gt_labels[b, g, 0])
            metric[g] = [float(pred_scores[b, a, c]) ** alpha * _iou(gts[g], preds[a]) ** beta for a in range(A)]
            inside = [_inside(pts[a], gts[g]) for a in range(A)]
            masked = [m if ins else 0.0 for m, ins in zip(metric[g], inside)]
            top = sorted(range(A), key=lambda a: -masked[a])[:topk]
            pos[g] = {a for a in top if inside[a]}
        match = _resolve(pos, real, lambda g, a: _iou(gts[g], preds[a]), A)
        for g in real:
            mine = [a for a, h in match.items() if h == g]
            if not mine:
                continue
            max_m = max(metric[g][a] for a in mine)
            max_iou = max(_iou(gts[g], preds[a]) for a in mine)
            for a in mine:
                labels[b, a] = int(gt_labels[b, g, 0])
                boxes[b, a] = torch.tensor(gts[g])
                scores[b, a, labels[b, a]] = metric[g][a] / (max_m + eps) * max_iou
    return labels, boxes, scores


def random_case(seed: int, img: int = 96, B: int = 2, M: int = 5, C: int = 6):
    g = torch.Generator().manual_seed(seed)
    anchors, points, counts = make_anchors(img)
    A = points.shape[0]
    wh = 8 + torch.rand(B, M, 2, generator=g) * (img * 0.6)
    ctr = torch.rand(B, M, 2, generator=g) * img
    gt_boxes = torch.cat([ctr - wh / 2, ctr + wh / 2], -1).clamp(0, img)
    gt_labels = torch.randint(0, C, (B, M, 1), generator=g)
    n_real = torch.tensor([M - 2] + [M] * (B - 1))  # image 0 has two padded slots
    pad = (torch.arange(M)[None] < n_real[:, None]).float()[..., None]
    gt_boxes = gt_boxes * pad
    gt_labels = gt_labels * pad.long()
    # Predicted boxes around each point, large enough to overlap every GT a little (IoU > 0).
    half = 30 + torch.rand(B, A, 2, generator=g) * 40
    pred_boxes = torch.cat([points - half, points + half], -1)
    pred_scores = torch.rand(B, A, C, generator=g)
    return dict(anchors=anchors, points=points, counts=counts, gt_boxes=gt_boxes, gt_labels=gt_labels,
                pad=pad, pred_boxes=pred_boxes, pred_scores=pred_scores, C=C)


def _assert_same(out, ref):
    labels, boxes, scores = out
    r_labels, r_boxes, r_scores = ref
    assert torch.equal(labels, r_labels)
    fg = r_labels != scores.shape[-1]
    torch.testing.assert_close(boxes[fg], r_boxes[fg])
    torch.testing.assert_close(scores, r_scores, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- vs references


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_atss_matches_loop_reference(seed):
    c = random_case(seed)
    out = atss_assign(c["anchors"], c["counts"], c["gt_labels"], c["gt_boxes"], c["pad"], bg_index=c["C"],
                      topk=9, pred_bboxes=c["pred_boxes"])
    ref = ref_atss(c["anchors"], c["counts"], c["gt_labels"], c["gt_boxes"], c["pad"], c["C"], 9, c["pred_boxes"], c["C"])
    assert (ref[0] != c["C"]).sum() > 0
    _assert_same(out, ref)


def test_atss_without_pred_boxes_gives_unit_scores():
    c = random_case(3)
    labels, _, scores = atss_assign(c["anchors"], c["counts"], c["gt_labels"], c["gt_boxes"], c["pad"], bg_index=c["C"])
    ref = ref_atss(c["anchors"], c["counts"], c["gt_labels"], c["gt_boxes"], c["pad"], c["C"], 9, None, c["C"])
    assert torch.equal(labels, ref[0])
    fg = labels != c["C"]
    assert torch.equal(scores.sum(-1), fg.float())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tal_matches_loop_reference(seed):
    c = random_case(seed)
    out = task_aligned_assign(c["pred_scores"], c["pred_boxes"], c["points"], c["gt_labels"], c["gt_boxes"], c["pad"],
                              bg_index=c["C"], topk=13, alpha=1.0, beta=6.0)
    ref = ref_tal(c["pred_scores"], c["pred_boxes"], c["points"], c["gt_labels"], c["gt_boxes"], c["pad"], c["C"])
    assert (ref[0] != c["C"]).sum() > 0
    _assert_same(out, ref)


# Integer corners put GT centres exactly between anchor centres (equal distances); equal
# predictions and scores tie every metric. 128 px: 336 anchors, few enough that
# ``Tensor.topk`` fully sorts a row and its ties came out of index order before topk_mask.
TIE_GTS = torch.tensor([[[16.0, 16.0, 48.0, 48.0], [40.0, 8.0, 88.0, 72.0], [0.0, 64.0, 64.0, 128.0],
                         [64.0, 64.0, 96.0, 96.0]]])
TIE_LABELS = torch.tensor([[[1], [2], [0], [3]]])


def test_atss_breaks_distance_ties_by_the_lower_anchor_index():
    anchors, points, counts = make_anchors(128)
    pad = torch.ones(1, 4, 1)
    out = atss_assign(anchors, counts, TIE_LABELS, TIE_GTS, pad, bg_index=4, topk=9, num_classes=4)
    ref = ref_atss(anchors, counts, TIE_LABELS, TIE_GTS, pad, 4, 9, None, 4)
    assert (ref[0] != 4).sum() >= 16
    _assert_same(out, ref)


def test_tal_breaks_metric_ties_by_the_lower_anchor_index():
    anchors, points, counts = make_anchors(128)
    pad = torch.ones(1, 4, 1)
    scores = torch.full((1, anchors.shape[0], 4), 0.5)
    pred = anchors[None].clone()
    out = task_aligned_assign(scores, pred, points, TIE_LABELS, TIE_GTS, pad, bg_index=4)
    ref = ref_tal(scores, pred, points, TIE_LABELS, TIE_GTS, pad, 4)
    assert (ref[0] != 4).sum() >= 40
    _assert_same(out, ref)


# --------------------------------------------------------------------------- properties


def _one_gt(box, label=2):
    return (torch.tensor([[[label]]]), torch.tensor([[box]], dtype=torch.float32), torch.ones(1, 1, 1))


def _tal_inputs(points, C=4, pred=None):
    A = points.shape[0]
    scores = torch.full((1, A, C), 0.5)
    if pred is None:
        pred = torch.cat([points - 12, points + 12], -1)[None]
    return scores, pred


@pytest.mark.parametrize("box", [[10.0, 14.0, 40.0, 44.0], [50.0, 20.0, 90.0, 70.0], [2.0, 60.0, 30.0, 94.0]])
def test_gt_with_an_anchor_centre_inside_is_assigned(box):
    anchors, points, counts = make_anchors(96)
    labels_gt, boxes_gt, pad = _one_gt(box)
    inside = ((points[:, 0] > box[0]) & (points[:, 0] < box[2]) & (points[:, 1] > box[1]) & (points[:, 1] < box[3]))
    assert inside.any()
    for labels, boxes, scores in (
        atss_assign(anchors, counts, labels_gt, boxes_gt, pad, bg_index=4, num_classes=4),
        task_aligned_assign(*_tal_inputs(points), points, labels_gt, boxes_gt, pad, bg_index=4),
    ):
        fg = labels[0] != 4
        assert fg.any()
        assert (labels[0][fg] == 2).all()
        assert inside[fg].all()  # only anchors whose centre lies inside the GT
        assert torch.equal(boxes[0][fg], boxes_gt[0].expand(int(fg.sum()), 4))
        assert (scores[0][fg][:, 2] > 0).all() and (scores[0][~fg] == 0).all()


def test_padded_gts_never_assigned():
    """Padded slots (mask 0) with non-zero boxes and their own label change nothing."""
    c = random_case(4, B=2, M=3)
    c = {k: (v[1:] if k in ("gt_labels", "gt_boxes", "pred_boxes", "pred_scores") else v) for k, v in c.items()}
    c["gt_labels"] = c["gt_labels"] % 5  # label 5 belongs to the padded slots only
    real = dict(labels=c["gt_labels"], boxes=c["gt_boxes"], pad=torch.ones(1, 3, 1))
    junk_boxes = torch.tensor([[[20.0, 20.0, 70.0, 70.0], [0.0, 0.0, 96.0, 96.0]]])
    padded = dict(
        labels=torch.cat([c["gt_labels"], torch.full((1, 2, 1), 5)], 1),
        boxes=torch.cat([c["gt_boxes"], junk_boxes], 1),
        pad=torch.cat([torch.ones(1, 3, 1), torch.zeros(1, 2, 1)], 1),
    )
    C = c["C"]
    runs = {}
    for name, t in (("real", real), ("padded", padded)):
        runs[name] = (
            atss_assign(c["anchors"], c["counts"], t["labels"], t["boxes"], t["pad"], bg_index=C, pred_bboxes=c["pred_boxes"]),
            task_aligned_assign(c["pred_scores"], c["pred_boxes"], c["points"], t["labels"], t["boxes"], t["pad"], bg_index=C),
        )
    for (lr, br, sr), (lp, bp, sp) in zip(runs["real"], runs["padded"]):
        assert not (lp == 5).any()
        assert torch.equal(lr, lp)
        fg = lr != C
        assert torch.equal(br[fg], bp[fg])
        torch.testing.assert_close(sr, sp)


def test_tal_anchor_inside_two_gts_goes_to_higher_iou():
    """Point (12, 12) lies inside both GTs; each GT holds fewer than 13 points, so both take
    it as a candidate. Its predicted box decides: it goes to the GT it overlaps most, in
    either slot order."""
    anchors, points, counts = make_anchors(96)
    p = int(((points - torch.tensor([12.0, 12.0])).abs().sum(-1) == 0).nonzero()[0])
    gt_a = [4.0, 4.0, 28.0, 28.0]
    gt_b = [10.0, 10.0, 30.0, 30.0]
    for target, other in ((gt_a, gt_b), (gt_b, gt_a)):
        scores, pred = _tal_inputs(points)
        pred = pred.clone()
        pred[0, p] = torch.tensor(target)
        for order in ((target, other), (other, target)):
            boxes = torch.tensor([list(order)])
            labels = torch.tensor([[[1 if order[0] is target else 3], [3 if order[0] is target else 1]]])
            out_l, out_b, _ = task_aligned_assign(scores, pred, points, labels, boxes, torch.ones(1, 2, 1), bg_index=4)
            assert int(out_l[0, p]) == 1
            assert torch.equal(out_b[0, p], torch.tensor(target))


def test_atss_anchor_inside_two_gts_goes_to_higher_iou():
    """Two concentric GTs on the stride-8 point (44, 44): both select the centre anchor
    (40x40 px); it goes to the 40x40 GT (IoU 1), not the 34x46 one, in either order."""
    anchors, points, counts = make_anchors(96)
    p = int(((points - torch.tensor([44.0, 44.0])).abs().sum(-1) == 0).nonzero()[0])
    assert anchors[p].tolist() == [24.0, 24.0, 64.0, 64.0]
    square = [24.0, 24.0, 64.0, 64.0]
    tall = [27.0, 21.0, 61.0, 67.0]
    for first_is_square in (True, False):
        order = (square, tall) if first_is_square else (tall, square)
        labels = torch.tensor([[[1], [3]]]) if first_is_square else torch.tensor([[[3], [1]]])
        out_l, out_b, _ = atss_assign(anchors, counts, labels, torch.tensor([order]), torch.ones(1, 2, 1), bg_index=4, num_classes=4)
        assert int(out_l[0, p]) == 1
        assert torch.equal(out_b[0, p], torch.tensor(square))
    # Alone, the tall GT takes the centre anchor too: above, both GTs claimed it.
    out_l, _, _ = atss_assign(anchors, counts, torch.tensor([[[3]]]), torch.tensor([[tall]]), torch.ones(1, 1, 1), bg_index=4, num_classes=4)
    assert int(out_l[0, p]) == 3


def test_empty_image_is_all_background():
    anchors, points, counts = make_anchors(64)
    A = points.shape[0]
    labels = torch.zeros(2, 3, 1, dtype=torch.long)
    boxes = torch.zeros(2, 3, 4)
    pad = torch.zeros(2, 3, 1)
    for out in (
        atss_assign(anchors, counts, labels, boxes, pad, bg_index=4, num_classes=4),
        task_aligned_assign(torch.rand(2, A, 4), torch.rand(2, A, 4) * 64, points, labels, boxes, pad, bg_index=4),
    ):
        assert out[0].shape == (2, A) and out[1].shape == (2, A, 4) and out[2].shape == (2, A, 4)
        assert (out[0] == 4).all() and (out[2] == 0).all()


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("topk", [9, 40])  # 40: over the kernels' 32, the reference runs on every back end
def test_no_gt_slots_is_all_background_on_every_backend(backend, topk):
    """M = 0 (a batch without boxes, padded to no slot): every anchor background, as the
    kernels return; the torch assigners raised in argmax over an empty dim."""
    x = assign_inputs(batch=2, max_boxes=3, num_classes=3, img_size=128, seed=5)
    x = dataclasses.replace(x, gt_labels=x.gt_labels[:, :0], gt_bboxes=x.gt_bboxes[:, :0],
                            pad_gt_mask=x.pad_gt_mask[:, :0])
    B, A, C = x.pred_scores.shape
    with ops.use_backend(backend, "cpu"):
        tal = ops.task_aligned_assign(*x.tal_args(), topk=topk)
        atss = ops.atss_assign(*x.atss_args(), topk, x.pred_bboxes)
        gt, iou = ops.simota_assign(*x.simota_args(), topk=topk)
    for name, (labels, boxes, scores) in (("tal", tal), ("atss", atss)):
        assert torch.equal(labels, torch.full((B, A), C)), name
        assert torch.equal(boxes, torch.zeros(B, A, 4)) and torch.equal(scores, torch.zeros(B, A, C)), name
    assert torch.equal(gt, torch.full((B, A), -1)) and torch.equal(iou, torch.zeros(B, A))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_backend_returns_the_inputs_dtype(dtype):
    """Half inputs: the kernels compute in float32 and return the input's dtype; the torch
    path (the default for SimOTA on CUDA, and any topk over 32) returned SimOTA's IoU in
    float32, so the loss's objectness targets changed dtype with the back end."""
    x = assign_inputs(batch=2, max_boxes=3, num_classes=3, img_size=128, seed=5)
    x = dataclasses.replace(x, **{f: getattr(x, f).to(dtype) for f in ("pred_scores", "pred_bboxes", "gt_bboxes")})
    out = {}
    for backend in ("cpp", "torch"):
        with ops.use_backend(backend, "cpu"):
            _, boxes, scores = ops.task_aligned_assign(*x.tal_args())
            _, iou = ops.simota_assign(*x.simota_args())
        out[backend] = (boxes.dtype, scores.dtype, iou.dtype)
    assert out["torch"] == out["cpp"] == (dtype, dtype, dtype)


def test_assigners_trace_without_graph_breaks():
    c = random_case(0)
    e1 = torch._dynamo.explain(atss_assign)(c["anchors"], c["counts"], c["gt_labels"], c["gt_boxes"], c["pad"], c["C"], 9, c["pred_boxes"])
    e2 = torch._dynamo.explain(task_aligned_assign)(c["pred_scores"], c["pred_boxes"], c["points"], c["gt_labels"], c["gt_boxes"], c["pad"], c["C"])
    for e in (e1, e2):
        assert e.graph_break_count == 0, e.break_reasons
        assert e.graph_count == 1
