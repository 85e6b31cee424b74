"""What a user does next after the README (issue 26): nothing they do loses their work.

CLI behaviour is tested through the command line in a subprocess, at 64 px with a few
steps on the small demo set; a command that fails or stops before training runs its
main() in the test's process (``main_in_process``: exit code, stdout, stderr as the
process would give them, without a process start of seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import main_in_process  # tests/ is on sys.path (rootdir conftest)

from fastdet.runtime.checkpoint import load_checkpoint

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS: tests/conftest.py


def train_cmd(data: Path, out: Path | None, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "fastdet.train", "--arch", "ppyoloe", "--size", "s",
           "--data", str(data), "--device", "cpu", "--img-size", "64", "--no-multiscale",
           "--batch-size", "4", "--epochs", "2", "--workers", "0",
           "--log-interval", "1", "--set", "data.eval_batch_size=8",
           "--set", "optim.warmup_steps=2", *extra]
    return cmd + (["--output-dir", str(out)] if out is not None else [])


def run(cmd: list[str], cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, cwd=cwd)


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(demo_small, tmp_path_factory):
    """One finished 2-step run in ``<tmp>/runs/ppyoloe_s`` (the default output directory)."""
    cwd = tmp_path_factory.mktemp("user")
    r = run(train_cmd(demo_small, None, "--max-steps", "2"), cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return cwd, cwd / "runs" / "ppyoloe_s"


# --------------------------------------------------------------------------- 1. no run overwritten

def test_the_same_command_twice_starts_a_numbered_run_and_keeps_the_first(demo_small, first_run, tmp_path):
    cwd, out = first_run
    snap = tmp_path / "snap"
    shutil.copytree(out, snap)
    r = run(train_cmd(demo_small, None, "--max-steps", "1"), cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    second = cwd / "runs" / "ppyoloe_s2"
    assert f"this run writes to {Path('runs') / 'ppyoloe_s2'}" in r.stdout, r.stdout
    assert (second / "latest.pth").is_file() and steps(second / "metrics.jsonl") == [1]
    for f in ("latest.pth", "best.pth", "metrics.jsonl", "eval.jsonl", "config.yaml"):
        assert (out / f).read_bytes() == (snap / f).read_bytes(), f
    assert (out / "train.log").read_text() == (snap / "train.log").read_text()
    assert load_checkpoint(second / "latest.pth")["config"]["run"]["output_dir"] == str(Path("runs") / "ppyoloe_s2")


def test_exist_ok_writes_into_the_directory(demo_small, first_run, tmp_path):
    """--exist-ok: the new run writes into the folder of another, and what it logs is its
    own. Before, TensorBoard drew both runs' curves interleaved (the old event file was read
    with the new). Its checkpoints' fallback: tests/test_rundir.py."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, src = first_run
    out = tmp_path / "run"
    shutil.copytree(src, out)  # a finished 2-step run
    old_events = len(list((out / "tb").iterdir()))
    r = run(train_cmd(demo_small, out, "--max-steps", "1", "--exist-ok"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert load_checkpoint(out / "latest.pth")["step"] == 1  # the new run's, over the other's
    assert not (tmp_path / "run2").exists()
    assert steps(out / "metrics.jsonl") == [1]
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert len(list((out / "tb").iterdir())) == old_events + 1  # the old run's files stay; TensorBoard skips them
    assert [e.step for e in events.Scalars("train/total_loss")] == [1]


def test_predict_never_writes_over_a_source_image(demo_small, tmp_path, capsys, caplog):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    src = sorted((demo_small / "val2017").glob("*.jpg"))[0]
    shutil.copy(src, imgs / "a.jpg")
    before = (imgs / "a.jpg").read_bytes()
    ckpt = tmp_path / "w.pth"
    ckpt.write_bytes(b"checked after the source")  # the refusal comes before the checkpoint is read
    code, _, err = main_in_process(["--ckpt", str(ckpt), "--source", str(imgs / "a.jpg"), "--output-dir", str(imgs),
                                    "--device", "cpu"], capsys, caplog, "fastdet.predict")
    assert code == 2
    assert "is the folder of the source images" in err and len(err.strip().splitlines()) == 1, err
    assert (imgs / "a.jpg").read_bytes() == before


# --------------------------------------------------------------------------- 2. the end of a run, at its start

def _copy_with(demo_small: Path, dst: Path, edit) -> Path:
    """``demo_small`` copied to ``dst`` with ``edit(doc, split)`` applied to both annotation files."""
    shutil.copytree(demo_small, dst)
    for split in ("train", "val"):
        f = dst / "annotations" / f"instances_{split}2017.json"
        doc = json.loads(f.read_text())
        edit(doc, split)
        f.write_text(json.dumps(doc))
    return dst


def test_coco_file_without_iscrowd_and_area_is_filled_counted_and_evaluates(demo_small, tmp_path):
    def strip(doc, split):
        for a in doc["annotations"]:
            a.pop("iscrowd", None)
            a.pop("area", None)
    data = _copy_with(demo_small, tmp_path / "data", strip)
    n_val = len(json.loads((data / "annotations" / "instances_val2017.json").read_text())["annotations"])
    r = run(train_cmd(data, tmp_path / "out", "--max-steps", "1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "COCO AP" in r.stdout
    assert f"filled in {n_val} missing 'area', {n_val} missing 'iscrowd' as COCO defines them" in r.stdout, r.stdout


def test_an_evaluation_problem_fails_before_the_first_step_in_one_line(demo_small, tmp_path, capsys, caplog,
                                                                      monkeypatch):
    """An ``area`` written as a string (some converters do) reads fine and breaks
    pycocotools' area ranges; before, that came after training, at the first evaluation.
    main() in this process: it fails before the first step (a traceback would fail the test)."""
    def bad_area(doc, split):
        if split == "val":
            doc["annotations"][0]["area"] = "12.5"
    data = _copy_with(demo_small, tmp_path / "data", bad_area)
    out = tmp_path / "out"
    # pycocotools breaks on it; faster-coco-eval reads the string as a number
    monkeypatch.setenv("FASTDET_COCO_EVAL", "pycocotools")
    code, _, err = main_in_process(train_cmd(data, out, "--max-steps", "2")[3:], capsys, caplog)
    assert code == 1
    assert "fails before training, scoring against the ground truth of" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (out / "metrics.jsonl").exists() and not (out / "latest.pth").exists()


# --------------------------------------------------------------------------- 3, 9. resume

def test_resume_rebuilds_the_run_from_its_checkpoint(first_run, tmp_path, capsys, caplog):
    """No --arch, --data or --img-size: the run's own config (64 px, the demo_small set).
    A checkpoint older than the logs (a run killed after it) truncates metrics.jsonl and
    TensorBoard to its step; a finished run says so; a changed recipe flag is named."""
    _, src = first_run
    out = tmp_path / "run"
    shutil.copytree(src, out)
    at2 = (out / "latest.pth").read_bytes()
    resume = [sys.executable, "-m", "fastdet.train", "--resume", "--output-dir", str(out),
              "--device", "cpu", "--workers", "0"]
    r = run(resume + ["--max-steps", "3"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "train sizes 64, eval size 64" in r.stdout, r.stdout
    import yaml
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["img_size"] == 64
    (out / "latest.pth").write_bytes(at2)  # killed after step 3 was logged, before its checkpoint
    r = run(resume + ["--max-steps", "4"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert steps(out / "metrics.jsonl") == [1, 2, 3, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/total_loss")] == [1, 2, 3, 4]
    # Nothing to train, and two refusals: in this process.
    code, said, err = main_in_process(resume[3:] + ["--max-steps", "4"], capsys, caplog)
    assert code == 0 and "finished at step 4 of 4" in said, said + err
    code, _, err = main_in_process(resume[3:] + ["--img-size", "96"], capsys, caplog)
    assert code == 2
    assert "--resume: --img-size 96 differs from the run's data.img_size 64" in err, err
    assert len(err.strip().splitlines()) == 1
    # The set's classes changed under the run (here: the run's record of them): one line, not
    # a state-dict size mismatch.
    from fastdet.runtime.checkpoint import save_checkpoint

    ck = load_checkpoint(out / "latest.pth")
    ck["class_names"] = [*ck["class_names"], "project"]
    save_checkpoint(out / "latest.pth", ck)
    code, _, err = main_in_process(resume[3:] + ["--max-steps", "5"], capsys, caplog)
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "trained 5 classes, the set has 4 now (only in the run: " \
        "['project'], only in the set: none" in err, err


def test_resume_from_a_checkpoint_into_another_runs_directory_is_refused(first_run, tmp_path, capsys):
    """``--resume --ckpt A/latest.pth --output-dir B`` with B holding another run: one line,
    B untouched (before, B's logs were cut at A's step, its checkpoints replaced and its
    latest.pth kept as this run's fallback). B holding this run (a latest.pth of the same
    config), an empty B, or A's own directory are where it may continue."""
    from fastdet.config import ConfigError
    from fastdet.runtime.checkpoint import save_checkpoint
    from fastdet.train import check_resume_target
    from fastdet.train import main as train_main

    _, src = first_run
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    ck = load_checkpoint(b / "latest.pth")
    ck["config"]["optim"]["base_lr"] *= 2  # another run's
    save_checkpoint(b / "latest.pth", ck)
    before = {f.name: f.read_bytes() for f in b.iterdir() if f.is_file()}
    assert train_main(["--resume", "--ckpt", str(a / "latest.pth"), "--output-dir", str(b), "--max-steps", "3",
                       "--device", "cpu", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--resume: {b} holds another run than {a / 'latest.pth'}'s" in err[0], err
    assert {f.name: f.read_bytes() for f in b.iterdir() if f.is_file()} == before
    config = load_checkpoint(a / "latest.pth")["config"]
    with pytest.raises(ConfigError):
        check_resume_target(a / "latest.pth", config, b)
    for ok in (a, src, tmp_path / "empty"):
        check_resume_target(a / "latest.pth", config, ok)


# --------------------------------------------------------------------------- 4, 10. custom data, sizes

def test_custom_data_uses_the_preset_and_needs_all_four_paths(demo_paths, capsys, caplog):
    import yaml

    paths = ["--train-ann", str(demo_paths.train_ann), "--train-images", str(demo_paths.train_images),
             "--val-ann", str(demo_paths.val_ann), "--val-images", str(demo_paths.val_images)]
    code, out, err = main_in_process(["--print-config", *paths, "--img-size", "320"], capsys, caplog)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["optim"]["optimizer"] == "sgd" and cfg["optim"]["epochs"] == 300  # PP-YOLOE-s, not the demo's
    assert cfg["data"]["img_size"] == 320
    assert cfg["data"]["train_sizes"] == list(range(160, 385, 32))  # 320..768 around 640, halved
    assert cfg["model"]["num_classes"] == 4
    code, _, err = main_in_process(["--print-config", *paths[:4], *paths[6:]], capsys, caplog)
    assert code == 2
    assert "--val-ann missing" in err and len(err.strip().splitlines()) == 1, err


def test_help_names_every_family_size_and_the_data_flags(capsys, caplog):
    code, out, _ = main_in_process(["--help"], capsys, caplog)
    assert code == 0
    text = " ".join(out.split())
    assert "yolox: nano, tiny, s, m, l, x" in text and "fcos: r50" in text
    assert "COCO instances file of the training set" in text


# --------------------------------------------------------------------------- 5. --ckpt of another model

def test_ckpt_of_another_size_is_refused_naming_both(demo_small, first_run, tmp_path, capsys, caplog):
    _, src = first_run
    code, _, err = main_in_process(train_cmd(demo_small, tmp_path / "m", "--size", "m", "--ckpt",
                                             str(src / "latest.pth"))[3:], capsys, caplog)
    assert code == 2
    assert "holds ppyoloe-s weights and this run trains ppyoloe-m" in err and "--ckpt-partial" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m").exists()


# --------------------------------------------------------------------------- 8, 11. messages, best.pth

def test_best_checkpoint_holds_no_optimizer_state(first_run):
    _, src = first_run
    best, latest = load_checkpoint(src / "best.pth"), load_checkpoint(src / "latest.pth")
    assert "optimizer" not in best and "optimizer" in latest
    assert {"model", "ema", "config", "class_names", "cat_ids"} <= set(best)
    assert (src / "best.pth").stat().st_size < (src / "latest.pth").stat().st_size


def test_a_batch_larger_than_the_set_is_one_line_naming_the_flag_once(demo_small, tmp_path, capsys, caplog):
    code, out, err = main_in_process(train_cmd(demo_small, tmp_path / "out", "--batch-size", "64")[3:], capsys,
                                     caplog)
    assert code == 1
    assert "lower --batch-size" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "lower --batch-size" not in out  # once, not also as a log line


def test_a_folder_given_as_the_annotation_file_is_named_as_such(demo_small, tmp_path, capsys, caplog):
    code, _, err = main_in_process(train_cmd(demo_small, tmp_path / "out", "--train-ann",
                                             str(demo_small / "annotations"))[3:], capsys, caplog)
    assert code == 1
    assert "is a directory; expected the COCO annotation JSON file" in err, err


# --------------------------------------------------------------------------- 13. fastdet.detect's inputs

def test_detect_inputs_paths_pil_arrays_one_or_many(demo_small):
    import numpy as np
    import torch
    from PIL import Image

    from fastdet.api import as_rgb_images
    from fastdet.data.augment import decode_image

    f = sorted((demo_small / "val2017").glob("*.jpg"))[0]
    rgb = decode_image(str(f))
    for one in (f, str(f), Image.open(f), rgb, torch.from_numpy(rgb), rgb.astype(np.float32)):
        got = as_rgb_images(one)
        assert len(got) == 1 and got[0].dtype == np.uint8 and np.array_equal(got[0], rgb), type(one)
    assert len(as_rgb_images([f, rgb, Image.open(f)])) == 3
    assert len(as_rgb_images(np.stack([rgb, rgb]))) == 2  # [N, H, W, C]: a batch
    gray = rgb[:, :, 0]
    assert np.array_equal(as_rgb_images(gray)[0], np.repeat(gray[:, :, None], 3, 2))
    assert np.array_equal(as_rgb_images(gray[:, :, None])[0], as_rgb_images(Image.fromarray(gray))[0])
    rgba = np.concatenate([rgb, np.full_like(rgb[:, :, :1], 7)], 2)
    assert np.array_equal(as_rgb_images(rgba)[0], rgb)
    assert np.array_equal(as_rgb_images(Image.fromarray(rgba, "RGBA"))[0], rgb)
    for bad, needle in ((rgb / 255.0, "multiply a [0, 1] image by 255"),
                        (rgb.astype(np.float32) * 2, "must lie in 0..255"),
                        (-rgb.astype(np.float32), "must lie in 0..255"),
                        (rgb.astype(np.uint16), "expected uint8"),
                        (rgb[:, :, :2], "expected an [H, W] or [H, W, 1|3|4] image")):
        with pytest.raises(ValueError) as e:
            as_rgb_images(bad)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_demo_generation_says_what_it_does(tmp_path):
    import logging

    from fastdet.data.demo import make_demo

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("fastdet")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        make_demo(tmp_path / "demo", num_train=2, num_val=1, seed=0)
        make_demo(tmp_path / "demo", num_train=2, num_val=1, seed=0)  # present: says nothing
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert len(lines) == 2, lines
    assert lines[0].startswith("generating the demo set (2 train, 1 val images") and str(tmp_path) in lines[0]
    assert lines[1].startswith("demo set generated in ")
