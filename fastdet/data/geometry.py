"""Where the multi-record and geometric stages put every pixel: plans drawn once, on the CPU.

A plan is the random draw of one stage for one sample (mosaic centre and tiles, the
affine matrix, the mixup partner's jitter, flip and crop, the blend weight) together
with the boxes it produces. Both back ends execute the same plan on the pixels (the
torch back end in ``fastdet.data.augment``, the DALI graph in ``fastdet.pipelines``,
whose source computes the plans), so for these stages the two back ends give the
same boxes, and their pixels differ only by the resampling kernels. Boxes never
leave the CPU. Everything is numpy on ``[N, 4]`` float32 xyxy px boxes; a plan
depends only on its generator (keyed by (seed, epoch, step, slot)) and the records'
sizes, never on pixels.

Sources (re-checked): Megvii YOLOX ``yolox/data/datasets/mosaicdetection.py``
(mosaic, ``get_mosaic_coordinate``, ``mixup``) and ``yolox/data/data_augment.py``
(``get_affine_matrix``, ``apply_affine_to_bboxes``, ``box_candidates``);
PaddleDetection ``ppdet/data/transform/operators.py`` ``Mixup``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

HW = tuple[int, int]


def box_candidates(before: np.ndarray, after: np.ndarray, wh_thr: float = 2.0, ar_thr: float = 20.0,
                   area_thr: float = 0.2) -> np.ndarray:
    """YOLOX ``box_candidates``: [N] bool, boxes [N, 4] ``after`` an augmentation kept when
    both sides > ``wh_thr`` px, area > ``area_thr`` of ``before``'s and aspect < ``ar_thr``."""
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    ar = np.maximum(w2 / (h2 + 1e-16), h2 / (w2 + 1e-16))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + 1e-16) > area_thr) & (ar < ar_thr)


# --------------------------------------------------------------------------- mosaic

@dataclass(frozen=True)
class Tile:
    """One record of a mosaic: resized to ``hw`` and placed with its top-left at ``xy``
    on the canvas (whole, cropped by the canvas; the four tiles never overlap)."""

    hw: HW
    xy: tuple[int, int]


@dataclass(frozen=True)
class MosaicPlan:
    canvas_hw: HW  # (2 S_h, 2 S_w)
    tiles: tuple[Tile, Tile, Tile, Tile]  # this record, then its 3 partners


def mosaic_plan(rng: np.random.Generator, prob: float, center_range: Sequence[float], input_hw: HW,
                sizes_wh: Sequence[tuple[int, int]]) -> Optional[MosaicPlan]:
    """YOLOX mosaic of 4 records of sizes ``sizes_wh`` (w, h) for an ``input_hw`` input; None when not drawn."""
    if rng.random() >= prob:
        return None
    ih, iw = input_hw
    yc = int(rng.uniform(center_range[0] * ih, center_range[1] * ih))
    xc = int(rng.uniform(center_range[0] * iw, center_range[1] * iw))
    tiles = []
    for i, (w0, h0) in enumerate(sizes_wh):
        scale = min(ih / h0, iw / w0)
        w, h = int(w0 * scale), int(h0 * scale)
        # get_mosaic_coordinate: the tile ends at the centre on the sides facing it.
        x = xc - w if i in (0, 2) else xc
        y = yc - h if i in (0, 1) else yc
        tiles.append(Tile((h, w), (x, y)))
    return MosaicPlan((2 * ih, 2 * iw), tuple(tiles))


def mosaic_boxes(plan: MosaicPlan, sizes_wh: Sequence[tuple[int, int]], boxes: Sequence[np.ndarray]) -> np.ndarray:
    """The 4 records' boxes on the canvas, clipped to it (YOLOX scales by the float ratio)."""
    ch, cw = plan.canvas_hw
    out = []
    for t, (w0, h0), b in zip(plan.tiles, sizes_wh, boxes):
        ih, iw = ch // 2, cw // 2
        scale = min(ih / h0, iw / w0)
        out.append(b * np.float32(scale) + np.array([t.xy[0], t.xy[1]] * 2, np.float32))
    cat = np.concatenate(out).astype(np.float32).reshape(-1, 4)
    cat[:, 0::2] = cat[:, 0::2].clip(0, cw)
    cat[:, 1::2] = cat[:, 1::2].clip(0, ch)
    return cat


# --------------------------------------------------------------------------- affine

def affine_matrix(rng: np.random.Generator, degrees: float, translate: float, scale: Sequence[float],
                  shear: float, out_hw: HW) -> tuple[np.ndarray, float]:
    """YOLOX ``get_affine_matrix``: ``(M [2, 3] float64 src px → dst px, scale)``.

    Rotation and scale about the origin, shear, translation ±``translate``·(W, H); the
    output is the top-left ``out_hw`` of the warped image (for a mosaic: of its 2S canvas).
    """
    angle = rng.uniform(-degrees, degrees)
    s = rng.uniform(scale[0], scale[1])
    a = math.radians(angle)
    # cv2.getRotationMatrix2D(angle, center=(0, 0), scale): [[c, s], [-s, c]] * scale
    R = np.array([[s * math.cos(a), s * math.sin(a), 0.0], [-s * math.sin(a), s * math.cos(a), 0.0]])
    shear_x = math.tan(math.radians(rng.uniform(-shear, shear)))
    shear_y = math.tan(math.radians(rng.uniform(-shear, shear)))
    M = np.empty((2, 3))
    M[0] = R[0] + shear_y * R[1]
    M[1] = R[1] + shear_x * R[0]
    M[0, 2] = rng.uniform(-translate, translate) * out_hw[1]
    M[1, 2] = rng.uniform(-translate, translate) * out_hw[0]
    return M, s


def affine_boxes(boxes: np.ndarray, M: np.ndarray, scale: float, out_hw: HW) -> tuple[np.ndarray, np.ndarray]:
    """Boxes through ``M``: the extent of the 4 warped corners, clipped to ``out_hw``; and the
    [N] keep mask of ``box_candidates`` (against the box scaled by ``scale``, as YOLOX's
    ``random_perspective``)."""
    n = len(boxes)
    if n == 0:
        return boxes.reshape(0, 4).astype(np.float32), np.zeros(0, bool)
    pts = np.ones((4 * n, 3))
    pts[:, :2] = boxes[:, [0, 1, 2, 3, 0, 3, 2, 1]].reshape(4 * n, 2)
    pts = (pts @ M.T).reshape(n, 8)
    xs, ys = pts[:, 0::2], pts[:, 1::2]
    out = np.stack([xs.min(1), ys.min(1), xs.max(1), ys.max(1)], 1)
    out[:, 0::2] = out[:, 0::2].clip(0, out_hw[1])
    out[:, 1::2] = out[:, 1::2].clip(0, out_hw[0])
    keep = box_candidates(boxes * scale, out)
    return out.astype(np.float32), keep


# --------------------------------------------------------------------------- mixup

@dataclass(frozen=True)
class ScaledCropMixupPlan:
    """The partner: letterboxed into the ``input_hw`` canvas (content ``letter_hw``, fill
    114), that canvas resized to ``jitter_hw``, flipped if ``flip``, padded with 0 to at
    least the target's size and cropped at ``offset`` (x, y) to ``target_hw``; blended 0.5/0.5."""

    input_hw: HW
    letter_hw: HW
    jitter_hw: HW
    flip: bool
    offset: tuple[int, int]
    target_hw: HW


def scaled_crop_mixup_plan(rng: np.random.Generator, prob: float, scale_range: Sequence[float], input_hw: HW,
                           target_hw: HW, target_has_boxes: bool, partner_wh: tuple[int, int],
                           partner_boxes: np.ndarray) -> tuple[Optional[ScaledCropMixupPlan], np.ndarray, np.ndarray]:
    """YOLOX ``MosaicDetection.mixup``: ``(plan or None, partner boxes on the target [K, 4], kept [N] bool)``.

    Drawn only when the target has boxes (as YOLOX); no mixup when none of the partner's
    boxes survive ``box_candidates(wh_thr=5)``.
    """
    none = (None, np.zeros((0, 4), np.float32), np.zeros(len(partner_boxes), bool))
    if not target_has_boxes or rng.random() >= prob:
        return none
    jit = rng.uniform(scale_range[0], scale_range[1])
    flip = rng.uniform(0, 1) > 0.5
    ih, iw = input_hw
    w0, h0 = partner_wh
    r = min(ih / h0, iw / w0)
    letter = (int(h0 * r), int(w0 * r))
    jh, jw = int(ih * jit), int(iw * jit)
    r *= jit
    th, tw = target_hw
    ph, pw = max(jh, th), max(jw, tw)
    oy = int(rng.integers(0, ph - th)) if ph > th else 0  # random.randint(0, ph - th - 1)
    ox = int(rng.integers(0, pw - tw)) if pw > tw else 0
    b = partner_boxes.astype(np.float64) * r
    b[:, 0::2] = b[:, 0::2].clip(0, jw)
    b[:, 1::2] = b[:, 1::2].clip(0, jh)
    if flip:
        b[:, 0::2] = jw - b[:, 2::-2]
    origin = b.copy()
    b[:, 0::2] = (b[:, 0::2] - ox).clip(0, tw)
    b[:, 1::2] = (b[:, 1::2] - oy).clip(0, th)
    keep = box_candidates(origin, b, wh_thr=5)
    if not keep.any():
        return none
    plan = ScaledCropMixupPlan(input_hw, letter, (jh, jw), bool(flip), (ox, oy), target_hw)
    return plan, b[keep].astype(np.float32), keep


def beta_blend_factor(rng: np.random.Generator, prob: float, alpha: float, beta: float) -> Optional[float]:
    """PaddleDetection ``Mixup``: λ ~ Beta(alpha, beta) clipped to [0, 1]; None when not drawn."""
    if rng.random() >= prob:
        return None
    return float(min(1.0, max(0.0, rng.beta(alpha, beta))))
