"""The trainer through its command line, on the small demo set, on the CPU.

Each run is a subprocess (as a user runs it), at 64-96 px with a handful of steps.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from in_process import main_in_process
from ports import free_port

from fastdet.engine.hooks import Hook
from fastdet.runtime.checkpoint import load_checkpoint
from fastdet.models import build_model

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS: tests/conftest.py


def train_cmd(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fastdet.train", "--arch", "ppyoloe", "--size", "s",
            "--data", str(data), "--device", "cpu", "--img-size", "64", "--no-multiscale",
            "--batch-size", "4", "--epochs", "2", "--output-dir", str(out), "--workers", "0",
            "--log-interval", "1", "--set", "data.eval_batch_size=8",
            "--set", "optim.warmup_steps=2", *extra]


def run(cmd: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def eager_run(demo_small, tmp_path_factory):
    out = tmp_path_factory.mktemp("eager")
    r = run(train_cmd(demo_small, out, "--max-steps", "3"))
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r


def test_demo_training_writes_checkpoint_tensorboard_and_ap(eager_run):
    out, r = eager_run
    assert "COCO AP" in r.stdout
    ck = load_checkpoint(out / "latest.pth")  # weights_only=True
    assert ck["step"] == 3 and ck["epoch"] == 0
    assert {"model", "ema", "optimizer", "scaler", "config", "rng", "cat_ids"} <= set(ck)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ck["model"])
    assert ck["config"]["model"]["num_classes"] == 4 and ck["cat_ids"] == [1, 3, 7, 12]
    assert (out / "best.pth").is_file() and (out / "config.yaml").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/total_loss", "train/lr", "train/images_per_s", "val/AP", "val/AP50"} <= tags
    assert [e.step for e in acc.Scalars("train/total_loss")] == [1, 2, 3]
    logged = [m["total_loss"] for m in metrics(out)]
    assert [e.value for e in acc.Scalars("train/total_loss")] == pytest.approx(logged)
    line = next(l for l in r.stdout.splitlines() if "step 3/" in l)
    for field in ("epoch 1/2 ", "loss_cls", "lr ", "img/s", "data ", "mem ", "eta "):
        assert field in line, line
    # Each line's longest gap between steps is its step's time (log interval 1), and the
    # run's longest is the largest of them, named with its step.
    m = metrics(out)
    assert all(b["time_s"] > a["time_s"] for a, b in zip(m, m[1:]))
    for a, b in zip(m, m[1:]):
        assert b["max_step_gap_s"] == pytest.approx(b["time_s"] - a["time_s"], abs=0.25)
    worst = max(m, key=lambda x: x["max_step_gap_s"])
    assert f"longest gap between two steps {worst['max_step_gap_s']:.1f} s (step {worst['step']};" in r.stdout


def test_step_gaps_count_steps_not_the_time_between_epochs(monkeypatch):
    from fastdet.runtime import logging as L

    clock = iter([0.0, 2.0, 3.0, 103.0, 110.0, 140.0, 141.0])
    monkeypatch.setattr(L.time, "perf_counter", lambda: next(clock))
    g = L.StepGaps()
    g.restart()                       # epoch 0 begins at t=0
    assert g.tick(1) == 2.0 and g.tick(2) == 1.0
    assert g.take_interval() == 2.0 and g.take_interval() == 0.0
    g.restart()                       # epoch 1 begins at t=103 after a 100 s evaluation
    assert g.tick(3) == 7.0 and g.tick(4) == 30.0 and g.tick(5) == 1.0
    assert (g.longest, g.longest_step) == (30.0, 4) and g.take_interval() == 30.0


def test_eval_cli_on_the_checkpoint(eager_run, demo_small, tmp_path, capsys, caplog):
    """The eval CLI scores best.pth as the trainer scored it, with an AP far from 0. Three
    steps put out one box everywhere (AP 0 on the demo's boxes, as any weights would): a
    copy of the run gets head predictors of distinct boxes (tests/own_truth.py), other ones
    in its EMA than in its plain weights; the val boxes become the EMA's own best
    detections; the copy, resumed at its last step with that step's evaluation dropped,
    evaluates it. The CLI must print that AP, and ``--weights model`` the plain weights'
    (as a file holding only them is scored)."""
    from own_truth import demo_with_own_truth, redraw_run_predictors

    from fastdet.eval.__main__ import main as eval_main
    from fastdet.runtime.checkpoint import save_checkpoint

    out, _ = eager_run
    rerun = tmp_path / "run"
    shutil.copytree(out, rerun)
    ck = redraw_run_predictors(rerun, "ppyoloe")
    data = demo_with_own_truth(demo_small, tmp_path / "own", rerun / "latest.pth", img_size=64)
    r = run([sys.executable, "-m", "fastdet.train", "--resume", "--output-dir", str(rerun), "--data", str(data),
             "--device", "cpu", "--workers", "0"])
    assert r.returncode == 0 and "evaluating it now" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    trained = json.loads((rerun / "eval.jsonl").read_text().splitlines()[-1])
    assert trained["step"] == 3 and trained["AP"] > 0.5, trained
    # In this process (python -m fastdet.eval is test_families_cli's and test_formats's).
    code, said, err = main_in_process(["--ckpt", str(rerun / "best.pth"), "--data", str(data), "--device", "cpu"],
                                      capsys, caplog, "fastdet.eval")
    assert code == 0, err
    ap_line = next(l for l in said.splitlines() if l.startswith("COCO AP"))
    assert float(ap_line.split()[2]) == pytest.approx(trained["AP"], abs=1e-4)

    def ap(path, *extra: str) -> float:
        assert eval_main(["--ckpt", str(path), "--data", str(data), "--device", "cpu", *extra]) == 0
        return float(next(l for l in capsys.readouterr().out.splitlines() if l.startswith("COCO AP")).split()[2])

    save_checkpoint(tmp_path / "plain.pth", {k: v for k, v in ck.items() if k not in ("ema", "optimizer")})
    plain = ap(rerun / "best.pth", "--weights", "model")
    assert plain == ap(tmp_path / "plain.pth") and plain < trained["AP"] - 0.2
    # --set changes the recipe's post-processing: one detection an image misses the val
    # boxes after each image's first (the demo's images hold several).
    assert ap(rerun / "best.pth", "--set", "family.max_det=1") < trained["AP"] - 0.2


@pytest.mark.parametrize("extra, message", [
    (["--set", "optim.base_lr=0.1"], "--set optim.base_lr: only the post-processing (family.<field>) can change "
                                     "here"),
    (["--set", "family.static_assigner_epoch=3"], "family.static_assigner_epoch: only the post-processing can "
                                                   "change here, and ppyoloe's reads family.score_thresh, "
                                                   "family.nms_iou, family.max_det, family.pre_nms_topk, "
                                                   "family.per_class_topk"),
    (["--set", "family.nms_iou=1.5"], "family.nms_iou must be in [0, 1], got 1.5"),
    (["--set", "family.max_det=0"], "family.max_det must be at least 1, got 0"),
    (["--set", "family.max_det=many"], "family.max_det"),
    (["--set", "family.nms_iou"], "--set 'family.nms_iou': expected section.field=value"),
])
def test_eval_set_takes_only_the_post_processing_in_range(eager_run, tmp_path, capsys, extra, message):
    """``fastdet.eval --set``: a field evaluation does not read (another section, a training
    field of the family) or a value out of range is one line, exit 2, before the data is read
    (the --data given does not exist)."""
    from fastdet.eval.__main__ import main as eval_main

    out, _ = eager_run
    code = eval_main(["--ckpt", str(out / "best.pth"), "--data", str(tmp_path / "no_such_set"), "--device", "cpu",
                      *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_val_image_that_does_not_decode_is_left_out_of_the_evaluation(eager_run, demo_small, tmp_path, capsys,
                                                                        caplog):
    """A val JPEG cut short (its header reads, its pixels do not) is a counted, named skip:
    the evaluation scores the other images and says so; before, the eval loader left it out
    and the evaluation then failed with "the eval loader dropped images" (a run, after its
    whole schedule)."""
    out, _ = eager_run
    data = tmp_path / "data"
    shutil.copytree(demo_small, data)
    bad = sorted((data / "val2017").glob("*.jpg"))[5]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 3])
    code, stdout, stderr = main_in_process(["--ckpt", str(out / "best.pth"), "--data", str(data), "--device", "cpu"],
                                           capsys, caplog, "fastdet.eval")
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    said = stdout + stderr
    assert bad.name in said and "1 of 8 val images do not decode and are left out of this evaluation" in said
    assert any(line.startswith("COCO AP") for line in stdout.splitlines())


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--img-size", "100"], "--img-size must be a positive multiple of 32"),
])
def test_eval_cli_bad_values_fail_before_any_work_in_one_line(tmp_path, capsys, extra, message):
    """Before the checkpoint is read (here it does not exist): exit 2, one line naming the flag."""
    from fastdet.eval.__main__ import main as eval_main

    assert eval_main(["--ckpt", str(tmp_path / "never_read.pth"), "--data", "demo", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_eval_cli_without_the_loader_it_asks_for_is_one_line(eager_run, demo_small, capsys, monkeypatch):
    """``--loader dali`` where DALI cannot run: LoaderError's one line, not a traceback."""
    from fastdet.data import loader
    from fastdet.eval.__main__ import main as eval_main

    monkeypatch.setattr(loader, "dali_unavailable_reason", lambda device: "nvidia-dali is not installed (test)")
    out, _ = eager_run
    assert eval_main(["--ckpt", str(out / "best.pth"), "--data", str(demo_small), "--device", "cpu",
                      "--loader", "dali"]) == 1
    err = capsys.readouterr().err
    assert "--loader dali: nvidia-dali is not installed (test)" in err and len(err.strip().splitlines()) == 1, err


# 24 train images (23 with objects) / batch 4 = 5 steps per epoch; a run stopped mid-epoch 0
# resumes across the phase switch at epoch 1 (ATSS -> task-aligned assignment), as a user
# resumes a recipe with phases (YOLOX's no-aug epochs, PP-YOLOE's assigner).
PHASES = ("--set", "family.static_assigner_epoch=1")


@pytest.fixture(scope="module")
def stopped_and_resumed(demo_small, tmp_path_factory):
    """A run of ``PHASES`` stopped after step 4 and resumed to step 8, both launched with
    ``--resume auto`` (what torchrun's restarts do; the first finds no checkpoint and starts
    the run) -> (its folder, the two completed processes)."""
    part = tmp_path_factory.mktemp("resume") / "part"
    b1 = run(train_cmd(demo_small, part, "--max-steps", "4", "--resume", "auto", *PHASES))
    b2 = run(train_cmd(demo_small, part, "--max-steps", "8", "--resume", "auto", *PHASES))
    return part, b1, b2


def test_resume_matches_an_uninterrupted_run(demo_small, tmp_path, stopped_and_resumed):
    full = tmp_path / "full"
    # The uninterrupted run also evaluates at the end of epoch 1 (evaluation leaves the
    # training's random streams alone): its line names the epoch its last step is in.
    a = run(train_cmd(demo_small, full, "--max-steps", "8", *PHASES, "--set", "run.eval_interval=1"))
    assert a.returncode == 0, a.stderr
    part, b1, b2 = stopped_and_resumed
    assert b1.returncode == 0, b1.stderr
    assert b2.returncode == 0, b2.stderr
    assert "resumed from" in b2.stdout
    ma, mb = metrics(full), metrics(part)
    assert [m["step"] for m in mb] == list(range(1, 9))
    # Epochs count from 1, and an epoch's last step and the evaluation after it name one
    # epoch (metrics.jsonl once said 0 where eval.jsonl said 1).
    assert [m["epoch"] for m in ma] == [m["epoch"] for m in mb] == [1] * 5 + [2] * 3
    for run_dir, evaluated in ((full, [(5, 1), (8, 2)]), (part, [(4, 1), (8, 2)])):
        evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
        assert [(e["step"], e["epoch"]) for e in evals] == evaluated, run_dir
    for x, y in zip(ma, mb):
        for k in ("total_loss", "loss_cls", "loss_iou", "loss_dfl", "lr"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
    wa = load_checkpoint(full / "latest.pth")
    wb = load_checkpoint(part / "latest.pth")
    for key in ("model", "ema"):
        sa, sb = _flat(wa[key]), _flat(wb[key])
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5, msg=f"{key}.{k}")


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def test_compiled_training_cli(demo_small, tmp_path):
    """--compile with frozen BatchNorm statistics: freeze_bn and train() come before
    warm-up, so the graph compiled there is the one the steps run (else Dynamo recompiles
    at step 1 on the BatchNorm ``training`` guard and the first log raises). The guard is
    Dynamo's, so aot_eager shows it (the trainer's whole step through inductor is the
    slow test_compile_cli_fills_the_cache_that_training_then_loads's)."""
    r = run(train_cmd(demo_small, tmp_path, "--max-steps", "2", "--compile",
                      "--set", "compile.backend=aot_eager",
                      "--set", "family.static_assigner_epoch=100", "--set", "compile.warmup=blocking",
                      "--set", "model.freeze_bn=true"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warm-up: 1 size bucket(s) x 1 loss variant(s) compiled" in r.stdout
    assert "COCO AP" in r.stdout
    assert "recompiled" not in r.stdout + r.stderr
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["total_loss"])) for m in metrics(tmp_path))


# The runs compared across process counts and across eager / compiled. 128 px and a real
# LR: the assigned-score normaliser is clamped at 1 (PaddleDetection), so it must exceed 1
# on each rank for one process and two to be equivalent, and the weights must move far
# more than the tolerance for a comparison to mean anything. BatchNorm trains: PP-YOLOE's
# preset turns model.sync_bn on, so two ranks of half the batch normalise as one process
# does (fastdet/engine/sync_bn.py, eager and compiled). --max-boxes 3 (the demo images
# hold 1 to 8) drops boxes on every rank: the count the run logs is the whole batch's.
SAME_RUN = ["--no-augment", "--max-steps", "3", "--img-size", "128", "--lr", "0.05", "--max-boxes", "3",
            "--set", "optim.ref_batch=4", "--set", "run.eval_interval=100"]


def boxes_dropped(stdout: str) -> int:
    """The run's logged count of boxes beyond SAME_RUN's --max-boxes 3 (the line said once)."""
    found = re.findall(r"training data so far \(epoch \d+\): (\d+) boxes beyond max_boxes=3 dropped", stdout)
    assert len(found) == 1, stdout[-3000:]
    return int(found[0])


@pytest.fixture(scope="module")
def one_process(demo_small, tmp_path_factory):
    """``SAME_RUN`` in one process, eager -> (output dir, completed process)."""
    out = tmp_path_factory.mktemp("one_eager")
    return out, run(train_cmd(demo_small, out, *SAME_RUN))


# --compile with the aot_eager backend: Dynamo and AOTAutograd trace the same graphs as
# with inductor (same guards, recompiles and DDP splits), without inductor's code
# generation, which takes many minutes for PP-YOLOE-s on a shared 2-core CPU.
# compile.warmup=blocking: these runs check the compiled step itself, so every bucket is
# compiled before the first of their three steps (background compilation is
# tests/test_background_compile.py's subject).
COMPILE = ["--compile", "--set", "compile.backend=aot_eager", "--set", "compile.warmup=blocking"]


# What the fault tests launch in place of -m fastdet.train: the same command with the
# fault of $FASTDET_FAULT injected through the trainer's hooks.
FAULT_LAUNCH = Path(__file__).resolve().parent / "fault_launch.py"


def two_ranks(data: Path, out: Path, *extra: str, port: int, launcher: tuple[str, ...] = (),
              env: dict | None = None) -> subprocess.CompletedProcess:
    """``SAME_RUN`` under torchrun with 2 processes (gloo) of half the batch each; with
    ``FASTDET_FAULT`` in ``env``, through ``tests/fault_launch.py``."""
    entry = (str(FAULT_LAUNCH),) if env and "FASTDET_FAULT" in env else ("-m", "fastdet.train")
    return run(two_ranks_cmd(data, out, *extra, port=port, launcher=launcher, entry=entry), timeout=1200, env=env)


def two_ranks_cmd(data: Path, out: Path, *extra: str, port: int | None,
                  launcher: tuple[str, ...] = ("--nproc_per_node", "2"),
                  entry: tuple[str, ...] = ("-m", "fastdet.train")) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", *(launcher or ("--nproc_per_node", "2")),
                *(("--master_port", str(port)) if port else ()), *entry]
    cmd = torchrun + train_cmd(data, out, *SAME_RUN, *extra)[3:]
    cmd[cmd.index("--batch-size") + 1] = "2"
    return cmd


def assert_same_training(one: Path, two: Path, arch: str = "ppyoloe", size: str = "s") -> None:
    """The 1-process and 2-rank runs of ``SAME_RUN``-style settings end with the same weights
    (moved well beyond the tolerance from the seed-0 initial ones) and log the same losses."""
    a, b = load_checkpoint(one / "latest.pth"), load_checkpoint(two / "latest.pth")
    for k, v in a["model"].items():
        torch.testing.assert_close(v, b["model"][k], rtol=1e-4, atol=1e-5, msg=k)
    torch.manual_seed(0)  # the trainer's seed for rank 0: the initial weights
    init = build_model(arch, size, num_classes=4).state_dict()
    moved = max((a["model"][k] - v).abs().max().item() for k, v in init.items() if v.is_floating_point())
    assert moved > 1e-3, "the weights barely moved: the comparison would prove nothing"
    la, lb = metrics(one), metrics(two)
    assert [m["step"] for m in la] == [m["step"] for m in lb] == [1, 2, 3]
    for x, y in zip(la, lb):
        assert x["total_loss"] == pytest.approx(y["total_loss"], rel=1e-4)


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process(demo_small, tmp_path, one_process):
    """Slow: make test holds the same equality and SyncBatchNorm through two torchrun agents
    (test_two_nodes_train_as_one_node, which also checks the final AP line is printed once),
    and this launcher (--nproc_per_node 2) in the compiled, SIGTERM and restart tests."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, r = one_process
    assert r.returncode == 0, r.stderr
    two = two_ranks(demo_small, tmp_path / "two", port=free_port())
    assert two.returncode == 0, two.stdout + two.stderr
    assert "SyncBatchNorm: BatchNorm statistics over the 2 ranks" in two.stdout
    assert two.stdout.count("COCO AP") == 1, two.stdout  # the final line once, not once per rank
    assert boxes_dropped(two.stdout) == boxes_dropped(r.stdout) > 0  # both ranks' batches, not rank 0's
    assert_same_training(one, tmp_path / "two")


@pytest.fixture(scope="module")
def two_ranks_compiled(demo_small, tmp_path_factory):
    """``SAME_RUN`` under torchrun (2 ranks) with ``--compile`` -> (output dir, completed process)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("two_compiled")
    return out, two_ranks(demo_small, out, *COMPILE, port=free_port())


def test_compiled_ddp_two_ranks_match_one_process(one_process, two_ranks_compiled):
    """``torchrun --nproc_per_node 2 ... --compile``: DDP wraps the compiled module (DDP's
    own forward cannot be traced with fullgraph=True), SyncBatchNorm is traced into the
    graph (fullgraph: no break), and 2 compiled ranks x batch 2 train as 1 process x batch 4.
    The one process is the eager run: aot_eager runs the traced graphs op by op, with
    eager's rounding, so the compiled ranks must land on its weights and losses."""
    one, r = one_process
    assert r.returncode == 0, r.stdout + r.stderr
    two, c = two_ranks_compiled
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    assert "warm-up: 1 size bucket(s) x 1 loss variant(s) compiled" in c.stdout
    assert "SyncBatchNorm: BatchNorm statistics over the 2 ranks" in c.stdout
    assert "recompiled" not in c.stdout + c.stderr
    assert_same_training(one, two)


@pytest.mark.parametrize("backend, said", [("auto", "faster-coco-eval on"), ("pycocotools", "pycocotools on")])
def test_the_check_before_training_evaluates_two_val_images_per_rank_on_the_cpu(backend, said, demo_small, tmp_path,
                                                                                 monkeypatch, capfd):
    """On the CPU an eval batch of the recipe's size costs seconds of eager forward before
    the first step (PP-YOLO at 608 px: 12 s of a warm launch's 30 s); two images still run
    the loader, predict, collation of unequal images and pycocotools. A GPU evaluates the
    whole batch, which also shows that it fits in memory. The log names the scorer it ran."""
    from fastdet.engine import preflight
    from fastdet.engine.trainer import Trainer
    from fastdet.runtime import dist
    from fastdet.train import build_parser, resolve_config

    seen = []
    real = preflight.coco_eval_mod.evaluate

    def spy(model, loader, dataset, *args, **kwargs):
        seen.append(len(dataset.records))
        return real(model, loader, dataset, *args, **kwargs)

    monkeypatch.setattr(preflight.coco_eval_mod, "evaluate", spy)
    monkeypatch.setenv("FASTDET_COCO_EVAL", backend)
    args = build_parser().parse_args(train_cmd(demo_small, tmp_path / "out")[3:])  # eval batch 8
    trainer = Trainer(resolve_config(args))
    try:
        trainer._preflight()
    finally:
        dist.shutdown()
    assert seen == [2]
    logged = capfd.readouterr()
    assert said in logged.out + logged.err and "checked before training" in logged.out + logged.err, logged
    assert preflight.preflight_images(8, torch.device("cuda")) == 8
    assert preflight.preflight_images(1, torch.device("cpu")) == 1


def test_first_logged_loss_of_a_compiled_run_is_the_eager_one(one_process, two_ranks_compiled):
    """Warm-up batches do not leak into the logged losses: the first logged loss of a
    --compile run (after its warm-up on a synthetic batch; here the 2-rank run, whose
    logged loss is the mean over the ranks) is the eager run's first loss, up to the
    rounding of inductor's fused kernels."""
    (eager, re), (compiled, rc) = one_process, two_ranks_compiled
    assert re.returncode == 0 and rc.returncode == 0, re.stderr[-2000:] + rc.stderr[-2000:]
    first_e, first_c = metrics(eager)[0], metrics(compiled)[0]
    assert first_e["step"] == first_c["step"] == 1
    for k in ("total_loss", "loss_cls", "loss_iou", "loss_dfl"):
        assert first_c[k] == pytest.approx(first_e[k], rel=1e-4), k


@pytest.mark.parametrize("extra, message", [
    (["--arch", "yolo9"], "unknown --arch 'yolo9'"),
    (["--size", "q"], "unknown --size 'q' for ppyoloe"),
    (["--cuda-graphs"], "--cuda-graphs needs a CUDA device"),
    (["--sync-debug"], "--sync-debug needs a CUDA device"),
    (["--batch-size", "four"], "invalid int value: 'four'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--set", "optim.learning_rate=0.1"], "unknown config field 'optim.learning_rate'"),
])
def test_bad_command_lines_give_one_clear_line(demo_small, tmp_path, capsys, caplog, extra, message):
    code, _, err = main_in_process(train_cmd(demo_small, tmp_path, *extra)[3:], capsys, caplog)
    assert code != 0
    assert message in err, err


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--img-size", "100"], "--img-size must be a positive multiple of 32 (the largest stride), got 100"),
    (["--img-size", "0"], "--img-size must be a positive multiple of 32"),
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--set", "data.eval_batch_size=0"], "data.eval_batch_size must be at least 1, got 0"),
    (["--lr", "-1"], "--lr (optim.base_lr) must be positive, got -1"),
    (["--ckpt", "NOT_A_CKPT"], "weights.pth: neither a torch file (a zip archive) nor a Paddle .pdparams"),
    (["--ckpt", "MISSING"], "no such file"),
    (["--ckpt", "TRUNCATED"], "cut.pth: a zip archive that does not open (truncated or damaged)"),
    (["--ckpt", "A_FOLDER"], "--ckpt TMP/adir.pth: a folder, not a weight file"),
    (["--backbone-weights", "A_FOLDER"], "--backbone-weights TMP/adir.pth: a folder, not a weight file"),
    # Not a fastdet checkpoint and not a released PP-YOLOE file (Paddle's): fastdet.train has no --from to offer.
    (["--ckpt", "STATE_DICT"], "sd.pth: a torch file that is not a fastdet checkpoint (no 'config' and 'model' "
                               "entries), nor a released ppyoloe file fastdet reads (ppyoloe converts paddle"),
    # --ckpt's weights were loaded over the backbone file's, silently.
    (["--backbone-weights", "STATE_DICT", "--ckpt", "STATE_DICT"], "--ckpt's weights include a backbone"),
])
def test_bad_values_fail_before_any_work_in_one_line(demo_small, tmp_path, capsys, caplog, extra, message):
    """Each fails at once (no output directory, no data read), in one line naming the flag;
    before, these failed an epoch in, at evaluation, or trained 0 steps and exited 0 (or,
    for the weight files, failed after the model was built, with a traceback or a --from
    flag fastdet.train does not have). In this process (main_in_process): test_missing_
    dataset_is_named runs such a failure through ``python -m fastdet.train``."""
    bad = tmp_path / "weights.pth"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is an image, not weights" * 8)
    torch.save({"w": torch.zeros(3)}, tmp_path / "sd.pth")
    data = (tmp_path / "sd.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "adir.pth").mkdir()
    files = {"NOT_A_CKPT": bad, "MISSING": tmp_path / "nowhere.pth", "STATE_DICT": tmp_path / "sd.pth",
             "TRUNCATED": tmp_path / "cut.pth", "A_FOLDER": tmp_path / "adir.pth"}
    extra = [str(files.get(a, a)) for a in extra]
    message = message.replace("TMP/", f"{tmp_path}/")
    out = tmp_path / "out"
    code, _, err = main_in_process(train_cmd(demo_small, out, *extra)[3:], capsys, caplog)
    assert code == 2, err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "weights_only" not in err
    assert not out.exists(), "the run started before the error"


@pytest.mark.parametrize("extra, message", [
    (["--set", "optim.optimizer=adam"], "optim.optimizer must be one of sgd, adamw, got 'adam'"),
    (["--set", "optim.schedule=linear"], "optim.schedule must be one of cosine"),
    (["--set", "data.loader=foo"], "--loader (data.loader) must be one of auto, dali, torch, got 'foo'"),
    (["--lr", "nan"], "--lr (optim.base_lr) must be a finite number, got nan"),
    (["--set", "optim.base_lr=-1"], "--lr (optim.base_lr) must be positive"),
    (["--set", "optim.ref_batch=0"], "optim.ref_batch must be at least 1, got 0"),
    (["--set", "optim.beta2=1.5"], "optim.beta2 must be in [0, 1), got 1.5"),
    (["--set", "optim.weight_decay=-1"], "optim.weight_decay must be >= 0"),
    (["--set", "family.nms_iou=5"], "family.nms_iou must be in [0, 1], got 5"),
    (["--set", "family.max_det=0"], "family.max_det must be at least 1, got 0"),
    (["--set", "family.pre_nms_topk=0"], "family.pre_nms_topk must be at least 1, got 0"),
    (["--seed", "-1"], "--seed (run.seed) must be >= 0, got -1"),
    (["--profile-steps", "5:2"], "--profile-steps '5:2': need 0 <= A < B"),
    (["--output-dir", "A_FILE"], "is a file, not a folder"),
    (["--output-dir", "runs/{date}"], "--output-dir runs/{date}: it may name {arch} and {size}, not 'date'"),
    (["--profile-steps", "1:2"], "--profile-steps needs --device cuda"),
    (["--batch-size", "1", "--img-size", "32"], "--batch-size 1: at train size 32 the model's BatchNorm sees one "
                                                "value per channel of a 1x1 feature map"),
])
def test_values_a_run_meets_late_are_refused_before_it_starts(demo_small, tmp_path, extra, message):
    """Names looked up and numbers used only once the run has started (an optimizer, a
    schedule, a NaN learning rate that trains to a NaN loss, a division by ref_batch): one
    ConfigError naming the field, before any folder or data (``python -m fastdet.train``
    turns it into exit 2, as the cases above)."""
    from fastdet.config import ConfigError
    from fastdet.train import build_parser, check_config, resolve_config

    (tmp_path / "a_file").write_text("mine")
    argv = [str(tmp_path / "a_file") if a == "A_FILE" else a for a in train_cmd(demo_small, tmp_path / "out")[3:]
            + extra]
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(resolve_config(build_parser().parse_args(argv)))
    assert not (tmp_path / "out").exists()


def test_a_start_that_fails_on_its_data_leaves_no_folder_and_resume_auto_keeps_a_runs_weights(demo_small,
                                                                                             tmp_path, capsys,
                                                                                             caplog):
    """A run that fails before its first step (a missing annotation file, found once the
    data is read) removes the folder it made, so the corrected command is not sent to
    ``out2``; ``--resume auto`` into a folder with another run's best.pth and no latest.pth
    is refused instead of writing over it. The commands run main() in this process
    (main_in_process)."""
    from fastdet.config import Config
    from fastdet.engine.checkpointer import auto_resume

    out = tmp_path / "out"
    argv = train_cmd(demo_small, out, "--set", f"data.train_ann={tmp_path / 'nowhere.json'}")[3:]
    code, said, err = main_in_process(argv, capsys, caplog)
    assert code == 1 and "not found" in err and not out.exists(), said + err
    done = tmp_path / "done"
    done.mkdir()
    (done / "best.pth").write_bytes(b"a finished run's weights")
    cfg = Config()
    cfg = type(cfg)(**{**vars(cfg), "run": type(cfg.run)(**{**vars(cfg.run), "auto_resume": True})})
    with pytest.raises(ValueError, match="holds .*best.pth but no latest.pth to continue from"):
        auto_resume(cfg, done, True)
    assert (done / "best.pth").read_bytes() == b"a finished run's weights"
    # Through the command: refused, and the folder is left as it was (its train.log too).
    (done / "train.log").write_text("the other run's log\n")
    code, said, err = main_in_process(train_cmd(demo_small, done, "--resume", "auto")[3:], capsys, caplog)
    assert code == 1 and "but no latest.pth to continue from" in err, said + err
    assert sorted(p.name for p in done.iterdir()) == ["best.pth", "train.log"]
    assert (done / "train.log").read_text() == "the other run's log\n"
    fresh = tmp_path / "fresh"  # a folder of no log: a refused start leaves none in it
    fresh.mkdir()
    (fresh / "best.pth").write_bytes(b"weights")
    code, _, err = main_in_process(train_cmd(demo_small, fresh, "--resume", "auto")[3:], capsys, caplog)
    assert code == 1 and sorted(p.name for p in fresh.iterdir()) == ["best.pth"], err


def test_a_failed_check_before_the_first_step_leaves_no_folder(demo_small, tmp_path, monkeypatch):
    """The check before training (the evaluation path on a few val images) and the compile
    warm-up are part of the start: a failure there removes the folder the start made."""
    from fastdet.engine.trainer import Trainer, TrainingError
    from fastdet.runtime import dist
    from fastdet.train import build_parser, resolve_config

    out = tmp_path / "out"
    trainer = Trainer(resolve_config(build_parser().parse_args(train_cmd(demo_small, out)[3:])))
    try:
        assert (out / "train.log").is_file()

        def fails():
            raise TrainingError("the end-of-run path fails before training, scoring: (planted)")

        monkeypatch.setattr(trainer, "_preflight", fails)
        with pytest.raises(TrainingError, match="planted"):
            trainer.train()
    finally:
        dist.shutdown()
    assert not out.exists()


def test_a_first_step_that_fails_leaves_no_folder(demo_small, tmp_path):
    """A failure in the first step (out of memory on a GPU; here BatchNorm of one image on a
    1x1 map, the configuration check_config refuses, given to the trainer directly) is a
    failed start too: nothing trained, the folder goes. One image at 64 passes the check."""
    from fastdet.engine.trainer import Trainer
    from fastdet.runtime import dist
    from fastdet.train import build_parser, check_config, resolve_config

    out = tmp_path / "out"
    cfg = resolve_config(build_parser().parse_args(train_cmd(demo_small, out, "--batch-size", "1")[3:]))
    check_config(cfg)  # 64: a 2x2 coarsest map
    cfg = resolve_config(build_parser().parse_args(
        train_cmd(demo_small, out, "--batch-size", "1", "--img-size", "32")[3:]))
    trainer = Trainer(cfg)
    try:
        assert (out / "train.log").is_file()
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            trainer.train()
    finally:
        dist.shutdown()
    assert not out.exists()


def test_a_familys_own_default_size_and_data_paths_stored_absolute(demo_small, tmp_path, monkeypatch):
    """--arch fcos alone takes FCOS's size (there is no s); data paths given relative are
    stored absolute, so the run resumes from another working directory."""
    from fastdet.train import build_parser, resolve_config

    (tmp_path / "myset").symlink_to(demo_small)
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config(build_parser().parse_args(["--arch", "fcos", "--data", "myset"]))
    assert cfg.model.size == "r50" and cfg.data.data == str(tmp_path / "myset")
    from fastdet.models import ARCHITECTURES

    assert resolve_config(build_parser().parse_args(["--arch", "ppyolo"])).model.size == ARCHITECTURES["ppyolo"].sizes[0]


def test_a_damaged_checkpoint_is_one_line_without_torch_advice(tmp_path):
    good = tmp_path / "good.pth"
    torch.save({"model": {"w": torch.zeros(3)}}, good)
    data = good.read_bytes()
    (tmp_path / "truncated.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.pth").write_text("not a checkpoint\n")
    # An object that needs code to unpickle (weights_only refuses it).
    torch.save({"model": argparse.Namespace(lr=0.1)}, tmp_path / "code.pth")
    cases = {"truncated.pth": "is not a checkpoint", "text.pth": "is not a checkpoint",
             "code.pth": "holds Python objects other than tensors"}
    for name, message in cases.items():
        with pytest.raises(ValueError) as e:
            load_checkpoint(tmp_path / name)
        assert message in str(e.value) and "\n" not in str(e.value), name
        assert "weights_only" not in str(e.value), name
    assert load_checkpoint(good)["model"]["w"].shape == (3,)


def test_missing_dataset_is_named(tmp_path):
    r = run(train_cmd(tmp_path / "nowhere", tmp_path / "out"))
    assert r.returncode == 1
    assert "no such directory" in r.stderr and "nowhere" in r.stderr
    assert "Traceback" not in r.stderr


def test_corrupt_training_image_is_a_counted_skip(demo_small, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo_small, data)
    victim = sorted((data / "train2017").iterdir())[3]
    victim.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    r = run(train_cmd(data, tmp_path / "out", "--max-steps", "1", "--set", "data.check_images=decode"))
    assert r.returncode == 0, r.stderr
    assert "1 corrupt" in r.stdout and victim.name in r.stdout


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(eager_run, demo_small, tmp_path):
    done, _ = eager_run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    before = load_checkpoint(out / "latest.pth")
    # A resumed run keeps its stored config (a differing --lr is refused): the diverging LR goes
    # there (finite: a NaN one is refused before the run starts).
    poisoned = load_checkpoint(out / "latest.pth")
    poisoned["config"]["optim"]["base_lr"] = 1e30
    torch.save(poisoned, out / "latest.pth")
    r = run(train_cmd(demo_small, out, "--max-steps", "6", "--resume"))
    assert r.returncode == 1
    assert "non-finite loss" in r.stderr
    after = load_checkpoint(out / "latest.pth")
    assert after["step"] == before["step"] == 3
    assert all(torch.isfinite(v).all() for v in after["model"].values() if v.is_floating_point())


# What the out-of-memory lines keep of OutOfMemoryAt.MESSAGE: up to the device's free memory.
FIGURES = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.06 GiB "
           "is free")


class OutOfMemoryAt(Hook):
    """Raises what the CUDA caching allocator raises, inside the trainer's call of its train
    step at step ``step``."""

    MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
               "1.06 GiB is free. Including non-PyTorch memory, this process has 78.04 GiB memory in use.")

    def __init__(self, step: int):
        self.step = step

    def before_train(self, trainer) -> None:
        hook = self

        class Failing:  # the step, but out of memory at the hook's step
            def __init__(self, step):
                self.step = step

            def __getattr__(self, name):
                return getattr(self.step, name)

            def __call__(self, batch, kw):
                if trainer.step + 1 == hook.step:
                    raise torch.OutOfMemoryError(hook.MESSAGE)
                return self.step(batch, kw)

        trainer.train_step = Failing(trainer.train_step)


@pytest.mark.parametrize("where, said", [
    ("train_step", "out of device memory in training step 4 (images [4, 3, 64, 64], loss {'static_assigner': True}) "
                   f"({FIGURES}): training stopped; the last checkpoint is "
                   "RUN/latest.pth; a smaller --batch-size (images per process)"),
    ("evaluate", f"out of device memory evaluating step 3 ({FIGURES}): training "
                 "stopped; the last checkpoint is RUN/latest.pth; a smaller data.eval_batch_size"),
])
def test_out_of_device_memory_is_one_line_naming_the_work_and_the_last_checkpoint(eager_run, demo_small, tmp_path,
                                                                                 capsys, caplog, monkeypatch, where,
                                                                                 said):
    """Device memory running out in a step (a larger train size, the task-aligned phase) or
    in an evaluation (its batch) is one line, exit 1: what ran (the step, its input's shape and
    loss variant), torch's figures, the checkpoint to go back to and what needs less memory;
    the checkpoint is the last one written, untouched. (A traceback before.)"""
    from fastdet.train import main

    from fastdet.engine.eval_hook import EvalHook

    done, _ = eager_run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    hooks = []
    if where == "train_step":
        hooks.append(OutOfMemoryAt(step=4))
        argv = train_cmd(demo_small, out, "--max-steps", "4", "--resume")[3:]
    else:  # a run stopped during its last evaluation evaluates at once when resumed (no step to train)
        (out / "eval.jsonl").unlink()

        def evaluate(*args, **kwargs):
            raise torch.OutOfMemoryError(OutOfMemoryAt.MESSAGE)

        monkeypatch.setattr(EvalHook, "evaluate", evaluate)
        argv = train_cmd(demo_small, out, "--max-steps", "3", "--resume")[3:]
    with caplog.at_level(logging.INFO, logger="fastdet"):
        code = main(argv, hooks=hooks)
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert said.replace("RUN/", f"{out}/") in err, err
    assert load_checkpoint(out / "latest.pth")["step"] == 3


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_one_before_is_kept(eager_run, demo_small, tmp_path,
                                                                                    capsys, caplog, monkeypatch):
    """A full disk while latest.pth is written (torch.save's own words for it: "[enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598") stops the run in one line, exit 1:
    the file, the cause, the space left; the checkpoint before it is kept and no temp file is
    left (a traceback before)."""
    import fastdet.runtime.checkpoint as checkpoint
    from fastdet.train import main

    done, _ = eager_run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    real_save = checkpoint.torch.save

    def save(state, f, *args, **kwargs):
        if str(f).startswith(str(out / "latest.pth")):
            with open(f, "wb") as part:
                part.write(b"PK\x03\x04 half a file")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(state, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    with caplog.at_level(logging.INFO, logger="fastdet"):
        code = main(train_cmd(demo_small, out, "--max-steps", "4", "--resume")[3:])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"error: cannot write {re.escape(str(out))}/latest.pth: \[enforce fail at inline_container.cc:672\] "
                     r"\. unexpected pos 704 vs 598 \([\d,]+ MiB free on its file system\); the checkpoint before it is "
                     r"kept$", err.strip()), err
    monkeypatch.undo()
    assert load_checkpoint(out / "latest.pth")["step"] == 3
    assert not list(out.glob("*.tmp"))
    # A full disk met by another write (metrics.jsonl at a log point) is one line too.
    import fastdet.engine.metrics_log as metrics_log

    def write(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "metrics.jsonl"))

    monkeypatch.setattr(metrics_log.MetricsLog, "write", write)
    code = main(train_cmd(demo_small, out, "--max-steps", "4", "--resume")[3:])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == (f"fastdet.train: error: cannot write {out}/metrics.jsonl: No space left on "
                                         "device; the run's checkpoints are whole (each is written to a temp file "
                                         "and renamed)"), err


def test_a_loader_worker_death_said_by_torchs_signal_handler_is_one_line(eager_run, demo_small, tmp_path, capsys,
                                                                          caplog):
    """Torch's SIGCHLD handler raises a dead loader worker's RuntimeError wherever the main
    thread is (in the step, at a log point): fastdet.train says it in one line, exit 1, as
    the loader does when the iteration finds it (test_torch_loader)."""
    from fastdet.train import main

    class WorkerKilled(Hook):
        def after_step(self, trainer) -> None:
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")

    done, _ = eager_run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    with caplog.at_level(logging.INFO, logger="fastdet"):
        code = main(train_cmd(demo_small, out, "--max-steps", "4", "--resume")[3:], hooks=[WorkerKilled()])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == (
        "fastdet.train: error: DataLoader worker (pid 4242) is killed by signal: Killed: a data loader worker died "
        "(killed when the host is out of memory); fewer --workers (now 0) or a smaller --batch-size need less host "
        "memory"), err


def test_predict_and_eval_out_of_device_memory_keep_what_is_done_and_say_it(eager_run, demo_small, tmp_path,
                                                                            capsys, monkeypatch):
    """``fastdet.predict`` running out of device memory on its second batch writes
    predictions.json for the images before it (their drawn copies are there) and says so in
    one line, exit 1; ``fastdet.eval`` says it in one line naming --batch-size (tracebacks
    before, and the predictions of the batches done were lost)."""
    import fastdet.eval.__main__ as eval_cli
    import fastdet.predict as predict_cli

    done, _ = eager_run
    calls = []
    real_detect = predict_cli.detect

    def detect(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError(OutOfMemoryAt.MESSAGE)
        return real_detect(*args, **kwargs)

    monkeypatch.setattr(predict_cli, "detect", detect)
    files = sorted((demo_small / "val2017").glob("*.jpg"))[:5]
    out = tmp_path / "preds"
    code = predict_cli.main(["--ckpt", str(done / "best.pth"), "--source", str(demo_small / "val2017"),
                             "--output-dir", str(out), "--batch-size", "2", "--score-thresh", "0", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert (f"out of device memory predicting 2 image(s) from {files[2]} ({FIGURES}): predictions.json in {out} "
            "holds the 2 image(s) before them; a smaller --batch-size (now 2) or --img-size needs less (with "
            "--exist-ok, to write over them)" in err), err
    results = json.loads((out / "predictions.json").read_text())
    assert results and {r["file_name"] for r in results} == {f.name for f in files[:2]}
    assert sorted(p.name for p in out.glob("*.jpg")) == [f.name for f in files[:2]]

    def evaluate(*args, **kwargs):
        raise torch.OutOfMemoryError(OutOfMemoryAt.MESSAGE)

    monkeypatch.setattr(eval_cli, "evaluate", evaluate)
    code = eval_cli.main(["--ckpt", str(done / "best.pth"), "--data", str(demo_small), "--device", "cpu",
                          "--batch-size", "8"])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == (f"fastdet.eval: error: out of device memory ({FIGURES}): a smaller "
                                         "--batch-size (now 8) needs less"), err


def test_tf32_and_sync_debug_flags():
    """TF32 stays off unless --tf32 (the trainer sets cuDNN and cuBLAS from it on CUDA,
    with cudnn.benchmark on); --sync-debug is a CUDA-only check."""
    from fastdet.train import build_parser, resolve_config

    parse = lambda *a: resolve_config(build_parser().parse_args(list(a)))  # noqa: E731
    assert parse().compile.tf32 is False and parse("--tf32").compile.tf32 is True
    assert parse().run.sync_debug is False and parse("--sync-debug").run.sync_debug is True


def test_sync_debug_covers_the_loader_call(monkeypatch):
    """--sync-debug: the loader's next() runs in "error" mode, as the step does (a loader
    that blocks the host on the device is caught too). set_sync_debug_mode is recorded,
    not called: this machine has no CUDA."""
    from dataclasses import replace
    from types import SimpleNamespace

    from fastdet.config import Config
    from fastdet.runtime.logging import Nvtx
    from fastdet.engine.trainer import Trainer

    mode = ["default"]
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m))
    seen = []

    def loader():
        for i in range(2):
            seen.append(mode[0])
            yield {"step": i}

    trainer = Trainer.__new__(Trainer)
    cfg = Config()
    trainer.cfg = replace(cfg, run=replace(cfg.run, sync_debug=True))
    trainer.train_step = SimpleNamespace(nvtx=Nvtx(False))
    it = loader()
    assert [trainer._next_batch(it) for _ in range(3)] == [{"step": 0}, {"step": 1}, None]
    assert seen == ["error", "error"] and mode == ["default"]


@pytest.mark.parametrize("fails", [False, True])
def test_train_releases_its_loaders_workers_when_it_returns(monkeypatch, fails):
    """train() closes both loaders, after a finished run or a failed one: persistent
    DataLoader workers left to interpreter exit held every run with --workers > 0 about 10 s
    after its last line (DataLoader joins each for 5 s once the queues are gone)."""
    from types import SimpleNamespace

    from fastdet.engine import trainer as T

    closed = []

    class Loader:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)

    class Stub:
        def __init__(self, cfg, hooks):
            self.train_loader, self.val_loader = Loader("train"), Loader("val")
            self.compilation = SimpleNamespace(close=lambda: None)
            self.control = SimpleNamespace(uninstall=lambda: None)

        def train(self):
            if fails:
                raise T.TrainingError("planted")
            return {"AP": 0.5}

    monkeypatch.setattr(T, "Trainer", Stub)
    monkeypatch.setattr(T.dist, "shutdown", lambda: None)
    if fails:
        with pytest.raises(T.TrainingError, match="planted"):
            T.train(None)
    else:
        assert T.train(None) == {"AP": 0.5}
    assert sorted(closed) == ["train", "val"]


# --------------------------------------------------------------------------- faults
# Each compares with the one-process run of SAME_RUN (3 steps), as the DDP tests do.


def test_sigterm_on_one_rank_stops_every_rank_and_the_resumed_run_is_exact(demo_small, tmp_path, one_process):
    """SIGTERM on rank 1 after step 1 (what a scheduler sends on preemption): both ranks
    stop at one step boundary (step 2: the ranks agree through a reduction one step
    later), latest.pth holds that step, the resume command is printed, the exit code says
    preempted (75); resuming ends with the uninterrupted run's weights and losses."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, r = one_process
    assert r.returncode == 0, r.stderr
    out = tmp_path / "two"
    a = two_ranks(demo_small, out, port=free_port(), env={"FASTDET_FAULT": "1:1:TERM"})
    assert a.returncode != 0
    assert "exitcode  : 75" in a.stderr or "exitcode: 75" in a.stderr, a.stderr[-3000:]
    assert "SIGTERM received: stopping at the next step boundary" in a.stderr
    assert "Resume with: torchrun --nproc_per_node 2 -m fastdet.train" in a.stderr and "--resume" in a.stderr
    assert "Traceback" not in a.stdout
    ck = load_checkpoint(out / "latest.pth")
    assert (ck["step"], ck["epoch"]) == (2, 0)
    b = two_ranks(demo_small, out, "--resume", port=free_port())
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    assert "resumed from" in b.stdout
    assert_same_training(one, out)


def test_torchrun_restart_after_a_killed_rank_continues_the_run(demo_small, tmp_path, one_process):
    """``torchrun --max-restarts 1``, rank 1 SIGKILLed after step 2 (before that step's
    checkpoint): torchrun restarts both workers with the same command line, they resume
    from step 1's latest.pth by themselves, and the run ends with the weights and losses
    of an uninterrupted one. The --output-dir given holds another run of the same config
    (the one-process run's), so the launch writes to ``two2``: the restart continues there
    (before, it continued the other run, in its directory, from its last step)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, r = one_process
    assert r.returncode == 0, r.stderr
    asked, out = tmp_path / "two", tmp_path / "two2"
    shutil.copytree(one, asked)
    before = {f.name: f.read_bytes() for f in asked.iterdir() if f.is_file()}
    a = two_ranks(demo_small, asked, "--ckpt-interval-steps", "1", port=free_port(),
                  launcher=("--nproc_per_node", "2", "--max-restarts", "1", "--monitor-interval", "0.5"),
                  env={"FASTDET_FAULT": "1:2:KILL"})
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    assert f"torchrun restart 1: continuing from {out / 'latest.pth'}" in a.stdout
    assert "resumed from" in a.stdout and "after step 1 (0 epoch(s) done)" in a.stdout
    assert {f.name: f.read_bytes() for f in asked.iterdir() if f.is_file()} == before
    assert_same_training(one, out)


def test_a_last_evaluation_lost_to_a_stop_is_made_on_resume(eager_run, demo_small, tmp_path, capsys, caplog):
    """A run killed during the evaluation of its last step (torchrun then restarts it; or the
    user resumes): latest.pth holds the last step, eval.jsonl has no line of it. Resuming
    evaluates it (before, "nothing to train", exit 0, and no final AP ever); once recorded,
    a resume has nothing to do (main() in this process: it stops before any work)."""
    done, _ = eager_run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    lines = (out / "eval.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 3
    (out / "eval.jsonl").write_text("".join(line + "\n" for line in lines[:-1]))
    a = run(train_cmd(demo_small, out, "--max-steps", "3", "--resume"))
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    assert "its evaluation of it was not recorded (stopped during it): evaluating it now" in a.stdout
    assert "final: AP" in a.stdout
    assert [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()][-1] == 3
    code, said, err = main_in_process(train_cmd(demo_small, out, "--max-steps", "3", "--resume")[3:], capsys, caplog)
    assert code == 0 and "nothing to train" in said, said[-3000:] + err[-3000:]


def test_an_error_every_rank_meets_is_said_once_under_torchrun(demo_small, tmp_path):
    """A bad --set under torchrun --nproc_per_node 2 is one line, not one per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "fastdet.train", *train_cmd(demo_small, tmp_path / "out", "--set", "optim.bogus=1")[3:]]
    r = run(cmd, timeout=300)
    assert r.returncode != 0
    assert r.stderr.count("fastdet.train: error: unknown config field 'optim.bogus'") == 1, r.stderr[-3000:]


def test_step_on_resize_counts_the_epochs_images_in_the_new_batches():
    from fastdet.engine.checkpointer import step_on_resize

    # 1 process x 2 images, 11 steps an epoch, saved at step 6 of epoch 0 (12 images), on
    # 2 processes x 2 (5 steps an epoch): step 3; from 2 ranks to 1 the other way round.
    assert step_on_resize(6, 0, 11, 2, 4, 5) == 3
    assert step_on_resize(14, 2, 5, 4, 2, 11) == 2 * 11 + 8
    assert step_on_resize(10, 0, 11, 2, 4, 5) == 4  # 20 images of an epoch of 5 x 4: its last step again
    assert step_on_resize(6, 0, None, 2, 4, 5) == 0  # an earlier fastdet's checkpoint: the epoch again


def test_a_run_resumed_on_more_processes_continues_where_its_epoch_was(demo_small, tmp_path):
    """One process (2 images a step: 11 steps an epoch) stopped at step 6, resumed under
    torchrun on 2 (4 images a step: 5 steps an epoch): it continues at step 3 of the epoch
    and trains; before, it skipped 6 batches of a 5-batch epoch, forever."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "run"
    a = run(train_cmd(demo_small, out, "--batch-size", "2", "--max-steps", "6", "--no-augment"))
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "fastdet.train", *train_cmd(demo_small, out, "--batch-size", "2", "--max-steps", "5", "--no-augment",
                                             "--resume")[3:]]
    b = run(cmd, timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    assert b.stdout.count("its step 6 is step 3 in the new batches (epoch 1, 3 of 5 steps done)") == 1, b.stdout
    ck = load_checkpoint(out / "latest.pth")
    assert (ck["step"], ck["epoch"], ck["world_size"], ck["steps_per_epoch"]) == (5, 1, 2, 5)
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5]  # on in the new steps, none twice


def test_two_nodes_train_as_one_node(demo_small, tmp_path, one_process):
    """Two torchrun agents as two nodes (--nnodes 2, c10d rendezvous on 127.0.0.1), one
    process each: the run equals one process with the whole batch (and so two processes
    on one node)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, r = one_process
    assert r.returncode == 0, r.stderr
    out = tmp_path / "nodes"
    launcher = ("--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "fastdet-test")
    cmd = two_ranks_cmd(demo_small, out, port=None, launcher=launcher)
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
              for _ in range(2)]
    outs = [p.communicate(timeout=1200) for p in agents]
    for p, (so, se) in zip(agents, outs):
        assert p.returncode == 0, so[-3000:] + se[-3000:]
    assert any("SyncBatchNorm: BatchNorm statistics over the 2 ranks" in so for so, _ in outs)
    assert sum(so.count("COCO AP") for so, _ in outs) == 1, outs  # the final line once, not once per rank
    assert boxes_dropped("".join(so for so, _ in outs)) == boxes_dropped(r.stdout) > 0  # both ranks' batches
    assert_same_training(one, out)


def test_resume_auto_starts_continues_and_refuses_another_runs_checkpoint(demo_small, tmp_path, capsys, caplog,
                                                                          stopped_and_resumed):
    """--resume auto: an empty directory starts the run, a second call continues it (the
    metrics go on; test_resume_matches_an_uninterrupted_run: exactly), a call with another
    config is refused in one line, before any data is read (main() in this process), and
    leaves the checkpoint alone."""
    part, a, b = stopped_and_resumed
    out = tmp_path / "run"
    shutil.copytree(part, out)  # the refusal below must leave it as it was
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    assert "--resume auto: no checkpoint in" in a.stdout
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    assert "--resume auto: continuing from" in b.stdout
    assert [m["step"] for m in metrics(out)] == list(range(1, 9))
    before = (out / "latest.pth").read_bytes()
    argv = train_cmd(demo_small, out, "--max-steps", "10", "--resume", "auto", "--lr", "0.5", *PHASES)[3:]
    code, _, err = main_in_process(argv, capsys, caplog)
    assert code == 1
    assert "is another run's (optim.base_lr: 0.04 in the checkpoint, 0.5 now)" in err, err
    assert (out / "latest.pth").read_bytes() == before
