"""Runs that survive faults: stopping on signals, time-sized checkpoints, automatic resume.

- :class:`StopControl`: SIGTERM (what a cluster scheduler sends on preemption) and SIGINT
  (Ctrl-C) on *any* rank set a flag; every rank learns of it at a step boundary through
  one small asynchronous all-reduce (MAX) on a gloo group of its own (CPU tensors: no
  GPU sync, no interference with NCCL), waited one step after it is launched, so all
  ranks stop after the same step. The same reduction carries rank 0's "a time-sized
  checkpoint is due" (``run.ckpt_interval_minutes``), so every rank agrees on when to
  checkpoint too. A second SIGINT raises ``KeyboardInterrupt`` at once.
- :class:`Preempted`: raised by the trainer once ``latest.pth`` is written; ``fastdet.train``
  prints the command that resumes and exits with :data:`EXIT_PREEMPTED`.
- :func:`restart_count` / :func:`config_mismatch`: the trainer resumes by itself under
  torchrun restarts (``TORCHELASTIC_RESTART_COUNT`` > 0) or ``--resume auto`` when the
  run directory holds a checkpoint of the same config.

The trainer holds one :class:`StopControl` (``Trainer.control``): installed before the first
step, polled after every step, finished and uninstalled at the end. The tests inject faults
at an exact step through the trainer's hooks (``tests/fault_launch.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from fastdet.runtime.dist import memory_figures
from fastdet.runtime.logging import epoch_of_step

log = logging.getLogger("fastdet")

# sysexits.h EX_TEMPFAIL: "a temporary failure ... the user is invited to retry".
EXIT_PREEMPTED = 75


# What needs less device memory, said with an out-of-memory stop.
TRAIN_MEMORY = ("a smaller --batch-size (images per process), smaller train sizes (--img-size, data.train_sizes) "
                "or --amp bf16 need less")
EVAL_MEMORY = "a smaller data.eval_batch_size (--set data.eval_batch_size=N) needs less"


class DeviceOutOfMemory(RuntimeError):
    """The device ran out of memory: one line of what ran, torch's figures, the last
    checkpoint and what needs less. Said by the rank it happened on (another rank may have
    room: unlike the errors every rank meets alike)."""


@contextlib.contextmanager
def out_of_memory_said(what: Callable[[], str], advice: str, latest: Path) -> Iterator[None]:
    """Turn ``torch.OutOfMemoryError`` inside into :class:`DeviceOutOfMemory`: ``what()``
    (computed only then) names the work, torch's message gives its first two sentences
    (the allocation asked for and the device's capacity), then the last checkpoint and
    ``advice``."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        kept = f"the last checkpoint is {latest}" if latest.exists() else "no checkpoint was written before it"
        raise DeviceOutOfMemory(f"out of device memory {what()} ({memory_figures(e)}): training stopped; {kept}; "
                                f"{advice}") from None


class MemoryGuard:
    """The trainer's out-of-device-memory lines at its three points (the warm-up, a step, an
    evaluation): each a context manager of :func:`out_of_memory_said` naming that work and
    ``latest`` (the checkpoint to go back to)."""

    def __init__(self, latest: Path) -> None:
        self.latest = latest

    def warmup(self) -> contextlib.AbstractContextManager:
        return out_of_memory_said(lambda: "at the warm-up (compiling the step's graphs)", TRAIN_MEMORY, self.latest)

    def step(self, step: int, batch: dict[str, Any], loss_kwargs: Any) -> contextlib.AbstractContextManager:
        return out_of_memory_said(lambda: f"in training step {step} (images {list(batch['images'].shape)}, loss "
                                          f"{loss_kwargs})", TRAIN_MEMORY, self.latest)

    def evaluation(self, step: int) -> contextlib.AbstractContextManager:
        return out_of_memory_said(lambda: f"evaluating step {step}", EVAL_MEMORY, self.latest)


class Preempted(Exception):
    """Training stopped on a signal at a step boundary, with ``latest.pth`` written."""

    def __init__(self, signame: str, step: int, checkpoint: str, command: str):
        self.signame, self.step, self.checkpoint, self.command = signame, step, checkpoint, command
        super().__init__(f"stopped by {signame} after step {step}; saved {checkpoint}. "
                         f"Resume with: {command}")


def restart_count() -> int:
    """How many times torchrun has restarted this run's workers (0 when not under torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def resume_command(argv: list[str] | None = None) -> str:
    """The command line that continues this run: the same arguments with ``--resume``
    (under torchrun: the same launcher settings as this node's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--resume" not in args:
        args.append("--resume")
    if "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        launch = ["torchrun", "--nproc_per_node", os.environ["LOCAL_WORLD_SIZE"]]
        nnodes = int(os.environ["WORLD_SIZE"]) // max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
        if nnodes > 1:
            launch += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       f"{os.environ.get('MASTER_ADDR', 'HOST')}:PORT"]
        return shlex.join(launch + ["-m", "fastdet.train", *args])
    return shlex.join(["python", "-m", "fastdet.train", *args])


# Config fields that may differ between a run and its resumption (how it runs, not what
# it trains): anything else differing means the checkpoint is another run's.
_RESUME_FREE = {
    "run": None,  # the whole section: output, logging, max_steps, resume flags, device
    "compile": None,
    "data": {"loader", "num_workers", "cache_dir", "check_images", "eval_batch_size", "data",
             "train_ann", "val_ann", "train_images", "val_images"},
    "model": {"num_classes", "backbone_weights"},
}


def config_mismatch(saved: dict[str, Any], current: dict[str, Any], limit: int = 3) -> list[str]:
    """The fields (``section.field: checkpoint -> this run``) that make a checkpoint another
    run's; empty when it continues this one."""
    out = []
    for sec, fields_ in current.items():
        free = _RESUME_FREE.get(sec, set())
        if free is None or not isinstance(fields_, dict):
            continue
        old = saved.get(sec) or {}
        for k, v in fields_.items():
            if k in free:
                continue
            ov = old.get(k, v)
            if _norm(ov) != _norm(v):
                out.append(f"{sec}.{k}: {ov!r} in the checkpoint, {v!r} now")
    return out[:limit]


def _norm(v: Any) -> Any:
    return [_norm(x) for x in v] if isinstance(v, (list, tuple)) else v


class StopControl:
    """Signal handling and the per-step agreement of all ranks (see the module docstring).

    ``poll()`` is called by every rank after every step; it returns ``(stop, checkpoint)``
    as decided one step earlier (the reduction launched then is waited now), identical on
    every rank.
    """

    def __init__(self, world_size: int, ckpt_interval_s: float, is_main: bool):
        self.world_size = world_size
        self.ckpt_interval_s = ckpt_interval_s
        self.is_main = is_main
        self.signum = 0
        self._last_ckpt = time.monotonic()
        self._pending = None
        self._buf = torch.zeros(2, dtype=torch.int64)
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._old: dict[int, Any] = {}

    # -- signals
    def install(self) -> None:
        """The handlers, before the first step; the time-sized checkpoints count from now."""
        self._last_ckpt = time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if not self.signum:
            self.signum = signum
            # Written directly: a logging call from a signal handler can deadlock on its lock.
            os.write(2, f"fastdet: {signal.Signals(signum).name} received: stopping at the next step "
                        "boundary and saving latest.pth (Ctrl-C again to stop at once)\n".encode())

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    # -- the per-step agreement
    def checkpoint_saved(self) -> None:
        self._last_ckpt = time.monotonic()

    def poll(self) -> tuple[bool, bool]:
        due = self.ckpt_interval_s > 0 and time.monotonic() - self._last_ckpt >= self.ckpt_interval_s
        if self._group is None:
            return bool(self.signum), due
        stop = ckpt = False
        if self._pending is not None:
            self._pending.wait()
            stop, ckpt = bool(self._buf[0]), bool(self._buf[1])
        self._buf = torch.tensor([1 if self.signum else 0, 1 if (due and self.is_main) else 0])
        self._pending = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return stop, ckpt

    def finish(self) -> None:
        """Wait for the reduction in flight (every rank calls it the same number of times)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def preempted(self, step: int, steps_per_epoch: int, latest: Path) -> Preempted:
        """What every rank raises once ``latest`` holds ``step`` (said once, by rank 0; the epoch
        counted from 1, as the log lines count it)."""
        who = self.signame or "a signal on another rank"
        if self.is_main:
            epoch = epoch_of_step(step, steps_per_epoch)
            log.warning("stopped by %s after step %d (step %d of %d in epoch %d); saved %s", who, step,
                        step - (epoch - 1) * steps_per_epoch, steps_per_epoch, epoch, latest)
        return Preempted(who, step, str(latest), resume_command())

