"""``python -m fastdet.data check --data ...``: the dataset report, without training;
``python -m fastdet.data split --data EXPORT --output-dir OUT`` (or ``--ann JSON --images DIR``):
a single-split export (COCO, YOLO, VOC XMLs) split into train and val (``fastdet.data.split``).

For each split (train, then val; ``--splits`` picks them, ``test`` included): images and
boxes kept, what was dropped or skipped and why (the same report training prints), boxes
per class, and a histogram of box sizes (square root of the area in pixels, with COCO's
small / medium / large counts). Exits 1
with one line naming the file when the set cannot be read. The format (COCO, YOLO
``data.yaml``, Pascal VOC) is detected from ``--data`` as training detects it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from fastdet.config import DataConfig
from fastdet.data.coco import DataError
from fastdet.data.formats import SPLITS, data_format, load_split
from fastdet.data.split import split_data, split_export

# Edges of the box-size histogram: sqrt(area) in pixels of the original image.
SIZE_EDGES = (0, 8, 16, 32, 64, 96, 128, 256, 512, float("inf"))
_BAR = 40


def _size_histogram(sides: np.ndarray) -> list[str]:
    counts, _ = np.histogram(sides, bins=np.array(SIZE_EDGES))
    peak = max(1, int(counts.max()) if counts.size else 1)
    lines = []
    for lo, hi, n in zip(SIZE_EDGES[:-1], SIZE_EDGES[1:], counts):
        label = f"{lo:>4g}-{hi:<4g}" if hi != float("inf") else f"{lo:>4g}+   "
        lines.append(f"    {label} px  {int(n):>8}  {'#' * round(_BAR * n / peak)}")
    return lines


def split_report(ds) -> str:
    """The multi-line report of one loaded split."""
    boxes = [r.boxes for r in ds.records if len(r.boxes)]
    labels = [r.labels for r in ds.records if len(r.labels)]
    xyxy = np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32)
    lab = np.concatenate(labels) if labels else np.zeros((0,), np.int64)
    sides = np.sqrt(np.maximum(0, (xyxy[:, 2] - xyxy[:, 0]) * (xyxy[:, 3] - xyxy[:, 1])))
    empty = sum(1 for r in ds.records if len(r.boxes) == 0)
    r = ds.report
    lines = [f"  {r.images_kept} images ({empty} without boxes), {r.boxes_kept} boxes, {ds.num_classes} classes",
             f"  problems: {r.summary()}"]
    for reason, shown in r.examples.items():
        if shown:
            lines.append(f"    {reason}: {', '.join(shown)}")
    per_class = np.bincount(lab, minlength=ds.num_classes)
    width = max(5, *(len(n) for n in ds.class_names))
    lines.append("  boxes per class:")
    for name, n in zip(ds.class_names, per_class):
        note = "  (no boxes)" if n == 0 else ""
        lines.append(f"    {name:<{width}}  {int(n):>8}{note}")
    lines.append("  box size (sqrt of area, px):")
    lines += _size_histogram(sides)
    small, medium = int((sides < 32).sum()), int(((sides >= 32) & (sides < 96)).sum())
    lines.append(f"    COCO small {small}, medium {medium}, large {len(sides) - small - medium}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastdet.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="print the dataset report (images, boxes per class, box sizes, problems)")
    c.add_argument("--data", default=None, metavar="demo|COCO_ROOT|data.yaml|VOC_ROOT",
                   help="the set; or leave it out and name COCO files with --train-ann ... --val-images")
    c.add_argument("--train-ann", default=None, metavar="JSON")
    c.add_argument("--train-images", default=None, metavar="DIR")
    c.add_argument("--val-ann", default=None, metavar="JSON")
    c.add_argument("--val-images", default=None, metavar="DIR")
    # decode: a JPEG cut short has a header that reads; only its pixels show it. Training
    # reads headers only ("open"), so this is where every pixel is read, once per file
    # (the results are cached by file size and time).
    c.add_argument("--check-images", choices=["none", "open", "decode"], default="decode",
                   help="decode (default): read every image's pixels; open: its header only; none: trust the file")
    c.add_argument("--splits", default="train,val", help="comma-separated train, val, test (default: train,val)")
    c.add_argument("--cache-dir", default=None)
    sp = sub.add_parser("split", help="split a single-split export (CVAT's or Label Studio's COCO, a YOLO folder "
                                      "with classes.txt, LabelImg's VOC XMLs) into train and val that --data reads")
    sp.add_argument("--data", default=None, metavar="FOLDER|data.yaml|obj.data",
                    help="the export: a YOLO folder with classes.txt (or its data.yaml / obj.data without val), "
                         "LabelImg's VOC XMLs beside their images, or a folder holding a COCO export's JSON")
    sp.add_argument("--ann", default=None, metavar="JSON", help="a COCO export's file (instead of --data)")
    sp.add_argument("--images", default=None, metavar="DIR", help="the folder its file_name are relative to")
    sp.add_argument("--output-dir", required=True, metavar="OUT",
                    help="where the split goes: COCO's annotations/instances_{train,val}.json and train/, val/ "
                         "links; YOLO's data.yaml, train.txt, val.txt; VOC's train/ and val/ of links")
    sp.add_argument("--val-fraction", type=float, default=0.2, help="the share of images held out (default 0.2)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--overwrite", action="store_true", help="replace the files an earlier split wrote there")
    return p


def split_main(args: argparse.Namespace) -> int:
    """``split``: the two files and links, then each split's one-line summary and the command."""
    out = Path(args.output_dir).expanduser()
    if (args.data is None) == (args.ann is None) or (args.ann is None) != (args.images is None):
        print("fastdet.data: error: give the export with --data, or a COCO file with --ann and --images "
              f"(got {' and '.join(f for f in ('--data', '--ann', '--images') if getattr(args, f[2:])) or 'none'})",
              file=sys.stderr)
        return 1
    try:
        if args.data is not None:
            export, train, val = split_data(args.data, out, args.val_fraction, args.seed, args.overwrite)
        else:
            export, train, val = split_export(Path(args.ann).expanduser(), Path(args.images), out,
                                              args.val_fraction, args.seed, args.overwrite)
    except (DataError, ValueError, OSError) as e:
        print(f"fastdet.data: error: {e}", file=sys.stderr)
        return 1
    print(f"{export.ann_file}: {len(export)} images, {export.report.boxes_kept} boxes; {export.report.summary()}")
    for name, ds in (("train", train), ("val", val)):
        print(f"{name}: {ds.ann_file} ({len(ds)} images, {ds.report.boxes_kept} boxes)")
        boxed = {int(k) for r in ds.records for k in r.labels}
        missing = [n for k, n in enumerate(ds.class_names) if k not in boxed]
        if missing:
            print(f"  no box of {len(missing)} class(es) in {name}: {', '.join(missing[:10])}"
                  + (" (not scored on this val split)" if name == "val" else " (not learned from this split)"))
    print(f"train on it with --data {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command == "split":
        return split_main(args)
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    bad = set(splits) - set(SPLITS)
    if bad or not splits:
        got = sorted(bad)[0] if bad else repr(args.splits)
        print(f"fastdet.data: error: --splits takes {', '.join(SPLITS)}, got {got}", file=sys.stderr)
        return 1
    unused = [f"--{s}-{what}" for s in ("train", "val") for what in ("ann", "images")
              if getattr(args, f"{s}_{what}") is not None and s not in splits]
    if unused:
        print(f"fastdet.data: error: {unused[0]} names a split --splits does not check ({args.splits})",
              file=sys.stderr)
        return 1
    if "test" in splits and args.data is None:
        print("fastdet.data: error: --splits test reads the test split of --data: give --data", file=sys.stderr)
        return 1
    if args.data is None:  # the splits' files named by the flags (test has none: refused above)
        missing = [f"--{s}-ann and --{s}-images" for s in splits
                   if getattr(args, f"{s}_ann") is None or getattr(args, f"{s}_images") is None]
        if missing:
            print(f"fastdet.data: error: give --data, or COCO files with {' and '.join(missing)}", file=sys.stderr)
            return 1
    data = args.data if args.data is not None else DataConfig().data  # every path named by the flags
    cfg = replace(DataConfig(), data=data, train_ann=args.train_ann, train_images=args.train_images,
                  val_ann=args.val_ann, val_images=args.val_images, check_images=args.check_images,
                  **({"cache_dir": args.cache_dir} if args.cache_dir else {}))
    try:
        for i, split in enumerate(splits):
            ds = load_split(cfg, split, train=False)
            if i == 0:  # once the set reads, so that an export refused by load_split is not called COCO
                print(f"{args.data}: {data_format(args.data).upper()} format" if args.data is not None
                      else "COCO files")
                print("images: " + {"decode": "every pixel read", "open": "headers read (--check-images decode "
                                    "reads every pixel)", "none": "not opened"}[args.check_images])
            print(f"{split}: {ds.ann_file}")
            print(split_report(ds))
    except DataError as e:
        print(f"fastdet.data: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
