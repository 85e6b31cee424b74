"""Benchmarks of the fastdet.ops kernels against the best library equivalent and against
the same torch reference compiled by inductor.

    python bench/kernels.py --device cpu            # C++ kernels, a few minutes on 2 cores
    python bench/kernels.py --device cuda --json bench/results/kernels_h200.json
    python bench/kernels.py --quick                 # small sizes, for a smoke run

For each op it times (median of timed repetitions after a warm-up; compilation is part
of the warm-up) the library baseline, the torch reference in eager mode, the reference
compiled by inductor (``torch.compile(fullgraph=True)``; foreach updates become combo
kernels), and every fastdet kernel back end that runs on the device (``cpp`` on the CPU,
``triton`` and ``cuda`` on a GPU). It reports milliseconds, achieved GB/s (from the bytes
the op must read and write at least), the speed-up over the library baseline and over
the compiled reference, and for the assigners the peak memory of a call. The verdict of
each op says which variant is fastest and whether a custom kernel loses to the compiled
reference, in which case that reference is the faster path the dispatch should default
to (``fastdet.ops.dispatch.DEFAULTS``).

Sizes (production: B=64 images, M=100 GT slots, A=8400 anchors at 640 px, C=80 classes;
EMA over PP-YOLOE-s, ~8.1 M values in ~500 tensors; FCOS: B=16, M=100, A=22400 points at
800x1344, and focal loss over [B, A, 80]): ``production`` on CUDA, ``cpu`` (B=8 for the
assigners and IoU, B=2 for the focal loss, FCOS assignment at full size) on the CPU,
``quick`` with ``--quick``.

SimOTA is also timed against a per-image loop rendering of its semantics written like
Megvii's ``get_assignments`` (boolean indexing, per-GT ``topk``, a host sync per image),
the way YOLOX's own loss runs it; it runs at the production size on the CPU too.
``simota_step`` times it inside a YOLOX-s training step (the CPU size: 320 px, batch 8,
30 boxes per image), where each row also gets its share of the step:

    python bench/kernels.py --device cpu --only simota_step

    python bench/kernels.py --device cpu --threads 1 --only fcos focal   # FCOS's ops
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import gc
import json
import math
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fastdet.ops import _ext, assigners, dispatch, reference, simota  # noqa: E402
from fastdet.ops.synthetic import assign_inputs, ema_tensor_shapes, random_boxes  # noqa: E402

SIZES = {
    "production": dict(iou=(64, 100, 8400), giou=(64, 8400), assign=(64, 100, 640, 80), yolo=(64, 50, 608, 80),
                       fcos=(16, 100, 800, 1344), focal=(16, 800, 1344, 80),
                       simota=(64, 100, 640, 80), simota_step=(64, 100, 640)),
    "cpu": dict(iou=(8, 100, 8400), giou=(64, 8400), assign=(8, 100, 640, 80), yolo=(8, 50, 608, 80),
                fcos=(16, 100, 800, 1344), focal=(2, 800, 1344, 80), simota=(64, 100, 640, 80),
                simota_step=(8, 30, 320)),
    "quick": dict(iou=(2, 20, 2100), giou=(4, 2100), assign=(2, 20, 320, 80), yolo=(2, 20, 320, 80),
                  fcos=(2, 20, 256, 320), focal=(2, 256, 320, 80), simota=(2, 20, 320, 80),
                  simota_step=(2, 10, 128)),
}


# ----------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int, budget_s: float) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls (fewer if ``budget_s`` runs out)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


def peak_mb(fn: Callable[[], Any], device: torch.device) -> Optional[float]:
    """Peak memory of one call above what was allocated before it.

    CUDA: the caching allocator's peak. CPU: the peak of glibc's bytes in use
    (``mallinfo2``: heap chunks plus mmapped blocks, where torch's CPU tensors live),
    sampled every 0.2 ms by a thread while the call runs (torch ops release the GIL);
    None where mallinfo2 is not available.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    in_use = _malloc_in_use()
    if in_use is None:
        return None
    base = in_use()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(0.0002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out = fn()
    peak[0] = max(peak[0], in_use())
    done.set()
    t.join()
    del out
    return (peak[0] - base) / 2**20


def _malloc_in_use() -> Optional[Callable[[], int]]:
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        f = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = MallInfo2

    def in_use() -> int:
        m = f()
        return m.uordblks + m.hblkhd

    return in_use


# ----------------------------------------------------------------------------- benches


@dataclass
class Variant:
    name: str
    fn: Callable[[], Any]
    # "library" | "reference" | "compiled" | "kernel" | "loop"; in a step bench also "step",
    # "loop_step" (whole training steps) and "dispatch" (what the step's op call chooses)
    kind: str
    peak: bool = False


@dataclass
class Bench:
    op: str
    shape: str
    bytes: int  # what the op must read and write at least
    variants: list[Variant] = field(default_factory=list)


def kernel_backends(device: torch.device) -> list[str]:
    names = []
    for name in ("cpp",) if device.type == "cpu" else ("triton", "cuda"):
        if dispatch.available(name, device.type):
            names.append(name)
    return names


def _ns(backend: str):
    return torch.ops.fastdet_triton if backend == "triton" else torch.ops.fastdet


def _compiled(fn):
    return torch.compile(fn, fullgraph=True)


def bench_iou(device, size) -> list[Bench]:
    import torchvision

    B, N, M = size
    a, b = random_boxes(B, N, seed=1, device=device), random_boxes(B, M, seed=2, device=device)
    nbytes = (a.numel() + b.numel() + B * N * M) * 4
    out = []
    for op, tv in (("box_iou", torchvision.ops.box_iou), ("generalized_box_iou", torchvision.ops.generalized_box_iou)):
        ref = getattr(reference, op)
        bench = Bench(op, f"[{B},{N},4] x [{B},{M},4]", nbytes)
        bench.variants.append(Variant("torchvision (vmap)", lambda tv=tv: torch.vmap(tv)(a, b), "library"))
        bench.variants.append(Variant("reference", lambda ref=ref: ref(a, b), "reference"))
        cref = _compiled(ref)
        bench.variants.append(Variant("reference compiled", lambda cref=cref: cref(a, b), "compiled"))
        for be in kernel_backends(device):
            kop = getattr(_ns(be), op)
            bench.variants.append(Variant(f"fastdet {be}", lambda kop=kop: kop(a, b, 1e-9), "kernel"))
        out.append(bench)
    return out


def bench_giou_loss(device, size) -> list[Bench]:
    B, A = size
    p = random_boxes(B, A, seed=3, device=device).requires_grad_()
    t = random_boxes(B, A, seed=4, device=device)
    n = B * A
    # forward reads 2 x 16 B and writes 4 B per pair; backward reads 2 x 16 + 4, writes 2 x 16
    nbytes = n * (36 + 68)
    bench = Bench("giou_loss fwd+bwd", f"[{B},{A},4] pairs", nbytes)
    grad = torch.ones(B, A, device=device)

    def run(fn):
        def go():
            loss = fn(p, t)
            (gp,) = torch.autograd.grad(loss, p, grad)
            return gp
        return go

    bench.variants.append(Variant("reference (autograd)", run(reference.giou_loss), "library"))
    bench.variants.append(Variant("reference compiled", run(_compiled(reference.giou_loss)), "compiled"))
    for be in kernel_backends(device):
        kop = _ns(be).giou_loss
        bench.variants.append(Variant(f"fastdet {be}", run(lambda x, y, kop=kop: kop(x, y, 1e-10)), "kernel"))
    return [bench]


def ema_tensors(device) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    """PP-YOLOE-s parameters + buffers (the model itself if it builds, else its shapes)."""
    try:
        from fastdet.models import build_model

        model = build_model("ppyoloe", "s", 80).to(device)
        src = [p.detach() for p in model.parameters()] + list(model.buffers())
        what = "PP-YOLOE-s model"
    except Exception as e:  # noqa: BLE001 - any failure: fall back to the shapes
        print(f"(PP-YOLOE-s did not build: {type(e).__name__}; using its tensor shapes)", file=sys.stderr)
        src = [torch.randn(s, device=device) if s else torch.tensor(3, device=device) for s in ema_tensor_shapes()]
        what = "PP-YOLOE-s shapes"
    src = [s.clone() for s in src]
    ema = [s.clone() for s in src]
    return ema, src, what


def bench_ema(device) -> list[Bench]:
    ema, src, what = ema_tensors(device)
    fe = [e for e in ema if e.is_floating_point()]
    fs = [s for e, s in zip(ema, src) if e.is_floating_point()]
    ie = [e for e in ema if not e.is_floating_point()]
    is_ = [s for e, s in zip(ema, src) if not e.is_floating_point()]
    values = sum(e.numel() for e in fe)
    nbytes = 3 * sum(e.numel() * e.element_size() for e in fe) + 2 * sum(e.numel() * e.element_size() for e in ie)
    decay = torch.tensor(0.9998, device=device)
    bench = Bench("ema_update_", f"{what}: {values / 1e6:.2f} M values in {len(ema)} tensors", nbytes)
    flat_src = torch.randn(nbytes // 8, device=device)
    flat_dst = torch.empty_like(flat_src)
    # Copy bandwidth: one contiguous copy of as many bytes as the update moves.
    bench.variants.append(Variant("copy (bandwidth ceiling)", lambda: flat_dst.copy_(flat_src), "ceiling"))

    def foreach():
        torch._foreach_lerp_(fe, fs, 1 - 0.9998)
        if ie:
            torch._foreach_copy_(ie, is_)

    bench.variants.append(Variant("torch._foreach_lerp_", foreach, "library"))
    bench.variants.append(Variant("reference (per tensor)", lambda: reference.ema_update_(ema, src, decay), "reference"))
    cref = _compiled(reference.ema_update_)
    bench.variants.append(Variant("reference compiled", lambda: cref(ema, src, decay), "compiled"))
    for be in kernel_backends(device):
        kop = _ns(be).ema_update_
        bench.variants.append(Variant(f"fastdet {be}", lambda kop=kop: kop(ema, src, decay), "kernel"))
    return [bench]


def bench_assign(device, size) -> list[Bench]:
    B, M, img, C = size
    x = assign_inputs(B, M, C, img, seed=0, device=device)
    A = x.anchor_points.shape[0]
    # Outputs (labels, boxes, scores) plus the predictions read: the least an assigner moves.
    nbytes = B * A * (8 + 16 + 4 * C) + B * A * (16 + 4 * C)
    shape = f"B={B} M={M} A={A} C={C} ({int(x.pad_gt_mask.sum())} real GTs)"
    out = []
    tal_args = x.tal_args()
    atss_args = (*x.atss_args(), 9, x.pred_bboxes)
    for op, ref, args in (("task_aligned_assign", assigners.task_aligned_assign, tal_args),
                          ("atss_assign", assigners.atss_assign, atss_args)):
        bench = Bench(op, shape, nbytes)
        bench.variants.append(Variant("reference", lambda ref=ref, args=args: ref(*args), "library", peak=True))
        cref = _compiled(ref)
        bench.variants.append(Variant("reference compiled", lambda cref=cref, args=args: cref(*args), "compiled",
                                      peak=True))
        for be in kernel_backends(device):
            kop = getattr(_ns(be), op)
            if op == "task_aligned_assign":
                call = lambda kop=kop: kop(*tal_args[:6], C, 13, 1.0, 6.0, 1e-9)  # noqa: E731
            else:
                call = lambda kop=kop: kop(x.anchors, x.num_anchors_list, x.gt_labels, x.gt_bboxes,  # noqa: E731
                                           x.pad_gt_mask, x.pred_bboxes, C, C, 9, 1e-9)
            bench.variants.append(Variant(f"fastdet {be}", call, "kernel", peak=True))
        out.append(bench)
    return out


def bench_yolo_targets(device, size) -> list[Bench]:
    """PP-YOLO R50's grid targets (3 levels, 9 anchors) from B images of M padded boxes."""
    from fastdet.models.ppyolo import SIZES as PPYOLO
    from fastdet.ops.yolo import anchor_tables, yolo_targets_reference

    B, M, img, C = size
    p = PPYOLO["r50vd_dcn"]
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(B, M, 2, generator=g) * img
    wh = torch.rand(B, M, 2, generator=g) ** 2 * img * 0.5 + 2
    boxes = torch.cat([xy - wh / 2, xy + wh / 2], -1).clamp(0, img).to(device)
    labels = torch.randint(0, C, (B, M), generator=g).to(device)
    mask = (torch.rand(B, M, generator=g) < 0.6).to(device)
    scores = mask.float()
    args = (boxes, labels, mask, scores, p.anchors, p.anchor_masks, p.strides, (img, img), C)
    cells = sum(3 * (img // s) ** 2 for s in p.strides)
    bench = Bench("yolo_targets", f"B={B} M={M} {img}px C={C} ({int(mask.sum())} real GTs)",
                  B * M * 40 + B * cells * (6 + C) * 4)
    bench.variants.append(Variant("reference", lambda: yolo_targets_reference(*args), "library", peak=True))
    cref = _compiled(yolo_targets_reference)
    bench.variants.append(Variant("reference compiled", lambda: cref(*args), "compiled", peak=True))
    level, slot = anchor_tables(len(p.anchors), p.anchor_masks)
    flat = [float(v) for a in p.anchors for v in a]
    for be in kernel_backends(device):
        if be == "triton":
            continue  # none: the op is a sliver of a step (see fastdet/ops/yolo.py)
        bench.variants.append(Variant(f"fastdet {be}", lambda: torch.ops.fastdet.yolo_targets(
            boxes, labels, mask, scores, flat, level, slot, list(p.strides), img, img, C), "kernel", peak=True))
    return [bench]


def fcos_inputs(B: int, M: int, h: int, w: int, seed: int = 0, device=None):
    """FCOS points of an ``h`` x ``w`` input and ``M`` padded GT slots per image, about 3/4
    of them real, of every scale (8 to 800 px) so that each level gets positives."""
    from fastdet.models.fcos import feature_shapes, level_points

    points, strides, ranges = level_points(feature_shapes(h, w))
    g = torch.Generator().manual_seed(seed)
    wh = 8 * torch.exp(torch.rand(B, M, 2, generator=g) * math.log(100))
    ctr = torch.rand(B, M, 2, generator=g) * torch.tensor([w, h])
    boxes = torch.cat([ctr - wh / 2, ctr + wh / 2], -1).clamp(min=0).minimum(torch.tensor([w, h, w, h]))
    labels = torch.randint(0, 80, (B, M), generator=g)
    mask = torch.rand(B, M, generator=g) < 0.75
    return tuple(x.to(device) for x in (points, strides, ranges, boxes, labels, mask))


def bench_fcos_assign(device, size) -> list[Bench]:
    from fastdet.ops import fcos as fcos_ref

    B, M, h, w = size
    args = fcos_inputs(B, M, h, w, device=device)
    A = args[0].shape[0]
    # Reads points, strides, ranges and the GT; writes two [B, A] int64.
    nbytes = A * 20 + B * M * (16 + 8 + 1) + B * A * 16
    bench = Bench("fcos_assign", f"B={B} M={M} A={A} ({h}x{w}, {int(args[5].sum())} real GTs)", nbytes)
    ref = fcos_ref.fcos_assign
    bench.variants.append(Variant("reference", lambda: ref(*args), "library", peak=True))
    cref = _compiled(ref)
    bench.variants.append(Variant("reference compiled", lambda: cref(*args), "compiled", peak=True))
    for be in kernel_backends(device):
        kop = _ns(be).fcos_assign
        bench.variants.append(Variant(f"fastdet {be}", lambda kop=kop: kop(*args, 1.5), "kernel", peak=True))
    return [bench]


def bench_focal(device, size) -> list[Bench]:
    """Forward + backward of the summed sigmoid focal loss over FCOS's [B, A, C] logits:
    torchvision's (FCOS's default) against fastdet.losses' one-node form, eager and compiled."""
    import torchvision

    from fastdet.losses import sigmoid_focal_loss
    from fastdet.models.fcos import feature_shapes

    B, h, w, C = size
    A = sum(fh * fw for fh, fw in feature_shapes(h, w))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, A, C, generator=g).to(device).requires_grad_()
    t = (torch.rand(B, A, C, generator=g) < 0.002).float().to(device)
    nbytes = B * A * C * 4 * 4  # reads logits and targets, writes the gradient, at least

    def run(fn):
        def go():
            (gx,) = torch.autograd.grad(fn(x, t), x)
            return gx
        return go

    def tv(x, t):
        return torchvision.ops.sigmoid_focal_loss(x, t, 0.25, 2.0, "sum")

    def fused(x, t):
        return sigmoid_focal_loss(x, t, 0.25, 2.0)

    bench = Bench("sigmoid_focal_loss fwd+bwd", f"[{B},{A},{C}] logits", nbytes)
    bench.variants.append(Variant("torchvision", run(tv), "library", peak=True))
    bench.variants.append(Variant("torchvision compiled", run(_compiled(tv)), "compiled", peak=True))
    bench.variants.append(Variant("fastdet fused", run(fused), "kernel", peak=True))
    bench.variants.append(Variant("fastdet fused compiled", run(_compiled(fused)), "kernel", peak=True))


def simota_per_image(pred_scores, pred_boxes, points, strides, gt_boxes, gt_labels, gt_mask, center_radius=2.5,
                     topk=10, iou_weight=3.0):
    """SimOTA as YOLOX's loss runs it: image by image, GT by GT, with boolean indexing and
    host syncs (``int(nlabel)``, ``dynamic_ks.tolist()``); the same semantics as the reference."""
    B, A, C = pred_scores.shape
    assigned = torch.full((B, A), -1, dtype=torch.long, device=pred_scores.device)
    assigned_iou = torch.zeros(B, A, dtype=pred_scores.dtype, device=pred_scores.device)
    x, y = points[:, 0], points[:, 1]
    for b in range(B):
        real = gt_mask[b].nonzero().squeeze(1)
        if real.numel() == 0:
            continue
        g = gt_boxes[b, real]
        in_box = (x - g[:, :1] > 0) & (y - g[:, 1:2] > 0) & (g[:, 2:3] - x > 0) & (g[:, 3:4] - y > 0)
        cx, cy = (g[:, :1] + g[:, 2:3]) / 2, (g[:, 1:2] + g[:, 3:4]) / 2
        r = center_radius * strides
        in_ctr = (x - (cx - r) > 0) & (y - (cy - r) > 0) & ((cx + r) - x > 0) & ((cy + r) - y > 0)
        cand = in_box.any(0) | in_ctr.any(0)
        cand_idx = cand.nonzero().squeeze(1)
        if cand_idx.numel() == 0:
            continue
        both = (in_box & in_ctr)[:, cand]
        ious = reference.box_iou(g, pred_boxes[b, cand])
        q = pred_scores[b, cand].sqrt()
        onehot = torch.nn.functional.one_hot(gt_labels[b, real], C).to(q.dtype)
        G, N = ious.shape
        cls_cost = torch.nn.functional.binary_cross_entropy(q[None].expand(G, N, C), onehot[:, None].expand(G, N, C),
                                                            reduction="none").sum(-1)
        cost = cls_cost + iou_weight * -torch.log(ious + 1e-8) + 1e5 * (~both).to(q.dtype)
        dyn_k = ious.topk(min(topk, N), dim=1).values.sum(1).int().clamp(min=1).tolist()
        matching = torch.zeros(G, N, dtype=torch.bool, device=q.device)
        for gi, k in enumerate(dyn_k):
            matching[gi, cost[gi].topk(k, largest=False).indices] = True
        multiple = matching.sum(0) > 1
        if multiple.any():
            best = cost[:, multiple].argmin(0)
            matching[:, multiple] = False
            matching[best, multiple.nonzero().squeeze(1)] = True
        fg = matching.any(0)
        gi = matching[:, fg].long().argmax(0)
        assigned[b, cand_idx[fg]] = real[gi]
        assigned_iou[b, cand_idx[fg]] = ious[gi, fg.nonzero().squeeze(1)]
    return assigned, assigned_iou


def bench_simota(device, size) -> list[Bench]:
    B, M, img, C = size
    x = assign_inputs(B, M, C, img, seed=0, device=device)
    args = x.simota_args()
    A = x.anchor_points.shape[0]
    # Reads scores and boxes, writes the two outputs: the least SimOTA moves.
    nbytes = B * A * (4 * C + 16) + B * A * (8 + 4)
    bench = Bench("simota_assign", f"B={B} M={M} A={A} C={C} ({int(x.pad_gt_mask.sum())} real GTs)", nbytes)
    bench.variants.append(Variant("per-image loop (Megvii)", lambda: simota_per_image(*args), "loop", peak=True))
    bench.variants.append(Variant("reference", lambda: simota.simota_assign(*args), "library", peak=True))
    cref = _compiled(simota.simota_assign)
    bench.variants.append(Variant("reference compiled", lambda: cref(*args), "compiled", peak=True))
    for be in kernel_backends(device):
        kop = _ns(be).simota_assign
        bench.variants.append(Variant(f"fastdet {be}", lambda kop=kop: kop(*args, 2.5, 10, 3.0), "kernel", peak=True))
    return [bench]


def bench_simota_step(device, size) -> list[Bench]:
    """SimOTA inside a YOLOX-s training step (eager forward + loss + backward): the step with
    our assignment and with the per-image loop in its place, and the assignment alone (loop,
    reference, kernels) on the very inputs the step passes it. ``run_bench`` adds each
    row's share of the fastdet step (``pct_of_step``)."""
    from fastdet.models import build_model
    from fastdet.models import yolox as yolox_module

    B, M, img = size
    torch.manual_seed(0)
    model = build_model("yolox", "s", num_classes=80).to(device).train()
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(B, 3, img, img, generator=g) * 255).to(device)
    xy = torch.rand(B, M, 2, generator=g) * img * 0.8
    wh = torch.rand(B, M, 2, generator=g) * img * 0.3 + 8
    boxes = torch.cat([xy, (xy + wh).clamp(max=img - 1)], -1)
    targets = {"gt_boxes": boxes.to(device), "gt_labels": torch.randint(0, 80, (B, M), generator=g).to(device),
               "gt_mask": torch.ones(B, M, dtype=torch.bool, device=device),
               "gt_scores": torch.ones(B, M, device=device)}
    default = yolox_module.simota_assign
    captured: dict[str, Any] = {}

    def capture(*a, **k):
        captured["args"], captured["kwargs"] = a, k
        return default(*a, **k)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(images, targets)["total_loss"].backward()

    def step_with(assign: Callable) -> Callable[[], None]:
        def run() -> None:
            yolox_module.simota_assign = assign
            try:
                step()
            finally:
                yolox_module.simota_assign = default
        return run

    step_with(capture)()
    a, k = captured["args"], captured["kwargs"]
    args = (*a, k["center_radius"], k["topk"], k["iou_weight"])

    def loop(*a, **k):
        return simota_per_image(*a, **k)

    bench = Bench("simota_in_yolox_step",
                  f"YOLOX-s train step B={B} img={img} M={M} boxes/image, A={a[0].shape[1]} C=80", 0)
    bench.variants.append(Variant("step, per-image loop", step_with(loop), "loop_step"))
    bench.variants.append(Variant("step, fastdet", step, "step"))
    bench.variants.append(Variant("assign: per-image loop", lambda: simota_per_image(*args), "loop"))
    bench.variants.append(Variant("assign: reference", lambda: simota.simota_assign(*args), "library"))
    for be in kernel_backends(device):
        kop = _ns(be).simota_assign
        bench.variants.append(Variant(f"assign: fastdet {be}", lambda kop=kop: kop(*args), "kernel"))
    bench.variants.append(Variant(f"assign: dispatch ({dispatch.backend_for('simota_assign', device.type, False)})",
                                  lambda: default(*a, **k), "dispatch"))
    return [bench]


# ----------------------------------------------------------------------------- running


def run_bench(bench: Bench, device: torch.device, warmup: int, reps: int, budget_s: float) -> dict[str, Any]:
    rows = []
    for v in bench.variants:
        try:
            t0 = time.perf_counter()
            v.fn()  # first call: compiles (compiled variants) / builds tables; not timed
            _sync(device)
            first_s = time.perf_counter() - t0
            ms = time_fn(v.fn, device, warmup, reps, budget_s)
            row = {"variant": v.name, "kind": v.kind, "ms": ms, "gbps": bench.bytes / ms / 1e6,
                   "first_call_s": first_s}
            if v.peak:
                row["peak_mb"] = peak_mb(v.fn, device)
        except Exception as e:  # noqa: BLE001 - report and carry on with the other variants
            row = {"variant": v.name, "kind": v.kind, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        rows.append(row)
        gc.collect()
    timed = [r for r in rows if "ms" in r]
    lib = next((r for r in timed if r["kind"] == "library"), None)
    comp = next((r for r in timed if r["kind"] == "compiled"), None)
    ceiling = next((r for r in timed if r["kind"] == "ceiling"), None)
    loop = next((r for r in timed if r["kind"] == "loop"), None)
    step = next((r for r in timed if r["kind"] == "step"), None)
    loop_step = next((r for r in timed if r["kind"] == "loop_step"), None)
    for r in timed:
        if step:
            r["pct_of_step"] = 100.0 * r["ms"] / step["ms"]
        if r["kind"] in ("step", "loop_step"):  # whole steps: compared with each other only
            if loop_step:
                r["x_loop"] = loop_step["ms"] / r["ms"]
            continue
        if loop:
            r["x_loop"] = loop["ms"] / r["ms"]
        if lib:
            r["x_library"] = lib["ms"] / r["ms"]
        if comp:
            r["x_compiled"] = comp["ms"] / r["ms"]
        if ceiling:
            r["pct_copy_bw"] = 100.0 * r["gbps"] / ceiling["gbps"]
    candidates = [r for r in timed if r["kind"] in ("kernel", "compiled", "reference", "library")]
    best = min(candidates, key=lambda r: r["ms"]) if candidates else None
    kernels = [r for r in timed if r["kind"] == "kernel"]
    verdict = None
    if best is not None:
        verdict = f"fastest: {best['variant']}"
        if kernels and comp:
            k = min(kernels, key=lambda r: r["ms"])
            if k["ms"] > comp["ms"]:
                verdict += f"; {k['variant']} LOSES to the compiled reference ({comp['ms'] / k['ms']:.2f}x)"
            else:
                verdict += f"; {k['variant']} is {comp['ms'] / k['ms']:.2f}x the compiled reference"
        if kernels and loop:
            k = min(kernels, key=lambda r: r["ms"])
            verdict += f"; {k['variant']} is {loop['ms'] / k['ms']:.2f}x the per-image loop"
        if step:
            used = next((r for r in timed if r["kind"] == "dispatch"), None)
            if used:
                verdict += f"; the assignment the step runs ({used['variant']}) is {used['pct_of_step']:.1f}% of it"
            if loop and loop_step:
                verdict += (f"; the per-image loop is {100 * loop['ms'] / loop_step['ms']:.1f}% of a step that "
                            f"runs it")
    return {"op": bench.op, "shape": bench.shape, "bytes": bench.bytes, "rows": rows, "verdict": verdict}


def print_result(res: dict[str, Any], flush: bool = False) -> None:
    print(f"\n{res['op']}  {res['shape']}  ({res['bytes'] / 1e6:.1f} MB moved at least)")
    print(f"  {'variant':<26}{'ms':>10}{'GB/s':>9}{'x lib':>8}{'x comp':>8}{'peak MB':>9}{'%copy':>7}")
    for r in res["rows"]:
        if "error" in r:
            print(f"  {r['variant']:<26}  error: {r['error']}")
            continue
        peak = r.get("peak_mb")
        print(f"  {r['variant']:<26}{r['ms']:>10.3f}{r['gbps']:>9.1f}{r.get('x_library', math.nan):>8.2f}"
              f"{r.get('x_compiled', math.nan):>8.2f}{(peak if peak is not None else math.nan):>9.1f}"
              f"{r.get('pct_copy_bw', math.nan):>7.1f}"
              + (f"  {r['pct_of_step']:.1f}% of the step" if "pct_of_step" in r else ""))
    if res["verdict"]:
        print(f"  -> {res['verdict']}", flush=flush)


def env_info(device: torch.device) -> dict[str, Any]:
    import triton
    import torchvision

    info = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "torchvision": torchvision.__version__,
        "threads": torch.get_num_threads(),
        "extension": _ext.variant(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30)}
    else:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return info


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", nargs="*", choices=("iou", "giou", "ema", "assign", "yolo", "fcos", "focal",
                                                     "simota", "simota_step"),
                        help="run only these benches")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per variant (at most)")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds of timing per variant (at most)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    preset = "quick" if args.quick else ("production" if device.type == "cuda" else "cpu")
    sizes = SIZES[preset]
    only = set(args.only or ("iou", "giou", "ema", "assign", "yolo", "fcos", "focal", "simota", "simota_step"))
    _ext.load()
    print(f"fastdet kernel benchmarks on {device} ({preset} sizes); extension: {_ext.variant() or _ext.error()}")
    warmup = 3 if device.type == "cuda" else 1
    results = []
    # The assigners and the EMA first: the figures the targets name, kept if a
    # time limit stops the run (the JSON is rewritten after every op).
    groups = [("assign", lambda: bench_assign(device, sizes["assign"])), ("ema", lambda: bench_ema(device)),
              ("fcos", lambda: bench_fcos_assign(device, sizes["fcos"])),
              ("focal", lambda: bench_focal(device, sizes["focal"])),
              ("giou", lambda: bench_giou_loss(device, sizes["giou"])), ("iou", lambda: bench_iou(device, sizes["iou"])),
              ("yolo", lambda: bench_yolo_targets(device, sizes["yolo"])),
              ("simota", lambda: bench_simota(device, sizes["simota"])),
              ("simota_step", lambda: bench_simota_step(device, sizes["simota_step"]))]
    report = {
        "schema": "fastdet.bench.kernels/1",
        "device": device.type,
        "preset": preset,
        "sizes": sizes,
        "env": env_info(device),
        "dispatch": {"eager": dispatch.describe(device.type),
                     "compiled": {op: dispatch.backend_for(op, device.type, True) for op in dispatch.OPS}},
        "results": results,
    }
    for key, make in groups:
        if key not in only:
            continue
        for bench in make():
            res = run_bench(bench, device, warmup, args.reps, args.budget)
            print_result(res, flush=True)
            results.append(res)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=2))
        torch._dynamo.reset()
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
