"""Every registered family through the command line its users run, on the small demo set.

- ``python -m fastdet.train --arch A --compile`` with each loader (torch and DALI's CPU
  mode), a few steps at 64 px, ending in the trainer's COCO evaluation;
- ``python -m fastdet.eval --ckpt`` on that checkpoint gives the trainer's AP again
  (boxes mapped back from the family's letterbox or keep-ratio canvas by both);
- YOLOX: ``torchrun`` with 2 processes trains as 1 process does, and resume is exact
  across the switch into its no-aug phase (mosaic off, L1 on), with mosaic before it.

The compiled runs use the ``aot_eager`` backend: Dynamo and AOTAutograd trace the graphs
inductor would get (same guards, recompiles, phases), without inductor's C++ build,
which takes many minutes per family on a 2-core CPU (``tests/test_train.py`` runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port
from test_train import assert_same_training  # tests/ is on sys.path (rootdir conftest)

from fastdet.runtime.checkpoint import load_checkpoint
from fastdet.models import ARCHITECTURES

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS: tests/conftest.py
COMPILE = ["--compile", "--set", "compile.backend=aot_eager", "--set", "compile.warmup=blocking"]
# The smallest size of each family. Each compiled CLI run takes a minute or more on a
# 2-core CPU, so `make test` keeps one of them (YOLOX with DALI, the loader with every
# stage) and the rest of the matrix is marked slow (`make test-all`).
SMALLEST = {"ppyoloe": "s", "yolox": "nano", "fcos": "r50", "ppyolo": "r18vd"}
IN_MAKE_TEST = {("yolox", "nano", "dali")}


def train_cmd(data: Path, out: Path, arch: str, size: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fastdet.train", "--arch", arch, "--size", size,
            "--data", str(data), "--device", "cpu", "--img-size", "64", "--no-multiscale",
            "--batch-size", "4", "--epochs", "1", "--output-dir", str(out), "--workers", "1",
            "--log-interval", "1", "--set", "data.eval_batch_size=8", "--set", "optim.warmup_steps=2", *extra]


def run(cmd: list[str], timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_family_has_a_cli_case():
    assert set(SMALLEST) == set(ARCHITECTURES)
    for arch, size in SMALLEST.items():
        assert size in ARCHITECTURES[arch].sizes


def _cases():
    out = []
    for arch in sorted(ARCHITECTURES):
        for size in ARCHITECTURES[arch].sizes if arch == "ppyolo" else (SMALLEST[arch],):
            for loader in ("torch", "dali"):
                marks = [] if (arch, size, loader) in IN_MAKE_TEST else [pytest.mark.slow]
                out.append(pytest.param(arch, size, loader, marks=marks, id=f"{arch}-{size}-{loader}"))
    return out


@pytest.fixture(scope="module")
def compiled_run(demo_small, tmp_path_factory):
    """``(arch, size, loader) -> (output dir, completed process)`` of a 2-step compiled CLI
    run, each made once per module (the eval test reuses the training test's run)."""
    done: dict = {}

    def get(arch: str, size: str, loader: str):
        if (arch, size, loader) not in done:
            out = tmp_path_factory.mktemp(f"{arch}_{size}_{loader}")
            r = run(train_cmd(demo_small, out, arch, size, "--max-steps", "2", "--loader", loader, *COMPILE))
            done[arch, size, loader] = out, r
        return done[arch, size, loader]

    return get


def _dali_or_torch() -> str:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return "torch"
    return "dali"


@pytest.mark.parametrize("arch, size, loader", _cases())
def test_compiled_training_with_each_loader(arch, size, loader, compiled_run):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    out, r = compiled_run(arch, size, loader)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"loader {loader}" in r.stdout and "compile True" in r.stdout
    assert "size bucket(s) x" in r.stdout and "compiled" in r.stdout  # the warm-up line
    assert "recompiled" not in r.stdout + r.stderr
    assert "COCO AP" in r.stdout
    logged = metrics(out)
    assert [m["step"] for m in logged] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["total_loss"])) for m in logged)
    assert (out / "latest.pth").is_file()


@pytest.mark.parametrize("arch", [a if a == "yolox" else pytest.param(a, marks=pytest.mark.slow)
                                  for a in sorted(SMALLEST)])
def test_eval_cli_gives_the_trainers_ap(arch, demo_small, compiled_run, tmp_path):
    """With an AP far from 0, of the evaluated weights (the EMA; FCOS's recipe keeps none:
    its plain weights): two steps score AP 0 on the demo's boxes whatever the weights. A
    copy of the run gets head predictors of distinct boxes (tests/own_truth.py, every
    family's head), other ones in its plain weights where it has an EMA; the val boxes
    become the evaluated weights' own detections; the copy, resumed at its last step with
    that step's evaluation dropped, evaluates them."""
    from own_truth import demo_with_own_truth, redraw_run_predictors

    out, r = compiled_run(arch, SMALLEST[arch], _dali_or_torch())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rerun = tmp_path / "run"
    shutil.copytree(out, rerun)
    redraw_run_predictors(rerun, arch)
    out, data = rerun, demo_with_own_truth(demo_small, tmp_path / "own", rerun / "latest.pth", img_size=64)
    rr = run([sys.executable, "-m", "fastdet.train", "--resume", "--output-dir", str(out), "--data", str(data),
              "--device", "cpu"])
    assert rr.returncode == 0 and "evaluating it now" in rr.stdout, rr.stdout[-3000:] + rr.stderr[-3000:]
    trained = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert trained["step"] == 2 and trained["AP"] > 0.5, trained
    ev = run([sys.executable, "-m", "fastdet.eval", "--ckpt", str(out / "latest.pth"),
              "--data", str(data), "--device", "cpu"])
    assert ev.returncode == 0, ev.stderr[-3000:]
    ap_line = next(l for l in ev.stdout.splitlines() if l.startswith("COCO AP"))
    assert float(ap_line.split()[2]) == pytest.approx(trained["AP"], abs=1e-4)


# --------------------------------------------------------------------------- YOLOX

# YOLOX-nano in its own recipe's two phases, shortened: 2 epochs of 5 steps (23 of the 24
# train images have objects), the second one the no-aug phase (mosaic, affine and mixup
# off, the L1 loss on, evaluation every epoch). Mosaic always on before the switch, so the
# partner records drawn from (seed, epoch, step) are part of what resume must reproduce.
YOLOX_PHASES = ["--epochs", "2", "--set", "optim.no_aug_epochs=1", "--set", "family.mosaic_prob=1.0",
                "--set", "run.eval_interval=100"]


def test_yolox_resume_is_exact_across_the_no_aug_switch(demo_small, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    a = run(train_cmd(demo_small, full, "yolox", "nano", "--max-steps", "8", *YOLOX_PHASES))
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    b1 = run(train_cmd(demo_small, part, "yolox", "nano", "--max-steps", "3", *YOLOX_PHASES))
    assert b1.returncode == 0, b1.stderr[-3000:]
    b2 = run(train_cmd(demo_small, part, "yolox", "nano", "--max-steps", "8", "--resume", *YOLOX_PHASES))
    assert b2.returncode == 0, b2.stderr[-3000:]
    assert "resumed from" in b2.stdout
    ma, mb = metrics(full), metrics(part)
    assert [m["step"] for m in mb] == list(range(1, 9))
    # Steps 6-8 are in the no-aug phase: the L1 term is on there and only there.
    assert all(m["loss_l1"] == 0 for m in ma[:5]) and all(m["loss_l1"] > 0 for m in ma[5:])
    for x, y in zip(ma, mb):
        for k in ("total_loss", "loss_iou", "loss_obj", "loss_cls", "loss_l1", "lr"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
    wa, wb = load_checkpoint(full / "latest.pth"), load_checkpoint(part / "latest.pth")
    for key in ("model", "ema"):
        for k, v in wa[key].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(v, wb[key][k], rtol=1e-4, atol=1e-5, msg=f"{key}.{k}")


# One process and two gloo ranks of half the batch, as tests/test_train.py compares
# PP-YOLOE: no augmentation, frozen BatchNorm statistics (per-rank BatchNorm sees half the
# batch), a real LR from the first step (no 5-epoch quadratic warm-up) so that the weights
# move far more than the tolerance.
YOLOX_SAME_RUN = ["--no-augment", "--max-steps", "3", "--img-size", "128", "--lr", "0.05",
                  "--set", "optim.ref_batch=4", "--set", "optim.warmup_epochs=0", "--set", "model.freeze_bn=true",
                  "--set", "run.eval_interval=100"]


def yolox_two_ranks_cmd(data, out, port: int, *flags: str) -> list[str]:
    """torchrun, 2 ranks on this machine, of the one-process YOLOX-nano command with half its
    batch per rank (the same images per step)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(port), "-m", "fastdet.train"]
    cmd = torchrun + train_cmd(data, out, "yolox", "nano", *flags)[3:]
    cmd[cmd.index("--batch-size") + 1] = "2"
    return cmd


def test_yolox_two_ranks_match_one_process(demo_small, tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = run(train_cmd(demo_small, one, "yolox", "nano", *YOLOX_SAME_RUN))
    assert r1.returncode == 0, r1.stdout[-3000:] + r1.stderr[-3000:]
    r2 = run(yolox_two_ranks_cmd(demo_small, two, free_port(), *YOLOX_SAME_RUN))
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert_same_training(one, two, "yolox", "nano")


def test_yolox_bn_statistics_are_averaged_over_ranks_before_checkpoints(demo_small, tmp_path):
    """YOLOX trains plain per-rank BatchNorm and, as Megvii's all_reduce_norm, averages the
    running statistics over the ranks before each checkpoint and evaluation. After one step
    of 2 ranks x 2 images (different images per rank), the first BatchNorm's running mean
    (its input does not depend on the other ranks) is then the mean over all 4 images: the
    one-process run's, for the model and its EMA. Without the averaging, rank 0's checkpoint
    holds the statistics of its own 2 images only."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, two = tmp_path / "one", tmp_path / "two"
    same = ["--no-augment", "--max-steps", "1", "--set", "optim.warmup_epochs=0"]
    r1 = run(train_cmd(demo_small, one, "yolox", "nano", *same))
    assert r1.returncode == 0, r1.stdout[-3000:] + r1.stderr[-3000:]
    r2 = run(yolox_two_ranks_cmd(demo_small, two, free_port(), *same))
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert "running statistics averaged over the ranks" in r2.stdout
    a, b = load_checkpoint(one / "latest.pth"), load_checkpoint(two / "latest.pth")
    key = next(k for k in a["model"] if k.endswith("running_mean"))
    init = torch.zeros_like(a["model"][key])
    assert (a["model"][key] - init).abs().max() > 1e-2, "the statistics did not move"
    torch.testing.assert_close(b["model"][key], a["model"][key], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b["ema"]["module"][key], a["ema"]["module"][key], rtol=1e-4, atol=1e-5)
