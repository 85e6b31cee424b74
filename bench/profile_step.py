"""Where a train step's time goes: one command, the step's device time by category.

    python bench/profile_step.py                                   # PP-YOLOE-s, 640 px, batch 64, on CUDA
    python bench/profile_step.py --device cpu --quick              # 128 px, batch 2: minutes on a CPU
    python bench/profile_step.py --variants eager_fp32,compile --out bench/results/profile-ppyoloe

For each step variant (``eager_fp32``, ``eager_amp``, ``compile``, ``compile_graphs``; the
same variants as ``bench/throughput.py``'s step modes, built by the same code) it warms
the trainer's ``TrainStep`` up, times ``--iters`` steps without the profiler (the step
time, hence the model TFLOP/s), then runs ``--steps`` steps under ``torch.profiler`` and
writes:

- ``trace_<variant>.json``: the Chrome/Kineto trace (open it in https://ui.perfetto.dev);
- the step's time by category (per step, and its share), from that trace:
  convolution forward / backward, layout transposes and copies, BatchNorm and
  activations, matrix products, inductor's fused kernels grouped by the ops they came
  from (``inductor: batch_norm+silu``), each fastdet custom op (``fastdet::atss_assign``),
  the loss (eager: the head's ``loss``), the optimizer, the EMA, and idle gaps
  (device time with no kernel running; on the CPU, wall time outside any op: Python and
  dispatch overhead);
- the top 30 kernels (CPU: the ops that did the work) with calls and share;
- the model's TFLOP/s (forward, loss and backward FLOPs of one step counted by
  ``torch.utils.flop_counter``, over the un-profiled step time) and its share of a
  matrix product timed in the same run (bf16 on CUDA, fp32 on the CPU);
- ``profile.json`` with all of it and the environment, and ``profile.md`` with the tables.

How an event gets its category (``categorize``): the fastdet custom op it ran under, else
the step range it ran in (``optimizer``, ``ema``, and eager ``loss``), else the first of
its kernel name and its enclosing ops (innermost first) that a name rule knows. On CUDA a
kernel is tied to the op that launched it through the trace's correlation ids; inside a
CUDA graph replay only the kernel name is known. The same categories come out on the CPU,
so the tool is tested in ``make test`` (``tests/test_profile.py``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import SCHEMA, env_info, format_table, fresh_dynamo, one_line, release_memory, sync, write_json

VARIANTS = ("eager_fp32", "eager_amp", "compile", "compile_graphs")
RANGES = ("loss", "ema", "optimizer", "backward", "forward")  # innermost wins, in this order
TOP_KERNELS = 30

# --------------------------------------------------------------------------- categories

# Ops of inductor's kernel names (``triton_per_fused__native_batch_norm_legit_functional_silu_3``,
# ``cpp_fused_add_mul_7``) reduced to a short, stable vocabulary for grouping.
_OP_ALIASES = [
    (re.compile(r"native_batch_norm(_legit)?(_functional|_no_training)?|batch_norm\w*|_batch_norm"), "batch_norm"),
    (re.compile(r"convolution(_backward)?"), "convolution"),
    (re.compile(r"native_layer_norm|layer_norm"), "layer_norm"),
    (re.compile(r"_to_copy|copy_?|clone|permute|transpose|cat|constant_pad_nd|slice_scatter|select_scatter"),
     "copy"),
    (re.compile(r"silu|sigmoid|relu|leaky_relu|hardswish|mish|gelu|tanh|softplus"), "activation"),
    (re.compile(r"sum|mean|amax|max|min|argmax|argmin|var|std|logsumexp|softmax|log_softmax|topk|sort"), "reduction"),
    (re.compile(r"binary_cross_entropy\w*|smooth_l1|l1_loss|mse_loss|nll_loss|focal"), "loss"),
    (re.compile(r"mm|bmm|addmm|matmul"), "matmul"),
]
_FUSED = re.compile(r"^(?:triton_(?:poi|per|red|tem|for)_|cpp_)fused_?(.*?)(?:_\d+)?$")
_ALIASABLE = re.compile(r"[A-Za-z]+(?:_[A-Za-z]+)*")

# Name rules: (category, pattern), tried in order on a kernel name and then on its
# enclosing ops, innermost first. cuDNN / CUTLASS / oneDNN names included.
_NAME_RULES = [
    ("convolution backward", re.compile(
        r"convolution_backward|dgrad|wgrad|bprop|conv2d_backward|mkldnn_convolution_backward", re.I)),
    ("convolution forward", re.compile(
        r"aten::(?:_|mkldnn_|cudnn_|_slow_)?conv(?:olution|2d|_depthwise2d)|fprop|implicit_?gemm|"
        r"conv2d|convolve|xmma_fprop|cudnn::.*conv|depthwise", re.I)),
    ("layout, transposes and copies", re.compile(
        r"nchwtonhwc|nhwctonchw|transpose|permute|aten::copy_|aten::_to_copy|aten::clone|aten::contiguous|"
        r"memcpy|memset|aten::cat|CatArrayBatchedCopy|copy_kernel|aten::to$|aten::_copy_from", re.I)),
    ("BatchNorm and activations", re.compile(
        r"batch_?norm|bn_fw|bn_bw|batchnorm|silu|swish|sigmoid|relu|leaky|hardswish|mish|gelu|"
        r"aten::hardtanh|welford", re.I)),
    ("matrix products", re.compile(r"gemm|gemv|aten::(?:add|b)?mm$|aten::matmul|aten::linear|cutlass|cublas", re.I)),
    ("optimizer", re.compile(r"_foreach_|fused_sgd|fused_adam|multi_tensor_apply|aten::_fused_adam", re.I)),
]


def inductor_ops(kernel: str) -> str | None:
    """``triton_per_fused__native_batch_norm_legit_functional_silu_3`` -> ``batch_norm+activation``;
    None for a name that is not one of inductor's fused kernels."""
    m = _FUSED.match(kernel)
    if m is None:
        return None
    ops: list[str] = []
    rest = m.group(1)
    while rest:
        rest = rest.lstrip("_")
        best = None
        for pat, alias in _OP_ALIASES:
            mm = pat.match(rest)
            if mm and (best is None or mm.end() > best[0]):
                best = (mm.end(), alias)
        if best is None:  # an op outside the vocabulary: skip its name up to the next '_'
            word = _ALIASABLE.match(rest)
            end = rest.find("_", 1)
            name = rest[: end if end > 0 else len(rest)]
            if word and name and not name.isdigit():
                ops.append("pointwise")
            rest = rest[end:] if end > 0 else ""
            continue
        if best[1] not in ops:
            ops.append(best[1])
        rest = rest[best[0]:]
    ops = [o for i, o in enumerate(ops) if o not in ops[:i]]
    if len(ops) > 1 and "pointwise" in ops:
        ops.remove("pointwise")
    return "+".join(ops[:3]) or "pointwise"


def categorize(kernel: str, ops: list[str], step_range: str | None) -> str:
    """The category of one unit of work.

    kernel: the kernel name (CUDA) or the op that did the work (CPU, its self time);
    ops: the enclosing ops, innermost first (CPU: the op itself first);
    step_range: the innermost of ``RANGES`` the work ran in (None: outside, or in a graph).
    """
    for name in [kernel, *ops]:
        if name.startswith("fastdet::"):
            return name.split(".")[0]
    if step_range in ("optimizer", "ema"):
        return {"optimizer": "optimizer", "ema": "EMA"}[step_range]
    if step_range == "loss":
        return "loss"
    fused = inductor_ops(kernel)
    if fused is not None:
        return f"inductor: {fused}"
    if re.search(r"ema_update", kernel):
        return "EMA"
    for name in [kernel, *ops]:
        for cat, pat in _NAME_RULES:
            if pat.search(name):
                return cat
    return "other"


# --------------------------------------------------------------------------- the trace

@dataclass
class Work:
    """A unit of device time: a CUDA kernel / memcpy, or a CPU op's self time."""

    name: str
    dur_us: float
    ops: list[str]
    step_range: str | None
    category: str = ""


@dataclass
class Breakdown:
    steps: int
    wall_us: float  # the profiled steps' span (first to last step range)
    busy_us: float  # time with device work running (union of intervals)
    work: list[Work] = field(default_factory=list)

    def by_category(self) -> list[dict[str, Any]]:
        total: dict[str, float] = defaultdict(float)
        for w in self.work:
            total[w.category] += w.dur_us
        idle = max(0.0, self.wall_us - self.busy_us)
        total["idle gaps"] += idle
        denom = sum(total.values()) or 1.0
        rows = [{"category": c, "ms_per_step": t / 1000.0 / self.steps, "share": t / denom}
                for c, t in total.items()]
        return sorted(rows, key=lambda r: -r["ms_per_step"])

    def top_kernels(self, n: int = TOP_KERNELS) -> list[dict[str, Any]]:
        total: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        cat: dict[str, str] = {}
        for w in self.work:
            total[w.name] += w.dur_us
            calls[w.name] += 1
            cat.setdefault(w.name, w.category)
        denom = sum(total.values()) or 1.0
        rows = [{"kernel": k, "calls_per_step": calls[k] / self.steps, "ms_per_step": t / 1000.0 / self.steps,
                 "share": t / denom, "category": cat[k]} for k, t in total.items()]
        return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


class _Enclosing:
    """Innermost-first enclosing intervals of a timestamp, per thread (events sorted by start).

    The chain of ``t``: the latest event starting at or before ``t`` that ends at or after
    it, then the latest earlier one ending at or after that one's end, and so on. ``up[j]``
    is that next link of event ``j`` (the latest earlier event ending no earlier; -1: none),
    found for all events in one pass, so a query follows links instead of scanning every
    earlier event: an eager step's trace on CUDA holds ~11,000 ops and ~5,000 kernels per
    step, and a scan per kernel made parsing 3 steps take 22 s here (quadratic in the steps)."""

    def __init__(self, events: list[dict[str, Any]]):
        self.starts = [e["ts"] for e in events]
        self.ends = [e["ts"] + e.get("dur", 0.0) for e in events]
        self.events = events
        self.up: list[int] = []
        stack: list[int] = []  # indices whose ends decrease from bottom to top
        for j, end in enumerate(self.ends):
            while stack and self.ends[stack[-1]] < end:
                stack.pop()
            self.up.append(stack[-1] if stack else -1)
            stack.append(j)

    def chain(self, t: float) -> list[dict[str, Any]]:
        j = bisect.bisect_right(self.starts, t) - 1
        # An event between up[j] and j ends before j does: if j ended before t, so did it.
        while j >= 0 and self.ends[j] < t:
            j = self.up[j]
        out = []
        while j >= 0:
            out.append(self.events[j])
            j = self.up[j]
        return out


def parse_trace(trace: dict[str, Any], steps: int, device: str) -> Breakdown:
    """The profiled ``steps`` (each inside a ``profile_step`` range) of a Kineto trace."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    step_marks = [e for e in evs if e.get("cat") == "user_annotation" and e.get("name") == "profile_step"]
    if len(step_marks) != steps:
        raise ValueError(f"trace has {len(step_marks)} profile_step ranges, expected {steps}")
    t0 = min(e["ts"] for e in step_marks)
    t1 = max(e["ts"] + e["dur"] for e in step_marks)
    inside = [e for e in evs if t0 <= e["ts"] <= t1]
    ranges = sorted((e for e in inside if e.get("cat") == "user_annotation" and e.get("name") in RANGES),
                    key=lambda e: e["ts"])
    range_index = _Enclosing(ranges)

    def step_range(t: float) -> str | None:
        names = [e["name"] for e in range_index.chain(t)]
        for r in RANGES:
            if r in names:
                return r
        return None

    cpu_ops = [e for e in inside if e.get("cat") == "cpu_op"]
    by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in cpu_ops:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    enclosing = {k: _Enclosing(sorted(v, key=lambda e: (e["ts"], -e.get("dur", 0.0)))) for k, v in by_tid.items()}
    out = Breakdown(steps=steps, wall_us=t1 - t0, busy_us=0.0)
    if device == "cuda":
        launches = {}
        for e in inside:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
                launches[e["args"]["correlation"]] = e
        # Device work may run after its launch, past the last step mark: take every kernel
        # whose launch is inside the window.
        kernels = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        intervals = []
        for k in kernels:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is None:
                continue
            t = launch["ts"]
            chain = enclosing.get((launch.get("pid"), launch.get("tid")))
            ops = [e["name"] for e in chain.chain(t)] if chain else []
            out.work.append(Work(k["name"], float(k["dur"]), ops, step_range(t)))
            intervals.append((k["ts"], k["ts"] + k["dur"]))
        if intervals:
            first = min(s for s, _ in intervals)
            last = max(e for _, e in intervals)
            out.wall_us = max(out.wall_us, last - first)
        out.busy_us = _union_us(intervals)
    else:
        intervals = []
        for key, idx in enclosing.items():
            evs_t = idx.events
            # Self time: an op's duration minus its direct children's.
            children: dict[int, float] = defaultdict(float)
            stack: list[int] = []
            for i, e in enumerate(evs_t):
                end = e["ts"] + e.get("dur", 0.0)
                while stack and evs_t[stack[-1]]["ts"] + evs_t[stack[-1]].get("dur", 0.0) < e["ts"] + 1e-3:
                    stack.pop()
                while stack and evs_t[stack[-1]]["ts"] + evs_t[stack[-1]].get("dur", 0.0) < end - 1e-3:
                    stack.pop()
                if stack:
                    children[stack[-1]] += e.get("dur", 0.0)
                else:
                    intervals.append((e["ts"], end))
                stack.append(i)
            for i, e in enumerate(evs_t):
                self_us = max(0.0, e.get("dur", 0.0) - children[i])
                if self_us <= 0.0:
                    continue
                ops = [c["name"] for c in idx.chain(e["ts"] + min(e.get("dur", 0.0), 1e-3))]
                if not ops or ops[0] != e["name"]:
                    ops = [e["name"], *ops]
                out.work.append(Work(e["name"], self_us, ops, step_range(e["ts"])))
        out.busy_us = _union_us(intervals)
    for w in out.work:
        w.category = categorize(w.name, w.ops, w.step_range)
    return out


# --------------------------------------------------------------------------- the run

class ProfilerRanges:
    """``TrainStep.nvtx`` stand-in: ``record_function`` ranges the trace shows."""

    enabled = True

    def __call__(self, name: str):
        return torch.profiler.record_function(name)


@contextmanager
def loss_range(model: torch.nn.Module) -> Iterator[None]:
    """Eager variants: the head's ``loss`` inside a ``loss`` range (instance attribute,
    removed after)."""
    head = getattr(model, "head", None)
    if head is None or not hasattr(head, "loss"):
        yield
        return
    orig = head.loss

    def loss(*a, **kw):
        with torch.profiler.record_function("loss"):
            return orig(*a, **kw)

    head.loss = loss
    try:
        yield
    finally:
        del head.loss


def step_flops(bench, v, kw: dict[str, Any]) -> int:
    """FLOPs of one eager training step (forward, loss and backward) of ``v``'s model."""
    from torch.utils.flop_counter import FlopCounterMode

    model, step, _, _ = bench.build_step(replace(v, compile=False, cuda_graphs=False))
    batch = bench.synthetic(v, 1)[0]
    counter = FlopCounterMode(display=False)
    with counter:
        step(batch, kw)
    del model, step
    return counter.get_total_flops()


def matmul_tflops(device: torch.device, n: int, iters: int = 10) -> dict[str, Any]:
    """A square matrix product timed in this run: the reference the model's TFLOP/s is a share of."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    dt = (time.perf_counter() - t) / iters
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "tflops": 2 * n ** 3 / dt / 1e12}


def profile_variant(bench, name: str, args: argparse.Namespace, out_dir: Path, flops: int | None) -> dict[str, Any]:
    v = bench.variant(name)
    row: dict[str, Any] = {"variant": name, "status": None, "reason": None}
    reason = bench.skip_reason(v)
    if reason:
        row.update(status="skipped", reason=reason)
        return row
    if v.compile and bench.device.type == "cpu":
        # Inductor's C++ kernels are only visible to the profiler with this set.
        import torch._inductor.config as ic

        ic.cpp.enable_kernel_profile = True
    with fresh_dynamo():
        model, step, schedule, kw = bench.build_step(v)
        step.nvtx = ProfilerRanges()
        batches = bench.synthetic(v)
        ctx = loss_range(model) if not (v.compile or v.cuda_graphs) else nullcontext()
        with ctx:
            bench.warm_step(step, kw, v)
            k = 0

            def run(n: int, mark: bool = False) -> None:
                nonlocal k
                for _ in range(n):
                    with torch.profiler.record_function("profile_step") if mark else nullcontext():
                        step.optimizer.set_lr(schedule(k))
                        step(batches[k % len(batches)], kw)
                    k += 1

            run(args.warmup)
            sync(bench.device)
            t = time.perf_counter()
            run(args.iters)
            sync(bench.device)
            step_s = (time.perf_counter() - t) / args.iters
            activities = [torch.profiler.ProfilerActivity.CPU]
            if bench.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                run(args.steps, mark=True)
                sync(bench.device)
            step.read_losses()
        trace_path = out_dir / f"trace_{name}.json"
        prof.export_chrome_trace(str(trace_path))
        del model, step, batches
    trace = json.loads(trace_path.read_text())
    bd = parse_trace(trace, args.steps, bench.device.type)
    row.update(status="ok", step_ms=step_s * 1000.0, images_per_s=args.batch_size / step_s,
               profiled_step_ms=bd.wall_us / 1000.0 / args.steps,
               categories=bd.by_category(), top_kernels=bd.top_kernels(), trace=str(trace_path))
    if flops:
        row["model_tflops"] = flops / step_s / 1e12
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/profile_step.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="ppyoloe")
    p.add_argument("--size", default="s")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--quick", action="store_true", help="128 px, batch 2, 2 profiled steps (a CPU check)")
    p.add_argument("--img-size", help="N or HxW (default: the recipe's published shape, as bench/throughput.py; "
                                      "--quick 128)")
    p.add_argument("--batch-size", type=int, help="images per step (default 64; --quick 2)")
    p.add_argument("--max-boxes", type=int,
                   help="M of the padded ground truth (default: the recipe's data.max_boxes; --quick 16)")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all; those that cannot "
                        "run here are skipped with their reason)")
    p.add_argument("--warmup", type=int, help="untimed steps after compilation (default 5; --quick 1)")
    p.add_argument("--iters", type=int, help="timed steps without the profiler (default 10; --quick 2)")
    p.add_argument("--steps", type=int, help="profiled steps (default 5; --quick 2)")
    p.add_argument("--matmul-n", type=int, help="size of the reference matrix product (default 8192; CPU 1024)")
    p.add_argument("--out", default=None, help="output directory (default runs/profile/<arch>_<size>)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    quick = dict(img_size=128, batch_size=2, max_boxes=16, warmup=1, iters=2, steps=2)
    full = dict(img_size=None, batch_size=64, max_boxes=None, warmup=5, iters=10, steps=5)
    for k, val in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, val)
    for k in ("batch_size", "iters", "steps"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu)")
    names = [s.strip() for s in a.variants.split(",") if s.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        p.error(f"--variants: unknown {', '.join(bad) or '(none given)'}; variants are {', '.join(VARIANTS)}")
    a.variants = names
    if a.matmul_n is None:
        a.matmul_n = 8192 if a.device == "cuda" else 1024
    if a.out is None:
        a.out = f"runs/profile/{a.arch}_{a.size}"
    return a


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Profile: {doc['config']['arch']}-{doc['config']['size']}, {doc['config']['img_size']} px, "
             f"batch {doc['config']['batch_size']}, {doc['env'].get('device_name') or doc['config']['device']}", ""]
    mm = doc["matmul"]
    lines.append(f"Reference {mm['dtype']} matrix product ({mm['n']}²): {mm['tflops']:.2f} TFLOP/s. "
                 f"Model FLOPs per step (forward, loss, backward): {doc['flops_per_step'] / 1e9:.2f} G.")
    lines.append("")
    for r in doc["results"]:
        lines.append(f"## {r['variant']}")
        if r["status"] != "ok":
            lines.append(f"{r['status']}: {r['reason']}")
            lines.append("")
            continue
        share = r.get("model_tflops", 0.0) / mm["tflops"] if mm["tflops"] else 0.0
        lines.append(f"step {r['step_ms']:.1f} ms ({r['images_per_s']:.1f} img/s), model "
                     f"{r.get('model_tflops', 0.0):.4f} TFLOP/s = {100 * share:.1f} % of the matrix product; "
                     f"trace: `{r['trace']}`")
        lines.append("")
        lines.append(format_table(r["categories"], [("category", "category", ""), ("ms_per_step", "ms/step", ".2f"),
                                                    ("share", "share", ".1%")]))
        lines.append("")
        lines.append(format_table(r["top_kernels"], [("kernel", "kernel", ""), ("calls_per_step", "calls/step", ".1f"),
                                                     ("ms_per_step", "ms/step", ".2f"), ("share", "share", ".1%"),
                                                     ("category", "category", "")]))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench import throughput as tp

    a = parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The step is built by bench/throughput.py's code from the same flags, so a graph a
    # throughput run (or its --precompile) compiled loads from inductor's cache here.
    targs = tp.parse_args(["--arch", a.arch, "--size", a.size, "--device", a.device,
                           "--batch-size", str(a.batch_size), "--amp", a.amp,
                           "--compile-backend", a.compile_backend, "--seed", str(a.seed), "--modes", "step"]
                          + (["--img-size", str(a.img_size)] if a.img_size is not None else [])
                          + (["--max-boxes", str(a.max_boxes)] if a.max_boxes is not None else [])
                          + (["--channels-last"] if a.channels_last else []))
    a.img_size, a.max_boxes = tp.hw_name(targs.img_size), targs.max_boxes
    bench = tp.Bench(targs)
    device = bench.device
    doc: dict[str, Any] = {
        "schema": SCHEMA, "kind": "profile", "command": " ".join(sys.argv),
        "env": env_info(device),
        "config": {"arch": a.arch, "size": a.size, "device": a.device, "img_size": a.img_size,
                   "backend_flags": bench.backend_flags,
                   "batch_size": a.batch_size, "max_boxes": a.max_boxes, "amp": tp.amp_name(bench.amp_dtype),
                   "channels_last": a.channels_last, "compile_backend": a.compile_backend,
                   "steps": a.steps, "iters": a.iters, "warmup": a.warmup},
        "matmul": matmul_tflops(device, a.matmul_n),
        "results": [],
    }
    from fastdet import registry

    kw = registry.phase(bench.cfg, targs.epoch).loss_kwargs
    flops = {}
    status = 0
    for name in a.variants:
        v = bench.variant(name)
        try:
            if v.amp not in flops:
                flops[v.amp] = step_flops(bench, v, kw) if bench.skip_reason(v) is None else None
            row = profile_variant(bench, name, a, out_dir, flops[v.amp])
        except Exception as e:  # noqa: BLE001 - one failed variant must not lose the others
            import traceback

            traceback.print_exc(file=sys.stderr)
            row = {"variant": name, "status": "failed", "reason": one_line(e)}
            status = 1
        finally:
            release_memory(device)
        doc["results"].append(row)
        doc["flops_per_step"] = next((f for f in flops.values() if f), 0)
        write_json(out_dir / "profile.json", doc)
    text = markdown(doc)
    (out_dir / "profile.md").write_text(text + "\n")
    print(text)
    print(f"written: {out_dir / 'profile.json'}, {out_dir / 'profile.md'}, traces in {out_dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
