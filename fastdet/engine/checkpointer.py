"""The trainer's checkpoints: what they hold, writing them, and starting from one.

- :func:`auto_resume`: ``--resume auto`` or a torchrun restart picks this run directory's
  ``latest.pth`` before any data is read (or refuses another config's checkpoint).
- :class:`Checkpointer` (``Trainer.checkpoints``): the state of ``latest.pth`` and
  ``best.pth`` (:meth:`~Checkpointer.state`, :meth:`~Checkpointer.weights_state`),
  :meth:`~Checkpointer.save_latest` (every rank calls it; rank 0 writes), :meth:`~Checkpointer.resume`
  (``--resume``: weights, optimizer, counters, each rank's random streams) and
  :meth:`~Checkpointer.finetune` (``--ckpt`` without ``--resume``: the weights that fit).
- :func:`truncate_run_logs`: a resumed run drops the log lines written after its checkpoint.

The file format and reading are ``fastdet.runtime.checkpoint``'s.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from fastdet.config import Config
from fastdet.convert import load_any
from fastdet.engine.faults import config_mismatch, restart_count
from fastdet.engine.finetune import load_for_finetune
from fastdet.runtime import dist
from fastdet.runtime.checkpoint import (load_checkpoint, load_with_fallback, previous_path, rng_state, select_weights,
                                       save_checkpoint, set_rng_state)

log = logging.getLogger("fastdet")

# Where --resume starts from: (the checkpoint when rank 0 already read it, its path), or None
# for ``--ckpt`` / ``latest.pth`` read when the model is built.
ResumeFrom = tuple[dict[str, Any] | None, Path] | None


def auto_resume(cfg: Config, out: Path, is_main: bool) -> tuple[Config, ResumeFrom]:
    """``--resume auto`` or a torchrun restart: continue from ``out``'s ``latest.pth``
    (``latest.prev.pth`` if it is damaged) when its config is this run's, start the run when
    there is none, refuse a checkpoint of another config. Rank 0 decides and tells the
    others. Returns ``cfg`` (with ``run.resume`` set when it continues) and where from."""
    restarts = restart_count()
    if cfg.run.resume or not (cfg.run.auto_resume or restarts > 0):
        return cfg, None
    why = f"torchrun restart {restarts}" if restarts > 0 else "--resume auto"
    latest = out / "latest.pth"
    decision: tuple[str | None, str | None] = (None, None)
    loaded = None
    if is_main and (latest.exists() or previous_path(latest).exists()):
        try:
            ck, path = load_with_fallback(latest, warn=log.warning)
            bad = config_mismatch(ck.get("config") or {}, cfg.to_dict())
            decision = (None, f"{why}: {path} is another run's ({'; '.join(bad)}): use another "
                              "--output-dir") if bad else (str(path), None)
            loaded = None if bad else ck
        except (ValueError, FileNotFoundError) as e:
            decision = (None, f"{why}: {e}")
    elif is_main and not cfg.run.exist_ok and (out / "best.pth").exists():  # a run's weights, no latest.pth
        decision = (None, f"{why}: {out} holds {out / 'best.pth'} but no latest.pth to continue from: starting "
                          "here would replace that run's weights; choose another --output-dir, or --exist-ok to "
                          "write over it")
    path, error = dist.broadcast_object(decision)
    if error:
        raise ValueError(error)
    if path is None:
        log.info("%s: no checkpoint in %s: starting the run", why, out)
        return cfg, None
    log.info("%s: continuing from %s", why, path)
    return replace(cfg, run=replace(cfg.run, resume=True, ckpt=None)), (loaded, Path(path))


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


def step_on_resize(step: int, epoch: int, old_steps_per_epoch: int | None, old_batch: int, new_batch: int,
                   steps_per_epoch: int) -> int:
    """The step at which a run saved at ``step`` (``epoch`` epochs done, epochs of
    ``old_steps_per_epoch`` steps of ``old_batch`` images) continues with batches of
    ``new_batch`` images, ``steps_per_epoch`` to an epoch: the images its epoch has seen,
    in the new batches (rounded), and at most the epoch's last step (that batch again). A
    checkpoint without its steps per epoch (an earlier fastdet) restarts its epoch."""
    if not old_steps_per_epoch:
        return epoch * steps_per_epoch
    done = round((step - epoch * old_steps_per_epoch) * old_batch / new_batch)
    return epoch * steps_per_epoch + min(done, steps_per_epoch - 1)


class Checkpointer:
    """Checkpointing and the resume / fine-tune state of one run.

    Args:
        cfg: the run's resolved config (stored in every checkpoint).
        out: the run directory.
        dist_info: ``runtime.dist.init_distributed``'s answer (rank, world size).
        model, ema, optimizer: what the checkpoints hold (``ema`` may be None). SyncBatchNorm
            conversion later swaps modules inside ``model`` in place, so the reference holds.
        train_set: the training set (its classes go into every checkpoint).
        steps_per_epoch: this run's (stored, so a resume on another number of processes
            finds where in its epoch the run was).
    """

    def __init__(self, cfg: Config, out: Path, dist_info: Any, model: nn.Module, ema: Any, optimizer: Any,
                 train_set: Any, steps_per_epoch: int):
        self.cfg, self.out, self.dist = cfg, out, dist_info
        self.steps_per_epoch = steps_per_epoch
        self.model, self.ema, self.optimizer, self.train_set = model, ema, optimizer, train_set
        # The train step's GradScaler (use_scaler), built after the weights are restored, and
        # the state a resumed checkpoint holds for it.
        self.scaler: Any = None
        self.scaler_state: dict[str, Any] = {}
        # Whether out/latest.pth is this run's (a resumed one's is): only this run's is kept as
        # latest.prev.pth, the one a damaged latest.pth falls back to.
        self._latest_is_ours = cfg.run.resume

    def use_scaler(self, scaler: Any) -> None:
        """The train step's GradScaler: saved from now on, restored when resuming."""
        self.scaler = scaler
        if self.scaler_state:
            scaler.load_state_dict(self.scaler_state)

    def average_bn_stats(self) -> None:
        """``model.all_reduce_bn_stats`` (YOLOX): per-rank BatchNorm statistics averaged over
        the ranks, the model's and the EMA's, so evaluation and checkpoints see one model."""
        if self.cfg.model.all_reduce_bn_stats and self.dist.world_size > 1 and not self.cfg.model.sync_bn:
            dist.average_bn_stats(self.model, *([self.ema.module] if self.ema is not None else []))

    def state(self, epoch: int, step: int, best_ap: float, rng_ranks: list[Any] | None = None) -> dict[str, Any]:
        """What ``latest.pth`` holds: enough to resume exactly."""
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "epoch": epoch,
            "step": step,
            "best_ap": best_ap,
            "config": self.cfg.to_dict(),
            "cat_ids": list(self.train_set.cat_ids),
            "class_names": list(self.train_set.class_names),
            "rng": rng_state(),
            # Every rank's random streams (rank r resumes with its own: PP-YOLO's DropBlock
            # draws on each rank), gathered by save().
            "rng_ranks": rng_ranks or [],
            "world_size": self.dist.world_size,
            "steps_per_epoch": self.steps_per_epoch,
        }

    def weights_state(self, epoch: int, step: int, best_ap: float) -> dict[str, Any]:
        """What ``best.pth`` keeps: weights to use, not to resume (no optimizer state, which is
        as large as the model)."""
        return {k: v for k, v in self.state(epoch, step, best_ap).items()
                if k not in ("optimizer", "scaler", "rng", "rng_ranks")}

    def save_latest(self, epoch: int, step: int, best_ap: float) -> None:
        """``latest.pth``: every rank calls it (BatchNorm statistics and random streams are
        gathered), rank 0 writes, keeping the one before it (latest.prev.pth) to fall back
        on. (``best.pth`` is the evaluated weights, written by the evaluation: eval_hook.py.)"""
        self.average_bn_stats()
        rng_ranks = dist.all_gather_objects(rng_state()) if self.dist.world_size > 1 else None
        if self.dist.is_main:
            latest = self.out / "latest.pth"
            save_checkpoint(latest, self.state(epoch, step, best_ap, rng_ranks), keep_previous=self._latest_is_ours)
            if not self._latest_is_ours:  # --exist-ok over another run: its checkpoints are not this run's fallback
                previous_path(latest).unlink(missing_ok=True)
                self._latest_is_ours = True

    def _load_resume_checkpoint(self, source: ResumeFrom) -> tuple[dict[str, Any], Path]:
        """The checkpoint to resume from: the one auto-resume chose, ``--ckpt``, or
        ``latest.pth`` (falling back to ``latest.prev.pth``, with a warning)."""
        if source is not None:
            ck, path = source
            return (ck if ck is not None else load_checkpoint(path)), path
        if self.cfg.run.ckpt:
            return load_checkpoint(self.cfg.run.ckpt), Path(self.cfg.run.ckpt)
        latest = self.out / "latest.pth"
        if not latest.is_file() and not previous_path(latest).is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {latest} (train once without --resume)")
        return load_with_fallback(latest, warn=log.warning)

    def resume(self, source: ResumeFrom, world_batch: int, base_lr: float) -> tuple[int, int, float]:
        """Weights, EMA, optimizer and this rank's random streams from the checkpoint (the
        scaler's state waits for :meth:`use_scaler`); returns its (epoch, step, best AP).
        ``world_batch``, ``base_lr``: this run's. On another number of processes an epoch
        has another number of steps: the step returned is the checkpoint's place in its
        epoch counted in this run's batches (:func:`step_on_resize`)."""
        ck, path = self._load_resume_checkpoint(source)
        if "optimizer" not in ck:
            raise ValueError(f"--resume: {path} holds weights only (best.pth keeps no optimizer state): "
                             "resume from latest.pth, or fine-tune from it with --ckpt and no --resume")
        # The set's classes may have changed under the run (a file edited, a reader that reads
        # it otherwise): said here, before the head's shapes fail to load.
        trained, now = [str(n) for n in ck.get("class_names") or []], list(self.train_set.class_names)
        if trained and trained != now:
            raise ValueError(f"--resume: {path} trained {len(trained)} classes, the set has {len(now)} now "
                             f"(only in the run: {[n for n in trained if n not in now][:8] or 'none'}, only in the "
                             f"set: {[n for n in now if n not in trained][:8] or 'none'}; the same names in another "
                             "order otherwise): start a new run, or fine-tune from it with --ckpt (classes are "
                             "matched by name)")
        self.model.load_state_dict(ck["model"])
        if self.ema is not None and ck.get("ema") is not None:
            self.ema.load_state_dict(ck["ema"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scaler_state = ck.get("scaler") or {}
        epoch, step, best_ap = ck["epoch"], ck["step"], ck.get("best_ap", -1.0)
        log.info("resumed from %s after step %d (%d epoch(s) done)", path, step, epoch)
        if ck.get("world_size", 1) == self.dist.world_size:
            ranks = ck.get("rng_ranks") or []
            set_rng_state(ranks[self.dist.rank] if len(ranks) == self.dist.world_size else ck["rng"])
            if self.dist.is_main:
                truncate_run_logs(self.out, step)
            return epoch, step, best_ap
        was = ck.get("world_size", 1)
        old_batch = self.cfg.data.batch_size * was
        new_step = step_on_resize(step, epoch, ck.get("steps_per_epoch"), old_batch, world_batch, self.steps_per_epoch)
        if self.dist.is_main:
            log.warning("resuming a run trained on %d process(es) on %d: the total batch is now %d (was %d), the "
                        "LR scales with it to %.4g, an epoch is %d steps, and the data order and augmentation "
                        "draws differ from an uninterrupted run; its step %d is step %d in the new batches "
                        "(epoch %d, %d of %d steps done%s), from which the logs count", was, self.dist.world_size,
                        world_batch, old_batch, base_lr, self.steps_per_epoch, step, new_step, epoch + 1,
                        new_step - epoch * self.steps_per_epoch, self.steps_per_epoch,
                        "" if ck.get("steps_per_epoch") else ": a checkpoint of an earlier fastdet, whose place in "
                        "the epoch is not known, restarts the epoch")
            truncate_run_logs(self.out, new_step)  # the logs go on in the new steps, as TensorBoard does
        return epoch, new_step, best_ap

    def finetune(self, path: str) -> None:
        """Start from ``path``'s weights (ours, or the authors' released files, converted),
        each class's head rows taken from the checkpoint's class of the same name
        (engine/finetune.py). With ``--ckpt-partial`` a released file is converted at the size
        its shapes say, and the tensors that fit this run's size are loaded."""
        partial = self.cfg.run.ckpt_partial
        ck, _ = load_any(path, self.cfg.model.arch, None if partial else self.cfg.model.size)
        try:
            msg = load_for_finetune(self.model, ck, self.train_set.class_names)
        except ValueError as e:  # little fits (another family's weights, with --ckpt-partial)
            model = ck["config"].get("model") or {}
            raise ValueError(f"--ckpt {path} ({model.get('arch')}-{model.get('size')} weights): {e}; this run "
                             f"trains {self.cfg.model.arch}-{self.cfg.model.size}") from None
        if self.cfg.model.freeze_backbone and not self.cfg.model.backbone_weights:
            self._check_frozen_backbone_loaded(ck, path)
        if self.ema is not None:
            self.ema.reset(self.model)
        log.info("fine-tuning from %s; %s", path, msg)

    def _check_frozen_backbone_loaded(self, ck: dict[str, Any], path: str) -> None:
        """--freeze-backbone keeps the backbone as --ckpt left it: every backbone tensor must
        have come from it (with --ckpt-partial from another size, the ones of another shape
        start fresh and would stay random for the whole run). One ValueError line."""
        weights, _ = select_weights(ck)
        own = {k: v for k, v in self.model.state_dict().items() if k.startswith("backbone.")}
        fresh = [k for k, v in own.items() if k not in weights or tuple(weights[k].shape) != tuple(v.shape)]
        if fresh:
            raise ValueError(f"--freeze-backbone with --ckpt {path}: {len(fresh)} of {len(own)} backbone tensors are "
                             f"not in it at {self.cfg.model.arch}-{self.cfg.model.size}'s shapes (first: {fresh[0]}) "
                             "and would stay random for the whole run: give a checkpoint of this size, or "
                             "--backbone-weights, or drop --freeze-backbone")
