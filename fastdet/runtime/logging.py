"""Log lines, progress bar, TensorBoard scalars, NVTX ranges and the profiler window."""

from __future__ import annotations

import contextlib
import datetime
import logging
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

log = logging.getLogger("fastdet")


def setup_logging(output_dir: Path | None, is_main: bool) -> None:
    """Log lines to stdout (rank 0) and to ``output_dir/train.log``."""
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    log.handlers.clear()
    fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    h = _BarAwareHandler(sys.stdout)
    h.setFormatter(fmt)
    log.addHandler(h)
    if output_dir is not None and is_main:
        fh = logging.FileHandler(output_dir / "train.log")
        fh.setFormatter(fmt)
        log.addHandler(fh)
    log.propagate = False


def close_log_file() -> None:
    """Close and drop the ``train.log`` handler (its directory is about to go)."""
    for h in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        h.close()
        log.removeHandler(h)


class _BarAwareHandler(logging.StreamHandler):
    """Log lines go above an active progress bar (``tqdm.write``) instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        bar = Progress.active
        if bar is None:
            super().emit(record)
            return
        try:
            bar.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


class TensorBoard:
    """TensorBoard scalars and images on rank 0; a no-op elsewhere or when disabled."""

    def __init__(self, log_dir: Path | None, purge_step: int | None = None):
        """``purge_step``: events at or after it in earlier files are discarded when read
        (a resumed run re-logs the steps after its checkpoint)."""
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # heavy (tensorboard, protobuf): rank 0 only

            self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def scalars(self, values: dict[str, float], step: int, prefix: str = "") -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            self.writer.add_scalar(prefix + k, v, step)

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """One uint8 ``[3, H, W]`` image."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step, dataformats="CHW")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class Progress:
    """A tqdm bar on a terminal (rank 0); nothing otherwise. It moves every step
    (:meth:`step`); log lines print above it (``_BarAwareHandler``)."""

    active = None  # the tqdm class while a bar is shown (its ``write`` keeps the bar whole)

    def __init__(self, total: int, enabled: bool, force: bool = False):
        self.bar = None
        if enabled and (force or sys.stdout.isatty()):
            self.bar = tqdm(total=total, dynamic_ncols=True, leave=False, file=sys.stdout)
            Progress.active = tqdm

    def update(self, n: int, desc: str = "") -> None:
        if self.bar is not None:
            self.bar.update(n)
            if desc:
                self.bar.set_description(desc)

    def step(self, status: str = "") -> None:
        """One training step; ``status`` (e.g. graphs compiled so far) as the postfix."""
        if self.bar is not None:
            self.bar.update(1)
            if status != getattr(self, "_status", ""):
                self._status = status
                self.bar.set_postfix_str(status, refresh=False)

    def describe(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_description(desc)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            Progress.active = None


def epoch_of_step(step: int, steps_per_epoch: int) -> int:
    """The epoch that step ``step`` (counted from 1) belongs to, counted from 1: what the log
    lines, ``metrics.jsonl`` and ``eval.jsonl`` say, so an epoch's last step and the evaluation
    after it name one epoch. 0 before the first step."""
    return -(-step // steps_per_epoch)


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


def memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch; on the CPU the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Nvtx:
    """``with nvtx("forward"):`` ranges for Nsight, active only with ``--nvtx`` on CUDA."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.cuda.is_available()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


class ProfilerWindow:
    """``--profile-steps A:B``: cudaProfilerStart before step A, stop after step B-1.

    Pair with ``nsys profile --capture-range=cudaProfilerApi``.
    """

    @staticmethod
    def parse(spec: str) -> tuple[int, int]:
        """``(A, B)`` of ``--profile-steps A:B``; ``ValueError`` (one line) otherwise."""
        try:
            a, b = (int(x) for x in spec.split(":"))
        except ValueError:
            raise ValueError(f"--profile-steps {spec!r}: expected A:B, e.g. 100:120") from None
        if not 0 <= a < b:
            raise ValueError(f"--profile-steps {spec!r}: need 0 <= A < B")
        return a, b

    def __init__(self, spec: str | None, device: torch.device):
        self.start = self.stop = -1
        if spec:
            a, b = self.parse(spec)
            if device.type != "cuda":
                raise ValueError("--profile-steps needs --device cuda (it drives the CUDA profiler API)")
            self.start, self.stop = a, b
        self.active = False

    def before_step(self, step: int) -> None:
        if step == self.start:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            self.active = True
        elif step == self.stop and self.active:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            self.active = False


class Timer:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


class StepGaps:
    """The longest wall-clock gap between the ends of two consecutive steps.

    A step that waits for a compile (a bucket switching to its graph, a worker starving the
    cores) shows here, whatever its cause; the time between epochs (checkpoint, evaluation)
    does not, because :meth:`restart` is called when an epoch's steps begin. ``longest`` is over
    the run, ``interval`` since the last :meth:`take_interval` (each ``metrics.jsonl`` line).
    """

    def __init__(self) -> None:
        self.last: float | None = None
        self.longest, self.longest_step = 0.0, 0
        self.interval = 0.0

    def restart(self) -> None:
        self.last = time.perf_counter()

    def tick(self, step: int) -> float:
        """Called when ``step`` has finished; the gap since the previous one (seconds)."""
        now = time.perf_counter()
        gap = 0.0 if self.last is None else now - self.last
        self.last = now
        self.interval = max(self.interval, gap)
        if gap > self.longest:
            self.longest, self.longest_step = gap, step
        return gap

    def take_interval(self) -> float:
        gap, self.interval = self.interval, 0.0
        return gap
