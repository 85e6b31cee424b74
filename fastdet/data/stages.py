"""Augmentation as an ordered list of typed stages, the same list for both loader back ends.

A family's recipe returns, per training phase, a ``tuple[Stage, ...]``; the torch back
end (``fastdet.data.torch_backend``) and the DALI pipelines (``fastdet.pipelines``) each
build their chain from that tuple, stage by stage, so the two compute the same
augmentation (where DALI's semantics differ, the back end says so and a test bounds
the difference). Stages are frozen dataclasses: hashable (a phase change is a new
tuple, and a loader rebuilds its chain only when the tuple changes) and printable.

Order matters and is the recipe's. The usual orders:

- PP-YOLOE: ``Distort, ExpandCrop, Flip, Resize("stretch"), Normalize(ImageNet)``;
- PP-YOLO: ``MixUp("beta_blend"), Distort, ExpandCrop, Flip, Resize("stretch"), Normalize``;
- YOLOX: ``Mosaic, RandomAffine, MixUp("scaled_crop"), HSV, Flip, Resize("letterbox"), Normalize(None)``
  (its last 15 epochs: ``HSV, Flip, Resize("letterbox"), Normalize(None)``);
- FCOS: ``Flip, Resize("keep_ratio"), Normalize(ImageNet)``.

Every list ends with exactly one :class:`Resize` and one :class:`Normalize`; the batch's
(H, W) comes from the loader's size schedule (fixed buckets), never from a stage.
Stages that draw extra records (:class:`Mosaic`: 3 more, :class:`MixUp`: 1 more) take
them from the sampling schedule, keyed by (seed, epoch, step, slot), so resume and DDP
sharding stay exact. Boxes are dropped by each geometric stage as its reference does;
after the last stage boxes under 1 px are dropped and the rest padded to ``max_boxes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD


@dataclass(frozen=True)
class Distort:
    """PaddleDetection RandomDistort: brightness, contrast, saturation in [0.5, 1.5] and hue
    in [-18, 18] degrees, each applied with probability ``prob`` (``fastdet.data.augment``)."""

    prob: float = 0.5


@dataclass(frozen=True)
class ExpandCrop:
    """PaddleDetection RandomExpand (ratio in [1, ``max_ratio``] with probability ``expand_prob``,
    ImageNet-mean fill) then RandomCrop (SSD-style, when ``crop``), as one cut."""

    expand_prob: float = 0.5
    max_ratio: float = 4.0
    crop: bool = True


@dataclass(frozen=True)
class Flip:
    """Horizontal flip with probability ``prob``."""

    prob: float = 0.5


@dataclass(frozen=True)
class Mosaic:
    """YOLOX mosaic: with probability ``prob``, this record and 3 partners, each resized to fit
    the batch's input (S_h, S_w), on a (2·S_h, 2·S_w) canvas filled with ``pad_value``
    around a centre drawn as U(``center_range``)·S per axis. Its output is the 2S canvas;
    a :class:`RandomAffine` after it crops back to S (as YOLOX's ``random_affine`` does)."""

    prob: float = 1.0
    center_range: tuple[float, float] = (0.5, 1.5)
    pad_value: float = 114.0


@dataclass(frozen=True)
class RandomAffine:
    """YOLOX ``random_affine``: rotation ±``degrees``, translation ±``translate``·S, scale
    U(``scale``), shear ±``shear`` degrees, output (S_h, S_w) filled with ``pad_value``.
    Boxes are the transformed corners' extent, clipped; kept when w, h > 2 px, area ratio
    > 0.2 and aspect < 20 (YOLOX ``box_candidates``). ``after_mosaic_only``: applied only to
    samples the preceding :class:`Mosaic` mosaicked (YOLOX applies it inside the mosaic branch)."""

    degrees: float = 10.0
    translate: float = 0.1
    scale: tuple[float, float] = (0.1, 2.0)
    shear: float = 2.0
    pad_value: float = 114.0
    after_mosaic_only: bool = True


# MixUp's blends, named by what they do (see :class:`MixUp`).
MIXUP_KINDS = ("scaled_crop", "beta_blend")


@dataclass(frozen=True)
class MixUp:
    """Blend with one partner record, with probability ``prob``. ``kind`` names the blend:

    ``kind="scaled_crop"``: the partner is letterboxed to S, scaled by U(``scale``), flipped
    with p 0.5, randomly cropped to this sample's size, blended 0.5/0.5; its boxes kept by
    ``box_candidates`` with ``wh_thr`` 5. Scores stay 1. Drawn only when this sample has
    boxes. (Reproduces Megvii YOLOX's ``MosaicDetection.mixup``.)
    ``kind="beta_blend"``: λ ~ Beta(``alpha``, ``beta``) clipped to [0, 1]; both images on a
    max(h)×max(w) canvas, ``λ·a + (1−λ)·b``; boxes of both kept, ``gt_scores`` λ and 1−λ
    (λ ≥ 1 keeps this sample alone, λ ≤ 0 the partner alone). (Reproduces PaddleDetection's
    ``Mixup`` operator.)
    ``scale`` is read by ``scaled_crop`` only, ``alpha`` and ``beta`` by ``beta_blend`` only.
    """

    kind: str = "scaled_crop"
    prob: float = 1.0
    scale: tuple[float, float] = (0.5, 1.5)
    alpha: float = 1.5
    beta: float = 1.5

    def __post_init__(self) -> None:
        if self.kind not in MIXUP_KINDS:
            raise ValueError(f"MixUp.kind: expected one of {', '.join(map(repr, MIXUP_KINDS))}, got {self.kind!r}")


@dataclass(frozen=True)
class HSV:
    """YOLOX ``augment_hsv`` (current code): additive gains drawn in ±(``hgain``, ``sgain``,
    ``vgain``) on OpenCV's HSV (H in 0..180), each channel randomly on or off, with
    probability ``prob``."""

    hgain: float = 5.0
    sgain: float = 30.0
    vgain: float = 30.0
    prob: float = 1.0


# How letterbox / keep_ratio scale the boxes (Resize.box_scale, Preprocess.box_scale): by the
# resize factor r (YOLOX), or by the placed content's true factor floor(w r) / w (torchvision).
BOX_SCALES = ("ratio", "content")


@dataclass(frozen=True)
class Resize:
    """To the batch's input (S_h, S_w): ``mode`` is ``"stretch"``, ``"letterbox"`` (top-left,
    ``pad_value``) or ``"keep_ratio"`` (short side ``short``, long side ≤ ``max_long``, scaled
    with S, pasted top-left into the bucket canvas); letterbox and keep_ratio place
    ``floor(r · (h, w))`` px of content and scale boxes per ``box_scale`` (``BOX_SCALES``:
    by ``r``, or by that content's true factor). ``interp``: ``"random"`` draws one per
    batch from nearest/linear/cubic (PP-YOLOE BatchRandomResize), else that one."""

    mode: str = "stretch"
    pad_value: float = 0.0
    interp: str = "random"
    short: int = 800
    max_long: int = 1333
    box_scale: str = "ratio"

    def __post_init__(self) -> None:
        if self.mode not in ("stretch", "letterbox", "keep_ratio"):
            raise ValueError(f"Resize.mode: expected stretch, letterbox or keep_ratio, got {self.mode!r}")
        if self.box_scale not in BOX_SCALES:
            raise ValueError(f"Resize.box_scale: expected one of {', '.join(BOX_SCALES)}, got {self.box_scale!r}")
        if self.interp not in ("random", "nearest", "linear", "cubic"):
            raise ValueError(f"Resize.interp: expected random, nearest, linear or cubic, got {self.interp!r}")


@dataclass(frozen=True)
class Normalize:
    """float32 network input: ``(x - mean) / std`` on 0..255 RGB, or raw 0..255 when
    ``mean`` is None (YOLOX)."""

    mean: Optional[tuple[float, float, float]] = IMAGENET_MEAN
    std: Optional[tuple[float, float, float]] = IMAGENET_STD


Stage = Union[Distort, ExpandCrop, Flip, Mosaic, RandomAffine, MixUp, HSV, Resize, Normalize]
STAGE_TYPES = (Distort, ExpandCrop, Flip, Mosaic, RandomAffine, MixUp, HSV, Resize, Normalize)


def check_stages(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """Validate a stage list: known stages, one Resize then one Normalize at the end,
    probabilities in [0, 1]. Returns it unchanged; raises ``ValueError`` naming the stage."""
    stages = tuple(stages)
    for i, s in enumerate(stages):
        if not isinstance(s, STAGE_TYPES):
            raise ValueError(f"stage {i}: {s!r} is not a fastdet.data.stages stage")
        for name in ("prob", "expand_prob"):
            p = getattr(s, name, None)
            if p is not None and not 0.0 <= p <= 1.0:
                raise ValueError(f"stage {i} ({type(s).__name__}).{name}: expected a probability in [0, 1], got {p}")
    if len(stages) < 2 or not isinstance(stages[-2], Resize) or not isinstance(stages[-1], Normalize):
        raise ValueError("a stage list ends with one Resize then one Normalize")
    if sum(isinstance(s, (Resize, Normalize)) for s in stages) != 2:
        raise ValueError("a stage list has exactly one Resize and one Normalize")
    return stages


def partners_needed(stages: tuple[Stage, ...]) -> int:
    """Extra records one sample draws: 3 per Mosaic, 1 per MixUp."""
    return sum(3 if isinstance(s, Mosaic) else 1 if isinstance(s, MixUp) else 0 for s in stages)


def resize_of(stages: tuple[Stage, ...]) -> Resize:
    return next(s for s in stages if isinstance(s, Resize))


def normalize_of(stages: tuple[Stage, ...]) -> Normalize:
    return next(s for s in stages if isinstance(s, Normalize))
