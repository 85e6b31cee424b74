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
import logging
import sys
from pathlib import Path
from typing import Any

from fastdet.config import Config, ConfigError, apply_overrides, parse_set_args

# flag -> (config key, argparse kwargs). Each flag is a shortcut for --set key=value.
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--data": ("data.data", dict(metavar="demo|COCO_ROOT|data.yaml|VOC_ROOT",
                                  help="'demo' (built in), a COCO root, a YOLO data.yaml or a VOC root")),
    "--train-ann": ("data.train_ann", dict(metavar="JSON")),
    "--val-ann": ("data.val_ann", dict(metavar="JSON")),
    "--train-images": ("data.train_images", dict(metavar="DIR")),
    "--val-images": ("data.val_images", dict(metavar="DIR")),
    "--loader": ("data.loader", dict(choices=["dali", "torch", "auto"])),
    "--batch-size": ("data.batch_size", dict(type=int, help="images per process")),
    "--img-size": ("data.img_size", dict(type=int, help="evaluation size (and the training size with --no-multiscale)")),
    "--workers": ("data.num_workers", dict(type=int)),
    "--max-boxes": ("data.max_boxes", dict(type=int)),
    "--epochs": ("optim.epochs", dict(type=int)),
    "--lr": ("optim.base_lr", dict(type=float, help="base LR for optim.ref_batch images")),
    "--device": ("run.device", dict(choices=["cpu", "cuda", "auto"])),
    "--amp": ("compile.amp", dict(choices=["bf16", "fp16", "off", "auto"])),
    "--max-steps": ("run.max_steps", dict(type=int)),
    "--output-dir": ("run.output_dir", dict(metavar="DIR")),
    "--backbone-weights": ("model.backbone_weights", dict(
        metavar="PATH", help="start the backbone from this local state dict (FCOS: a torchvision ResNet-50's)")),
    "--ckpt": ("run.ckpt", dict(metavar="PATH", help="fine-tune from these weights (with --resume: resume from it)")),
    "--seed": ("run.seed", dict(type=int)),
    "--log-interval": ("run.log_interval", dict(type=int)),
    "--eval-interval": ("run.eval_interval", dict(type=int)),
    "--ckpt-interval-steps": ("run.ckpt_interval_steps", dict(type=int)),
    "--profile-steps": ("run.profile_steps", dict(metavar="A:B", help="bracket steps A..B-1 with cudaProfilerStart/Stop")),
}
SWITCHES: dict[str, tuple[str, Any, str]] = {
    "--compile": ("compile.compile", True, "torch.compile the model-with-loss (fullgraph)"),
    "--cuda-graphs": ("compile.cuda_graphs", True, "capture the whole step in CUDA graphs (CUDA only)"),
    "--sync-debug": ("run.sync_debug", True,
                     "CUDA: fail on any host sync inside a training step after warm-up (a check)"),
    "--tf32": ("compile.tf32", True, "allow TF32 in convolutions and matmuls on CUDA (off by default)"),
    "--resume": ("run.resume", True, "continue the run in --output-dir from latest.pth"),
    "--nvtx": ("run.nvtx", True, "NVTX ranges around data, forward, backward, optimizer, EMA"),
    "--channels-last": ("data.channels_last", True,
                        "model and images in channels-last (NHWC); bench/throughput.py --modes layout measures it"),
    "--no-multiscale": ("data.multiscale", False, "train at --img-size only"),
    "--no-augment": ("data.augment", False, "no data augmentation"),
    "--no-ema": ("optim.ema", False, "train without an EMA of the weights"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastdet.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="ppyoloe", help="architecture (a name in fastdet.models.ARCHITECTURES)")
    p.add_argument("--size", default="s", help="model size (the family's; ppyoloe: s, m, l, x)")
    for flag, (_, kw) in FLAGS.items():
        p.add_argument(flag, default=None, **kw)
    for flag, (_, _, help_) in SWITCHES.items():
        p.add_argument(flag, action="store_true", help=help_)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set optim.base_lr=0.01 (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def resolve_config(args: argparse.Namespace) -> Config:
    """The family's preset, then its demo overrides (for --data demo), then flags, then --set."""
    from fastdet import recipes

    cfg = recipes.get_preset(args.arch, args.size)
    overrides: dict[str, Any] = {}
    for flag, (key, _) in FLAGS.items():
        v = getattr(args, flag.lstrip("-").replace("-", "_"))
        if v is not None:
            overrides[key] = v
    for flag, (key, value, _) in SWITCHES.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            overrides[key] = value
    overrides.update(parse_set_args(args.set))
    if overrides.get("data.data", cfg.data.data) == "demo":
        cfg = apply_overrides(cfg, recipes.demo_overrides(args.arch))
    cfg = apply_overrides(cfg, overrides)
    if not cfg.data.multiscale:
        cfg = apply_overrides(cfg, {"data.train_sizes": (cfg.data.img_size,)})
    return cfg


def check_config(cfg: Config) -> None:
    """Reject values that would fail late (an epoch in, at evaluation) or silently (0 steps),
    before any data is read: one ConfigError naming the flag."""
    from fastdet.models.detector import Detector

    div = Detector.size_divisor
    d, o = cfg.data, cfg.optim
    if d.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {d.batch_size}")
    if d.img_size < div or d.img_size % div:
        raise ConfigError(f"--img-size must be a positive multiple of {div} (the largest stride), "
                          f"got {d.img_size}")
    bad = [s for s in d.train_sizes if s < div or s % div]
    if bad:
        raise ConfigError(f"data.train_sizes must be positive multiples of {div}, got {bad[0]}")
    if o.epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {o.epochs}")
    if o.base_lr <= 0:
        raise ConfigError(f"--lr must be positive, got {o.base_lr:g}")
    if cfg.run.ckpt:
        from fastdet.engine.checkpoint import is_checkpoint_archive

        path = Path(cfg.run.ckpt).expanduser()
        if not path.is_file():
            raise ConfigError(f"--ckpt {path}: no such file")
        if not is_checkpoint_archive(path):
            raise ConfigError(f"--ckpt {path} is not a checkpoint: torch.save writes a zip archive "
                              "and this file is not one (corrupt, truncated or another format)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        check_config(cfg)
    except ConfigError as e:
        print(f"fastdet.train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    from fastdet.data.coco import DataError
    from fastdet.engine.trainer import TrainingError, train

    try:
        stats = train(cfg)
    except (DataError, ConfigError, FileNotFoundError, ValueError, TrainingError) as e:
        logging.getLogger("fastdet").error("error: %s", e)
        print(f"fastdet.train: error: {e}", file=sys.stderr)
        return 1
    if stats:
        print(f"COCO AP {stats['AP']:.4f}  AP50 {stats['AP50']:.4f}  AP75 {stats['AP75']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
