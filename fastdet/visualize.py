"""Drawing detections: one image with its boxes, class names and scores, and a grid of them.

``fastdet.predict`` writes one drawn copy per image; the trainer logs a grid of the EMA
model's detections on a fixed set of val images at every evaluation
(``fastdet.engine.previews``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch import Tensor
from torchvision.utils import draw_bounding_boxes, make_grid

# Distinct colours cycled by class index (the 10 of matplotlib's tab10).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")



def _ordered(boxes):
    """[K, 4] xyxy as drawn: a box that a one-sided clip (PP-YOLO, Paddle's ``yolo_box``: x2
    <= w - 1, x1 >= 0) left with x2 < x1 is drawn as the line it has become."""
    b = boxes.float().cpu().clone()
    b[:, 2:] = torch.maximum(b[:, 2:], b[:, :2])
    return b

def draw_detections(image: np.ndarray | Tensor, boxes: Tensor, scores: Tensor, labels: Tensor,
                    class_names: Sequence[str]) -> Tensor:
    """Boxes with ``"name 0.87"`` captions drawn on a copy of ``image``.

    Args:
        image: RGB uint8 ``[H, W, 3]`` (numpy, as decoded) or ``[3, H, W]`` (tensor).
        boxes: ``[K, 4]`` xyxy in the pixels of ``image``; scores ``[K]``; labels ``[K]``
            contiguous class indices into ``class_names``.
    Returns:
        uint8 ``[3, H, W]``.
    """
    img = torch.as_tensor(np.ascontiguousarray(image)).permute(2, 0, 1) if isinstance(image, np.ndarray) else image
    if boxes.numel() == 0:
        return img.clone()
    labels = labels.tolist()
    captions = [f"{class_names[c] if c < len(class_names) else c} {s:.2f}"
                for c, s in zip(labels, scores.tolist())]
    colors = [PALETTE[c % len(PALETTE)] for c in labels]
    width = max(1, round(max(img.shape[-2:]) / 320))  # ~1 px per 320 px of the long side
    return draw_bounding_boxes(img, _ordered(boxes), labels=captions, colors=colors, width=width)


def draw_ground_truth(image: np.ndarray | Tensor, boxes: Tensor, labels: Tensor,
                      class_names: Sequence[str]) -> Tensor:
    """The ground-truth boxes with their class names (no score) on a copy of ``image``;
    the same colours per class as :func:`draw_detections`, so the two sides compare."""
    img = torch.as_tensor(np.ascontiguousarray(image)).permute(2, 0, 1) if isinstance(image, np.ndarray) else image
    if boxes.numel() == 0:
        return img.clone()
    labels = labels.tolist()
    captions = [str(class_names[c]) if c < len(class_names) else str(c) for c in labels]
    colors = [PALETTE[c % len(PALETTE)] for c in labels]
    width = max(1, round(max(img.shape[-2:]) / 320))
    return draw_bounding_boxes(img, _ordered(boxes), labels=captions, colors=colors, width=width)


def titled(tile: Tensor, title: str, note: str | None = None, bar: int = 18) -> Tensor:
    """uint8 ``[3, H, W]`` with a ``title`` bar above it and, if given, a ``note`` boxed in its middle."""
    h, w = tile.shape[-2:]
    canvas = Image.new("RGB", (w, h + bar), (40, 40, 40))
    canvas.paste(Image.fromarray(tile.permute(1, 2, 0).contiguous().numpy()), (0, bar))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 3), title, fill=(255, 255, 255))
    if note:
        x0, y0, x1, y1 = draw.textbbox((0, 0), note)
        tw, th = x1 - x0, y1 - y0
        cx, cy = (w - tw) // 2, bar + (h - th) // 2
        draw.rectangle((cx - 6, cy - 5, cx + tw + 6, cy + th + 5), fill=(0, 0, 0), outline=(255, 80, 80))
        draw.text((cx, cy), note, fill=(255, 255, 255))
    return torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1)


def fit_tile(image: Tensor, size: int, fill: int = 114) -> Tensor:
    """uint8 ``[3, H, W]`` scaled to fit a ``size`` x ``size`` tile (aspect kept, centred)."""
    h, w = image.shape[-2:]
    r = size / max(h, w)
    nh, nw = max(1, round(h * r)), max(1, round(w * r))
    small = F.interpolate(image[None].float(), size=(nh, nw), mode="bilinear", antialias=True,
                          align_corners=False)[0].round().clamp(0, 255).to(torch.uint8)
    tile = torch.full((3, size, size), fill, dtype=torch.uint8)
    top, left = (size - nh) // 2, (size - nw) // 2
    tile[:, top:top + nh, left:left + nw] = small
    return tile


def grid(images: Sequence[Tensor], tile: int = 320, nrow: int = 4) -> Tensor:
    """uint8 ``[3, H, W]`` grid of drawn images, each fitted into a ``tile`` px square."""
    return make_grid([fit_tile(im, tile) for im in images], nrow=nrow, padding=2, pad_value=255)


def save_image(image: Tensor, path: str | Path, quality: int = 90) -> None:
    """Write uint8 ``[3, H, W]`` as a JPEG (or PNG by extension) with PIL."""
    Image.fromarray(image.permute(1, 2, 0).contiguous().numpy()).save(path, quality=quality)
