"""The reference loader: a ``torch.utils.data.DataLoader`` running the stage list in numpy/torch.

This is the loader a user of a plain PyTorch detection trainer has, and the fallback
where DALI is not installed. Workers decode with PIL and run the stages of
``fastdet.data.stages`` through ``fastdet.data.augment``; the output layout is
``fastdet.data.layout``'s, as the DALI back end's.

Sampling comes from ``fastdet.data.schedule`` (:class:`TrainSchedule` /
:class:`EvalSchedule`): a batch sampler yields, per batch, items ``(record index,
(H, W), interp, seed, partner indices)``, so every sample of a batch is resized to the
batch's canvas in the worker, and each sample's augmentation draws from its own seed:
a run is reproducible whatever the number of workers. The stage list is the
DataLoader's: when ``set_epoch`` brings a different tuple, the DataLoader (and its
workers) is rebuilt; otherwise it lives on.

Evaluation runs ``Preprocess.__call__`` (the family's resize mode, fill and
normalisation) on each image; batches carry ``scale_factors`` for
``fastdet.data.preprocess.boxes_to_original``.

A file that fails to decode is never silent: in training another record (drawn from
the sample's seed) takes its place, in evaluation the image is left out of its batch
(so it is scored as having no detections); either way the loader counts it in
``skipped`` and logs the file once.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fastdet.data import augment
from fastdet.data import stages as S
from fastdet.data.layout import BATCH_KEYS, BY_NAME, empty_batch
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import ImageRecord
from fastdet.data.schedule import EvalSchedule, TrainSchedule

log = logging.getLogger(__name__)

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


class _TorchLoader:
    backend = "torch"

    def __init__(self, data, *, device: torch.device, report: Any = None) -> None:
        self.device = device
        self._report = report  # the dataset's DataReport: undecodable images are counted there too
        self.channels_last = data.channels_last
        self.max_boxes = data.max_boxes
        self.num_workers = max(int(data.num_workers), 0)
        self.skipped: Counter = Counter()  # file -> times it failed to decode
        self.dropped = 0  # evaluation images left out because they failed to decode
        self.boxes_truncated = 0  # boxes beyond max_boxes (the smallest ones)
        self._loader: Optional[DataLoader] = None

    def _make(self, dataset: Dataset, sampler: Sampler) -> None:
        self.close()
        w = self.num_workers
        self._loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=w,
            collate_fn=collate,
            pin_memory=self.device.type == "cuda",
            worker_init_fn=_worker_init if w else None,
            persistent_workers=w > 0,
            prefetch_factor=2 if w else None,
        )

    def _to_device(self, raw: dict[str, Any], hw: tuple[int, int]) -> dict[str, torch.Tensor]:
        for f, why, reason in raw["skipped"]:
            if f not in self.skipped:
                log.warning("%s; %s", why, self._skip_action)
                if self._report is not None:
                    self._report.count(self._report.image_skips, reason, 1, [f])
            self.skipped[f] += 1
        self.dropped += raw["dropped"]
        self.boxes_truncated += raw["overflow"]
        if "images" not in raw:
            return empty_batch(hw, self.max_boxes, channels_last=self.channels_last, device=self.device)
        nb = self.device.type == "cuda"
        batch = {k: raw[k].to(self.device, non_blocking=nb) for k in BATCH_KEYS}
        if self.channels_last:
            batch["images"] = batch["images"].permute(0, 3, 1, 2)  # [B, 3, H, W] with channels-last strides
        return batch

    def close(self) -> None:
        """Stop the worker processes (a later pass starts new ones)."""
        if self._loader is None:
            return
        it = getattr(self._loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self._loader._iterator = None

    def report(self) -> str:
        """One line: what this loader skipped or truncated so far."""
        parts = []
        if self.skipped:
            parts.append(f"{sum(self.skipped.values())} undecodable image reads ({len(self.skipped)} files)")
        if self.dropped:
            parts.append(f"{self.dropped} evaluation images left out")
        if self.boxes_truncated:
            parts.append(f"{self.boxes_truncated} boxes beyond max_boxes={self.max_boxes} dropped")
        return "; ".join(parts) if parts else "nothing skipped"


class TorchTrainLoader(_TorchLoader):
    """Training batches of a :class:`TrainSchedule`; successive passes are successive epochs.

    ``stages_for_epoch(e)`` is asked at every ``set_epoch``; the DataLoader is rebuilt
    only when the tuple differs from the current one.
    """

    _skip_action = "another image takes its place"

    def __init__(
        self,
        data,
        records: list[ImageRecord],
        schedule: TrainSchedule,
        *,
        stages_for_epoch: Callable[[int], tuple],
        device: torch.device,
        report: Any = None,
    ) -> None:
        super().__init__(data, device=device, report=report)
        self.records = records
        self.schedule = schedule
        self.stages_for_epoch = stages_for_epoch
        self.stages: Optional[tuple] = None
        self.chain_changes = 0  # stage lists taken so far (a test counts them)
        self.epoch = 0
        self.set_epoch(0)

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return self.schedule.sizes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        stages = S.check_stages(self.stages_for_epoch(self.epoch))
        if stages == self.stages:
            return
        self.stages = stages
        self.schedule.set_interp(S.resize_of(stages).interp)
        augment_on = any(not isinstance(s, (S.Resize, S.Normalize)) for s in stages)
        self._sampler = _TrainBatches(self.schedule, augment_on, S.partners_needed(stages))
        ds = ImageDataset(self.records, max_boxes=self.max_boxes, channels_last=self.channels_last, stages=stages)
        self._make(ds, self._sampler)
        self.chain_changes += 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.epoch
        self._sampler.epoch = epoch
        for step, raw in enumerate(self._loader):
            yield self._to_device(raw, self.schedule.batch(epoch, step).hw)
        self.set_epoch(epoch + 1)


class TorchEvalLoader(_TorchLoader):
    """Evaluation batches of an :class:`EvalSchedule` (every record once over all ranks)."""

    _skip_action = "left out of the evaluation"

    def __init__(
        self, data, records: list[ImageRecord], schedule: EvalSchedule, *, preprocess: Preprocess,
        device: torch.device, report: Any = None,
    ) -> None:
        super().__init__(data, device=device, report=report)
        self.schedule = schedule
        ds = ImageDataset(records, max_boxes=self.max_boxes, channels_last=self.channels_last, preprocess=preprocess)
        self._make(ds, _EvalBatches(schedule))

    def __len__(self) -> int:
        return self.schedule.steps

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return self.schedule.sizes

    def set_epoch(self, epoch: int) -> None:
        """Evaluation is the same every epoch."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        s = self.schedule
        for step, raw in enumerate(self._loader):
            yield self._to_device(raw, s.batch(step).hw)
        for _ in range(s.steps - s.nonempty_steps):
            yield empty_batch(s.sizes[0], self.max_boxes, channels_last=self.channels_last, device=self.device)
