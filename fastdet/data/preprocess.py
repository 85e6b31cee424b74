"""How a family's network sees an image at evaluation and prediction time.

A family declares one :class:`Preprocess` (resize mode, canvas fill, normalisation);
evaluation, ``fastdet.predict`` and ``fastdet.export`` all read it, so a detector is
always fed the way its recipe trains and evaluates it. Three resize modes exist:

- ``"stretch"`` (PP-YOLOE, PP-YOLO): every image to the (H, W) input, aspect not kept;
- ``"letterbox"`` (YOLOX): scaled by ``r = min(H / h, W / w)`` and pasted at the
  top-left corner of an (H, W) canvas filled with ``pad_value``;
- ``"keep_ratio"`` (FCOS): scaled by ``r = min(S / min(h, w), S * max_long / short / max(h, w))``
  on a canvas whose short side is ``S`` (the short side to ``S``, the long side at most
  ``S * max_long / short``: at the recipe's ``S = 800``, 800 and 1333), never past the
  canvas, pasted at its top-left.

Which (H, W) canvas an image gets is :meth:`Preprocess.canvases` (the loader's
``canvases_for``: one square ``S`` x ``S``, or keep-ratio's landscape ``(S, L)``, portrait
``(L, S)`` and square ``(S, S)`` with ``L = ceil32(S * max_long / short)``). Evaluation
(``EvalSchedule``: batches of one canvas), ``fastdet.detect`` and ``fastdet.predict``
(:func:`by_canvas`) give each image the canvas of its own orientation
(:meth:`Preprocess.canvas`).

Letterbox and keep_ratio place ``floor(h r)`` x ``floor(w r)`` px of content, as the authors
(YOLOX ``preproc``: ``int(h * r)``; torchvision's ``GeneralizedRCNNTransform``: ``interpolate``
with ``scale_factor=r, recompute_scale_factor=True``, ``floor(h * r)``) and the training
Resize stage (``fastdet.data.augment.resize_scale``).

In every mode a network-input pixel ``p`` maps back to the original image as
``p / scale`` with ``scale = (sx, sy)`` per image (top-left placement: no offset).
Batches carry it as ``scale_factors [B, 2]`` (x, y); :func:`boxes_to_original` applies it.
Letterbox and keep_ratio take it from ``box_scale``, the family's author's map-back:
``"ratio"``: ``(r, r)`` (YOLOX's evaluator divides boxes by ``r``); ``"content"``: the placed
content's true factor ``(floor(w r) / w, floor(h r) / h)`` (torchvision's ``resize_boxes``
by the ratio of the original to the resized size).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD
from fastdet.data.schedule import HW, Canvases, canvases_for
from fastdet.data import stages as S
from fastdet.data.augment import resize_scale
from fastdet.data.stages import BOX_SCALES

RESIZE_MODES = ("stretch", "letterbox", "keep_ratio")
_TORCH_INTERP = {"nearest": "nearest-exact", "linear": "bilinear", "cubic": "bicubic"}


@dataclass(frozen=True)
class Preprocess:
    """The evaluation-time preprocessing of a family.

    Attributes:
        resize: one of ``RESIZE_MODES``.
        pad_value: canvas fill on 0..255 pixels (letterbox and keep_ratio; YOLOX: 114).
        mean, std: per-channel RGB statistics on 0..255 values; ``None``: raw 0..255
            pixels fed as float (YOLOX since 2021/08).
        interp: ``"nearest" | "linear" | "cubic"`` of the evaluation resize.
        short, max_long: keep_ratio's limits in px at the recipe's evaluation scale
            (FCOS: 800 / 1333); for another input size they scale with it: on a canvas
            whose short side is ``S`` they are ``S`` and ``S * max_long / short`` (the
            training Resize stage's rule, ``fastdet.data.augment.resize_scale``).
        box_scale: one of ``BOX_SCALES``, the ``(sx, sy)`` that letterbox and keep_ratio report
            (stretch: the canvas over the image either way): ``"ratio"`` the resize factor
            ``r`` (YOLOX), ``"content"`` the placed content's true factor (torchvision FCOS).
    """

    resize: str = "stretch"
    pad_value: float = 0.0
    mean: Optional[tuple[float, float, float]] = IMAGENET_MEAN
    std: Optional[tuple[float, float, float]] = IMAGENET_STD
    interp: str = "cubic"
    short: int = 800
    max_long: int = 1333
    box_scale: str = "content"

    def __post_init__(self) -> None:
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"Preprocess.resize: expected one of {', '.join(RESIZE_MODES)}, got {self.resize!r}")
        if self.box_scale not in BOX_SCALES:
            raise ValueError(f"Preprocess.box_scale: expected one of {', '.join(BOX_SCALES)}, got {self.box_scale!r}")
        if self.interp not in _TORCH_INTERP:
            raise ValueError(f"Preprocess.interp: expected nearest, linear or cubic, got {self.interp!r}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("Preprocess: mean and std are both set or both None")

    def resize_stage(self) -> S.Resize:
        """This resize as the Resize stage: the training resize's rule
        (:func:`fastdet.data.augment.resize_scale`) and the DALI evaluation's stage list."""
        return S.Resize(self.resize, pad_value=self.pad_value, interp=self.interp, short=self.short,
                        max_long=self.max_long, box_scale=self.box_scale)

    def scale(self, h: int, w: int, canvas_hw: Sequence[int]) -> tuple[float, float]:
        """``(sx, sy)``: the resize factors for an ``h`` x ``w`` image on ``canvas_hw`` (letterbox
        and keep_ratio: ``(r, r)``; the map-back is :meth:`__call__`'s, per ``box_scale``)."""
        _, scale = resize_scale(replace(self.resize_stage(), box_scale="ratio"), h, w, _hw(canvas_hw))
        return scale

    def canvases(self) -> Canvases:
        """The (H, W) canvases of this resize mode (``Canvases.buckets(S)``): the evaluation
        loader's, and so detect's, predict's and the export's."""
        return canvases_for(self.resize, self.short, self.max_long)

    def canvas(self, h: int, w: int, size: int) -> HW:
        """The canvas of an ``h`` x ``w`` image at input size ``size``: its orientation's,
        the one evaluation gives it (``EvalSchedule`` groups batches by ``Canvases.own``)."""
        return self.canvases().pick(size, np.array([w / h], np.float64))

    def resized_hw(self, h: int, w: int, canvas_hw: Sequence[int]) -> tuple[int, int]:
        """The (height, width) the image content occupies on the canvas: ``floor(h r)``,
        ``floor(w r)``, as YOLOX's ``preproc`` (``int(h * r)``), torchvision's FCOS transform
        (``recompute_scale_factor=True``), the training resize and the DALI evaluation resize
        (``pipelines/stages.py``) compute it, in float64."""
        return resize_scale(self.resize_stage(), h, w, _hw(canvas_hw))[0]

    def normalize_(self, x: Tensor) -> Tensor:
        """float [..., 3, H, W] on 0..255 → the network's input values (in place)."""
        if self.mean is None:
            return x
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(3, 1, 1)
        inv_std = 1.0 / torch.tensor(self.std, dtype=x.dtype, device=x.device).view(3, 1, 1)
        return x.sub_(mean).mul_(inv_std)

    def __call__(self, img: np.ndarray | Tensor, canvas_hw: Sequence[int]) -> tuple[Tensor, tuple[float, float]]:
        """One RGB uint8 image ``[H0, W0, 3]`` → ``(float32 [3, H, W] network input, (sx, sy))``."""
        # np.require copies only an array torch cannot wrap as it is: strided, or read-only
        # (np.asarray of a PIL image), which torch would warn of.
        x = torch.from_numpy(np.require(img, requirements=["C", "W"])) if isinstance(img, np.ndarray) else img
        if x.dim() != 3 or x.shape[-1] != 3:
            raise ValueError(f"Preprocess: expected an RGB image [H, W, 3], got {tuple(x.shape)}")
        h, w = int(x.shape[0]), int(x.shape[1])
        ch, cw = _hw(canvas_hw)
        (rh, rw), (sx, sy) = resize_scale(self.resize_stage(), h, w, (ch, cw))
        src = x.permute(2, 0, 1)[None]  # [1, 3, H0, W0]
        mode = _TORCH_INTERP[self.interp]
        kw = {} if mode == "nearest-exact" else {"align_corners": False, "antialias": False}
        if (rh, rw) != (h, w):
            src = F.interpolate(src, size=(rh, rw), mode=mode, **kw)  # uint8 in, uint8 out
        out = torch.full((3, ch, cw), float(self.pad_value), dtype=torch.float32)
        out[:, :rh, :rw] = src[0].float()
        return self.normalize_(out), (sx, sy)


def _hw(canvas_hw: Sequence[int]) -> tuple[int, int]:
    return int(canvas_hw[0]), int(canvas_hw[1])


def boxes_to_original(boxes: Tensor, scale_xy: Sequence[float] | Tensor, orig_hw: Sequence[int] | Tensor) -> Tensor:
    """Map ``[K, 4]`` xyxy boxes from the network input to the original image, clipped.

    Args:
        scale_xy: ``(sx, sy)`` input px per original px (a batch's ``scale_factors`` row).
        orig_hw: ``(height, width)`` of the original image (a batch's ``orig_sizes`` row).
    """
    sx, sy = (float(v) for v in scale_xy)
    o_h, o_w = (float(v) for v in orig_hw)
    out = boxes / boxes.new_tensor([sx, sy, sx, sy])
    out[:, 0::2] = out[:, 0::2].clamp(0, o_w)
    out[:, 1::2] = out[:, 1::2].clamp(0, o_h)
    return out


def by_canvas(shapes: Sequence[Sequence[int]], preprocess: Preprocess, size: int) -> dict[HW, list[int]]:
    """``{canvas (H, W): indices}`` of images of ``shapes`` (each ``(h, w, ...)``), each on its
    own canvas (:meth:`Preprocess.canvas`), in first-seen order: one batch per canvas."""
    groups: dict[HW, list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(preprocess.canvas(int(shape[0]), int(shape[1]), size), []).append(i)
    return groups
