"""Model registry: an architecture name is looked up here once, nowhere else.

``build_model(arch, size, num_classes=80, **family_options) -> Detector``. A family is
added by one module defining an :class:`~fastdet.models.detector.ArchFamily` and one
line in ``ARCHITECTURES``.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

from fastdet.models import fcos, ppyolo, ppyoloe, yolox
from fastdet.models.detector import ArchFamily, Detector, multiclass_nms, rescale_boxes

ARCHITECTURES: dict[str, ArchFamily] = {
    "ppyoloe": ppyoloe.FAMILY,
    "ppyolo": ppyolo.FAMILY,
    "fcos": fcos.FAMILY,
    "yolox": yolox.FAMILY,
}

__all__ = [
    "ARCHITECTURES",
    "ArchFamily",
    "Detector",
    "build_model",
    "build_model_from_config",
    "multiclass_nms",
    "rescale_boxes",
]


def _family(arch: str, size: str) -> ArchFamily:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}: available are {', '.join(sorted(ARCHITECTURES))}")
    fam = ARCHITECTURES[arch]
    if size not in fam.sizes:
        raise ValueError(f"unknown size {size!r} for {arch}: available are {', '.join(fam.sizes)}")
    return fam


def build_model(arch: str, size: str, num_classes: int = 80, **family_options: Any) -> Detector:
    """Build ``arch`` (e.g. ``"ppyoloe"``) of ``size`` (e.g. ``"s"``) for ``num_classes`` classes.

    ``family_options`` are the family builder's keyword options (PP-YOLOE:
    ``use_alpha``, ``width_mult``, ``depth_mult``).
    """
    fam = _family(arch, size)
    try:  # any integral number (numpy's, a 0-d int tensor), not a float or a bool
        n = operator.index(num_classes)
    except TypeError:
        n = 0
    if isinstance(num_classes, bool) or n < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    num_classes = n
    params = inspect.signature(fam.build).parameters
    accepted = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(family_options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} for {arch}: accepted are {', '.join(accepted) or 'none'}")
    return fam.build(size, num_classes, **family_options)


def build_model_from_config(model_cfg: Any, family_options: Any = None) -> Detector:
    """Build from a :class:`fastdet.config.ModelConfig`, passing the family builder the
    fields of ``family_options`` (the config's ``family`` section) it names in
    ``ArchFamily.config_fields``."""
    fam = _family(model_cfg.arch, model_cfg.size)
    options = {f: getattr(family_options, f) for f in fam.config_fields}
    return build_model(model_cfg.arch, model_cfg.size, model_cfg.num_classes, **options)
