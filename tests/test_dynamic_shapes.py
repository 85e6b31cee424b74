"""A dynamic-shape compile of the PP-YOLOE loss is one graph for every image size.

The ATSS op's schema takes ``SymInt[] num_anchors_list`` (``csrc/ops.cpp``) and its Python
wrapper passes symbolic counts through, so a ``mark_dynamic`` compile does not guard on the
per-level anchor counts (``... == 25``) and recompile at each new size (issue 31, item 1).
The head's loss alone (no backbone) keeps the compile to seconds; ``aot_eager`` traces the
same Dynamo graph and guards as inductor.
"""

from __future__ import annotations

import torch
import torch._dynamo
import pytest

from fastdet import registry
from fastdet.config import apply_overrides
from fastdet.engine.step import synthetic_batch
from fastdet.ops import dispatch

SIZES = (64, 96, 128)


def _head_and_feats(size: int, head, gen: torch.Generator):
    """Neck-like features of a ``size`` x ``size`` image, the head's strides order."""
    return [torch.randn(2, conv.in_channels, size // s, size // s, generator=gen)
            for conv, s in zip(head.pred_cls, head.strides)]


@pytest.mark.parametrize("static_assigner", [True, False], ids=["atss", "tal"])
def test_dynamic_compile_of_the_ppyoloe_loss_is_one_graph(static_assigner):
    if static_assigner and dispatch.backend_for("atss_assign", "cpu", compiling=True) == "torch":
        pytest.skip("the C++ extension is not built here: the op under test is not the one dispatched")
    cfg = apply_overrides(registry.get_preset("ppyoloe", "s"), {"model.num_classes": 3})
    torch.manual_seed(0)
    head = registry.build_detector(cfg).head.train()
    ops_seen: set[str] = set()
    graphs = 0

    def backend(gm, example_inputs):
        nonlocal graphs
        graphs += 1
        ops_seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def loss(feats, targets):
        return head.loss(feats, targets, static_assigner=static_assigner)

    compiled = torch.compile(loss, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    for size in SIZES:
        feats = _head_and_feats(size, head, gen)
        for f in feats:
            torch._dynamo.mark_dynamic(f, 2)
            torch._dynamo.mark_dynamic(f, 3)
        batch = synthetic_batch(2, size, size, 6, torch.device("cpu"), gen)
        targets = {k: batch[k] for k in ("gt_boxes", "gt_labels", "gt_mask", "gt_scores")}
        got = compiled(feats, targets)
        want = loss(feats, targets)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{size}: {k}")
    assert graphs == 1, f"{graphs} graphs for sizes {SIZES}: a per-size guard is left"
    if static_assigner:
        assert any("atss_assign" in op for op in ops_seen), sorted(ops_seen)
