"""``python -m fastdet.predict --ckpt PATH --source SRC --output-dir DIR``: detect and draw.

``SRC`` is an image file, a folder (its image files, not recursive) or a glob
(``"imgs/**/*.jpg"``, quoted). For each image ``DIR`` gets a drawn copy (``<name>.jpg``:
boxes, class names and scores) and ``DIR/predictions.json`` holds every detection in the
COCO results format, in original-image pixels::

    [{"image_id": 139, "file_name": "000000000139.jpg", "category_id": 62,
      "bbox": [x, y, w, h], "score": 0.91}, ...]

``image_id`` is the file's numeric stem when every stem is a number (the COCO naming,
so the file scores directly against ``instances_val2017.json``), else the image's
1-based position in sorted order. ``category_id`` is the trained dataset's.

The network input (also the ``images`` input of ``python -m fastdet.export``): each RGB
image is resized as the family's evaluation does (``DetectorInfo.preprocess``) onto the
canvas evaluation gives its orientation, and normalised (``fastdet.detect``, through
``fastdet.api.preprocess_images``): PP-YOLOE stretches to the square ``S`` x ``S`` canvas
(``S`` = ``--img-size``) with bicubic interpolation, YOLOX letterboxes into it; FCOS keeps
the aspect ratio (short side ``S``, long side at most ``S`` * 1333 / 800) on a landscape
``(S, L)``, portrait ``(L, S)`` or square ``(S, S)`` canvas (at 800: 800 x 1344, 1344 x
800, 800 x 800), one batch per canvas. Boxes map back with ``(sx, sy)`` input px per
original px.

Files that do not decode are skipped, counted and named in the summary line. A folder
that already holds a file of these names (an earlier prediction) is refused before any
work unless ``--exist-ok``; a drawn copy never replaces a source image. ``--set
family.<field>=value`` changes the recipe's NMS (``--set family.nms_iou=0.5``).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from fastdet.api import CheckpointError, detect, load_detector
from fastdet.config import parse_postprocess_args
from fastdet.data.augment import ImageDecodeError, decode_image
from fastdet.data.formats import IMAGE_EXTS as IMAGE_SUFFIXES  # the suffixes the set readers take
from fastdet.runtime.dist import memory_figures, resolve_device
from fastdet.runtime.outputs import refuse_replacing
from fastdet.visualize import draw_detections, save_image

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".wmv")  # refused by name: predict reads images


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastdet.predict", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="PATH", help="a checkpoint written by fastdet.train")
    p.add_argument("--source", required=True, metavar="SRC", help="an image, a folder or a glob")
    p.add_argument("--output-dir", required=True, metavar="DIR")
    p.add_argument("--score-thresh", type=float, default=0.3, help="draw and save detections above it")
    p.add_argument("--img-size", type=int, default=None, help="input size (default: the recipe's evaluation size)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--weights", choices=["ema", "model"], default="ema")
    p.add_argument("--exist-ok", action="store_true",
                   help="replace the drawn images and predictions.json of an earlier prediction in --output-dir")
    p.add_argument("--set", action="append", default=[], metavar="family.FIELD=VALUE",
                   help="change the recipe's NMS, e.g. --set family.nms_iou=0.5 (repeatable; the fields the "
                        "family's post-processing reads; the score threshold is --score-thresh)")
    return p


def find_images(source: str) -> list[Path]:
    """The files ``source`` names, sorted; ``ValueError`` (one line) when there are none."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() in VIDEO_SUFFIXES:
            raise ValueError(f"--source {source}: a video; fastdet.predict reads images: extract its frames "
                             f"first (e.g. ffmpeg -i {path.name} frames/%06d.jpg) and pass the folder")
        return [path]
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            # A set's folder keeps its images one level down (images/, an export's split folders).
            below = Counter(f.suffix for f in path.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
            where = (f"; its subfolders hold {sum(below.values())}: pass a pattern, e.g. --source "
                     f"'{path / '**' / ('*' + below.most_common(1)[0][0])}'" if below else "")
            raise ValueError(f"--source {source}: the folder holds no image files ({', '.join(IMAGE_SUFFIXES)})"
                             f"{where}")
        return files
    if glob.has_magic(source):
        files = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
        if not files:
            raise ValueError(f"--source {source}: the pattern matches no files")
        return files
    raise ValueError(f"--source {source}: no such file or folder")


def image_ids(files: list[Path]) -> list[int]:
    stems = [f.stem for f in files]
    if all(s.isdigit() for s in stems) and len(set(map(int, stems))) == len(stems):
        return [int(s) for s in stems]
    return list(range(1, len(files) + 1))


def output_names(files: list[Path]) -> list[str]:
    """``<stem>.jpg`` per file, all different: a stem seen before (a glob over folders,
    ``a.jpg`` beside ``a.png``) gets the first ``<stem>_<n>.jpg`` no other file's name takes
    (``a_1.jpg`` stays the drawn copy of a source named ``a_1``)."""
    taken = {f"{f.stem}.jpg" for f in files}  # each stem's own name, kept for its first file
    given: set[str] = set()
    names = []
    for f in files:
        name, n = f"{f.stem}.jpg", 0
        while name in given or (n > 0 and name in taken):
            n += 1
            name = f"{f.stem}_{n}.jpg"
        given.add(name)
        names.append(name)
    return names


def output_paths(out: Path, names: list[str]) -> list[Path]:
    """Every file a prediction into ``out`` writes: the drawn copies, then ``predictions.json``."""
    return [out / n for n in names] + [out / "predictions.json"]


def check_no_source_overwritten(files: list[Path], out: Path, targets: list[Path]) -> None:
    """``ValueError`` (one line) if one of ``targets`` (:func:`output_paths`) would replace one
    of the source files (``--output-dir`` the source folder, or a source named ``predictions.json``)."""
    if out.absolute() in {f.absolute().parent for f in files}:  # as named: links are files of their folder too
        raise ValueError(f"--output-dir {out} is the folder of the source images: the drawn copies would be read "
                         "as images by the next prediction; choose another --output-dir")
    sources = {f.resolve() for f in files}
    for target in targets:
        if target.resolve() in sources:
            raise ValueError(f"--output-dir {out}: the drawn copy would replace the source image "
                             f"{target}; choose another --output-dir")


def check_args(args: argparse.Namespace) -> None:
    """Every flag error, before any work."""
    if not 0.0 <= args.score_thresh <= 1.0:
        raise ValueError(f"--score-thresh: expected a value in [0, 1], got {args.score_thresh}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected a positive integer, got {args.batch_size}")
    if args.img_size is not None and (args.img_size < 32 or args.img_size % 32):
        raise ValueError(f"--img-size: expected a positive multiple of 32, got {args.img_size}")
    if not Path(args.ckpt).exists():  # a folder: load_detector names the checkpoints in it
        raise ValueError(f"--ckpt {args.ckpt}: no such file")
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {args.output_dir}: exists and is not a folder")
    if "score_thresh" in parse_postprocess_args(args.set):
        raise ValueError("--set family.score_thresh: give --score-thresh (the threshold of what is drawn and saved)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.output_dir)
    try:
        check_args(args)
        files = find_images(args.source)
        names = output_names(files)
        targets = output_paths(out, names)
        check_no_source_overwritten(files, out, targets)
        if not args.exist_ok:
            refuse_replacing(targets, f"--output-dir {out}", "--exist-ok")
        device = resolve_device(args.device)
        det = load_detector(args.ckpt, ema=args.weights == "ema", device=device, arg_names={},  # no --arch here
                            postprocess=parse_postprocess_args(args.set))
    except (ValueError, CheckpointError) as e:
        print(f"fastdet.predict: error: {e}", file=sys.stderr)
        return 2
    info = det.info
    size = args.img_size or info.img_size
    out.mkdir(parents=True, exist_ok=True)
    ids = image_ids(files)
    canvases: dict[tuple[int, int], int] = {}  # (H, W) -> images predicted on it, for the summary
    results: list[dict] = []
    skipped: list[str] = []
    done = 0
    bar = tqdm(total=len(files), unit="img", disable=not sys.stderr.isatty(), dynamic_ncols=True)
    for start in range(0, len(files), args.batch_size):
        chunk = range(start, min(start + args.batch_size, len(files)))
        imgs, keep = [], []
        for i in chunk:
            try:
                imgs.append(decode_image(str(files[i])))
                keep.append(i)
            except ImageDecodeError:
                skipped.append(str(files[i]))
                (out / names[i]).unlink(missing_ok=True)  # an earlier run's copy (--exist-ok) is not this image's
        if imgs:
            try:
                with torch.inference_mode():
                    dets = detect(det, imgs, score_thresh=args.score_thresh, img_size=size)
            except torch.OutOfMemoryError as e:  # what is done is kept: its drawn images and its results
                bar.close()
                (out / "predictions.json").write_text(json.dumps(results))
                print(f"fastdet.predict: error: out of device memory predicting {len(imgs)} image(s) from "
                      f"{files[keep[0]]} ({memory_figures(e)}): predictions.json in {out} holds the {done} image(s) "
                      f"before them; a smaller --batch-size (now {args.batch_size}) or --img-size needs less (with "
                      "--exist-ok, to write over them)",
                      file=sys.stderr)
                return 1
            for img in imgs:
                hw = info.preprocess.canvas(img.shape[0], img.shape[1], size)  # the one detect used
                canvases[hw] = canvases.get(hw, 0) + 1
            for i, img, d in zip(keep, imgs, dets):
                drawn = draw_detections(img, d["boxes"], d["scores"], d["labels"], info.class_names)
                save_image(drawn, out / names[i])
                xywh = d["boxes"].double()
                xywh[:, 2:] -= xywh[:, :2]
                for b, s, c in zip(xywh.tolist(), d["scores"].tolist(), d["labels"].tolist()):
                    results.append({"image_id": ids[i], "file_name": files[i].name,
                                    "category_id": info.cat_ids[c], "bbox": [round(v, 2) for v in b],
                                    "score": round(s, 5)})
                done += 1
        bar.update(len(chunk))
    bar.close()
    (out / "predictions.json").write_text(json.dumps(results))
    msg = (f"predicted {done} image(s), {len(results)} detection(s) above {args.score_thresh} "
           f"({info.arch}-{info.size}, {', '.join(f'{h}x{w}' for h, w in sorted(canvases)) or f'{size}x{size}'}"
           f", {device}): "
           + (f"drawn images and predictions.json in {out}" if done else f"an empty predictions.json in {out}"))
    if skipped:
        msg += f"; skipped {len(skipped)} unreadable file(s): {', '.join(skipped)}"
    print(msg)
    return 0 if done else 1  # nothing predicted: a failure, for the script that called it


if __name__ == "__main__":
    sys.exit(main())
