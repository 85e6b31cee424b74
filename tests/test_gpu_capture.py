"""Every family's whole step captured in a CUDA graph and replayed against eager (issue 24).

For each family (its smallest model, 4 classes, batch 2, the recipe's optimizer, EMA and
clipping): every loss variant of its schedule at two tiny square sizes, or at each
keep-ratio canvas for FCOS, is captured by ``TrainStep.warmup`` (the trainer's
``--cuda-graphs``); then each bucket's graph is replayed on fresh batches with a new LR
under ``torch.cuda.set_sync_debug_mode("error")``, next to an eager twin under the same
mode, and both must give the same losses every step and the same weights at the end.
The random draws inside a step (PP-YOLO's DropBlock) come from the CUDA generator, which
is reseeded before each eager step and each replay, so the twins draw the same masks: a
graph that baked its random numbers in at capture would show here.

Marked ``gpu`` and skipped without CUDA; seconds each on a GPU. ``bench/gpu_check.sh``
runs them in its ``tests_capture`` part.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from capture_cases import FAMILIES, batch_for, case, make_step  # tests/ is on sys.path (rootdir conftest)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LRS = (0.01, 0.003, 0.007)
SQUARES = (64, 96)  # two sizes of a multi-size family; a keep-ratio family uses its canvases at the first


def buckets(arch: str):
    first = case(arch, SQUARES[0])
    if len(first.canvases) > 1:  # keep-ratio: landscape, portrait, square
        return first, first.buckets()
    return first, [b for s in SQUARES for b in case(arch, s).buckets()]


def params(step) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.model.parameters()]


def rel(a, b, ref) -> float:
    num = math.sqrt(sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b)))
    den = math.sqrt(sum(float((y - r).double().pow(2).sum()) for y, r in zip(b, ref)))
    assert den > 0, "the steps changed nothing"
    return num / den


@pytest.mark.parametrize("arch", FAMILIES)
def test_whole_step_is_captured_and_replays_like_eager(arch, exact_fp32):
    dev = torch.device("cuda")
    c, bucket_list = buckets(arch)
    model = make_step(c, dev).model
    eager = make_step(c, dev, model=model)
    graphed = make_step(c, dev, model=copy.deepcopy(model), cuda_graphs=True)
    p0 = params(eager)
    sizes = list(dict.fromkeys(hw for hw, _ in bucket_list))
    variants = list({tuple(sorted(kw.items())): kw for _, kw in bucket_list}.values())
    # Warm-up (cuDNN autotuning, lazy tables, the captures) leaves both states unchanged.
    eager.warmup(sizes, 2, 8, variants)
    graphed.warmup(sizes, 2, 8, variants)
    assert len(graphed._graphs) == len(sizes) * len(variants)
    data = [batch_for(hw, dev, seed=10 + i, boxes=1 + i % 4) for i, (hw, _) in enumerate(bucket_list)]
    torch.cuda.synchronize()
    for i, ((hw, kw), batch) in enumerate(zip(bucket_list, data)):
        lr = LRS[i % len(LRS)]
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in (eager, graphed):
                step.optimizer.set_lr(lr)
                torch.cuda.manual_seed(1000 + i)  # the same DropBlock masks in both
                step(batch, kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        le, lg = eager.read_losses(), graphed.read_losses()
        assert le.keys() == lg.keys()
        for k in le:
            assert math.isfinite(le[k]), (arch, hw, kw, k)
            assert lg[k] == pytest.approx(le[k], rel=1e-3, abs=1e-5), (arch, hw, kw, k, le, lg)
    assert len(graphed._graphs) == len(sizes) * len(variants)  # nothing captured after warm-up
    assert rel(params(graphed), params(eager), p0) < 1e-2
    if eager.ema is not None:
        ee = [t.detach() for t in eager.ema.module.parameters()]
        eg = [t.detach() for t in graphed.ema.module.parameters()]
        assert max(float((a - b).abs().max()) for a, b in zip(ee, eg)) < 1e-4
        assert int(eager.ema.updates) == int(graphed.ema.updates) == len(bucket_list)
