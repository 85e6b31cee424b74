"""SimOTA (``fastdet.ops.simota_assign``): the plain-torch reference against a loop-based
rendering of Megvii's published-weights SimOTA, constructed cases, and graph capture
(the C++, Triton and CUDA kernels: tests/test_simota_kernels.py).

The loop rendering below walks one image at a time with boolean indexing and per-GT
``argsort``, as Megvii's ``get_assignments`` does, computing the classification cost with
``F.binary_cross_entropy`` over ``[num_gt, num_candidates, C]``; it shares no code with
``fastdet.ops.simota``. It runs in float64, and so is the reference when compared with it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdet.ops import simota as ref

STRIDES = (8, 16, 32)


def grid(img: int, strides=STRIDES) -> tuple[torch.Tensor, torch.Tensor]:
    """-> cell centres [A, 2] and strides [A], finest level first (as YOLOXHead)."""
    pts, st = [], []
    for s in strides:
        n = img // s
        c = (torch.arange(n, dtype=torch.float64) + 0.5) * s
        yy, xx = torch.meshgrid(c, c, indexing="ij")
        pts.append(torch.stack([xx, yy], -1).reshape(-1, 2))
        st.append(torch.full((n * n,), float(s), dtype=torch.float64))
    return torch.cat(pts), torch.cat(st)


def random_inputs(B=3, M=6, C=5, img=256, valid=(4, 0, 6), seed=0, dtype=torch.float64, on_points=False):
    """Random SimOTA inputs: GT boxes of 3-50 % of the image, predicted boxes around every
    point (sizes up to 8 strides), scores = sigmoid(cls) * sigmoid(obj).

    ``on_points``: GT corners snapped to multiples of 8 px plus 4, the stride-8 point centres
    (as integer annotations put them: a box edge then passes through a row or column of
    points, which must not count as inside, and centre squares end on points too)."""
    g = torch.Generator().manual_seed(seed)
    points, strides = grid(img)
    A = points.shape[0]
    mask = torch.zeros(B, M, dtype=torch.bool)
    for b, n in enumerate(valid):
        mask[b, :n] = True
    wh = img * (0.03 + 0.47 * torch.rand(B, M, 2, generator=g, dtype=torch.float64))
    ctr = img * torch.rand(B, M, 2, generator=g, dtype=torch.float64)
    gt = torch.cat([ctr - wh / 2, ctr + wh / 2], -1).clamp(0, img)
    if on_points:
        gt = (torch.round((gt - 4) / 8) * 8 + 4).clamp(4, img - 4)
    gt = torch.where(mask[..., None], gt, torch.zeros_like(gt))
    labels = torch.randint(0, C, (B, M), generator=g)
    pwh = (0.5 + 7.5 * torch.rand(B, A, 2, generator=g, dtype=torch.float64)) * strides[:, None]
    pc = points + (torch.rand(B, A, 2, generator=g, dtype=torch.float64) - 0.5) * strides[:, None] * 2
    pred = torch.cat([pc - pwh / 2, pc + pwh / 2], -1)
    scores = torch.sigmoid(torch.randn(B, A, C, generator=g, dtype=torch.float64) * 2 - 2) * torch.sigmoid(
        torch.randn(B, A, 1, generator=g, dtype=torch.float64) * 2 - 1)
    return [t.to(dtype) if t.is_floating_point() else t for t in (scores, pred, points, strides, gt, labels, mask)]


# --------------------------------------------------------------------------- loop rendering


def _iou(a, b):
    """[G, 4] x [N, 4] xyxy -> [G, N] (Megvii's bboxes_iou on the same boxes)."""
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    return inter / (area_a[:, None] + area_b[None] - inter)


def loop_simota(scores, pred, points, strides, gt, labels, mask, r=2.5, topk=10, w=3.0):
    B, A, C = scores.shape
    assigned = torch.full((B, A), -1, dtype=torch.long)
    assigned_iou = torch.zeros(B, A, dtype=scores.dtype)
    x, y = points[:, 0], points[:, 1]
    for b in range(B):
        real = [m for m in range(gt.shape[1]) if mask[b, m]]
        if not real:
            continue
        g = gt[b, real]
        in_box = (x - g[:, :1] > 0) & (y - g[:, 1:2] > 0) & (g[:, 2:3] - x > 0) & (g[:, 3:4] - y > 0)
        cx, cy = (g[:, :1] + g[:, 2:3]) / 2, (g[:, 1:2] + g[:, 3:4]) / 2
        rr = r * strides
        in_ctr = (x - (cx - rr) > 0) & (y - (cy - rr) > 0) & ((cx + rr) - x > 0) & ((cy + rr) - y > 0)
        cand = in_box.any(0) | in_ctr.any(0)
        cand_idx = cand.nonzero().squeeze(1)
        if cand_idx.numel() == 0:
            continue
        both = (in_box & in_ctr)[:, cand]
        ious = _iou(g, pred[b, cand])
        q = scores[b, cand].sqrt()
        onehot = F.one_hot(labels[b, real], C).to(q.dtype)
        G, N = ious.shape
        cls_cost = F.binary_cross_entropy(q[None].expand(G, N, C), onehot[:, None].expand(G, N, C),
                                          reduction="none").sum(-1)
        cost = cls_cost + w * -torch.log(ious + 1e-8) + 1e5 * (~both).to(q.dtype)
        k_cand = min(topk, N)
        dyn_k = ious.topk(k_cand, dim=1).values.sum(1).floor().clamp(min=1).long()
        matching = torch.zeros(G, N, dtype=torch.bool)
        for gi in range(G):
            order = torch.argsort(cost[gi], stable=True)  # ties: lower point index
            matching[gi, order[: dyn_k[gi]]] = True
        multiple = matching.sum(0) > 1
        if multiple.any():
            best = cost[:, multiple].argmin(0)
            matching[:, multiple] = False
            matching[best, multiple.nonzero().squeeze(1)] = True
        fg = matching.any(0)
        gi = matching[:, fg].long().argmax(0)
        a_idx = cand_idx[fg]
        assigned[b, a_idx] = torch.tensor(real)[gi]
        assigned_iou[b, a_idx] = ious[gi, fg.nonzero().squeeze(1)]
    return assigned, assigned_iou


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_loop_rendering(seed):
    args = random_inputs(seed=seed)
    got_gt, got_iou = ref.simota_assign(*args)
    want_gt, want_iou = loop_simota(*args)
    assert (want_gt >= 0).sum() > 10
    assert torch.equal(got_gt, want_gt)
    torch.testing.assert_close(got_iou, want_iou, rtol=1e-12, atol=1e-12)


def edge_points(points, gt, mask) -> int:
    """How many (point, real GT) pairs have the point exactly on a box edge, inside its span."""
    x, y = points[:, 0], points[:, 1]
    g = gt[mask]  # [G, 4]
    on_x = ((x == g[:, :1]) | (x == g[:, 2:3])) & (y > g[:, 1:2]) & (y < g[:, 3:4])
    on_y = ((y == g[:, 1:2]) | (y == g[:, 3:4])) & (x > g[:, :1]) & (x < g[:, 2:3])
    return int((on_x | on_y).sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_points_on_a_box_edge_are_outside_as_in_megvii(seed):
    """Integer GT corners through point centres (the usual case in annotated data): Megvii's
    ``get_in_boxes_info`` takes a point as inside only strictly (``> 0``), so the points on
    an edge are candidates only through the centre square. A ``>= 0`` test passed the
    random cases above, which never put a point on an edge."""
    args = random_inputs(seed=seed, on_points=True)
    _, _, points, _, gt, _, mask = args
    assert edge_points(points, gt, mask) > 20
    got_gt, got_iou = ref.simota_assign(*args)
    want_gt, want_iou = loop_simota(*args)
    assert (want_gt >= 0).sum() > 10
    assert torch.equal(got_gt, want_gt)
    torch.testing.assert_close(got_iou, want_iou, rtol=1e-12, atol=1e-12)


def test_reference_float32_agrees_with_float64():
    args = random_inputs(seed=3)
    gt64, iou64 = ref.simota_assign(*args)
    args32 = [a.float() if a.is_floating_point() else a for a in args]
    gt32, iou32 = ref.simota_assign(*args32)
    assert (gt32 == gt64).float().mean() > 0.999
    same = gt32 == gt64
    torch.testing.assert_close(iou32[same].double(), iou64[same], rtol=1e-5, atol=1e-6)


def _one_gt_case(C=3):
    """One 64 x 64 GT at (64, 64)-(128, 128) on a 256 px grid; every prediction is far away
    (IoU 0) except three points inside the box and its centre square whose predictions
    equal the GT."""
    points, strides = grid(256)
    A = points.shape[0]
    pred = torch.tensor([1000.0, 1000.0, 1010.0, 1010.0], dtype=torch.float64).repeat(1, A, 1)
    gt = torch.tensor([[[64.0, 64.0, 128.0, 128.0]]], dtype=torch.float64)
    half = torch.clamp(2.5 * strides, max=32.0)[:, None]
    inside = ((points - 96).abs() < half).all(-1).nonzero().squeeze(1)
    good = inside[[0, 5, 9]]
    pred[0, good] = gt[0, 0]
    scores = torch.full((1, A, C), 0.25, dtype=torch.float64)
    return scores, pred, points, strides, gt, torch.tensor([[1]]), torch.tensor([[True]]), good


def test_dynamic_k_is_the_sum_of_top_ious():
    scores, pred, points, strides, gt, labels, mask, good = _one_gt_case()
    assigned, iou = ref.simota_assign(scores, pred, points, strides, gt, labels, mask)
    assert sorted((assigned[0] == 0).nonzero().squeeze(1).tolist()) == sorted(good.tolist())  # k = 1 + 1 + 1
    assert torch.equal(iou[0, good], torch.ones(3, dtype=torch.float64))
    # Two perfect predictions and one of IoU 0.5: k = floor(2.5) = 2, the two perfect ones.
    half = gt[0, 0].clone()
    half[2] = 160.0  # twice as wide: IoU 0.5
    pred[0, good[2]] = half
    assigned, _ = ref.simota_assign(scores, pred, points, strides, gt, labels, mask)
    assert sorted((assigned[0] == 0).nonzero().squeeze(1).tolist()) == sorted(good[:2].tolist())


def test_k_is_at_least_one_and_only_candidates_are_assigned():
    scores, pred, points, strides, gt, labels, mask, _ = _one_gt_case()
    pred[:] = torch.tensor([1000.0, 1000.0, 1010.0, 1010.0], dtype=torch.float64)  # all IoUs 0
    scores[0, 7, 1] = 0.99  # a point far from the box: not a candidate, whatever its score
    assigned, iou = ref.simota_assign(scores, pred, points, strides, gt, labels, mask)
    fg = (assigned[0] == 0).nonzero().squeeze(1).tolist()
    assert len(fg) == 1 and iou[0, fg[0]] == 0
    a = fg[0]
    assert ((points[a] > 64) & (points[a] < 128)).all()  # inside box and centre square
    assert assigned[0, 7] == -1


def test_padded_slots_never_match_and_empty_images_are_background():
    args = random_inputs(seed=4)
    scores, pred, points, strides, gt, labels, mask = args
    gt_pad = gt.clone()
    gt_pad[~mask] = torch.tensor([10.0, 10.0, 200.0, 200.0], dtype=gt.dtype)  # garbage in padded slots
    assigned, _ = ref.simota_assign(scores, pred, points, strides, gt_pad, labels, mask)
    want, _ = ref.simota_assign(*args)
    assert torch.equal(assigned, want)
    assert (assigned[1] == -1).all()  # image 1 has no GT
    for b in range(3):
        assert (assigned[b][assigned[b] >= 0] < int(mask[b].sum())).all()


def test_conflict_goes_to_the_cheapest_gt():
    """Two identical GTs but for the label: the shared points go to the GT whose class the
    points score higher (the cheaper one), none to the other."""
    scores, pred, points, strides, gt, labels, mask, good = _one_gt_case()
    gt2 = gt.expand(1, 2, 4).clone()
    labels2 = torch.tensor([[1, 2]])
    mask2 = torch.tensor([[True, True]])
    scores[0, :, 2] = 0.5
    assigned, _ = ref.simota_assign(scores, pred, points, strides, gt2, labels2, mask2)
    assert sorted((assigned[0] == 1).nonzero().squeeze(1).tolist()) == sorted(good.tolist())
    assert not (assigned[0] == 0).any()


def test_penalised_points_are_taken_after_those_in_box_and_centre():
    """A small box (8 x 8 at stride 8): one point lies in box and centre square, but the
    dynamic k is 3; the other two come from the centre square, cheapest first."""
    points, strides = grid(128)
    A = points.shape[0]
    gt = torch.tensor([[[40.0, 40.0, 48.0, 48.0]]], dtype=torch.float64)
    pred = torch.tensor([40.0, 40.0, 40.0 + 8 / 0.35, 48.0], dtype=torch.float64).repeat(1, A, 1)  # IoU 0.35: k = 3
    scores = torch.full((1, A, 2), 0.3, dtype=torch.float64)
    assigned, _ = ref.simota_assign(scores, pred, points, strides, gt, torch.tensor([[0]]), torch.tensor([[True]]))
    fg = (assigned[0] == 0).nonzero().squeeze(1)
    assert len(fg) == 3
    in_box = ((points[fg] > 40) & (points[fg] < 48)).all(-1)
    assert in_box.sum() == 1  # (44, 44), the only point in the box
    # All costs tie but for the penalty: the other two are the lowest-index candidates.
    in_ctr = ((points - 44).abs() < 2.5 * strides[:, None]).all(-1) & ~((points > 40) & (points < 48)).all(-1)
    assert fg[~in_box].tolist() == in_ctr.nonzero().squeeze(1)[:2].tolist()


def test_reference_traces_into_one_graph():
    args = [a.float() if a.is_floating_point() else a for a in random_inputs(seed=5)]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(ref.simota_assign)(*args)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
