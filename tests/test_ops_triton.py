"""The Triton kernels of fastdet.ops against the torch references, in Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before triton is first imported, so the suite's own
process cannot flip it: the one test collected normally re-runs this file in a fresh
pytest subprocess with the variable set, where the kernel tests below are defined.
Inputs are small (the interpreter runs every program in Python).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:

    def test_triton_kernels_under_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"interpreted Triton tests failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
        assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]

else:
    import triton
    import triton.language as tl

    import fastdet.ops as ops
    from fastdet.ops import assigners, reference
    from fastdet.ops.synthetic import assign_inputs, random_boxes
    from fastdet.ops.triton import assign as tassign
    from fastdet.ops.triton import ema as tema

    T = torch.ops.fastdet_triton

    @pytest.fixture(autouse=True)
    def triton_backend():
        with ops.use_backend("triton", "cpu"):
            yield

    def _edge_boxes():
        return torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 5.0, 9.0],
                             [3.0, 3.0, 3.0, 3.0], [10.0, 0.0, 20.0, 10.0], [2.0, 2.0, 8.0, 8.0]])

    @pytest.mark.parametrize("op", ["box_iou", "generalized_box_iou"])
    def test_pairwise(op):
        assert ops.backend_for(op, "cpu") == "triton"
        for a, b in [(random_boxes(37, seed=1), random_boxes(150, seed=2)),
                     (random_boxes(2, 9, seed=3), random_boxes(2, 5, seed=4)), (_edge_boxes(), _edge_boxes())]:
            torch.testing.assert_close(getattr(ops, op)(a, b), getattr(reference, op)(a, b), rtol=0, atol=0)
        a, b = random_boxes(6, seed=5).double(), random_boxes(7, seed=6).double()
        torch.testing.assert_close(getattr(T, op)(a, b, 1e-9), getattr(reference, op)(a, b), rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("op", ["box_iou", "generalized_box_iou"])
    def test_pairwise_public_api_is_differentiable_as_torchvision(op):
        """The Triton kernels have no backward (it raised "no autograd formula"): with a
        gradient wanted the public op gives torchvision's, without one the kernel runs."""
        import torchvision

        a = random_boxes(5, seed=11).double().requires_grad_()
        b = random_boxes(6, seed=12).double().requires_grad_()
        assert torch.autograd.gradcheck(getattr(ops, op), (a, b))
        g = torch.rand(5, 6, dtype=torch.float64)
        got = torch.autograd.grad(getattr(ops, op)(a, b), (a, b), g)
        want = torch.autograd.grad(getattr(torchvision.ops, op)(a, b), (a, b), g)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
        with torch.no_grad():
            out = getattr(ops, op)(a, b)
        torch.testing.assert_close(out, getattr(T, op)(a.detach(), b.detach(), 1e-9), rtol=0, atol=0)

    def test_giou_loss_and_backward():
        e = _edge_boxes()
        for p, t in [(random_boxes(600, seed=7), random_boxes(600, seed=8)), (e, e.flip(0)), (e, e)]:
            p = p.double().requires_grad_()
            t = t.double().requires_grad_()
            got, want = ops.giou_loss(p, t), reference.giou_loss(p, t)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            g = torch.rand_like(want)
            for a, b in zip(torch.autograd.grad(got, (p, t), g), torch.autograd.grad(want, (p, t), g)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        p, t = random_boxes(5, seed=9).double().requires_grad_(), random_boxes(5, seed=10).double().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: T.giou_loss(a, b, 1e-10), (p, t))

    def test_ema_update_pointer_table():
        g = torch.Generator().manual_seed(0)
        shapes = [(32, 3, 3, 3), (32,), (5000,), (7, 5)]
        ema = [torch.randn(s, generator=g) for s in shapes] + [torch.tensor(2), torch.randn(9, dtype=torch.float64)]
        src = [torch.randn(s, generator=g) for s in shapes] + [torch.tensor(7), torch.randn(9).double()]
        ema.append(torch.randn(6))
        src.append(torch.randn(6).half())  # mixed dtypes take the slow path
        cl = torch.channels_last  # dense: the fused kernel reads both in memory order
        ema.append(torch.randn(16, 3, 3, 3, generator=g).to(memory_format=cl))
        src.append(torch.randn(16, 3, 3, 3, generator=g).to(memory_format=cl))
        want = [e.clone(memory_format=torch.preserve_format) for e in ema]
        tema._cache.clear()
        for step, d in enumerate((0.5, 0.9, 0.9998)):
            decay = torch.tensor(d)
            ops.ema_update_(ema, src, decay)
            reference.ema_update_(want, src, decay)
            for a, b in zip(ema, want):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        assert len(tema._cache) == 1  # built once, reused for every step
        assert ema[4].item() == 7

    def test_ema_update_refuses_a_bad_decay_and_other_shapes():
        for d in (1.5, float("nan")):
            with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
                ops.ema_update_([torch.zeros(3)], [torch.ones(3)], d)
        e = [torch.zeros(2, 3)]
        with pytest.raises(ValueError, match=r"tensor 0 has shape \[2, 3\] in the EMA but \[3\] in the model"):
            ops.ema_update_(e, [torch.ones(3)], 0.5)
        assert not e[0].any()

    ASSIGN_CASES = {
        "random": dict(batch=2, max_boxes=5, num_classes=4, img_size=256, valid=[3, 2], seed=0),
        "no_gt_in_one_image": dict(batch=2, max_boxes=4, num_classes=3, img_size=256, valid=[0, 3], seed=2),
        "all_padded": dict(batch=1, max_boxes=3, num_classes=3, img_size=256, valid=[0], seed=3),
    }

    def _assert_assign_equal(got, want, msg):
        assert torch.equal(got[0], want[0]), f"{msg}: labels differ at {(got[0] != want[0]).nonzero()[:5].tolist()}"
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, msg=msg)
        # The interpreter's pow is 2^(p log2 x): a few ulp off torch.pow.
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-6, msg=msg)

    @pytest.mark.parametrize("case", list(ASSIGN_CASES))
    def test_assigners(case):
        x = assign_inputs(**ASSIGN_CASES[case])
        assert ops.backend_for("task_aligned_assign", "cpu") == "triton"
        _assert_assign_equal(ops.task_aligned_assign(*x.tal_args()), assigners.task_aligned_assign(*x.tal_args()),
                             f"tal {case}")
        _assert_assign_equal(ops.atss_assign(*x.atss_args(), 9, x.pred_bboxes),
                             assigners.atss_assign(*x.atss_args(), 9, x.pred_bboxes), f"atss {case}")

    def test_no_gt_slots_is_all_background():
        """M = 0 on the Triton back end, and with topk over its 32 (the reference runs)."""
        import dataclasses

        x = assign_inputs(batch=2, max_boxes=3, num_classes=3, img_size=128, seed=5)
        x = dataclasses.replace(x, gt_labels=x.gt_labels[:, :0], gt_bboxes=x.gt_bboxes[:, :0],
                                pad_gt_mask=x.pad_gt_mask[:, :0])
        B, A, C = x.pred_scores.shape
        for topk in (9, 40):
            for labels, boxes, scores in (ops.task_aligned_assign(*x.tal_args(), topk=topk),
                                          ops.atss_assign(*x.atss_args(), topk, x.pred_bboxes)):
                assert torch.equal(labels, torch.full((B, A), C)) and not boxes.any() and not scores.any()
                assert boxes.shape == (B, A, 4) and scores.shape == (B, A, C)
            gt, iou = ops.simota_assign(*x.simota_args(), topk=topk)
            assert torch.equal(gt, torch.full((B, A), -1)) and torch.equal(iou, torch.zeros(B, A))

    def test_assign_ties_and_duplicates():
        x = assign_inputs(batch=1, max_boxes=4, num_classes=3, img_size=256, valid=[4], seed=4)
        x.pred_bboxes[0] = torch.tensor([60.0, 60.0, 140.0, 150.0])  # every metric ties
        x.pred_scores[0] = 0.5
        x.gt_bboxes[0, 1] = x.gt_bboxes[0, 0]  # several claimants with equal IoU
        x.gt_bboxes[0, 2] = torch.tensor([100.0, 40.0, 100.0, 90.0])  # zero width
        _assert_assign_equal(ops.task_aligned_assign(*x.tal_args()), assigners.task_aligned_assign(*x.tal_args()),
                             "tal ties")

    def test_topk_merge_sorting_network_matches_rounds():
        """The GPU path (tl.topk sorting network) and the interpreter's path (rounds of max)."""

        @triton.jit
        def kernel(keys_ptr, best_ptr, out_ptr, SORT: tl.constexpr):
            keys = tl.load(keys_ptr + tl.arange(0, 64))
            best = tl.load(best_ptr + tl.arange(0, 16))
            tl.store(out_ptr + tl.arange(0, 16), tassign._merge_topk(best, keys, 16, SORT))

        g = torch.Generator().manual_seed(0)
        keys = torch.randint(0, 2**40, (64,), generator=g)
        keys[:5] = -1
        best = torch.full((16,), -1, dtype=torch.int64)
        best[:3] = torch.randint(0, 2**40, (3,), generator=g)
        outs = []
        for sort in (True, False):
            out = torch.empty(16, dtype=torch.int64)
            kernel[(1,)](keys, best, out, SORT=sort)
            outs.append(out)
        want = torch.cat([keys, best]).topk(16).values
        assert torch.equal(outs[0], want) and torch.equal(outs[1], want)

    def test_compiled_step_has_no_graph_break():
        x = assign_inputs(batch=1, max_boxes=3, num_classes=3, img_size=128, valid=[2], seed=6)
        pred = x.pred_bboxes.clone().requires_grad_()
        ema, src = [torch.zeros(8)], [torch.ones(8)]

        def step(pred):
            labels, boxes, scores = ops.task_aligned_assign(x.pred_scores, pred.detach(), x.anchor_points,
                                                            x.gt_labels, x.gt_bboxes, x.pad_gt_mask, 3)
            fg = (labels != 3).float()
            loss = (ops.giou_loss(pred, torch.where(fg[..., None] > 0, boxes, pred.detach())) * fg).sum()
            ops.ema_update_(ema, src, torch.tensor(0.5))
            return loss + ops.box_iou(x.gt_bboxes[0], pred[0].detach()).sum()

        explained = torch._dynamo.explain(step)(pred)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        eager = step(pred)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(pred)
        torch.testing.assert_close(compiled, eager)
        compiled.backward()
        assert pred.grad is not None and torch.isfinite(pred.grad).all()
