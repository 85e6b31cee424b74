"""Post-processing: multiclass NMS against torchvision's batched_nms and a greedy loop
reference, its limits, predict() end to end, and mapping boxes to original image sizes."""

from __future__ import annotations

import torch
import torchvision

from fastdet.models import build_model, multiclass_nms, rescale_boxes


def dense_predictions(B=2, A=300, C=5, img=128, seed=0):
    """Clustered boxes (so NMS has work to do) and scores in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(B, 8, 2, generator=g) * img
    pick = torch.randint(0, 8, (B, A), generator=g)
    ctr = torch.gather(centres, 1, pick[..., None].expand(-1, -1, 2)) + torch.randn(B, A, 2, generator=g) * 3
    wh = 10 + torch.rand(B, A, 2, generator=g) * 30
    boxes = torch.cat([ctr - wh / 2, ctr + wh / 2], -1)
    scores = torch.rand(B, A, C, generator=g) ** 3  # many below the threshold
    return boxes, scores


def greedy_nms(boxes, scores, labels, iou_thresh):
    """Per class: keep the best remaining box, drop those overlapping it by more than iou_thresh."""
    keep = []
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    suppressed = set()
    for i in order:
        if i in suppressed:
            continue
        keep.append(i)
        for j in order:
            if j not in suppressed and j != i and labels[j] == labels[i]:
                if torchvision.ops.box_iou(boxes[i : i + 1], boxes[j : j + 1])[0, 0] > iou_thresh:
                    suppressed.add(j)
    return sorted(keep, key=lambda i: -float(scores[i]))


def candidates(boxes, scores, score_thresh, topk):
    """The (anchor, class) pairs NMS starts from, chosen with a sort instead of topk."""
    C = scores.shape[-1]
    flat = scores.reshape(-1)
    order = flat.argsort(descending=True)[:topk]
    order = order[flat[order] > score_thresh]
    return boxes[order // C], flat[order], order % C


def test_multiclass_nms_matches_batched_nms_and_greedy_reference():
    boxes, scores = dense_predictions()
    out = multiclass_nms(boxes, scores, score_thresh=0.05, iou_thresh=0.5, max_det=40, pre_nms_topk=200)
    assert len(out) == 2
    for b, det in enumerate(out):
        cb, cs, cl = candidates(boxes[b], scores[b], 0.05, 200)
        direct = torchvision.ops.batched_nms(cb, cs, cl, 0.5)[:40]
        torch.testing.assert_close(det["boxes"], cb[direct])
        torch.testing.assert_close(det["scores"], cs[direct])
        assert torch.equal(det["labels"], cl[direct])
        ref = greedy_nms(cb, cs, cl, 0.5)[:40]
        assert torch.equal(det["scores"], cs[ref])
        assert torch.equal(det["labels"], cl[ref])


def test_multiclass_nms_limits_and_order():
    boxes, scores = dense_predictions(seed=1)
    for det in multiclass_nms(boxes, scores, score_thresh=0.2, iou_thresh=0.6, max_det=25, pre_nms_topk=500):
        K = det["boxes"].shape[0]
        assert 0 < K <= 25
        assert (det["scores"] > 0.2).all()
        assert (det["scores"][:-1] >= det["scores"][1:]).all()
        iou = torchvision.ops.box_iou(det["boxes"], det["boxes"])
        same = det["labels"][:, None] == det["labels"][None]
        off_diag = ~torch.eye(K, dtype=torch.bool)
        assert (iou[same & off_diag] <= 0.6).all()  # no same-class pair survives above the IoU
    # Boxes of different classes never suppress each other.
    one = torch.tensor([[[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]]])
    s = torch.tensor([[[0.9, 0.0], [0.0, 0.8]]])
    det = multiclass_nms(one, s, score_thresh=0.01)[0]
    assert det["labels"].tolist() == [0, 1]
    det = multiclass_nms(one, torch.tensor([[[0.9, 0.0], [0.8, 0.0]]]), score_thresh=0.01)[0]
    assert det["labels"].tolist() == [0] and det["scores"].tolist() == [0.8999999761581421]


def test_pre_nms_topk_bounds_candidates():
    boxes, scores = dense_predictions(A=50, C=3, seed=2)
    det = multiclass_nms(boxes, scores, score_thresh=0.0, iou_thresh=1.0, max_det=1000, pre_nms_topk=7)
    assert all(d["boxes"].shape[0] == 7 for d in det)  # IoU 1.0 suppresses nothing
    top7 = scores[0].reshape(-1).topk(7).values
    torch.testing.assert_close(det[0]["scores"], top7)


def paddle_multiclass_nms(boxes, scores, score_thresh, iou_thresh, max_det, nms_top_k):
    """PaddleDetection's MultiClassNMS (its C++ kernel's steps), one image, a loop per
    class: the scores above the threshold, the best ``nms_top_k`` of them, greedy NMS;
    then the best ``max_det`` over all classes."""
    kept = []
    for c in range(scores.shape[1]):
        idx = [int(i) for i in scores[:, c].argsort(descending=True) if scores[i, c] > score_thresh][:nms_top_k]
        cb, cs = boxes[idx], scores[idx, c]
        kept += [(float(cs[i]), c, idx[i]) for i in greedy_nms(cb, cs, [c] * len(idx), iou_thresh)]
    kept = sorted(kept, key=lambda t: -t[0])[:max_det]
    return [t[0] for t in kept], [t[1] for t in kept], [t[2] for t in kept]


def test_per_class_topk_is_paddles_multiclass_nms():
    boxes, scores = dense_predictions(A=120, C=4, seed=4)
    scores[:, :, 0] = 0.5 + scores[:, :, 0] / 2  # class 0 holds the top of the (anchor, class) ranking
    scores[:, :, 1:] /= 2
    out = multiclass_nms(boxes, scores, 0.05, 0.5, max_det=30, pre_nms_topk=10, per_class_topk=True)
    for b, det in enumerate(out):
        s, labels, anchors = paddle_multiclass_nms(boxes[b], scores[b], 0.05, 0.5, 30, 10)
        assert det["scores"].tolist() == s and det["labels"].tolist() == labels
        torch.testing.assert_close(det["boxes"], boxes[b][anchors])
        assert set(labels) == {0, 1, 2, 3}
    # Over all pairs, the same top-10 keeps class 0's boxes only: the two top-k differ here.
    flat = multiclass_nms(boxes, scores, 0.05, 0.5, max_det=30, pre_nms_topk=10)
    assert set(flat[0]["labels"].tolist()) == {0}


def test_the_paddle_families_take_their_top_k_per_class():
    """PP-YOLOE and FCOS evaluate as PaddleDetection's MultiClassNMS (nms_top_k per class)."""
    from fastdet import registry
    for arch, size in (("ppyoloe", "s"), ("fcos", "r50")):
        assert registry.predict_kwargs(registry.get_preset(arch, size))["per_class_topk"] is True
        assert build_model(arch, size, num_classes=2).predict_defaults["per_class_topk"] is True


def test_no_detections_above_threshold():
    boxes, scores = dense_predictions(seed=3)
    det = multiclass_nms(boxes, scores * 0, score_thresh=0.01)
    assert all(d["boxes"].shape == (0, 4) and d["scores"].numel() == 0 and d["labels"].numel() == 0 for d in det)


def test_predict_is_nms_over_the_dense_outputs():
    torch.manual_seed(0)
    model = build_model("ppyoloe", "s", num_classes=4).eval()
    with torch.no_grad():
        for conv in model.head.pred_cls:
            conv.weight.normal_(0, 0.05)
            conv.bias.fill_(0.0)  # scores around 0.5: plenty above 0.01
    x = torch.randn(2, 3, 96, 96)
    dets = model.predict(x, score_thresh=0.01, iou_thresh=0.7, max_det=300, pre_nms_topk=1000)
    with torch.no_grad():
        boxes, scores = model(x)
    ref = multiclass_nms(boxes, scores, 0.01, 0.7, 300, 1000)
    for d, r in zip(dets, ref):
        assert 0 < d["boxes"].shape[0] <= 300
        for k in ("boxes", "scores", "labels"):
            torch.testing.assert_close(d[k], r[k])


def test_rescale_boxes_to_original_size():
    boxes = torch.tensor([[64.0, 32.0, 320.0, 640.0], [-5.0, 10.0, 700.0, 50.0]])
    # Network input 640x640 (h, w); original image 480 high, 1280 wide.
    out = rescale_boxes(boxes, (640, 640), (480, 1280))
    torch.testing.assert_close(out[0], torch.tensor([128.0, 24.0, 640.0, 480.0]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 7.5, 1280.0, 37.5]))  # clipped to the image
    out = rescale_boxes(boxes, torch.tensor([640, 320]), torch.tensor([640, 320]))  # same size: clip only
    torch.testing.assert_close(out[0], torch.tensor([64.0, 32.0, 320.0, 640.0]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 10.0, 320.0, 50.0]))
