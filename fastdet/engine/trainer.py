"""The plain training loop: data -> step -> log, with checkpoints and evaluation.

Nothing here names an architecture: the family's recipe (``fastdet.registry``), looked up
once, says what changes during training (``phase(epoch)``: the loss arguments, the
augmentation stages, schedule switches) and the loop passes it on. Each concern around
the step is one collaborator, called at the loop's named points (before training, after
each step, after each epoch, after training): ``metrics`` (engine/metrics_log.py),
``evals`` (engine/eval_hook.py), ``checkpoints`` (engine/checkpointer.py), ``control``
(engine/faults.py), ``compilation`` (engine/compile_workers.py) and the ``hooks`` a caller
gives (engine/hooks.py).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import torch

from fastdet import registry
from fastdet.config import Config
from fastdet.data.coco import categories_diff
from fastdet.data.formats import load_split
from fastdet.data.loader import build_eval_loader, build_train_loader
from fastdet.runtime import dist
from fastdet.engine.checkpointer import Checkpointer, auto_resume
from fastdet.engine.compile_workers import CompileWorkers
from fastdet.engine.eval_hook import EvalHook, EvalRunner
from fastdet.engine.faults import MemoryGuard, StopControl, restart_count
from fastdet.engine.hooks import Hook
from fastdet.engine.metrics_log import MetricsLog
from fastdet.runtime.logging import Progress, ProfilerWindow, StepGaps, epoch_of_step, setup_logging
from fastdet.engine.optim import LRSchedule
from fastdet.engine.preflight import PreflightError, check_end_of_run_path, preflight_set
from fastdet.engine.rundir import choose_run_dir, forget_failed_start
from fastdet.eval.scoring import resolve_backend
from fastdet.engine.step import TrainParts, build_train_parts, build_train_step, set_train_mode
from fastdet.runtime.amp import backend_flags
from fastdet.models.recipe import pretrained_backbone_note

log = logging.getLogger("fastdet")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, a recompile after warm-up)."""


def output_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir.format(arch=cfg.model.arch, size=cfg.model.size)).expanduser()


class Trainer:
    """Set up in small named steps (process, data, family, model, loaders, restore, step,
    collaborators), then :meth:`train`."""

    def __init__(self, cfg: Config, hooks: Sequence[Hook] = ()):
        cfg = registry.resolve(cfg)
        self._setup_process(cfg)
        try:
            self._set_up(cfg, hooks)
        except BaseException:
            forget_failed_start(self.out, self._made_out, self.dist.is_main, self._log_before)
            raise

    def _set_up(self, cfg: Config, hooks: Sequence[Hook]) -> None:
        cfg = replace(cfg, run=replace(cfg.run, output_dir=str(self.out)))  # the directory chosen
        cfg, resume_from = auto_resume(cfg, self.out, self.dist.is_main)
        self.cfg = self._load_data(cfg)
        # The family, looked up once: what the loaders, the loop and evaluation ask of it.
        self.family = registry.family(self.cfg.model.arch)
        self.phase = partial(registry.phase, self.cfg)  # phase(epoch)
        self.predict_kwargs = registry.predict_kwargs(self.cfg)
        self._build_model()
        self._build_loaders()
        self.checkpoints = Checkpointer(self.cfg, self.out, self.dist, self.model, self.ema, self.optimizer,
                                        self.train_set, self.steps_per_epoch)
        self.epoch, self.step, best_ap = 0, 0, -1.0
        if self.cfg.run.resume:
            self.epoch, self.step, best_ap = self.checkpoints.resume(resume_from, self.world_batch, self.base_lr)
        elif self.cfg.run.ckpt:
            self.checkpoints.finetune(self.cfg.run.ckpt)
        self._build_step()
        self.checkpoints.use_scaler(self.train_step.scaler)
        self.gaps = StepGaps()
        self.metrics = MetricsLog(self.cfg, self.out, self.device, self.dist, self.schedule, self.gaps, self.step)
        # Evaluations are scored in a background process (engine/eval_hook.py).
        self.evals = EvalHook(EvalRunner(self.val_set, self.out, self.metrics.tb, is_main=self.dist.is_main,
                                         async_eval=self.cfg.run.async_eval, best_ap=best_ap),
                              self.val_loader, amp_dtype=self.amp_dtype, predict_kwargs=self.predict_kwargs,
                              preprocess=self.family.preprocess, img_size=self.cfg.data.img_size,
                              phase=self.phase, eval_interval=self.cfg.run.eval_interval)
        self.control = StopControl(self.dist.world_size, self.cfg.run.ckpt_interval_minutes * 60.0,
                                   self.dist.is_main)
        self.profiler = ProfilerWindow(self.cfg.run.profile_steps, self.device)
        self.hooks = list(hooks)
        self.metrics.start_run_files(self.cfg, self.model)

    # ------------------------------------------------------------------ set-up steps
    def _setup_process(self, cfg: Config) -> None:
        """Device, process group, output directory, logging and seeds."""
        self.device = dist.resolve_device(cfg.run.device)
        dist.check_device_flags(cfg, self.device)
        self.dist = dist.init_distributed(self.device.type, cuda_graphs=cfg.compile.cuda_graphs,
                                          timeout_minutes=cfg.run.dist_timeout_minutes)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
            backend_flags(self.device, cfg.compile.tf32)
        asked = output_dir(cfg)
        if asked.exists() and not asked.is_dir():
            raise ValueError(f"--output-dir {asked} is a file, not a folder")
        # Rank 0 chooses (another rank could see the directory rank 0 just made as taken).
        out, self._made_out, self._log_before = asked, False, None
        if self.dist.is_main:
            keep = cfg.run.resume or cfg.run.exist_ok or cfg.run.auto_resume
            out, self._made_out, self._log_before = choose_run_dir(asked, keep, restarted=restart_count() > 0)
        self.out = dist.broadcast_object(out)
        self.memory = MemoryGuard(self.out / "latest.pth")  # out-of-device-memory lines
        dist.barrier()
        setup_logging(self.out, self.dist.is_main)
        if self.out != asked:
            resumable = "--resume continues that run, " if (asked / "latest.pth").exists() else ""
            log.info("%s holds another run: this run writes to %s (%s--exist-ok writes into it)", asked, self.out,
                     resumable)
        dist.seed_everything(cfg.run.seed, self.dist.rank)

    def _load_data(self, cfg: Config) -> Config:
        """The train and val sets; returns ``cfg`` with ``model.num_classes`` set from them."""
        # COCO, YOLO (data.yaml) or VOC, told apart by what --data points at (data/formats.py).
        self.train_set = load_split(cfg.data, "train")
        self.val_set = load_split(cfg.data, "val")
        if len(self.train_set) == 0:
            raise ValueError(f"{self.train_set.ann_file}: no usable training images "
                             f"({self.train_set.report.summary()})")
        if (self.train_set.cat_ids, self.train_set.class_names) != (self.val_set.cat_ids, self.val_set.class_names):
            raise ValueError(f"{self.val_set.ann_file}: categories differ from {self.train_set.ann_file}'s: "
                             f"{categories_diff(self.train_set, self.val_set)}")
        return replace(cfg, model=replace(cfg.model, num_classes=self.train_set.num_classes))

    def _build_model(self) -> None:
        """The detector on the device, the AMP dtype, the optimizer and the EMA, as the compile
        workers build them (engine/step.py); a resumed run has its backbone weights in its state."""
        cfg = self.cfg
        parts = build_train_parts(cfg, self.device, world_size=self.dist.world_size,
                                  backbone_weights=not cfg.run.resume)
        self.model, self.optimizer, self.ema = parts.model, parts.optimizer, parts.ema
        self.amp_dtype, self.base_lr = parts.amp_dtype, parts.base_lr
        note = pretrained_backbone_note(self.family.recipe, cfg.model.size, cfg.data.data,
                                        cfg.model.backbone_weights, cfg.run.ckpt or cfg.run.resume)
        if note and self.dist.is_main:
            log.info(note)
        self.world_batch = cfg.data.batch_size * self.dist.world_size

    def _build_loaders(self) -> None:
        """The loaders and the LR schedule, which needs the number of steps per epoch."""
        cfg, d = self.cfg, self.dist
        # The family's phase decides each epoch's augmentation; the loader rebuilds its
        # chain only when the stage list changes.
        self.train_loader = build_train_loader(cfg.data, self.train_set,
                                               stages_for_epoch=lambda epoch: self.phase(epoch).stages,
                                               rank=d.rank, world_size=d.world_size, device=self.device,
                                               seed=cfg.run.seed)
        self.val_loader = build_eval_loader(cfg.data, self.val_set,
                                            preprocess=self.family.preprocess,
                                            rank=d.rank, world_size=d.world_size,
                                            device=self.device)
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(self.train_set)} images, fewer than one batch of "
                f"{self.world_batch}: lower --batch-size")
        self.schedule = LRSchedule.from_config(cfg.optim, self.base_lr, self.steps_per_epoch)

    def _build_step(self) -> None:
        """The (compiled, DDP-wrapped when distributed) train step and its compilation (the
        compile workers build theirs with the same ``build_train_step``)."""
        cfg = self.cfg
        self.train_step = build_train_step(
            cfg, self.device, parts=TrainParts(self.model, self.optimizer, self.ema, self.base_lr, self.amp_dtype),
            ddp=self.dist.distributed, world_size=self.dist.world_size,
            background=cfg.compile.compile and cfg.compile.warmup == "background")
        # SyncBatchNorm (model.sync_bn) converts in place: the root module, which the
        # checkpointer holds, stays the same object.
        self.model = self.train_step.model
        self.compilation = CompileWorkers(cfg, self.device, step=self.train_step, out_dir=self.out,
                                          ddp=self.dist.distributed, ranks=self.dist)

    # ------------------------------------------------------------------ checkpoints / eval
    def save(self) -> None:
        """``latest.pth`` (every rank calls it); it restarts the time-sized interval."""
        self.checkpoints.save_latest(self.epoch, self.step, self.evals.best_ap)
        self.control.checkpoint_saved()

    def evaluate(self) -> None:
        """The EMA's weights (the model's without one) scored on the val set, in the background."""
        self.checkpoints.average_bn_stats()
        model = self.ema.averaged() if self.ema is not None else self.model
        with self.memory.evaluation(self.step):
            self.evals.evaluate(model, step=self.step, epoch=self._epoch_number(),
                                state=lambda: self.checkpoints.weights_state(self.epoch, self.step, self.evals.best_ap))

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, float]:
        cfg, run = self.cfg, self.cfg.run
        total_steps = cfg.optim.epochs * self.steps_per_epoch
        if run.max_steps > 0:
            total_steps = min(total_steps, run.max_steps)
        if self.step == total_steps and not self.evals.recorded(self.step):
            # Stopped or killed during the evaluation of its last step (then resumed, or
            # restarted by torchrun): the last step is always evaluated, so it is now.
            log.info("the run in %s trained to its last step, %d, but its evaluation of it was not recorded "
                     "(stopped during it): evaluating it now", self.out, self.step)
            self.evaluate()
            return self._finish()
        if self.step >= total_steps:
            more = ("raise --max-steps, or start a new run for more --epochs" if total_steps < cfg.optim.epochs *
                    self.steps_per_epoch else "its schedule is done: for more --epochs start a new run, with --ckpt "
                    f"{self.out / 'latest.pth'} to start from its weights")
            log.info("the run in %s finished at step %d of %d (epoch %d): nothing to train; %s", self.out, self.step,
                     total_steps, self._epoch_number(), more)
            self.metrics.close()
            return {}
        with self._start():
            self._preflight()
            self.control.install()  # a signal during a long blocking warm-up stops at the first step
            # Modes first: warm-up compiles and captures the model in the mode it trains in
            # (Dynamo guards on each module's `training`, a graph bakes BatchNorm's mode in).
            self._train_mode()
            with self.memory.warmup():
                self.compilation.warmup(self.epoch, self.steps_per_epoch)
            progress = self.metrics.start(self.step, total_steps, images=len(self.train_set),
                                          steps_per_epoch=self.steps_per_epoch, lr=self.base_lr,
                                          amp_dtype=self.amp_dtype, loader=self.train_loader.backend)
            for hook in self.hooks:
                hook.before_train(self)
            while self.step < total_steps:
                stop = self._train_epoch(progress, total_steps)
                epoch_done = self.step % self.steps_per_epoch == 0
                if epoch_done:
                    self.epoch += 1
                last = self.step >= total_steps
                if epoch_done or last:
                    self.save()
                    self.metrics.data_losses(self.train_loader, self._epoch_number())
                if self.evals.due(self.epoch, epoch_done, last):
                    self.evaluate()
                for hook in self.hooks:
                    hook.after_epoch(self)
                if stop and not last:  # a signal at an epoch's last step: saved (and evaluated) above
                    self._stop_preempted()
        self.control.finish()
        self.metrics.report_gaps(self.step)
        stats = self._finish()
        for hook in self.hooks:
            hook.after_train(self)
        return stats

    def _finish(self) -> dict[str, float]:
        """The last evaluations waited for (``latest.pth`` then records the best AP), the
        writers and workers closed, the final line; the last scores."""
        best_changed, stats = self.evals.finish(self.step)
        if best_changed:
            self.save()
        self.metrics.close()
        self.compilation.close()
        self.evals.report(stats)
        return stats

    def _train_epoch(self, progress: Progress, total_steps: int) -> bool:
        """Train until the end of the epoch or ``total_steps``; True if a signal asks to stop
        (at the epoch's last step: the loop saves and evaluates first)."""
        run = self.cfg.run
        self._train_mode()  # evaluation may have left the model in eval mode
        self.train_loader.set_epoch(self.epoch)
        self.metrics.epoch_begins()
        skip = self.step - self.epoch * self.steps_per_epoch  # resumed mid-epoch
        # Never all of it: an epoch that skips every batch would be read again forever.
        assert 0 <= skip < self.steps_per_epoch, (self.step, self.epoch, self.steps_per_epoch)
        kw = self.phase(self.epoch).loss_kwargs
        it = iter(self.train_loader)
        while (batch := self._next_batch(it)) is not None:
            if skip > 0:
                skip -= 1
                if skip == 0:
                    self.gaps.restart()  # the skipped batches are not a gap between steps
                continue
            self.metrics.batch_loaded()
            self.profiler.before_step(self.step)
            with self._sync_check(), self.memory.step(self.step + 1, batch, kw):
                self.optimizer.set_lr(self.schedule(self.step))
                self.train_step(batch, kw)
            self.step += 1
            self.metrics.step_done(self.step, batch["images"].shape[0] * self.dist.world_size, compiled=lambda: (
                self.cfg.compile.compile and self.train_step.is_compiled(*batch["images"].shape[-2:], kw)))
            for hook in self.hooks:
                hook.after_step(self)
            # Every rank gets the same answer: a signal on any rank, a time-sized checkpoint.
            stop, time_due = self.control.poll()
            ckpt_due = (run.ckpt_interval_steps > 0 and self.step % run.ckpt_interval_steps == 0) or time_due
            end = self.step >= total_steps or self.step % self.steps_per_epoch == 0
            log_due = self.step % run.log_interval == 0 or ckpt_due or end or stop
            if not self.dist.distributed or log_due:
                # Ranks agree on ready buckets at log points only (one small all-reduce).
                self.compilation.poll(self.step, self.gaps)
            progress.step(self.compilation.status())
            # Losses are read (and checked) before every checkpoint, so a saved
            # checkpoint never holds weights from after a non-finite loss.
            if log_due:
                self._log()
            if stop and not end:
                self.save()
                self._stop_preempted()
            if ckpt_due:
                self.save()
            if end:
                return stop
        return False

    def _log(self) -> None:
        """A log point: the losses read and written (every rank), the scores that arrived acted on."""
        if not self.metrics.write(self.step, self._epoch_number(), self.train_step):
            self.metrics.close()
            self.evals.close()
            latest = self.out / "latest.pth"
            raise TrainingError(f"non-finite loss at step {self.step}: training stopped; " + (
                f"the last good checkpoint is {latest}" if latest.exists() else "no checkpoint was written before it"))
        self.evals.collect(self.step)  # scores finished in the background since the last log

    @contextlib.contextmanager
    def _start(self) -> Iterator[None]:
        """A failure before this process's first step finishes (the check before training,
        the warm-up, the first step: out of memory, a shape) is a failed start: the workers
        and writers closed, and the folder as it was (engine/rundir.py), so the corrected
        command goes to the same folder."""
        first_step = self.step + 1
        try:
            yield
        except BaseException:
            if self.step < first_step:
                self.metrics.close()
                self.evals.close()
                self.compilation.close()
                forget_failed_start(self.out, self._made_out, self.dist.is_main, self._log_before)
            raise

    def _epoch_number(self) -> int:
        """The epoch of the last step, counted from 1, as every line and file names it
        (``self.epoch`` counts the epochs finished: where the loader and the phase resume)."""
        return epoch_of_step(self.step, self.steps_per_epoch)

    def _stop_preempted(self) -> None:
        """After ``latest.pth`` holds this step: every rank stops (faults.Preempted)."""
        self.control.finish()
        self.evals.close()  # a scoring still running is lost with the stop; latest.pth is saved
        raise self.control.preempted(self.step, self.steps_per_epoch, self.out / "latest.pth")

    @contextlib.contextmanager
    def _sync_check(self):
        """--sync-debug: any host sync in the step raises (the log reads, evaluation and
        checkpoints outside it may sync)."""
        if not self.cfg.run.sync_debug:
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def _next_batch(self, it: Iterator) -> dict[str, torch.Tensor] | None:
        """The loader's next batch (None at the epoch's end), inside --sync-debug's check as
        the step is: a loader that blocks the host on the device (a synchronous copy, a read
        of a device value) raises there instead of slowing every step unseen."""
        with self._sync_check(), self.train_step.nvtx("data"):
            return next(it, None)

    def _train_mode(self) -> None:
        set_train_mode(self.model, self.cfg.model)  # as build_train_step set it (the graphs' mode)

    def _preflight(self) -> None:
        """The evaluation and checkpoint paths on one eval batch per rank, before step 1
        (fastdet/engine/preflight.py), so that they fail in the first minute."""
        cfg, d = self.cfg, self.dist
        model = self.ema.averaged() if self.ema is not None else self.model
        build = partial(build_eval_loader, cfg.data, preprocess=self.family.preprocess,
                        rank=d.rank, world_size=d.world_size, device=self.device)
        tiny = preflight_set(self.val_set, cfg.data.eval_batch_size, self.device, d.world_size,
                             self.family.preprocess.canvases(), cfg.data.img_size)
        try:
            secs = check_end_of_run_path(model, self.val_set, build, self.amp_dtype, self.predict_kwargs, tiny,
                                         lambda: self.checkpoints.state(self.epoch, self.step, self.evals.best_ap),
                                         self.out, d.is_main)
        except PreflightError as e:
            raise TrainingError(str(e)) from e
        scorer = {"faster": "faster-coco-eval"}.get(resolve_backend(), "pycocotools")  # the back end it scored by
        log.info("checked before training: evaluation of %d val image(s) per rank (eval loader, predict, "
                 "%s on %s) and a checkpoint write (%.1f s)", -(-len(tiny.records) // d.world_size), scorer,
                 self.val_set.ann_file.name, secs)


def train(cfg: Config, hooks: Sequence[Hook] = ()) -> dict[str, float]:
    trainer = Trainer(cfg, hooks)
    try:
        return trainer.train()
    finally:
        # Persistent loader workers left to interpreter exit wait out DataLoader's 5 s join
        # each (the queues' feeder threads are gone by then): released here, while alive.
        trainer.train_loader.close()
        trainer.val_loader.close()
        trainer.compilation.close()
        trainer.control.uninstall()
        dist.shutdown()
