"""Evaluation pictures: PR and F1 curves, the confusion matrix, and the run's results.png.

Drawn with matplotlib (Agg, no display) from what :func:`fastdet.eval.scoring.score`
returns, in the background scorer's process (``draw_evaluation``), so the trainer only
reads the PNG files back for TensorBoard:

- ``PR_curve.png``: precision against recall at IoU 0.5 (all areas, 100 detections), one
  line per class (COCOeval's interpolated precision at 101 recall points) and their mean;
  the legend gives each class's AP50;
- ``F1_curve.png``: F1 against the score threshold, per class and their mean, the best
  mean F1 and its threshold in the title. The F1 at threshold ``c`` is read from the same
  tables: the highest recall point whose score is at least ``c``, and its precision;
- ``confusion_matrix.png``: ``Scores.confusion`` (detections scoring >= 0.25, IoU > 0.5),
  each true-class column normalised to 1, counts written in the cells.

``plot_results(run_dir)`` draws ``results.png`` at the end of training from
``metrics.jsonl`` (every loss, the learning rate) and ``eval.jsonl`` (AP, AP50, AP75).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PR_FILE, F1_FILE, CM_FILE, RESULTS_FILE = "PR_curve.png", "F1_curve.png", "confusion_matrix.png", "results.png"
_MAX_LEGEND = 12  # classes named in a legend; more are drawn thin and grey
_RECALL = np.linspace(0, 1, 101)


def _plt():
    import matplotlib  # heavy (~0.5 s): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg"): no display needed

    return plt


def _valid(scores: Any) -> list[int]:
    """Classes that have ground truth (COCOeval writes -1 for the others)."""
    if scores.precision is None:
        return []
    return [k for k in range(scores.precision.shape[2]) if (scores.precision[0, :, k, 0, -1] > -1).any()]


def _save_curves(plt: Any, fig: Any, ax: Any, any_class: bool, path: Path) -> Path:
    """The common end of the curve plots: grid, a legend (or "no detections"), saved and closed."""
    ax.grid(alpha=0.3)
    if any_class:
        ax.legend(loc="lower left", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no detections", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_pr(scores: Any, path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5.5), dpi=110)
    ks = _valid(scores)
    curves = np.stack([np.clip(scores.precision[0, :, k, 0, -1], 0, None) for k in ks]) if ks else np.zeros((0, 101))
    many = len(ks) > _MAX_LEGEND
    for row, k in zip(curves, ks):
        name = scores.class_names[k]
        ap50 = scores.per_class.get(name, {}).get("AP50", float("nan"))
        ax.plot(_RECALL, row, lw=0.8 if many else 1.2, color="grey" if many else None, alpha=0.6 if many else 1,
                label=None if many else f"{name} {ap50:.3f}")
    if len(ks):
        ax.plot(_RECALL, curves.mean(0), lw=3, color="#1f3b73", label=f"all classes AP50 {curves.mean():.3f}")
    ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0, 1.02),
           title=title or "precision-recall at IoU 0.5")
    return _save_curves(plt, fig, ax, bool(ks), path)


def f1_by_threshold(scores: Any, k: int, thresholds: np.ndarray) -> np.ndarray:
    """F1 of class ``k`` at IoU 0.5 for each score threshold (see the module docstring)."""
    p = scores.precision[0, :, k, 0, -1]
    s = scores.pr_scores[0, :, k, 0, -1]
    reached = (p > 0) & (s > 0)
    out = np.zeros(len(thresholds))
    for i, c in enumerate(thresholds):
        ok = np.flatnonzero(reached & (s >= c))
        if ok.size:
            j = ok[-1]  # highest recall point still at or above the threshold
            out[i] = 2 * p[j] * _RECALL[j] / (p[j] + _RECALL[j])
    return out


def plot_f1(scores: Any, path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5.5), dpi=110)
    thr = np.linspace(0, 1, 101)
    ks = _valid(scores)
    many = len(ks) > _MAX_LEGEND
    curves = np.stack([f1_by_threshold(scores, k, thr) for k in ks]) if ks else np.zeros((0, 101))
    for row, k in zip(curves, ks):
        ax.plot(thr, row, lw=0.8 if many else 1.2, color="grey" if many else None, alpha=0.6 if many else 1,
                label=None if many else scores.class_names[k])
    head = title or "F1 at IoU 0.5"
    if len(ks):
        mean = curves.mean(0)
        best = int(mean.argmax())
        ax.plot(thr, mean, lw=3, color="#1f3b73", label="all classes")
        head += f": best mean F1 {mean[best]:.3f} at score {thr[best]:.2f}"
    ax.set(xlabel="score threshold", ylabel="F1", xlim=(0, 1), ylim=(0, 1.02), title=head)
    return _save_curves(plt, fig, ax, bool(ks), path)


def plot_confusion(scores: Any, path: Path, title: str = "") -> Path:
    plt = _plt()
    m = scores.confusion
    names = list(scores.class_names) + ["background"]
    n = len(names)
    size = min(16, 3 + 0.45 * n)
    fig, ax = plt.subplots(figsize=(size + 1.5, size), dpi=110)
    cols = m.sum(0, keepdims=True)
    norm = np.divide(m, cols, out=np.zeros(m.shape, np.float64), where=cols > 0)
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    if n <= 30:
        ax.set_xticks(range(n), names, rotation=90, fontsize=8)
        ax.set_yticks(range(n), names, fontsize=8)
        for i in range(n):
            for j in range(n):
                if m[i, j]:
                    ax.text(j, i, str(int(m[i, j])), ha="center", va="center", fontsize=7,
                            color="white" if norm[i, j] > 0.5 else "black")
    ax.set(xlabel="true", ylabel="predicted",
           title=title or "confusion matrix (score >= 0.25, IoU > 0.5; background: missed / false)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def draw_evaluation(scores: Any, out_dir: Path, step: int) -> dict[str, str]:
    """The three evaluation PNGs in ``out_dir`` (overwritten at each evaluation); ``{tag: path}``."""
    out_dir = Path(out_dir)
    # Without any detection the curves are drawn empty (``_valid``: no tables), so the
    # files of an earlier evaluation are never left looking current.
    return {
        "PR_curve": str(plot_pr(scores, out_dir / PR_FILE, f"precision-recall at IoU 0.5, step {step}")),
        "F1_curve": str(plot_f1(scores, out_dir / F1_FILE, f"F1 at IoU 0.5, step {step}")),
        "confusion_matrix": str(plot_confusion(scores, out_dir / CM_FILE,
                                               f"confusion matrix (score >= 0.25, IoU > 0.5), step {step}")),
    }


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_results(run_dir: Path) -> Path | None:
    """``results.png``: every logged loss and the LR against the step, and AP / AP50 / AP75."""
    run_dir = Path(run_dir)
    metrics, evals = _jsonl(run_dir / "metrics.jsonl"), _jsonl(run_dir / "eval.jsonl")
    if not metrics and not evals:
        return None
    skip = {"epoch", "step", "lr", "images_per_s"}
    losses = [k for k in (metrics[0] if metrics else {}) if k not in skip]
    panels = [(k, "loss") for k in losses] + [("lr", "lr")] + [("AP", "eval")]
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    plt = _plt()
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), dpi=100, squeeze=False)
    steps = [m["step"] for m in metrics]
    for ax, (key, kind) in zip(axes.flat, panels):
        if kind == "eval":
            es = [e["step"] for e in evals]
            for k, style in (("AP", "o-"), ("AP50", "s-"), ("AP75", "^-")):
                ax.plot(es, [e[k] for e in evals], style, ms=3, label=k)
            ax.set_title("val AP")
            ax.legend(fontsize=8)
        else:
            vals = [m.get(key, np.nan) for m in metrics]
            ax.plot(steps, vals, lw=1, color="#1f77b4" if kind == "loss" else "#ff7f0e")
            if kind == "loss" and len(vals) > 9:  # a running mean: single steps are noisy
                w = max(3, len(vals) // 20)
                smooth = np.convolve(vals, np.ones(w) / w, mode="valid")
                ax.plot(steps[w - 1:], smooth, lw=2, color="#d62728", label=f"mean of {w}")
                ax.legend(fontsize=8)
            ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path = run_dir / RESULTS_FILE
    fig.savefig(path)
    plt.close(fig)
    return path


def read_png(path: str | Path):
    """uint8 ``[3, H, W]`` tensor of a PNG (for TensorBoard)."""
    import torch  # heavy: the scoring process imports this module to draw, and needs no torch

    with Image.open(path) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
