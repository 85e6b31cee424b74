"""The one loader interface the trainer consumes, and the sampling both back ends share.

``build_train_loader`` / ``build_eval_loader`` return an object with ``__iter__``
(batch dicts laid out as ``fastdet.data.records.BATCH_KEYS``, on the training
device), ``__len__`` (batches per pass on this rank), ``set_epoch(epoch)``,
``.backend`` (``"dali"`` or ``"torch"``), ``.sizes`` (the image sizes its batches
can have) and ``report()`` (one line: images skipped, boxes truncated). Images the
loader finds undecodable are also counted into ``dataset.report``. Two back ends
sit behind it:

- ``"dali"``: the pipelines in ``fastdet.pipelines`` (decode with nvJPEG on a GPU,
  augmentation and padding inside the DALI graph);
- ``"torch"``: ``fastdet.data.torch_backend``, a ``torch.utils.data.DataLoader`` whose
  workers do the same augmentations in numpy/PIL/torch (the reference and the
  fallback where DALI is not installed).

``cfg.data.loader == "auto"`` picks DALI on a CUDA device when it imports, the torch
back end otherwise.

What a batch holds is decided here, identically for both back ends, so a run is
reproducible from its seed and the two back ends see the same samples:

- :class:`TrainSchedule`: every epoch a fresh permutation of the records drawn from
  ``(seed, epoch)`` (the same on every rank), cut into ``world_size`` disjoint strided
  shards (``perm[rank::world_size]`` of its first ``world_size * (N // world_size)``
  entries, as ``DistributedSampler(drop_last=True)``), then into full batches
  (the remainder of a shard is dropped; the permutation changes every epoch so no
  record is dropped systematically). Each batch gets one image size from
  ``train_sizes`` and one interpolation, drawn from ``(seed, epoch, step)``: the same
  on every rank, so DDP ranks do the same amount of work per step.
- :class:`EvalSchedule`: rank ``r`` takes records ``r, r + W, r + 2W, ...`` in order;
  every rank runs ``ceil(ceil(N / W) / B)`` batches, the last ones smaller or even
  empty on short ranks. Over all ranks every record appears exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from fastdet.config import Config

BACKENDS = ("auto", "dali", "torch")

# Interpolations of the multi-scale resize, drawn per batch when augmenting (PP-YOLOE
# BatchRandomResize random_interp). PaddleDetection draws from cv2 nearest, linear,
# area, cubic and lanczos4; these three exist in both DALI and torch.
INTERPS = ("nearest", "linear", "cubic")
LINEAR = INTERPS.index("linear")
CUBIC = INTERPS.index("cubic")  # evaluation resize (PP-YOLOE eval Resize interp=2)


class LoaderError(RuntimeError):
    """A user-facing loader problem; the message is one line."""


# --------------------------------------------------------------------------- sampling

@dataclass(frozen=True)
class BatchPlan:
    """What one batch holds: record indices, the image size and the interpolation."""

    indices: np.ndarray  # [b] int64 indices into the record list (b <= batch_size)
    size: int  # square network input, px
    interp: int  # index into INTERPS
    epoch: int
    step: int


class TrainSchedule:
    """Per-epoch shuffled, sharded, fixed-size training batches with one size per batch.

    Args:
        num_records: N, the number of training records.
        batch_size: B per rank; every batch is full.
        rank, world_size: this process's shard.
        seed: the run's seed; the permutation of epoch ``e`` is drawn from ``(seed, e)``.
        sizes: the size buckets (``cfg.data.train_sizes``, or ``(img_size,)``).
        random_interp: draw the interpolation per batch; else always linear.
    """

    def __init__(
        self,
        num_records: int,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        sizes: Sequence[int],
        random_interp: bool,
    ) -> None:
        _check_rank(rank, world_size)
        if batch_size < 1:
            raise LoaderError(f"data.batch_size must be >= 1, got {batch_size}")
        if not sizes or any(int(s) < 32 for s in sizes):
            raise LoaderError(f"data.train_sizes must be sizes >= 32 px, got {tuple(sizes)}")
        per_rank = num_records // world_size
        if per_rank < batch_size:
            raise LoaderError(
                f"{num_records} training images cannot fill one batch of {batch_size} on each of "
                f"{world_size} process(es); lower data.batch_size"
            )
        self.num_records = num_records
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.sizes = tuple(int(s) for s in sizes)
        self.random_interp = random_interp
        self.per_rank = per_rank
        self.steps_per_epoch = per_rank // batch_size
        self._cached: tuple[int, np.ndarray] | None = None

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's records for ``epoch`` in batch order: [per_rank] int64."""
        if self._cached is None or self._cached[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_records)
            shard = perm[: self.per_rank * self.world_size][self.rank :: self.world_size]
            self._cached = (epoch, shard.astype(np.int64))
        return self._cached[1]

    def size_and_interp(self, epoch: int, step: int) -> tuple[int, int]:
        rng = np.random.default_rng([self.seed, epoch, step, 0x51AE])
        size = self.sizes[int(rng.integers(len(self.sizes)))]
        interp = int(rng.integers(len(INTERPS))) if self.random_interp else LINEAR
        return size, interp

    def batch(self, epoch: int, step: int) -> BatchPlan:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside 0..{self.steps_per_epoch - 1}")
        b = self.batch_size
        size, interp = self.size_and_interp(epoch, step)
        return BatchPlan(self.shard(epoch)[step * b : (step + 1) * b], size, interp, epoch, step)

    def sample_seed(self, epoch: int, step: int, slot: int) -> int:
        """A seed for the augmentation of one sample (torch back end), per rank."""
        return int(np.random.SeedSequence([self.seed, epoch, step, slot, self.rank]).generate_state(1)[0])


class EvalSchedule:
    """Strided shards, in order; every rank runs the same number of batches."""

    def __init__(self, num_records: int, batch_size: int, *, rank: int, world_size: int, size: int) -> None:
        _check_rank(rank, world_size)
        if batch_size < 1:
            raise LoaderError(f"data.eval_batch_size must be >= 1, got {batch_size}")
        self.num_records = num_records
        self.batch_size = batch_size
        self.size = int(size)
        self.indices = np.arange(rank, num_records, world_size, dtype=np.int64)
        longest = math.ceil(num_records / world_size)
        self.steps = math.ceil(longest / batch_size)
        # Batches of this rank that hold at least one record (the rest are empty).
        self.nonempty_steps = math.ceil(len(self.indices) / batch_size)

    def batch(self, step: int) -> BatchPlan:
        b = self.batch_size
        return BatchPlan(self.indices[step * b : (step + 1) * b], self.size, CUBIC, 0, step)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise LoaderError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")


def train_sizes(cfg: Config) -> tuple[int, ...]:
    d = cfg.data
    return tuple(d.train_sizes) if d.multiscale else (d.img_size,)


def empty_batch(size: int, max_boxes: int, *, channels_last: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """A batch with no images, for a short rank's last evaluation steps."""
    images = torch.empty((0, 3, size, size), dtype=torch.float32, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return {
        "images": images,
        "gt_boxes": torch.empty((0, max_boxes, 4), dtype=torch.float32, device=device),
        "gt_labels": torch.empty((0, max_boxes), dtype=torch.int64, device=device),
        "gt_mask": torch.empty((0, max_boxes), dtype=torch.bool, device=device),
        "image_ids": torch.empty((0,), dtype=torch.int64, device=device),
        "orig_sizes": torch.empty((0, 2), dtype=torch.int64, device=device),
    }


# --------------------------------------------------------------------------- back-end choice

def dali_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the DALI back end cannot run here, or None when it can."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        return f"nvidia-dali is not installed ({e.msg}); install nvidia-dali-cuda130 or use --loader torch"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available to DALI"
    return None


def resolve_backend(cfg: Config, device: torch.device) -> str:
    """``"dali"`` or ``"torch"`` for ``cfg.data.loader`` on ``device``."""
    choice = cfg.data.loader
    if choice not in BACKENDS:
        raise LoaderError(f"data.loader must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "torch":
        return "torch"
    reason = dali_unavailable_reason(device)
    if choice == "dali":
        if reason is not None:
            raise LoaderError(f"--loader dali: {reason}")
        return "dali"
    return "dali" if device.type == "cuda" and reason is None else "torch"


def _as_device(device: Any) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def build_train_loader(cfg: Config, dataset: Any, *, rank: int, world_size: int, device: Any, seed: int):
    """The training loader for ``dataset`` (a ``CocoDataset``) on this rank.

    Batches are full (``cfg.data.batch_size``), their image size comes from
    ``cfg.data.train_sizes`` (one per batch; ``img_size`` when multiscale is off) and
    the augmentation is PP-YOLOE's when ``cfg.data.augment``. Successive passes are
    successive epochs; ``set_epoch(e)`` jumps to epoch ``e``.

    ``dataset`` is taken to be loaded with ``check_images=cfg.data.check_images``; the
    DALI back end, which cannot skip an undecodable file, runs the COCO layer's cached
    ``"decode"`` check first unless that is the mode (failures are left out and counted
    in ``dataset.report``).
    """
    device = _as_device(device)
    backend = resolve_backend(cfg, device)
    records, left_out = _records_for(backend, dataset, cfg)
    schedule = TrainSchedule(
        len(records),
        cfg.data.batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        sizes=train_sizes(cfg),
        random_interp=cfg.data.augment,
    )
    if backend == "dali":
        from fastdet.pipelines.adapter import DaliTrainLoader

        loader = DaliTrainLoader(cfg, records, schedule, device=device, seed=seed, rank=rank)
        loader.left_out = left_out
        return loader
    from fastdet.data.torch_backend import TorchTrainLoader

    return TorchTrainLoader(cfg, records, schedule, device=device, report=getattr(dataset, "report", None))


def build_eval_loader(cfg: Config, dataset: Any, *, rank: int, world_size: int, device: Any):
    """The evaluation loader: every record of ``dataset`` exactly once over all ranks.

    Images are resized to ``cfg.data.img_size`` square (bicubic, no kept ratio) and
    normalised; ``image_ids`` and ``orig_sizes`` map predictions back to the original
    images. Every rank yields ``len(loader)`` batches; the last may be smaller, or
    empty on a rank with fewer records.
    """
    device = _as_device(device)
    backend = resolve_backend(cfg, device)
    records, left_out = _records_for(backend, dataset, cfg)
    schedule = EvalSchedule(
        len(records), cfg.data.eval_batch_size, rank=rank, world_size=world_size, size=cfg.data.img_size
    )
    if backend == "dali":
        from fastdet.pipelines.adapter import DaliEvalLoader

        loader = DaliEvalLoader(cfg, records, schedule, device=device)
        loader.left_out = left_out
        return loader
    from fastdet.data.torch_backend import TorchEvalLoader

    return TorchEvalLoader(cfg, records, schedule, device=device, report=getattr(dataset, "report", None))


def _records_for(backend: str, dataset: Any, cfg: Config) -> tuple[list, int]:
    """The records a back end may read: DALI only gets decode-verified ones (it cannot skip)."""
    if backend == "dali":
        from fastdet.pipelines.adapter import verified_records

        return verified_records(dataset, cfg)
    return list(dataset.records), 0
