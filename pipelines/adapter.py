"""DALI pipelines behind the loader interface of ``fastdet.data.loader``.

Each loader owns one pipeline fed by an endless, iteration-keyed source (see
``sources``): a pass runs it ``len(loader)`` times and turns the outputs into torch
tensors without a copy (DLPack; on a GPU bound to torch's current stream, so no host
synchronisation). Because the stream runs on across epochs, DALI keeps prefetching
through epoch boundaries; ``set_epoch`` to an epoch the stream is not positioned at
(resume, or a pass broken off early) rebuilds the pipeline there.

DALI stops the pipeline for good on a file it cannot decode and cannot skip a sample,
so its records must be decode-verified: :func:`verified_records` runs the COCO
layer's cached ``"decode"`` check unless the set was loaded with it, and leaves out
(counting them) the images that fail.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from fastdet.data import stages as S
from fastdet.data.augment import ImageDecodeError, decode_image, planned_prefix
from fastdet.data.layout import BATCH_KEYS, empty_batch
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import ImageRecord
from fastdet.data.schedule import EvalSchedule, LoaderError, TrainSchedule
from fastdet.pipelines.detection import OUTPUTS, detection_pipeline, unused_outputs
from fastdet.pipelines.sources import EvalSource, TrainSource, _RecordSource

log = logging.getLogger(__name__)
_PIPE_PREFETCH = 2  # batches the pipeline runs ahead of the trainer
_SOURCE_PREFETCH = 1  # batches the parallel source runs ahead, beyond one per worker


def verified_records(dataset: Any, data) -> tuple[list[ImageRecord], int]:
    """``(records that decode, number left out)``; trusts a set loaded with ``check_images="decode"``."""
    records = list(dataset.records)
    if data.check_images == "decode":  # the loaders assume the set was loaded with data.check_images
        return records, 0
    # The COCO layer's checker, keyed like load_coco's (image dir + file name), so its
    # cache of earlier "decode" checks is reused and this one is cached for the next run.
    from fastdet.data import coco

    base = getattr(dataset, "image_dir", None)
    by_dir: dict[Path, list[tuple[int, str]]] = defaultdict(list)
    for i, r in enumerate(records):
        f = Path(r.file)
        if base is not None and f.is_relative_to(base):
            by_dir[Path(base)].append((i, str(f.relative_to(base))))
        else:
            by_dir[f.parent].append((i, f.name))
    bad: list[int] = []
    report = getattr(dataset, "report", None)
    for d, items in by_dir.items():
        idx = [i for i, _ in items]
        checks = coco._check_images(d, [name for _, name in items], "decode", data.cache_dir)
        for i, (status, w, h, *_) in zip(idx, checks):
            if status == "ok" and (w, h) != (records[i].width, records[i].height):
                status = "size mismatch"
            if status != "ok":
                bad.append(i)
                if report is not None:
                    report.count(report.image_skips, status, 1, [records[i].file])
    if bad:
        shown = ", ".join(records[i].file for i in bad[:3])
        log.warning(
            "DALI loader: left out %d image(s) that do not decode (%s%s)",
            len(bad), shown, ", ..." if len(bad) > 3 else "",
        )
        drop = set(bad)
        records = [r for i, r in enumerate(records) if i not in drop]
    if not records:
        raise LoaderError(f"{dataset.ann_file}: no image decodes")
    return records, len(bad)


class _DaliLoader:
    backend = "dali"

    def __init__(self, data, records: list[ImageRecord], *, device: torch.device) -> None:
        d = data
        self.records = records
        self.device = device
        self.max_boxes = d.max_boxes
        self.channels_last = d.channels_last
        self.stages: Optional[tuple] = None  # the stage list the pipeline is built from
        self.num_threads = max(1, int(d.num_workers))
        # Worker processes of the parallel source (reads + per-sample plans): light work
        # next to the pixels' num_threads, so a quarter of them.
        self.py_workers = max(1, -(-self.num_threads // 4))
        self.boxes_truncated = 0  # boxes beyond max_boxes (the smallest ones)
        self.left_out = 0  # records that failed the decode check (set by the builder)
        if device.type == "cuda":
            self._pixels = "gpu"
            self._device_id = device.index if device.index is not None else torch.cuda.current_device()
        else:
            self._pixels, self._device_id = "cpu", None
        self._pipe = None
        self._source: _RecordSource | None = None
        self._served = 0  # batches taken from the pipeline since it was built

    def _build(self, source: _RecordSource, batch_size: int, seed: int) -> None:
        self.close()
        self._source = source
        self._pipe = detection_pipeline(
            source,
            device=self._pixels,
            stage_list=self.stages,
            evaluation=isinstance(self, DaliEvalLoader),
            max_boxes=self.max_boxes,
            channels_last=self.channels_last,
            source_prefetch=_SOURCE_PREFETCH + self.py_workers,
            batch_size=batch_size,
            num_threads=self.num_threads,
            device_id=self._device_id,
            seed=seed,
            prefetch_queue_depth=_PIPE_PREFETCH,
            py_num_workers=self.py_workers,
            # fork is cheap, but DALI refuses it once CUDA is initialised in this process (a
            # GPU run always has it); spawn pickles the source (records and schedule, no handles).
            py_start_method="spawn" if self._pixels == "gpu" else "fork",
        )
        self._pipe.build()
        self._served = 0

    def _next_batch(self) -> dict[str, torch.Tensor]:
        try:
            if self._pixels == "gpu":
                outs = self._pipe.run(torch.cuda.current_stream(self.device))
            else:
                outs = self._pipe.run()
        except RuntimeError as e:
            raise self._explain(e) from None
        self._served += 1
        named = dict(zip(OUTPUTS, outs))
        batch = {}
        for k in BATCH_KEYS:
            if self._pixels == "gpu":
                with torch.cuda.device(self.device):
                    batch[k] = torch.from_dlpack(named[k].as_tensor())
            else:
                batch[k] = torch.from_dlpack(named[k].as_tensor())
        self.boxes_truncated += int(np.asarray(named["overflow"].as_tensor()).sum())
        if self.channels_last:
            batch["images"] = batch["images"].permute(0, 3, 1, 2)  # [B, 3, H, W] with channels-last strides
        return batch

    def _explain(self, err: RuntimeError) -> LoaderError:
        """A one-line error naming the file when DALI failed to decode one."""
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        # The failing batch is the next one or one already prefetched; the source is a pure
        # function of the iteration, so its files are known here without the workers.
        ahead = _PIPE_PREFETCH + _SOURCE_PREFETCH + self.py_workers + 1
        files = [f for g in range(self._served, self._served + ahead) for f in self._source.files_of(g)] \
            if self._source is not None else []
        for f in dict.fromkeys(files):
            try:
                decode_image(f)
            except ImageDecodeError:
                return LoaderError(
                    f"DALI cannot decode {f}: load the data with --set data.check_images=decode "
                    "(corrupt images are then skipped and counted) or use --loader torch"
                )
        return LoaderError(f"DALI pipeline failed: {msg}")

    def report(self) -> str:
        """One line: what this loader left out or truncated so far."""
        parts = []
        if self.left_out:
            parts.append(f"{self.left_out} images that do not decode left out")
        if self.boxes_truncated:
            parts.append(f"{self.boxes_truncated} boxes beyond max_boxes={self.max_boxes} dropped")
        return "; ".join(parts) if parts else "nothing skipped"

    def close(self) -> None:
        """Release the pipeline (its worker processes and device memory)."""
        self._pipe, self._source = None, None


class DaliTrainLoader(_DaliLoader):
    """Training batches of a :class:`TrainSchedule`; successive passes are successive epochs."""

    def __init__(
        self,
        data,
        records: list[ImageRecord],
        schedule: TrainSchedule,
        *,
        stages_for_epoch,
        device: torch.device,
        seed: int,
        rank: int,
    ) -> None:
        super().__init__(data, records, device=device)
        self.schedule = schedule
        self.stages_for_epoch = stages_for_epoch
        self.seed = int(seed)
        self.rank = int(rank)
        self.chain_changes = 0  # stage lists taken so far (a test counts them)
        self.epoch = 0
        self._next: tuple[int, int] | None = None  # (epoch, step) the stream yields next
        self.set_epoch(0)

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return self.schedule.sizes

    def set_epoch(self, epoch: int) -> None:
        """Asks the epoch's stage list; a different tuple drops the pipeline (rebuilt at the next pass)."""
        self.epoch = int(epoch)
        stages = S.check_stages(self.stages_for_epoch(self.epoch))
        if stages != self.stages:
            try:
                head = planned_prefix(stages)
            except ValueError as e:
                raise LoaderError(f"epoch {self.epoch}: {e}") from None
            self.close()
            self.stages, self._head = stages, head
            self.chain_changes += 1
            self.schedule.set_interp(S.resize_of(stages).interp)

    def _restart(self, epoch: int) -> None:
        # The augmentation RNG differs per rank and per restart point, and is fixed by the seed.
        seed = int(np.random.SeedSequence([self.seed, self.rank, epoch]).generate_state(1)[0] >> 1)
        source = TrainSource(
            self.records,
            self.schedule,
            epoch,
            unused=unused_outputs(self.stages),
            head=self._head,
        )
        self._build(source, self.schedule.batch_size, seed)
        self._next = (epoch, 0)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, steps = self.epoch, self.schedule.steps_per_epoch
        if self._pipe is None or self._next != (epoch, 0):
            self._restart(epoch)
        for step in range(steps):
            batch = self._next_batch()
            self._next = (epoch, step + 1) if step + 1 < steps else (epoch + 1, 0)
            yield batch
        self.epoch = epoch + 1


class DaliEvalLoader(_DaliLoader):
    """Evaluation batches of an :class:`EvalSchedule` (every record once over all ranks)."""

    def __init__(self, data, records: list[ImageRecord], schedule: EvalSchedule, *, preprocess: Preprocess,
                 device: torch.device) -> None:
        super().__init__(data, records, device=device)
        self.schedule = schedule
        p = preprocess
        # Preprocess.__call__ as a stage list; DALI's cubic kernel differs slightly from torch's.
        self.stages = (S.Resize(p.resize, pad_value=p.pad_value, interp=p.interp, short=p.short, max_long=p.max_long),
                       S.Normalize(p.mean, p.std))
        self._next = -1  # the non-empty step the stream yields next (-1: no pipeline)

    def __len__(self) -> int:
        return self.schedule.steps

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return self.schedule.sizes

    def set_epoch(self, epoch: int) -> None:
        """Evaluation is the same every epoch."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        s = self.schedule
        if s.nonempty_steps:
            if self._pipe is None or self._next != 0:
                source = EvalSource(self.records, s, unused=unused_outputs(self.stages))
                self._build(source, s.batch_size, seed=0)
                self._next = 0
            for step in range(s.nonempty_steps):
                batch = self._next_batch()
                self._next = (step + 1) % s.nonempty_steps
                yield batch
        for _ in range(s.steps - s.nonempty_steps):
            yield empty_batch(s.sizes[0], self.max_boxes, channels_last=self.channels_last, device=self.device)
