"""The loader both back ends are: the schedule, the epoch bookkeeping, the report, close.

:class:`TrainLoader` and :class:`EvalLoader` own everything the two back ends
(``fastdet.data.torch_backend`` and ``fastdet.pipelines.adapter``) have in common: the
length and the size buckets (from the :mod:`fastdet.data.schedule` they are given), the
epoch a pass runs and the stage list it runs (``set_epoch``), the iteration protocol
(a training pass is an epoch and moves on to the next; an evaluation pass pads a short
rank with empty batches), the layout a batch leaves in (channels-last strides), the
counts behind ``report()``, and ``close()``. A back end supplies only how batches are
produced:

- ``_use_stages(stages)`` (training): get ready for a new stage list (validate it,
  drop the producer built for the old one);
- ``_epoch_batches(epoch)`` (training) / ``_batches()`` (evaluation): the batches of one
  pass, each through ``_deliver``;
- ``_stop(producer)``: release what produces the batches (worker processes, pipeline).

This module sits at the bottom of the data layer: it imports neither back end nor
``fastdet.data.loader``; the back ends import it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from fastdet.data import stages as S
from fastdet.data.layout import empty_batch
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import ImageRecord
from fastdet.data.schedule import HW, EvalSchedule, TrainSchedule

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


@dataclass
class DataLosses:
    """What a loader left out, skipped or truncated so far; ranks' add up (``a + b``), so
    a DDP run reports its whole data, not rank 0's share."""

    max_boxes: int
    left_out: int = 0  # records left out before the loader: the dataset's, the same on every rank
    skipped: Counter = field(default_factory=Counter)  # file -> times it failed to decode
    dropped: int = 0  # evaluation images left out because they failed to decode
    boxes_truncated: int = 0  # boxes beyond max_boxes (the smallest ones)

    def __add__(self, other: "DataLosses") -> "DataLosses":
        return DataLosses(self.max_boxes, max(self.left_out, other.left_out), self.skipped + other.skipped,
                          self.dropped + other.dropped, self.boxes_truncated + other.boxes_truncated)

    def __str__(self) -> str:
        """One line: what was left out, skipped or truncated."""
        parts = []
        if self.left_out:
            parts.append(f"{self.left_out} images that do not decode left out")
        if self.skipped:
            parts.append(f"{sum(self.skipped.values())} undecodable image reads ({len(self.skipped)} files)")
        if self.dropped:
            parts.append(f"{self.dropped} evaluation images left out")
        if self.boxes_truncated:
            parts.append(f"{self.boxes_truncated} boxes beyond max_boxes={self.max_boxes} dropped")
        return "; ".join(parts) if parts else "nothing skipped"


class Loader(ABC):
    """What both back ends and both uses share; see the module docstring.

    Args:
        data: the run's ``DataConfig`` (the base reads ``max_boxes`` and ``channels_last``).
        records: the records the schedule's indices point into.
        schedule: a :class:`TrainSchedule` or :class:`EvalSchedule`.
        device: where batches are delivered.
        report: the dataset's ``DataReport`` (or None): undecodable images are counted there too.
        left_out: records the builder left out before the loader (DALI's decode check).
    """

    backend: str  # "torch" | "dali", set by each back end

    def __init__(self, data, records: list[ImageRecord], schedule: TrainSchedule | EvalSchedule, *,
                 device: torch.device, report: Any = None, left_out: int = 0) -> None:
        self.records = records
        self.schedule = schedule
        self.device = device
        self.max_boxes = data.max_boxes
        self.channels_last = data.channels_last
        self._report = report
        self.left_out = left_out
        self.skipped: Counter = Counter()  # file -> times it failed to decode
        self.dropped = 0  # evaluation images left out because they failed to decode
        self.boxes_truncated = 0  # boxes beyond max_boxes (the smallest ones)
        # What produces the batches (a DataLoader, a DALI pipeline): started by a pass,
        # stopped by close(), started again by the next pass.
        self._producer: Any = None

    @property
    def sizes(self) -> tuple[HW, ...]:
        """Every (H, W) a batch can have: the compile buckets."""
        return self.schedule.sizes

    # What a failed image becomes, for the log line (training substitutes, evaluation leaves out).
    _skip_action: str
    # Whether boxes beyond max_boxes are warned about: training's are lost to the loss;
    # evaluation scores against the annotation file, whatever its batches hold.
    _says_overflow = False

    def _count_skips(self, skipped: list[tuple[str, str, str]], dropped: int) -> None:
        """Count ``(file, message, reason)`` decode failures: each file logged and reported once."""
        for f, why, reason in skipped:
            if f not in self.skipped:
                log.warning("%s; %s", why, self._skip_action)
                if self._report is not None:
                    self._report.count(self._report.image_skips, reason, 1, [f])
            self.skipped[f] += 1
        self.dropped += dropped

    def _deliver(self, batch: Batch, overflow: int) -> Batch:
        """A produced batch as the step takes it; ``overflow`` boxes beyond ``max_boxes`` were dropped."""
        if overflow and not self.boxes_truncated and self._says_overflow:
            log.warning("an image has more boxes than --max-boxes %d: its smallest beyond that are dropped (counted "
                        "at each epoch's end); raise --max-boxes to keep them", self.max_boxes)
        self.boxes_truncated += overflow
        if self.channels_last:
            batch["images"] = batch["images"].permute(0, 3, 1, 2)  # [B, 3, H, W] with channels-last strides
        return batch

    def _empty(self, hw: HW) -> Batch:
        """A batch of no images at canvas ``hw``, in the layout of a full one."""
        return empty_batch(hw, self.max_boxes, channels_last=self.channels_last, device=self.device)

    def losses(self) -> DataLosses:
        """What this loader (this rank's) left out, skipped or truncated so far."""
        return DataLosses(self.max_boxes, self.left_out, Counter(self.skipped), self.dropped, self.boxes_truncated)

    def report(self) -> str:
        """One line: what this loader left out, skipped or truncated so far."""
        return str(self.losses())

    def close(self) -> None:
        """Release the worker processes (and device memory); a later pass starts them again. Idempotent."""
        if self._producer is not None:
            producer, self._producer = self._producer, None
            self._stop(producer)

    @abstractmethod
    def _stop(self, producer: Any) -> None:
        """Release ``producer`` (close() has already let go of it)."""


class TrainLoader(Loader):
    """Training batches of a :class:`TrainSchedule`; successive passes are successive epochs.

    ``stages_for_epoch(e)`` is asked at every ``set_epoch`` (and at the end of a pass, for
    the next epoch); the back end is told only when the tuple differs from the current one.
    """

    schedule: TrainSchedule
    _skip_action = "another image takes its place"
    _says_overflow = True

    def __init__(self, data, records: list[ImageRecord], schedule: TrainSchedule, *,
                 stages_for_epoch: Callable[[int], tuple], **kw) -> None:
        super().__init__(data, records, schedule, **kw)
        self.stages_for_epoch = stages_for_epoch
        self.stages: Optional[tuple] = None  # the stage list batches are produced with
        self.chain_changes = 0  # stage lists taken so far (a test counts them)
        self.epoch = 0
        self.set_epoch(0)

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch``, with that epoch's stage list."""
        self.epoch = int(epoch)
        stages = S.check_stages(self.stages_for_epoch(self.epoch))
        if stages == self.stages:
            return
        self._use_stages(stages)
        self.stages = stages
        self.schedule.set_interp(S.resize_of(stages).interp)
        self.chain_changes += 1

    def __iter__(self) -> Iterator[Batch]:
        epoch = self.epoch
        yield from self._epoch_batches(epoch)
        self.set_epoch(epoch + 1)

    @abstractmethod
    def _use_stages(self, stages: tuple) -> None:
        """Produce the next passes' batches with ``stages`` (checked; differs from ``self.stages``)."""

    @abstractmethod
    def _epoch_batches(self, epoch: int) -> Iterator[Batch]:
        """The ``len(self)`` batches of ``epoch``, each through ``_deliver``."""


class EvalLoader(Loader):
    """Evaluation batches of an :class:`EvalSchedule` (every record once over all ranks).

    Every rank yields ``len(loader)`` batches: its records' batches, then empty ones.
    """

    schedule: EvalSchedule
    _skip_action = "left out of the evaluation"

    def __init__(self, data, records: list[ImageRecord], schedule: EvalSchedule, *, preprocess: Preprocess,
                 **kw) -> None:
        super().__init__(data, records, schedule, **kw)
        self.preprocess = preprocess

    def __len__(self) -> int:
        return self.schedule.steps

    def set_epoch(self, epoch: int) -> None:
        """Evaluation is the same every epoch."""

    def __iter__(self) -> Iterator[Batch]:
        s = self.schedule
        if s.nonempty_steps:
            yield from self._batches()
        for _ in range(s.steps - s.nonempty_steps):
            yield self._empty(s.sizes[0])

    @abstractmethod
    def _batches(self) -> Iterator[Batch]:
        """The ``schedule.nonempty_steps`` batches that hold this rank's records, each through ``_deliver``."""
