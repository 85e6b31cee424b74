"""The reference loader: a ``torch.utils.data.DataLoader`` running the stage list in numpy/torch.

This is the loader a user of a plain PyTorch detection trainer has, and the fallback
where DALI is not installed. Workers decode with PIL and run the stages of
``fastdet.data.stages`` through ``fastdet.data.augment``; the output layout is
``fastdet.data.layout``'s, as the DALI back end's.

Sampling comes from ``fastdet.data.schedule`` (:class:`TrainSchedule` /
:class:`EvalSchedule`): a batch sampler yields, per batch, items ``(record index,
(H, W), interp, seed, partner indices)``, so every sample of a batch is resized to the
batch's canvas in the worker, and each sample's augmentation draws from its own seed:
a run is reproducible whatever the number of workers. The loaders are
``fastdet.data.loader_base``'s :class:`TrainLoader` / :class:`EvalLoader` with the
DataLoader as their producer: when ``set_epoch`` brings a different stage list, the
DataLoader (and its workers) is dropped and the next pass starts a new one; otherwise
it lives on.

Evaluation runs ``Preprocess.__call__`` (the family's resize mode, fill and
normalisation) on each image; batches carry ``scale_factors`` for
``fastdet.data.preprocess.boxes_to_original``.

A file that fails to decode is never silent: in training another record (drawn from
the sample's seed) takes its place, in evaluation the image is left out of its batch
(so it is scored as having no detections); either way the worker sends the failure
with the batch, and the loader counts it in ``skipped`` and logs the file once.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fastdet.data import augment
from fastdet.data import stages as S
from fastdet.data.layout import BATCH_KEYS, BY_NAME
from fastdet.data.loader_base import EvalLoader, Loader, TrainLoader
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import ImageRecord
from fastdet.data.schedule import EvalSchedule, LoaderError, TrainSchedule

# Training: substitutes tried for a sample whose image does not decode.
MAX_SUBSTITUTES = 10

# (record index, (H, W), interp, seed, partner record indices); seed < 0: no augmentation.
Item = tuple[int, tuple[int, int], int, int, tuple[int, ...]]


class ImageDataset(Dataset):
    """Records → samples in the layout's per-sample form (plus ``overflow`` and ``skipped``).

    Training (``stages`` given): ``dataset[(index, hw, interp, seed, partners)]`` runs the
    stage list. Evaluation (``preprocess`` given): ``dataset[(index, hw, ...)]`` runs
    ``Preprocess.__call__``; a sample whose image fails to decode has ``images`` None.
    """

    def __init__(
        self,
        records: list[ImageRecord],
        *,
        max_boxes: int,
        channels_last: bool,
        stages: Optional[tuple] = None,
        preprocess: Optional[Preprocess] = None,
    ) -> None:
        self.records = records
        self.stages = stages
        self.preprocess = preprocess
        self.max_boxes = max_boxes
        self.channels_last = channels_last
        self.train = stages is not None

    def __len__(self) -> int:
        return len(self.records)

    def _load(self, index: int, seed: int, skipped: list) -> tuple[ImageRecord, Optional[np.ndarray]]:
        """The record and its pixels; in training a failing file is replaced by another record."""
        first = index
        for attempt in range(MAX_SUBSTITUTES + 1):
            rec = self.records[index]
            try:
                return rec, _load(rec)
            except augment.ImageDecodeError as e:
                skipped.append((rec.file, str(e), e.reason))
                if not self.train:
                    return rec, None
                # A substitute drawn from this sample's index and seed keeps the run reproducible.
                index = int(np.random.default_rng([first, max(seed, 0), attempt]).integers(len(self.records)))
        raise augment.ImageDecodeError(
            f"{MAX_SUBSTITUTES + 1} images in a row failed to decode ({skipped[0][1]}, ...): "
            "check the image directory"
        )

    def __getitem__(self, item: Item) -> dict[str, Any]:
        index, hw, interp, seed, partners = item
        skipped: list[tuple[str, str, str]] = []
        rec, img = self._load(index, seed, skipped)
        if img is None:
            return {"images": None, "skipped": skipped}
        if self.train:
            out = self._train(rec, img, hw, interp, seed, partners, skipped)
        else:
            out = self._eval(rec, img, hw)
        out.update(image_ids=rec.image_id, orig_sizes=(rec.height, rec.width), skipped=skipped)
        return out

    def _train(self, rec, img, hw, interp, seed, partners, skipped) -> dict[str, Any]:
        rng = np.random.default_rng(seed) if seed >= 0 else None
        prng = augment.plan_rng(seed) if seed >= 0 else None
        others = []
        for j, p in enumerate(partners):
            prec, pimg = self._load(int(p), seed + 1 + j, skipped)
            others.append(augment.Work.of(pimg, prec.boxes, prec.labels))
        r = augment.run_stages(augment.Work.of(img, rec.boxes, rec.labels), self.stages, hw=hw, interp=interp,
                               rng=rng, prng=prng, partners=others)
        t = augment.finalize(r.boxes, r.labels, r.scores, self.max_boxes)
        # scale_factors: of the final resize (a mosaic has no single original image).
        sx, sy = r.scale
        return {
            "images": augment.to_input(r.image, S.normalize_of(self.stages), channels_last=self.channels_last),
            **{k: torch.from_numpy(t[k]) for k in ("gt_boxes", "gt_labels", "gt_mask", "gt_scores")},
            "scale_factors": torch.tensor([sx, sy], dtype=torch.float32),
            "overflow": t["overflow"],
        }

    def _eval(self, rec, img, hw) -> dict[str, Any]:
        x, (sx, sy) = self.preprocess(img, hw)  # float32 [3, H, W]
        if self.channels_last:
            x = x.permute(1, 2, 0).contiguous()
        if self.preprocess.resize == "stretch":
            # Relative, then input px: the same arithmetic as the training stretch.
            rel = rec.boxes / np.array([rec.width, rec.height] * 2, np.float32)
            boxes = rel * np.array([hw[1], hw[0]] * 2, np.float32)
        else:
            boxes = rec.boxes * np.array([sx, sy, sx, sy], np.float32)
        t = augment.finalize(boxes, rec.labels, np.ones(len(rec.labels), np.float32), self.max_boxes)
        return {
            "images": x,
            **{k: torch.from_numpy(t[k]) for k in ("gt_boxes", "gt_labels", "gt_mask", "gt_scores")},
            "scale_factors": torch.tensor([sx, sy], dtype=torch.float32),
            "overflow": t["overflow"],
        }


def _load(rec: ImageRecord) -> np.ndarray:
    img = augment.decode_image(rec.file)
    if img.shape[:2] != (rec.height, rec.width):
        # The boxes are in the annotation's pixel grid; with another size they cannot be trusted.
        raise augment.ImageDecodeError(
            f"{rec.file}: decodes to {img.shape[1]}x{img.shape[0]}, the annotations say {rec.width}x{rec.height}",
            reason="size mismatch",
        )
    return img


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack samples into the layout; an evaluation sample whose image failed to decode is left out."""
    kept = [s for s in samples if s["images"] is not None]
    out: dict[str, Any] = {
        "skipped": [f for s in samples for f in s["skipped"]],
        "dropped": len(samples) - len(kept),
        "overflow": sum(s["overflow"] for s in kept),
    }
    if not kept:
        return out
    for k in BATCH_KEYS:
        v = [s[k] for s in kept]
        out[k] = torch.stack(v) if isinstance(v[0], torch.Tensor) else torch.tensor(v, dtype=BY_NAME[k].dtype)
    return out


class _TrainBatches(Sampler):
    """Batches of items of one epoch of a :class:`TrainSchedule` (its epoch is set by the loader)."""

    def __init__(self, schedule: TrainSchedule, augment_on: bool, partners: int) -> None:
        self.schedule = schedule
        self.augment_on = augment_on
        self.partners = partners
        self.epoch = 0

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    def __iter__(self) -> Iterator[list[Item]]:
        s, e = self.schedule, self.epoch
        for step in range(s.steps_per_epoch):
            plan = s.batch(e, step)
            items = []
            for j, i in enumerate(plan.indices):
                seed = s.sample_seed(e, step, j) if self.augment_on else -1
                partners = tuple(int(p) for p in s.partners(e, step, j, self.partners)) if self.partners else ()
                items.append((int(i), plan.hw, plan.interp, seed, partners))
            yield items


class _EvalBatches(Sampler):
    def __init__(self, schedule: EvalSchedule) -> None:
        self.schedule = schedule

    def __len__(self) -> int:
        return self.schedule.nonempty_steps

    def __iter__(self) -> Iterator[list[Item]]:
        for step in range(self.schedule.nonempty_steps):
            plan = self.schedule.batch(step)
            yield [(int(i), plan.hw, plan.interp, -1, ()) for i in plan.indices]


def _worker_init(_: int) -> None:
    # One intra-op thread per worker: the workers are the parallelism.
    torch.set_num_threads(1)


def worker_death(e: BaseException, num_workers: int) -> LoaderError | None:
    """The :class:`LoaderError` line for torch's words on a DataLoader worker that is gone
    (the kernel's out-of-memory killer on a host short of memory, a crash in a decoder
    library), raised in the iteration or, from torch's SIGCHLD handler, wherever the main
    thread is; None for anything else. An exception raised inside a worker ("Caught ... in
    DataLoader worker process N") is a bug to show as it is."""
    if not isinstance(e, RuntimeError) or not any(w in str(e) for w in ("exited unexpectedly",
                                                                         "is killed by signal")):
        return None
    said = str(e).strip().splitlines()[0].rstrip(". ")
    return LoaderError(f"{said}: a data loader worker died (killed when the host is out of memory); fewer --workers "
                       f"(now {num_workers}) or a smaller --batch-size need less host memory")


class _TorchLoader(Loader):
    """The DataLoader half of both torch loaders: its dataset and batch sampler, built lazily."""

    backend = "torch"

    def __init__(self, data, records: list[ImageRecord], schedule, **kw) -> None:
        self.num_workers = max(int(data.num_workers), 0)
        self._dataset: Optional[ImageDataset] = None
        self._sampler: Optional[Sampler] = None
        super().__init__(data, records, schedule, **kw)

    def _loader(self) -> DataLoader:
        """The running DataLoader (its workers persist from pass to pass until close())."""
        if self._producer is None:
            w = self.num_workers
            self._producer = DataLoader(
                self._dataset,
                batch_sampler=self._sampler,
                num_workers=w,
                collate_fn=collate,
                pin_memory=self.device.type == "cuda",
                worker_init_fn=_worker_init if w else None,
                persistent_workers=w > 0,
                prefetch_factor=2 if w else None,
            )
        return self._producer

    def _raw_batches(self) -> Iterator[dict[str, Any]]:
        """The DataLoader's batches. A worker that dies (the kernel's out-of-memory killer on a
        host short of memory, a crash in a decoder library) is one :class:`LoaderError` line
        naming it and what needs less host memory, not torch's traceback."""
        try:
            yield from self._loader()
        except RuntimeError as e:
            died = worker_death(e, self.num_workers)
            if died is None:
                raise
            raise died from None

    def _to_device(self, raw: dict[str, Any], hw: tuple[int, int]) -> dict[str, torch.Tensor]:
        self._count_skips(raw["skipped"], raw["dropped"])
        if "images" not in raw:  # every image of an evaluation batch failed to decode
            return self._empty(hw)
        nb = self.device.type == "cuda"
        return self._deliver({k: raw[k].to(self.device, non_blocking=nb) for k in BATCH_KEYS}, raw["overflow"])

    def _stop(self, producer: DataLoader) -> None:
        it = getattr(producer, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        producer._iterator = None


class TorchTrainLoader(_TorchLoader, TrainLoader):
    """Training batches of a :class:`TrainSchedule` from a DataLoader, rebuilt when the stage list changes."""

    def _use_stages(self, stages: tuple) -> None:
        self.close()
        augment_on = any(not isinstance(s, (S.Resize, S.Normalize)) for s in stages)
        self._sampler = _TrainBatches(self.schedule, augment_on, S.partners_needed(stages))
        self._dataset = ImageDataset(self.records, max_boxes=self.max_boxes, channels_last=self.channels_last,
                                     stages=stages)

    def _epoch_batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        self._sampler.epoch = epoch
        for step, raw in enumerate(self._raw_batches()):
            yield self._to_device(raw, self.schedule.batch(epoch, step).hw)


class TorchEvalLoader(_TorchLoader, EvalLoader):
    """Evaluation batches of an :class:`EvalSchedule` from a DataLoader running ``Preprocess``."""

    def __init__(self, data, records: list[ImageRecord], schedule: EvalSchedule, **kw) -> None:
        super().__init__(data, records, schedule, **kw)
        self._sampler = _EvalBatches(schedule)
        self._dataset = ImageDataset(records, max_boxes=self.max_boxes, channels_last=self.channels_last,
                                     preprocess=self.preprocess)

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        for step, raw in enumerate(self._raw_batches()):
            yield self._to_device(raw, self.schedule.batch(step).hw)
