"""What a user does next after the README (issue 26): nothing they do loses their work.

CLI behaviour is tested through the command line in a subprocess, at 64 px with a few
steps on the small demo set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastdet.engine.checkpoint import load_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}


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


def test_exist_ok_writes_into_the_directory(demo_small, tmp_path):
    run(train_cmd(demo_small, tmp_path, "--max-steps", "1"))
    r = run(train_cmd(demo_small, tmp_path, "--max-steps", "2", "--exist-ok"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert load_checkpoint(tmp_path / "latest.pth")["step"] == 2
    assert not (tmp_path.parent / (tmp_path.name + "2")).exists()


def test_predict_never_writes_over_a_source_image(demo_small, tmp_path):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    src = sorted((demo_small / "val2017").glob("*.jpg"))[0]
    shutil.copy(src, imgs / "a.jpg")
    before = (imgs / "a.jpg").read_bytes()
    ckpt = tmp_path / "w.pth"
    ckpt.write_bytes(b"checked after the source")  # the refusal comes before the checkpoint is read
    r = run([sys.executable, "-m", "fastdet.predict", "--ckpt", str(ckpt), "--source", str(imgs / "a.jpg"),
             "--output-dir", str(imgs), "--device", "cpu"])
    assert r.returncode == 2
    assert "would replace the source image" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
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


def test_an_evaluation_problem_fails_before_the_first_step_in_one_line(demo_small, tmp_path):
    """An ``area`` written as a string (some converters do) reads fine and breaks
    pycocotools' area ranges; before, that came after training, at the first evaluation."""
    def bad_area(doc, split):
        if split == "val":
            doc["annotations"][0]["area"] = "12.5"
    data = _copy_with(demo_small, tmp_path / "data", bad_area)
    out = tmp_path / "out"
    r = run(train_cmd(data, out, "--max-steps", "2"))
    assert r.returncode == 1
    assert "fails before training, scoring with pycocotools against" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "latest.pth").exists()
