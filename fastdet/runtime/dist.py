"""torchrun integration: process group, ranks, reductions, per-rank seeding.

Launch with ``torchrun --nproc_per_node N -m fastdet.train ...`` (multi-node: add
``--nnodes/--node_rank/--rdzv_endpoint``). NCCL on GPUs, gloo on the CPU.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # by torchrun (or with RANK/WORLD_SIZE set): a process group is up

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Train through DDP: every torchrun launch, even of one process (a check of the
        multi-GPU path, DDP and its all-reduces, on one GPU)."""
        return self.launched


def resolve_device(name: str) -> torch.device:
    """``run.device``: ``"auto"`` is CUDA when visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible (use --device cpu)")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu, cuda or auto, got {name!r}")
    return torch.device(name)


def memory_figures(e: BaseException) -> str:
    """Torch's out-of-memory message up to the device's free memory ("CUDA out of memory.
    Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.06 GiB is
    free"), without what follows (the process's use, the advice paragraph); the first two
    sentences of another message."""
    text = str(e).strip()
    end = text.find(" is free")
    if end >= 0:
        return text[:end + len(" is free")][:400]
    return ". ".join(text.split(". ")[:2]).rstrip(".")[:300]


def check_device_flags(cfg: Any, device: torch.device) -> None:
    """The flags that need a CUDA device, refused in one line on ``device`` (the resolved
    ``--device``: ``auto`` is only known here, not in ``check_config``). The trainer and
    ``python -m fastdet.compile`` both call this, so they refuse the same command alike."""
    if device.type == "cuda":
        return
    for on, flag in ((cfg.compile.cuda_graphs, "--cuda-graphs"), (cfg.run.sync_debug, "--sync-debug")):
        if on:
            raise ValueError(f"{flag} needs a CUDA device (--device resolves to the CPU here): drop the flag")


def init_distributed(device_type: str, cuda_graphs: bool = False,
                     timeout_minutes: float | None = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment, if present.

    ``cuda_graphs``: NCCL's asynchronous error handling is turned off (unless the
    environment sets it), as the PyTorch CUDA-graph notes require for capturing DDP.
    ``timeout_minutes`` (``--dist-timeout``): how long a collective waits for the other
    ranks before the run fails. It must cover the longest time one rank spends alone:
    rank 0 scoring a COCO evaluation while the others wait in the broadcast of its
    result (NCCL's default, 10 min, does not on a slow host). None: torch's default.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo()
    world_size = int(os.environ["WORLD_SIZE"])
    if cuda_graphs:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if timeout_minutes is not None and timeout_minutes <= 0:
        raise ValueError(f"--dist-timeout must be positive (minutes), got {timeout_minutes:g}")
    timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
    if not dist.is_initialized():
        kw: dict[str, Any] = dict(timeout=timeout, **_restart_store(rank, world_size, timeout))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), **kw)
        else:
            dist.init_process_group("gloo", **kw)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, launched=True)


def _restart_store(rank: int, world_size: int, timeout: timedelta | None) -> dict[str, Any]:
    """After a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0): the rendezvous store
    under a prefix of this attempt, as ``init_process_group`` keywords. torchrun keeps its
    store across restarts, and the process groups of the new workers otherwise read the
    dead workers' addresses from it (gloo: "connectFullMesh failed ... Connection refused",
    seen with torch 2.14 for the default group and for every new_group)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return {}
    from torch.distributed.rendezvous import _create_c10d_store  # private torch API, only after a torchrun restart

    store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size,
                               timeout or timedelta(minutes=30))
    return dict(store=dist.PrefixStore(f"fastdet/attempt_{attempt}", store), rank=rank, world_size=world_size)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean_(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over ranks, in place (a blocking collective, outside compiled code;
    ``fastdet.losses.all_reduce_mean`` is the traceable, out-of-place one); returns ``t``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def mean_dict(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean over ranks of a dict of floats (same keys on every rank): one collective."""
    if not values:
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    all_reduce_mean_(t)
    return dict(zip(values, t.tolist()))


def average_bn_stats(*modules: torch.nn.Module) -> None:
    """Average every BatchNorm's running mean and variance over the ranks, in place, in
    one all-reduce (Megvii YOLOX ``all_reduce_norm``: per-rank BatchNorm, made one model
    before evaluation and checkpoints). A no-op in one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    stats = [b for m in modules for mod in m.modules()
             if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and mod.track_running_stats
             for b in (mod.running_mean, mod.running_var)]
    if not stats:
        return
    flat = torch.cat([s.detach().reshape(-1).double() for s in stats])
    all_reduce_mean_(flat)
    with torch.no_grad():
        for s, v in zip(stats, flat.split([s.numel() for s in stats])):
            s.copy_(v.view_as(s))


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def seed_everything(seed: int, rank: int) -> None:
    """Per-rank seeds: ranks draw different augmentations but runs repeat exactly."""
    s = seed + 1000 * rank
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
