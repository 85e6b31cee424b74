"""The Triton and CUDA kernels on a GPU against the torch references (skipped without one).

The assigner references run on the CPU copies of the inputs: torch.topk's order among
equal values differs between devices, the kernels' (lower index first) matches the CPU's.
"""

from __future__ import annotations

import pytest
import torch

import fastdet.ops as ops
from fastdet.ops import _ext, assigners, reference
from fastdet.ops.synthetic import assign_inputs, random_boxes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = ["triton", "cuda"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "cuda" and not (_ext.load() and _ext.has_cuda_kernels()):
        pytest.fail(f"the CUDA kernels did not build: {_ext.error()}")
    with ops.use_backend(request.param, "cuda"):
        assert ops.backend_for("box_iou", "cuda") == request.param
        yield request.param


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("op", ["box_iou", "generalized_box_iou"])
def test_pairwise(backend, op):
    for a, b in [(random_boxes(300, seed=1), random_boxes(1000, seed=2)),
                 (random_boxes(8, 100, seed=3), random_boxes(8, 8400, seed=4))]:
        got = getattr(ops, op)(a.cuda(), b.cuda())
        torch.testing.assert_close(got.cpu(), getattr(reference, op)(a, b), rtol=1e-6, atol=1e-6)
        half = getattr(ops, op)(a.cuda().half(), b.cuda().half())
        assert half.dtype == torch.float16


def test_giou_loss(backend):
    p = random_boxes(64, 8400, seed=5).cuda().requires_grad_()
    t = random_boxes(64, 8400, seed=6).cuda()
    got = ops.giou_loss(p, t)
    want = reference.giou_loss(p, t)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.rand_like(want)
    (ga,) = torch.autograd.grad(got, p, g)
    (gb,) = torch.autograd.grad(want, p, g)
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)
    pd = random_boxes(6, seed=7).cuda().double().requires_grad_()
    td = random_boxes(6, seed=8).cuda().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ops.giou_loss(a, b), (pd, td))


def _ema_lists(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(256, 128, 3, 3), (256,), (100003,), (3,), (64, 64)]
    ema = [torch.randn(s, generator=g).cuda() for s in shapes] + [torch.tensor(3).cuda(), torch.randn(7).cuda().half()]
    src = [torch.randn(s, generator=g).cuda() for s in shapes] + [torch.tensor(9).cuda(), torch.randn(7).cuda().half()]
    return ema, src


def test_ema_update_in_a_cuda_graph(backend):
    ema, src = _ema_lists()
    want = [e.clone() for e in ema]
    decay = torch.tensor(0.5, device="cuda")
    ops.ema_update_(ema, src, decay)  # warm-up: builds the Triton pointer table outside capture
    reference.ema_update_(want, src, decay)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.ema_update_(ema, src, decay)
    for d in (0.9, 0.9998):
        decay.fill_(d)
        graph.replay()
        reference.ema_update_(want, src, decay)
    torch.cuda.synchronize()
    for a, b in zip(ema, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ema[5].item() == 9


CASES = {
    "production_slice": dict(batch=8, max_boxes=100, num_classes=80, img_size=640, seed=0),
    "no_gt_in_one_image": dict(batch=3, max_boxes=6, num_classes=4, img_size=256, valid=[0, 6, 2], seed=2),
    "all_padded": dict(batch=2, max_boxes=5, num_classes=4, img_size=256, valid=[0, 0], seed=3),
}


def _check(got, want, msg):
    assert torch.equal(got[0].cpu(), want[0]), msg
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=0, atol=0, msg=msg)
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-4, atol=1e-6, msg=msg)


@pytest.mark.parametrize("case", list(CASES))
def test_assigners(backend, case):
    x = assign_inputs(**CASES[case])
    xc = assign_inputs(**CASES[case], device=torch.device("cuda"))
    _check(ops.task_aligned_assign(*xc.tal_args()), assigners.task_aligned_assign(*x.tal_args()), f"tal {case}")
    _check(ops.atss_assign(*xc.atss_args(), 9, xc.pred_bboxes), assigners.atss_assign(*x.atss_args(), 9, x.pred_bboxes),
           f"atss {case}")


def test_compiled_step_with_cuda_kernels(backend):
    x = assign_inputs(batch=4, max_boxes=20, num_classes=80, img_size=320, seed=9, device=torch.device("cuda"))
    pred = x.pred_bboxes.clone().requires_grad_()

    def step(pred):
        labels, boxes, scores = ops.task_aligned_assign(x.pred_scores, pred.detach(), x.anchor_points, x.gt_labels,
                                                        x.gt_bboxes, x.pad_gt_mask, 80)
        fg = labels != 80
        safe = torch.where(fg[..., None], boxes, pred.detach())
        return (ops.giou_loss(pred, safe) * scores.sum(-1)).sum()

    explained = torch._dynamo.explain(step)(pred)
    assert explained.graph_break_count == 0
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(pred), step(pred), rtol=1e-4, atol=1e-4)
