"""``python -m fastdet.eval --ckpt PATH --data ...``: COCO AP of a checkpoint.

The model is rebuilt from the config stored in the checkpoint, as
``fastdet.load_detector`` rebuilds it; its EMA weights are evaluated when present
(``--weights model`` picks the raw weights). With ``--arch`` (and optionally ``--size``,
``--from``), ``--ckpt`` may be the authors' released file (Megvii, Paddle, torchvision),
converted on load as ``python -m fastdet.convert`` does. The val set is ``--data``'s
(or ``--val-ann/--val-images``), defaulting to the one trained on; ``--split test`` scores
``--data``'s test split instead. ``--set family.<field>=value`` changes the recipe's
post-processing (e.g. ``--set family.nms_iou=0.7 --set family.max_det=300``, the NMS
PaddleDetection 2.4 to 2.6 evaluate PP-YOLOE with); only the fields it reads are taken.
Runs under torchrun too: each rank evaluates its shard, rank 0 scores.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

import torch

from fastdet.config import ConfigError, apply_overrides, parse_postprocess_args
from fastdet import registry
from fastdet.api import CLI_ARGS, detector_from_checkpoint, read_any_checkpoint
from fastdet.data.coco import DataError
from fastdet.data.formats import load_split
from fastdet.data.loader import build_eval_loader, resolve_backend
from fastdet.data.schedule import LoaderError
from fastdet.eval.coco import evaluate
from fastdet.models import Detector
from fastdet.runtime import dist
from fastdet.runtime.amp import resolve_amp
from fastdet.runtime.logging import setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastdet.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="PATH")
    p.add_argument("--data", default=None, metavar="demo|COCO_ROOT|data.yaml|VOC_ROOT")
    p.add_argument("--split", choices=["val", "test"], default="val",
                   help="the split of --data to score (test: a Roboflow export's test/, a data.yaml's test:, "
                        "ImageSets/Main/test.txt)")
    p.add_argument("--val-ann", default=None, metavar="JSON")
    p.add_argument("--val-images", default=None, metavar="DIR")
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--amp", choices=["bf16", "fp16", "off", "auto"], default=None)
    p.add_argument("--loader", choices=["dali", "torch", "auto"], default=None)
    p.add_argument("--weights", choices=["ema", "model"], default="ema")
    p.add_argument("--arch", default=None, help="for a released file: the family to convert it for")
    p.add_argument("--size", default=None, help="for a released file: the size (inferred when left out)")
    p.add_argument("--from", dest="source", choices=["megvii", "paddle", "torchvision"], default=None,
                   help="for a released file: whose format it is (inferred when left out)")
    p.add_argument("--set", action="append", default=[], metavar="family.FIELD=VALUE",
                   help="change a post-processing field of the recipe, e.g. --set family.nms_iou=0.7 "
                        "(repeatable; the fields the family's post-processing reads)")
    return p


def category_ids_by_name(ck: dict, num_classes: int, val) -> list[int]:
    """The val set's category id for each of the model's labels, matched by class name.

    The same classes keep their names across a set's COCO, YOLO and VOC forms while their
    ids differ (COCO's 1..90 against YOLO's 0..79), so a checkpoint scores any form; a
    checkpoint without names (written before they were kept) is matched by id. A real
    mismatch is refused naming the classes that differ on each side.
    """
    ours = [str(n) for n in ck.get("class_names") or []]
    theirs = [str(n) for n in val.class_names]
    if not ours:
        ids = list(ck.get("cat_ids") or val.cat_ids)
        if ids != list(val.cat_ids) or len(ids) != num_classes:
            raise ValueError(f"{val.ann_file}: category ids {list(val.cat_ids)[:8]} differ from the checkpoint's "
                             f"{ids[:8]} (it keeps no class names to match them by)")
        return list(val.cat_ids)
    if len(ours) != num_classes:
        raise ValueError(f"the checkpoint names {len(ours)} classes but its model has {num_classes}")
    for names, whose in ((theirs, f"{val.ann_file}"), (ours, "the checkpoint")):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{whose} names the class {twice[0]!r} twice: classes are matched to the "
                             "checkpoint's by name")
    if sorted(ours) != sorted(theirs):
        only_ck = [n for n in ours if n not in theirs]
        only_val = [n for n in theirs if n not in ours]
        left_out = [n for n in only_ck if any(g.startswith(f"{n!r} (id ") for g in val.report.categories_left_out)]
        why = (f" ({left_out[0]!r} groups every other category of the file and has no box: it is read as no "
               "class)") if left_out else ""
        raise ValueError(f"{val.ann_file}: classes differ from the checkpoint's: only in the checkpoint "
                         f"{only_ck[:10] or 'none'}, only in this set {only_val[:10] or 'none'}{why}")
    index = {n: i for i, n in enumerate(theirs)}
    return [int(val.cat_ids[index[n]]) for n in ours]


def check_args(args: argparse.Namespace) -> None:
    """The flag values, before the checkpoint or any data is read: one ValueError naming the flag."""
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    div = Detector.size_divisor
    if args.img_size is not None and (args.img_size < div or args.img_size % div):
        raise ValueError(f"--img-size must be a positive multiple of {div} (the largest stride), got {args.img_size}")
    if args.split == "test" and (args.val_ann or args.val_images or not args.data):
        raise ValueError("--split test scores the test split of --data: give --data (and no --val-ann/--val-images, "
                         "which name a set to score as it is)")
    parse_postprocess_args(args.set)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except (ValueError, ConfigError) as e:
        print(f"fastdet.eval: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.arch is None and (args.size or args.source):
            raise ValueError("--size and --from describe a released file: give --arch too")
        ck, cfg = read_any_checkpoint(args.ckpt, args.arch, args.size, args.source, CLI_ARGS)
        over = {"run.device": args.device}
        for key, val in (("data.data", args.data), ("data.val_ann", args.val_ann),
                         ("data.val_images", args.val_images), ("data.img_size", args.img_size),
                         ("data.eval_batch_size", args.batch_size), ("compile.amp", args.amp),
                         ("data.loader", args.loader)):
            if val is not None:
                over[key] = val
        if args.data is not None:  # a new dataset: forget the trained-on explicit paths
            for key in ("data.val_ann", "data.val_images", "data.train_ann", "data.train_images"):
                over.setdefault(key, None)
        cfg = apply_overrides(cfg, over)
        try:
            cfg = registry.postprocess_overrides(cfg, parse_postprocess_args(args.set))
        except ConfigError as e:  # a flag's value, as check_args's
            print(f"fastdet.eval: error: {e}", file=sys.stderr)
            return 2
        device = dist.resolve_device(cfg.run.device)
        resolve_backend(cfg.data, device)  # --loader dali without DALI: said before the data is read
        info = dist.init_distributed(device.type)
        if device.type == "cuda":
            device = torch.device("cuda", info.local_rank)
        setup_logging(None, info.is_main)
        val = load_split(cfg.data, args.split, check_images="open")
        val = replace(val, cat_ids=category_ids_by_name(ck, cfg.model.num_classes, val))
        # Unfused: evaluation scores the weights as trained (fusing changes only float rounding).
        model = detector_from_checkpoint(ck, cfg, args.ckpt, ema=args.weights == "ema", fuse=False, device=device)
        loader = build_eval_loader(cfg.data, val, preprocess=registry.family(cfg.model.arch).preprocess,
                                   rank=info.rank, world_size=info.world_size, device=device)
        stats = evaluate(model, loader, val, resolve_amp(cfg.compile.amp, device), registry.predict_kwargs(cfg))
    except (ConfigError, DataError, FileNotFoundError, ValueError, LoaderError) as e:  # CheckpointError, ConvertError too
        print(f"fastdet.eval: error: {e}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as e:
        print(f"fastdet.eval: error: out of device memory ({dist.memory_figures(e)}): a smaller --batch-size (now "
              f"{cfg.data.eval_batch_size}) needs less", file=sys.stderr)
        return 1
    finally:
        dist.shutdown()
    logging.getLogger("fastdet").info("evaluated %s on %s", args.ckpt, val.ann_file)
    print(f"COCO AP {stats['AP']:.4f}  AP50 {stats['AP50']:.4f}  AP75 {stats['AP75']:.4f}  "
          f"APs {stats['APs']:.4f}  APm {stats['APm']:.4f}  APl {stats['APl']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
