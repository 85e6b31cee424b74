"""The C++ CPU kernels of fastdet.ops against the torch references, called directly
through ``torch.ops.fastdet`` (and once through the public API with the ``cpp`` back end).

The extension is built once per session (cached under ``$FASTDET_EXT_DIR``); with a CUDA
toolkit present that one build also compiles the CUDA sources (test_ops_build.py).
"""

from __future__ import annotations

import pytest
import torch
import torchvision

import fastdet.ops as ops
from fastdet.ops import _ext, assigners, reference
from fastdet.ops.synthetic import assign_inputs, random_boxes


@pytest.fixture(scope="module")
def F():
    if not _ext.load():
        pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
    return torch.ops.fastdet


def _edge_boxes() -> torch.Tensor:
    """Zero-area, identical, nested, touching and disjoint boxes."""
    return torch.tensor([
        [0.0, 0.0, 10.0, 10.0],
        [0.0, 0.0, 10.0, 10.0],  # identical to the first
        [5.0, 5.0, 5.0, 9.0],  # zero width
        [3.0, 3.0, 3.0, 3.0],  # a point
        [10.0, 0.0, 20.0, 10.0],  # touches the first
        [2.0, 2.0, 8.0, 8.0],  # inside the first
        [50.0, 50.0, 60.0, 70.0],  # disjoint
    ])


# ----------------------------------------------------------------------------- IoU family


@pytest.mark.parametrize("op", ["box_iou", "generalized_box_iou"])
def test_pairwise_matches_reference(F, op):
    for seed, (a, b) in enumerate([
        (random_boxes(17, seed=1), random_boxes(23, seed=2)),
        (random_boxes(3, 9, seed=3), random_boxes(3, 14, seed=4)),
        (_edge_boxes(), _edge_boxes()),
        (random_boxes(0, seed=5), random_boxes(4, seed=6)),
    ]):
        got = getattr(F, op)(a, b, 1e-9)
        want = getattr(reference, op)(a, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"case {seed}")


def test_pairwise_matches_torchvision(F):
    a, b = random_boxes(40, seed=7), random_boxes(30, seed=8)
    torch.testing.assert_close(F.box_iou(a, b, 1e-9), torchvision.ops.box_iou(a, b), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(F.generalized_box_iou(a, b, 1e-9), torchvision.ops.generalized_box_iou(a, b),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["box_iou", "generalized_box_iou"])
def test_pairwise_public_api_is_differentiable_as_torchvision(F, op):
    """The kernels have no backward: with a gradient wanted the public op must still give
    torchvision's (it gave none on cpp, only the L1 term of a loss reached the boxes)."""
    pred = torch.tensor([[2.0, 2.0, 8.0, 12.0]], requires_grad=True)
    tgt = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    tv = getattr(torchvision.ops, op)
    want = torch.autograd.grad((1 - torch.diag(tv(pred, tgt))).sum(), pred)[0]
    with ops.use_backend("cpp", "cpu"):
        assert ops.backend_for(op, "cpu") == "cpp"
        got = torch.autograd.grad((1 - torch.diag(getattr(ops, op)(pred, tgt))).sum(), pred)[0]
        torch.testing.assert_close(got, want)
        a = random_boxes(5, seed=23).double().requires_grad_()
        b = random_boxes(2, 6, seed=24).double()[1].requires_grad_()
        assert torch.autograd.gradcheck(getattr(ops, op), (a, b))
        g = torch.rand(5, 6, dtype=torch.float64)
        got = torch.autograd.grad(getattr(ops, op)(a, b), (a, b), g)
        want = torch.autograd.grad(tv(a, b), (a, b), g)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
        with torch.no_grad():  # what training asks: the kernel's values, no graph
            out = getattr(ops, op)(a, b)
        assert out.grad_fn is None
        torch.testing.assert_close(out, getattr(F, op)(a.detach(), b.detach(), 1e-9), rtol=0, atol=0)


def test_edge_case_values(F):
    e = _edge_boxes()
    iou = F.box_iou(e, e, 1e-9)
    assert iou[0, 1] == 1.0 and iou[0, 5] == pytest.approx(36 / 100)
    assert iou[0, 4] == 0.0 and iou[0, 6] == 0.0
    assert iou[2, 2] == 0.0 and iou[3, 3] == 0.0  # zero-area boxes: 0, not NaN
    assert torch.isfinite(F.generalized_box_iou(e, e, 1e-9)).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_pairwise_dtypes(F, dtype):
    a, b = random_boxes(2, 11, seed=9), random_boxes(2, 13, seed=10)
    got = F.box_iou(a.to(dtype), b.to(dtype), 1e-9)
    assert got.dtype == dtype
    tol = {torch.float64: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), reference.box_iou(a.to(dtype).float(), b.to(dtype).float()),
                               rtol=tol, atol=tol)


def test_pairwise_bad_shapes(F):
    with pytest.raises(RuntimeError, match="box_iou.*expected a \\[N,4\\] and b \\[M,4\\]"):
        F.box_iou(random_boxes(2, 3), random_boxes(3, 3), 1e-9)
    with pytest.raises(ValueError, match="fastdet.ops.box_iou: a must have shape"):
        ops.box_iou(torch.zeros(3, 5), torch.zeros(3, 4))


def _paired_cases():
    p, t = random_boxes(64, seed=11), random_boxes(64, seed=12)
    e = _edge_boxes()
    # identical pairs, nested, touching, disjoint; and a [B, A, 4] batch
    return [(p, t), (e, e.flip(0)), (e, e), (random_boxes(2, 5, seed=13), random_boxes(2, 5, seed=14))]


def test_giou_loss_forward_backward_match_autograd(F):
    for i, (p, t) in enumerate(_paired_cases()):
        p = p.double().requires_grad_()
        t = t.double().requires_grad_()
        got = F.giou_loss(p, t, 1e-10)
        want = reference.giou_loss(p, t)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"case {i}")
        g = torch.rand_like(want)
        got_g = torch.autograd.grad(got, (p, t), g)
        want_g = torch.autograd.grad(want, (p, t), g)
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"case {i}")


def test_giou_loss_gradcheck(F):
    p, t = random_boxes(6, seed=15).double(), random_boxes(6, seed=16).double()
    p[0] = t[0]  # identical boxes: max/min ties split the gradient like autograd
    p.requires_grad_()
    t.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: F.giou_loss(a, b, 1e-10), (p, t))


def test_giou_loss_public_api_broadcast_and_float32(F):
    p = random_boxes(2, 7, seed=17).requires_grad_()
    t = random_boxes(7, seed=18)
    with ops.use_backend("cpp", "cpu"):
        got = ops.giou_loss(p, t)
    want = reference.giou_loss(p, t)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.sum().backward()
    g = p.grad.clone()
    p.grad = None
    want.sum().backward()
    torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_custom_ops_pass_opcheck(F):
    a, b = random_boxes(5, seed=19), random_boxes(6, seed=20)
    torch.library.opcheck(F.box_iou, (a, b, 1e-9))
    p, t = random_boxes(8, seed=21).requires_grad_(), random_boxes(8, seed=22).requires_grad_()
    torch.library.opcheck(F.giou_loss, (p, t, 1e-10))
    x = assign_inputs(2, 4, 3, 128, valid=[2, 4], seed=1)
    torch.library.opcheck(F.task_aligned_assign, (*x.tal_args()[:6], 3, 13, 1.0, 6.0, 1e-9),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(F.atss_assign, (x.anchors, x.num_anchors_list, x.gt_labels, x.gt_bboxes,
                                          x.pad_gt_mask, x.pred_bboxes, 3, 3, 9, 1e-9),
                          test_utils=("test_schema", "test_faketensor"))
    ema = [torch.randn(4), torch.zeros((), dtype=torch.int64)]
    torch.library.opcheck(F.ema_update_, (ema, [torch.randn(4), torch.tensor(3)], torch.tensor(0.5)),
                          test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- EMA


def _ema_pair(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 3, 3, 3), (64,), (64,), (), (1000,), (7, 5)]
    ema = [torch.randn(s, generator=g) for s in shapes]
    src = [torch.randn(s, generator=g) for s in shapes]
    ema[3], src[3] = torch.tensor(4, dtype=torch.int64), torch.tensor(9, dtype=torch.int64)  # BN counter
    return ema, src


@pytest.mark.parametrize("decay", [0.0, 0.1, 0.9998, 0.75])
def test_ema_update_matches_reference(F, decay):
    ema, src = _ema_pair(0)
    want = [e.clone() for e in ema]
    d = torch.tensor(decay)
    F.ema_update_(ema, src, d)
    reference.ema_update_(want, src, d)
    for a, b in zip(ema, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert ema[3].item() == 9  # non-floating tensors are copied


def test_ema_update_dtypes_and_layouts(F):
    d = torch.tensor(0.9, dtype=torch.float64)
    cases = {
        "double": (torch.randn(300, dtype=torch.float64), torch.randn(300, dtype=torch.float64)),
        "half": (torch.randn(300).half(), torch.randn(300).half()),
        "bf16": (torch.randn(300).bfloat16(), torch.randn(300).bfloat16()),
        "mixed": (torch.randn(300), torch.randn(300).half()),
        "strided": (torch.randn(20, 30).t(), torch.randn(30, 20)),
    }
    for name, (e, s) in cases.items():
        want = e.clone()
        reference.ema_update_([want], [s], d)
        F.ema_update_([e], [s], d)
        tol = 1e-2 if e.dtype in (torch.float16, torch.bfloat16) else 1e-6
        torch.testing.assert_close(e, want, rtol=tol, atol=tol, msg=name)


def test_ema_update_large_parallel(F):
    # Several parallel chunks, with tensors straddling chunk boundaries.
    ema = [torch.randn(n) for n in (70001, 3, 40000, 1)]
    src = [torch.randn_like(e) for e in ema]
    want = [e.clone() for e in ema]
    F.ema_update_(ema, src, torch.tensor(0.99))
    reference.ema_update_(want, src, torch.tensor(0.99))
    for a, b in zip(ema, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_ema_update_rejects_mismatched_lists(F):
    with pytest.raises(RuntimeError, match="ema_update_: got 1 EMA tensors but 2"):
        F.ema_update_([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="tensor 0 has shape"):
        F.ema_update_([torch.zeros(2)], [torch.zeros(3)], torch.tensor(0.5))


# ----------------------------------------------------------------------------- assigners


def _assert_assign_equal(got, want, msg=""):
    labels, bboxes, scores = got
    wl, wb, ws = want
    assert labels.dtype == torch.int64 and labels.shape == wl.shape
    assert torch.equal(labels, wl), f"{msg}: labels differ at {(labels != wl).nonzero()[:5].tolist()}"
    torch.testing.assert_close(bboxes, wb, rtol=0, atol=0, msg=msg)
    torch.testing.assert_close(scores, ws, rtol=1e-5, atol=1e-6, msg=msg)


# 256 px input: A = 32^2 + 16^2 + 8^2 = 1344 anchors. The reference breaks top-k ties by the
# lower index (``assigners.topk_mask``), as the kernels' packed keys do.
ASSIGN_CASES = {
    "random": dict(batch=3, max_boxes=8, num_classes=5, img_size=256, seed=0),
    "crowded": dict(batch=2, max_boxes=20, num_classes=3, img_size=256, valid=[20, 13], seed=1),
    "no_gt_in_one_image": dict(batch=3, max_boxes=6, num_classes=4, img_size=256, valid=[0, 6, 2], seed=2),
    "all_padded": dict(batch=2, max_boxes=5, num_classes=4, img_size=256, valid=[0, 0], seed=3),
}


@pytest.mark.parametrize("case", list(ASSIGN_CASES))
def test_task_aligned_assign_matches_reference(F, case):
    x = assign_inputs(**ASSIGN_CASES[case])
    want = assigners.task_aligned_assign(*x.tal_args())
    got = F.task_aligned_assign(*x.tal_args()[:6], x.num_classes, 13, 1.0, 6.0, 1e-9)
    _assert_assign_equal(got, want, case)
    if case in ("random", "crowded"):
        assert (want[0] != x.num_classes).sum() > 20  # the case exercises real assignments


@pytest.mark.parametrize("case", list(ASSIGN_CASES))
def test_atss_assign_matches_reference(F, case):
    x = assign_inputs(**ASSIGN_CASES[case])
    C = x.num_classes
    for pred in (x.pred_bboxes, None):
        want = assigners.atss_assign(*x.atss_args(), 9, pred)
        got = F.atss_assign(x.anchors, x.num_anchors_list, x.gt_labels, x.gt_bboxes, x.pad_gt_mask, pred, C, C, 9,
                            1e-9)
        _assert_assign_equal(got, want, case)


def test_assign_ties_and_duplicates(F):
    """Ties in top-k (equal metrics, equal distances) and identical GT boxes."""
    x = assign_inputs(batch=2, max_boxes=6, num_classes=3, img_size=256, valid=[6, 4], seed=4)
    # Image 0: every prediction the same box and every score the same, so metrics tie
    # across anchors; GTs 0 and 1 identical (several claimants, IoU tie -> first slot);
    # GT 2 of zero width (no anchor strictly inside).
    x.pred_bboxes[0] = torch.tensor([60.0, 60.0, 140.0, 150.0])
    x.pred_scores[0] = 0.5
    x.gt_bboxes[0, 1] = x.gt_bboxes[0, 0]
    x.gt_bboxes[0, 2] = torch.tensor([100.0, 40.0, 100.0, 90.0])
    _assert_assign_equal(F.task_aligned_assign(*x.tal_args()[:6], 3, 13, 1.0, 6.0, 1e-9),
                         assigners.task_aligned_assign(*x.tal_args()), "tal ties")
    # ATSS: GTs centred exactly between anchor centres on every level (equal distances).
    x = assign_inputs(batch=1, max_boxes=4, num_classes=3, img_size=768, valid=[4], seed=5)
    x.gt_bboxes[0, 0] = torch.tensor([352.0, 352.0, 416.0, 416.0])
    x.gt_bboxes[0, 1] = torch.tensor([300.0, 320.0, 468.0, 448.0])
    x.gt_bboxes[0, 2] = x.gt_bboxes[0, 0]
    _assert_assign_equal(F.atss_assign(x.anchors, x.num_anchors_list, x.gt_labels, x.gt_bboxes, x.pad_gt_mask,
                                       x.pred_bboxes, 3, 3, 9, 1e-9),
                         assigners.atss_assign(*x.atss_args(), 9, x.pred_bboxes), "atss ties")


def test_assign_no_gt_slots(F):
    x = assign_inputs(batch=2, max_boxes=3, num_classes=4, img_size=128, seed=5)
    empty = dict(gt_labels=x.gt_labels[:, :0], gt_bboxes=x.gt_bboxes[:, :0], pad_gt_mask=x.pad_gt_mask[:, :0])
    labels, bboxes, scores = F.task_aligned_assign(x.pred_scores, x.pred_bboxes, x.anchor_points,
                                                   empty["gt_labels"], empty["gt_bboxes"], empty["pad_gt_mask"],
                                                   4, 13, 1.0, 6.0, 1e-9)
    assert (labels == 4).all() and (bboxes == 0).all() and (scores == 0).all()
    labels, _, scores = F.atss_assign(x.anchors, x.num_anchors_list, empty["gt_labels"], empty["gt_bboxes"],
                                      empty["pad_gt_mask"], None, 4, 4, 9, 1e-9)
    assert (labels == 4).all() and scores.shape == (2, x.anchors.shape[0], 4) and (scores == 0).all()


def test_assign_public_api_uses_kernel_and_matches(F):
    x = assign_inputs(batch=2, max_boxes=5, num_classes=4, img_size=256, seed=6)
    with ops.use_backend("cpp", "cpu"):
        assert ops.backend_for("task_aligned_assign", "cpu") == "cpp"
        got_t = ops.task_aligned_assign(*x.tal_args())
        got_a = ops.atss_assign(*x.atss_args(), 9, x.pred_bboxes)
    _assert_assign_equal(got_t, assigners.task_aligned_assign(*x.tal_args()), "tal")
    _assert_assign_equal(got_a, assigners.atss_assign(*x.atss_args(), 9, x.pred_bboxes), "atss")


def test_assign_bad_inputs(F):
    x = assign_inputs(batch=1, max_boxes=2, num_classes=3, img_size=128, seed=7)
    with pytest.raises(RuntimeError, match="num_anchors_list sums to"):
        F.atss_assign(x.anchors, [1, 2], x.gt_labels, x.gt_bboxes, x.pad_gt_mask, None, 3, 3, 9, 1e-9)
    with pytest.raises(RuntimeError, match="pred_bboxes must be \\[B, A, 4\\]"):
        F.task_aligned_assign(x.pred_scores, x.pred_bboxes[:, :5], x.anchor_points, x.gt_labels, x.gt_bboxes,
                              x.pad_gt_mask, 3, 13, 1.0, 6.0, 1e-9)
