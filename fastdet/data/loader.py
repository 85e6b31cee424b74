"""The one loader interface the trainer consumes.

``build_train_loader(data, dataset, *, stages_for_epoch, rank, world_size, device, seed)``
and ``build_eval_loader(data, dataset, *, preprocess, rank, world_size, device)`` take
the run's ``DataConfig`` (never the whole ``Config``) and return a
``fastdet.data.loader_base`` :class:`TrainLoader` / :class:`EvalLoader`, with
``__iter__`` (batch dicts laid out as ``fastdet.data.layout``, on the training
device), ``__len__`` (batches per pass on this rank), ``set_epoch(epoch)``,
``.backend`` (``"dali"`` or ``"torch"``), ``.sizes`` (every (H, W) its batches can
have: the compile buckets) and ``report()`` (one line: images skipped, boxes
truncated). Images the loader finds undecodable are also counted into
``dataset.report``. Two back ends sit behind it, each supplying only how batches are
produced:

- ``"dali"``: the pipelines in ``fastdet.pipelines`` (decode with nvJPEG on a GPU,
  augmentation and padding inside the DALI graph);
- ``"torch"``: ``fastdet.data.torch_backend``, a ``torch.utils.data.DataLoader`` whose
  workers run the same stages in numpy/torch (the reference and the fallback where
  DALI is not installed).

``data.loader == "auto"`` picks DALI on a CUDA device when it imports, the torch back
end otherwise. The training augmentation is a stage list (``fastdet.data.stages``)
that may change with the epoch: ``set_epoch(e)`` asks ``stages_for_epoch(e)`` and the
loader rebuilds its chain only when the tuple changes. What each batch holds (records,
canvas, interpolation, partner records) is ``fastdet.data.schedule``'s, shared by both
back ends.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from fastdet.data import stages as S
from fastdet.data.loader_base import EvalLoader, TrainLoader
from fastdet.data.preprocess import Preprocess
from fastdet.data.schedule import INTERPS, Canvases, EvalSchedule, LoaderError, TrainSchedule, canvases_for
from fastdet.data.torch_backend import TorchEvalLoader, TorchTrainLoader

BACKENDS = ("auto", "dali", "torch")

StagesForEpoch = Callable[[int], tuple]


def train_sizes(data) -> tuple[int, ...]:
    """The square size buckets of a ``DataConfig``: ``train_sizes``, or ``(img_size,)`` without multiscale."""
    return tuple(data.train_sizes) if data.multiscale else (data.img_size,)


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


def resolve_backend(data, device: torch.device) -> str:
    """``"dali"`` or ``"torch"`` for ``data.loader`` on ``device``."""
    choice = data.loader
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


def _aspects(records) -> np.ndarray:
    return np.array([r.width / r.height for r in records], np.float64)


def build_train_loader(data, dataset: Any, *, stages_for_epoch: StagesForEpoch, rank: int, world_size: int,
                       device: Any, seed: int) -> TrainLoader:
    """The training loader for ``dataset`` (a ``CocoDataset``) on this rank.

    Batches are full (``data.batch_size``); their square size comes from
    ``train_sizes(data)``, a new one every ``data.size_period`` steps, and their (H, W)
    from that size's canvas (keep-ratio: by orientation). The augmentation of epoch
    ``e`` is ``stages_for_epoch(e)``; its Resize mode fixes the canvases and must be the
    same in every phase. Successive passes are successive epochs; ``set_epoch(e)``
    jumps to epoch ``e``.

    ``dataset`` is taken to be loaded with ``check_images=data.check_images``; the DALI
    back end, which cannot skip an undecodable file, runs the COCO layer's cached
    ``"decode"`` check first unless that is the mode (failures are left out and counted
    in ``dataset.report``).
    """
    device = _as_device(device)
    backend = resolve_backend(data, device)
    records, left_out = _records_for(backend, dataset, data)
    first = S.check_stages(stages_for_epoch(0))
    rs = S.resize_of(first)
    schedule = TrainSchedule(
        len(records),
        data.batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        sizes=train_sizes(data),
        random_interp=rs.interp == "random",
        size_period=getattr(data, "size_period", 1),
        canvases=canvases_for(rs.mode, rs.short, rs.max_long),
        aspects=_aspects(records),
    )
    stages_for_epoch = _same_canvases(stages_for_epoch, schedule.canvases)
    train_cls, _ = _loader_classes(backend)
    return train_cls(data, records, schedule, stages_for_epoch=stages_for_epoch, device=device,
                     report=getattr(dataset, "report", None), left_out=left_out)


def _same_canvases(stages_for_epoch: StagesForEpoch, canvases: Canvases) -> StagesForEpoch:
    """``stages_for_epoch``, refusing a phase whose Resize needs other canvases (new compile shapes)."""

    def checked(epoch: int) -> tuple:
        stages = stages_for_epoch(epoch)
        rs = S.resize_of(S.check_stages(stages))
        if canvases_for(rs.mode, rs.short, rs.max_long) != canvases:
            raise LoaderError(f"epoch {epoch}: Resize({rs.mode!r}) needs other canvases than epoch 0's; "
                              "every phase of a recipe keeps one Resize mode")
        return stages

    return checked


def build_eval_loader(data, dataset: Any, *, preprocess: Preprocess, rank: int, world_size: int,
                      device: Any) -> EvalLoader:
    """The evaluation loader: every record of ``dataset`` exactly once over all ranks.

    Images are fed as ``preprocess`` says (the family's resize mode, fill, normalisation
    and interpolation) at ``data.img_size`` (keep-ratio: each image on the canvas of its
    own orientation, a batch holding one orientation); batches carry ``image_ids``, ``orig_sizes`` and ``scale_factors`` to map
    predictions back (``fastdet.data.preprocess.boxes_to_original``). Every rank yields
    ``len(loader)`` batches; the last may be smaller, or empty on a rank with fewer records.
    """
    device = _as_device(device)
    backend = resolve_backend(data, device)
    records, left_out = _records_for(backend, dataset, data)
    schedule = EvalSchedule(
        len(records), data.eval_batch_size, rank=rank, world_size=world_size, size=data.img_size,
        canvases=preprocess.canvases(),
        aspects=_aspects(records), interp=INTERPS.index(preprocess.interp),
    )
    _, eval_cls = _loader_classes(backend)
    return eval_cls(data, records, schedule, preprocess=preprocess, device=device,
                    report=getattr(dataset, "report", None), left_out=left_out)


def _loader_classes(backend: str) -> tuple[type[TrainLoader], type[EvalLoader]]:
    """The back end's (train, eval) loader classes, both with loader_base's constructors."""
    if backend == "dali":
        # nvidia-dali is optional: imported only when the DALI back end is chosen.
        from fastdet.pipelines.adapter import DaliEvalLoader, DaliTrainLoader

        return DaliTrainLoader, DaliEvalLoader
    return TorchTrainLoader, TorchEvalLoader


def _records_for(backend: str, dataset: Any, data) -> tuple[list, int]:
    """The records a back end may read: DALI only gets decode-verified ones (it cannot skip)."""
    if backend == "dali":
        # nvidia-dali is optional: imported only when the DALI back end is chosen.
        from fastdet.pipelines.adapter import verified_records

        return verified_records(dataset, data)
    return list(dataset.records), 0
