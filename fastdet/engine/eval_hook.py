"""The trainer's evaluation and best checkpoint: when to evaluate, predict, hand off, and act on
the score when it comes.

:class:`EvalHook` is the trainer's collaborator (``Trainer.evals``): after an epoch it says
whether an evaluation is due (:meth:`EvalHook.due`: the run's interval, or the interval of
the family's phase), ``Trainer.evaluate`` hands it the model to score
(:meth:`EvalHook.evaluate`: the val predictions drawn too, the training's random streams
untouched), the log points collect the scores that arrived (:meth:`EvalHook.collect`), and
the end of training waits for the last ones (:meth:`EvalHook.finish`).

:meth:`EvalHook.evaluate` calls :meth:`EvalRunner.run`: every rank predicts its val shard and
the detections are gathered on rank 0 (``fastdet.eval.coco.gather_predictions``); rank 0
submits them, with the step, the epoch and a CPU copy of the evaluated state, to the
background scorer (``fastdet.eval.async_scoring``) and training goes on. Scores are
collected at the trainer's log points (:meth:`EvalRunner.collect`) and, before the run
exits, waited for (``collect(wait=True)``). For each one, on rank 0:

- the log line (the 12 numbers, the scoring time, the step the score arrived at) and the
  per-class AP / AP50 table;
- a line in ``eval.jsonl`` (``epoch``, ``step``: the evaluated ones; the 12 numbers;
  ``per_class``; ``scored_s``; ``collected_step``) and TensorBoard scalars at the
  evaluated step (``val/AP`` ..., ``val_AP/<class>``, ``val_AP50/<class>``);
- the PR / F1 curves and the confusion matrix (``fastdet.eval.plots``, drawn in the
  scorer's process) as PNGs in the run directory and TensorBoard images (``val/PR_curve``,
  ``val/F1_curve``, ``val/confusion_matrix``); ``draw_results`` draws ``results.png`` at
  the end of training;
- a new best AP writes ``best.pth`` from the state captured when the weights were
  evaluated.

With ``run.async_eval`` off the score is waited for inside ``run`` (the behaviour before
background scoring: the same outputs, in the same order).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from fastdet.engine.previews import log_val_predictions
from fastdet.runtime import dist
from fastdet.runtime.checkpoint import rng_state, save_checkpoint, set_rng_state
from fastdet.eval.async_scoring import DEFAULT_SCORE_FN, AsyncScorer, ScoredJob
from fastdet.eval.coco import gather_predictions, gt_source
from fastdet.eval.plots import plot_results, read_png

log = logging.getLogger("fastdet")


def cpu_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (a snapshot training cannot change)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


class EvalRunner:
    """The trainer's evaluations, scored in the background (rank 0 owns the scorer).

    Args:
        dataset: the val ``CocoDataset`` (its ground truth: ``coco_gt`` or ``ann_file``).
        out_dir: the run directory (``eval.jsonl``, ``best.pth``, the plots).
        tb: ``fastdet.runtime.logging.TensorBoard``.
        is_main: rank 0.
        async_eval: score in the background (False: wait inside :meth:`run`).
        best_ap: the best AP so far (a resumed run's); a score above it writes ``best.pth``.
    """

    def __init__(self, dataset: Any, out_dir: Path, tb: Any, *, is_main: bool, async_eval: bool = True,
                 score_fn: str = DEFAULT_SCORE_FN, plots: bool = True, best_ap: float = -1.0):
        self.dataset, self.out, self.tb = dataset, Path(out_dir), tb
        self.is_main, self.async_eval, self.score_fn = is_main, async_eval, score_fn
        self.plots = plots
        self.scorer: AsyncScorer | None = None
        self.best_ap = best_ap  # a resumed run's, from its checkpoint
        self.best_changed = False  # a best.pth written since the trainer last saved latest.pth
        self.last_stats: dict[str, float] = {}

    def _scorer(self) -> AsyncScorer:
        if self.scorer is None:
            self.scorer = AsyncScorer(gt_source(self.dataset), score_fn=self.score_fn,
                                      plot_dir=str(self.out) if self.plots else None)
        return self.scorer

    def run(self, model, loader, amp_dtype, predict_kwargs: dict[str, Any], *, step: int, epoch: int,
            state: Callable[[], dict[str, Any]]) -> None:
        """Predict (every rank), gather, and submit on rank 0; ``state()`` is the checkpoint to keep."""
        t = time.perf_counter()
        gathered = gather_predictions(model, loader, self.dataset, amp_dtype, predict_kwargs)
        if gathered is None:  # not rank 0
            return
        results, image_ids = gathered
        meta = {"step": step, "epoch": epoch, "state": cpu_copy(state()), "predict_s": time.perf_counter() - t}
        self._scorer().submit(results, image_ids, meta)
        if not self.async_eval:
            self.collect(step, wait=True)

    def collect(self, current_step: int, wait: bool = False) -> list[dict[str, float]]:
        """Act on the scores finished (all pending ones with ``wait``); returns their stats."""
        if self.scorer is None or not self.is_main:
            return []
        jobs = self.scorer.wait() if wait else self.scorer.poll()
        out = []
        for job in jobs:
            if job.error is not None:
                raise RuntimeError(f"scoring the evaluation of step {job.meta['step']} failed: {job.error}")
            self._record(job, current_step)
            out.append(job.scores.stats)
        return out

    def _record(self, job: ScoredJob, current_step: int) -> None:
        m, s = job.meta, job.scores
        stats = s.stats
        lag = f", arrived at step {current_step}" if current_step != m["step"] else ""
        log.info("eval epoch %d step %d: AP %.4f  AP50 %.4f  AP75 %.4f  APs %.4f  APm %.4f  APl %.4f  "
                 "(predict %.1f s, scored in %.1f s by %s%s)", m["epoch"], m["step"], stats["AP"], stats["AP50"],
                 stats["AP75"], stats["APs"], stats["APm"], stats["APl"], m["predict_s"], job.seconds,
                 s.backend, lag)
        if s.per_class:
            log.info("per-class AP at step %d:\n%s", m["step"], s.per_class_table())
        self.tb.scalars(stats, m["step"], prefix="val/")
        for name, v in s.per_class.items():
            if v["AP"] >= 0:
                self.tb.scalars({f"val_AP/{name}": v["AP"], f"val_AP50/{name}": v["AP50"]}, m["step"])
        record = {"epoch": m["epoch"], "step": m["step"], **stats, "per_class": s.per_class,
                  "scored_s": round(job.seconds, 3), "collected_step": current_step}
        with open(self.out / "eval.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.last_stats = stats
        for tag, path in job.extra.get("plots", {}).items():
            self.tb.image(f"val/{tag}", read_png(path), m["step"])
        if "plot_error" in job.extra:
            log.warning("the evaluation plots of step %d were not drawn: %s", m["step"], job.extra["plot_error"])
        if stats["AP"] > self.best_ap:
            self.best_ap = stats["AP"]
            state = m["state"]
            state["best_ap"] = self.best_ap
            save_checkpoint(self.out / "best.pth", state)
            self.best_changed = True
            log.info("new best AP %.4f: best.pth holds the weights of step %d", self.best_ap, m["step"])

    def draw_results(self, step: int) -> Optional[Path]:
        """``results.png`` of the run so far (losses, LR, AP), also as a TensorBoard image (rank 0)."""
        if not (self.is_main and self.plots):
            return None
        try:
            path = plot_results(self.out)
        except Exception as e:  # noqa: BLE001 - a plot must not fail a finished run
            log.warning("results.png was not drawn: %s: %s", type(e).__name__, e)
            return None
        if path is not None:
            self.tb.image("results", read_png(path), step)
        return path

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None


class EvalHook:
    """When the trainer evaluates, with what, and what it does with the scores.

    Args:
        runner: the :class:`EvalRunner` that scores and keeps ``best.pth``.
        val_loader: the eval loader (every rank predicts its shard).
        amp_dtype: the training's autocast dtype, or None.
        predict_kwargs: the family's post-processing (``registry.predict_kwargs``).
        preprocess: the family's preprocessing, for the drawn val predictions.
        img_size: the evaluation size.
        phase: ``phase(epoch)``, the family's phase of an epoch (its ``eval_interval``).
        eval_interval: ``run.eval_interval``, the interval of a phase that sets none.
    """

    def __init__(self, runner: EvalRunner, val_loader: Any, *, amp_dtype: torch.dtype | None,
                 predict_kwargs: dict[str, Any], preprocess: Callable, img_size: int,
                 phase: Callable[[int], Any], eval_interval: int):
        self.runner, self.val_loader, self.amp_dtype = runner, val_loader, amp_dtype
        self.predict_kwargs, self.preprocess, self.img_size = predict_kwargs, preprocess, img_size
        self.phase, self.eval_interval = phase, eval_interval
        self.val_predictions: Path | None = None  # the last drawn set (engine/previews.py)

    @property
    def best_ap(self) -> float:
        return self.runner.best_ap

    def due(self, epoch: int, epoch_done: bool, last: bool) -> bool:
        """After the loop's epoch pass (``epoch``: the next one): the run's last step always,
        else the end of every ``interval``-th epoch."""
        # The phase of the epoch just finished may switch the interval (YOLOX: every epoch at the end).
        interval = self.phase(epoch - 1).eval_interval or self.eval_interval
        return last or (epoch_done and epoch % interval == 0)

    def evaluate(self, model: torch.nn.Module, *, step: int, epoch: int,
                 state: Callable[[], dict[str, Any]]) -> None:
        """Predict on the val set (every rank) and hand the detections to the background
        scorer; the score is acted on when it arrives (:meth:`collect`). ``state()``: the
        checkpoint ``best.pth`` keeps if these weights score best."""
        rng = rng_state()  # evaluation must not perturb the training's random streams
        self.runner.run(model, self.val_loader, self.amp_dtype, self.predict_kwargs, step=step, epoch=epoch,
                        state=state)
        if self.runner.is_main:
            ds = self.runner.dataset
            self.val_predictions = log_val_predictions(
                model, ds.records, self.preprocess, self.img_size, self.predict_kwargs, ds.class_names,
                self.runner.tb, self.runner.out, step)
        set_rng_state(rng)
        self.collect(step)

    def collect(self, step: int) -> None:
        """Log, record and keep the best of the scores that have arrived (rank 0)."""
        self.runner.collect(step)

    def finish(self, step: int) -> tuple[bool, dict[str, float]]:
        """The last scores waited for, the scorer closed and ``results.png`` drawn; every
        rank gets (whether ``best.pth`` moved since the last ``latest.pth``, the last scores)."""
        try:
            self.runner.collect(step, wait=True)
        finally:
            self.runner.close()
        # Rank 0 scored: every rank learns whether best.pth moved (the trainer's save is collective).
        best_changed, stats = dist.broadcast_object(
            (self.runner.best_changed, self.runner.last_stats) if self.runner.is_main else None)
        self.runner.draw_results(step)
        return best_changed, stats or {}

    def recorded(self, step: int) -> bool:
        """Whether ``eval.jsonl`` holds an evaluation of ``step`` (rank 0 reads it; every
        rank gets the answer, so that all evaluate or none)."""
        found = False
        if self.runner.is_main:
            f = self.runner.out / "eval.jsonl"
            found = f.is_file() and any(json.loads(line).get("step") == step
                                        for line in f.read_text().splitlines() if line.strip())
        return dist.broadcast_object(found)

    def report(self, stats: dict[str, float]) -> None:
        if stats and self.runner.is_main:
            log.info("final: AP %.4f  AP50 %.4f  (best AP %.4f; checkpoints in %s; val predictions "
                     "drawn in %s)", stats["AP"], stats["AP50"], self.best_ap, self.runner.out,
                     self.val_predictions)

    def close(self) -> None:
        """A stop or a failure: a scoring still running is lost (``latest.pth`` is saved)."""
        self.runner.close()
