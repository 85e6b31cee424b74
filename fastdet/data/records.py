"""The per-image record every loader back end consumes, and the padded batch layout.

Records come from :func:`fastdet.data.coco.load_coco`; the DALI pipelines
(``fastdet.pipelines``) and the torch reference loader (``fastdet.data.torch_backend``)
both turn a list of records into batches of the same layout (see ``BATCH_KEYS``).
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


# The batch dict every back end yields, on the training device:
#   images      float32 [B, 3, H, W]  RGB, normalised with IMAGENET_MEAN/STD (on 0..255 values)
#   gt_boxes    float32 [B, M, 4]     xyxy pixels of the network input (after augmentation and resize)
#   gt_labels   int64   [B, M]        contiguous labels; 0 where padded
#   gt_mask     bool    [B, M]        True for real boxes
#   image_ids   int64   [B]           COCO image ids
#   orig_sizes  int64   [B, 2]        (height, width) of the original image
# M is DataConfig.max_boxes for every batch, so compiled steps see static shapes.
BATCH_KEYS = ("images", "gt_boxes", "gt_labels", "gt_mask", "image_ids", "orig_sizes")

# ImageNet statistics on 0..255 RGB values (PP-YOLOE NormalizeImage, is_scale then mean/std).
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
