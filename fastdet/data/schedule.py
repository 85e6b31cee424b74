"""What each batch holds, decided once for both loader back ends.

Both back ends (``fastdet.data.torch_backend`` and ``fastdet.pipelines``) and the
loader interface (``fastdet.data.loader``) sit on top of this module; it imports
nothing of theirs. Everything here depends only on (seed, epoch, step[, slot]), so a
run is reproducible from its seed, resume is exact, and the two back ends see the
same samples:

- :class:`TrainSchedule`: every epoch a fresh permutation of the records drawn from
  ``(seed, epoch)`` (the same on every rank), cut into ``world_size`` disjoint strided
  shards (``perm[rank::world_size]`` of its first ``world_size * (N // world_size)``
  entries, as ``DistributedSampler(drop_last=True)``), then into full batches (the
  remainder of a shard is dropped; the permutation changes every epoch so no record
  is dropped systematically). Each batch gets one square size drawn from
  ``(seed, epoch, step // size_period)`` (YOLOX: a new size every 10 iterations;
  PP-YOLOE: every batch) and one interpolation; the same on every rank, so DDP ranks
  do the same work per step. The batch's (H, W) canvas is that size's bucket
  (:class:`Canvases`). Records a sample draws besides its own (mosaic, mixup) come
  from :meth:`TrainSchedule.partners`, keyed by (seed, epoch, step, slot, rank).
- :class:`EvalSchedule`: rank ``r`` takes records ``r, r + W, r + 2W, ...``, grouped by
  the canvas each one's aspect gives it on its own (:meth:`Canvases.own`; one group for a
  square family), in file order within a group, each group cut into batches of ``B``
  (the last of a group smaller), so every image is evaluated on its own orientation's
  canvas, as ``fastdet.detect`` feeds it. Every rank runs the same number of batches,
  the most any rank needs (one canvas: ``ceil(ceil(N / W) / B)``), a shorter rank's last
  ones empty. Over all ranks every record appears exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

# Interpolations of the resize, drawn per batch when the Resize stage says "random"
# (PP-YOLOE BatchRandomResize random_interp). PaddleDetection draws from cv2 nearest,
# linear, area, cubic and lanczos4; these three exist in both DALI and torch.
INTERPS = ("nearest", "linear", "cubic")
LINEAR = INTERPS.index("linear")
CUBIC = INTERPS.index("cubic")  # evaluation resize (PP-YOLOE eval Resize interp=2)

HW = tuple[int, int]


class LoaderError(RuntimeError):
    """A user-facing loader problem; the message is one line."""


SQUARE_BAND = 1.1  # aspect w / h above it: landscape, below its inverse: portrait, else square


def _ceil32(x: float) -> int:
    return int(math.ceil(x / 32.0) * 32)


@dataclass(frozen=True)
class Canvases:
    """The (H, W) buckets of a square size ``S``.

    ``long_ratio == 1``: one square canvas (stretch and letterbox). Otherwise
    (keep-ratio) three: landscape ``(S, L)``, portrait ``(L, S)`` and square ``(S, S)``
    with ``L = ceil32(S * long_ratio)`` (FCOS: ``long_ratio = 1333 / 800``), so every
    image fits at the recipe's scale in the canvas of its orientation. A batch takes
    the canvas of its records' most common orientation (aspect w/h above 1.1:
    landscape, below 1/1.1: portrait, else square); in a training batch an image of the
    other orientation is scaled down to fit and padded, the price of a bounded set of
    compiled shapes. Evaluation batches hold one orientation (:meth:`own`), so there
    every image gets the canvas of its own.
    """

    long_ratio: float = 1.0

    def buckets(self, size: int) -> tuple[HW, ...]:
        s = int(size)
        if self.long_ratio <= 1.0:
            return ((s, s),)
        L = _ceil32(s * self.long_ratio)
        return ((s, L), (L, s), (s, s))

    def own(self, aspects: np.ndarray) -> np.ndarray:
        """[n] int64: each record's own bucket (an index into :meth:`buckets`) from its
        ``aspects`` (w / h) [n]: what :meth:`pick` gives a batch of that record alone."""
        a = np.asarray(aspects, np.float64)
        if self.long_ratio <= 1.0:
            return np.zeros(len(a), np.int64)
        # ORIENTATIONS order: 0 landscape, 1 portrait, 2 square.
        return np.where(a > SQUARE_BAND, 0, np.where(a < 1 / SQUARE_BAND, 1, 2)).astype(np.int64)

    def pick(self, size: int, aspects: np.ndarray) -> HW:
        """The canvas for a batch whose records have ``aspects`` (w / h) [b]."""
        b = self.buckets(size)
        if len(b) == 1 or len(aspects) == 0:
            return b[0]
        votes = np.bincount(self.own(aspects), minlength=len(b))
        return b[int(np.argmax(votes))]  # ties: landscape, then portrait

    def named(self, size: int) -> dict[str, HW]:
        """``{orientation: (H, W)}`` of :meth:`buckets`: ``landscape``, ``portrait`` and
        ``square`` (keep-ratio), or the one ``square``."""
        b = self.buckets(size)
        return {"square": b[0]} if len(b) == 1 else dict(zip(ORIENTATIONS, b))


ORIENTATIONS = ("landscape", "portrait", "square")  # the order of Canvases.buckets
# Which images each keep-ratio canvas is made for (Canvases.pick's vote), in words.
ORIENTATION_OF = {"landscape": f"w / h > {SQUARE_BAND}", "portrait": f"w / h < 1 / {SQUARE_BAND}",
                  "square": f"1 / {SQUARE_BAND} <= w / h <= {SQUARE_BAND}"}


def canvases_for(resize_mode: str, short: int, max_long: int) -> Canvases:
    """Keep-ratio gets landscape, portrait and square canvases; the other modes one square.

    The one rule for both the training Resize stage and a family's evaluation
    ``Preprocess`` (and so for ``fastdet.detect``, ``fastdet.predict`` and the export)."""
    return Canvases(max_long / short) if resize_mode == "keep_ratio" else Canvases()


@dataclass(frozen=True)
class BatchPlan:
    """What one batch holds: record indices, the (H, W) canvas and the interpolation."""

    indices: np.ndarray  # [b] int64 indices into the record list (b <= batch_size)
    hw: HW  # network input (height, width), px
    interp: int  # index into INTERPS
    epoch: int
    step: int


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise LoaderError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")


class TrainSchedule:
    """Per-epoch shuffled, sharded, fixed-size training batches with one canvas per batch.

    Args:
        num_records: N, the number of training records.
        batch_size: B per rank; every batch is full.
        rank, world_size: this process's shard.
        seed: the run's seed; the permutation of epoch ``e`` is drawn from ``(seed, e)``.
        sizes: the square size buckets (``DataConfig.train_sizes``, or ``(img_size,)``).
        random_interp: draw the interpolation per batch; else ``interp`` always.
        interp: index into ``INTERPS`` when not random.
        size_period: a new size every this many steps (1: every batch).
        canvases: the (H, W) buckets of a size (keep-ratio: three orientations).
        aspects: [N] w / h of the records (needed when ``canvases`` has several buckets).
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
        interp: int = LINEAR,
        size_period: int = 1,
        canvases: Canvases = Canvases(),
        aspects: Optional[np.ndarray] = None,
    ) -> None:
        _check_rank(rank, world_size)
        if batch_size < 1:
            raise LoaderError(f"data.batch_size must be >= 1, got {batch_size}")
        if not sizes or any(int(s) < 32 for s in sizes):
            raise LoaderError(f"data.train_sizes must be sizes >= 32 px, got {tuple(sizes)}")
        if size_period < 1:
            raise LoaderError(f"data.size_period must be >= 1, got {size_period}")
        per_rank = num_records // world_size
        if per_rank < batch_size:
            raise LoaderError(
                f"{num_records} training images cannot fill one batch of {batch_size} on each of "
                f"{world_size} process(es); lower --batch-size"
            )
        self.num_records = num_records
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.square_sizes = tuple(int(s) for s in sizes)
        self.random_interp = random_interp
        self.interp = int(interp)
        self.size_period = int(size_period)
        self.canvases = canvases
        self.aspects = np.ones(num_records) if aspects is None else np.asarray(aspects, np.float64)
        self.per_rank = per_rank
        self.steps_per_epoch = per_rank // batch_size
        self._cached: tuple[int, np.ndarray] | None = None

    def set_interp(self, name: str) -> None:
        """Follow a Resize stage's ``interp``: ``"random"`` draws one per batch, else that one."""
        self.random_interp = name == "random"
        if not self.random_interp:
            self.interp = INTERPS.index(name)

    @property
    def sizes(self) -> tuple[HW, ...]:
        """Every (H, W) a batch can have: the compile buckets."""
        return tuple(dict.fromkeys(hw for s in self.square_sizes for hw in self.canvases.buckets(s)))

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's records for ``epoch`` in batch order: [per_rank] int64."""
        if self._cached is None or self._cached[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_records)
            shard = perm[: self.per_rank * self.world_size][self.rank :: self.world_size]
            self._cached = (epoch, shard.astype(np.int64))
        return self._cached[1]

    def size_and_interp(self, epoch: int, step: int) -> tuple[int, int]:
        """The square size and interpolation of a batch; the size changes every ``size_period`` steps."""
        rng = np.random.default_rng([self.seed, epoch, step // self.size_period, 0x51AE])
        size = self.square_sizes[int(rng.integers(len(self.square_sizes)))]
        if self.random_interp:
            # Per step, also inside a size period (the draw after the size, as with period 1).
            if self.size_period > 1:
                rng = np.random.default_rng([self.seed, epoch, step, 0x1A7E])
            return size, int(rng.integers(len(INTERPS)))
        return size, self.interp

    def batch(self, epoch: int, step: int) -> BatchPlan:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside 0..{self.steps_per_epoch - 1}")
        b = self.batch_size
        size, interp = self.size_and_interp(epoch, step)
        idx = self.shard(epoch)[step * b : (step + 1) * b]
        return BatchPlan(idx, self.canvases.pick(size, self.aspects[idx]), interp, epoch, step)

    def sample_seed(self, epoch: int, step: int, slot: int) -> int:
        """A seed for the augmentation of one sample, per rank."""
        return int(np.random.SeedSequence([self.seed, epoch, step, slot, self.rank]).generate_state(1)[0])

    def partners(self, epoch: int, step: int, slot: int, k: int) -> np.ndarray:
        """[k] int64 records sample ``slot`` of a batch draws besides its own (mosaic: 3, mixup: 1).

        Uniform over all records, as YOLOX's ``random.randint(0, len(dataset) - 1)``
        and PaddleDetection's mixup partner; keyed by (seed, epoch, step, slot, rank)
        like :meth:`sample_seed`, so resume and DDP sharding stay exact.
        """
        rng = np.random.default_rng([self.seed, epoch, step, slot, self.rank, 0x9A27])
        return rng.integers(self.num_records, size=k).astype(np.int64)


class EvalSchedule:
    """Strided shards grouped by canvas; every rank runs the same number of batches.

    Rank ``r``'s records ``r, r + W, ...`` are grouped by their own canvas
    (:meth:`Canvases.own`, in :meth:`Canvases.buckets` order; file order within a group)
    and each group is cut into batches of ``batch_size``, so a batch never mixes
    orientations and every image is evaluated on the canvas ``Preprocess.canvas`` gives
    it. ``nonempty_steps``: this rank's batches; ``steps``: the most any rank has (the
    aspects of every record are known on every rank), the rest of this rank's empty.

    Attributes:
        indices: [n] int64 this rank's records in batch order.
    """

    def __init__(self, num_records: int, batch_size: int, *, rank: int, world_size: int, size: int,
                 canvases: Canvases = Canvases(), aspects: Optional[np.ndarray] = None,
                 interp: int = CUBIC) -> None:
        _check_rank(rank, world_size)
        if batch_size < 1:
            raise LoaderError(f"data.eval_batch_size must be >= 1, got {batch_size}")
        self.num_records = num_records
        self.batch_size = batch_size
        self.size = int(size)
        self.interp = int(interp)
        self.canvases = canvases
        self.aspects = np.ones(num_records) if aspects is None else np.asarray(aspects, np.float64)
        if len(self.aspects) != num_records:
            raise LoaderError(f"EvalSchedule: {len(self.aspects)} aspects for {num_records} records")
        buckets = canvases.buckets(self.size)
        own = canvases.own(self.aspects)  # [N] bucket of each record
        shard = np.arange(rank, num_records, world_size, dtype=np.int64)
        shard = shard[np.argsort(own[shard], kind="stable")]  # grouped by bucket, file order within
        self.indices = shard
        self._plans: list[tuple[np.ndarray, HW]] = []
        for k, hw in enumerate(buckets):
            group = shard[own[shard] == k]
            self._plans += [(group[i : i + batch_size], hw) for i in range(0, len(group), batch_size)]
        # Batches of this rank that hold records (the rest of ``steps`` are empty).
        self.nonempty_steps = len(self._plans)
        self.steps = max(
            (int(np.ceil(np.bincount(own[q::world_size], minlength=len(buckets)) / batch_size).sum())
             for q in range(world_size)),
            default=0,
        )

    @property
    def sizes(self) -> tuple[HW, ...]:
        return self.canvases.buckets(self.size)

    def batch(self, step: int) -> BatchPlan:
        """Batch ``step``: its records, all of one canvas; from ``nonempty_steps`` on, empty."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} outside 0..{self.steps - 1}")
        idx, hw = self._plans[step] if step < self.nonempty_steps else (self.indices[:0], self.sizes[0])
        return BatchPlan(idx, hw, self.interp, 0, step)
