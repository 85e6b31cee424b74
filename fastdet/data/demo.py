"""The built-in demo dataset: coloured shapes on textured backgrounds, in COCO format.

``--data demo`` generates it on first use into the cache directory; it is also the
fixture every test uses, so nothing ever needs a download. The layout is a COCO root::

    <root>/annotations/instances_train2017.json
    <root>/annotations/instances_val2017.json
    <root>/train2017/*.jpg   <root>/val2017/*.jpg
    <root>/manifest.json     # generator version + parameters; a different one regenerates

The class of an object is its SHAPE (circle, rectangle, triangle, cross); colours are
drawn independently of the class so they carry no label information. Objects range
from 12 px to half the short image side (log-uniform, so small ones are common), 1-8
per image, may overlap but every object keeps at least ``MIN_VISIBLE`` of its pixels,
and the boxes are tight to the pixels that remain visible. Category ids are
deliberately non-contiguous (1, 3, 7, 12) to exercise the label mapping, and every
25th image (index 3 mod 25) has no objects.

Generation is deterministic: each image draws from its own ``numpy`` generator seeded
by ``(seed, split, index)``, the JSON is written with fixed key order and formatting,
and JPEGs are saved with fixed quality and subsampling, so two generations with the
same parameters are byte-identical (for the same Pillow/libjpeg build).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, ImageDraw

# Bump when the images or annotations produced for given parameters change: cached
# sets with another version are regenerated.
GENERATOR_VERSION = 1
GENERATOR_NAME = "fastdet.data.demo"

# (COCO category id, name); the ids are non-contiguous on purpose.
CATEGORIES: tuple[tuple[int, str], ...] = ((1, "circle"), (3, "rectangle"), (7, "triangle"), (12, "cross"))
# (width, height) of the images; one is drawn per image.
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((320, 320), (384, 288), (288, 384), (352, 352))
MIN_OBJECTS, MAX_OBJECTS = 1, 8
MIN_SIZE = 12.0  # px, the nominal extent of the smallest objects
MAX_SIZE_FRAC = 0.5  # of the short image side, for the largest objects
MIN_VISIBLE = 0.6  # fraction of an object's pixels that later objects may not cover
MIN_COLOUR_DIST = 70.0  # RGB distance between an object and what lies under it
JPEG_QUALITY = 90
EMPTY_EVERY, EMPTY_AT = 25, 3  # image index i has no objects when i % 25 == 3
PLACE_TRIES = 30  # placements tried per object before giving up on it

SPLITS = ("train", "val")
_VAL_ID_OFFSET = 1_000_000  # val image ids are 1_000_001, ... so they never collide with train ids

DEFAULT_PARAMS = dict(num_train=400, num_val=100, seed=0)


# --------------------------------------------------------------------------- public API

def ann_path(root: str | Path, split: str) -> Path:
    return Path(root) / "annotations" / f"instances_{split}2017.json"


def image_dir(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}2017"


def demo_root(cache_dir: str | Path) -> Path:
    """The default demo set under ``cache_dir`` (``~`` expanded), generated on first use."""
    root = Path(cache_dir).expanduser() / f"demo-v{GENERATOR_VERSION}"
    return make_demo(root, **DEFAULT_PARAMS)


def make_demo(root: str | Path, *, num_train: int = 400, num_val: int = 100, seed: int = 0) -> Path:
    """Generate the demo set into ``root`` unless an identical one is already there.

    The set is written into a temporary sibling folder and renamed into place, under a
    file lock, so concurrent callers (e.g. several ``torchrun`` ranks) generate it once
    and nobody ever reads a half-written set. An existing ``root`` from other
    parameters or another generator version is replaced; a ``root`` that is not a demo
    set (no manifest of ours, not empty) is never touched.

    Returns ``root`` as a ``Path``.
    """
    if num_train < 1 or num_val < 1:
        raise ValueError(f"make_demo: num_train and num_val must be >= 1, got {num_train}, {num_val}")
    root = Path(root).expanduser().absolute()
    manifest = _manifest(num_train, num_val, seed)
    if _read_manifest(root) == manifest:
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(root.parent / f".{root.name}.lock"):
        if _read_manifest(root) == manifest:  # another process made it while we waited
            return root
        if root.exists() and _read_manifest(root) is None and any(root.iterdir()):
            raise FileExistsError(
                f"{root}: exists and is not a fastdet demo set (no {GENERATOR_NAME} manifest.json); "
                "refusing to overwrite it"
            )
        log = logging.getLogger("fastdet")
        log.info("generating the demo set (%d train, %d val images of shapes) into %s; done once, "
                 "reused from then on", num_train, num_val, root)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            counts = {split: _write_split(tmp, split, n, seed) for split, n in zip(SPLITS, (num_train, num_val))}
            log.info("demo set generated in %.1f s", time.perf_counter() - t0)
            # The manifest is written last: a folder without it is never taken as complete.
            (tmp / "manifest.json").write_text(json.dumps({**manifest, "counts": counts}, indent=1) + "\n")
            if root.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
                os.replace(root, old / "set")
                os.replace(tmp, root)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return root


# --------------------------------------------------------------------------- manifest and lock

def _manifest(num_train: int, num_val: int, seed: int) -> dict:
    return {
        "generator": GENERATOR_NAME,
        "generator_version": GENERATOR_VERSION,
        "num_train": int(num_train),
        "num_val": int(num_val),
        "seed": int(seed),
    }


def _read_manifest(root: Path) -> dict | None:
    """The parameters part of ``root/manifest.json``, or None when absent or not ours."""
    try:
        m = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("generator") != GENERATOR_NAME:
        return None
    return {k: m.get(k) for k in ("generator", "generator_version", "num_train", "num_val", "seed")}


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps readers safe
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- generation

def _write_split(root: Path, split: str, n: int, seed: int) -> dict:
    img_dir = image_dir(root, split)
    img_dir.mkdir(parents=True)
    ann_path(root, split).parent.mkdir(parents=True, exist_ok=True)
    split_code = SPLITS.index(split)
    id_offset = 0 if split == "train" else _VAL_ID_OFFSET
    images, annotations = [], []
    for i in range(n):
        rng = np.random.default_rng(np.random.SeedSequence([seed, split_code, i]))
        w, h = IMAGE_SIZES[int(rng.integers(len(IMAGE_SIZES)))]
        n_obj = 0 if i % EMPTY_EVERY == EMPTY_AT else int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1))
        pixels, objects = render_image(rng, w, h, n_obj)
        image_id = id_offset + i + 1
        file_name = f"{image_id:012d}.jpg"
        Image.fromarray(pixels).save(
            img_dir / file_name, "JPEG", quality=JPEG_QUALITY, subsampling=2, optimize=False
        )
        images.append({"id": image_id, "file_name": file_name, "width": w, "height": h})
        for label, (x0, y0, x1, y1), area in objects:
            annotations.append({
                "id": len(annotations) + 1,
                "image_id": image_id,
                "category_id": CATEGORIES[label][0],
                "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
                "area": float(area),
                "iscrowd": 0,
            })
    doc = {
        "info": {
            "description": "fastdet demo set: shapes on textured backgrounds",
            "version": str(GENERATOR_VERSION),
            "year": 2024,
        },
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [{"id": cid, "name": name, "supercategory": "shape"} for cid, name in CATEGORIES],
    }
    ann_path(root, split).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    return {"images": len(images), "annotations": len(annotations)}


def render_image(
    rng: np.random.Generator, w: int, h: int, n_obj: int
) -> tuple[np.ndarray, list[tuple[int, tuple[int, int, int, int], int]]]:
    """Draw up to ``n_obj`` shapes on a textured background.

    Returns the image (uint8 [h, w, 3]) and, per object, ``(label, (x0, y0, x1, y1), area)``:
    the contiguous label (index into ``CATEGORIES``), the box tight to its visible pixels
    (x1, y1 exclusive) and the number of visible pixels.
    """
    img = _background(rng, w, h)  # float32 [h, w, 3]
    bg_img = img.copy()
    full: list[np.ndarray] = []  # bool [h, w] per placed object, as drawn
    visible: list[np.ndarray] = []  # bool [h, w], what later objects left uncovered
    colours: list[np.ndarray] = []
    labels: list[int] = []
    max_size = MAX_SIZE_FRAC * min(w, h)
    for _ in range(n_obj):
        for _try in range(PLACE_TRIES):
            label = int(rng.integers(len(CATEGORIES)))
            size = math.exp(rng.uniform(math.log(MIN_SIZE), math.log(max_size)))
            mask = _shape_mask(rng, label, size, w, h)
            if mask is None:
                continue
            if any((v & ~mask).sum() < MIN_VISIBLE * f.sum() for v, f in zip(visible, full)):
                continue
            under = [c for v, c in zip(visible, colours) if (v & mask).any()]
            colour = _pick_colour(rng, bg_img[mask], under)
            if colour is None:
                continue
            break
        else:
            continue  # no room left for this object; the image gets fewer
        for v in visible:
            v &= ~mask
        full.append(mask)
        visible.append(mask.copy())
        colours.append(colour)
        labels.append(label)
        img[mask] = _shade(rng, mask, colour)
    # Sensor-like noise over everything, so object interiors are not flat either.
    img += rng.normal(0.0, rng.uniform(2.0, 8.0), size=img.shape).astype(np.float32)
    pixels = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    objects = []
    for label, v in zip(labels, visible):
        ys, xs = np.nonzero(v)
        box = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
        objects.append((label, box, int(v.sum())))
    return pixels, objects


def _random_colour(rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(0, 255, size=3).astype(np.float32)


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """One of three textures, float32 [h, w, 3] in 0..255: blotchy noise, gradient, stripes."""
    kind = int(rng.integers(3))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == 0:
        # Low-frequency colour noise: a tiny random image upsampled bicubically.
        cells = int(rng.integers(3, 9))
        small = rng.uniform(0, 255, size=(cells, cells, 3)).astype(np.uint8)
        out = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    elif kind == 1:
        a, b = _random_colour(rng), _random_colour(rng)
        theta = rng.uniform(0, 2 * math.pi)
        t = xx * math.cos(theta) + yy * math.sin(theta)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
        out = a + (b - a) * t[..., None]
    else:
        a, b = _random_colour(rng), _random_colour(rng)
        theta = rng.uniform(0, math.pi)
        period = rng.uniform(8.0, 48.0)
        t = 0.5 + 0.5 * np.sin(2 * math.pi * (xx * math.cos(theta) + yy * math.sin(theta)) / period)
        out = a + (b - a) * t[..., None]
    # Blend towards grey a little so backgrounds are not always saturated.
    mix = rng.uniform(0.0, 0.5)
    return (out * (1 - mix) + 128.0 * mix).astype(np.float32)


def _pick_colour(rng: np.random.Generator, bg: np.ndarray, under: list[np.ndarray]) -> np.ndarray | None:
    """A random colour that stands out from what it is drawn over.

    ``bg`` [P, 3] are the background pixels under the shape: at most 10 % of them may lie
    within MIN_COLOUR_DIST / 2 of the colour (so a stripe of the same colour cannot eat
    its outline), and their mean must be MIN_COLOUR_DIST away; ``under`` are the colours
    of the objects it overlaps, each MIN_COLOUR_DIST away too.
    """
    for _ in range(10):
        c = _random_colour(rng)
        if float(np.linalg.norm(bg.mean(axis=0) - c)) < MIN_COLOUR_DIST:
            continue
        if (np.linalg.norm(bg - c, axis=1) < MIN_COLOUR_DIST / 2).mean() > 0.1:
            continue
        if all(float(np.linalg.norm(c - u)) >= MIN_COLOUR_DIST for u in under):
            return c
    return None


def _shade(rng: np.random.Generator, mask: np.ndarray, colour: np.ndarray) -> np.ndarray:
    """The object's pixels: its colour with a soft linear brightness ramp (±12 %)."""
    ys, xs = np.nonzero(mask)
    theta = rng.uniform(0, 2 * math.pi)
    t = xs * math.cos(theta) + ys * math.sin(theta)
    t = (t - t.mean()) / max(float(np.abs(t - t.mean()).max()), 1.0)
    gain = 1.0 + 0.12 * t.astype(np.float32)
    return np.clip(colour[None, :] * gain[:, None], 0, 255)


def _rotate(points: np.ndarray, theta: float) -> np.ndarray:
    c, s = math.cos(theta), math.sin(theta)
    return points @ np.array([[c, s], [-s, c]], dtype=np.float64)


def _shape_mask(rng: np.random.Generator, label: int, size: float, w: int, h: int) -> np.ndarray | None:
    """A bool [h, w] mask of one shape of nominal extent ``size`` px at a random place.

    The shape lies fully inside the image (1 px margin). None when it would not fit.
    """
    name = CATEGORIES[label][1]
    r = size / 2
    if name == "circle":
        aspect = rng.uniform(0.85, 1.15)
        pts = None
        rx, ry = r, r * aspect
        half = np.array([rx, ry])
    else:
        if name == "rectangle":
            aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
            hw, hh = r, r * aspect
            if hh > r:  # keep the longer side equal to `size`
                hw, hh = r / aspect, r
            pts = np.array([[-hw, -hh], [hw, -hh], [hw, hh], [-hw, hh]])
            theta = rng.uniform(-math.pi / 12, math.pi / 12)
        elif name == "triangle":
            angles = np.deg2rad(np.array([90.0, 210.0, 330.0]) + rng.uniform(-12, 12, size=3))
            pts = np.stack([np.cos(angles), -np.sin(angles)], axis=1) * r
            theta = rng.uniform(0, 2 * math.pi)
        else:  # cross: a plus sign with arms a third of its extent thick
            t = r * rng.uniform(0.28, 0.4)
            pts = np.array([
                [-t, -r], [t, -r], [t, -t], [r, -t], [r, t], [t, t],
                [t, r], [-t, r], [-t, t], [-r, t], [-r, -t], [-t, -t],
            ])
            theta = rng.uniform(-math.pi / 9, math.pi / 9)
        pts = _rotate(pts, theta)
        half = np.abs(pts).max(axis=0)
    lo_x, hi_x = half[0] + 1, w - 1 - half[0]
    lo_y, hi_y = half[1] + 1, h - 1 - half[1]
    if lo_x >= hi_x or lo_y >= hi_y:
        return None
    cx, cy = rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y)
    canvas = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(canvas)
    if pts is None:
        draw.ellipse([cx - half[0], cy - half[1], cx + half[0], cy + half[1]], fill=255)
    else:
        draw.polygon([(float(x + cx), float(y + cy)) for x, y in pts], fill=255)
    mask = np.asarray(canvas) > 0
    return mask if mask.any() else None
