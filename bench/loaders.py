"""Images per second of each loader back end: decode + augment + targets, no model.

``measure_loader`` is what ``bench/throughput.py`` calls for its data rows; the CLI
prints the same figures for a quick look::

    python bench/loaders.py --backend torch dali --device cpu --batch-size 8 --size 640 --workers 2

``--stages yolox`` measures YOLOX's stage list instead of the recipe's (Mosaic, RandomAffine,
MixUp, HSV, Flip, top-left letterbox at ``--size`` filled with 114, raw pixels): both back
ends in the same run, with the DALI / torch ratio; ``--store`` writes the JSON (with the
environment) under ``bench/results/`` as ``<date>_<device>_torch-<v>_loaders-<stages>.json``.
The target on a GPU is DALI >= 3x a 16-worker DataLoader; on the CPU both decode and
augment on the same cores, so the CPU ratio says nothing of the GPU one.

Timing: the loader is built and ``warmup`` batches are drawn first (worker start-up,
DALI's pipeline build and first prefetch), then ``windows`` timed windows of
``n_batches / windows`` batches each; on CUDA the device is synchronised at each
window's ends. The figure is the median over windows, with the spread
``(max - min) / median`` so two figures can be compared. Each batch is fully
produced on ``device`` (images, padded targets) as the trainer receives it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `fastdet` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from fastdet import registry
from fastdet.config import Config, DataConfig
from fastdet.data import stages as S
from fastdet.data.loader import build_train_loader, dali_unavailable_reason

# YOLOX's training stages (MX yolox_base.py: mosaic 1.0, mixup 1.0, degrees 10, translate
# 0.1, mosaic_scale (0.1, 2), shear 2, HSV 1.0, flip 0.5; preproc letterbox 114, raw pixels).
YOLOX_STAGES = (S.Mosaic(), S.RandomAffine(), S.MixUp("scaled_crop"), S.HSV(), S.Flip(),
                S.Resize("letterbox", pad_value=114.0, interp="linear"), S.Normalize(None, None))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Batches:
    """Batches without end: a finished pass starts the next epoch, as the trainer does."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.epoch = loader, 0
        loader.set_epoch(0)
        self._it = iter(loader)

    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self._it, None)
        if batch is None:
            self.epoch += 1
            self.loader.set_epoch(self.epoch)
            self._it = iter(self.loader)
            batch = next(self._it)
        return batch


def measure_loader(
    cfg: Config,
    dataset: Any,
    backend: str,
    device: Any,
    n_batches: int = 40,
    warmup: int = 5,
    *,
    windows: int = 4,
    seed: int = 0,
    stages: tuple | None = None,
) -> dict[str, Any]:
    """Throughput of the training loader of ``backend`` ("dali" | "torch") on ``device``.

    Returns ``images_per_s`` (median over windows) with ``spread_pct``, ``windows``
    (each window's images/s), ``images``, ``seconds`` (timed part), ``startup_s``
    (build + warm-up), ``batches_per_epoch``, ``backend``, ``device``, ``batch_size``,
    ``sizes``, ``num_workers``, ``augment``; or ``skipped`` with the reason when the
    back end cannot run here. ``stages``: the stage list of every epoch (default:
    ``cfg.data``'s PP-YOLOE stages).
    """
    device = torch.device(device)
    cfg = replace(cfg, data=replace(cfg.data, loader=backend))
    out: dict[str, Any] = {
        "backend": backend,
        "device": str(device),
        "batch_size": cfg.data.batch_size,
        "sizes": list(cfg.data.train_sizes if cfg.data.multiscale else (cfg.data.img_size,)),
        "num_workers": cfg.data.num_workers,
        "augment": cfg.data.augment,
    }
    if backend == "dali":
        reason = dali_unavailable_reason(device)
        if reason is not None:
            return {**out, "skipped": reason}
    windows = max(1, min(windows, n_batches))
    per_window = max(1, n_batches // windows)
    t0 = time.perf_counter()
    stage_list = stages if stages is not None else registry.phase(cfg, 0).stages
    loader = build_train_loader(cfg.data, dataset, stages_for_epoch=lambda e: stage_list, rank=0, world_size=1,
                                device=device, seed=seed)
    stream = _Batches(loader)
    for _ in range(warmup):
        stream.next()
    _sync(device)
    startup = time.perf_counter() - t0
    rates, images, seconds = [], 0, 0.0
    for _ in range(windows):
        n = 0
        t = time.perf_counter()
        for _ in range(per_window):
            n += stream.next()["images"].shape[0]
        _sync(device)
        dt = time.perf_counter() - t
        rates.append(n / dt)
        images += n
        seconds += dt
    med = statistics.median(rates)
    out.update(
        images_per_s=med,
        spread_pct=100.0 * (max(rates) - min(rates)) / med,
        windows=rates,
        images=images,
        seconds=seconds,
        startup_s=startup,
        batches_per_epoch=len(loader),
        loader_report=loader.report(),
    )
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Loader throughput (decode + augment + targets, no model).")
    p.add_argument("--backend", nargs="+", default=["torch", "dali"], choices=["torch", "dali"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", default="demo", help="'demo', a COCO root (annotations/, train2017/), a YOLO data.yaml or a VOC root")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--size", type=int, default=640, help="one image size; --multiscale uses 320..768 instead")
    p.add_argument("--multiscale", action="store_true")
    p.add_argument("--no-augment", action="store_true")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers / DALI CPU threads")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--stages", choices=["recipe", "yolox"], default="recipe",
                   help="the PP-YOLOE recipe's stages (default) or YOLOX's")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--store", action="store_true", help="write the JSON under bench/results/ (see its README)")
    args = p.parse_args(argv)

    from fastdet.data.formats import load_split

    data = DataConfig(
        data=args.data,
        batch_size=args.batch_size,
        img_size=args.size,
        multiscale=args.multiscale,
        augment=not args.no_augment,
        num_workers=args.workers,
        max_boxes=100,
    )
    ds = load_split(data, "train", check_images="decode")  # COCO, YOLO data.yaml or VOC
    cfg = Config(data=replace(data, check_images="decode"))
    stage_list = YOLOX_STAGES if args.stages == "yolox" else None
    rows = [measure_loader(cfg, ds, b, args.device, args.batches, args.warmup, stages=stage_list)
            for b in args.backend]
    aug = "YOLOX stages" if args.stages == "yolox" else ("no augmentation" if args.no_augment else "PP-YOLOE stages")
    print(f"{len(ds.records)} images from {ds.ann_file}; batch {args.batch_size}, "
          f"{'sizes 320..768' if args.multiscale else f'size {args.size}'}, {aug}, {args.workers} workers")
    for r in rows:
        if "skipped" in r:
            print(f"  {r['backend']:>5} on {r['device']}: skipped ({r['skipped']})")
        else:
            print(f"  {r['backend']:>5} on {r['device']}: {r['images_per_s']:8.1f} images/s "
                  f"(spread {r['spread_pct']:.0f}%, start-up {r['startup_s']:.1f} s)")
    rates = {r["backend"]: r.get("images_per_s") for r in rows}
    ratio = rates["dali"] / rates["torch"] if rates.get("dali") and rates.get("torch") else None
    if ratio is not None:
        print(f"  DALI / torch: {ratio:.2f}x on {args.device}"
              + (" (a CPU figure: the GPU target is >= 3x a 16-worker DataLoader)" if args.device == "cpu" else ""))
    doc = {"stages": [repr(s) for s in (stage_list or registry.phase(cfg, 0).stages)], "rows": rows,
           "dali_over_torch": ratio, "command": "python bench/loaders.py " + " ".join(argv or sys.argv[1:])}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if args.store:
        from bench.common import env_info, result_stem, write_json

        env = env_info(torch.device(args.device), with_ops=False)
        path = Path(__file__).resolve().parent / "results" / f"{result_stem(env, f'loaders-{args.stages}')}.json"
        write_json(path, {"env": env, **doc})
        print(f"  stored {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
