"""The reference loader: a ``torch.utils.data.DataLoader`` doing PP-YOLOE's augmentation.

This is the loader a user of a plain PyTorch detection trainer has, and the fallback
where DALI is not installed. Workers decode with PIL and run ``fastdet.data.augment``;
the output layout is the DALI back end's (``fastdet.data.records.BATCH_KEYS``).

Sampling comes from ``fastdet.data.loader`` (:class:`TrainSchedule` /
:class:`EvalSchedule`): a batch sampler yields, per batch, items ``(record index,
size, interp, seed)``, so every sample of a batch is resized to the batch's size in
the worker, and each sample's augmentation draws from its own seed: a run is
reproducible whatever the number of workers.

A file that fails to decode is never silent: in training another record (drawn from
the sample's seed) takes its place, in evaluation the image is left out of its batch
(so it is scored as having no detections); either way the loader counts it in
``skipped`` and logs the file once.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fastdet.config import Config
from fastdet.data import augment
from fastdet.data.loader import EvalSchedule, TrainSchedule, empty_batch
from fastdet.data.records import BATCH_KEYS, ImageRecord

log = logging.getLogger(__name__)

# Training: substitutes tried for a sample whose image does not decode.
MAX_SUBSTITUTES = 10

Item = tuple[int, int, int, int]  # (record index, size, interp, seed); seed < 0: no augmentation


class DetectionDataset(Dataset):
    """Records → augmented, resized, normalised and padded samples.

    ``dataset[(index, size, interp, seed)]`` returns a dict with ``image`` float32
    [3, S, S] (or [S, S, 3] when ``channels_last``), ``boxes`` [M, 4], ``labels`` [M],
    ``mask`` [M], ``image_id``, ``orig_size`` (h, w), ``overflow`` (boxes over M) and
    ``skipped`` ((file, message, reason) of the images that failed to decode); an
    evaluation sample whose image fails to decode has ``image`` None.
    """

    def __init__(
        self,
        records: list[ImageRecord],
        *,
        max_boxes: int,
        channels_last: bool,
        train: bool,
        spec: augment.AugmentSpec = augment.PPYOLOE,
    ) -> None:
        self.records = records
        self.spec = spec
        self.max_boxes = max_boxes
        self.channels_last = channels_last
        self.train = train

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, item: Item) -> dict[str, Any]:
        index, size, interp, seed = item
        first = index
        skipped: list[tuple[str, str, str]] = []
        rng = np.random.default_rng(seed) if seed >= 0 else None
        for attempt in range(MAX_SUBSTITUTES + 1):
            rec = self.records[index]
            try:
                img = _load(rec)
            except augment.ImageDecodeError as e:
                skipped.append((rec.file, str(e), e.reason))
                if not self.train:
                    return {"image": None, "skipped": skipped}
                # A substitute drawn from this sample's index and seed keeps the run reproducible.
                index = int(np.random.default_rng([first, max(seed, 0), attempt]).integers(len(self.records)))
                continue
            s = augment.transform(img, rec.boxes, rec.labels, size=size, interp=interp, rng=rng, spec=self.spec)
            boxes, labels, mask, overflow = augment.finalize_targets(s.boxes, s.labels, self.max_boxes)
            return {
                "image": augment.normalize(s.image, channels_last=self.channels_last),
                "boxes": torch.from_numpy(boxes),
                "labels": torch.from_numpy(labels),
                "mask": torch.from_numpy(mask),
                "image_id": rec.image_id,
                "orig_size": (rec.height, rec.width),
                "overflow": overflow,
                "skipped": skipped,
            }
        raise augment.ImageDecodeError(
            f"{MAX_SUBSTITUTES + 1} images in a row failed to decode ({skipped[0][1]}, ...): "
            "check the image directory"
        )


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
    """Stack samples; an evaluation sample whose image failed to decode is left out."""
    kept = [s for s in samples if s["image"] is not None]
    out: dict[str, Any] = {
        "skipped": [f for s in samples for f in s["skipped"]],
        "dropped": len(samples) - len(kept),
        "overflow": sum(s["overflow"] for s in kept),
    }
    if not kept:
        return out
    out.update(
        images=torch.stack([s["image"] for s in kept]),
        gt_boxes=torch.stack([s["boxes"] for s in kept]),
        gt_labels=torch.stack([s["labels"] for s in kept]),
        gt_mask=torch.stack([s["mask"] for s in kept]),
        image_ids=torch.tensor([s["image_id"] for s in kept], dtype=torch.int64),
        orig_sizes=torch.tensor([s["orig_size"] for s in kept], dtype=torch.int64),
    )
    return out


class _TrainBatches(Sampler):
    """Batches of items of one epoch of a :class:`TrainSchedule` (its epoch is set by the loader)."""

    def __init__(self, schedule: TrainSchedule, augment_on: bool) -> None:
        self.schedule = schedule
        self.augment_on = augment_on
        self.epoch = 0

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    def __iter__(self) -> Iterator[list[Item]]:
        s, e = self.schedule, self.epoch
        for step in range(s.steps_per_epoch):
            plan = s.batch(e, step)
            yield [
                (int(i), plan.size, plan.interp, s.sample_seed(e, step, j) if self.augment_on else -1)
                for j, i in enumerate(plan.indices)
            ]


class _EvalBatches(Sampler):
    def __init__(self, schedule: EvalSchedule) -> None:
        self.schedule = schedule

    def __len__(self) -> int:
        return self.schedule.nonempty_steps

    def __iter__(self) -> Iterator[list[Item]]:
        for step in range(self.schedule.nonempty_steps):
            plan = self.schedule.batch(step)
            yield [(int(i), plan.size, plan.interp, -1) for i in plan.indices]


def _worker_init(_: int) -> None:
    # One intra-op thread per worker: the workers are the parallelism.
    torch.set_num_threads(1)


class _TorchLoader:
    backend = "torch"

    def __init__(
        self,
        cfg: Config,
        records: list[ImageRecord],
        sampler: Sampler,
        *,
        device: torch.device,
        train: bool,
        spec: augment.AugmentSpec = augment.PPYOLOE,
        report: Any = None,
    ) -> None:
        d = cfg.data
        self.device = device
        self._report = report  # the dataset's DataReport: undecodable images are counted there too
        self.channels_last = d.channels_last
        self.max_boxes = d.max_boxes
        self.skipped: Counter = Counter()  # file -> times it failed to decode
        self.dropped = 0  # evaluation images left out because they failed to decode
        self.boxes_truncated = 0  # boxes beyond max_boxes (the smallest ones)
        self._sampler = sampler
        workers = max(int(d.num_workers), 0)
        self._loader = DataLoader(
            DetectionDataset(records, max_boxes=d.max_boxes, channels_last=d.channels_last, train=train, spec=spec),
            batch_sampler=sampler,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=device.type == "cuda",
            worker_init_fn=_worker_init if workers else None,
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers else None,
        )

    def _to_device(self, raw: dict[str, Any], size: int) -> dict[str, torch.Tensor]:
        for f, why, reason in raw["skipped"]:
            if f not in self.skipped:
                log.warning("%s; %s", why, self._skip_action)
                if self._report is not None:
                    self._report.count(self._report.image_skips, reason, 1, [f])
            self.skipped[f] += 1
        self.dropped += raw["dropped"]
        self.boxes_truncated += raw["overflow"]
        if "images" not in raw:
            return empty_batch(size, self.max_boxes, channels_last=self.channels_last, device=self.device)
        nb = self.device.type == "cuda"
        batch = {k: raw[k].to(self.device, non_blocking=nb) for k in BATCH_KEYS}
        if self.channels_last:
            batch["images"] = batch["images"].permute(0, 3, 1, 2)  # [B, 3, H, W] with channels-last strides
        return batch

    def close(self) -> None:
        """Stop the worker processes (a later pass starts new ones)."""
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
    """Training batches of a :class:`TrainSchedule`; successive passes are successive epochs."""

    _skip_action = "another image takes its place"

    def __init__(
        self,
        cfg: Config,
        records: list[ImageRecord],
        schedule: TrainSchedule,
        *,
        device: torch.device,
        spec: Optional[augment.AugmentSpec] = None,
        report: Any = None,
    ) -> None:
        # spec: the augmentation (default: the one cfg.data describes; None when it is off).
        spec = spec if spec is not None else augment.spec_from_config(cfg.data)
        sampler = _TrainBatches(schedule, spec is not None)
        super().__init__(
            cfg, records, sampler, device=device, train=True, spec=spec or augment.PPYOLOE, report=report
        )
        self.schedule = schedule
        self.epoch = 0

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.schedule.sizes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.epoch
        self._sampler.epoch = epoch
        for step, raw in enumerate(self._loader):
            yield self._to_device(raw, self.schedule.size_and_interp(epoch, step)[0])
        self.epoch = epoch + 1


class TorchEvalLoader(_TorchLoader):
    """Evaluation batches of an :class:`EvalSchedule` (every record once over all ranks)."""

    _skip_action = "left out of the evaluation"

    def __init__(
        self, cfg: Config, records: list[ImageRecord], schedule: EvalSchedule, *, device: torch.device, report: Any = None
    ) -> None:
        super().__init__(cfg, records, _EvalBatches(schedule), device=device, train=False, report=report)
        self.schedule = schedule

    def __len__(self) -> int:
        return self.schedule.steps

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.schedule.size,)

    def set_epoch(self, epoch: int) -> None:
        """Evaluation is the same every epoch."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        s = self.schedule
        for raw in self._loader:
            yield self._to_device(raw, s.size)
        for _ in range(s.steps - s.nonempty_steps):
            yield empty_batch(s.size, self.max_boxes, channels_last=self.channels_last, device=self.device)
