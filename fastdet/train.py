"""``python -m fastdet.train``: parse the command line, resolve the config, train.

Examples::

    python -m fastdet.train --arch ppyoloe --size s --data demo
    python -m fastdet.train --arch ppyoloe --size l --data /data/coco --compile --cuda-graphs
    torchrun --nproc_per_node 8 -m fastdet.train --arch ppyoloe --size s --data /data/coco --compile
    python -m fastdet.train ... --set optim.base_lr=0.01 --set data.max_boxes=120
    python -m fastdet.train ... --set family.static_assigner_epoch=30   # the family's own options
    python -m fastdet.train --arch ppyoloe --size s --print-config      # every field, resolved
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from fastdet import registry
from fastdet.config import Config, ConfigError, RunConfig, apply_overrides, parse_set_args
from fastdet.data.augment import ImageDecodeError
from fastdet.data.coco import DataError
from fastdet.data.formats import train_num_classes
from fastdet.data.loader import BACKENDS as LOADERS, train_sizes
from fastdet.data.schedule import LoaderError
from fastdet.data.torch_backend import worker_death
from fastdet.engine.compile_workers import CompileError
from fastdet.engine.faults import EXIT_PREEMPTED, DeviceOutOfMemory, Preempted, config_mismatch
from fastdet.engine.optim import OPTIMIZERS, SCHEDULES
from fastdet.models.recipe import check_postprocess
from fastdet.engine.rundir import holds_run
from fastdet.engine.trainer import TrainingError, train
from fastdet.models import ARCHITECTURES
from fastdet.models.detector import Detector
from fastdet.ops.ema import EMA_FLAVOURS
from fastdet.convert.core import convert_weights, is_fastdet_checkpoint
from fastdet.runtime.checkpoint import (CheckpointWriteError, load_checkpoint, load_torch_file, load_with_fallback,
                                        previous_path, read_weights, weight_file_format)
from fastdet.runtime.logging import ProfilerWindow

# flag -> (config key, argparse kwargs). Each flag is a shortcut for --set key=value.
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--data": ("data.data", dict(metavar="demo|COCO_ROOT|data.yaml|VOC_ROOT",
                                  help="'demo' (built in), a COCO root, a YOLO data.yaml or a VOC root")),
    "--train-ann": ("data.train_ann", dict(metavar="JSON", help="COCO instances file of the training set "
                                           "(without --data: give all four of these paths)")),
    "--val-ann": ("data.val_ann", dict(metavar="JSON", help="COCO instances file of the validation set")),
    "--train-images": ("data.train_images", dict(metavar="DIR", help="folder the training file_names are in")),
    "--val-images": ("data.val_images", dict(metavar="DIR", help="folder the validation file_names are in")),
    "--loader": ("data.loader", dict(choices=["dali", "torch", "auto"],
                                     help="auto: DALI on CUDA when installed, else the torch DataLoader")),
    "--batch-size": ("data.batch_size", dict(type=int, help="images per process")),
    "--img-size": ("data.img_size", dict(type=int, help="training and evaluation size: the recipe's multi-scale "
                                         "training sizes move with it (--no-multiscale: this size only)")),
    "--workers": ("data.num_workers", dict(type=int, help="loader worker processes per rank")),
    "--max-boxes": ("data.max_boxes", dict(type=int, help="ground-truth boxes kept per image (the largest)")),
    "--epochs": ("optim.epochs", dict(type=int, help="epochs of the schedule")),
    "--lr": ("optim.base_lr", dict(type=float, help="base LR for optim.ref_batch images")),
    "--device": ("run.device", dict(choices=["cpu", "cuda", "auto"], help="auto: CUDA when available")),
    "--amp": ("compile.amp", dict(choices=["bf16", "fp16", "off", "auto"],
                                  help="mixed precision (auto: bf16 on GPUs that have it, off on the CPU)")),
    "--max-steps": ("run.max_steps", dict(type=int, help="stop after this many steps (0: the whole schedule)")),
    "--output-dir": ("run.output_dir", dict(metavar="DIR", help="the run's directory (default runs/{arch}_{size}; "
                                            "one holding another run gets a number: runs/ppyoloe_s2)")),
    "--backbone-weights": ("model.backbone_weights", dict(
        metavar="PATH", help="start the backbone from this local state dict (FCOS: a torchvision ResNet-50's)")),
    "--ckpt": ("run.ckpt", dict(metavar="PATH", help="fine-tune from these weights (with --resume: resume from it)")),
    "--seed": ("run.seed", dict(type=int, help="random seed (runs repeat exactly)")),
    "--log-interval": ("run.log_interval", dict(type=int, help="steps between log lines")),
    "--eval-interval": ("run.eval_interval", dict(type=int, help="epochs between evaluations (the last is always)")),
    "--ckpt-interval-steps": ("run.ckpt_interval_steps", dict(type=int,
                                                              help="also write latest.pth every N steps")),
    "--ckpt-interval-minutes": ("run.ckpt_interval_minutes", dict(
        type=float, metavar="MIN", help="also write latest.pth after this much training time (default 5; 0: off)")),
    "--dist-timeout": ("run.dist_timeout_minutes", dict(
        type=float, metavar="MIN", help="torchrun: how long ranks wait for each other in a collective, e.g. "
                                        "while rank 0 scores COCO (default 30)")),
    "--profile-steps": ("run.profile_steps", dict(metavar="A:B", help="bracket steps A..B-1 with cudaProfilerStart/Stop")),
}
SWITCHES: dict[str, tuple[str, Any, str]] = {
    "--compile": ("compile.compile", True, "torch.compile the model-with-loss (fullgraph)"),
    "--cuda-graphs": ("compile.cuda_graphs", True, "capture the whole step in CUDA graphs (CUDA only)"),
    "--sync-debug": ("run.sync_debug", True,
                     "CUDA: fail on any host sync inside a training step after warm-up (a check)"),
    "--tf32": ("compile.tf32", True, "allow TF32 in convolutions and matmuls on CUDA (off by default)"),
    "--exist-ok": ("run.exist_ok", True, "write into --output-dir even if it holds another run "
                   "(otherwise a new run goes to the next numbered directory, e.g. runs/ppyoloe_s2)"),
    "--nvtx": ("run.nvtx", True, "NVTX ranges around data, forward, backward, optimizer, EMA"),
    "--channels-last": ("data.channels_last", True,
                        "model and images in channels-last (NHWC); bench/throughput.py --modes layout measures it"),
    "--no-multiscale": ("data.multiscale", False, "train at --img-size only"),
    "--no-augment": ("data.augment", False, "no data augmentation"),
    "--no-ema": ("optim.ema", False, "train without an EMA of the weights"),
    "--ckpt-partial": ("run.ckpt_partial", True,
                       "with --ckpt from another family or size: load the tensors that fit, start the rest fresh"),
    "--freeze-backbone": ("model.freeze_backbone", True,
                          "keep the backbone as it starts (from --ckpt or --backbone-weights): no gradient, no "
                          "optimizer state, BatchNorm statistics fixed; the neck and head train (fine-tuning on "
                          "a small set)"),
    "--sync-bn": ("model.sync_bn", True,
                  "under torchrun: BatchNorm statistics over every rank's batch (on in the presets "
                  "of PP-YOLOE and PP-YOLO; works with --compile)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastdet.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=None, help=f"architecture, one of {', '.join(sorted(_archs()))} "
                   f"(default {DEFAULT_ARCH}; with --resume: the run's)")
    p.add_argument("--size", default=None, help="model size: " + "; ".join(
        f"{a}: {', '.join(sizes)}" for a, sizes in _archs().items()) + f" (default {DEFAULT_SIZE}, or the family's "
        "first where it has no s)")
    for flag, (_, kw) in FLAGS.items():
        p.add_argument(flag, default=None, **kw)
    for flag, (_, _, help_) in SWITCHES.items():
        p.add_argument(flag, action="store_true", help=help_)
    p.add_argument("--resume", nargs="?", const="yes", choices=["auto", "yes"], default=None,
                   metavar="auto",
                   help="continue the run in --output-dir from latest.pth; --resume auto: continue it "
                        "if latest.pth is there (and of this config), else start it (what torchrun "
                        "restarts do)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set optim.base_lr=0.01 (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


DEFAULT_ARCH, DEFAULT_SIZE = "ppyoloe", "s"
# The explicit dataset paths: without --data they are the dataset, all four needed.
DATA_PATH_FLAGS = ("--train-ann", "--train-images", "--val-ann", "--val-images")
# What a resumed run may change (everything else is the run's recipe, kept from its
# checkpoint): how long it runs, how often it logs, evaluates and checkpoints, and the
# machinery (device, workers, loader, compile, profiling) that does not change the maths.
RESUMABLE = frozenset({
    "run.max_steps", "run.log_interval", "run.eval_interval", "run.ckpt_interval_steps",
    "run.device", "run.resume", "run.ckpt", "run.output_dir", "run.exist_ok", "run.nvtx",
    "run.profile_steps", "run.sync_debug", "run.progress", "run.tensorboard",
    "data.num_workers", "data.loader", "data.cache_dir", "data.eval_batch_size",
    "compile.compile", "compile.cuda_graphs", "compile.backend",
    "compile.warmup", "compile.shapes", "compile.workers", "compile.worker_nice", "compile.cache_dir",
    "run.ckpt_interval_minutes", "run.dist_timeout_minutes",
    "run.auto_resume",
    # The set's files, named again where they are now (moved, or another working directory):
    # a set of other classes is refused by the checkpoint's class check.
    "data.data", "data.train_ann", "data.val_ann", "data.train_images", "data.val_images",
})
# Config fields that name files: stored absolute, so a run resumes from any working directory.
PATH_KEYS = ("data.data", "data.train_ann", "data.val_ann", "data.train_images", "data.val_images")


def _archs() -> dict[str, tuple[str, ...]]:
    return {a: tuple(f.sizes) for a, f in sorted(ARCHITECTURES.items())}


def flag_of(key: str) -> str:
    """The flag that sets config ``key`` (``--set key=`` where none does)."""
    for flag, (k, _) in FLAGS.items():
        if k == key:
            return flag
    for flag, (k, _, _) in SWITCHES.items():
        if k == key:
            return flag
    return f"--set {key}="


def explicit_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``{"section.field": value}`` of the flags and --set given on the command line."""
    overrides: dict[str, Any] = {}
    for flag, (key, _) in FLAGS.items():
        v = getattr(args, flag.lstrip("-").replace("-", "_"))
        if v is not None:
            overrides[key] = v
    for flag, (key, value, _) in SWITCHES.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            overrides[key] = value
    if args.resume:
        overrides["run.auto_resume" if args.resume == "auto" else "run.resume"] = True
    overrides.update(parse_set_args(args.set))
    return overrides


def scaled_sizes(sizes: tuple[int, ...], ref: int, img_size: int, div: int = 32) -> tuple[int, ...]:
    """The recipe's training sizes around ``ref`` moved to around ``img_size`` (same ratios,
    multiples of ``div``): PP-YOLOE's 320..768 around 640 is 160..384 around 320."""
    return tuple(sorted({max(div, round(s * img_size / ref / div) * div) for s in sizes}))


def default_size(arch: str) -> str:
    """``s`` where the family has it, else its first size (FCOS: r50)."""
    sizes = ARCHITECTURES[arch].sizes if arch in ARCHITECTURES else (DEFAULT_SIZE,)
    return DEFAULT_SIZE if DEFAULT_SIZE in sizes else sizes[0]


def resolve_config(args: argparse.Namespace) -> Config:
    """The family's preset, then its demo overrides (for --data demo), then flags, then --set.
    With --resume: the run's stored config, with only the RESUMABLE fields taken from the flags."""
    overrides = explicit_overrides(args)
    for key in PATH_KEYS:
        if isinstance(overrides.get(key), str) and overrides[key] not in ("demo", ""):
            overrides[key] = str(Path(overrides[key]).expanduser().absolute())
    if overrides.get("run.resume"):
        return resolve_resume(args, overrides)
    arch = args.arch or DEFAULT_ARCH
    size = args.size or default_size(arch)
    cfg = registry.get_preset(arch, size)
    given = [f for f in DATA_PATH_FLAGS if FLAGS[f][0] in overrides]
    if given and "data.data" not in overrides:
        missing = [f for f in DATA_PATH_FLAGS if f not in given]
        if missing:
            raise ConfigError(f"{' '.join(missing)} missing: without --data, {', '.join(DATA_PATH_FLAGS)} "
                              "name the dataset and all four are needed (or give --data COCO_ROOT)")
    elif overrides.get("data.data", cfg.data.data) == "demo":
        cfg = apply_overrides(cfg, registry.demo_overrides(arch))
    ref_size, ref_sizes = cfg.data.img_size, cfg.data.train_sizes
    cfg = apply_overrides(cfg, overrides)
    if not cfg.data.multiscale:
        cfg = apply_overrides(cfg, {"data.train_sizes": (cfg.data.img_size,)})
    elif "data.img_size" in overrides and "data.train_sizes" not in overrides:
        cfg = apply_overrides(cfg, {"data.train_sizes": scaled_sizes(ref_sizes, ref_size, cfg.data.img_size)})
    return cfg


def resolve_resume(args: argparse.Namespace, overrides: dict[str, Any]) -> Config:
    """The config stored in the checkpoint being resumed; a flag that differs from it is a
    ConfigError naming it unless it is RESUMABLE."""
    if overrides.get("run.ckpt"):
        path = Path(overrides["run.ckpt"]).expanduser()
    else:
        out = overrides.get("run.output_dir") or RunConfig.output_dir.format(
            arch=args.arch or DEFAULT_ARCH, size=args.size or default_size(args.arch or DEFAULT_ARCH))
        path = Path(out).expanduser() / "latest.pth"
    fallback = not overrides.get("run.ckpt") and previous_path(path).is_file()
    if not path.is_file() and not fallback:
        raise ConfigError(f"--resume: no checkpoint at {path} (train once without --resume, "
                          "or name the run's directory with --output-dir)")
    try:
        # latest.pth damaged by a kill mid-write: the trainer resumes from latest.prev.pth.
        # mmap: only the config is read here (the trainer loads the tensors).
        ck = load_with_fallback(path, mmap=True)[0] if fallback else load_checkpoint(path, mmap=True)
        if not isinstance(ck, dict) or not isinstance(ck.get("config"), dict):
            raise ValueError("not a fastdet checkpoint (no stored config to resume)")
        stored = registry.config_from_dict(ck["config"])
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--resume: {path}: {e}") from None
    given = {"model.arch": args.arch, "model.size": args.size, **overrides}
    flags = {"model.arch": "--arch", "model.size": "--size"}
    cfg = stored
    for key, value in given.items():
        if value is None:
            continue
        new = apply_overrides(stored, {key: value})
        sec, name = key.split(".", 1)
        old_v, new_v = getattr(getattr(stored, sec), name), getattr(getattr(new, sec), name)
        if new_v != old_v and key not in RESUMABLE:
            flag = flags.get(key) or flag_of(key)
            shown = flag if flag in SWITCHES else f"{flag}{value}" if flag.endswith("=") else f"{flag} {value}"
            raise ConfigError(
                f"--resume: {shown} differs from the run's {key} {old_v} (stored in {path}); a resumed run keeps its config, only --max-steps, "
                "--log-interval, --eval-interval, --ckpt-interval-steps, --workers, --device, --loader, "
                "--compile, --cuda-graphs, the profiling flags and the data's paths may change: drop the flag, or "
                "start a new run")
        cfg = apply_overrides(cfg, {key: value})
    if not overrides.get("run.output_dir") and not overrides.get("run.ckpt"):
        cfg = apply_overrides(cfg, {"run.output_dir": str(path.parent)})
    check_resume_target(path, ck["config"], Path(cfg.run.output_dir).expanduser())
    # run.ckpt: the run's own fine-tuning source is not what it resumes from.
    return apply_overrides(cfg, {"run.resume": True, "run.exist_ok": False, "run.ckpt": overrides.get("run.ckpt")})


def check_resume_target(path: Path, config: dict[str, Any], out: Path) -> None:
    """``--resume --ckpt PATH --output-dir OUT``: OUT must be PATH's own directory, hold no
    run, or hold this run (its latest.pth of the same config); resumed into another run's
    directory, this run would cut that run's logs at its step and replace its checkpoints,
    and keep its latest.pth as this run's fallback. A ConfigError line otherwise."""
    if path.resolve().parent == out.resolve() or not holds_run(out):
        return
    theirs = out / "latest.pth"
    try:
        other = load_checkpoint(theirs, mmap=True).get("config") if theirs.is_file() else None
    except (ValueError, FileNotFoundError):
        other = None
    if isinstance(other, dict) and not config_mismatch(other, config):
        return
    raise ConfigError(f"--resume: {out} holds another run than {path}'s; resumed there, this run would cut that "
                      "run's logs and replace its checkpoints: give --output-dir a new or empty directory, or "
                      f"{path.parent}")


def check_config(cfg: Config) -> None:
    """Reject values that would fail late (an epoch in, at evaluation) or silently (0 steps),
    before any data is read: one ConfigError naming the flag."""
    div = Detector.size_divisor
    d, o = cfg.data, cfg.optim
    if d.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {d.batch_size}")
    # At least 1: a 0 here divides by zero (an interval, a period) or pads no boxes, an
    # epoch in or at the first evaluation. Each names the flag a user types, else the field.
    for value, name in ((d.eval_batch_size, "data.eval_batch_size"), (d.max_boxes, "--max-boxes"),
                        (d.size_period, "data.size_period"), (cfg.run.log_interval, "--log-interval"),
                        (cfg.run.eval_interval, "--eval-interval")):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    for value, name in ((d.num_workers, "--workers"), (cfg.run.max_steps, "--max-steps (0: the whole schedule)"),
                        (cfg.run.ckpt_interval_steps, "--ckpt-interval-steps (0: off)"),
                        (cfg.optim.warmup_steps, "optim.warmup_steps"), (cfg.optim.warmup_epochs, "optim.warmup_epochs")):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    if not 0 <= cfg.optim.ema_decay < 1:
        raise ConfigError(f"optim.ema_decay must be in [0, 1), got {cfg.optim.ema_decay}")
    if d.img_size < div or d.img_size % div:
        raise ConfigError(f"--img-size must be a positive multiple of {div} (the largest stride), "
                          f"got {d.img_size}")
    bad = [s for s in d.train_sizes if s < div or s % div]
    if bad:
        raise ConfigError(f"data.train_sizes must be positive multiples of {div}, got {bad[0]}")
    c = cfg.compile
    if c.warmup not in ("background", "blocking"):
        raise ConfigError(f"compile.warmup must be 'background' or 'blocking', got {c.warmup!r}")
    if c.shapes not in ("static", "dynamic"):
        raise ConfigError(f"compile.shapes must be 'static' or 'dynamic', got {c.shapes!r}")
    if c.workers < 0:
        raise ConfigError(f"compile.workers must be >= 0 (0: sized to the cores), got {c.workers}")
    if not 0 <= c.worker_nice <= 19:
        raise ConfigError(f"compile.worker_nice must be a niceness from 0 to 19, got {c.worker_nice}")
    if o.epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {o.epochs}")
    if cfg.run.dist_timeout_minutes <= 0:
        raise ConfigError(f"--dist-timeout must be positive (minutes), got {cfg.run.dist_timeout_minutes:g}")
    if cfg.run.ckpt_interval_minutes < 0:
        raise ConfigError(f"--ckpt-interval-minutes must be 0 (off) or positive, got "
                          f"{cfg.run.ckpt_interval_minutes:g}")
    _check_values(cfg)
    _check_frozen_backbone_starts_trained(cfg)
    _check_one_image_batch_norm(cfg)
    try:
        out = Path(cfg.run.output_dir.format(arch=cfg.model.arch, size=cfg.model.size)).expanduser()
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"--output-dir {cfg.run.output_dir}: it may name {{arch}} and {{size}}, not {e}") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} is a file, not a folder")
    _check_weight_files(cfg)


def _check_weight_files(cfg: Config) -> None:
    """--ckpt and --backbone-weights: files that can be read (not a folder, not a damaged
    archive), a --ckpt this run can start from, and not both at once: one ConfigError line."""
    if cfg.model.backbone_weights and not cfg.run.resume:
        if cfg.run.ckpt:
            # The model is built with the backbone file loaded, then --ckpt's weights are loaded over it.
            raise ConfigError(f"--backbone-weights {cfg.model.backbone_weights} and --ckpt {cfg.run.ckpt}: --ckpt's "
                              "weights include a backbone, which would replace the backbone file's; give one of them")
        try:
            weight_file_format(Path(cfg.model.backbone_weights).expanduser())
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--backbone-weights {e}") from None
    if cfg.run.ckpt:
        path = Path(cfg.run.ckpt).expanduser()
        try:
            fmt = weight_file_format(path)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--ckpt {e}") from None
        if not cfg.run.resume:
            check_same_model(path, fmt, cfg)


def _check_frozen_backbone_starts_trained(cfg: Config) -> None:
    """--freeze-backbone keeps the backbone as the run starts it: from scratch that is a
    random one, kept for the whole run. A resumed run starts from its checkpoint (which was
    refused so when it started); --resume auto may start the run, so it needs weights too."""
    if not cfg.model.freeze_backbone or cfg.run.ckpt or cfg.model.backbone_weights or cfg.run.resume:
        return
    fam = registry.family(cfg.model.arch)
    file = fam.recipe.backbone_files.get(cfg.model.size) if fam.recipe is not None else None
    backbone = f", --backbone-weights PATH (a pretrained backbone: {file})" if file else ""
    raise ConfigError(f"--freeze-backbone without --ckpt, --backbone-weights or --resume would keep a random "
                      f"backbone for the whole run: give --ckpt PATH (a trained detector's weights){backbone}, "
                      "or drop --freeze-backbone")


def _check_one_image_batch_norm(cfg: Config) -> None:
    """--batch-size 1 normalises BatchNorm over one image a rank: at a train size whose
    coarsest map is 1x1 that is one value per channel, which BatchNorm refuses in training
    ("Expected more than 1 value per channel", at the first step, after the data, the model
    and the compile). Found here by a forward on the meta device (no memory, under a second):
    the model of ``cfg`` in training mode on one image of the smallest train size."""
    d = cfg.data
    if d.batch_size != 1 or (cfg.model.sync_bn and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return  # SyncBatchNorm counts every rank's image
    size = min(train_sizes(d))
    try:
        with torch.device("meta"):
            registry.build_detector(cfg).train()(torch.empty(1, 3, size, size))
    except Exception as e:  # anything else (an op without a meta kernel) is the first step's to say
        if isinstance(e, ValueError) and "Expected more than 1 value per channel" in str(e):
            raise ConfigError(f"--batch-size 1: at train size {size} the model's BatchNorm sees one value per "
                              "channel of a 1x1 feature map and cannot train; use --batch-size 2 or more, or "
                              f"train sizes above {size}") from None


def _named(key: str) -> str:
    """How a message names config ``key``: its flag and the field (``--lr (optim.base_lr)``)."""
    flag = flag_of(key)
    return key if flag.startswith("--set") else f"{flag} ({key})"


def _check_values(cfg: Config) -> None:
    """Names and ranges a run only meets once it has started (a schedule, an optimizer, a
    loader looked up; a NaN learning rate, a negative decay): one ConfigError naming the field."""
    for section in ("data", "optim", "compile", "run", "model", "family"):
        values = getattr(cfg, section)
        items = values.items() if isinstance(values, dict) else vars(values).items()
        for name, v in items:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{_named(f'{section}.{name}')} must be a finite number, got {v}")
    o, d = cfg.optim, cfg.data
    names = {"optim.optimizer": (o.optimizer, OPTIMIZERS), "optim.schedule": (o.schedule, tuple(SCHEDULES)),
             "optim.ema_type": (o.ema_type, tuple(EMA_FLAVOURS)), "data.loader": (d.loader, LOADERS)}
    for key, (v, allowed) in names.items():
        if v not in allowed:
            raise ConfigError(f"{_named(key)} must be one of {', '.join(allowed)}, got {v!r}")
    ranges = {"optim.base_lr": (o.base_lr > 0, "positive"), "optim.ref_batch": (o.ref_batch >= 1, "at least 1"),
              "optim.weight_decay": (o.weight_decay >= 0, ">= 0"), "optim.momentum": (0 <= o.momentum < 1, "in [0, 1)"),
              "optim.beta2": (0 <= o.beta2 < 1, "in [0, 1)"), "optim.min_lr_ratio": (0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
              "optim.warmup_start_factor": (0 <= o.warmup_start_factor <= 1, "in [0, 1]"),
              "optim.gamma": (o.gamma > 0, "positive"), "optim.clip_grad_norm": (o.clip_grad_norm >= 0, ">= 0 (0: off)"),
              "optim.no_aug_epochs": (o.no_aug_epochs >= 0, ">= 0"),
              "run.seed": (cfg.run.seed >= 0, ">= 0")}
    for key, (ok, what) in ranges.items():
        if not ok:
            section, name = key.split(".")
            raise ConfigError(f"{_named(key)} must be {what}, got {getattr(getattr(cfg, section), name)}")
    try:
        check_postprocess(cfg.family)  # the family's post-processing, where it has one
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.run.profile_steps:
        try:
            ProfilerWindow.parse(cfg.run.profile_steps)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.run.device == "cpu":
            raise ConfigError("--profile-steps needs --device cuda (it drives the CUDA profiler API)")


def check_same_model(path: Path, fmt: str, cfg: Config) -> None:
    """Fine-tuning loads into the same family and size: a ConfigError naming both otherwise
    (its weights would mostly not fit, and training would start nearly from scratch), unless
    --ckpt-partial. A file that is not a fastdet checkpoint must be a released file of this
    family (converted when the model is built); its size is checked then, from the shapes."""
    ck = None
    if fmt == "torch":
        try:  # mmap: only the config is read, not the tensors
            ck = load_torch_file(path, mmap=True)
        except ValueError as e:  # damaged, or it needs code to unpickle: the reader's line
            raise ConfigError(f"--ckpt {e}") from None
    if not is_fastdet_checkpoint(ck):
        # Converted here as the model build will (names, class count, size from the shapes), so a
        # file that is none of this family's is one line before the data is read; the torch file
        # is memory-mapped, a Paddle pickle read whole.
        try:
            convert_weights(ck if fmt == "torch" else read_weights(path), path, cfg.model.arch,
                            None if cfg.run.ckpt_partial else cfg.model.size)
        except ValueError as e:  # ConvertError, or a Paddle pickle that is damaged or unsafe
            raise ConfigError(f"--ckpt {e}") from None
        return
    model = ck["config"].get("model")
    if cfg.run.ckpt_partial or not isinstance(model, dict) or "arch" not in model:
        return
    theirs, ours = (model.get("arch"), model.get("size")), (cfg.model.arch, cfg.model.size)
    if theirs != ours:
        partial = (", or --ckpt-partial to load the tensors that fit and start the rest fresh" if theirs[0] == ours[0]
                   else " (another family's weights do not fit this model)")
        raise ConfigError(f"--ckpt {path} holds {theirs[0]}-{theirs[1]} weights and this run trains "
                          f"{ours[0]}-{ours[1]}: pass --arch {theirs[0]} --size {theirs[1]}{partial}")


def with_dataset_classes(cfg: Config) -> tuple[Config, str]:
    """``cfg`` with ``model.num_classes`` of its training set (as training sets it), and a
    comment line when the set cannot be read."""
    try:
        n = train_num_classes(cfg.data)
    except (DataError, OSError, ValueError) as e:
        return cfg, f"# model.num_classes: set from the training set when it is read ({e})\n"
    return apply_overrides(cfg, {"model.num_classes": n}), ""


def main(argv: list[str] | None = None, hooks: Sequence[Any] = ()) -> int:
    """The command; ``hooks``: ``fastdet.engine.hooks.Hook`` objects the trainer calls at its
    named points (a launcher script's extra work, e.g. the tests' fault injection)."""
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        check_config(cfg)
    except ConfigError as e:
        _say_error(e)
        return 2
    if args.print_config:
        cfg, note = with_dataset_classes(cfg)
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False) + note)
        return 0
    try:
        stats = train(cfg, hooks)
    except (DataError, ConfigError, FileNotFoundError, ValueError, TrainingError, CompileError, LoaderError,
            ImageDecodeError, DeviceOutOfMemory, CheckpointWriteError) as e:
        _log_to_file_only(f"error: {e}")  # the terminal shows it once, on stderr
        _say_error(e)
        return 1
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"fastdet.train: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except RuntimeError as e:  # torch's SIGCHLD handler says a dead loader worker wherever the main thread is
        died = worker_death(e, cfg.data.num_workers)
        if died is None:
            raise
        _say_error(died)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        # A metrics, evaluation or TensorBoard write on a full disk (an append names no
        # file): one line; checkpoints say it themselves (CheckpointWriteError), and each is
        # written whole or not at all.
        where = f"cannot write {e.filename}" if e.filename else "a write of the run failed"
        _say_error(CheckpointWriteError(f"{where}: {e.strerror}; the run's checkpoints are whole (each is written "
                                        "to a temp file and renamed)"))
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, nothing saved
        print("fastdet.train: interrupted (nothing saved since the last checkpoint)", file=sys.stderr)
        return 130
    if stats and int(os.environ.get("RANK", "0")) == 0:  # once under torchrun
        print(f"COCO AP {stats['AP']:.4f}  AP50 {stats['AP50']:.4f}  AP75 {stats['AP75']:.4f}")
    return 0


# Errors every rank of a torchrun launch meets alike (they come from the command line, the
# config, the data files, a checkpoint, or losses averaged over the ranks): said by each
# node's first rank only, not once per rank. Others (a rank's own images, its compile)
# are said by every rank that meets them, with its rank.
_SAME_ON_EVERY_RANK = (ConfigError, DataError, FileNotFoundError, ValueError, TrainingError)


def _say_error(e: Exception) -> None:
    rank, local = os.environ.get("RANK"), os.environ.get("LOCAL_RANK", "0")
    if rank is None or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        print(f"fastdet.train: error: {e}", file=sys.stderr)
    elif not isinstance(e, _SAME_ON_EVERY_RANK):
        print(f"fastdet.train: error on rank {rank}: {e}", file=sys.stderr)
    elif local == "0":
        print(f"fastdet.train: error: {e}", file=sys.stderr)


def _log_to_file_only(msg: str) -> None:
    """``msg`` into the run's train.log (not on stdout, where it would repeat stderr's line)."""
    log = logging.getLogger("fastdet")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, msg, (), None)
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)


if __name__ == "__main__":
    sys.exit(main())
