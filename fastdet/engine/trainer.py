"""The plain training loop: data -> step -> log, with checkpoints and evaluation.

Nothing here names an architecture: the family's recipe (``fastdet.recipes``) says what
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
from typing import Any, Callable

import torch
from torch import nn

from fastdet import recipes
from fastdet.config import Config
from fastdet.data.coco import load_coco, resolve_data
from fastdet.data.loader import build_eval_loader, build_train_loader
from fastdet.engine import dist
from fastdet.engine.checkpoint import (load_checkpoint, load_weights_tolerant, rng_state,
                                       save_checkpoint, set_rng_state)
from fastdet.engine.logging import (Nvtx, Progress, ProfilerWindow, TensorBoard, Timer,
                                    format_eta, memory_mb, setup_logging)
from fastdet.engine.optim import LRSchedule, build_optimizer_and_ema
from fastdet.engine.previews import log_val_predictions
from fastdet.engine.step import TrainStep, resolve_amp
from fastdet.eval.coco import evaluate
from fastdet.models.recipe import pretrained_backbone_note

log = logging.getLogger("fastdet")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, a recompile after warm-up)."""


def output_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir.format(arch=cfg.model.arch, size=cfg.model.size)).expanduser()


def freeze_bn_stats(model: nn.Module) -> None:
    """Put every BatchNorm in eval mode (running statistics fixed, affine still trained)."""
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.eval()


class Trainer:
    """Set up in small named steps (process, data, model, loaders, restore, step), then
    :meth:`train`."""

    def __init__(self, cfg: Config):
        cfg = recipes.resolve(cfg)
        self._setup_process(cfg)
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
        self.dist = dist.init_distributed(self.device.type, cuda_graphs=cfg.compile.cuda_graphs)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
            # The input sizes are a fixed set of buckets, so cuDNN's per-shape autotuning
            # pays off; it runs at each bucket's first (warm-up) step. TF32 only on request:
            # it changes results (10-bit mantissa in convolutions and matmuls).
            torch.backends.cudnn.benchmark = True
            torch.backends.cudnn.allow_tf32 = cfg.compile.tf32
            torch.backends.cuda.matmul.allow_tf32 = cfg.compile.tf32
        self.out = output_dir(cfg)
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        setup_logging(self.out, self.dist.is_main)
        dist.seed_everything(cfg.run.seed, self.dist.rank)

    def _load_data(self, cfg: Config) -> Config:
        """The train and val sets; returns ``cfg`` with ``model.num_classes`` set from them."""
        d = cfg.data
        paths = resolve_data(d)
        self.train_set = load_coco(paths.train_ann, paths.train_images, train=True, keep_empty=d.keep_empty_train,
                                   check_images=d.check_images, cache_dir=d.cache_dir)
        self.val_set = load_coco(paths.val_ann, paths.val_images, train=False,
                                 check_images=d.check_images, cache_dir=d.cache_dir)
        if len(self.train_set) == 0:
            raise ValueError(f"{paths.train_ann}: no usable training images ({self.train_set.report.summary()})")
        if self.train_set.cat_ids != self.val_set.cat_ids:
            raise ValueError(f"{paths.val_ann}: categories differ from {paths.train_ann}")
        return replace(cfg, model=replace(cfg.model, num_classes=self.train_set.num_classes))

    def _build_model(self) -> None:
        """The detector on the device, the AMP dtype, the optimizer and the EMA."""
        cfg = self.cfg
        self.model = recipes.build_detector(cfg).to(self.device)
        if cfg.model.backbone_weights and not cfg.run.resume:  # a resumed run has them in its state
            self.model.load_backbone_weights(cfg.model.backbone_weights)
        note = pretrained_backbone_note(recipes.recipe(cfg.model.arch), cfg.model.size, cfg.data.data,
                                        cfg.model.backbone_weights, cfg.run.ckpt or cfg.run.resume)
        if note and self.dist.is_main:
            log.info(note)
        if cfg.data.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.amp_dtype = resolve_amp(cfg.compile.amp, self.device)
        self.world_batch = cfg.data.batch_size * self.dist.world_size
        self.optimizer, self.ema, self.base_lr = build_optimizer_and_ema(
            cfg.optim, self.model, self.world_batch, self.device)

    def _build_loaders(self) -> None:
        """The loaders and the LR schedule, which needs the number of steps per epoch."""
        cfg, d = self.cfg, self.dist
        # The family's phase decides each epoch's augmentation; the loader rebuilds its
        # chain only when the stage list changes.
        self.train_loader = build_train_loader(cfg.data, self.train_set,
                                               stages_for_epoch=lambda epoch: recipes.phase(cfg, epoch).stages,
                                               rank=d.rank, world_size=d.world_size, device=self.device,
                                               seed=cfg.run.seed)
        self.val_loader = build_eval_loader(cfg.data, self.val_set,
                                            preprocess=recipes.family(cfg.model.arch).preprocess,
                                            rank=d.rank, world_size=d.world_size,
                                            device=self.device)
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(self.train_set)} images, fewer than one batch of "
                f"{self.world_batch}: lower --batch-size")
        self.schedule = LRSchedule.from_config(cfg.optim, self.base_lr, self.steps_per_epoch)

    def _build_step(self) -> None:
        """The (compiled, DDP-wrapped when distributed) train step, TensorBoard and the profiler."""
        cfg = self.cfg
        # Before the step is built: it may convert BatchNorm to SyncBatchNorm in self.model.
        ddp = self._ddp_wrapper() if self.dist.distributed else None
        self.train_step = TrainStep(
            self.model, self.model, self.optimizer, self.ema, self.device, self.amp_dtype,
            clip_grad_norm=cfg.optim.clip_grad_norm, compile=cfg.compile.compile,
            cuda_graphs=cfg.compile.cuda_graphs, dynamic=cfg.compile.dynamic,
            graph_warmup_iters=11 if self.dist.distributed else 3, nvtx=Nvtx(cfg.run.nvtx),
            ddp=ddp, backend=cfg.compile.backend)
        self.tb = TensorBoard(self.out / "tb" if self.dist.is_main and cfg.run.tensorboard else None)
        self.profiler = ProfilerWindow(cfg.run.profile_steps, self.device)

    def _start_run_files(self) -> None:
        """The resolved config next to the run; a fresh run in an old directory starts its logs anew."""
        if self.dist.is_main:
            self.cfg.dump(self.out / "config.yaml")
            if not self.cfg.run.resume:
                for name in ("metrics.jsonl", "eval.jsonl"):
                    (self.out / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ helpers
    def _ddp_wrapper(self) -> Callable[[nn.Module], nn.Module]:
        """Convert BatchNorm to SyncBatchNorm where it can be, and return what wraps the
        step's (compiled) module in DDP: TrainStep calls it, so that DDP wraps the compiled
        module and not the other way round (fastdet/engine/step.py says why)."""
        if self.device.type == "cuda":
            if self.cfg.compile.compile:
                log.info("SyncBatchNorm is not traceable by torch.compile (Dynamo graph-breaks on "
                         "it): --compile keeps per-rank BatchNorm")
            else:
                # In place: the new SyncBatchNorm modules keep the same parameter tensors,
                # so the optimizer built above still holds them.
                self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
            return partial(nn.parallel.DistributedDataParallel, device_ids=[self.device.index])
        log.info("distributed on the CPU (gloo): torch's SyncBatchNorm needs CUDA, so each rank "
                 "uses plain BatchNorm on its own batch")
        return nn.parallel.DistributedDataParallel

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
            "world_size": self.dist.world_size,
        }

    def _resume(self) -> None:
        path = Path(self.cfg.run.ckpt) if self.cfg.run.ckpt else self.out / "latest.pth"
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {path} (train once without --resume)")
        ck = load_checkpoint(path)
        self.model.load_state_dict(ck["model"])
        if self.ema is not None and ck.get("ema") is not None:
            self.ema.load_state_dict(ck["ema"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self._scaler_state = ck.get("scaler") or {}
        self.epoch, self.step, self.best_ap = ck["epoch"], ck["step"], ck.get("best_ap", -1.0)
        if ck.get("world_size", 1) == self.dist.world_size:
            set_rng_state(ck["rng"])
        log.info("resumed from %s at epoch %d, step %d", path, self.epoch, self.step)

    def _finetune(self, path: str) -> None:
        from fastdet.convert import load_any  # also the authors' released files, converted

        ck, _ = load_any(path, self.cfg.model.arch, self.cfg.model.size)
        weights = ck.get("ema") or ck.get("model") or ck
        if isinstance(weights, dict) and "module" in weights:
            weights = weights["module"]
        skipped = load_weights_tolerant(self.model, weights)
        if self.ema is not None:
            self.ema.reset(self.model)
        msg = f"fine-tuning from {path}"
        if skipped:
            msg += f"; {len(skipped)} tensors left freshly initialised (shape differs, e.g. a " \
                   f"different number of classes): {', '.join(skipped[:4])}"
        log.info(msg)

    # ------------------------------------------------------------------ checkpoints / eval
    def save(self, name: str) -> None:
        if self.dist.is_main:
            save_checkpoint(self.out / f"{name}.pth", self._state())

    def evaluate(self) -> dict[str, float]:
        model = self.ema.averaged() if self.ema is not None else self.model
        t = time.perf_counter()
        rng = rng_state()  # evaluation must not perturb the training's random streams
        stats = evaluate(model, self.val_loader, self.val_set, self.amp_dtype, recipes.predict_kwargs(self.cfg))
        set_rng_state(rng)
        log.info("eval (%s weights) epoch %d: AP %.4f  AP50 %.4f  AP75 %.4f  (%.1f s)",
                 "EMA" if self.ema is not None else "model", self.epoch, stats["AP"],
                 stats["AP50"], stats["AP75"], time.perf_counter() - t)
        self.tb.scalars(stats, self.step, prefix="val/")
        if self.dist.is_main:
            with open(self.out / "eval.jsonl", "a") as f:
                f.write(json.dumps({"epoch": self.epoch, "step": self.step, **stats}) + "\n")
            self.val_predictions = log_val_predictions(
                model, self.val_set.records, recipes.family(self.cfg.model.arch).preprocess,
                self.cfg.data.img_size, recipes.predict_kwargs(self.cfg), self.val_set.class_names,
                self.tb, self.out, self.step)
        return stats

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, float]:
        cfg, run = self.cfg, self.cfg.run
        total_steps = cfg.optim.epochs * self.steps_per_epoch
        if run.max_steps > 0:
            total_steps = min(total_steps, run.max_steps)
        if getattr(self, "_scaler_state", None):
            self.train_step.scaler.load_state_dict(self._scaler_state)
        # Modes first: warm-up compiles and captures the model in the mode it trains in
        # (Dynamo guards on each module's `training`, a graph bakes BatchNorm's mode in).
        self._train_mode()
        self._warmup()
        log.info("training %s-%s on %s: %d images, %d steps/epoch x %d epochs (%d steps), "
                 "batch %d x %d rank(s), lr %.4g, amp %s, compile %s, cuda graphs %s, loader %s",
                 cfg.model.arch, cfg.model.size, self.device, len(self.train_set),
                 self.steps_per_epoch, cfg.optim.epochs, total_steps, cfg.data.batch_size,
                 self.dist.world_size, self.base_lr, self.amp_dtype or "off", cfg.compile.compile,
                 cfg.compile.cuda_graphs, self.train_loader.backend)
        progress = Progress(total_steps - self.step, run.progress and self.dist.is_main)
        stats: dict[str, float] = {}
        t_start, steps_at_start = time.perf_counter(), self.step
        self._last_log_t = t_start
        while self.step < total_steps:
            if self._train_epoch(total_steps, progress, t_start, steps_at_start):
                progress.close()
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
            interval = recipes.phase(cfg, self.epoch - 1).eval_interval or run.eval_interval
            if last or (epoch_done and self.epoch % interval == 0):
                stats = self.evaluate()
                if stats["AP"] > self.best_ap:
                    self.best_ap = stats["AP"]
                    self.save("best")
                    self.save("latest")
        progress.close()
        self.tb.close()
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

    def _train_mode(self) -> None:
        self.model.train()
        if self.cfg.model.freeze_bn:
            freeze_bn_stats(self.model)

    def _warmup(self) -> None:
        cfg = self.cfg
        if not (cfg.compile.compile or cfg.compile.cuda_graphs):
            return
        sizes = self.train_loader.sizes
        last_epoch = cfg.optim.epochs - 1
        if cfg.run.max_steps > 0:
            last_epoch = min(last_epoch, (cfg.run.max_steps - 1) // self.steps_per_epoch)
        # Every phase the rest of the run goes through: its distinct loss arguments x the
        # loader's size buckets, so that nothing compiles after warm-up.
        variants = recipes.loss_variants(cfg, self.epoch, last_epoch)
        t = time.perf_counter()
        self.train_step.warmup(list(sizes), cfg.data.batch_size, cfg.data.max_boxes,
                               variants, channels_last=cfg.data.channels_last)
        log.info("warm-up: %d size bucket(s) x %d loss variant(s) compiled%s in %.1f s",
                 len(sizes), len(variants), " and captured" if cfg.compile.cuda_graphs else "",
                 time.perf_counter() - t)

    def _train_epoch(self, total_steps: int, progress: Progress, t_start: float,
                     steps_at_start: int) -> bool:
        """Train until the end of the epoch or ``total_steps``; True if training must stop."""
        cfg, run = self.cfg, self.cfg.run
        self._train_mode()  # evaluation may have left the model in eval mode
        self.train_loader.set_epoch(self.epoch)
        skip = self.step - self.epoch * self.steps_per_epoch  # resumed mid-epoch
        kw = recipes.phase(cfg, self.epoch).loss_kwargs
        timer, data_time, n_images = Timer(), 0.0, 0
        nvtx = self.train_step.nvtx
        it = iter(self.train_loader)
        while True:
            with nvtx("data"):
                batch = next(it, None)
            if batch is None:
                return False
            if skip > 0:
                skip -= 1
                continue
            data_time += timer.lap()
            self.profiler.before_step(self.step)
            with self._sync_check():
                self.optimizer.set_lr(self.schedule(self.step))
                self.train_step(batch, kw)
            self.step += 1
            n_images += batch["images"].shape[0] * self.dist.world_size
            timer.lap()
            ckpt_due = run.ckpt_interval_steps > 0 and self.step % run.ckpt_interval_steps == 0
            end = self.step >= total_steps or self.step % self.steps_per_epoch == 0
            # Losses are read (and checked) before every checkpoint, so a saved
            # checkpoint never holds weights from after a non-finite loss.
            if self.step % run.log_interval == 0 or ckpt_due or end:
                if not self._log(progress, t_start, steps_at_start, total_steps, data_time, n_images):
                    return True
                data_time, n_images = 0.0, 0
            if ckpt_due:
                self.save("latest")
            if end:
                return False

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
        progress.update(n, f"ep {self.epoch} loss {losses.get('total_loss', float('nan')):.3f}")
        self.tb.scalars({f"train/{k}": v for k, v in losses.items()}, self.step)
        if self.dist.is_main:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"epoch": self.epoch, "step": self.step, "lr": lr,
                                    "images_per_s": ips, **losses}) + "\n")
        self.tb.scalars({"train/lr": lr, "train/images_per_s": ips, "train/data_time": data_time / max(1, n),
                         "train/memory_mb": mem}, self.step)
        return True


def train(cfg: Config) -> dict[str, float]:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        dist.shutdown()

