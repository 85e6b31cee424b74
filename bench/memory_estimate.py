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
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.throughput import Bench, parse_args as throughput_args  # noqa: E402  (the path above)

# eager bf16 on the CPU's fake tensors x this = GiB bench/gpu_check.sh reserves for a job:
# 1.14 (13.8 GiB measured / 12.1 estimated, eager bf16) x 0.69 (9.5 compiled / 13.8 eager,
# measured) x 1.2 (slack), the H200's PP-YOLOE-s figures (../shared/GPU.md).
GPU_CHECK_MARGIN = 0.95


def gpu_check_jobs() -> list[tuple[str, list[str]]]:
    """bench/gpu_check.sh's precompile jobs as (job, bench/throughput.py arguments), read
    from its plan: the step parts' own commands; each trainer run's family, batch and
    largest canvas at its --img-size (FCOS's keep-ratio buckets are not square)."""
    from fastdet.config import apply_overrides
    from fastdet.engine.graph_cache import bucket_sizes
    from fastdet.registry import get_preset

    plan = json.loads(subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--plan"], check=True,
                                     capture_output=True, text=True).stdout)
    jobs = []
    for part in plan["parts"]:
        if part["part"].startswith("step_"):
            argv = part["command"].split()[1:]
            argv[argv.index("--device") + 1] = "cpu"
            jobs.append((part["part"], argv))
    flags = argparse.ArgumentParser(add_help=False)
    for name in ("--arch", "--size", "--img-size", "--batch-size"):
        flags.add_argument(name)
    for family, line in plan["train"].items():
        t, _ = flags.parse_known_args(line.split())
        cfg = apply_overrides(get_preset(t.arch, t.size), {"data.img_size": int(t.img_size),
                                                            "data.train_sizes": (int(t.img_size),)})
        h, w = max(bucket_sizes(cfg), key=lambda hw: hw[0] * hw[1])
        jobs.append((f"train_{family}", ["--arch", t.arch, "--size", t.size, "--batch-size", t.batch_size,
                                         "--img-size", f"{h}x{w}"]))
    return jobs


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


def estimate(bench_argv: list[str], amp: str) -> dict:
    """GiB at the peak of one eager step of ``bench/throughput.py``'s arguments (its defaults:
    the recipe's image size and box padding), by kind (parameters, activations, ...) and in all."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    _hooks_skip_frozen_parameters()
    bench = Bench(throughput_args([*bench_argv, "--device", "cpu", "--amp", amp]))
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
    a = bench.args
    return {"arch": a.arch, "size": a.size, "img_size": "x".join(map(str, a.img_size)), "batch_size": a.batch_size,
            "max_boxes": a.max_boxes, "amp": amp, "peak_gib": by_kind.pop("total"), "by_kind": by_kind}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="ppyoloe")
    p.add_argument("--size", default="s")
    p.add_argument("--img-size", help="N or HxW (default: the recipe's)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-boxes", type=int, help="default: the recipe's padding")
    p.add_argument("--amp", default="bf16", choices=["off", "bf16", "fp16"])
    p.add_argument("--gpu-check", action="store_true",
                   help="bench/gpu_check.sh's precompile jobs, eager bf16: 'job<TAB>GiB' lines, the GiB "
                        f"rounded up from the estimate x {GPU_CHECK_MARGIN}")
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args(argv)
    if a.gpu_check:
        rows = []
        for job, argv in gpu_check_jobs():
            r = {"job": job, **estimate(argv, "bf16")}
            r["reserve_gib"] = math.ceil(r["peak_gib"] * GPU_CHECK_MARGIN)
            rows.append(r)
            print(f"{job}\t{r['reserve_gib']}\t# {r['arch']}-{r['size']} {r['img_size']} b{r['batch_size']} "
                  f"{r['max_boxes']} boxes: eager bf16 {r['peak_gib']:.1f} GiB", flush=True)
    else:
        argv = ["--arch", a.arch, "--size", a.size, "--batch-size", str(a.batch_size)]
        argv += ["--img-size", a.img_size] if a.img_size else []
        argv += ["--max-boxes", str(a.max_boxes)] if a.max_boxes else []
        rows = [estimate(argv, a.amp)]
        r = rows[0]
        print(f"{r['arch']}-{r['size']} {r['img_size']} b{r['batch_size']} {r['max_boxes']} boxes amp {r['amp']}: "
              f"{r['peak_gib']:.2f} GiB at the peak ({', '.join(f'{k} {v:.2f}' for k, v in r['by_kind'].items() if v)})")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
