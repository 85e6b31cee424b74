"""The trainer's logging and metrics: what a run tells while it trains.

:class:`MetricsLog` (``Trainer.metrics``) owns the log lines of training (the first step,
each log point, the longest gap between steps at the end), ``metrics.jsonl``, TensorBoard's
``train/*`` scalars (its writer, ``tb``, is shared with the evaluation's ``val/*``), the
progress bar, the time spent waiting for data and the gaps between steps
(``runtime.logging.StepGaps``), and the run's files written at start (``config.yaml``,
``model_summary.txt``; a fresh run's ``metrics.jsonl`` / ``eval.jsonl`` start empty).

The trainer calls it at named points: :meth:`~MetricsLog.start` (before the first step: the
line that says what trains how),
:meth:`~MetricsLog.epoch_begins`, :meth:`~MetricsLog.batch_loaded` and
:meth:`~MetricsLog.step_done` (each step), :meth:`~MetricsLog.write` (log points),
:meth:`~MetricsLog.close` and :meth:`~MetricsLog.report_gaps` (the end).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import operator
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fastdet.config import Config
from fastdet.data.loader import train_sizes
from fastdet.engine.summary import summarize_model, write_summary
from fastdet.runtime import dist
from fastdet.runtime.logging import Progress, StepGaps, TensorBoard, Timer, format_eta, memory_mb

log = logging.getLogger("fastdet")
# When this module was imported (with the trainer; torch already was): the clock of
# "first step after start".
_T_START = time.perf_counter()


class MetricsLog:
    """Logging and metrics of one run (see the module docstring).

    Args:
        cfg: the run's resolved config (what the start line says; ``run.tensorboard``,
            ``run.progress``, ``run.resume``).
        out: the run directory.
        device: the training device (memory use).
        dist_info: ``runtime.dist.init_distributed``'s answer (rank 0 writes; losses are
            averaged over the ranks).
        schedule: the LR schedule (``schedule(step)``).
        gaps: the gaps between steps, shared with the compile log lines.
        step: the step the run starts at (TensorBoard drops a resumed run's later events).
    """

    def __init__(self, cfg: Config, out: Path, device: torch.device, dist_info: Any,
                 schedule: Callable[[int], float], gaps: StepGaps, step: int):
        self.cfg, self.out, self.device, self.dist = cfg, out, device, dist_info
        self.schedule, self.gaps = schedule, gaps
        self._data_losses: str | None = None  # the training loader's report last logged
        self.show_progress = cfg.run.progress and dist_info.is_main
        # purge_step: TensorBoard drops the events a resumed run logged after its checkpoint, and
        # for a new run every earlier event (--exist-ok over another run: its curves would
        # interleave with this one's); the files stay, TensorBoard skips them.
        self.tb = TensorBoard(out / "tb" if dist_info.is_main and cfg.run.tensorboard else None,
                              purge_step=step + 1 if cfg.run.resume else 0)
        self.progress = Progress(0, enabled=False)  # the bar of start()
        self.t_start = self.last_log_t = time.perf_counter()
        self.steps_at_start = self.total_steps = step
        # Since the last log point: seconds waiting for batches, images trained on.
        self.timer, self.data_time, self.images = Timer(), 0.0, 0

    def start_run_files(self, cfg: Config, model: nn.Module) -> None:
        """The resolved config and the model summary next to the run; a fresh run in an old
        directory starts its logs anew (rank 0)."""
        if not self.dist.is_main:
            return
        cfg.dump(self.out / "config.yaml")
        # Parameters, trainable parameters and GFLOPs at the smallest and largest training
        # size and the evaluation size.
        sizes = train_sizes(cfg.data)
        summary = summarize_model(model, f"{cfg.model.arch}-{cfg.model.size}",
                                  (min(sizes), max(sizes), cfg.data.img_size))
        write_summary(summary, self.out)
        log.info("%s", summary)
        if not cfg.run.resume:
            for name in ("metrics.jsonl", "eval.jsonl"):
                (self.out / name).unlink(missing_ok=True)

    def start(self, step: int, total_steps: int, *, images: int, steps_per_epoch: int, lr: float,
              amp_dtype: torch.dtype | None, loader: str) -> Progress:
        """Training begins at ``step`` of ``total_steps``: the line that says what trains how
        (``images`` in the training set, ``lr`` for the whole batch, the ``loader`` back end),
        the clocks start; the progress bar."""
        cfg = self.cfg
        log.info("training %s-%s on %s: %d images, %d steps/epoch x %d epochs (%d steps), "
                 "batch %d per rank x %d rank(s) = %d, lr %.4g, train sizes %s, eval size %d, "
                 "amp %s, compile %s, cuda graphs %s, loader %s",
                 cfg.model.arch, cfg.model.size, self.device, images, steps_per_epoch, cfg.optim.epochs,
                 total_steps, cfg.data.batch_size, self.dist.world_size,
                 cfg.data.batch_size * self.dist.world_size, lr, ",".join(map(str, cfg.data.train_sizes)),
                 cfg.data.img_size, amp_dtype or "off", cfg.compile.compile, cfg.compile.cuda_graphs, loader)
        self.progress = Progress(total_steps - step, self.show_progress)
        self.t_start = self.last_log_t = time.perf_counter()
        self.steps_at_start, self.total_steps = step, total_steps
        return self.progress

    def epoch_begins(self) -> None:
        self.gaps.restart()
        self.timer, self.data_time, self.images = Timer(), 0.0, 0

    def batch_loaded(self) -> None:
        self.data_time += self.timer.lap()

    def step_done(self, step: int, images: int, compiled: Callable[[], bool]) -> None:
        """``step`` has run on ``images`` images (all ranks); ``compiled()``: whether it ran a
        compiled graph (asked at the first step only)."""
        self.gaps.tick(step)
        self.images += images
        self.timer.lap()
        if step == self.steps_at_start + 1:
            log.info("first step done %.1f s after start (%s)", time.perf_counter() - _T_START,
                     "compiled" if compiled() else "eager")

    def write(self, step: int, epoch: int, train_step: Any) -> bool:
        """A log point: one host read of the losses ``train_step`` accumulated since the last
        (averaged over the ranks), the log line, ``metrics.jsonl`` and TensorBoard; False on a
        non-finite loss (nothing written). ``epoch``: the step's, counted from 1."""
        n = train_step.steps_accumulated
        losses = train_step.read_losses()
        if self.dist.distributed:
            losses = dist.mean_dict(losses, self.device)
        if not all(math.isfinite(v) for v in losses.values()):
            bad = ", ".join(f"{k}={v}" for k, v in losses.items() if not math.isfinite(v))
            log.error("non-finite loss at step %d (epoch %d): %s; stopping. The last good "
                      "checkpoint is kept in %s", step, epoch, bad, self.out)
            return False
        train_step.check_recompiles()  # a recompile after warm-up raises, at a log point (it syncs)
        now = time.perf_counter()
        elapsed = now - self.t_start
        ips = self.images / max(1e-9, now - self.last_log_t)
        self.last_log_t = now
        eta = elapsed / max(1, step - self.steps_at_start) * (self.total_steps - step)
        lr = self.schedule(step - 1)
        mem = memory_mb(self.device)
        data = self.data_time / max(1, n)
        loss_txt = "  ".join(f"{k} {v:.4f}" for k, v in losses.items())
        log.info("epoch %d/%d  step %d/%d  %s  lr %.3g  %.1f img/s  data %.3f s/it  mem %.0f MB  eta %s",
                 epoch, self.cfg.optim.epochs, step, self.total_steps, loss_txt, lr, ips, data, mem, format_eta(eta))
        self.progress.describe(f"ep {epoch} loss {losses.get('total_loss', float('nan')):.3f}")
        self.tb.scalars({f"train/{k}": v for k, v in losses.items()}, step)
        if self.dist.is_main:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"epoch": epoch, "step": step, "lr": lr,
                                    "images_per_s": ips, "time_s": round(elapsed, 3),
                                    "max_step_gap_s": round(self.gaps.take_interval(), 3),
                                    **losses}) + "\n")
        self.tb.scalars({"train/lr": lr, "train/images_per_s": ips, "train/data_time": data,
                         "train/memory_mb": mem}, step)
        self.data_time, self.images = 0.0, 0
        return True

    def data_losses(self, loader, epoch: int) -> None:
        """What the training loader dropped or replaced so far (boxes beyond --max-boxes,
        images that did not decode), when it changed: counted, not lost in silence."""
        losses = loader.losses()
        if self.dist.world_size > 1:  # every rank's batches (one small gather at an epoch's end)
            losses = functools.reduce(operator.add, dist.all_gather_objects(losses))
        said = str(losses)
        if self.dist.is_main and said != "nothing skipped" and said != self._data_losses:
            log.info("training data so far (epoch %d): %s", epoch, said)
            self._data_losses = said

    def close(self) -> None:
        self.progress.close()
        self.tb.close()

    def report_gaps(self, step: int) -> None:
        if self.dist.is_main:
            log.info("steps %d-%d: longest gap between two steps %.1f s (step %d; evaluation and "
                     "checkpoints between epochs not counted)", self.steps_at_start + 1, step,
                     round(self.gaps.longest, 3), self.gaps.longest_step)  # as metrics.jsonl rounds it
