"""How a model family declares its training recipe, next to its model.

A family's :class:`Recipe` holds everything about training it that is not the network:

- ``options``: the type of the config's ``family`` section (a frozen dataclass
  subclassing :class:`fastdet.config.FamilyOptions`), overridable with
  ``--set family.<field>=value``;
- ``base`` / ``sizes``: the published recipe as ``{"section.field": value}`` overrides
  of the shared defaults, common to all sizes and per size (``get_preset`` applies
  both, type-checked);
- ``demo``: the overrides for the built-in demo set (``--data demo``);
- ``phase(epoch, epochs, cfg) -> Phase``: everything that changes over training, as a
  pure function of the epoch: the loss keyword arguments (they key the compiled
  graphs), the augmentation stages (``fastdet.data.stages``) and any schedule switch;
- ``predict(options) -> dict``: the keyword arguments of ``Detector.predict``
  (post-processing: NMS thresholds, kind).

The trainer asks the recipe through ``fastdet.registry`` and never names a family. A
new family declares, in its model module::

    @dataclass(frozen=True)
    class MyOptions(NMSOptions):
        flip_prob: float = 0.5

    def my_phase(epoch, epochs, cfg):
        late = epoch >= epochs - cfg.optim.no_aug_epochs
        return Phase({"use_l1": late}, (Flip(cfg.family.flip_prob), Resize("letterbox", 114.0), Normalize(None, None)))

    RECIPE = Recipe(options=MyOptions, phase=my_phase, sizes={"s": {"data.batch_size": 64}})
    FAMILY = ArchFamily(build=build_my, sizes=("s",), recipe=RECIPE)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from fastdet.config import Config, FamilyOptions
from fastdet.data.stages import Normalize, Resize, Stage, check_stages


@dataclass(frozen=True)
class Phase:
    """What one epoch of training uses.

    ``loss_kwargs``: passed to ``model(images, targets, **loss_kwargs)``; each distinct
    value is one compiled variant, all of them compiled at warm-up.
    ``stages``: the augmentation, a ``fastdet.data.stages`` list ending in Resize,
    Normalize; the loader rebuilds its chain when the tuple changes.
    ``eval_interval``: a schedule switch: evaluate every this many epochs during the
    phase (None: ``run.eval_interval``; YOLOX evaluates every epoch once mosaic is off).
    """

    loss_kwargs: Mapping[str, Any]
    stages: tuple[Stage, ...]
    eval_interval: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_kwargs", dict(self.loss_kwargs))
        object.__setattr__(self, "stages", check_stages(self.stages))


def check_probabilities(options: Any, *names: str) -> None:
    """A one-line ``ValueError`` naming ``family.<name>`` unless each is in [0, 1]."""
    for name in names:
        p = getattr(options, name)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"family.{name}: expected a probability in [0, 1], got {p}")


# Post-processing fields the families share, and the values they take: a score or IoU is a
# fraction, a count keeps at least one box. A family has those its ``predict`` reads.
POSTPROCESS_RANGES: Mapping[str, tuple[Callable[[float], bool], str]] = {
    "score_thresh": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "nms_iou": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "post_thresh": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "max_det": (lambda v: v >= 1, "at least 1"),
    "pre_nms_topk": (lambda v: v >= 1, "at least 1"),
}


def check_postprocess(options: Any) -> None:
    """A one-line ``ValueError`` naming ``family.<name>`` for a post-processing value out of
    its range: the options class's ``postprocess_ranges`` (a family whose post-processing
    reads a value another way declares its own), else :data:`POSTPROCESS_RANGES`;
    ``options`` a family's options or their dict. A NaN fails every range."""
    values = options if isinstance(options, Mapping) else vars(options)
    ranges = getattr(type(options), "postprocess_ranges", POSTPROCESS_RANGES)
    for name, (ok, what) in ranges.items():
        v = values.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not ok(v):
            raise ValueError(f"family.{name} must be {what}, got {v}")


def without_augmentation(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """Only the Resize and Normalize of ``stages`` (``data.augment`` off), the resize at one
    fixed interpolation (linear when the recipe draws one at random)."""
    out: list[Stage] = []
    for s in stages:
        if isinstance(s, Resize):
            out.append(Resize(s.mode, s.pad_value, "linear" if s.interp == "random" else s.interp,
                              s.short, s.max_long))
        elif isinstance(s, Normalize):
            out.append(s)
    return tuple(out)


@dataclass(frozen=True)
class NMSOptions(FamilyOptions):
    """Post-processing options most families share: class-aware NMS after a score
    threshold and a pre-NMS top-k (``fastdet.models.detector.multiclass_nms``). A family
    subclasses it for its options and may redeclare a field to change its default."""

    score_thresh: float = 0.01
    nms_iou: float = 0.7
    max_det: int = 300
    pre_nms_topk: int = 1000


def nms_kwargs(options: Any) -> dict[str, Any]:
    """``Detector.predict`` keyword arguments from :class:`NMSOptions` fields."""
    return dict(score_thresh=options.score_thresh, iou_thresh=options.nms_iou,
                max_det=options.max_det, pre_nms_topk=options.pre_nms_topk)


@dataclass(frozen=True)
class PaddleNMSOptions(NMSOptions):
    """:class:`NMSOptions` of PaddleDetection's MultiClassNMS, whose ``nms_top_k`` is taken
    per class (``multiclass_nms(per_class_topk=True)``) rather than over all (anchor, class)
    pairs; ``family.per_class_topk=false`` gives the latter."""

    per_class_topk: bool = True


def paddle_nms_kwargs(options: PaddleNMSOptions) -> dict[str, Any]:
    """``Detector.predict`` keyword arguments from :class:`PaddleNMSOptions` fields."""
    return {**nms_kwargs(options), "per_class_topk": options.per_class_topk}


# What every family's demo recipe shares, so that `--data demo` learns in minutes on a
# 2-core CPU: 192 px, batches of 8 (the LR given for them), at most 32 boxes, one loader
# worker, AdamW with clipping (a short from-scratch run learns far faster with it than
# with the published SGD recipes: PP-YOLOE AP50 0.57 against 0.38, measured), a faster
# EMA. A family's `demo` adds its own schedule and augmentation on top.
DEMO_CPU: Mapping[str, Any] = {
    "data.batch_size": 8,
    "data.eval_batch_size": 16,
    "data.img_size": 192,
    "data.train_sizes": (192,),
    "data.max_boxes": 32,
    "data.num_workers": 1,
    "optim.optimizer": "adamw",
    "optim.ref_batch": 8,
    "optim.weight_decay": 0.01,
    "optim.clip_grad_norm": 10.0,
    "optim.ema_decay": 0.999,
    "run.log_interval": 24,
}


@dataclass(frozen=True)
class Recipe:
    """A family's training recipe (see the module docstring)."""

    options: type[FamilyOptions]
    phase: Callable[[int, int, Config], Phase]
    base: Mapping[str, Any] = field(default_factory=dict)
    sizes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    demo: Mapping[str, Any] = field(default_factory=dict)
    predict: Callable[[Any], dict[str, Any]] = nms_kwargs
    # size -> the authors' ImageNet backbone file the published recipe starts from
    # (``--backbone-weights``); a published preset trained without it is told once that
    # the paper's AP assumes it (``pretrained_backbone_note``).
    backbone_files: Mapping[str, str] = field(default_factory=dict)


def pretrained_backbone_note(recipe: "Recipe", size: str, data: str, backbone_weights: Any, ckpt: Any) -> str | None:
    """The one log line for a published preset started from scratch (None when it has its
    backbone file, starts from a checkpoint, or is the demo, which trains from scratch)."""
    name = recipe.backbone_files.get(size)
    if not name or backbone_weights or ckpt or data == "demo":
        return None
    return (f"the published AP of this preset assumes the authors' ImageNet backbone {name} "
            "(--backbone-weights PATH); this run starts the backbone from scratch")
