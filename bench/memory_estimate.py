"""Peak device memory of one training step, estimated on the CPU without allocating it.

    python bench/memory_estimate.py --arch ppyolo --size r50vd_dcn --img-size 608 --batch-size 64 \\
        --max-boxes 50 --amp bf16
    python bench/memory_estimate.py --gpu-check          # bench/gpu_check.sh's precompile jobs

The trainer's eager step (model, loss, assignment, backward, optimizer and EMA, as
``bench/throughput.py`` builds it) runs once on fake tensors (``FakeTensorMode``: shapes and
dtypes, no storage) under ``torch.distributed._tools.mem_tracker.MemTracker``, which adds up
the bytes of the tensors alive at each moment. It is eager, not compiled, and the CPU's
autocast rules stand in for CUDA's. Against the one GPU measurement (../shared/GPU.md, H200,
PP-YOLOE-s 640 batch 64, peaks of 23.6 / 13.8 / 9.5 "GB"): eager fp32 21.9 GiB here, eager
bf16 12.1 for 13.8; the compiled step took 0.69x its eager bf16 there. So ``--gpu-check``
reports what a compiled step should hold on the GPU, with room to spare: eager bf16 here
x 1.14 (to the measured eager bf16) x 0.69 (compiled over eager) x 1.2 (the caching
allocator's slack; other families' other ratios) = x 0.95, rounded up. bench/gpu_check.sh's
scheduler (bench/run_jobs.py) starts its precompile jobs only while these fit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import Bench, parse_args as throughput_args  # noqa: E402  (the path above)

# eager bf16 on the CPU's fake tensors x this = GiB bench/gpu_check.sh reserves for a job:
# 1.14 (13.8 GiB measured / 12.1 estimated, eager bf16) x 0.69 (9.5 compiled / 13.8 eager,
# measured) x 1.2 (slack), the H200's PP-YOLOE-s figures (../shared/GPU.md).
GPU_CHECK_MARGIN = 0.95

# bench/gpu_check.sh's precompile jobs: (job, arch, size, HxW, batch, boxes). Its trainer
# runs (256 px, batch 8) are the train_* rows.
GPU_CHECK_JOBS = [
    ("step_ppyoloe", "ppyoloe", "s", "640", 64, 100),
    ("step_yolox", "yolox", "s", "640", 64, 120),
    ("step_ppyolo", "ppyolo", "r50vd_dcn", "608", 64, 50),
    ("step_fcos", "fcos", "r50", "800x1344", 16, 100),
    ("step_b128", "ppyoloe", "s", "640", 128, 100),
    ("train_ppyoloe", "ppyoloe", "s", "256", 8, 100),
    ("train_yolox", "yolox", "s", "256", 8, 120),
    ("train_ppyolo", "ppyolo", "r50vd_dcn", "256", 8, 50),
    ("train_fcos", "fcos", "r50", "256x448", 8, 100),  # its largest canvas at 256 px
]


class _NoHandle:
    def remove(self) -> None:
        pass


def _hooks_skip_frozen_parameters() -> None:
    """MemTracker hooks every parameter's gradient; a frozen one (FCOS's first backbone
    stages) cannot take a hook and has no gradient to count."""
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        orig = getattr(torch.Tensor, name)
        if getattr(orig, "_skips_frozen", False):
            continue

        def safe(self, hook, _orig=orig):
            return _orig(self, hook) if self.requires_grad else _NoHandle()

        safe._skips_frozen = True
        setattr(torch.Tensor, name, safe)


def estimate(arch: str, size: str, img_size: str, batch: int, boxes: int, amp: str) -> dict:
    """GiB at the peak of one eager step, by kind (parameters, activations, ...) and in all."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    _hooks_skip_frozen_parameters()
    bench = Bench(throughput_args(["--arch", arch, "--size", size, "--device", "cpu", "--img-size", img_size,
                                   "--batch-size", str(batch), "--max-boxes", str(boxes), "--amp", amp]))
    v = bench.variant("eager_fp32" if amp == "off" else "eager_amp")
    real = bench.synthetic(v, 1)[0]
    # Model, optimizer and EMA are real (a few MB); the batch and all that the step makes are fake.
    model, step, _, kw = bench.build_step(v)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        batch_fake = {k: mode.from_tensor(t) for k, t in real.items()}
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            step(batch_fake, kw)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_kind = {str(k).split(".")[-1].split(":")[0].lower(): round(b / 2**30, 3) for k, b in peak.items()}
    return {"arch": arch, "size": size, "img_size": img_size, "batch_size": batch, "max_boxes": boxes,
            "amp": amp, "peak_gib": by_kind.pop("total"), "by_kind": by_kind}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="ppyoloe")
    p.add_argument("--size", default="s")
    p.add_argument("--img-size", default="640", help="N or HxW")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-boxes", type=int, default=100)
    p.add_argument("--amp", default="bf16", choices=["off", "bf16", "fp16"])
    p.add_argument("--gpu-check", action="store_true",
                   help="bench/gpu_check.sh's precompile jobs, eager bf16: 'job<TAB>GiB' lines, the GiB "
                        f"rounded up from the estimate x {GPU_CHECK_MARGIN}")
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args(argv)
    if a.gpu_check:
        rows = []
        for job, arch, size, hw, batch, boxes in GPU_CHECK_JOBS:
            row = {"job": job, **estimate(arch, size, hw, batch, boxes, "bf16")}
            row["reserve_gib"] = math.ceil(row["peak_gib"] * GPU_CHECK_MARGIN)
            rows.append(row)
            print(f"{job}\t{row['reserve_gib']}\t# {arch}-{size} {hw} b{batch}: eager bf16 {row['peak_gib']:.1f} GiB",
                  flush=True)
    else:
        rows = [estimate(a.arch, a.size, a.img_size, a.batch_size, a.max_boxes, a.amp)]
        r = rows[0]
        print(f"{r['arch']}-{r['size']} {r['img_size']} b{r['batch_size']} {r['max_boxes']} boxes amp {r['amp']}: "
              f"{r['peak_gib']:.2f} GiB at the peak ({', '.join(f'{k} {v:.2f}' for k, v in r['by_kind'].items() if v)})")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
