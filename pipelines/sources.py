"""The reader of the DALI pipelines: ``fn.external_source`` callbacks over validated records.

Why not ``fn.readers.coco`` on the JSON: it maps a category missing from ``categories``
to label 0 without a word, keeps crowd boxes unless told, filters by its own size
rule, and its per-epoch shuffle (``shuffle_after_epoch``) cannot be keyed to our seed
and epoch or rotated shards to match the torch back end. The records from
``fastdet.data.coco.load_coco`` are already validated (crowd dropped, boxes clipped,
corrupt images skipped), so the pipelines read exactly those.

The callbacks run in batch mode with ``batch_info=True``, in DALI's worker processes
(parallel external source: the file reads and each sample's planning happen there, never
on the training thread; a worker reads its batch's files one after another, and the
workers' batches overlap a cold disk's latency). They are pure functions of the iteration
number, so the main process can name the files of any iteration again (``files_of``, for
error messages): batch ``g`` of the stream is step ``g % steps`` of epoch
``start_epoch + g // steps`` of the shared :class:`~fastdet.data.schedule.TrainSchedule`
(the same record indices, size and interpolation as the torch back end). They never
raise ``StopIteration``, so DALI's prefetching runs on across epoch boundaries
without a stall or a reset. Evaluation cycles over its rank's batches the same way;
its last batch is simply shorter (batch mode allows a smaller batch), so nothing is
padded or duplicated.

Per sample the callbacks emit (CPU):

    encoded   uint8 [bytes]   the file's bytes, decoded in the graph
    boxes     float32 [N, 4]  xyxy relative to the image (0..1)
    labels    int32 [N]
    wh        float32 [2]     (width, height) of the image (only for the geometric stages)
    image_id  int64 []        COCO id
    orig_hw   int64 [2]       (height, width)
    size      float32 [2]     (H, W), the batch's network input canvas
    interp    int32 []        DALI interpolation of the batch's resize
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from fastdet.data import augment
from fastdet.data import stages as S
from fastdet.data.schedule import INTERPS, EvalSchedule, TrainSchedule
from fastdet.data.records import ImageRecord

SOURCE_OUTPUTS = ("encoded", "boxes", "labels", "wh", "image_id", "orig_hw", "size", "interp")

# INTERPS index → DALIInterpType value (INTERP_NN, INTERP_LINEAR, INTERP_CUBIC).
_DALI_INTERP = {"nearest": 0, "linear": 1, "cubic": 2}


def _read(path: str) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


class _RecordSource:
    """Shared part: per-record arrays prepared once. Picklable (a "spawn" worker receives it)."""

    def __init__(self, records: list[ImageRecord], unused: tuple[str, ...]) -> None:
        # An output the graph does not consume makes DALI warn: `wh` only feeds expand/crop,
        # `interp` only a Resize with a random interpolation.
        self.outputs = tuple(n for n in SOURCE_OUTPUTS if n not in unused)
        self.files = [r.file for r in records]
        self.boxes = [
            (r.boxes.reshape(-1, 4) / np.array([r.width, r.height, r.width, r.height], np.float32)).astype(np.float32)
            for r in records
        ]
        self.labels = [r.labels.astype(np.int32).reshape(-1) for r in records]
        self.wh = [np.array([r.width, r.height], np.float32) for r in records]
        self.ids = [np.array(r.image_id, np.int64) for r in records]
        self.hw = [np.array([r.height, r.width], np.int64) for r in records]

    def emit(self, indices: np.ndarray, hw: tuple[int, int], interp: int) -> dict[str, list]:
        idx = [int(i) for i in indices]
        n = len(idx)
        size_arr = np.array(hw, np.float32)
        interp_arr = np.array(_DALI_INTERP[INTERPS[interp]], np.int32)
        return {
            "encoded": [_read(self.files[i]) for i in idx],
            "boxes": [self.boxes[i] for i in idx],
            "labels": [self.labels[i] for i in idx],
            "wh": [self.wh[i] for i in idx],
            "image_id": [self.ids[i] for i in idx],
            "orig_hw": [self.hw[i] for i in idx],
            "size": [size_arr] * n,
            "interp": [interp_arr] * n,
        }


class TrainSource(_RecordSource):
    """Batch ``g`` = step ``g % steps`` of epoch ``start_epoch + g // steps``; endless."""

    def __init__(
        self,
        records: list[ImageRecord],
        schedule: TrainSchedule,
        start_epoch: int,
        *,
        unused: tuple[str, ...] = (),
        head: tuple = (),
    ) -> None:
        super().__init__(records, unused)
        self.schedule = schedule
        self.start_epoch = int(start_epoch)
        # Planned stages (Mosaic, RandomAffine, MixUp) at the head of the list: their draws
        # and boxes are computed here, on the CPU; the graph moves the pixels.
        self.head = tuple(head)
        self.partners = S.partners_needed(self.head)
        self.outputs = self.outputs + plan_outputs(self.head)
        self.w = [r.width for r in records]
        self.h = [r.height for r in records]
        self.px_boxes = [r.boxes.reshape(-1, 4).astype(np.float32) for r in records]

    def _at(self, g: int) -> tuple[int, int]:
        steps = self.schedule.steps_per_epoch
        return self.start_epoch + g // steps, g % steps

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        epoch, step = self._at(info.iteration)  # never reset: this source never ends an epoch for DALI
        plan = self.schedule.batch(epoch, step)
        out = self.emit(plan.indices, plan.hw, plan.interp)
        if self.head:
            self._plan(out, plan, epoch, step)
        return tuple(out[k] for k in self.outputs)

    def files_of(self, g: int) -> list[str]:
        """The files batch ``g`` may read: its records', then every partner its plans may draw."""
        epoch, step = self._at(g)
        idx = [int(i) for i in self.schedule.batch(epoch, step).indices]
        if self.partners:
            idx += [int(q) for j in range(len(idx)) for q in self.schedule.partners(epoch, step, j, self.partners)]
        return [self.files[i] for i in idx]

    def _plan(self, out: dict[str, list], plan, epoch: int, step: int) -> None:
        """The planned stages' draws for each sample: the torch back end's, from the same keys."""
        s = self.schedule
        rows = []
        for j, i in enumerate(int(v) for v in plan.indices):
            partners = [int(v) for v in s.partners(epoch, step, j, self.partners)]
            prng = augment.plan_rng(s.sample_seed(epoch, step, j))
            own = ((self.w[i], self.h[i]), self.px_boxes[i], self.labels[i])
            p = augment.plan_sample(self.head, own, [((self.w[q], self.h[q]), self.px_boxes[q], self.labels[q])
                                                     for q in partners], prng, plan.hw)
            arrays = plan_arrays(self.head, p, [self.files[q] for q in partners], _read)
            w, h = p.wh
            arrays["boxes"] = (p.boxes.reshape(-1, 4) / np.array([w, h, w, h], np.float32)).astype(np.float32)
            arrays["labels"] = p.labels.astype(np.int32)
            arrays["scores"] = p.scores.astype(np.float32)
            arrays["wh"] = np.array([w, h], np.float32)
            rows.append(arrays)
        for k in rows[0]:
            out[k] = [r[k] for r in rows]


class EvalSource(_RecordSource):
    """Batch ``g`` = this rank's non-empty evaluation batch ``g % nonempty_steps``; endless."""

    def __init__(self, records: list[ImageRecord], schedule: EvalSchedule, *,
                 unused: tuple[str, ...] = ("wh",)) -> None:
        super().__init__(records, unused)
        self.schedule = schedule

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        plan = self.schedule.batch(info.iteration % self.schedule.nonempty_steps)
        out = self.emit(plan.indices, plan.hw, plan.interp)
        return tuple(out[k] for k in self.outputs)

    def files_of(self, g: int) -> list[str]:
        """The files batch ``g`` reads."""
        return [self.files[int(i)] for i in self.schedule.batch(g % self.schedule.nonempty_steps).indices]


# --------------------------------------------------------------------------- planned stages

def _tiny_jpeg() -> np.ndarray:
    """The bytes of an 8 x 8 JPEG: the partner decoded where a plan draws none (it is never shown)."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (114, 114, 114)).save(buf, format="JPEG")
    return np.frombuffer(buf.getvalue(), np.uint8)


DUMMY = _tiny_jpeg()
_FAR = np.array([16, 16], np.int32)  # a slice anchor past the 8 x 8 dummy: all fill


def plan_outputs(head: tuple) -> tuple[str, ...]:
    """The source outputs that carry the plans of ``head`` (``fastdet.data.augment.planned_prefix``)."""
    if not head:
        return ()
    names, k = ["scores"], 0
    for st in head:
        if isinstance(st, S.Mosaic):
            names += [f"enc_p{k}", f"enc_p{k + 1}", f"enc_p{k + 2}", "mos_rsz", "mos_anchor", "mos_quad"]
            k += 3
        elif isinstance(st, S.RandomAffine):
            names += ["aff_m", "aff_size"]
        elif isinstance(st, S.MixUp) and st.kind == "scaled_crop":
            names += [f"enc_p{k}", "mix_letter", "mix_input", "mix_jit", "mix_flip", "mix_anchor", "mix_target",
                      "mix_w"]
            k += 1
        elif isinstance(st, S.MixUp):
            names += [f"enc_p{k}", "mix_lam", "mix_canvas"]
            k += 1
    return tuple(names)


def dali_affine(M: np.ndarray) -> np.ndarray:
    """cv2's src → dst matrix [2, 3] (pixel centres at integers) as DALI warp_affine's dst → src
    matrix (pixel centres at +0.5): conjugated by the half-pixel shift, then inverted."""
    A = np.vstack([M, [0.0, 0.0, 1.0]])
    T = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5], [0.0, 0.0, 1.0]])
    return np.linalg.inv(T @ A @ np.linalg.inv(T))[:2].astype(np.float32)


def plan_arrays(head: tuple, p: augment.Prefix, partner_files: list[str], read) -> dict[str, np.ndarray]:
    """One sample's plan outputs (see :func:`plan_outputs`); ``read(file)`` gives a partner's bytes."""
    out: dict[str, np.ndarray] = {}
    k = 0
    for st in head:
        w0, h0 = p.wh_before[type(st)]
        if isinstance(st, S.Mosaic):
            m = p.mosaic
            for j in range(3):
                out[f"enc_p{k + j}"] = read(partner_files[k + j]) if m is not None else DUMMY
            if m is not None:
                out["mos_rsz"] = np.array([t.hw for t in m.tiles], np.float32)
                (ch, cw), t0 = m.canvas_hw, m.tiles[0]
                # The centre: tile 0 ends there (YOLOX get_mosaic_coordinate), clipped to the canvas.
                xc, yc = min(max(t0.xy[0] + t0.hw[1], 0), cw), min(max(t0.xy[1] + t0.hw[0], 0), ch)
                origin = [(0, 0), (xc, 0), (0, yc), (xc, yc)]
                out["mos_anchor"] = np.array([(ox - t.xy[0], oy - t.xy[1]) for (ox, oy), t in zip(origin, m.tiles)],
                                             np.int32)
                out["mos_quad"] = np.array([(xc, yc), (cw - xc, yc), (xc, ch - yc), (cw - xc, ch - yc)], np.int32)
            else:  # the sample alone on a canvas of its own size: quadrant 0 is all of it, the others empty
                out["mos_rsz"] = np.array([(h0, w0)] + [(8, 8)] * 3, np.float32)
                out["mos_anchor"] = np.zeros((4, 2), np.int32)
                out["mos_quad"] = np.array([(w0, h0), (0, h0), (w0, 0), (0, 0)], np.int32)
            k += 3
        elif isinstance(st, S.RandomAffine):
            if p.affine is not None:
                M, (oh, ow) = p.affine
                out["aff_m"], out["aff_size"] = dali_affine(M), np.array([oh, ow], np.float32)
            else:
                out["aff_m"] = np.array([[1, 0, 0], [0, 1, 0]], np.float32)
                out["aff_size"] = np.array([h0, w0], np.float32)
        elif isinstance(st, S.MixUp) and st.kind == "scaled_crop":
            m = p.mixup
            if m is not None:
                out[f"enc_p{k}"] = read(partner_files[k])
                out["mix_letter"] = np.array(m.letter_hw, np.float32)
                out["mix_input"] = np.array([m.input_hw[1], m.input_hw[0]], np.int32)
                out["mix_jit"] = np.array(m.jitter_hw, np.float32)
                out["mix_flip"] = np.array(int(m.flip), np.int32)
                out["mix_anchor"] = np.array(m.offset, np.int32)
                out["mix_w"] = np.array([1, 1], np.uint8)
            else:
                out[f"enc_p{k}"] = DUMMY
                out["mix_letter"] = out["mix_jit"] = np.array([8, 8], np.float32)
                out["mix_input"] = np.array([8, 8], np.int32)
                out["mix_flip"] = np.array(0, np.int32)
                out["mix_anchor"] = _FAR
                out["mix_w"] = np.array([2, 0], np.uint8)
            out["mix_target"] = np.array([w0, h0], np.int32)
            k += 1
        elif isinstance(st, S.MixUp):
            lam = p.mixup
            out[f"enc_p{k}"] = read(partner_files[k]) if lam is not None else DUMMY
            out["mix_lam"] = np.array(1.0 if lam is None else lam, np.float32)
            pw, ph = p.mixup_wh if lam is not None else (0, 0)
            out["mix_canvas"] = np.array([max(w0, pw), max(h0, ph)] if lam != 0.0 else [pw, ph], np.int32)
            k += 1
    return out
