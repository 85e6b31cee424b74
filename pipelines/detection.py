"""The DALI detection pipeline: records → augmented, padded batches, built from a stage list.

One graph serves training and evaluation (evaluation: the stage list
``(Resize, Normalize)`` of the family's ``Preprocess``)::

    read ─ decode ─ [stages in the list's order] ─ resize ─ normalize ─┐
                                               boxes ─ targets ───────┴─ outputs

The graph is built from the ``tuple[Stage, ...]`` (``fastdet.data.stages``); Python
``if`` appears only on build-time parameters. Pixels live on ``device`` ("gpu" after
the mixed decoder, "cpu" in CPU-only mode); boxes, labels, scores and the random
parameters stay on the CPU. The outputs are ``fastdet.data.layout``'s fields, in
order, then ``overflow`` (CPU).
"""

from __future__ import annotations

import nvidia.dali.fn as fn
import nvidia.dali.types as types
from nvidia.dali import pipeline_def

from fastdet.data import stages as S
from fastdet.data.layout import BATCH_KEYS
from fastdet.pipelines import stages

OUTPUTS = BATCH_KEYS + ("overflow",)


def read(source, prefetch: int):
    """The records' external source (batch mode, keyed by iteration; see ``sources``).

    Parallel: in the pipeline's ``py_num_workers`` processes, each computing a whole batch,
    ``prefetch`` batches ahead (at least one per worker keeps them all busy).
    """
    names = source.outputs
    nodes = fn.external_source(
        source=source, num_outputs=len(names), batch=True, batch_info=True, layout=[""] * len(names),
        parallel=True, prefetch_queue_depth=prefetch,
    )
    return dict(zip(names, nodes))


def unused_outputs(stage_list: tuple) -> tuple[str, ...]:
    """The source outputs the graph of ``stage_list`` does not read (DALI warns about them)."""
    unused = []
    if not any(isinstance(s, S.ExpandCrop) and (s.expand_prob > 0 or s.crop) for s in stage_list):
        unused.append("wh")
    if S.resize_of(stage_list).interp != "random":
        unused.append("interp")
    return tuple(unused)


@pipeline_def
def detection_pipeline(source, *, device: str, stage_list: tuple, max_boxes: int, channels_last: bool,
                       source_prefetch: int):
    """Build-time args: ``device`` "gpu" | "cpu" (pipeline ``device_id=None``), ``stage_list``
    (``fastdet.data.stages``, validated), ``max_boxes`` (M), ``channels_last`` (HWC images),
    ``source_prefetch`` (batches the source's worker processes run ahead, see :func:`read`).
    Pipeline kwargs
    ``py_num_workers`` and ``py_start_method`` set the source's workers."""
    s = read(source, source_prefetch)
    images = stages.decode(s["encoded"], device)
    boxes, labels, scores, mirror = s["boxes"], s["labels"], s.get("scores"), None
    k = 0  # the next partner's encoded output
    for st in stage_list:
        if isinstance(st, S.Mosaic):
            partners = [stages.decode(s[f"enc_p{k + j}"], device) for j in range(3)]
            images = stages.mosaic(images, partners, s["mos_rsz"], s["mos_anchor"], s["mos_quad"], st.pad_value)
            k += 3
        elif isinstance(st, S.RandomAffine):
            images = stages.affine(images, s["aff_m"], s["aff_size"], st.pad_value)
        elif isinstance(st, S.MixUp):
            partner = stages.decode(s[f"enc_p{k}"], device)
            k += 1
            if st.kind == "scaled_crop":
                images = stages.mixup_scaled_crop(images, partner, s["mix_letter"], s["mix_input"], s["mix_jit"],
                                                  s["mix_flip"], s["mix_anchor"], s["mix_target"], s["mix_w"])
            else:
                images = stages.mixup_beta_blend(images, partner, s["mix_lam"], s["mix_canvas"])
        elif isinstance(st, S.HSV):
            images = stages.hsv_jitter(images, st)
        elif isinstance(st, S.Distort):
            if st.prob > 0:
                images = stages.distort(images, st.prob)
        elif isinstance(st, S.ExpandCrop):
            if st.expand_prob > 0 or st.crop:
                images, boxes, labels, scores = stages.expand_crop(images, boxes, labels, s["wh"], st, scores)
        elif isinstance(st, S.Flip):
            if st.prob > 0:
                boxes, coin = stages.flip(boxes, st.prob)
                if S.resize_of(stage_list).mode == "stretch":
                    mirror = coin  # in crop_mirror_normalize, after the stretch (one pass fewer)
                else:
                    images = fn.flip(images, horizontal=coin)  # before the canvas padding
        elif isinstance(st, S.Resize):
            hw_in = fn.cast(images.shape(), dtype=types.FLOAT)
            images, box_scale = stages.resize(images, s["size"], s.get("interp"), st)
            scale_factors = box_scale / fn.stack(hw_in[1], hw_in[0])
        elif isinstance(st, S.Normalize):
            images = stages.normalize(images, mirror, channels_last, st)
    gt_boxes, gt_labels, gt_mask, gt_scores, overflow = stages.targets(boxes, labels, box_scale, max_boxes, scores)
    named = dict(images=images, gt_boxes=gt_boxes, gt_labels=gt_labels, gt_mask=gt_mask, gt_scores=gt_scores,
                 image_ids=s["image_id"], orig_sizes=s["orig_hw"], scale_factors=scale_factors)
    outs = [named[k] for k in BATCH_KEYS]
    if device == "gpu":
        outs = [o if k == "images" else o.gpu() for k, o in zip(BATCH_KEYS, outs)]
    return (*outs, overflow)
