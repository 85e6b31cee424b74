"""PP-YOLOE's training augmentation on numpy images, box-aware (the torch back end's).

The chain (PaddleDetection ``configs/ppyoloe/_base_/ppyoloe_reader.yml``)::

    decode → RandomDistort → RandomExpand → RandomCrop → RandomFlip → (per batch) resize → normalise

and it is the same chain the DALI pipelines (``fastdet.pipelines``) run on the device.
Parameters and where they come from:

- distort: brightness, contrast, saturation in [0.5, 1.5] and hue in [-18, 18]
  degrees, each applied with probability 0.5 (PaddleDetection ``RandomDistort``).
  The operations are DALI's, so both back ends compute the same thing:
  ``brightness_contrast`` (``b * (128 + c * (x - 128))``) then ``hsv`` (a linear map in
  YIQ space: saturation scales I and Q, hue rotates them). PaddleDetection's own code
  adds the "brightness" delta to 0..255 values (a no-op in effect) and multiplies by
  the "contrast" delta; it also applies the four in a random order, here the order is
  fixed. Values are rounded and clipped to uint8 after each of the two steps.
- expand: with probability 0.5 the image is placed at a random integer offset on a
  canvas ``ratio`` in [1, 4] times larger, filled with the ImageNet mean. The canvas is
  never materialised: the crop window is cut from the original with that fill.
- crop: PaddleDetection ``RandomCrop`` (SSD-style): thresholds [0, .1, .3, .5, .7, .9]
  plus "no crop" in random order, 50 attempts each, scale [0.3, 1] and aspect ratio
  [0.5, 2] relative to the canvas, IoU with the best box (``cover_all_box=False``);
  boxes whose centre leaves the window are dropped, the others clipped to it. An image
  without boxes is not cropped.
- flip: horizontal with probability 0.5.
- resize: every image of a batch to one square size, no kept ratio, no antialiasing
  (cv2 semantics, as PaddleDetection), by the batch's interpolation.
- targets: boxes narrower or lower than 1 px of the network input are dropped, the
  rest padded to ``max_boxes`` (``fastdet.data.targets.pad_one``: the largest are kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fastdet.data.loader import INTERPS
from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD
from fastdet.data.targets import pad_one

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


@dataclass(frozen=True)
class AugmentSpec:
    """Which stages run and how often; both back ends build their chain from it.

    ``PPYOLOE`` is the recipe. A stage with probability 0 (or ``crop=False``) is left out
    of the DALI graph at build time.
    """

    distort_prob: float = 0.5  # each of brightness, contrast, saturation, hue
    expand_prob: float = 0.5
    expand_max_ratio: float = 4.0
    crop: bool = True
    flip_prob: float = 0.5


PPYOLOE = AugmentSpec()


def spec_from_config(data_cfg) -> "AugmentSpec | None":
    """The training augmentation a :class:`fastdet.config.DataConfig` asks for (None: off)."""
    if not data_cfg.augment:
        return None
    for name in ("distort_prob", "expand_prob", "flip_prob"):
        if not 0.0 <= getattr(data_cfg, name) <= 1.0:
            raise ValueError(f"data.{name}: expected a probability in [0, 1], got {getattr(data_cfg, name)}")
    if data_cfg.expand_max_ratio < 1.0:
        raise ValueError(f"data.expand_max_ratio: expected >= 1, got {data_cfg.expand_max_ratio}")
    return AugmentSpec(distort_prob=data_cfg.distort_prob, expand_prob=data_cfg.expand_prob,
                       expand_max_ratio=data_cfg.expand_max_ratio, crop=data_cfg.crop,
                       flip_prob=data_cfg.flip_prob)

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
    """RGB uint8 [H, W, 3] of an image file, in stored orientation (EXIF ignored, as the JSON sizes)."""
    try:
        with Image.open(path) as im:
            return np.array(im.convert("RGB"))
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageDecodeError(f"{path}: cannot decode image ({e})") from None


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
    centers = (boxes[:, :2] + boxes[:, 2:]) / 2
    out = boxes.copy()
    out[:, :2] = np.maximum(boxes[:, :2], window[:2]) - window[:2]
    out[:, 2:] = np.minimum(boxes[:, 2:], window[2:]) - window[:2]
    keep = ((window[:2] <= centers) & (centers < window[2:])).all(axis=1) & (out[:, :2] < out[:, 2:]).all(axis=1)
    return out[keep], labels[keep]


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


def resize(img: np.ndarray, size: int, interp: int) -> torch.Tensor:
    """uint8 [H, W, 3] → uint8 [3, size, size] (HWC in memory), pixel-centre aligned, no antialiasing.

    torch's uint8 kernels: nearest and linear match DALI's resize within one level;
    cubic is cv2's (a = -0.75, as PaddleDetection), DALI's cubic kernel differs slightly.
    """
    mode = _TORCH_MODES[INTERPS[interp]]
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None]  # [1, 3, H, W], channels-last strides
    kw = {} if mode == "nearest-exact" else {"align_corners": False, "antialias": False}
    return F.interpolate(x, size=(size, size), mode=mode, **kw)[0]


def normalize(img: torch.Tensor, *, channels_last: bool) -> torch.Tensor:
    """uint8 [3, H, W] → float32 ImageNet-normalised, contiguous [3, H, W] (or [H, W, 3] when channels_last)."""
    if channels_last:
        return img.permute(1, 2, 0).contiguous().float().sub_(_MEAN_T).mul_(_INV_STD_T)
    return img.contiguous().float().sub_(_MEAN_T.view(3, 1, 1)).mul_(_INV_STD_T.view(3, 1, 1))


# --------------------------------------------------------------------------- the chain

@dataclass
class Sample:
    image: torch.Tensor  # uint8 [3, S, S]
    boxes: np.ndarray  # [N, 4] float32 xyxy px of the network input
    labels: np.ndarray  # [N] int64


def transform(
    img: np.ndarray,
    boxes: np.ndarray,
    labels: np.ndarray,
    *,
    size: int,
    interp: int,
    rng: np.random.Generator | None,
    spec: AugmentSpec = PPYOLOE,
) -> Sample:
    """One image through the chain of ``spec`` (``rng=None``: no augmentation, resize only).

    Args:
        img: uint8 [H, W, 3] RGB.
        boxes: [N, 4] float32 xyxy px of ``img``.
        labels: [N] int64.
        size: the batch's square input size.
        interp: index into ``INTERPS``.
    """
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    labels = np.asarray(labels, np.int64).reshape(-1)
    if rng is not None:
        if spec.distort_prob > 0:
            img = random_distort(img, rng, spec.distort_prob)
        h, w = img.shape[:2]
        cw, ch, ox, oy = random_expand(rng, w, h, spec.expand_prob, spec.expand_max_ratio)
        boxes = boxes + np.array([ox, oy, ox, oy], np.float32)  # canvas px
        win = random_crop_window(rng, boxes, cw, ch) if spec.crop else np.array([0, 0, cw, ch], np.int64)
        boxes, labels = crop_boxes(boxes, labels, win.astype(np.float32))
        x0, y0, x1, y1 = (int(v) for v in win)
        img = extract(img, x0 - ox, y0 - oy, x1 - ox, y1 - oy)
        if rng.random() < spec.flip_prob:
            img = img[:, ::-1]
            boxes = np.stack([(x1 - x0) - boxes[:, 2], boxes[:, 1], (x1 - x0) - boxes[:, 0], boxes[:, 3]], axis=1)
    h, w = img.shape[:2]
    # Relative to the (cropped) image, then to the input: the DALI graph does the same two steps.
    rel = boxes / np.array([w, h, w, h], np.float32)
    out = resize(img, size, interp)
    return Sample(out, (rel * np.float32(size)).astype(np.float32), labels)


def finalize_targets(
    boxes: np.ndarray, labels: np.ndarray, max_boxes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Drop boxes under ``MIN_BOX_SIZE`` px, pad to ``max_boxes``: ``(boxes [M,4], labels [M], mask [M], overflow)``."""
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    labels = np.asarray(labels, np.int64).reshape(-1)
    keep = ((boxes[:, 2] - boxes[:, 0]) >= MIN_BOX_SIZE) & ((boxes[:, 3] - boxes[:, 1]) >= MIN_BOX_SIZE)
    return pad_one(boxes[keep], labels[keep], max_boxes)
