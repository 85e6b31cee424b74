"""Scoring off the training path: training goes on while a (deliberately slow) scoring runs,
and best.pth holds the weights that were evaluated.

The slow scorer below runs in the scorer's background process; it refuses to finish its
first job until ``metrics.jsonl`` shows a training step after the evaluated one, so the
run can only finish if training went on while that job was being scored (a trainer that
waited for the score would time the scorer out and fail the run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastdet.runtime.checkpoint import load_checkpoint
from fastdet.engine.hooks import Hook
from fastdet.eval import async_scoring
from fastdet.eval.scoring import score

WAIT_S = 240


def slow_score(gt, results, image_ids):
    """``score``, but the first job waits for training step ``$FASTDET_TEST_WAIT_STEP`` to be
    logged, and a later job's AP is raised by 0.5 (a few steps score AP 0 at every step, and
    a best.pth that never moved past the first evaluation would pass on that tie)."""
    run_dir = Path(os.environ["FASTDET_TEST_RUN_DIR"])
    wait_step = int(os.environ["FASTDET_TEST_WAIT_STEP"])
    marker = run_dir / "slow_score_started"
    first = not marker.exists()
    if first:
        marker.write_text(str(time.time()))
        deadline = time.time() + WAIT_S
        metrics = run_dir / "metrics.jsonl"
        while True:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if any(json.loads(line)["step"] >= wait_step for line in lines):
                break
            if time.time() > deadline:
                raise TimeoutError(f"no training step {wait_step} while scoring: training waited for the score")
            time.sleep(0.1)
    scores = score(gt, results, image_ids)
    if not first:  # the later evaluation scores higher, so best.pth has to move to its weights
        scores.stats = {**scores.stats, "AP": scores.stats["AP"] + 0.5}
    return scores


def perfect_results(ann_file: Path) -> tuple[list[int], list[dict]]:
    """The val set's image ids, and its own boxes as detections (AP 1)."""
    doc = json.loads(ann_file.read_text())
    return [im["id"] for im in doc["images"]], [
        {"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9}
        for a in doc["annotations"]]


def test_the_scorer_outlives_a_ctrl_c(demo_paths):
    """Ctrl-C signals the terminal's whole process group: the scorer ignores it (the
    trainer stops at a step boundary and waits for the score); before, it died and the
    run's last evaluation was lost with "the scoring process exited"."""
    import signal

    ids, res = perfect_results(demo_paths.val_ann)
    s = async_scoring.AsyncScorer(str(demo_paths.val_ann))
    try:
        s.submit(res, ids, {"step": 1})
        assert len(s.wait(timeout=120)) == 1  # up and scoring
        os.kill(s._proc.pid, signal.SIGINT)
        s.submit(res, ids, {"step": 2})
        (job,) = s.wait(timeout=120)
        assert job.meta == {"step": 2} and job.scores.stats["AP"] == pytest.approx(1.0)
    finally:
        s.close()


def test_scorer_round_trip_and_errors(demo_paths):
    ids, res = perfect_results(demo_paths.val_ann)
    s = async_scoring.AsyncScorer(str(demo_paths.val_ann))
    try:
        a = s.submit(res, ids, {"step": 3})
        b = s.submit([{"image_id": ids[0], "score": 0.5}], ids, {"step": 4})  # a result without a box
        jobs = {j.job_id: j for j in s.wait(timeout=120)}
        assert s.pending == 0 and s.poll() == []
        assert jobs[a].meta == {"step": 3} and jobs[a].scores.stats["AP"] == pytest.approx(1.0)
        assert jobs[b].scores is None and "Error" in jobs[b].error
        assert score(str(demo_paths.val_ann), res, ids).stats == jobs[a].scores.stats
    finally:
        s.close()
    bad = async_scoring.AsyncScorer(str(demo_paths.val_ann) + ".missing")
    try:
        bad.submit(res, ids, {})
        with pytest.raises(RuntimeError, match="could not load the ground truth"):
            bad.wait(timeout=120)
    finally:
        bad.close()


SCORER_PROBE = """
import sys


def modules(gt, results, image_ids):
    # The main module's code ran here if its name is defined (multiprocessing's child
    # bootstrap is a bare "-c" main otherwise).
    return {"torch": "torch" in sys.modules, "main ran": hasattr(sys.modules["__main__"], "TRAINER_LIKE")}
"""

TRAINER_LIKE_MAIN = """
import json
import sys

import torch  # what the trainer's main module (python -m fastdet.train) holds

from fastdet.eval import async_scoring

TRAINER_LIKE = True

if __name__ == "__main__":
    s = async_scoring.AsyncScorer(sys.argv[1], score_fn="scorer_probe:modules")
    s.submit([], [], {"step": 1})
    (job,) = s.wait(timeout=120)
    s.close()
    print(json.dumps(job.scores if job.error is None else job.error))
"""


def test_the_scorer_process_runs_neither_the_main_module_nor_torch(demo_paths, tmp_path):
    """Started from ``python -m <a module importing torch>``, as the trainer starts it, the
    scoring process imports no torch: spawn does not re-run the main module there, and the
    scoring path (ground truth, COCOeval, plots) needs none (~3 s of CPU per launch)."""
    (tmp_path / "scorer_probe.py").write_text(SCORER_PROBE)
    (tmp_path / "trainer_like.py").write_text(TRAINER_LIKE_MAIN)
    r = subprocess.run([sys.executable, "-m", "trainer_like", str(demo_paths.val_ann)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"torch": False, "main ran": False}


class PointRecorder(Hook):
    """Records each named point the trainer calls, with its step and epoch."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []

    def before_train(self, trainer):
        self.calls.append(("before_train", trainer.step, trainer.epoch))

    def after_step(self, trainer):
        self.calls.append(("after_step", trainer.step, trainer.epoch))

    def after_epoch(self, trainer):
        self.calls.append(("after_epoch", trainer.step, trainer.epoch))

    def after_train(self, trainer):
        self.calls.append(("after_train", trainer.step, trainer.epoch))


def test_training_goes_on_while_scoring_and_best_holds_the_evaluated_weights(demo_small, tmp_path,
                                                                              monkeypatch):
    from fastdet.runtime import dist
    from fastdet.engine.eval_hook import EvalRunner
    from fastdet.engine.trainer import Trainer
    from fastdet.train import build_parser, resolve_config

    out = tmp_path / "run"
    # 23 train images with boxes, batch 4: 5 steps an epoch; evaluated after epoch 1 (step 5)
    # and at the last step (6).
    monkeypatch.setenv("FASTDET_TEST_RUN_DIR", str(out))
    monkeypatch.setenv("FASTDET_TEST_WAIT_STEP", "6")
    args = build_parser().parse_args([
        "--arch", "ppyoloe", "--size", "s", "--data", str(demo_small), "--device", "cpu",
        "--img-size", "64", "--no-multiscale", "--batch-size", "4", "--epochs", "2", "--max-steps", "6", "--eval-interval", "1",
        "--output-dir", str(out), "--workers", "0", "--log-interval", "1",
        "--set", "data.eval_batch_size=8", "--set", "optim.warmup_steps=2"])
    torch.manual_seed(0)
    points = PointRecorder()
    trainer = Trainer(resolve_config(args), hooks=[points])
    trainer.evals.runner = EvalRunner(trainer.val_set, trainer.out, trainer.metrics.tb, is_main=True,
                                      score_fn=f"{__name__}:slow_score")
    evaluated: dict[int, dict[str, torch.Tensor]] = {}
    evaluate = trainer.evaluate

    def evaluate_and_keep_weights():
        evaluated[trainer.step] = {k: v.clone() for k, v in trainer.ema.averaged().state_dict().items()}
        evaluate()

    trainer.evaluate = evaluate_and_keep_weights
    try:
        stats = trainer.train()
    finally:
        dist.shutdown()
    assert sorted(evaluated) == [5, 6]
    # The trainer's hooks ran at their named points: (point, step, epoch) in the order called.
    assert points.calls == [("before_train", 0, 0), *[("after_step", s, 0) for s in range(1, 6)],
                            ("after_epoch", 5, 1), ("after_step", 6, 1), ("after_epoch", 6, 1),
                            ("after_train", 6, 1)]
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 6]
    # The first score arrived while training went on (it could not finish before step 6).
    assert records[0]["collected_step"] >= 6 and records[1]["collected_step"] == 6
    assert stats["AP"] == records[-1]["AP"]
    best_step = max(records, key=lambda r: (r["AP"], -r["step"]))["step"]
    assert best_step == 6  # slow_score's later job scores higher (two scores of 0 tie at step 5)
    best = load_checkpoint(out / "best.pth")
    assert best["step"] == best_step and best["best_ap"] == max(r["AP"] for r in records)
    weights = best["ema"]["module"] if "module" in best["ema"] else best["ema"]
    for k, v in evaluated[best_step].items():
        torch.testing.assert_close(weights[k], v, rtol=0, atol=0, msg=k)
    latest = load_checkpoint(out / "latest.pth")
    moved = [k for k, v in evaluated[5].items() if v.is_floating_point()
             and not torch.equal(v, (latest["ema"].get("module", latest["ema"]))[k])]
    assert moved, "the weights did not change after step 5: the check above would prove nothing"
    assert latest["best_ap"] == best["best_ap"]
    # The start-up model summary is in the run directory (tests/test_summary.py checks its figures).
    assert "M parameters" in (out / "model_summary.txt").read_text()
    # TensorBoard got the scores at the evaluated steps.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/AP")] == [5, 6]
    assert [e.step for e in acc.Scalars("val_AP/circle")] == [5, 6]  # per class too
    assert records[0]["per_class"].keys() == {"circle", "rectangle", "triangle", "cross"}
    # The evaluation plots (drawn by the scorer's process) and results.png, as files and images.
    images = set(acc.Tags()["images"])
    assert {"val/PR_curve", "val/F1_curve", "val/confusion_matrix", "results", "val/predictions"} <= images
    assert [e.step for e in acc.Images("val/confusion_matrix")] == [5, 6]
    for name in ("PR_curve.png", "F1_curve.png", "confusion_matrix.png", "results.png", "val_predictions.jpg"):
        assert (out / name).stat().st_size > 10_000, name
