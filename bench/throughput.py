"""Throughput of fastdet side by side, in one run: data, train step and end to end.

    python bench/throughput.py                       # PPYOLOE-s, 640, bf16, batch 64, every mode
    python bench/throughput.py --quick               # a small configuration, minutes on a CPU
    python bench/throughput.py --modes step --json step.json
    python bench/throughput.py --modes data,e2e --data /data/coco --workers 16

Modes (``--modes`` takes names or the groups ``data``, ``step``, ``layout``, ``warmup``, ``e2e``,
``all``):

data   data_torch            images/s of the torch DataLoader (the seed-style baseline)
       data_dali             images/s of the DALI pipeline; same dataset, augmentation, batch
step   step_eager_fp32       the train step (forward + loss, backward, SGD, EMA) in eager fp32,
                             the seed's way: the baseline of its group
       step_eager_amp        eager with autocast (--amp)
       step_compile          torch.compile(fullgraph) with autocast
       step_compile_graphs   compiled and the whole step captured in CUDA graphs (CUDA only)
layout step_eager_fp32_nhwc  step_eager_fp32 with model and images in channels-last (NHWC)
       step_eager_amp_nhwc   step_eager_amp in channels-last
       step_compile_nhwc     step_compile in channels-last; each layout row's speedup is over
                             its NCHW twin in the same run, the figure data.channels_last
                             (the trainer's --channels-last) rests on
warmup step_compile_dynamic  step_compile with compile.shapes=dynamic (H, W symbolic); its
                             speedup is over step_compile in the same run (the dynamic-vs-static
                             step ratio compile.shapes' default rests on)
       warmup_cold           with an empty inductor cache: ``fastdet.train --compile`` (background
                             compilation) to its first step, then ``fastdet.compile`` until every
                             bucket is compiled (graphs, seconds per graph, total)
       warmup_warm           the same cache again: ``fastdet.compile`` (every graph a cache hit)
                             and ``fastdet.train --compile`` with compile.warmup=blocking to its
                             first compiled step
                             (``--modes warmup`` runs these three and step_compile; not in ``all``:
                             minutes per inductor graph on a CPU. ``--recipe-sizes`` uses the
                             recipe's multi-scale buckets instead of ``--img-size``.)
e2e    e2e_seed              the training loop with the torch loader and the eager fp32 step
       e2e_torch             the training loop with the torch loader and the --e2e-step step
       e2e_dali              the training loop with DALI and the --e2e-step step

Step modes run on synthetic batches already on the device (random images, a few valid
boxes per image) through ``fastdet.engine.step.TrainStep``: the trainer's step, with
its optimizer, EMA and per-step LR write. End-to-end modes run the trainer's loop
(next batch, LR, step; losses read every window) over the real loader, and then time
the very same step on a synthetic batch: ``of_step`` = end to end / step only says how
much the data costs (1.0: the loader keeps up; the issue's target is >= 0.9).

For each mode: images/s (median of ``--windows`` timed windows of ``--iters``
iterations, and their spread), speedup over its group's baseline measured in the same
run, peak memory, warm-up time (compilation and capture included) and Dynamo graphs,
graph breaks and recompilations after warm-up. Nothing is timed before warm-up ends.
The table goes to the terminal; ``--json FILE`` writes the same figures with the
environment (rewritten after every mode, so a run cut short keeps what it measured; a FILE
there before the run is replaced only with ``--overwrite``).
A mode that cannot run here is skipped with its reason; one that fails is recorded
with its error and the run goes on (the exit status is then 1).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from fastdet.config import ConfigError
from fastdet.engine.graph_cache import bucket_sizes, cache_counts, count_delta
from bench.common import (SCHEMA, PeakMemory, check_output_file, dynamo_counts, env_info, format_table,
                          fresh_dynamo, one_line, release_memory, summarize, sync, time_windows, write_json)

log = logging.getLogger("fastdet.bench")


@dataclass(frozen=True)
class StepVariant:
    compile: bool
    cuda_graphs: bool
    amp: bool  # autocast with --amp (False: fp32)
    channels_last: bool = False  # model and images in NHWC whatever --channels-last says
    shapes: str = "static"  # compile.shapes


STEP_VARIANTS: dict[str, StepVariant] = {
    "eager_fp32": StepVariant(compile=False, cuda_graphs=False, amp=False),
    "eager_amp": StepVariant(compile=False, cuda_graphs=False, amp=True),
    "compile": StepVariant(compile=True, cuda_graphs=False, amp=True),
    "compile_graphs": StepVariant(compile=True, cuda_graphs=True, amp=True),
    "eager_fp32_nhwc": StepVariant(compile=False, cuda_graphs=False, amp=False, channels_last=True),
    "eager_amp_nhwc": StepVariant(compile=False, cuda_graphs=False, amp=True, channels_last=True),
    "compile_nhwc": StepVariant(compile=True, cuda_graphs=False, amp=True, channels_last=True),
    "compile_dynamic": StepVariant(compile=True, cuda_graphs=False, amp=True, shapes="dynamic"),
}

GROUPS: dict[str, tuple[str, ...]] = {
    "step": ("step_eager_fp32", "step_eager_amp", "step_compile", "step_compile_graphs"),
    "layout": ("step_eager_fp32_nhwc", "step_eager_amp_nhwc", "step_compile_nhwc"),
    "data": ("data_torch", "data_dali"),
    "e2e": ("e2e_seed", "e2e_torch", "e2e_dali"),
    "warmup": ("step_compile_dynamic", "warmup_cold", "warmup_warm"),
}
ALL_MODES = GROUPS["step"] + GROUPS["layout"] + GROUPS["data"] + GROUPS["e2e"]
KNOWN_MODES = ALL_MODES + GROUPS["warmup"]
GROUP_OF = {m: g for g, ms in GROUPS.items() for m in ms}
# What --modes takes besides mode names (its help and its error list these).
GROUP_NAMES = (*GROUPS, "all")
# The row each mode's speedup is over: its group's baseline; a layout row's NCHW twin.
GROUP_BASELINES = {"step": "step_eager_fp32", "data": "data_torch", "e2e": "e2e_seed"}
BASELINE_OF = {m: GROUP_BASELINES[g] if g in GROUP_BASELINES else m.removesuffix("_nhwc")
               for m, g in GROUP_OF.items()}
BASELINE_OF.update(step_compile_dynamic="step_compile", warmup_cold=None, warmup_warm=None)

# Production defaults (the targets are stated for these, on one H200) and the
# small --quick configuration for a CPU. Without --quick, --img-size and --max-boxes
# default to the recipe's own (recipe_shape): its published input and box padding.
FULL = dict(img_size=None, batch_size=64, max_boxes=None, windows=5, iters=10, warmup=5, workers=16,
            demo_images=400)
QUICK = dict(img_size=128, batch_size=2, max_boxes=16, windows=3, iters=2, warmup=1, workers=2,
             demo_images=400)


# --------------------------------------------------------------------------- config

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/throughput.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true",
                   help="small configuration (128 px, batch 2, 3 windows of 2 iterations)")
    p.add_argument("--json", metavar="FILE", help="write the results and the environment as JSON "
                   "(an existing FILE only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace --json FILE if it exists")
    p.add_argument("--arch", default="ppyoloe")
    p.add_argument("--size", default="s")
    p.add_argument("--num-classes", type=int, default=80,
                   help="classes of the model in every mode (default 80, COCO); the dataset's "
                        "labels must be below it")
    p.add_argument("--img-size", type=parse_hw, metavar="N|HxW",
                   help="input size: N (square) or HxW, e.g. 800x1344 (default: the recipe's published "
                        "shape, e.g. 640, FCOS 800x1344; --quick 128)")
    p.add_argument("--batch-size", type=int, help="images per step (default 64; --quick 2)")
    p.add_argument("--max-boxes", type=int,
                   help="M of the padded ground truth (default: the recipe's data.max_boxes; --quick 16)")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="autocast dtype of the AMP and compiled modes (default auto, as the "
                        "trainer: bf16 on a GPU that supports it, fp32 on the CPU)")
    p.add_argument("--channels-last", action="store_true", help="model and images in channels-last")
    p.add_argument("--modes", default="all",
                   help=f"comma-separated modes or groups ({', '.join(GROUP_NAMES)}); default all")
    p.add_argument("--e2e-step", choices=sorted(STEP_VARIANTS), default=None,
                   help="step of e2e_torch / e2e_dali (default: compile_graphs on CUDA; on the CPU "
                        "eager_amp with an explicit --amp bf16/fp16, else eager_fp32)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled modes (default inductor, the "
                        "trainer's; 'aot_eager' or 'eager' only check that the modes run)")
    p.add_argument("--data", default="demo", metavar="demo|COCO_ROOT",
                   help="dataset of the data and e2e modes (default: the built-in demo set)")
    p.add_argument("--cache-dir", default=None,
                   help="where the demo set and image-check caches go (default: data.cache_dir, "
                        "~/.cache/fastdet)")
    p.add_argument("--demo-images", type=int,
                   help="training images of the demo set (default 400; generated once into the cache)")
    p.add_argument("--workers", type=int,
                   help="torch DataLoader workers / DALI threads (default 16; --quick 2)")
    p.add_argument("--windows", type=int, help="timed windows per mode (default 5; --quick 3)")
    p.add_argument("--iters", type=int, help="iterations per window (default 10; --quick 2)")
    p.add_argument("--warmup", type=int, help="untimed iterations after compilation (default 5; --quick 1)")
    p.add_argument("--epoch", type=int, default=0,
                   help="training epoch whose loss settings are used (the recipe's phase of that epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe-sizes", action="store_true",
                   help="warmup modes: the recipe's multi-scale size buckets (default: --img-size only)")
    p.add_argument("--precompile", action="store_true",
                   help="only compile the graphs of the compiled modes among --modes into inductor's "
                        "cache, by the same code the timed modes use, and exit (bench/gpu_check.sh runs "
                        "these in parallel, so its timed parts load every graph)")
    p.add_argument("--prepare-data", action="store_true",
                   help="only generate the demo set the data and e2e modes read (--demo-images), "
                        "print where it is and exit (bench/gpu_check.sh does this in the background)")
    args = p.parse_args(argv)
    if args.json and not args.prepare_data:  # --prepare-data writes no JSON
        try:
            check_output_file(args.json, "--json", args.overwrite)
        except ValueError as e:
            p.error(str(e))
    defaults = QUICK if args.quick else FULL
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    # Whatever --quick or --img-size / --max-boxes set: an unknown --arch / --size is said
    # here, not as a traceback once a mode builds its model.
    try:
        hw, boxes = recipe_shape(args.arch, args.size)
    except ConfigError as e:
        p.error(str(e))
    args.img_size = args.img_size or hw
    args.max_boxes = args.max_boxes or boxes
    if isinstance(args.img_size, int):
        args.img_size = (args.img_size, args.img_size)
    for k in ("batch_size", "max_boxes", "windows", "iters", "workers", "demo_images", "num_classes"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if any(x < 1 or x % 32 for x in args.img_size):
        p.error(f"--img-size must be a multiple of 32 (the largest stride), got {hw_name(args.img_size)}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu)")
    try:
        args.modes = parse_modes(args.modes)
    except ValueError as e:
        p.error(str(e))
    if args.e2e_step is None:
        if args.device == "cuda":
            args.e2e_step = "compile_graphs"
        else:
            args.e2e_step = "eager_fp32" if args.amp in ("off", "auto") else "eager_amp"
    return args


def parse_hw(text: str) -> tuple[int, int]:
    """``640`` -> (640, 640); ``800x1344`` -> (800, 1344): height x width."""
    parts = text.lower().split("x")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        h, w = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or HxW, e.g. 640 or 800x1344, got {text!r}") from None
    return h, w


def hw_name(hw: tuple[int, int]) -> str:
    return str(hw[0]) if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"


def recipe_shape(arch: str, size: str) -> tuple[tuple[int, int], int]:
    """The recipe's published training input (H, W) and its box padding (data.max_boxes):
    its first size bucket at ``data.img_size`` (a square, or for keep-ratio resizing its
    landscape canvas, FCOS's 800x1344) and the M its loader pads the ground truth to."""
    from fastdet.config import apply_overrides
    from fastdet.registry import get_preset

    cfg = get_preset(arch, size)
    one = apply_overrides(cfg, {"data.train_sizes": (cfg.data.img_size,), "data.multiscale": False})
    return bucket_sizes(one)[0], cfg.data.max_boxes


def parse_modes(spec: str) -> list[str]:
    chosen: list[str] = []
    for item in (s.strip() for s in spec.replace(" ", ",").split(",")):
        if not item:
            continue
        names = ALL_MODES if item == "all" else GROUPS.get(item, (item,))
        for n in names:
            if n not in KNOWN_MODES:
                raise ValueError(f"--modes: unknown mode {n!r}; modes are {', '.join(KNOWN_MODES)} "
                                 f"(or the groups {', '.join(GROUP_NAMES)})")
            if n not in chosen:
                chosen.append(n)
    if not chosen:
        raise ValueError("--modes: nothing to run")
    if "step_compile_dynamic" in chosen and "step_compile" not in chosen:
        chosen.append("step_compile")  # its baseline, measured in the same run
    return [m for m in KNOWN_MODES if m in chosen]  # always step, layout, data, e2e, warmup order


def amp_name(dtype: torch.dtype | None) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class Bench:
    """One benchmark run: the shared config, the dataset (loaded once) and the rows."""

    def __init__(self, args: argparse.Namespace):
        from fastdet.config import apply_overrides
        from fastdet.runtime.amp import backend_flags, resolve_amp
        from fastdet.registry import get_preset

        self.args = args
        self.device = torch.device(args.device)
        self.amp_dtype = resolve_amp(args.amp, self.device)
        cfg = get_preset(args.arch, args.size)
        if args.cache_dir is not None:
            cfg = apply_overrides(cfg, {"data.cache_dir": args.cache_dir})
        # The data and e2e modes' loader works at the short side (keep-ratio families make
        # their canvases from it); the step modes at --img-size's H x W.
        self.cfg = apply_overrides(cfg, {
            "model.num_classes": args.num_classes,
            "data.data": args.data,
            "data.img_size": min(args.img_size),
            "data.train_sizes": (min(args.img_size),),
            "data.multiscale": False,
            "data.batch_size": args.batch_size,
            "data.max_boxes": args.max_boxes,
            "data.num_workers": args.workers,
            "data.channels_last": args.channels_last,
            "run.device": args.device,
            "run.seed": args.seed,
        })
        self.dataset = None
        self.rows: list[dict[str, Any]] = []
        self.env: dict[str, Any] = {}
        # cuDNN benchmark and TF32 as the trainer sets them (before env_info records them).
        self.backend_flags = backend_flags(self.device, self.cfg.compile.tf32)

    # ------------------------------------------------------------------ pieces
    def variant_dtype(self, v: StepVariant) -> torch.dtype | None:
        return self.amp_dtype if v.amp else None

    def variant(self, name: str) -> StepVariant:
        """The step variant ``name`` with ``--channels-last`` applied (a layout mode is NHWC anyway)."""
        v = STEP_VARIANTS[name]
        return replace(v, channels_last=v.channels_last or self.args.channels_last)

    def repeats_seed_step(self, v: StepVariant) -> bool:
        """Whether ``v`` runs as e2e_seed's step does (eager fp32, its layout)."""
        seed = self.variant("eager_fp32")
        return (self.variant_dtype(v) is None and not (v.compile or v.cuda_graphs)
                and v.channels_last == seed.channels_last)

    def skip_reason(self, v: StepVariant) -> str | None:
        if v.cuda_graphs and self.device.type != "cuda":
            return "CUDA graphs need a CUDA device (this run is on the CPU)"
        if v.cuda_graphs and self.amp_dtype == torch.float16:
            return "fp16's GradScaler syncs with the host every step, which CUDA graphs cannot capture"
        if v.amp and not v.compile and self.amp_dtype is None:
            return (f"--amp {self.args.amp} is fp32 on the {self.device.type.upper()}, so eager AMP "
                    "would repeat step_eager_fp32 (pass --amp bf16 to measure autocast)")
        return None

    def step_config(self, v: StepVariant):
        """The run's config with the step variant's settings (compile, CUDA graphs, AMP,
        layout, dynamic shapes) and ``--compile-backend``: what ``build_train_step`` reads.
        Another backend than inductor ('aot_eager', 'eager') only checks that the mode runs."""
        from fastdet.config import apply_overrides

        return apply_overrides(self.cfg, {
            "compile.compile": v.compile, "compile.cuda_graphs": v.cuda_graphs,
            "compile.amp": self.args.amp if v.amp else "off",
            "compile.backend": self.args.compile_backend, "compile.shapes": v.shapes,
            "data.channels_last": v.channels_last,
        })

    def build_step(self, v: StepVariant):
        """Model, optimizer, EMA and TrainStep built by the trainer's ``build_train_step``.

        Returns (model, step, lr_schedule, loss_kwargs)."""
        from fastdet import registry
        from fastdet.engine.optim import LRSchedule
        from fastdet.engine.step import build_train_parts, build_train_step

        cfg, dev = self.step_config(v), self.device
        torch.manual_seed(self.args.seed)
        parts = build_train_parts(cfg, dev)
        step = build_train_step(cfg, dev, parts=parts)
        # steps_per_epoch only shapes the schedule; the LR value does not change the cost.
        schedule = LRSchedule.from_config(cfg.optim, parts.base_lr, steps_per_epoch=1000)
        return parts.model, step, schedule, registry.phase(cfg, self.args.epoch).loss_kwargs

    def warm_step(self, step, kw: dict[str, Any], v: StepVariant,
                  sizes: list[tuple[int, int]] | None = None) -> float:
        """Compile / capture the size buckets (TrainStep.warmup; default the one --img-size);
        seconds taken."""
        a = self.args
        t0 = time.perf_counter()
        step.warmup(sizes or [a.img_size], a.batch_size, a.max_boxes, [kw],
                    channels_last=v.channels_last)
        sync(self.device)
        return time.perf_counter() - t0

    def synthetic(self, v: StepVariant, n: int = 2) -> list[dict[str, torch.Tensor]]:
        """``n`` different random batches on the device (alternated, never all zeros)."""
        from fastdet.engine.step import synthetic_batch

        a = self.args
        gen = torch.Generator().manual_seed(a.seed + 1)
        return [synthetic_batch(a.batch_size, *a.img_size, a.max_boxes, self.device, gen,
                                v.channels_last) for _ in range(n)]

    def data_paths(self):
        """The training split of ``--data``; a demo set of ``--demo-images`` images other
        than the default 400 is generated (once) under the cache directory."""
        from fastdet.data.coco import coco_layout, resolve_data
        from fastdet.data.demo import DEFAULT_PARAMS, make_demo

        d = self.cfg.data
        if d.data == "demo" and self.args.demo_images != DEFAULT_PARAMS["num_train"]:
            root = Path(d.cache_dir).expanduser() / f"bench-demo-{self.args.demo_images}"
            return coco_layout(make_demo(root, num_train=self.args.demo_images, num_val=8))
        return resolve_data(d, splits=("train",))

    def load_dataset(self):
        if self.dataset is None:
            from fastdet.data.coco import load_coco

            from fastdet.data.formats import data_format, load_split

            d = self.cfg.data
            if data_format(d.data) == "coco":
                paths = self.data_paths()
                ds = load_coco(paths.train_ann, paths.train_images, train=True, keep_empty=d.keep_empty_train,
                               check_images=d.check_images, cache_dir=d.cache_dir)
            else:  # a YOLO data.yaml or a VOC root
                ds = load_split(d, "train")
            if ds.num_classes > self.cfg.model.num_classes:
                raise ValueError(f"{ds.ann_file}: {ds.num_classes} classes, more than "
                                 f"--num-classes {self.cfg.model.num_classes}")
            self.dataset = ds
            self.data_desc = {"train_ann": str(ds.ann_file), "images": len(ds.records),
                              "classes": ds.num_classes}
        return self.dataset

    def loader_cfg(self, backend: str, v: StepVariant):
        from fastdet.config import apply_overrides

        return apply_overrides(self.cfg, {"data.loader": backend, "data.channels_last": v.channels_last})

    def loader_skip_reason(self, backend: str) -> str | None:
        if backend != "dali":
            return None
        from fastdet.data.loader import dali_unavailable_reason

        return dali_unavailable_reason(self.device)

    # ------------------------------------------------------------------ modes
    def run_step_mode(self, name: str) -> dict[str, Any]:
        v = self.variant(name.removeprefix("step_"))
        row = self.new_row(name, dtype=self.variant_dtype(v), compile=v.compile, cuda_graphs=v.cuda_graphs,
                           channels_last=v.channels_last)
        reason = self.skip_reason(v)
        if reason:
            return self.skip(row, reason)
        a = self.args
        with fresh_dynamo(), PeakMemory(self.device) as mem:
            c0 = dynamo_counts()
            model, step, schedule, kw = self.build_step(v)
            batches = self.synthetic(v)
            cache0 = cache_counts()
            compile_s = self.warm_step(step, kw, v)
            # Whether the graph came from inductor's cache (a --precompile run's) or was compiled.
            row["inductor_cache"] = count_delta(cache0, cache_counts()) if v.compile else None
            k = 0

            def run(n: int) -> int:
                nonlocal k
                for _ in range(n):
                    step.optimizer.set_lr(schedule(k))
                    step(batches[k % len(batches)], kw)
                    k += 1
                row["losses"] = step.read_losses()  # the trainer's one host read per log interval
                return n * a.batch_size

            t0 = time.perf_counter()
            if a.warmup:
                run(a.warmup)
            sync(self.device)
            warm_s = compile_s + time.perf_counter() - t0
            c1 = dynamo_counts()
            stats = time_windows(lambda: run(a.iters), a.windows, self.device)
            c2 = dynamo_counts()
            del model, step, batches
        return self.finish(row, stats, mem, compile_s=compile_s, warmup_s=warm_s,
                           graphs=c1["graphs"] - c0["graphs"], graph_breaks=c1["graph_breaks"] - c0["graph_breaks"],
                           recompiles=c2["graphs"] - c1["graphs"])

    def run_data_mode(self, name: str) -> dict[str, Any]:
        """The loader alone, through ``bench/loaders.py``'s ``measure_loader``."""
        from bench.loaders import measure_loader

        backend = name.removeprefix("data_")
        row = self.new_row(name, loader=backend)
        reason = self.loader_skip_reason(backend)
        if reason:
            return self.skip(row, f"unavailable: {reason}")
        a = self.args
        ds = self.load_dataset()
        with PeakMemory(self.device) as mem:
            m = measure_loader(self.cfg, ds, backend, self.device, n_batches=a.windows * a.iters,
                               warmup=max(1, a.warmup), windows=a.windows, seed=a.seed)
        if "skipped" in m:
            return self.skip(row, f"unavailable: {m['skipped']}")
        stats = {**summarize(m["windows"]), "seconds": m["seconds"]}
        row["batches_per_epoch"] = m["batches_per_epoch"]
        # Epochs the warm-up and timed batches spanned beyond the first (a small dataset).
        row["epoch_restarts"] = (max(1, a.warmup) + a.windows * a.iters - 1) // m["batches_per_epoch"]
        row["loader_report"] = m.get("loader_report")
        return self.finish(row, stats, mem, warmup_s=m["startup_s"])

    def run_e2e_mode(self, name: str) -> dict[str, Any]:
        from fastdet.data.loader import build_train_loader
        from fastdet import registry

        backend, vname = {"e2e_seed": ("torch", "eager_fp32"), "e2e_torch": ("torch", self.args.e2e_step),
                          "e2e_dali": ("dali", self.args.e2e_step)}[name]
        v = self.variant(vname)
        row = self.new_row(name, loader=backend, step=vname, dtype=self.variant_dtype(v),
                           channels_last=v.channels_last,
                           compile=v.compile, cuda_graphs=v.cuda_graphs)
        reason = self.skip_reason(v)
        if reason:
            return self.skip(row, reason)
        if name == "e2e_torch" and self.repeats_seed_step(v):
            return self.skip(row, f"--e2e-step {vname} at fp32 is e2e_seed's configuration (measured there)")
        reason = self.loader_skip_reason(backend)
        if reason:
            return self.skip(row, f"unavailable: {reason}")
        a = self.args
        ds = self.load_dataset()
        with fresh_dynamo(), PeakMemory(self.device) as mem:
            c0 = dynamo_counts()
            model, step, schedule, kw = self.build_step(v)
            t0 = time.perf_counter()
            lcfg = self.loader_cfg(backend, v)
            # Every canvas the loader yields (FCOS's keep-ratio: landscape, portrait, square):
            # a captured step refuses a bucket it was not warmed up for.
            compile_s = (self.warm_step(step, kw, v, bucket_sizes(lcfg)) if (v.compile or v.cuda_graphs)
                         else 0.0)
            loader = build_train_loader(lcfg.data, ds, stages_for_epoch=lambda e: registry.phase(lcfg, e).stages, rank=0,
                                        world_size=1, device=self.device, seed=a.seed)
            stream = EpochStream(loader)
            k, data_wait = 0, 0.0

            def loop(n: int) -> int:
                """The trainer's inner loop: next batch, LR, step; losses read at the end."""
                nonlocal k, data_wait
                images = 0
                for _ in range(n):
                    t = time.perf_counter()
                    batch = next(stream)
                    data_wait += time.perf_counter() - t
                    step.optimizer.set_lr(schedule(k))
                    step(batch, kw)
                    images += batch["images"].shape[0]
                    k += 1
                row["losses"] = step.read_losses()
                return images

            loop(max(1, a.warmup))
            sync(self.device)
            warm_s = time.perf_counter() - t0
            c1 = dynamo_counts()
            data_wait = 0.0
            stats = time_windows(lambda: loop(a.iters), a.windows, self.device)
            row["data_wait_frac"] = data_wait / stats["seconds"]
            row["epoch_restarts"] = stream.restarts
            row["batches_per_epoch"] = len(loader)
            stream.close()
            del loader, stream
            # The same (warm) step on a synthetic batch already on the device: what the
            # loop would reach if data were free.
            batches = self.synthetic(v)

            def step_only() -> int:
                nonlocal k
                for _ in range(a.iters):
                    step.optimizer.set_lr(schedule(k))
                    step(batches[k % len(batches)], kw)
                    k += 1
                step.read_losses()
                return a.iters * a.batch_size

            only = time_windows(step_only, a.windows, self.device)
            c2 = dynamo_counts()
            row["step_only_images_per_s"] = only["median"]
            row["of_step"] = stats["median"] / only["median"]
            del model, step, batches
        return self.finish(row, stats, mem, compile_s=compile_s, warmup_s=warm_s,
                           graphs=c1["graphs"] - c0["graphs"], graph_breaks=c1["graph_breaks"] - c0["graph_breaks"],
                           recompiles=c2["graphs"] - c1["graphs"])

    # ------------------------------------------------------------------ rows
    def new_row(self, name: str, **what: Any) -> dict[str, Any]:
        if "dtype" in what:
            what["dtype"] = amp_name(what["dtype"])
        return {"mode": name, "group": GROUP_OF[name], "baseline": BASELINE_OF[name],
                "status": None, "reason": None, **what}

    @staticmethod
    def skip(row: dict[str, Any], reason: str) -> dict[str, Any]:
        row.update(status="skipped", reason=reason)
        return row

    def finish(self, row: dict[str, Any], stats: dict[str, Any], mem: PeakMemory, **extra: Any) -> dict[str, Any]:
        a = self.args
        row.update(status="ok", images_per_s=stats["median"], min_images_per_s=stats["min"],
                   max_images_per_s=stats["max"], spread_pct=stats["spread_pct"],
                   window_images_per_s=stats["windows"], windows=a.windows, iters_per_window=a.iters,
                   ms_per_iter=1000.0 * a.batch_size / stats["median"], timed_s=stats["seconds"],
                   peak_mem_mb=mem.mb, mem_kind=mem.kind, **extra)
        losses = row.get("losses") or {}
        if losses and not all(math.isfinite(x) for x in losses.values()):
            row.update(status="failed", reason=f"non-finite loss after the timed windows: {losses}")
        return row

    # ------------------------------------------------------------------ warmup modes
    def warmup_flags(self, cache: Path, out: Path) -> list[str]:
        """The training command's flags of this bench's configuration, on ``cache``."""
        a = self.args
        paths = self.data_paths()
        flags = ["--arch", a.arch, "--size", a.size, "--train-ann", str(paths.train_ann),
                 "--train-images", str(paths.train_images), "--val-ann", str(paths.train_ann),
                 "--val-images", str(paths.train_images), "--device", a.device,
                 "--batch-size", str(a.batch_size), "--max-boxes", str(a.max_boxes), "--amp", a.amp,
                 "--workers", str(a.workers), "--output-dir", str(out), "--compile",
                 "--set", f"compile.backend={a.compile_backend}", "--set", f"compile.cache_dir={cache}",
                 "--set", "run.eval_interval=1000000", "--set", "run.tensorboard=false"]
        if not a.recipe_sizes:
            flags += ["--img-size", str(min(a.img_size)), "--no-multiscale"]
        if a.channels_last:
            flags.append("--channels-last")
        return flags

    def _run(self, cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {r.returncode}: "
                               f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        return r, time.perf_counter() - t0

    def run_warmup_mode(self, name: str) -> dict[str, Any]:
        import tempfile

        row = self.new_row(name, compile=True, dtype=self.amp_dtype)
        if name == "step_compile_dynamic":
            return self.run_step_mode(name)
        root = Path(tempfile.mkdtemp(prefix="fastdet-bench-warmup-"))
        cache = Path(self.args.cache_dir or root).expanduser() / f"inductor-bench-{self.args.arch}-{self.args.size}"
        if name == "warmup_cold" and cache.exists():
            shutil.rmtree(cache)
        flags = self.warmup_flags(cache, root / "run")
        py = sys.executable
        first = re.compile(r"first step done ([\d.]+) s after start \((\w+)\)")
        per_graph = re.compile(r"graph \d+/(\d+) \(.*?\): ([\d.]+) s \(cache: (\d+) FX hit")
        if name == "warmup_cold":
            r, _ = self._run([py, "-m", "fastdet.train", *flags, "--max-steps", "1"])
            m = first.search(r.stdout)
            row.update(first_step_s=float(m.group(1)), first_step_kind=m.group(2))
            r, wall = self._run([py, "-m", "fastdet.compile", *flags])
        else:
            r, wall = self._run([py, "-m", "fastdet.compile", *flags])
        graphs = per_graph.findall(r.stderr)
        row.update(graphs=len(graphs), all_compiled_s=wall, graph_s=[float(g[1]) for g in graphs],
                   fx_hits=sum(int(g[2]) for g in graphs), cache_dir=str(cache))
        if name == "warmup_warm":
            r2, _ = self._run([py, "-m", "fastdet.train", *flags, "--max-steps", "1",
                               "--set", "compile.warmup=blocking"])
            m = first.search(r2.stdout)
            row.update(first_step_s=float(m.group(1)), first_step_kind=m.group(2))
        row.update(status="ok", warmup_s=row["first_step_s"],
                   note=f"{row['graphs']} graph(s); first step {row['first_step_s']:.1f} s "
                        f"({row['first_step_kind']}); every graph {'compiled' if name == 'warmup_cold' else 'loaded'} "
                        f"in {wall:.1f} s ({row['fx_hits']} FX cache hits)")
        shutil.rmtree(root / "run", ignore_errors=True)
        return row

    def precompile(self) -> list[dict[str, Any]]:
        """--precompile: each distinct compiled step among --modes, built and warmed up by
        the code its timed mode runs (so inductor's cache key is the same), without CUDA
        graphs (the capture replays the same inductor graph) and without timing."""
        todo: dict[tuple, tuple[StepVariant, list[tuple[int, int]] | None]] = {}
        for name in self.args.modes:
            group = GROUP_OF[name]
            if group in ("step", "layout"):
                v, sizes = self.variant(name.removeprefix("step_")), None
            elif group == "e2e" and name != "e2e_seed":
                v = self.variant(self.args.e2e_step)
                sizes = bucket_sizes(self.loader_cfg("torch", v))
            else:
                continue
            if v.compile and self.skip_reason(replace(v, cuda_graphs=False)) is None:
                v = replace(v, cuda_graphs=False)
                todo.setdefault((v, tuple(sizes or [self.args.img_size])), (v, sizes))
        rows = []
        for v, sizes in todo.values():
            t0 = time.perf_counter()
            row: dict[str, Any] = {"mode": "precompile", "dtype": amp_name(self.variant_dtype(v)),
                                   "channels_last": v.channels_last, "shapes": v.shapes,
                                   "sizes": [list(hw) for hw in (sizes or [self.args.img_size])]}
            try:
                with fresh_dynamo():
                    model, step, _, kw = self.build_step(v)
                    c0 = cache_counts()
                    row["compile_s"] = self.warm_step(step, kw, v, sizes)
                    row["inductor_cache"] = count_delta(c0, cache_counts())
                    del model, step
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - the timed mode then compiles it itself
                traceback.print_exc(file=sys.stderr)
                row.update(status="failed", reason=one_line(e))
            finally:
                release_memory(self.device)
            row["wall_s"] = time.perf_counter() - t0
            print(f"[precompile] {row['dtype']}{' nhwc' if v.channels_last else ''} {row['sizes']}: "
                  f"{row['status']} in {row['wall_s']:.1f} s {row.get('inductor_cache') or row.get('reason')}",
                  flush=True)
            rows.append(row)
        return rows

    def run_mode(self, name: str) -> dict[str, Any]:
        runner: Callable[[str], dict[str, Any]] = {
            "step": self.run_step_mode, "layout": self.run_step_mode, "data": self.run_data_mode,
            "e2e": self.run_e2e_mode, "warmup": self.run_warmup_mode,
        }[GROUP_OF[name]]
        t0 = time.perf_counter()
        try:
            row = runner(name)
        except Exception as e:  # noqa: BLE001 - one failed mode must not lose the others
            traceback.print_exc(file=sys.stderr)
            row = self.new_row(name)
            row.update(status="failed", reason=one_line(e))
        finally:
            release_memory(self.device)
        if row["status"] is None:
            row["status"] = "ok"
        row["wall_s"] = time.perf_counter() - t0
        return row

    def add_speedups(self) -> None:
        by_mode = {r["mode"]: r for r in self.rows}
        for r in self.rows:
            base = by_mode.get(r["baseline"])
            ok = r["status"] == "ok" and base is not None and base["status"] == "ok"
            r["speedup"] = r["images_per_s"] / base["images_per_s"] if ok else None

    def document(self) -> dict[str, Any]:
        a = self.args
        return {
            "schema": SCHEMA,
            "kind": "throughput",
            "command": " ".join(sys.argv),
            "env": self.env,
            "config": {
                "arch": a.arch, "size": a.size, "num_classes": a.num_classes, "img_size": min(a.img_size),
                "hw": list(a.img_size), "backend_flags": self.backend_flags,
                "batch_size": a.batch_size, "max_boxes": a.max_boxes, "amp": amp_name(self.amp_dtype),
                "channels_last": a.channels_last, "compile_backend": a.compile_backend,
                "e2e_step": a.e2e_step, "loss_kwargs_epoch": a.epoch, "warmup_iters": a.warmup,
                "windows": a.windows, "iters_per_window": a.iters, "workers": a.workers,
                "quick": a.quick, "modes": a.modes, "data": a.data,
                "dataset": getattr(self, "data_desc", None),
                "augment": self.cfg.data.augment, "multiscale": False,
            },
            "results": self.rows,
            "targets": targets(self.rows, self),
            # The machine's load when the run started and now: figures taken under load are not
            # the code's (see each row's spread_pct and reliable).
            "machine_load": {"start": getattr(self, "load_start", None), "end": machine_load()},
        }


class EpochStream:
    """Batches of a training loader without end: a finished pass starts the next epoch
    (``set_epoch``), as the trainer does; ``restarts`` counts how often."""

    def __init__(self, loader: Any):
        self.loader, self.epoch, self.restarts = loader, 0, 0
        self.loader.set_epoch(0)
        self._it: Iterator[Any] = iter(loader)

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self._it, None)
        if batch is None:
            self.epoch += 1
            self.restarts += 1
            self.loader.set_epoch(self.epoch)
            self._it = iter(self.loader)
            batch = next(self._it)
        return batch

    def close(self) -> None:
        self._it = iter(())
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


# --------------------------------------------------------------------------- targets

def targets(rows: list[dict[str, Any]], bench: Bench) -> list[dict[str, Any]]:
    """The issue's targets, evaluated on what this run measured (None: not measured).
    They are stated for one H200 at PPYOLOE-s, 640, bf16, batch 64 (``applies``)."""
    r = {x["mode"]: x for x in rows if x["status"] == "ok"}
    a = bench.args

    def ratio(m1: str, m2: str, key: str = "images_per_s") -> float | None:
        return r[m1][key] / r[m2][key] if m1 in r and m2 in r else None

    def value(m: str, key: str) -> float | None:
        return r[m].get(key) if m in r else None

    gpu = bench.env.get("gpu") or {}
    applies = (bench.device.type == "cuda" and "H200" in str(gpu.get("name")) and a.arch == "ppyoloe"
               and a.size == "s" and a.img_size == (640, 640) and a.batch_size == 64
               and bench.amp_dtype == torch.bfloat16 and a.compile_backend == "inductor")
    def spread(*modes: str) -> float | None:
        return sum(r[m]["spread_pct"] for m in modes) if all(m in r for m in modes) else None

    out = []
    for name, got, want, modes in (
        ("step_compile_graphs / step_eager_amp", ratio("step_compile_graphs", "step_eager_amp"), 1.5,
         ("step_compile_graphs", "step_eager_amp")),
        ("step_compile_graphs / step_eager_fp32", ratio("step_compile_graphs", "step_eager_fp32"), 5.0,
         ("step_compile_graphs", "step_eager_fp32")),
        ("e2e_dali / its step only (of_step)", value("e2e_dali", "of_step"), 0.9, ("e2e_dali",)),
        ("e2e_dali images/s", value("e2e_dali", "images_per_s"), 2000.0, ("e2e_dali",)),
        (f"data_dali / data_torch ({a.workers} workers)", ratio("data_dali", "data_torch"), 3.0,
         ("data_dali", "data_torch")),
    ):
        out.append({"target": name, "value": got, "at_least": want, "applies": applies,
                    "spread_pct": spread(*modes), **verdict(got, want, spread(*modes), applies)})
    return out


def verdict(got: float | None, want: float, spread_pct: float | None, applies: bool) -> dict[str, Any]:
    """``met`` (True / False / None) and ``verdict`` of one target. None and "not checked"
    where the target is stated for another machine or setting, or nothing was measured;
    "within noise" (met None) where the value's own spread reaches across the target: the
    figures' spreads summed, as a fraction of the value, is its uncertainty here."""
    if got is None:
        return {"met": None, "verdict": "not measured"}
    if not applies:
        return {"met": None, "verdict": "not checked (stated for another machine or setting)"}
    u = got * (spread_pct or 0.0) / 100.0
    if abs(got - want) <= u:
        return {"met": None, "verdict": f"within noise (+/- {u:.2g})"}
    return {"met": bool(got >= want), "verdict": "met" if got >= want else "MISSED"}


# A figure whose windows differ by more than this (percent of the median) is not a
# measurement of the code but of the machine (other processes, clocks): it is flagged.
UNRELIABLE_SPREAD_PCT = 10.0


def reliability(row: dict[str, Any]) -> str:
    """The note on an ok row's spread: "" or why its figure cannot be trusted."""
    if row.get("status") != "ok" or row.get("spread_pct") is None:
        return ""
    if not math.isfinite(row["spread_pct"]) or row["spread_pct"] > UNRELIABLE_SPREAD_PCT:
        return (f"UNRELIABLE: spread {row['spread_pct']:.0f}% > {UNRELIABLE_SPREAD_PCT:g}% "
                "(a busy machine? rerun on an idle one, or with more --windows)")
    return ""


def machine_load() -> dict[str, Any]:
    """The 1/5/15-minute load averages and the CPU count, to read the figures against."""
    try:
        load = list(os.getloadavg())
    except OSError:  # not on this platform
        load = None
    return {"loadavg_1_5_15": load, "cpus": os.cpu_count()}


# --------------------------------------------------------------------------- output

COLUMNS = (
    ("mode", "mode", ""),
    ("what", "what", ""),
    ("images_per_s", "img/s", ".1f"),
    ("spread_pct", "spread%", ".1f"),
    ("speedup", "speedup", ".2f"),
    ("of_step", "of step", ".2f"),
    ("peak_mem_mb", "peak MB", ".0f"),
    ("warmup_s", "warm-up s", ".1f"),
    ("recompiles", "recomp", "d"),
    ("note", "note", ""),
)


def describe(row: dict[str, Any]) -> str:
    if row["group"] == "data":
        return f"loader {row.get('loader')}"
    if row["status"] == "skipped" and row["group"] in ("step", "layout"):
        return row["mode"].removeprefix("step_")
    parts = []
    if row["group"] == "e2e":
        parts.append(f"{row.get('loader')} +")
    parts.append("compiled" if row.get("compile") else "eager")
    if row.get("cuda_graphs"):
        parts.append("+graphs")
    if row.get("dtype"):
        parts.append(row["dtype"])
    if row.get("channels_last"):
        parts.append("nhwc")
    return " ".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    shown = []
    for r in rows:
        note = r["reason"] or (r.get("note") if r["status"] == "ok" else None) or ""
        if r["status"] == "ok" and r.get("epoch_restarts"):
            note = f"{r['epoch_restarts']} epoch restart(s) in the timed windows"
        if r["status"] == "ok" and r.get("data_wait_frac") is not None:
            note = (note + "; " if note else "") + f"data wait {100 * r['data_wait_frac']:.0f}%"
        if reliability(r):
            note = reliability(r) + ("; " + note if note else "")
        shown.append({**r, "what": describe(r), "note": f"{r['status'].upper()}: {note}"
                      if r["status"] != "ok" else note})
    return format_table(shown, COLUMNS)


def env_line(env: dict[str, Any]) -> str:
    dev = env["gpu"]["name"] if env.get("gpu") else f"CPU {env['cpu']['model']} ({env['cpu']['torch_threads']} threads)"
    return (f"{dev} | torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}) | triton "
            f"{env['triton']} | DALI {env['dali']} | {env['date']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    bench = Bench(args)
    if args.prepare_data:
        print(bench.data_paths().train_ann.parent.parent)
        return 0
    bench.env = env_info(bench.device)
    if args.precompile:
        rows = bench.precompile()
        if args.json:
            write_json(args.json, {**bench.document(), "kind": "precompile", "results": rows, "targets": []})
        return 1 if any(r["status"] != "ok" for r in rows) else 0
    bench.load_start = machine_load()
    print(env_line(bench.env), flush=True)
    print(f"{args.arch}-{args.size}, {hw_name(args.img_size)} px, batch {args.batch_size}, "
          f"{args.max_boxes} boxes, amp "
          f"{amp_name(bench.amp_dtype)}, {args.windows} windows x {args.iters} iterations after "
          f"{args.warmup} warm-up; modes: {', '.join(args.modes)}", flush=True)
    for name in args.modes:
        print(f"[{name}] ...", flush=True)
        row = bench.run_mode(name)
        bench.rows.append(row)
        bench.add_speedups()
        if row["status"] != "ok":
            msg = row["reason"]
        elif "images_per_s" in row:
            row["reliable"] = not reliability(row)
            msg = (f"{row['images_per_s']:.1f} img/s (spread {row['spread_pct']:.1f}%)"
                   + (f"; {reliability(row)}" if reliability(row) else ""))
        else:  # a warmup row: its times
            msg = row.get("note", "")
        print(f"[{name}] {row['status']}: {msg} ({row['wall_s']:.1f} s)", flush=True)
        if args.json:
            write_json(args.json, bench.document())
    doc = bench.document()
    if args.json:
        write_json(args.json, doc)
    print()
    print(table(bench.rows))
    print()
    measured = [t for t in doc["targets"] if t["value"] is not None]
    if measured and not measured[0]["applies"]:
        print("targets not checked: they are stated for one H200 at ppyoloe-s/640/bf16/batch 64/inductor, "
              f"and this run is {env_line(bench.env).split(' | ')[0]} at {args.arch}-{args.size}/"
              f"{hw_name(args.img_size)}/{amp_name(bench.amp_dtype)}/batch {args.batch_size}")
    elif measured:
        print("targets:")
        for t in measured:
            print(f"  {t['target']}: {t['value']:.2f} (>= {t['at_least']:g}: {t['verdict']})")
    load = doc["machine_load"]
    if load["end"]["loadavg_1_5_15"]:
        print(f"machine load (1 min) {load['start']['loadavg_1_5_15'][0]:.1f} at the start, "
              f"{load['end']['loadavg_1_5_15'][0]:.1f} at the end, on {load['end']['cpus']} CPU(s)")
    if args.json:
        print(f"\nwritten: {args.json}")
    return 1 if any(r["status"] == "failed" for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
