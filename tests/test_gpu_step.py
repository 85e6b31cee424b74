"""The train step on a GPU: CUDA-graph replay against eager, and no host sync per step.

- A step captured in a CUDA graph (the whole step: forward, loss, backward, SGD, EMA,
  loss accumulation) and replayed must train exactly like the eager step: same losses,
  weights, momentum and EMA after a few steps on *different* batches with a *different*
  learning rate each step (a graph that replayed stale inputs, a baked-in LR, grads not
  zeroed in the graph or a skipped EMA update would all show here).
- The compiled step in CUDA graphs at the benchmark's configuration (PPYOLOE-s, 640,
  bf16, batch 64: the graph bench/throughput.py times) must train like eager bf16 within
  bf16 noise, and not recompile after warm-up.
- Under ``torch.cuda.set_sync_debug_mode("error")`` an eager step and a graph replay
  must not synchronise with the host (no ``.item()``, ``nonzero``, boolean indexing or
  device-to-host copy anywhere in model, loss, assigners, optimizer or EMA).
- Graphs of several buckets (2 sizes x 2 loss variants) replayed in alternation each
  train like an eager step, and share one set of ``.grad`` tensors that no bucket's
  warm-up frees (issue 13, item 3).
- The Triton ATSS assigner runs sync-free and inside a capture (its level tables are
  made once per bucket, not copied from the host per call) (item 5).
- After warm-up a bucket it did not capture raises instead of capturing mid-training,
  and a capture is not broken by another thread's CUDA calls, as the loader's are
  (``capture_error_mode="thread_local"``) (item 7).

``bench/gpu_check.sh`` runs this file a second time with ``FASTDET_OPS_BACKEND=triton``.

All are marked ``gpu`` and skipped without CUDA; ``bench/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

import fastdet.ops as ops
from fastdet.engine.optim import CapturableSGD, build_param_groups
from fastdet.engine.step import TrainStep, synthetic_batch
from fastdet.models import build_model
from fastdet.ops import assigners
from fastdet.ops.ema import ModelEMA
from fastdet.ops.synthetic import assign_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LRS = (0.02, 0.005, 0.011)  # a different LR each step: replays must see the new value
# Valid boxes per image in each step's batch: with 4 vs 1 box the loss differs by ~12 %,
# so a graph replaying a stale batch shows in the per-step losses.
BOXES = (4, 1, 16)


def make_step(model, *, compile=False, cuda_graphs=False, amp=None, clip=0.0) -> TrainStep:
    dev = next(model.parameters()).device
    opt = CapturableSGD(build_param_groups(model, 5e-4), lr=LRS[0], momentum=0.9, device=dev)
    ema = ModelEMA(model, decay=0.9998)
    return TrainStep(model, model, opt, ema, dev, amp, clip_grad_norm=clip, compile=compile,
                     cuda_graphs=cuda_graphs)


def batches(b, size, max_boxes, seed=0, device="cuda"):
    """One batch per step, with ``BOXES[k]`` valid boxes per image in batch ``k``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in BOXES:
        batch = synthetic_batch(b, size, size, max_boxes, torch.device(device), gen)
        mask = torch.zeros_like(batch["gt_mask"])
        mask[:, :n] = True
        batch.update(gt_mask=mask, gt_boxes=batch["gt_boxes"] * mask[..., None],
                     gt_labels=batch["gt_labels"] * mask)
        out.append(batch)
    return out


def snapshot(step: TrainStep):
    params = [p.detach().clone() for p in step.model.parameters()]
    momentum = [step.optimizer.state[p]["momentum_buffer"].clone() for p in step.model.parameters()]
    ema = [t.detach().clone() for t in step.ema.module.parameters()]
    return params, momentum, ema, int(step.ema.updates)


def norm(ts) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def rel_diff(a, b, ref) -> float:
    """||a - b|| / ||b - ref|| over all tensors: the disagreement relative to the change."""
    den = norm([y - r for y, r in zip(b, ref)])
    assert den > 0, "the step changed nothing"
    return norm([x - y for x, y in zip(a, b)]) / den


def check_update(step: TrainStep, before, lr: float) -> None:
    """What one step must have done, exactly (fp32 master weights whatever the autocast):
    SGD ``p -= lr * mult * buf`` with this step's LR, and the EMA folded in once with
    ``d = min(decay, (1 + n) / (10 + n))``."""
    p0, _, e0, n0 = before
    p1, buf, e1, n1 = snapshot(step)
    mult = {id(p): g["lr_mult"] for g in step.optimizer.param_groups for p in g["params"]}
    want = [-lr * mult[id(p)] * b for p, b in zip(step.model.parameters(), buf)]
    assert rel_diff([a - b for a, b in zip(p1, p0)], want, [torch.zeros_like(w) for w in want]) < 2e-2
    assert n1 == n0 + 1
    d = min(step.ema.decay, (1 + n0) / (10 + n0))
    assert rel_diff(e1, [d * e + (1 - d) * p for e, p in zip(e0, p1)], e0) < 1e-2


def train(step: TrainStep, data, kw, check: bool = False) -> list[float]:
    losses = []
    for batch, lr in zip(data, LRS):
        step.optimizer.set_lr(lr)
        before = snapshot(step) if check else None
        step(batch, kw)
        losses.append(step.read_losses()["total_loss"])
        if check:
            check_update(step, before, lr)
    return losses


def test_captured_step_trains_like_eager(exact_fp32):
    torch.manual_seed(0)
    model = build_model("ppyoloe", "s", num_classes=80).cuda().train()
    twin = copy.deepcopy(model)
    eager, graphed = make_step(model), make_step(twin, cuda_graphs=True)
    p0, _, e0, _ = snapshot(eager)
    data = batches(4, 160, 16)
    kw = {"static_assigner": True}  # PP-YOLOE's first phase
    le = train(eager, data, kw)
    lg = train(graphed, data, kw, check=True)
    assert len(graphed._graphs) == 1  # captured once, replayed for every step
    assert lg == pytest.approx(le, rel=1e-3)
    pe, me, ee, ne = snapshot(eager)
    pg, mg, eg, ng = snapshot(graphed)
    assert rel_diff(pg, pe, p0) < 1e-2
    assert rel_diff(mg, me, [torch.zeros_like(m) for m in me]) < 1e-2
    assert rel_diff(eg, ee, e0) < 1e-2
    assert ng == ne == len(LRS)


def test_compiled_graph_step_at_benchmark_size_trains_like_eager():
    torch.manual_seed(0)
    model = build_model("ppyoloe", "s", num_classes=80).cuda().train()
    twin = copy.deepcopy(model)
    eager = make_step(model, amp=torch.bfloat16)
    compiled = make_step(twin, compile=True, cuda_graphs=True, amp=torch.bfloat16)
    kw = {"static_assigner": True}  # PP-YOLOE's first phase
    compiled.warmup([(640, 640)], 64, 100, [kw])
    data = batches(64, 640, 100, seed=1)
    le = train(eager, data, kw)
    lc = train(compiled, data, kw, check=True)
    compiled.check_recompiles()
    assert len(compiled._graphs) == 1
    # Fused and eager bf16 kernels round differently (~1e-3 on the loss); a stale batch
    # would be ~12 % off at step 2. Weights are not compared with eager: in bf16 the
    # updates of two correct implementations already differ by tens of percent.
    assert lc == pytest.approx(le, rel=2e-2)


@pytest.mark.parametrize("epoch", [0, 10_000], ids=["static_assigner", "task_aligned"])
def test_eager_step_is_sync_free(epoch):
    torch.manual_seed(0)
    model = build_model("ppyoloe", "s", num_classes=80).cuda().train()
    step = make_step(model, amp=torch.bfloat16, clip=10.0)
    kw = {"static_assigner": epoch < 100}  # PP-YOLOE's phases (static_assigner_epoch 100)
    data = batches(4, 160, 16)
    step(data[0], kw)  # first call: lazy initialisation, extension loading, cuDNN handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, batch in enumerate(data[1:]):
            step.optimizer.set_lr(LRS[i])
            step(batch, kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    losses = step.read_losses()
    assert all(math.isfinite(v) for v in losses.values()), losses


def test_graph_replay_is_sync_free():
    torch.manual_seed(0)
    model = build_model("ppyoloe", "s", num_classes=80).cuda().train()
    step = make_step(model, cuda_graphs=True, amp=torch.bfloat16)
    kw = {"static_assigner": True}  # PP-YOLOE's first phase
    data = batches(4, 160, 16)
    step(data[0], kw)  # capture (synchronises once, by design)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, batch in enumerate(data[1:]):
            step.optimizer.set_lr(LRS[i])
            step(batch, kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.steps_accumulated == 3
    assert all(math.isfinite(v) for v in step.read_losses().values())


def test_graphs_of_several_buckets_replay_in_any_order(exact_fp32):
    """2 sizes x 2 loss variants (ATSS, task-aligned): 4 graphs, captured one after the
    other and then replayed in alternation, each step compared with an eager twin. A
    bucket whose warm-up set the grads to None would free the ``.grad`` tensors the
    graphs captured before it, and replays would then write into freed memory."""
    torch.manual_seed(0)
    model = build_model("ppyoloe", "s", num_classes=80).cuda().train()
    twin = copy.deepcopy(model)
    eager, graphed = make_step(model), make_step(twin, cuda_graphs=True)
    p0, _, e0, _ = snapshot(eager)
    sizes = (128, 160)
    variants = ({"static_assigner": True}, {"static_assigner": False})  # PP-YOLOE's two phases
    assert variants[0] != variants[1]
    # Each bucket twice; the first pass captures (lazily), the second only replays, in
    # another order than the captures were made.
    order = [(s, v) for s in sizes for v in (0, 1)] + [(s, v) for v in (1, 0) for s in sizes]
    gen = torch.Generator().manual_seed(3)
    grad_ptrs = None
    for i, (size, v) in enumerate(order):
        batch = synthetic_batch(4, size, size, 16, torch.device("cuda"), gen)
        lr = LRS[i % len(LRS)]
        for step in (eager, graphed):
            step.optimizer.set_lr(lr)
            step(batch, variants[v])
        if grad_ptrs is None:  # the tensors the first graph captured
            grad_ptrs = [p.grad.data_ptr() for p in graphed.params]
        le, lg = eager.read_losses(), graphed.read_losses()
        for k in le:
            assert lg[k] == pytest.approx(le[k], rel=1e-3, abs=1e-6), (i, size, v, k)
    assert len(graphed._graphs) == 4
    assert [p.grad.data_ptr() for p in graphed.params] == grad_ptrs, "a .grad tensor was replaced"
    pe, me, ee, ne = snapshot(eager)
    pg, mg, eg, ng = snapshot(graphed)
    assert rel_diff(pg, pe, p0) < 1e-2
    assert rel_diff(mg, me, [torch.zeros_like(m) for m in me]) < 1e-2
    assert rel_diff(eg, ee, e0) < 1e-2
    assert ng == ne == len(order)


def test_triton_atss_is_sync_free_and_capturable():
    x = assign_inputs(batch=4, max_boxes=20, num_classes=80, img_size=320, seed=5)
    xc = assign_inputs(batch=4, max_boxes=20, num_classes=80, img_size=320, seed=5, device=torch.device("cuda"))
    want = assigners.atss_assign(*x.atss_args(), 9, x.pred_bboxes)
    with ops.use_backend("triton", "cuda"):
        assert ops.backend_for("atss_assign", "cuda") == "triton"
        ops.atss_assign(*xc.atss_args(), 9, xc.pred_bboxes)  # compiles the kernels, makes the tables
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = ops.atss_assign(*xc.atss_args(), 9, xc.pred_bboxes)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.atss_assign(*xc.atss_args(), 9, xc.pred_bboxes)
        graph.replay()
        torch.cuda.synchronize()
    for got in (eager, captured):
        assert torch.equal(got[0].cpu(), want[0])
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=0, atol=0)
        torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-4, atol=1e-6)


def test_no_capture_after_warm_up_and_captures_survive_other_threads():
    torch.manual_seed(0)
    model = build_model("ppyoloe", "s", num_classes=80).cuda().train()
    kw = {"static_assigner": True}  # PP-YOLOE's first phase

    # Lazy capture (no warm-up yet) while another thread allocates, computes and reads
    # back on the GPU, as DALI's and the loader's threads do.
    step = make_step(model, cuda_graphs=True)
    stop, errors = threading.Event(), []

    def busy():
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    t = torch.randn(512, 512, device="cuda")
                    (t @ t).sum().item()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        step(batches(4, 160, 16)[0], kw)
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    assert len(step._graphs) == 1
    assert all(math.isfinite(v) for v in step.read_losses().values())

    # After warm-up, a bucket it did not cover is refused, not captured mid-training.
    warmed = make_step(copy.deepcopy(model), cuda_graphs=True)
    warmed.warmup([(160, 160)], 4, 16, [kw])
    warmed(batches(4, 160, 16)[0], kw)
    with pytest.raises(RuntimeError, match="was not captured by the warm-up"):
        warmed(batches(4, 192, 16)[0], kw)
    assert len(warmed._graphs) == 1
