"""The batch every loader back end yields, defined once.

Every other place that needs the layout derives it from :data:`FIELDS`: the torch
back end's samples and collate (``fastdet.data.torch_backend``), the DALI pipeline's
outputs (``fastdet.pipelines.detection``), the train step's inputs
(``fastdet.engine.step``) and the detector's target check (``fastdet.models.detector``).
This module imports nothing of fastdet, so anything can sit on top of it.

``B`` is the batch, ``M`` is ``DataConfig.max_boxes`` for every batch (compiled steps
see static shapes), ``(H, W)`` one of the loader's size buckets (``loader.sizes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    dims: tuple  # per batch; "B", "M", "H", "W" are symbolic
    doc: str  # what the field holds (this table is the layout's documentation)


FIELDS: tuple[Field, ...] = (
    Field("images", torch.float32, ("B", 3, "H", "W"),
          "RGB network input, normalised as the stage list's Normalize says (or raw 0..255)"),
    Field("gt_boxes", torch.float32, ("B", "M", 4), "xyxy px of the network input; 0 where padded"),
    Field("gt_labels", torch.int64, ("B", "M"), "contiguous labels 0..C-1; 0 where padded"),
    Field("gt_mask", torch.bool, ("B", "M"), "True for real boxes"),
    Field("gt_scores", torch.float32, ("B", "M"), "1 for real boxes unless mixup says otherwise; 0 where padded"),
    Field("image_ids", torch.int64, ("B",), "COCO image ids"),
    Field("orig_sizes", torch.int64, ("B", 2), "(height, width) of the original image"),
    Field("scale_factors", torch.float32, ("B", 2),
          "(sx, sy): input px per original px (evaluation: fastdet.data.preprocess.boxes_to_original)"),
)
BY_NAME = {f.name: f for f in FIELDS}
BATCH_KEYS: tuple[str, ...] = tuple(f.name for f in FIELDS)
# Everything a head's loss may read; it must have the first three, gt_scores is optional
# (absent means all ones).
TARGET_KEYS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.name.startswith("gt_"))
REQUIRED_TARGET_KEYS: tuple[str, ...] = ("gt_boxes", "gt_labels", "gt_mask")
# What the train step feeds the model.
STEP_KEYS: tuple[str, ...] = ("images",) + TARGET_KEYS


def shape(name: str, *, B: int, M: int, H: int = 0, W: int = 0) -> tuple[int, ...]:
    """The concrete shape of field ``name``."""
    sym = {"B": B, "M": M, "H": H, "W": W}
    return tuple(sym[d] if isinstance(d, str) else d for d in BY_NAME[name].dims)


def empty_batch(hw: tuple[int, int], max_boxes: int, *, channels_last: bool,
                device: torch.device) -> dict[str, torch.Tensor]:
    """A batch with no images (``B = 0``), for a short rank's last evaluation steps."""
    h, w = hw
    out = {f.name: torch.empty(shape(f.name, B=0, M=max_boxes, H=h, W=w), dtype=f.dtype, device=device)
           for f in FIELDS}
    if channels_last:
        out["images"] = out["images"].contiguous(memory_format=torch.channels_last)
    return out
