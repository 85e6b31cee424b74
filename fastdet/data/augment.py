"""The stages of ``fastdet.data.stages`` on numpy images, box-aware (the torch back end's).

:func:`run_stages` runs one sample through a stage list in its order; the DALI
pipelines (``fastdet.pipelines``) build the same chain on the device. Each stage and
where its parameters come from:

- Distort: brightness, contrast, saturation in [0.5, 1.5] and hue in [-18, 18]
  degrees, each applied with probability 0.5 (PaddleDetection ``RandomDistort``).
  The operations are DALI's, so both back ends compute the same thing:
  ``brightness_contrast`` (``b * (128 + c * (x - 128))``) then ``hsv`` (a linear map in
  YIQ space: saturation scales I and Q, hue rotates them). PaddleDetection's own code
  adds the "brightness" delta to 0..255 values (a no-op in effect) and multiplies by
  the "contrast" delta; it also applies the four in a random order, here the order is
  fixed. Values are rounded and clipped to uint8 after each of the two steps.
- ExpandCrop: with probability 0.5 the image is placed at a random integer offset on
  a canvas ``ratio`` in [1, 4] times larger, filled with the ImageNet mean (never
  materialised: the crop window is cut from the original with that fill); then
  PaddleDetection ``RandomCrop`` (SSD-style): thresholds [0, .1, .3, .5, .7, .9] plus
  "no crop" in random order, 50 attempts each, scale [0.3, 1] and aspect ratio
  [0.5, 2] relative to the canvas, IoU with the best box (``cover_all_box=False``);
  boxes whose centre leaves the window are dropped, the others clipped to it. An
  image without boxes is not cropped.
- Flip: horizontal with probability ``prob``.
- Mosaic, RandomAffine, MixUp: the plans of ``fastdet.data.geometry`` (YOLOX,
  PaddleDetection), drawn from :func:`plan_rng`, executed here with torch's
  resampling (bilinear, no antialiasing; ``warp_affine`` is cv2.warpAffine's bilinear
  with a constant border).
- HSV: YOLOX ``augment_hsv`` on OpenCV's 8-bit HSV (H 0..180), additive gains.
- Resize: to the batch's (H, W) canvas: stretch (no kept ratio, the batch's
  interpolation, cv2 semantics as PaddleDetection), top-left letterbox (YOLOX
  ``preproc``) or keep-ratio (FCOS), filled with ``pad_value``.
- Normalize: ImageNet-style mean/std on 0..255, or raw 0..255 floats.
- targets: boxes narrower or lower than 1 px of the network input are dropped, the
  rest padded to ``max_boxes`` (``fastdet.data.targets.pad_one``: the largest are
  kept), with their scores (1, or a ``beta_blend`` mixup's λ / 1 − λ).

The draws of Distort, ExpandCrop, Flip and HSV come from the sample's generator in
list order, so PP-YOLOE's batches are the ones the fixed chain gave before stage lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from fastdet.data import geometry as G
from fastdet.data import stages as S
from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD
from fastdet.data.schedule import INTERPS
from fastdet.data.targets import keep_largest, pad_one

# RandomDistort: (low, high) of each factor.
BRIGHTNESS = (0.5, 1.5)
CONTRAST = (0.5, 1.5)
SATURATION = (0.5, 1.5)
HUE = (-18.0, 18.0)  # degrees
CONTRAST_CENTER = 128.0  # DALI brightness_contrast's default centre for uint8
FILL = tuple(int(round(m)) for m in IMAGENET_MEAN)  # uint8 canvas fill (123.675, 116.28, 103.53 rounded)
# RandomCrop.
CROP_THRESHOLDS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)
CROP_SCALING = (0.3, 1.0)
CROP_ASPECT = (0.5, 2.0)
CROP_ATTEMPTS = 50
MIN_BOX_SIZE = 1.0  # px of the network input; narrower or lower boxes are dropped


_MEAN_T = torch.tensor(IMAGENET_MEAN, dtype=torch.float32)
_INV_STD_T = 1.0 / torch.tensor(IMAGENET_STD, dtype=torch.float32)

# RGB <-> YIQ, as DALI's hsv operator (its matrix is verified against DALI in the tests).
_RGB2YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.321], [0.211, -0.523, 0.311]])
_YIQ2RGB = np.linalg.inv(_RGB2YIQ)
_TORCH_MODES = {"nearest": "nearest-exact", "linear": "bilinear", "cubic": "bicubic"}


class ImageDecodeError(RuntimeError):
    """An image file that cannot be used; the message names the file.

    ``reason`` is the ``fastdet.data.coco`` skip reason: "corrupt" or "size mismatch".
    """

    def __init__(self, message: str, reason: str = "corrupt") -> None:
        super().__init__(message)
        self.reason = reason


def decode_image(path: str) -> np.ndarray:
    """RGB uint8 [H, W, 3] of an image file, upright: its EXIF orientation applied, as the
    sizes the data layer reads (``fastdet.data.coco._probe``), OpenCV's imread and viewers do."""
    try:
        with Image.open(path) as im:
            # In place: the usual picture, stored upright, is not copied once more.
            ImageOps.exif_transpose(im, in_place=True)
            return rgb_of(im)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageDecodeError(f"{path}: cannot decode image ({e})") from None


def rgb_of(im: Image.Image) -> np.ndarray:
    """RGB uint8 [H, W, 3] of a PIL image. 16-bit grayscale (PNG, TIFF: modes ``I;16*``, and
    ``I`` as PIL opens some of them) keeps its high byte, as DALI's decoder and PIL's own
    16-bit RGB reading do; ``convert("RGB")`` would clip every value above 255 to white."""
    if im.mode.startswith("I;16") or im.mode == "I":
        gray = (np.clip(np.asarray(im, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    return np.array(im.convert("RGB"))


# --------------------------------------------------------------------------- colour

def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def brightness_contrast(img: np.ndarray, brightness: float, contrast: float) -> np.ndarray:
    """DALI ``brightness_contrast`` on uint8 [H, W, 3]: ``b * (128 + c * (x - 128))``."""
    x = img.astype(np.float32)
    return _to_uint8(brightness * (CONTRAST_CENTER + contrast * (x - CONTRAST_CENTER)))


def hsv_matrix(hue: float, saturation: float) -> np.ndarray:
    """[3, 3] RGB→RGB map of DALI ``hsv``: to YIQ, rotate IQ by ``hue`` degrees, scale IQ, back."""
    t = np.deg2rad(hue)
    rot = np.array([[1.0, 0.0, 0.0], [0.0, np.cos(t), np.sin(t)], [0.0, -np.sin(t), np.cos(t)]])
    sat = np.diag([1.0, saturation, saturation])
    return _YIQ2RGB @ rot @ sat @ _RGB2YIQ


def adjust_hsv(img: np.ndarray, hue: float, saturation: float) -> np.ndarray:
    m = hsv_matrix(hue, saturation).astype(np.float32)
    return _to_uint8(img.astype(np.float32) @ m.T)


def random_distort(img: np.ndarray, rng: np.random.Generator, prob: float) -> np.ndarray:
    """PP-YOLOE RandomDistort: each of the four factors applied with probability ``prob``."""

    def factor(lo: float, hi: float, neutral: float) -> float:
        on = rng.random() < prob
        value = rng.uniform(lo, hi)
        return float(value) if on else neutral

    b = factor(*BRIGHTNESS, 1.0)
    c = factor(*CONTRAST, 1.0)
    s = factor(*SATURATION, 1.0)
    h = factor(*HUE, 0.0)
    if b != 1.0 or c != 1.0:
        img = brightness_contrast(img, b, c)
    if s != 1.0 or h != 0.0:
        img = adjust_hsv(img, h, s)
    return img


# --------------------------------------------------------------------------- geometry

def random_expand(
    rng: np.random.Generator, width: int, height: int, prob: float, max_ratio: float
) -> tuple[int, int, int, int]:
    """PP-YOLOE RandomExpand: ``(canvas_w, canvas_h, offset_x, offset_y)`` (the identity when not drawn)."""
    if rng.random() >= prob:
        return width, height, 0, 0
    ratio = rng.uniform(1.0, max_ratio)
    cw, ch = int(width * ratio), int(height * ratio)
    if cw <= width or ch <= height:
        return width, height, 0, 0
    return cw, ch, int(rng.integers(0, cw - width)), int(rng.integers(0, ch - height))


def _iou(boxes: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """IoU [K, N] of windows [K, 4] with boxes [N, 4] (xyxy)."""
    lt = np.maximum(windows[:, None, :2], boxes[None, :, :2])
    rb = np.minimum(windows[:, None, 2:], boxes[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area_b = np.prod(boxes[:, 2:] - boxes[:, :2], axis=1)
    area_w = np.prod(windows[:, 2:] - windows[:, :2], axis=1)
    return inter / (area_w[:, None] + area_b[None, :] - inter + 1e-10)


def crop_boxes(boxes: np.ndarray, labels: np.ndarray, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Boxes [N, 4] whose centre lies in ``window`` (xyxy), clipped and shifted to its origin."""
    out, keep = _crop(boxes, window)
    return out, labels[keep]


def random_crop_window(rng: np.random.Generator, boxes: np.ndarray, width: int, height: int) -> np.ndarray:
    """PaddleDetection RandomCrop: a window [4] int xyxy in an image of ``width`` x ``height``.

    The thresholds and "no crop" are tried in random order; each threshold gets
    ``CROP_ATTEMPTS`` candidate windows (drawn at once, the first valid one wins, as
    PaddleDetection's sequential loop). The full image when there are no boxes, when
    "no crop" comes first, or when no candidate is valid.
    """
    full = np.array([0, 0, width, height], np.int64)
    if len(boxes) == 0:
        return full
    centers = (boxes[:, :2] + boxes[:, 2:]) / 2  # [N, 2]
    choices = list(CROP_THRESHOLDS) + [None]  # None: "no crop"
    n = CROP_ATTEMPTS
    for k in rng.permutation(len(choices)):
        thresh = choices[k]
        if thresh is None:
            return full
        scale = rng.uniform(*CROP_SCALING, size=n)
        ar = rng.uniform(np.maximum(CROP_ASPECT[0], scale**2), np.minimum(CROP_ASPECT[1], scale**-2))
        ch = (height * scale / np.sqrt(ar)).astype(np.int64)
        cw = (width * scale * np.sqrt(ar)).astype(np.int64)
        y = (rng.random(n) * np.maximum(height - ch, 1)).astype(np.int64)
        x = (rng.random(n) * np.maximum(width - cw, 1)).astype(np.int64)
        win = np.stack([x, y, x + cw, y + ch], axis=1)  # [n, 4]
        wf = win.astype(np.float32)
        iou_ok = _iou(boxes, wf).max(axis=1) >= thresh
        # Some box keeps its centre inside, with a positive clipped area (the kept set is non-empty).
        inside = ((wf[:, None, :2] <= centers) & (centers < wf[:, None, 2:])).all(axis=2)  # [n, N]
        clipped = (np.minimum(boxes[None, :, 2:], wf[:, None, 2:]) > np.maximum(boxes[None, :, :2], wf[:, None, :2]))
        valid = iou_ok & (cw >= 1) & (ch >= 1) & (inside & clipped.all(axis=2)).any(axis=1)
        if valid.any():
            return win[int(np.argmax(valid))]
    return full


def extract(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, fill: tuple[int, int, int] = FILL) -> np.ndarray:
    """Pixels [y0:y1, x0:x1] of ``img`` [H, W, 3]; parts outside the image get ``fill``."""
    h, w = img.shape[:2]
    if x0 >= 0 and y0 >= 0 and x1 <= w and y1 <= h:
        return img[y0:y1, x0:x1]
    out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
    out[:] = np.asarray(fill, np.uint8)
    sx0, sy0, sx1, sy1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    if sx1 > sx0 and sy1 > sy0:
        out[sy0 - y0 : sy1 - y0, sx0 - x0 : sx1 - x0] = img[sy0:sy1, sx0:sx1]
    return out


def resize(img: np.ndarray, size, interp: int) -> torch.Tensor:
    """uint8 [H, W, 3] → uint8 [3, H', W'] (HWC in memory) for ``size`` (H', W') or a square
    side, pixel-centre aligned, no antialiasing.

    torch's uint8 kernels: nearest and linear match DALI's resize within one level;
    cubic is cv2's (a = -0.75, as PaddleDetection), DALI's cubic kernel differs slightly.
    """
    mode = _TORCH_MODES[INTERPS[interp]]
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None]  # [1, 3, H, W], channels-last strides
    kw = {} if mode == "nearest-exact" else {"align_corners": False, "antialias": False}
    hw = (size, size) if isinstance(size, int) else tuple(int(v) for v in size)
    return F.interpolate(x, size=hw, mode=mode, **kw)[0]


def normalize(img: torch.Tensor, *, channels_last: bool) -> torch.Tensor:
    """uint8 [3, H, W] → float32 ImageNet-normalised, contiguous [3, H, W] (or [H, W, 3] when channels_last)."""
    if channels_last:
        return img.permute(1, 2, 0).contiguous().float().sub_(_MEAN_T).mul_(_INV_STD_T)
    return img.contiguous().float().sub_(_MEAN_T.view(3, 1, 1)).mul_(_INV_STD_T.view(3, 1, 1))


def resize_hwc(img: np.ndarray, hw: tuple[int, int], mode: str = "linear") -> np.ndarray:
    """uint8 [H, W, 3] → uint8 [h, w, 3], pixel-centre aligned, no antialiasing (cv2 semantics)."""
    if img.shape[:2] == tuple(hw):
        return img
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None]
    m = _TORCH_MODES[mode]
    kw = {} if m == "nearest-exact" else {"align_corners": False, "antialias": False}
    return F.interpolate(x, size=tuple(int(v) for v in hw), mode=m, **kw)[0].permute(1, 2, 0).numpy()


def place(img: np.ndarray, canvas_hw: tuple[int, int], xy: tuple[int, int], fill: float) -> np.ndarray:
    """``img`` [h, w, 3] with its top-left at ``xy`` (may be negative) on a ``canvas_hw`` canvas of ``fill``."""
    ch, cw = canvas_hw
    x, y = xy
    return extract(img, -x, -y, cw - x, ch - y, fill=(int(fill),) * 3)


def warp_affine(img: np.ndarray, M: np.ndarray, out_hw: tuple[int, int], fill: float) -> np.ndarray:
    """cv2.warpAffine (bilinear, constant border ``fill``): ``out[y, x] = img[M⁻¹ (x, y)]``, uint8 [H, W, 3]."""
    h, w = img.shape[:2]
    oh, ow = out_hw
    inv = np.linalg.inv(np.vstack([M, [0.0, 0.0, 1.0]]))[:2]
    ys, xs = np.meshgrid(np.arange(oh, dtype=np.float64), np.arange(ow, dtype=np.float64), indexing="ij")
    u = inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]
    v = inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]
    # Pixel centres at integer coordinates (cv2) → grid_sample's [-1, 1] over pixel edges.
    grid = np.stack([(2 * u + 1) / w - 1, (2 * v + 1) / h - 1], -1).astype(np.float32)
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].float() - fill
    out = F.grid_sample(x, torch.from_numpy(grid)[None], mode="bilinear", padding_mode="zeros", align_corners=False)
    return out[0].add_(fill).round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


# OpenCV's 8-bit HSV: H in 0..180 (degrees / 2), S and V in 0..255.
def rgb_to_hsv(img: np.ndarray) -> np.ndarray:
    x = img.astype(np.float32)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    v = x.max(-1)
    d = v - x.min(-1)
    s = np.where(v > 0, 255.0 * d / np.maximum(v, 1e-6), 0.0)
    dd = np.maximum(d, 1e-6)
    h = np.where(v == r, 60.0 * (g - b) / dd, np.where(v == g, 120.0 + 60.0 * (b - r) / dd, 240.0 + 60.0 * (r - g) / dd))
    h = np.where(d == 0, 0.0, h) % 360.0
    return np.stack([np.rint(h / 2) % 180, np.rint(s), v], -1).astype(np.int16)


def hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    h = hsv[..., 0].astype(np.float32) * 2.0
    s = hsv[..., 1].astype(np.float32) / 255.0
    v = hsv[..., 2].astype(np.float32)
    c = v * s
    hp = h / 60.0
    xx = c * (1 - np.abs(hp % 2 - 1))
    z = np.zeros_like(c)
    k = np.floor(hp).astype(np.int64) % 6
    r = np.choose(k, [c, xx, z, z, xx, c])
    g = np.choose(k, [xx, c, c, xx, z, z])
    b = np.choose(k, [z, z, xx, c, c, xx])
    m = v - c
    return _to_uint8(np.stack([r + m, g + m, b + m], -1))


def hsv_gains(rng: np.random.Generator, st: S.HSV) -> Optional[np.ndarray]:
    """YOLOX augment_hsv's draw: int16 [3] additive (h, s, v) gains, each on or off; None when not drawn."""
    if rng.random() >= st.prob:
        return None
    gains = rng.uniform(-1, 1, 3) * np.array([st.hgain, st.sgain, st.vgain])
    gains *= rng.integers(0, 2, 3)
    return gains.astype(np.int16)


def augment_hsv(img: np.ndarray, gains: np.ndarray) -> np.ndarray:
    """YOLOX ``augment_hsv`` (current): hue += g0 mod 180, saturation and value += g1, g2 clipped."""
    hsv = rgb_to_hsv(img)
    hsv[..., 0] = (hsv[..., 0] + gains[0]) % 180
    hsv[..., 1] = np.clip(hsv[..., 1] + gains[1], 0, 255)
    hsv[..., 2] = np.clip(hsv[..., 2] + gains[2], 0, 255)
    return hsv_to_rgb(hsv)


# --------------------------------------------------------------------------- the chain

@dataclass
class Work:
    """One sample between stages: uint8 [h, w, 3] RGB and its boxes [N, 4] xyxy px, labels [N], scores [N]."""

    img: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    scores: np.ndarray
    mosaicked: bool = False

    @classmethod
    def of(cls, img: np.ndarray, boxes: np.ndarray, labels: np.ndarray) -> "Work":
        boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
        return cls(img, boxes, np.asarray(labels, np.int64).reshape(-1), np.ones(len(boxes), np.float32))

    def keep(self, mask: np.ndarray) -> None:
        self.labels, self.scores = self.labels[mask], self.scores[mask]


@dataclass
class Result:
    image: torch.Tensor  # uint8 [3, H, W] (HWC in memory)
    boxes: np.ndarray  # [N, 4] float32 xyxy px of the network input
    labels: np.ndarray  # [N] int64
    scores: np.ndarray  # [N] float32
    scale: tuple[float, float]  # (sx, sy) of the final resize: input px per px before it


def plan_rng(sample_seed: int) -> np.random.Generator:
    """The generator of the planned stages (Mosaic, RandomAffine, MixUp): the DALI source draws
    the same plans from it. The other stages draw from the sample's own generator."""
    return np.random.default_rng([sample_seed, 0x9EA7])


def run_stages(
    w: Work,
    stages: tuple,
    *,
    hw: tuple[int, int],
    interp: int,
    rng: Optional[np.random.Generator],
    prng: Optional[np.random.Generator] = None,
    partners: Sequence[Work] = (),
) -> Result:
    """One sample through ``stages`` (``fastdet.data.stages``; ``rng=None``: only Resize).

    Args:
        w: the sample as decoded.
        hw: the batch's (H, W) canvas; interp: index into ``INTERPS`` for a "random" Resize.
        rng: draws of Distort, ExpandCrop, Flip, HSV (the order is PP-YOLOE's chain's, so its
            batches are unchanged); prng: draws of the planned stages (:func:`plan_rng`).
        partners: the records drawn for Mosaic (3) and MixUp (1), in stage order, as decoded.
    """
    queue = list(partners)
    for st in stages:
        if rng is None and not isinstance(st, (S.Resize, S.Normalize)):
            continue
        if isinstance(st, S.Distort):
            if st.prob > 0:
                w.img = random_distort(w.img, rng, st.prob)
        elif isinstance(st, S.ExpandCrop):
            _expand_crop(w, st, rng)
        elif isinstance(st, S.Flip):
            if rng.random() < st.prob:
                wd = w.img.shape[1]
                w.img = w.img[:, ::-1]
                b = w.boxes
                w.boxes = np.stack([wd - b[:, 2], b[:, 1], wd - b[:, 0], b[:, 3]], axis=1).reshape(-1, 4)
        elif isinstance(st, S.Mosaic):
            _mosaic(w, st, prng, hw, [queue.pop(0) for _ in range(3)])
        elif isinstance(st, S.RandomAffine):
            if w.mosaicked or not st.after_mosaic_only:
                M, s = G.affine_matrix(prng, st.degrees, st.translate, st.scale, st.shear, hw)
                w.img = warp_affine(w.img, M, hw, st.pad_value)
                w.boxes, keep = G.affine_boxes(w.boxes, M, s, hw)
                w.boxes = w.boxes[keep]
                w.keep(keep)
        elif isinstance(st, S.MixUp):
            _mixup(w, st, prng, hw, queue.pop(0))
        elif isinstance(st, S.HSV):
            gains = hsv_gains(rng, st)
            if gains is not None:
                w.img = augment_hsv(w.img, gains)
        elif isinstance(st, S.Resize):
            return _resize(w, st, hw, interp)
    raise ValueError("a stage list ends with one Resize then one Normalize")


def _expand_crop(w: Work, st: S.ExpandCrop, rng: np.random.Generator) -> None:
    h, wd = w.img.shape[:2]
    cw, ch, ox, oy = random_expand(rng, wd, h, st.expand_prob, st.max_ratio)
    boxes = w.boxes + np.array([ox, oy, ox, oy], np.float32)  # canvas px
    win = random_crop_window(rng, boxes, cw, ch) if st.crop else np.array([0, 0, cw, ch], np.int64)
    w.boxes, keep = _crop(boxes, win.astype(np.float32))
    w.keep(keep)
    x0, y0, x1, y1 = (int(v) for v in win)
    w.img = extract(w.img, x0 - ox, y0 - oy, x1 - ox, y1 - oy)


def _mosaic(w: Work, st: S.Mosaic, prng: np.random.Generator, hw: tuple[int, int], others: list[Work]) -> None:
    recs = [w] + others
    sizes = [(r.img.shape[1], r.img.shape[0]) for r in recs]
    plan = G.mosaic_plan(prng, st.prob, st.center_range, hw, sizes)
    if plan is None:
        return
    canvas = np.full((*plan.canvas_hw, 3), int(st.pad_value), np.uint8)
    for r, t in zip(recs, plan.tiles):
        tile = resize_hwc(r.img, t.hw, "linear")
        x, y = t.xy
        x0, y0 = max(x, 0), max(y, 0)
        x1, y1 = min(x + t.hw[1], plan.canvas_hw[1]), min(y + t.hw[0], plan.canvas_hw[0])
        if x1 > x0 and y1 > y0:
            canvas[y0:y1, x0:x1] = tile[y0 - y : y1 - y, x0 - x : x1 - x]
    w.boxes = G.mosaic_boxes(plan, sizes, [r.boxes for r in recs])
    w.labels = np.concatenate([r.labels for r in recs])
    w.scores = np.concatenate([r.scores for r in recs])
    w.img, w.mosaicked = canvas, True


def _mixup(w: Work, st: S.MixUp, prng: np.random.Generator, hw: tuple[int, int], p: Work) -> None:
    th, tw = w.img.shape[:2]
    if st.kind == "scaled_crop":
        plan, boxes, keep = G.scaled_crop_mixup_plan(prng, st.prob, st.scale, hw, (th, tw), len(w.boxes) > 0,
                                                     (p.img.shape[1], p.img.shape[0]), p.boxes)
        if plan is None:
            return
        other = mixup_partner_pixels(p.img, plan)
        w.img = (0.5 * w.img.astype(np.float32) + 0.5 * other.astype(np.float32)).astype(np.uint8)
        w.boxes = np.concatenate([w.boxes, boxes])
        w.labels = np.concatenate([w.labels, p.labels[keep]])
        w.scores = np.concatenate([w.scores, p.scores[keep]])
        return
    lam = G.beta_blend_factor(prng, st.prob, st.alpha, st.beta)
    if lam is None or lam >= 1.0:
        return
    if lam <= 0.0:
        w.img, w.boxes, w.labels, w.scores = p.img, p.boxes, p.labels, p.scores
        return
    ph, pw = p.img.shape[:2]
    out = np.zeros((max(th, ph), max(tw, pw), 3), np.float32)
    out[:th, :tw] = w.img.astype(np.float32) * lam
    out[:ph, :pw] += p.img.astype(np.float32) * (1.0 - lam)
    w.img = out.astype(np.uint8)  # PaddleDetection truncates
    w.boxes = np.concatenate([w.boxes, p.boxes])
    w.labels = np.concatenate([w.labels, p.labels])
    w.scores = np.concatenate([w.scores * lam, p.scores * (1.0 - lam)]).astype(np.float32)


def mixup_partner_pixels(img: np.ndarray, plan: G.ScaledCropMixupPlan) -> np.ndarray:
    """The YOLOX mixup partner's pixels on the target: letterbox, jitter, flip, crop; uint8 [th, tw, 3]."""
    letter = place(resize_hwc(img, plan.letter_hw, "linear"), plan.input_hw, (0, 0), 114)
    jit = resize_hwc(letter, plan.jitter_hw, "linear")
    if plan.flip:
        jit = jit[:, ::-1]
    ox, oy = plan.offset
    th, tw = plan.target_hw
    return place(jit, (th, tw), (-ox, -oy), 0)


def _crop(boxes: np.ndarray, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    centers = (boxes[:, :2] + boxes[:, 2:]) / 2
    out = boxes.copy()
    out[:, :2] = np.maximum(boxes[:, :2], window[:2]) - window[:2]
    out[:, 2:] = np.minimum(boxes[:, 2:], window[2:]) - window[:2]
    keep = ((window[:2] <= centers) & (centers < window[2:])).all(axis=1) & (out[:, :2] < out[:, 2:]).all(axis=1)
    return out[keep], keep


def resize_scale(st: S.Resize, h: int, w: int, hw: tuple[int, int]) -> tuple[tuple[int, int], tuple[float, float]]:
    """``((content h, w), (sx, sy))`` of the Resize stage for an ``h`` x ``w`` image on the ``hw`` canvas.

    stretch: the whole canvas; letterbox: ``r = min(H / h, W / w)``, content ``int(h r), int(w r)``
    (YOLOX ``preproc``); keep_ratio: the same ratio further capped by the recipe's short / long
    side at this canvas's scale (FCOS Resize keep_ratio). Boxes scale by ``(r, r)``, or with
    ``st.box_scale == "content"`` by the content's true factor ``(int(w r) / w, int(h r) / h)``.
    """
    H, W = hw
    if st.mode == "stretch":
        return (H, W), (W / w, H / h)
    r = min(H / h, W / w)
    if st.mode == "keep_ratio":
        short = min(H, W)
        r = min(r, short / min(h, w), short * st.max_long / st.short / max(h, w))
    ch, cw = max(1, min(H, int(h * r))), max(1, min(W, int(w * r)))
    return (ch, cw), ((cw / w, ch / h) if st.box_scale == "content" else (r, r))


def _resize(w: Work, st: S.Resize, hw: tuple[int, int], interp: int) -> Result:
    h, wd = w.img.shape[:2]
    mode = INTERPS[interp] if st.interp == "random" else st.interp
    if st.mode == "stretch":
        # Relative to the image, then to the input: the DALI graph does the same two steps.
        rel = w.boxes / np.array([wd, h, wd, h], np.float32)
        out = resize(w.img, hw, INTERPS.index(mode))
        boxes = (rel * np.array([hw[1], hw[0], hw[1], hw[0]], np.float32)).astype(np.float32)
        return Result(out, boxes, w.labels, w.scores, (hw[1] / wd, hw[0] / h))
    content, (sx, sy) = resize_scale(st, h, wd, hw)
    img = place(resize_hwc(w.img, content, mode), hw, (0, 0), st.pad_value)
    boxes = (w.boxes * np.array([sx, sy, sx, sy], np.float32)).astype(np.float32)
    return Result(torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1), boxes, w.labels, w.scores, (sx, sy))


def to_input(img: torch.Tensor, norm: S.Normalize, *, channels_last: bool) -> torch.Tensor:
    """uint8 [3, H, W] → float32 network input per ``norm``, [3, H, W] (or [H, W, 3] when channels_last)."""
    if norm.mean is not None and tuple(norm.mean) == IMAGENET_MEAN and tuple(norm.std) == IMAGENET_STD:
        return normalize(img, channels_last=channels_last)  # PP-YOLOE's exact arithmetic
    x = img.permute(1, 2, 0).contiguous().float() if channels_last else img.contiguous().float()
    if norm.mean is None:
        return x
    mean = torch.tensor(norm.mean, dtype=torch.float32)
    inv = 1.0 / torch.tensor(norm.std, dtype=torch.float32)
    if not channels_last:
        mean, inv = mean.view(3, 1, 1), inv.view(3, 1, 1)
    return x.sub_(mean).mul_(inv)


def finalize(boxes: np.ndarray, labels: np.ndarray, scores: np.ndarray, max_boxes: int) -> dict[str, np.ndarray]:
    """Boxes under ``MIN_BOX_SIZE`` px dropped, the ``max_boxes`` largest kept and padded.

    Returns the sample's target fields of ``fastdet.data.layout`` and ``overflow``.
    """
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    keep = ((boxes[:, 2] - boxes[:, 0]) >= MIN_BOX_SIZE) & ((boxes[:, 3] - boxes[:, 1]) >= MIN_BOX_SIZE)
    b, lab, s = boxes[keep], np.asarray(labels, np.int64).reshape(-1)[keep], np.asarray(scores, np.float32)[keep]
    out_b, out_l, out_m, overflow = pad_one(b, lab, max_boxes)
    out_s = np.zeros(max_boxes, np.float32)
    out_s[: int(out_m.sum())] = s[keep_largest(b, max_boxes)]
    return {"gt_boxes": out_b, "gt_labels": out_l, "gt_mask": out_m, "gt_scores": out_s, "overflow": overflow}


def finalize_batch(boxes: Sequence[np.ndarray], labels: Sequence[np.ndarray], box_scale: Sequence[np.ndarray],
                   scores: Optional[Sequence[np.ndarray]], max_boxes: int) -> dict[str, np.ndarray]:
    """:func:`finalize` of a whole batch at once, bit for bit (the DALI pipeline's targets).

    Args:
        boxes: B arrays [N_i, 4] xyxy, each scaled by its ``box_scale`` [2] (x, y) to pixels.
        labels: B arrays [N_i]; scores: B arrays [N_i] or None (all ones).

    Returns ``gt_boxes [B, M, 4]``, ``gt_labels [B, M]``, ``gt_mask [B, M]``, ``gt_scores [B, M]``
    and ``overflow [B]`` (int64): per sample the M largest of the boxes of at least
    ``MIN_BOX_SIZE`` px, in their original order (ties: the earlier box), as :func:`finalize`.
    """
    n_img, m = len(boxes), max_boxes
    b = [np.asarray(x, np.float32).reshape(-1, 4) for x in boxes]
    seg = np.repeat(np.arange(n_img), [len(x) for x in b])  # [N] sample of each box
    scale = np.tile(np.stack([np.asarray(s, np.float32).reshape(2) for s in box_scale]), (1, 2))  # [B, 4]
    b = np.concatenate(b) * scale[seg]  # [N, 4] px
    lab = np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in labels])
    s = (np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in scores]) if scores is not None
         else np.ones(len(b), np.float32))
    keep = ((b[:, 2] - b[:, 0]) >= MIN_BOX_SIZE) & ((b[:, 3] - b[:, 1]) >= MIN_BOX_SIZE)
    b, lab, s, seg = b[keep], lab[keep], s[keep], seg[keep]
    n = np.bincount(seg, minlength=n_img)  # [B] boxes over the size
    # Rank by area within each sample (largest first, then position: keep_largest's stable sort).
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    order = np.lexsort((np.arange(len(b)), -area, seg))
    rank = np.arange(len(b)) - (np.cumsum(n) - n)[seg[order]]
    chosen = np.zeros(len(b), bool)
    chosen[order[rank < m]] = True
    idx = np.flatnonzero(chosen)  # in original order
    k = np.bincount(seg[idx], minlength=n_img)
    row, slot = seg[idx], np.arange(len(idx)) - (np.cumsum(k) - k)[seg[idx]]
    out = {"gt_boxes": np.zeros((n_img, m, 4), np.float32), "gt_labels": np.zeros((n_img, m), np.int64),
           "gt_mask": np.zeros((n_img, m), bool), "gt_scores": np.zeros((n_img, m), np.float32)}
    out["gt_boxes"][row, slot] = b[idx]
    out["gt_labels"][row, slot] = lab[idx]
    out["gt_mask"][row, slot] = True
    out["gt_scores"][row, slot] = s[idx]
    out["overflow"] = (n - k).astype(np.int64)
    return out


# --------------------------------------------------------------------------- plans for the DALI source

PLANNED = (S.Mosaic, S.RandomAffine, S.MixUp)


@dataclass
class Prefix:
    """What the planned stages at the head of a stage list do to one sample, without pixels.

    The DALI source computes it (same draws, same order as :func:`run_stages`) and the
    graph executes it: ``mosaic`` / ``affine`` / ``mixup`` hold the plans (None: that
    stage left the sample alone), ``wh`` the image size after the prefix, ``boxes`` etc.
    the sample's boxes on it.
    """

    wh: tuple[int, int]
    boxes: np.ndarray
    labels: np.ndarray
    scores: np.ndarray
    mosaic: Optional[G.MosaicPlan] = None
    affine: Optional[tuple[np.ndarray, tuple[int, int]]] = None  # (M [2, 3] src → dst, out (h, w))
    mixup: Optional[object] = None  # G.ScaledCropMixupPlan, or the beta_blend λ (float)
    mixup_wh: tuple[int, int] = (0, 0)  # beta_blend: the partner's (w, h)
    wh_before: dict = None  # stage type → (w, h) of the image entering it


def planned_prefix(stages: tuple) -> tuple:
    """The planned stages at the head of ``stages`` (the DALI graph needs them before any other geometry)."""
    n = 0
    while n < len(stages) and isinstance(stages[n], PLANNED + (S.HSV, S.Distort)):
        n += 1
    head = tuple(s for s in stages[:n] if isinstance(s, PLANNED))
    kinds = [type(s) for s in head]
    if len(set(kinds)) != len(kinds):
        raise ValueError("the DALI loader plans at most one Mosaic, one RandomAffine and one MixUp per stage list")
    later = [s for s in stages[n:] if isinstance(s, PLANNED)]
    if later:
        raise ValueError(f"{type(later[0]).__name__} after a geometric stage: the DALI loader plans Mosaic, "
                         "RandomAffine and MixUp first (put them before ExpandCrop, Flip and Resize, or use "
                         "--loader torch)")
    return head


def plan_sample(head: tuple, own: tuple, partners: Sequence[tuple], prng: np.random.Generator,
                hw: tuple[int, int]) -> Prefix:
    """:class:`Prefix` of one sample: ``own`` and ``partners`` are ``((w, h), boxes px, labels)``."""
    (w, h), boxes, labels = own
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    p = Prefix((w, h), boxes, np.asarray(labels, np.int64).reshape(-1), np.ones(len(boxes), np.float32),
               wh_before={})
    queue = list(partners)
    mosaicked = False
    for st in head:
        p.wh_before[type(st)] = p.wh
        if isinstance(st, S.Mosaic):
            others = [queue.pop(0) for _ in range(3)]
            recs = [((p.wh), p.boxes, p.labels)] + [(o[0], np.asarray(o[1], np.float32).reshape(-1, 4), o[2])
                                                   for o in others]
            sizes = [r[0] for r in recs]
            plan = G.mosaic_plan(prng, st.prob, st.center_range, hw, sizes)
            if plan is not None:
                p.mosaic, mosaicked = plan, True
                p.boxes = G.mosaic_boxes(plan, sizes, [r[1] for r in recs])
                p.labels = np.concatenate([np.asarray(r[2], np.int64).reshape(-1) for r in recs])
                p.scores = np.ones(len(p.boxes), np.float32)
                p.wh = (plan.canvas_hw[1], plan.canvas_hw[0])
        elif isinstance(st, S.RandomAffine):
            if mosaicked or not st.after_mosaic_only:
                M, s = G.affine_matrix(prng, st.degrees, st.translate, st.scale, st.shear, hw)
                boxes, keep = G.affine_boxes(p.boxes, M, s, hw)
                p.boxes, p.labels, p.scores = boxes[keep], p.labels[keep], p.scores[keep]
                p.affine, p.wh = (M, hw), (hw[1], hw[0])
        elif isinstance(st, S.MixUp):
            (pw, ph), pboxes, plabels = queue.pop(0)
            pboxes = np.asarray(pboxes, np.float32).reshape(-1, 4)
            plabels = np.asarray(plabels, np.int64).reshape(-1)
            if st.kind == "scaled_crop":
                th, tw = p.wh[1], p.wh[0]
                plan, b, keep = G.scaled_crop_mixup_plan(prng, st.prob, st.scale, hw, (th, tw),
                                                         len(p.boxes) > 0, (pw, ph), pboxes)
                if plan is not None:
                    p.mixup = plan
                    p.boxes = np.concatenate([p.boxes, b])
                    p.labels = np.concatenate([p.labels, plabels[keep]])
                    p.scores = np.concatenate([p.scores, np.ones(int(keep.sum()), np.float32)])
                continue
            lam = G.beta_blend_factor(prng, st.prob, st.alpha, st.beta)
            if lam is None or lam >= 1.0:
                continue
            p.mixup, p.mixup_wh = lam, (pw, ph)
            ones = np.ones(len(pboxes), np.float32)
            if lam <= 0.0:
                p.wh, p.boxes, p.labels, p.scores = (pw, ph), pboxes, plabels, ones
                continue
            p.wh = (max(p.wh[0], pw), max(p.wh[1], ph))
            p.boxes = np.concatenate([p.boxes, pboxes])
            p.labels = np.concatenate([p.labels, plabels])
            p.scores = np.concatenate([p.scores * lam, ones * (1.0 - lam)]).astype(np.float32)
    return p
