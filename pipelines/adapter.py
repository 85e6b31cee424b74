"""DALI pipelines behind the loader interface of ``fastdet.data.loader``.

The loaders are ``fastdet.data.loader_base``'s :class:`TrainLoader` /
:class:`EvalLoader` (schedule, epochs, report, close) with a DALI pipeline as their
producer, fed by an endless, iteration-keyed source (see ``sources``): a pass runs it
``len(loader)`` times and turns the outputs into torch tensors without a copy (DLPack;
on a GPU bound to torch's current stream, so no host synchronisation). Because the
stream runs on across epochs, DALI keeps prefetching through epoch boundaries; a pass
of an epoch the stream is not positioned at (``set_epoch`` for a resume, or after a
pass broken off early) rebuilds the pipeline there, and so does a new stage list.

DALI stops the pipeline for good on a file it cannot decode and cannot skip a sample,
so its records must be decode-verified: :func:`verified_records` runs the COCO
layer's cached ``"decode"`` check unless the set was loaded with it, and leaves out
(counting them) the images that fail.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from fastdet.data import stages as S
from fastdet.data.augment import ImageDecodeError, decode_image, planned_prefix
from fastdet.data.layout import BATCH_KEYS
from fastdet.data.loader_base import EvalLoader, Loader, TrainLoader
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


class _DaliLoader(Loader):
    """The pipeline half of both DALI loaders: build, run, explain a failure."""

    backend = "dali"

    def __init__(self, data, records: list[ImageRecord], schedule, *, device: torch.device, **kw) -> None:
        self.num_threads = max(1, int(data.num_workers))
        # Worker processes of the parallel source (reads + per-sample plans): light work
        # next to the pixels' num_threads, so a quarter of them.
        self.py_workers = max(1, -(-self.num_threads // 4))
        if device.type == "cuda":
            self._pixels = "gpu"
            self._device_id = device.index if device.index is not None else torch.cuda.current_device()
        else:
            self._pixels, self._device_id = "cpu", None
        self._source: _RecordSource | None = None
        self._served = 0  # batches taken from the pipeline since it was built
        super().__init__(data, records, schedule, device=device, **kw)

    def _build(self, source: _RecordSource, stage_list: tuple, batch_size: int, seed: int) -> None:
        self.close()
        self._source = source
        self._producer = detection_pipeline(
            source,
            device=self._pixels,
            stage_list=stage_list,
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
        self._producer.build()
        self._served = 0

    def _next_batch(self) -> dict[str, torch.Tensor]:
        try:
            if self._pixels == "gpu":
                outs = self._producer.run(torch.cuda.current_stream(self.device))
            else:
                outs = self._producer.run()
        except RuntimeError as e:
            err = self._explain(e)
            # DALI stops a pipeline for good on an error. Release it (its threads and worker
            # processes) now rather than through the garbage collector: a caller's traceback can
            # hold this loader in a reference cycle, and DALI's own frames in e's traceback hold
            # the pipeline (e stays err's __context__). A pipeline left for the collector
            # deadlocks any process forked meanwhile (a DataLoader worker) that collects it there.
            e.__traceback__ = None
            self.close()
            raise err from None
        self._served += 1
        named = dict(zip(OUTPUTS, outs))
        batch = {}
        for k in BATCH_KEYS:
            if self._pixels == "gpu":
                with torch.cuda.device(self.device):
                    batch[k] = torch.from_dlpack(named[k].as_tensor())
            else:
                batch[k] = torch.from_dlpack(named[k].as_tensor())
        return self._deliver(batch, int(np.asarray(named["overflow"].as_tensor()).sum()))

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

    def _stop(self, producer) -> None:
        # Dropping the last reference shuts the pipeline's worker processes and frees its memory.
        self._source = None


class DaliTrainLoader(_DaliLoader, TrainLoader):
    """Training batches of a :class:`TrainSchedule` from an endless pipeline (one stream across epochs)."""

    def __init__(self, data, records: list[ImageRecord], schedule: TrainSchedule, **kw) -> None:
        self._head: tuple = ()  # the planned prefix of the stage list (see augment.planned_prefix)
        self._next: tuple[int, int] | None = None  # (epoch, step) the stream yields next
        super().__init__(data, records, schedule, **kw)

    def _use_stages(self, stages: tuple) -> None:
        """A stage list DALI can plan; the pipeline of the old one is dropped (rebuilt at the next pass)."""
        try:
            head = planned_prefix(stages)
        except ValueError as e:
            raise LoaderError(f"epoch {self.epoch}: {e}") from None
        self.close()
        self._head = head

    def _restart(self, epoch: int) -> None:
        s = self.schedule
        # The augmentation RNG differs per rank and per restart point, and is fixed by the seed.
        seed = int(np.random.SeedSequence([s.seed, s.rank, epoch]).generate_state(1)[0] >> 1)
        source = TrainSource(self.records, s, epoch, unused=unused_outputs(self.stages), head=self._head)
        self._build(source, self.stages, s.batch_size, seed)
        self._next = (epoch, 0)

    def _epoch_batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        steps = self.schedule.steps_per_epoch
        if self._producer is None or self._next != (epoch, 0):
            self._restart(epoch)
        for step in range(steps):
            batch = self._next_batch()
            self._next = (epoch, step + 1) if step + 1 < steps else (epoch + 1, 0)
            yield batch


class DaliEvalLoader(_DaliLoader, EvalLoader):
    """Evaluation batches of an :class:`EvalSchedule` from a pipeline cycling over this rank's batches."""

    def __init__(self, data, records: list[ImageRecord], schedule: EvalSchedule, **kw) -> None:
        self._next = -1  # the non-empty step the stream yields next (-1: no pipeline)
        super().__init__(data, records, schedule, **kw)
        p = self.preprocess
        # Preprocess.__call__ as a stage list; DALI's cubic kernel differs slightly from torch's.
        self.stages = (p.resize_stage(), S.Normalize(p.mean, p.std))

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        s = self.schedule
        if self._producer is None or self._next != 0:
            source = EvalSource(self.records, s, unused=unused_outputs(self.stages))
            self._build(source, self.stages, s.batch_size, seed=0)
            self._next = 0
        for step in range(s.nonempty_steps):
            batch = self._next_batch()
            self._next = (step + 1) % s.nonempty_steps
            yield batch
