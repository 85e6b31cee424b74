"""A training-style step using every op traces into one graph with no graph break, on
the C++ back end and on the torch reference one; with the C++ kernels it also compiles
through inductor (``fullgraph=True``, forward and backward) and matches eager. (Compiling
the reference assigners with inductor is the PP-YOLOE tests' business.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastdet.ops as ops
from fastdet.ops import _ext
from fastdet.ops.ema import ModelEMA
from fastdet.ops.synthetic import assign_inputs


def _make_step(x, model, ema, static: bool):
    C = x.num_classes

    def step(pred):
        if static:
            labels, boxes, scores = ops.atss_assign(*x.atss_args(), 9, pred.detach())
        else:
            labels, boxes, scores = ops.task_aligned_assign(x.pred_scores, pred.detach(), x.anchor_points,
                                                            x.gt_labels, x.gt_bboxes, x.pad_gt_mask, C)
        fg = labels != C
        weight = scores.sum(-1) * fg
        safe = torch.where(fg[..., None], boxes, pred.detach())
        loss = (ops.giou_loss(pred, safe) * weight).sum() / weight.sum().clamp(min=1.0)
        overlap = ops.generalized_box_iou(x.gt_bboxes, pred.detach()).amax(-1).mean()
        ema.update(model)
        return loss + overlap

    return step


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_compiled_step_one_graph_matches_eager(backend):
    if backend == "cpp" and not _ext.load():
        pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
    torch._dynamo.reset()
    x = assign_inputs(batch=2, max_boxes=4, num_classes=3, img_size=128, valid=[3, 1], seed=0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    ema = ModelEMA(model, decay=0.9, kind="threshold")
    with ops.use_backend(backend, "cpu"):
        for static in (False, True):
            step = _make_step(x, model, ema, static)
            explained = torch._dynamo.explain(step)(x.pred_bboxes.clone().requires_grad_())
            assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        if backend == "torch":
            return
        step = _make_step(x, model, ema, static=False)
        pred_c = x.pred_bboxes.clone().requires_grad_()
        pred_e = x.pred_bboxes.clone().requires_grad_()
        compiled = torch.compile(step, fullgraph=True)
        loss_c = compiled(pred_c)
        loss_e = step(pred_e)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        loss_c.backward()
        loss_e.backward()
        torch.testing.assert_close(pred_c.grad, pred_e.grad, rtol=1e-5, atol=1e-7)
        # The EMA decay changes every step but is a tensor: no recompilation.
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(3):
            compiled(pred_c)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
