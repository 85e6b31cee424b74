"""Time the two COCO scoring back ends on one synthetic result set, side by side.

    python bench/coco_eval.py [--images 5000] [--dets 100] [--repeats 3] [--json OUT]

The ground truth is COCO-val-like: ``--images`` images (640x480), 80 categories,
7.3 boxes per image on average (COCO val2017: 36,781 boxes on 5,000 images), sizes
drawn log-uniformly over small / medium / large. The results are a detector's output:
``--dets`` per image (COCO keeps the top 100), some near each ground-truth box with the
right or a wrong class, the rest background. Each back end loads the ground truth once
(as the trainer's background scorer does) and then scores the same results
``--repeats`` times: ``loadRes`` + ``evaluate`` + ``accumulate`` + ``summarize``, the
work of one evaluation. Reported: median seconds per back end and the ratio
pycocotools / faster-coco-eval, both measured in one process, alternating, so a loaded
machine slows both alike. The 12 numbers of both are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fastdet.eval.scoring import STAT_NAMES, load_gt, score  # noqa: E402


def synthetic(images: int, dets: int, seed: int = 0) -> tuple[dict, list[dict]]:
    """``(ground truth document, results)`` as described in the module docstring."""
    rng = np.random.default_rng(seed)
    W, H, C = 640, 480, 80
    imgs = [{"id": i + 1, "file_name": f"{i + 1:012d}.jpg", "width": W, "height": H} for i in range(images)]
    cats = [{"id": c + 1, "name": f"class{c}"} for c in range(C)]
    anns, res = [], []
    for im in imgs:
        n = int(rng.poisson(7.3))
        side = np.exp(rng.uniform(np.log(8), np.log(400), n))
        asp = np.exp(rng.uniform(-0.7, 0.7, n))
        w, h = np.minimum(side * asp, W - 1), np.minimum(side / asp, H - 1)
        x, y = rng.uniform(0, W - w), rng.uniform(0, H - h)
        cls = rng.integers(1, C + 1, n)
        crowd = rng.random(n) < 0.01
        for k in range(n):
            anns.append({"id": len(anns) + 1, "image_id": im["id"], "category_id": int(cls[k]),
                         "bbox": [float(x[k]), float(y[k]), float(w[k]), float(h[k])],
                         "area": float(w[k] * h[k]), "iscrowd": int(crowd[k])})
        near = min(dets, 3 * n)
        for j in range(dets):
            if j < near:  # jittered copies of a ground-truth box, sometimes the wrong class
                k = j % n
                jit = rng.normal(0, 0.1, 4) * [w[k], h[k], w[k], h[k]]
                box = [x[k] + jit[0], y[k] + jit[1], w[k] + jit[2], h[k] + jit[3]]
                c = int(cls[k]) if rng.random() < 0.8 else int(rng.integers(1, C + 1))
            else:
                bw, bh = rng.uniform(8, 300, 2)
                box = [rng.uniform(0, W - bw), rng.uniform(0, H - bh), bw, bh]
                c = int(rng.integers(1, C + 1))
            res.append({"image_id": im["id"], "category_id": c, "bbox": [round(float(v), 2) for v in box],
                        "score": round(float(rng.beta(2, 5 if j >= near else 1)), 5)})
    return {"images": imgs, "annotations": anns, "categories": cats}, res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--dets", type=int, default=100, help="detections per image")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    t = time.perf_counter()
    gt_doc, results = synthetic(args.images, args.dets)
    print(f"synthetic set: {args.images} images, {len(gt_doc['annotations'])} boxes, {len(results)} detections "
          f"(made in {time.perf_counter() - t:.1f} s)")
    ids = [im["id"] for im in gt_doc["images"]]
    backends = ("pycocotools", "faster")
    gts, load_s, times, stats = {}, {}, {b: [] for b in backends}, {}
    for b in backends:
        t = time.perf_counter()
        gts[b] = load_gt(gt_doc, b)
        load_s[b] = time.perf_counter() - t
    for _ in range(args.repeats):  # alternating, so both see the same machine load
        for b in backends:
            t = time.perf_counter()
            s = score(gts[b], results, ids)
            times[b].append(time.perf_counter() - t)
            stats[b] = s.stats
    same = all(abs(stats["faster"][k] - stats["pycocotools"][k]) < 1e-12 for k in STAT_NAMES)
    med = {b: statistics.median(v) for b, v in times.items()}
    ratio = med["pycocotools"] / med["faster"]
    for b in backends:
        print(f"{b:>12}: {med[b]:7.2f} s per evaluation (median of {args.repeats}: "
              f"{', '.join(f'{v:.2f}' for v in times[b])}); ground truth loaded in {load_s[b]:.2f} s")
    print(f"pycocotools / faster-coco-eval: {ratio:.2f}x; 12 numbers equal: {same} (AP {stats['faster']['AP']:.4f})")
    if args.json:
        from bench import common

        import torch

        doc = {"schema": common.SCHEMA, "what": "coco-eval", "env": common.env_info(torch.device("cpu"),
                                                                                   with_ops=False),
               "args": vars(args), "boxes": len(gt_doc["annotations"]), "detections": len(results),
               "seconds": times, "median_s": med, "load_gt_s": load_s, "ratio": ratio,
               "same_stats": same, "stats": stats}
        common.write_json(args.json, doc)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
