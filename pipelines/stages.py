"""The stages the detection pipelines are composed of (DALI graph helpers).

Every stage takes and returns DataNodes; the pipeline functions in
``fastdet.pipelines.detection`` chain them. Pixels live on ``device`` ("gpu" after
the mixed decoder, or "cpu" in CPU-only mode); boxes and the random parameters are
always on the CPU (DALI's box operators are CPU-only), and they are small.

The parameters are those of ``fastdet.data.augment`` (the torch back end), which
documents where each comes from.

Coordinates: boxes enter as xyxy relative to the decoded image. ``expand_crop``
works on a virtual canvas ``(cw, ch)`` px, never materialised: the crop window,
rounded to whole canvas pixels, is cut from the original image with
``slice(out_of_bounds_policy="pad")`` filled with the ImageNet mean, which is what
RandomExpand followed by RandomCrop produce, without allocating a canvas up to 16
times the image. Boxes are then re-expressed relative to that integer window, so
they stay exact through the resize (relative boxes do not change under a resize)
and are scaled to pixels only at the end (``targets``).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.math as dmath
import nvidia.dali.types as types

from fastdet.data import augment as A
from fastdet.data import stages as S


def _maybe(p: float, value, neutral: float):
    """``value`` with probability ``p``, else ``neutral`` (per sample, CPU)."""
    on = fn.cast(fn.random.coin_flip(probability=p), dtype=types.FLOAT)
    return on * value + (1.0 - on) * neutral


def decode(encoded, device: str):
    """JPEG/PNG bytes → uint8 HWC RGB, upright (EXIF orientation applied, as the data layer's
    sizes and the torch back end); nvJPEG (mixed) on a GPU."""
    return fn.decoders.image(
        encoded,
        device="mixed" if device == "gpu" else "cpu",
        output_type=types.RGB,
        adjust_orientation=True,
    )


def distort(images, prob: float):
    """PP-YOLOE RandomDistort: brightness, contrast, saturation, hue, each with probability ``prob``."""
    b = _maybe(prob, fn.random.uniform(range=A.BRIGHTNESS), 1.0)
    c = _maybe(prob, fn.random.uniform(range=A.CONTRAST), 1.0)
    s = _maybe(prob, fn.random.uniform(range=A.SATURATION), 1.0)
    h = _maybe(prob, fn.random.uniform(range=A.HUE), 0.0)
    images = fn.brightness_contrast(images, brightness=b, contrast=c, contrast_center=A.CONTRAST_CENTER)
    return fn.hsv(images, hue=h, saturation=s, dtype=types.UINT8)


def expand_crop(images, boxes, labels, wh, spec: S.ExpandCrop, scores=None):
    """RandomExpand (virtual canvas) + RandomCrop (``random_bbox_crop``) in one cut.

    Args:
        images: uint8 HWC on the pixel device.
        boxes: [N, 4] xyxy relative to the image; labels: [N] int32.
        wh: float32 [2] (width, height) of the image.
        spec: ``expand_prob``, ``max_ratio`` and ``crop`` are read at build time.
        scores: [N] float32 per-box scores (after a ``beta_blend`` mixup) or None (all ones).

    Returns:
        ``(window images, boxes [K, 4] relative to the window, labels [K], scores [K] or None)``.

    ``random_bbox_crop`` takes PaddleDetection RandomCrop's parameters; its window
    sampling differs in one detail: it draws each side's scale in [0.3, 1] and rejects
    aspect ratios outside [0.5, 2], where PaddleDetection draws one scale and then an
    aspect ratio (the torch back end does that). Both give windows of 9 %..100 % of the
    canvas, aspect 0.5..2, the best box over the threshold, centre-pruned boxes.
    """
    w, h = wh[0], wh[1]
    ratio = _maybe(spec.expand_prob, fn.random.uniform(range=[1.0, spec.max_ratio]), 1.0)
    cw, ch = dmath.floor(w * ratio), dmath.floor(h * ratio)  # canvas px
    ox = dmath.floor(fn.random.uniform(range=[0.0, 1.0]) * (cw - w))  # image offset on the canvas, px
    oy = dmath.floor(fn.random.uniform(range=[0.0, 1.0]) * (ch - h))
    sx, sy, tx, ty = w / cw, h / ch, ox / cw, oy / ch
    canvas_boxes = boxes * fn.stack(sx, sy, sx, sy) + fn.stack(tx, ty, tx, ty)

    if not spec.crop:
        return (*_cut(images, canvas_boxes, labels, 0.0, 0.0, 1.0, 1.0, cw, ch, ox, oy), scores)
    anchor, shape, win_boxes, win_labels, kept = fn.random_bbox_crop(
        canvas_boxes,
        labels,
        bbox_layout="xyXY",
        thresholds=list(A.CROP_THRESHOLDS),
        scaling=list(A.CROP_SCALING),
        aspect_ratio=list(A.CROP_ASPECT),
        allow_no_crop=True,
        # PaddleDetection: the best box must meet the threshold, not every box.
        all_boxes_above_threshold=False,
        num_attempts=A.CROP_ATTEMPTS,
        # Bounded: after every threshold had its attempts, the best candidate is taken.
        total_num_attempts=A.CROP_ATTEMPTS * (len(A.CROP_THRESHOLDS) + 1),
        quiet=True,
        output_bbox_indices=True,
    )
    if scores is not None:
        scores = fn.python_function(scores, kept, function=_gather, num_outputs=1, batch_processing=True)
    # An image without boxes is not cropped (PaddleDetection RandomCrop returns early).
    has = fn.cast(boxes.shape()[0] > 0, dtype=types.FLOAT)
    ax, ay = anchor[0] * has, anchor[1] * has
    aw, ah = shape[0] * has + (1.0 - has), shape[1] * has + (1.0 - has)
    return (*_cut(images, win_boxes, win_labels, ax, ay, aw, ah, cw, ch, ox, oy), scores)


def _gather(values: list[np.ndarray], idx: list[np.ndarray]) -> list[np.ndarray]:
    """The kept boxes' scores, a whole batch in one call (B lists of [N_i] and [K_i])."""
    return [np.ascontiguousarray(v[i.astype(np.int64)]) for v, i in zip(values, idx)]


def _cut(images, win_boxes, labels, ax, ay, aw, ah, cw, ch, ox, oy):
    """Cut the window (relative anchor ``ax, ay``, shape ``aw, ah`` on the ``cw`` x ``ch`` canvas).

    ``win_boxes`` are relative to that float window; the image sits at ``(ox, oy)`` on the canvas.
    """
    # The window in whole canvas pixels [x0, x1) x [y0, y1).
    x0 = dmath.clamp(dmath.floor(ax * cw + 0.5), 0.0, cw - 1.0)
    y0 = dmath.clamp(dmath.floor(ay * ch + 0.5), 0.0, ch - 1.0)
    x1 = dmath.clamp(dmath.floor((ax + aw) * cw + 0.5), x0 + 1.0, cw)
    y1 = dmath.clamp(dmath.floor((ay + ah) * ch + 0.5), y0 + 1.0, ch)
    ww, wh_ = x1 - x0, y1 - y0
    # random_bbox_crop's boxes are relative to its float window: re-express them on the integer one.
    bsx, bsy = aw * cw / ww, ah * ch / wh_
    btx, bty = (ax * cw - x0) / ww, (ay * ch - y0) / wh_
    win_boxes = dmath.clamp(win_boxes * fn.stack(bsx, bsy, bsx, bsy) + fn.stack(btx, bty, btx, bty), 0.0, 1.0)

    start = fn.cast(fn.stack(x0 - ox, y0 - oy), dtype=types.INT32)  # in the original image, may be < 0
    extent = fn.cast(fn.stack(ww, wh_), dtype=types.INT32)
    images = fn.slice(
        images,
        start,
        extent,
        axis_names="WH",
        out_of_bounds_policy="pad",
        fill_values=list(A.FILL),
    )
    return images, win_boxes, labels


def flip(boxes, prob: float):
    """RandomFlip's boxes and the per-sample coin that mirrors the pixels in ``normalize``."""
    coin = fn.random.coin_flip(probability=prob)
    return fn.bb_flip(boxes, ltrb=True, horizontal=coin), coin


def resize(images, size, interp, st: S.Resize):
    """To the batch's canvas ``size`` (float32 [2] (H, W) per sample), no antialiasing (cv2-like).

    Returns ``(images, box_scale)``: ``box_scale`` float32 [2] (x, y) turns boxes relative
    to the image entering the resize into input px. stretch: the canvas; letterbox and
    keep_ratio: with ``r`` as ``fastdet.data.augment.resize_scale``, the content
    ``floor(r · (h, w))`` pasted top-left on the canvas filled with ``pad_value`` (the torch
    back end's and ``Preprocess.__call__``'s rounding), and ``r · (w, h)``, or with
    ``st.box_scale == "content"`` the content's extent ``(cw, ch)`` (its true factor).
    """
    interp_type = fn.cast(interp, dtype=types.INTERP_TYPE) if st.interp == "random" else _DALI_INTERP[st.interp]
    kw = dict(interp_type=interp_type, antialias=False, dtype=types.UINT8)
    H, W = size[0], size[1]
    if st.mode == "stretch":
        return fn.resize(images, size=size, **kw), fn.stack(W, H)
    # float64, in resize_scale's order of operations: in float32, 159 · (128 / 159) floors to
    # 127 where the torch back end (and YOLOX's preproc) get 128.
    hw = fn.cast(images.shape(), dtype=types.FLOAT64)
    h, w = hw[0], hw[1]
    H, W = fn.cast(H, dtype=types.FLOAT64), fn.cast(W, dtype=types.FLOAT64)
    r = dmath.min(H / h, W / w)
    if st.mode == "keep_ratio":
        short = dmath.min(H, W)
        r = dmath.min(r, dmath.min(short / dmath.min(h, w), short * float(st.max_long) / float(st.short)
                                   / dmath.max(h, w)))
    ch = fn.cast(dmath.clamp(dmath.floor(h * r), 1.0, H), dtype=types.FLOAT)
    cw = fn.cast(dmath.clamp(dmath.floor(w * r), 1.0, W), dtype=types.FLOAT)
    content = fn.resize(images, size=fn.stack(ch, cw), **kw)
    zero = fn.cast(H * 0.0, dtype=types.INT32)
    canvas = fn.slice(content, fn.stack(zero, zero), fn.cast(fn.stack(W, H), dtype=types.INT32), axis_names="WH",
                      out_of_bounds_policy="pad", fill_values=[float(st.pad_value)] * 3)
    return canvas, fn.cast(fn.stack(cw, ch) if st.box_scale == "content" else fn.stack(w * r, h * r),
                           dtype=types.FLOAT)


_DALI_INTERP = {"nearest": types.INTERP_NN, "linear": types.INTERP_LINEAR, "cubic": types.INTERP_CUBIC}


def normalize(images, mirror, channels_last: bool, st: S.Normalize):
    """float32 input: mean/std on 0..255 (or raw 0..255 when ``st.mean`` is None), CHW (or HWC)."""
    kw = {} if mirror is None else {"mirror": mirror}
    mean, std = (st.mean, st.std) if st.mean is not None else ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,
        output_layout="HWC" if channels_last else "CHW",
        mean=list(mean),
        std=list(std),
        **kw,
    )


def _finalize(boxes: list, labels: list, box_scale: list, *scores, max_boxes: int):
    # B samples: boxes [N_i, 4] xyxy relative to the image entering the resize, box_scale [2] (x, y) px.
    t = A.finalize_batch(boxes, labels, box_scale, scores[0] if scores else None, max_boxes)
    return (list(t["gt_boxes"]), list(t["gt_labels"]), list(t["gt_mask"]), list(t["gt_scores"]),
            [np.array(o) for o in t["overflow"]])


def targets(boxes, labels, box_scale, max_boxes: int, scores=None):
    """Pixels of the input, < 1 px dropped, the M largest kept and padded (``fastdet.data.augment.finalize``).

    One Python call per batch (``fastdet.data.augment.finalize_batch``, vectorised over the batch).
    Returns ``(gt_boxes [M, 4] f32, gt_labels [M] i64, gt_mask [M] bool, gt_scores [M] f32,
    overflow [] i64)`` per sample, CPU.
    """
    ins = (boxes, labels, box_scale) + ((scores,) if scores is not None else ())
    return fn.python_function(*ins, function=partial(_finalize, max_boxes=max_boxes), num_outputs=5,
                              batch_processing=True)


# --------------------------------------------------------------------------- planned stages
# Mosaic, RandomAffine and MixUp: the source computed each sample's draws and boxes
# (``fastdet.data.augment.plan_sample``, the torch back end's plans from the same keys);
# these helpers only move pixels, on the pixel device, with CPU per-sample arguments.
# A stage a sample did not draw gets identity arguments and an 8 x 8 dummy partner that
# lands outside the canvas, so the graph is the same for every sample.

def _f32(x):
    return fn.cast(x, dtype=types.FLOAT)


def _u16(x):
    return fn.cast(x, dtype=types.UINT16)


def _place(images, anchor, shape_wh, fill: float):
    """``images`` with its top-left at ``-anchor`` (x, y) on a ``shape_wh`` canvas of ``fill`` (int32 args)."""
    return fn.slice(images, anchor, shape_wh, axis_names="WH", out_of_bounds_policy="pad", fill_values=[fill] * 3)


def _linear(images, hw):
    return fn.resize(images, size=hw, interp_type=types.INTERP_LINEAR, antialias=False, dtype=types.UINT8)


def mosaic(images, partners, rsz, anchor, quad, pad_value: float):
    """YOLOX mosaic: 4 tiles resized (linear) around the centre (xc, yc) of the (2 S_h, 2 S_w) canvas, uint8.

    The tiles never overlap: tile k owns quadrant k (top-left, top-right, bottom-left,
    bottom-right of the centre), so quadrant k is a ``pad_value``-padded slice of tile k
    (``anchor[k]`` int32 [2] its origin in tile px, ``quad[k]`` int32 [2] its (w, h); empty
    quadrants are 0 wide or high), and the canvas is their concatenation: no arithmetic,
    no float canvas.
    """
    tiles = [images] + list(partners)
    q = [_place(_linear(t, rsz[k]), anchor[k], quad[k], pad_value) for k, t in enumerate(tiles)]
    return fn.cat(fn.cat(q[0], q[1], axis=1), fn.cat(q[2], q[3], axis=1), axis=0)  # [2 S_h, 2 S_w, 3]


def affine(images, matrix, size, pad_value: float):
    """YOLOX random_affine's warp (bilinear, constant border); ``matrix`` is DALI's dst → src
    (``fastdet.pipelines.sources.dali_affine``), ``size`` float32 [2] (H, W)."""
    return fn.warp_affine(images, matrix=matrix, size=size, fill_value=pad_value, interp_type=types.INTERP_LINEAR)


def mixup_scaled_crop(images, partner, letter, input_wh, jit, flip_coin, anchor, target_wh, weights):
    """YOLOX mixup: the partner letterboxed (114), jittered, flipped, cropped at ``anchor``
    onto the target's size (0 beyond it), then ``floor(0.5·image + 0.5·partner)``.

    In integers, exactly: ``(w0·image + w1·partner) // 2`` in uint16 with ``weights`` uint8 [2]
    (1, 1), or (2, 0) where the sample drew no mixup.
    """
    zero = fn.cast(weights[0], dtype=types.INT32) * 0
    letter_canvas = _place(_linear(partner, letter), fn.stack(zero, zero), input_wh, 114.0)
    jittered = fn.flip(_linear(letter_canvas, jit), horizontal=flip_coin)
    other = _place(jittered, anchor, target_wh, 0.0)
    two = types.Constant(2, dtype=types.UINT16)
    mixed = (weights[0] * _u16(images) + weights[1] * _u16(other)) // two
    return fn.cast(mixed, dtype=types.UINT8)


def mixup_beta_blend(images, partner, lam, canvas_wh):
    """PaddleDetection Mixup: both at the top-left of a max(h) x max(w) canvas of 0,
    ``λ·a + (1 − λ)·b`` truncated to uint8.

    In float32, as the torch back end: a beta-drawn λ is not exact in fp16 (a level off
    after the truncation), and DALI's CPU arithmetic has no fp16. The canvas is the
    images' size (before the resize), not YOLOX's 2S mosaic.
    """
    zero = fn.cast(lam * 0.0, dtype=types.INT32)
    origin = fn.stack(zero, zero)
    a = _f32(_place(images, origin, canvas_wh, 0.0))
    b = _f32(_place(partner, origin, canvas_wh, 0.0))
    return fn.cast(dmath.floor(lam * a + (1.0 - lam) * b), dtype=types.UINT8)


def hsv_jitter(images, st: S.HSV):
    """YOLOX augment_hsv, approximated with DALI's operators (the back ends differ here).

    YOLOX adds integer gains to OpenCV's H (0..180), S and V; DALI has no HSV-space
    add, so: hue ``fn.hsv(hue=2·g_h degrees)`` (a rotation in YIQ, DALI's hue
    approximation), saturation ``fn.hsv(saturation=1 + g_s / 255)`` (multiplicative:
    a grey pixel stays grey, where YOLOX tints it), value ``brightness_shift = g_v / 255``
    (adds g_v to every channel: V moves by g_v exactly, S slightly). Each gain is drawn
    U(−gain, gain), switched off with probability 1/2, the whole with probability
    ``prob``; the test bounds the difference in pixel statistics.
    """
    on = fn.cast(fn.random.coin_flip(probability=st.prob), dtype=types.FLOAT)

    def gain(g: float):
        keep = fn.cast(fn.random.coin_flip(probability=0.5), dtype=types.FLOAT)
        return fn.random.uniform(range=[-g, g]) * keep * on

    gh, gs, gv = gain(st.hgain), gain(st.sgain), gain(st.vgain)
    images = fn.hsv(images, hue=2.0 * gh, saturation=1.0 + gs / 255.0, dtype=types.UINT8)
    return fn.brightness_contrast(images, brightness_shift=gv / 255.0, dtype=types.UINT8)
