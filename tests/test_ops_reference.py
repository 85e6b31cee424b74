"""The torch back end (``fastdet/ops/reference.py``, ``assigners.py``) in half precision.

The kernels compute half and bfloat16 inputs in float32 and return the input's dtype; the
references must too: the area of a box over 256 px a side is past fp16's largest value
(65504), ``eps`` underflows to 0, and the IoUs came out NaN or the labels different. Each
test compares the torch back end on half inputs with the float32 computation of the same
(half-rounded) inputs, cast, and with the C++ kernels.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fastdet.ops as ops
from fastdet.ops.synthetic import assign_inputs, random_boxes

HALF = [torch.float16, torch.bfloat16]


def _on(backend: str, fn, *args, **kw):
    with ops.use_backend(backend, "cpu"):
        return fn(*args, **kw)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", ["box_iou", "generalized_box_iou"])
def test_pairwise_in_half_precision(op, dtype):
    a = torch.tensor([[0.0, 0.0, 300.0, 300.0], [10.0, 10.0, 50.0, 50.0]])
    b = torch.tensor([[0.0, 0.0, 300.0, 300.0], [20.0, 20.0, 40.0, 60.0]])
    fn = getattr(ops, op)
    got = _on("torch", fn, a.to(dtype), b.to(dtype))
    assert got.dtype == dtype and torch.isfinite(got).all(), got
    want = fn(a, b)  # the exact inputs: every corner is representable in both dtypes
    torch.testing.assert_close(got, want.to(dtype))
    if op == "box_iou":  # the values the user saw from cpp, triton and torchvision (torch gave nan and 0)
        torch.testing.assert_close(got.float(), torch.tensor([[1.0, 0.0089], [0.0178, 1 / 3]]), atol=2e-3, rtol=0)
    a, b = random_boxes(2, 9, size=800, seed=1).to(dtype), random_boxes(2, 7, size=800, seed=2).to(dtype)
    got = _on("torch", fn, a, b)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _on("torch", fn, a.float(), b.float()).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(got, _on("cpp", fn, a, b), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF)
def test_giou_loss_in_half_precision(dtype):
    pred = torch.tensor([[0.0, 0.0, 3e4, 3e4], [5.0, 5.0, 5.0, 5.0], [10.0, 10.0, 500.0, 400.0]])
    target = torch.tensor([[0.0, 0.0, 3e4, 2e4], [5.0, 5.0, 5.0, 5.0], [20.0, 0.0, 480.0, 410.0]])
    p = pred.to(dtype).requires_grad_()
    t = target.to(dtype)
    got = _on("torch", ops.giou_loss, p, t)
    assert got.dtype == dtype and torch.isfinite(got).all(), got
    want = _on("torch", ops.giou_loss, p.detach().float(), t.float())
    torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(got, _on("cpp", ops.giou_loss, p, t), rtol=0, atol=0)
    got.sum().backward()
    assert p.grad.dtype == dtype and torch.isfinite(p.grad).all(), p.grad


def _half_inputs(dtype, **kw):
    """Assigner inputs on a 512 px image (boxes of up to 256 px a side: areas past 65504),
    rounded to ``dtype``; the float32 copy holds the same values."""
    x = assign_inputs(batch=2, max_boxes=8, num_classes=4, img_size=512, seed=3, **kw)
    floats = ("pred_scores", "pred_bboxes", "anchor_points", "anchors", "gt_bboxes", "pad_gt_mask")
    half = dataclasses.replace(x, **{f: getattr(x, f).to(dtype) for f in floats})
    return half, dataclasses.replace(half, **{f: getattr(half, f).float() for f in floats})


def _assert_same_assignment(got, want, dtype, msg):
    assert torch.equal(got[0], want[0]), f"{msg}: labels differ at {(got[0] != want[0]).nonzero()[:5].tolist()}"
    assert got[1].dtype == dtype and got[2].dtype == dtype, msg
    torch.testing.assert_close(got[1], want[1].to(dtype), rtol=0, atol=0, msg=msg)
    torch.testing.assert_close(got[2], want[2].to(dtype), msg=msg)


@pytest.mark.parametrize("dtype", HALF)
def test_assigners_in_half_precision(dtype):
    half, f32 = _half_inputs(dtype)
    tal = _on("torch", ops.task_aligned_assign, *half.tal_args())
    assert (tal[0] != half.num_classes).sum() > 20  # real assignments
    _assert_same_assignment(tal, _on("torch", ops.task_aligned_assign, *f32.tal_args()), dtype, "tal")
    _assert_same_assignment(tal, _on("cpp", ops.task_aligned_assign, *half.tal_args()), dtype, "tal vs cpp")
    atss = _on("torch", ops.atss_assign, *half.atss_args(), 9, half.pred_bboxes)
    assert (atss[0] != half.num_classes).sum() > 20
    _assert_same_assignment(atss, _on("torch", ops.atss_assign, *f32.atss_args(), 9, f32.pred_bboxes), dtype, "atss")
    _assert_same_assignment(atss, _on("cpp", ops.atss_assign, *half.atss_args(), 9, half.pred_bboxes), dtype,
                            "atss vs cpp")
