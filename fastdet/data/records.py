"""The per-image record every loader back end consumes (the padded batch is fastdet.data.layout's).

Records come from :func:`fastdet.data.coco.load_coco`; the DALI pipelines
(``fastdet.pipelines``) and the torch reference loader (``fastdet.data.torch_backend``)
both turn a list of records into batches of the same layout (``fastdet.data.layout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageRecord:
    image_id: int  # COCO image id
    file: str  # absolute path of the image file
    width: int  # as decoded (the JSON's width/height are checked against the file when verified)
    height: int
    boxes: np.ndarray  # [N, 4] float32 xyxy pixels, clipped to the image, w and h >= 1
    labels: np.ndarray  # [N] int64 contiguous labels 0..C-1


# ImageNet statistics on 0..255 RGB values (PP-YOLOE NormalizeImage, is_scale then mean/std).
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
