"""The plain training loop: data -> step -> log, with checkpoints and evaluation.

Nothing here names an architecture: the family's recipe (``fastdet.registry``) says what
changes during training (``phase(cfg, epoch)``: the loss arguments, the augmentation
stages, schedule switches) and the loop passes it on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from fastdet import registry
from fastdet.config import Config
from fastdet.data.formats import load_split
from fastdet.data.loader import build_eval_loader, build_train_loader, train_sizes
from fastdet.runtime import dist
from fastdet.runtime.checkpoint import (load_checkpoint, load_weights_tolerant, load_with_fallback,
                                       previous_path, rng_state, save_checkpoint, select_weights,
                                       set_rng_state)
from fastdet.engine.compile_workers import CompileWorkers
from fastdet.engine.evaluation import EvalRunner
from fastdet.engine.faults import (Preempted, StopControl, config_mismatch, maybe_inject_fault,
                                   restart_count, resume_command)
from fastdet.runtime.logging import (Progress, ProfilerWindow, StepGaps, TensorBoard, Timer, format_eta,
                                    memory_mb, setup_logging)
from fastdet.engine.optim import LRSchedule
from fastdet.engine.preflight import PreflightError, check_end_of_run_path, preflight_images
from fastdet.engine.previews import log_val_predictions
from fastdet.engine.rundir import free_run_dir
from fastdet.engine.step import TrainParts, build_train_parts, build_train_step, freeze_bn_stats
from fastdet.runtime.amp import backend_flags
from fastdet.engine.summary import summarize_model, write_summary
from fastdet.models.recipe import pretrained_backbone_note

log = logging.getLogger("fastdet")
# When this module was imported (torch already was): the clock of "first step after start".
_T_START = time.perf_counter()


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, a recompile after warm-up)."""


def output_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir.format(arch=cfg.model.arch, size=cfg.model.size)).expanduser()


class Trainer:
    """Set up in small named steps (process, data, model, loaders, restore, step), then
    :meth:`train`."""

    def __init__(self, cfg: Config):
        cfg = registry.resolve(cfg)
        self._setup_process(cfg)
        cfg = replace(cfg, run=replace(cfg.run, output_dir=str(self.out)))  # the directory chosen
        cfg = self._auto_resume(cfg)
        self.cfg = self._load_data(cfg)
        self._build_model()
        self._build_loaders()
        self.epoch, self.step, self.best_ap = 0, 0, -1.0
        self.val_predictions: Path | None = None  # the last drawn set (engine/previews.py)
        if self.cfg.run.resume:
            self._resume()
        elif self.cfg.run.ckpt:
            self._finetune(self.cfg.run.ckpt)
        self._build_step()
        self._start_run_files()

    # ------------------------------------------------------------------ set-up steps
    def _setup_process(self, cfg: Config) -> None:
        """Device, process group, output directory, logging and seeds."""
        self.device = dist.resolve_device(cfg.run.device)
        if cfg.compile.cuda_graphs and self.device.type != "cuda":
            raise ValueError("--cuda-graphs needs a CUDA device (this run is on the CPU): drop the flag")
        if cfg.run.sync_debug and self.device.type != "cuda":
            raise ValueError("--sync-debug needs a CUDA device (this run is on the CPU): drop the flag")
        self.dist = dist.init_distributed(self.device.type, cuda_graphs=cfg.compile.cuda_graphs,
                                          timeout_minutes=cfg.run.dist_timeout_minutes)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
            backend_flags(self.device, cfg.compile.tf32)
        asked = output_dir(cfg)
        # Rank 0 chooses (another rank could see the directory rank 0 just made as taken).
        self.out = dist.broadcast_object(
            asked if cfg.run.resume or cfg.run.exist_ok or cfg.run.auto_resume or restart_count() > 0
            else free_run_dir(asked))
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        setup_logging(self.out, self.dist.is_main)
        if self.out != asked:
            log.info("%s holds another run: this run writes to %s (--resume continues that run, "
                     "--exist-ok writes into it)", asked, self.out)
        dist.seed_everything(cfg.run.seed, self.dist.rank)

    def _load_data(self, cfg: Config) -> Config:
        """The train and val sets; returns ``cfg`` with ``model.num_classes`` set from them."""
        # COCO, YOLO (data.yaml) or VOC, told apart by what --data points at (data/formats.py).
        self.train_set = load_split(cfg.data, "train")
        self.val_set = load_split(cfg.data, "val")
        if len(self.train_set) == 0:
            raise ValueError(f"{self.train_set.ann_file}: no usable training images "
                             f"({self.train_set.report.summary()})")
        if self.train_set.cat_ids != self.val_set.cat_ids:
            raise ValueError(f"{self.val_set.ann_file}: categories differ from {self.train_set.ann_file}")
        return replace(cfg, model=replace(cfg.model, num_classes=self.train_set.num_classes))

    def _build_model(self) -> None:
        """The detector on the device, the AMP dtype, the optimizer and the EMA, as the compile
        workers build them (engine/step.py); a resumed run has its backbone weights in its state."""
        cfg = self.cfg
        parts = build_train_parts(cfg, self.device, world_size=self.dist.world_size,
                                  backbone_weights=not cfg.run.resume)
        self.model, self.optimizer, self.ema = parts.model, parts.optimizer, parts.ema
        self.amp_dtype, self.base_lr = parts.amp_dtype, parts.base_lr
        note = pretrained_backbone_note(registry.recipe(cfg.model.arch), cfg.model.size, cfg.data.data,
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
                                               stages_for_epoch=lambda epoch: registry.phase(cfg, epoch).stages,
                                               rank=d.rank, world_size=d.world_size, device=self.device,
                                               seed=cfg.run.seed)
        self.val_loader = build_eval_loader(cfg.data, self.val_set,
                                            preprocess=registry.family(cfg.model.arch).preprocess,
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
        compile workers build theirs with the same ``build_train_step``), TensorBoard and the profiler."""
        cfg = self.cfg
        self.train_step = build_train_step(
            cfg, self.device, parts=TrainParts(self.model, self.optimizer, self.ema, self.base_lr, self.amp_dtype),
            ddp=self.dist.distributed, world_size=self.dist.world_size,
            background=cfg.compile.compile and cfg.compile.warmup == "background")
        self.model = self.train_step.model  # BatchNorm may have become SyncBatchNorm (model.sync_bn)
        self.compilation = CompileWorkers(cfg, self.device, step=self.train_step, out_dir=self.out,
                                          ddp=self.dist.distributed, ranks=self.dist)
        # purge_step: TensorBoard drops the events a resumed run logged after its checkpoint.
        self.tb = TensorBoard(self.out / "tb" if self.dist.is_main and cfg.run.tensorboard else None,
                              purge_step=self.step + 1 if cfg.run.resume else None)
        # Evaluations are scored in a background process (engine/evaluation.py).
        self.evals = EvalRunner(self.val_set, self.out, self.tb, is_main=self.dist.is_main,
                                async_eval=cfg.run.async_eval)
        self.evals.best_ap = self.best_ap
        self.profiler = ProfilerWindow(cfg.run.profile_steps, self.device)

    def _start_run_files(self) -> None:
        """The resolved config next to the run; a fresh run in an old directory starts its logs anew."""
        if self.dist.is_main:
            self.cfg.dump(self.out / "config.yaml")
            self._log_model_summary()
            if not self.cfg.run.resume:
                for name in ("metrics.jsonl", "eval.jsonl"):
                    (self.out / name).unlink(missing_ok=True)

    def _log_model_summary(self) -> None:
        """Parameters, trainable parameters and GFLOPs at the smallest and largest training
        size and the evaluation size: logged and written to model_summary.txt."""
        d = self.cfg.data
        sizes = train_sizes(d)
        summary = summarize_model(self.model, f"{self.cfg.model.arch}-{self.cfg.model.size}",
                                  (min(sizes), max(sizes), d.img_size))
        write_summary(summary, self.out)
        log.info("%s", summary)

    # ------------------------------------------------------------------ helpers
    def _state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.train_step.scaler.state_dict() if hasattr(self, "train_step") else {},
            "epoch": self.epoch,
            "step": self.step,
            "best_ap": self.best_ap,
            "config": self.cfg.to_dict(),
            "cat_ids": list(self.train_set.cat_ids),
            "class_names": list(self.train_set.class_names),
            "rng": rng_state(),
            # Every rank's random streams (rank r resumes with its own: PP-YOLO's DropBlock
            # draws on each rank), gathered by save().
            "rng_ranks": getattr(self, "_rng_ranks", None) or [],
            "world_size": self.dist.world_size,
        }

    def _auto_resume(self, cfg: Config) -> Config:
        """``--resume auto`` or a torchrun restart: continue from this output directory's
        ``latest.pth`` (``latest.prev.pth`` if it is damaged) when its config is this run's,
        start the run when there is none, refuse a checkpoint of another config. Rank 0
        decides and tells the others."""
        restarts = restart_count()
        if cfg.run.resume or not (cfg.run.auto_resume or restarts > 0):
            return cfg
        why = f"torchrun restart {restarts}" if restarts > 0 else "--resume auto"
        latest = self.out / "latest.pth"
        decision: tuple[str | None, str | None] = (None, None)
        if self.dist.is_main and (latest.exists() or previous_path(latest).exists()):
            try:
                ck, path = load_with_fallback(latest, warn=log.warning)
                bad = config_mismatch(ck.get("config") or {}, cfg.to_dict())
                decision = (None, f"{why}: {path} is another run's ({'; '.join(bad)}): use another "
                                  "--output-dir") if bad else (str(path), None)
                self._resume_state = None if bad else (ck, path)
            except (ValueError, FileNotFoundError) as e:
                decision = (None, f"{why}: {e}")
        path, error = dist.broadcast_object(decision)
        if error:
            raise ValueError(error)
        if path is None:
            log.info("%s: no checkpoint in %s: starting the run", why, self.out)
            return cfg
        self._resume_path = Path(path)
        log.info("%s: continuing from %s", why, path)
        return replace(cfg, run=replace(cfg.run, resume=True, ckpt=None))

    def _load_resume_checkpoint(self) -> tuple[dict[str, Any], Path]:
        """The checkpoint to resume from: ``--ckpt``, the one auto-resume chose, or
        ``latest.pth`` (falling back to ``latest.prev.pth``, with a warning)."""
        cached = getattr(self, "_resume_state", None)
        if cached is not None:
            self._resume_state = None
            return cached
        if getattr(self, "_resume_path", None) is not None:
            return load_checkpoint(self._resume_path), self._resume_path
        if self.cfg.run.ckpt:
            return load_checkpoint(self.cfg.run.ckpt), Path(self.cfg.run.ckpt)
        latest = self.out / "latest.pth"
        if not latest.is_file() and not previous_path(latest).is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {latest} (train once without --resume)")
        return load_with_fallback(latest, warn=log.warning)

    def _resume(self) -> None:
        ck, path = self._load_resume_checkpoint()
        if "optimizer" not in ck:
            raise ValueError(f"--resume: {path} holds weights only (best.pth keeps no optimizer state): "
                             "resume from latest.pth, or fine-tune from it with --ckpt and no --resume")
        self.model.load_state_dict(ck["model"])
        if self.ema is not None and ck.get("ema") is not None:
            self.ema.load_state_dict(ck["ema"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self._scaler_state = ck.get("scaler") or {}
        self.epoch, self.step, self.best_ap = ck["epoch"], ck["step"], ck.get("best_ap", -1.0)
        if ck.get("world_size", 1) == self.dist.world_size:
            ranks = ck.get("rng_ranks") or []
            set_rng_state(ranks[self.dist.rank] if len(ranks) == self.dist.world_size else ck["rng"])
        else:
            was = ck.get("world_size", 1)
            log.warning("resuming a run trained on %d process(es) on %d: the total batch is now %d "
                        "(was %d), the LR scales with it to %.4g, an epoch is %d steps, and the data "
                        "order and augmentation draws differ from an uninterrupted run",
                        was, self.dist.world_size, self.world_batch, self.cfg.data.batch_size * was,
                        self.base_lr, self.steps_per_epoch)
        log.info("resumed from %s at epoch %d, step %d", path, self.epoch, self.step)
        if self.dist.is_main:
            truncate_run_logs(self.out, self.step)

    def _finetune(self, path: str) -> None:
        from fastdet.convert import load_any  # also the authors' released files, converted

        ck, _ = load_any(path, self.cfg.model.arch, self.cfg.model.size)
        weights, _ = select_weights(ck)
        skipped = load_weights_tolerant(self.model, weights)
        if self.ema is not None:
            self.ema.reset(self.model)
        msg = f"fine-tuning from {path}"
        theirs = ck.get("class_names") if isinstance(ck, dict) else None
        if skipped and isinstance(theirs, list) and len(theirs) != self.train_set.num_classes:
            msg += (f"; the checkpoint has {len(theirs)} classes and this dataset {self.train_set.num_classes}: "
                    f"{len(skipped)} classification tensors start fresh ({', '.join(skipped[:4])})")
        elif skipped:
            msg += f"; {len(skipped)} tensors of another shape start fresh: {', '.join(skipped[:4])}"
        log.info(msg)

    # ------------------------------------------------------------------ checkpoints / eval
    def _average_bn_stats(self) -> None:
        """``model.all_reduce_bn_stats`` (YOLOX): per-rank BatchNorm statistics averaged over
        the ranks, the model's and the EMA's, so evaluation and checkpoints see one model."""
        if self.cfg.model.all_reduce_bn_stats and self.dist.world_size > 1 and not self.cfg.model.sync_bn:
            dist.average_bn_stats(self.model, *([self.ema.module] if self.ema is not None else []))

    def _weights_state(self) -> dict[str, Any]:
        """What ``best.pth`` keeps: weights to use, not to resume (no optimizer state, which is
        as large as the model)."""
        return {k: v for k, v in self._state().items() if k not in ("optimizer", "scaler", "rng", "rng_ranks")}

    def save(self, name: str) -> None:
        self._average_bn_stats()  # every rank calls save (only rank 0 writes)
        self._rng_ranks = dist.all_gather_objects(rng_state()) if self.dist.world_size > 1 else None
        if self.dist.is_main:
            state = self._weights_state() if name == "best" else self._state()
            # `latest` keeps the one before it (latest.prev.pth) to fall back on.
            save_checkpoint(self.out / f"{name}.pth", state, keep_previous=name == "latest")
        if name == "latest" and getattr(self, "control", None) is not None:
            self.control.checkpoint_saved()

    def evaluate(self) -> None:
        """Predict on the val set (every rank) and hand the detections to the background
        scorer; the score is acted on when it arrives (:meth:`_collect_evals`)."""
        self._average_bn_stats()
        model = self.ema.averaged() if self.ema is not None else self.model
        rng = rng_state()  # evaluation must not perturb the training's random streams
        self.evals.run(model, self.val_loader, self.amp_dtype, registry.predict_kwargs(self.cfg),
                       step=self.step, epoch=self.epoch, state=self._weights_state,
                       current_step=lambda: self.step)
        if self.dist.is_main:
            self.val_predictions = log_val_predictions(
                model, self.val_set.records, registry.family(self.cfg.model.arch).preprocess,
                self.cfg.data.img_size, registry.predict_kwargs(self.cfg), self.val_set.class_names,
                self.tb, self.out, self.step)
        set_rng_state(rng)
        self._collect_evals()

    def _collect_evals(self, wait: bool = False) -> None:
        """Log, record and keep the best of the scores that have arrived (rank 0)."""
        self.evals.collect(self.step, wait=wait)
        self.best_ap = self.evals.best_ap

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, float]:
        cfg, run = self.cfg, self.cfg.run
        total_steps = cfg.optim.epochs * self.steps_per_epoch
        if run.max_steps > 0:
            total_steps = min(total_steps, run.max_steps)
        if getattr(self, "_scaler_state", None):
            self.train_step.scaler.load_state_dict(self._scaler_state)
        if self.step >= total_steps:
            log.info("the run in %s finished at step %d of %d (epoch %d): nothing to train; raise "
                     "--max-steps, or start a new run for more --epochs", self.out, self.step,
                     total_steps, self.epoch)
            self.tb.close()
            return {}
        self._preflight()
        self._start_stop_control()
        # Modes first: warm-up compiles and captures the model in the mode it trains in
        # (Dynamo guards on each module's `training`, a graph bakes BatchNorm's mode in).
        self._train_mode()
        self.compilation.warmup(self.epoch, self.steps_per_epoch)
        log.info("training %s-%s on %s: %d images, %d steps/epoch x %d epochs (%d steps), "
                 "batch %d per rank x %d rank(s) = %d, lr %.4g, train sizes %s, eval size %d, "
                 "amp %s, compile %s, cuda graphs %s, loader %s",
                 cfg.model.arch, cfg.model.size, self.device, len(self.train_set),
                 self.steps_per_epoch, cfg.optim.epochs, total_steps, cfg.data.batch_size,
                 self.dist.world_size, self.world_batch, self.base_lr,
                 ",".join(map(str, cfg.data.train_sizes)), cfg.data.img_size,
                 self.amp_dtype or "off", cfg.compile.compile, cfg.compile.cuda_graphs,
                 self.train_loader.backend)
        progress = Progress(total_steps - self.step, run.progress and self.dist.is_main)
        t_start, steps_at_start = time.perf_counter(), self.step
        self._last_log_t = t_start
        self.gaps = StepGaps()
        while self.step < total_steps:
            if self._train_epoch(total_steps, progress, t_start, steps_at_start):
                progress.close()
                self.evals.close()
                self.tb.close()
                raise TrainingError(f"non-finite loss at step {self.step}: training stopped; "
                                    f"the last good checkpoint is {self.out / 'latest.pth'}")
            epoch_done = self.step % self.steps_per_epoch == 0
            if epoch_done:
                self.epoch += 1
            last = self.step >= total_steps
            if epoch_done or last:
                self.save("latest")
            # The phase of the epoch just finished may switch the interval (YOLOX: every epoch at the end).
            interval = registry.phase(cfg, self.epoch - 1).eval_interval or run.eval_interval
            if last or (epoch_done and self.epoch % interval == 0):
                self.evaluate()
            if self._stop_requested and not last:  # stopped at an epoch's end: saved above
                self._stop_preempted()
        self.control.finish()
        # The last evaluations are waited for; latest.pth then records the best AP.
        try:
            self._collect_evals(wait=True)
        finally:
            self.evals.close()
        # Rank 0 scored: every rank learns whether best.pth moved (save() is collective).
        best_changed, stats = dist.broadcast_object(
            (self.evals.best_changed, self.evals.last_stats) if self.dist.is_main else None)
        if best_changed:
            self.save("latest")
        self.evals.draw_results(self.step)
        stats = stats or {}
        progress.close()
        self.tb.close()
        self.compilation.close()
        if self.dist.is_main:
            log.info("steps %d-%d: longest gap between two steps %.1f s (step %d; evaluation and "
                     "checkpoints between epochs not counted)", steps_at_start + 1, self.step,
                     round(self.gaps.longest, 3), self.gaps.longest_step)  # as metrics.jsonl rounds it
        if stats and self.dist.is_main:
            log.info("final: AP %.4f  AP50 %.4f  (best AP %.4f; checkpoints in %s; val predictions "
                     "drawn in %s)", stats["AP"], stats["AP50"], self.best_ap, self.out,
                     self.val_predictions)
        return stats

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
        self.model.train()
        if self.cfg.model.freeze_bn:
            freeze_bn_stats(self.model)

    def _preflight(self) -> None:
        """The evaluation and checkpoint paths on one eval batch per rank, before step 1
        (fastdet/engine/preflight.py), so that they fail in the first minute."""
        cfg, d = self.cfg, self.dist
        model = self.ema.averaged() if self.ema is not None else self.model
        build = partial(build_eval_loader, cfg.data, preprocess=registry.family(cfg.model.arch).preprocess,
                        rank=d.rank, world_size=d.world_size, device=self.device)
        per_rank = preflight_images(cfg.data.eval_batch_size, self.device)
        try:
            secs = check_end_of_run_path(model, self.val_set, build, self.amp_dtype,
                                         registry.predict_kwargs(cfg), per_rank * d.world_size,
                                         self._state, self.out, d.is_main)
        except PreflightError as e:
            raise TrainingError(str(e)) from e
        log.info("checked before training: evaluation of %d val image(s) per rank (eval loader, predict, "
                 "pycocotools on %s) and a checkpoint write (%.1f s)", per_rank, self.val_set.ann_file.name, secs)

    def _train_epoch(self, total_steps: int, progress: Progress, t_start: float,
                     steps_at_start: int) -> bool:
        """Train until the end of the epoch or ``total_steps``; True if training must stop."""
        cfg, run = self.cfg, self.cfg.run
        self._train_mode()  # evaluation may have left the model in eval mode
        self.train_loader.set_epoch(self.epoch)
        self.gaps.restart()
        skip = self.step - self.epoch * self.steps_per_epoch  # resumed mid-epoch
        kw = registry.phase(cfg, self.epoch).loss_kwargs
        timer, data_time, n_images = Timer(), 0.0, 0
        it = iter(self.train_loader)
        while True:
            batch = self._next_batch(it)
            if batch is None:
                return False
            if skip > 0:
                skip -= 1
                if skip == 0:
                    self.gaps.restart()  # the skipped batches are not a gap between steps
                continue
            data_time += timer.lap()
            self.profiler.before_step(self.step)
            with self._sync_check():
                self.optimizer.set_lr(self.schedule(self.step))
                self.train_step(batch, kw)
            self.step += 1
            self.gaps.tick(self.step)
            maybe_inject_fault(self.dist.rank, self.step)
            n_images += batch["images"].shape[0] * self.dist.world_size
            timer.lap()
            # Every rank gets the same answer: a signal on any rank, a time-sized checkpoint.
            stop, time_due = self.control.poll()
            ckpt_due = (run.ckpt_interval_steps > 0 and self.step % run.ckpt_interval_steps == 0) or time_due
            end = self.step >= total_steps or self.step % self.steps_per_epoch == 0
            log_due = self.step % run.log_interval == 0 or ckpt_due or end or stop
            if self.step == steps_at_start + 1:
                h, w = batch["images"].shape[-2:]
                log.info("first step done %.1f s after start (%s)", time.perf_counter() - _T_START,
                         "compiled" if cfg.compile.compile and self.train_step.is_compiled(h, w, kw)
                         else "eager")
            if not self.dist.distributed or log_due:
                # Ranks agree on ready buckets at log points only (one small all-reduce).
                self.compilation.poll(self.step, self.gaps)
            progress.step(self.compilation.status())
            # Losses are read (and checked) before every checkpoint, so a saved
            # checkpoint never holds weights from after a non-finite loss.
            if log_due:
                if not self._log(progress, t_start, steps_at_start, total_steps, data_time, n_images):
                    return True
                data_time, n_images = 0.0, 0
            if stop and not end:
                self.save("latest")
                self._stop_preempted()
            if stop:  # the epoch's last step: the loop saves (and evaluates) as after any epoch
                self._stop_requested = True
            if ckpt_due:
                self.save("latest")
            if end:
                return False

    def _start_stop_control(self) -> None:
        """SIGTERM / SIGINT handlers and the per-step agreement of the ranks (engine/faults.py)."""
        self._stop_requested = False
        self.control = StopControl(self.dist.world_size, self.cfg.run.ckpt_interval_minutes * 60.0,
                                   self.dist.is_main)
        self.control.install()

    def _stop_preempted(self) -> None:
        """After ``latest.pth`` holds this step: every rank stops (faults.Preempted)."""
        self.control.finish()
        self.evals.close()  # a scoring still running is lost with the stop; latest.pth is saved
        latest = self.out / "latest.pth"
        into = self.step - self.epoch * self.steps_per_epoch
        if self.dist.is_main:
            log.warning("stopped by %s after step %d (step %d of %d in epoch %d); saved %s",
                        self.control.signame or "a signal on another rank", self.step, into,
                        self.steps_per_epoch, self.epoch, latest)
        raise Preempted(self.control.signame or "a signal on another rank", self.step, str(latest),
                        resume_command())

    def _log(self, progress: Progress, t_start: float, steps_at_start: int, total_steps: int,
             data_time: float, n_images: int) -> bool:
        """One host read of the accumulated losses; False on a non-finite loss."""
        n = self.train_step.steps_accumulated
        losses = self.train_step.read_losses()
        if self.dist.distributed:
            losses = dist.mean_dict(losses, self.device)
        if not all(math.isfinite(v) for v in losses.values()):
            bad = ", ".join(f"{k}={v}" for k, v in losses.items() if not math.isfinite(v))
            log.error("non-finite loss at step %d (epoch %d): %s; stopping. The last good "
                      "checkpoint is kept in %s", self.step, self.epoch, bad, self.out)
            return False
        self.train_step.check_recompiles()
        elapsed = time.perf_counter() - t_start
        done = self.step - steps_at_start
        now = time.perf_counter()
        ips = n_images / max(1e-9, now - self._last_log_t)
        self._last_log_t = now
        eta = elapsed / max(1, done) * (total_steps - self.step)
        lr = self.schedule(self.step - 1)
        mem = memory_mb(self.device)
        loss_txt = "  ".join(f"{k} {v:.4f}" for k, v in losses.items())
        log.info("epoch %d  step %d/%d  %s  lr %.3g  %.1f img/s  data %.3f s/it  mem %.0f MB  eta %s",
                 self.epoch, self.step, total_steps, loss_txt, lr, ips, data_time / max(1, n),
                 mem, format_eta(eta))
        progress.describe(f"ep {self.epoch} loss {losses.get('total_loss', float('nan')):.3f}")
        self.tb.scalars({f"train/{k}": v for k, v in losses.items()}, self.step)
        if self.dist.is_main:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"epoch": self.epoch, "step": self.step, "lr": lr,
                                    "images_per_s": ips, "time_s": round(elapsed, 3),
                                    "max_step_gap_s": round(self.gaps.take_interval(), 3),
                                    **losses}) + "\n")
        self.tb.scalars({"train/lr": lr, "train/images_per_s": ips, "train/data_time": data_time / max(1, n),
                         "train/memory_mb": mem}, self.step)
        self._collect_evals()  # scores finished in the background since the last log
        return True


def truncate_run_logs(out: Path, step: int) -> None:
    """Drop the lines of ``metrics.jsonl`` / ``eval.jsonl`` logged after ``step`` (a run
    stopped after its last checkpoint), so a resumed run does not repeat steps."""
    for name in ("metrics.jsonl", "eval.jsonl"):
        f = out / name
        if not f.is_file():
            continue
        lines = f.read_text().splitlines()
        keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if len(keep) != len(lines):
            f.write_text("".join(line + "\n" for line in keep))
            log.info("%s: dropped %d line(s) logged after step %d (the checkpoint resumed from)",
                     f.name, len(lines) - len(keep), step)


def train(cfg: Config) -> dict[str, float]:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.compilation.close()
        if getattr(trainer, "control", None) is not None:
            trainer.control.uninstall()
        dist.shutdown()

