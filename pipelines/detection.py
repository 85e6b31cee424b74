"""The DALI detection pipeline: COCO records → PP-YOLOE-augmented, padded batches.

One graph serves training and evaluation (``augment=False``: decode, resize,
normalise; the evaluation source asks for bicubic at ``img_size``)::

    read ─ decode ─ [distort ─ expand_crop ─ flip] ─ resize ─ normalize ─┐
                                                       boxes ─ targets ─┴─ outputs

Python ``if`` appears only on build-time parameters. Later stages slot in without
reshaping it: mosaic and mixup (YOLOX) take and return ``(images, boxes, labels)``
between the geometric stages and ``resize`` (``fn.multi_paste`` / ``fn.batch_permutation``
on the same relative boxes); per-level target building (FCOS, PP-YOLO) is a stage on
the padded targets, before ``outputs``.
"""

from __future__ import annotations

import nvidia.dali.fn as fn
from typing import Optional

from nvidia.dali import pipeline_def

from fastdet.data.augment import AugmentSpec
from fastdet.pipelines import stages

# The pipeline's outputs, in order; the first six are BATCH_KEYS, `overflow` stays on the CPU.
OUTPUTS = ("images", "gt_boxes", "gt_labels", "gt_mask", "image_ids", "orig_sizes", "overflow")


def read(source):
    """The records' external source (batch mode, keyed by iteration; see ``sources``)."""
    names = source.outputs
    nodes = fn.external_source(
        source=source, num_outputs=len(names), batch=True, batch_info=True, layout=[""] * len(names)
    )
    return dict(zip(names, nodes))


@pipeline_def
def detection_pipeline(source, *, device: str, augment: Optional[AugmentSpec], max_boxes: int, channels_last: bool):
    """Build-time args: ``device`` "gpu" | "cpu" (pipeline ``device_id=None``), ``augment``
    (None: resize only), ``max_boxes`` (M), ``channels_last`` (HWC images instead of CHW)."""
    s = read(source)
    images = stages.decode(s["encoded"], device)
    boxes, labels, mirror = s["boxes"], s["labels"], None
    if augment is not None:
        if augment.distort_prob > 0:
            images = stages.distort(images, augment.distort_prob)
        if augment.expand_prob > 0 or augment.crop:
            images, boxes, labels = stages.expand_crop(images, boxes, labels, s["wh"], augment)
        if augment.flip_prob > 0:
            boxes, mirror = stages.flip(boxes, augment.flip_prob)
    images = stages.resize(images, s["size"], s["interp"])
    images = stages.normalize(images, mirror, channels_last)
    gt_boxes, gt_labels, gt_mask, overflow = stages.targets(boxes, labels, s["size"], max_boxes)
    outs = [images, gt_boxes, gt_labels, gt_mask, s["image_id"], s["orig_hw"]]
    if device == "gpu":
        outs = [outs[0]] + [o.gpu() for o in outs[1:]]
    return (*outs, overflow)
