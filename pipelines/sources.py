"""The reader of the DALI pipelines: ``fn.external_source`` callbacks over validated records.

Why not ``fn.readers.coco`` on the JSON: it maps a category missing from ``categories``
to label 0 without a word, keeps crowd boxes unless told, filters by its own size
rule, and its per-epoch shuffle (``shuffle_after_epoch``) cannot be keyed to our seed
and epoch or rotated shards to match the torch back end. The records from
``fastdet.data.coco.load_coco`` are already validated (crowd dropped, boxes clipped,
corrupt images skipped), so the pipelines read exactly those.

The callbacks run in batch mode with ``batch_info=True`` and are pure functions of
the iteration number: batch ``g`` of the stream is step ``g % steps`` of epoch
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

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastdet.data.schedule import INTERPS, EvalSchedule, TrainSchedule
from fastdet.data.records import ImageRecord

SOURCE_OUTPUTS = ("encoded", "boxes", "labels", "wh", "image_id", "orig_hw", "size", "interp")

# INTERPS index → DALIInterpType value (INTERP_NN, INTERP_LINEAR, INTERP_CUBIC).
_DALI_INTERP = {"nearest": 0, "linear": 1, "cubic": 2}
_RECENT = 8  # batches remembered for error messages (the prefetch queue is shorter)


def _read(path: str) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


class _RecordSource:
    """Shared part: per-record arrays prepared once, threaded file reads."""

    def __init__(self, records: list[ImageRecord], reader_threads: int, unused: tuple[str, ...]) -> None:
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
        # File reads release the GIL: a few threads hide the latency of a cold disk.
        self._pool = ThreadPoolExecutor(max(1, reader_threads), thread_name_prefix="fastdet-read")
        self.recent: OrderedDict[int, list[str]] = OrderedDict()  # iteration -> files, for error messages

    def emit(self, iteration: int, indices: np.ndarray, hw: tuple[int, int], interp: int) -> tuple[list[np.ndarray], ...]:
        idx = [int(i) for i in indices]
        files = [self.files[i] for i in idx]
        self.recent[iteration] = files
        while len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        n = len(idx)
        size_arr = np.array(hw, np.float32)
        interp_arr = np.array(_DALI_INTERP[INTERPS[interp]], np.int32)
        out = {
            "encoded": list(self._pool.map(_read, files)),
            "boxes": [self.boxes[i] for i in idx],
            "labels": [self.labels[i] for i in idx],
            "wh": [self.wh[i] for i in idx],
            "image_id": [self.ids[i] for i in idx],
            "orig_hw": [self.hw[i] for i in idx],
            "size": [size_arr] * n,
            "interp": [interp_arr] * n,
        }
        return tuple(out[k] for k in self.outputs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TrainSource(_RecordSource):
    """Batch ``g`` = step ``g % steps`` of epoch ``start_epoch + g // steps``; endless."""

    def __init__(
        self,
        records: list[ImageRecord],
        schedule: TrainSchedule,
        start_epoch: int,
        *,
        reader_threads: int = 4,
        unused: tuple[str, ...] = (),
    ) -> None:
        super().__init__(records, reader_threads, unused)
        self.schedule = schedule
        self.start_epoch = int(start_epoch)

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        g = info.iteration  # never reset: this source never ends an epoch for DALI
        steps = self.schedule.steps_per_epoch
        plan = self.schedule.batch(self.start_epoch + g // steps, g % steps)
        return self.emit(g, plan.indices, plan.hw, plan.interp)


class EvalSource(_RecordSource):
    """Batch ``g`` = this rank's non-empty evaluation batch ``g % nonempty_steps``; endless."""

    def __init__(self, records: list[ImageRecord], schedule: EvalSchedule, *, reader_threads: int = 4,
                 unused: tuple[str, ...] = ("wh",)) -> None:
        super().__init__(records, reader_threads, unused)
        self.schedule = schedule

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        g = info.iteration
        plan = self.schedule.batch(g % self.schedule.nonempty_steps)
        return self.emit(g, plan.indices, plan.hw, plan.interp)
