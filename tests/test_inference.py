"""Using a trained detector: load_detector, fastdet.predict, fastdet.export, val predictions.

Every registered family gets the same tests on a tiny checkpoint of its smallest size,
trained in-process for 2 steps at 64 px on the small demo set (once per family).
"""

from __future__ import annotations

import json
import re
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdet.api import CheckpointError, detect, load_detector, preprocess_images
from fastdet.data.augment import decode_image
from fastdet.data.preprocess import boxes_to_original
from fastdet.models import ARCHITECTURES

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS: tests/conftest.py
IMG = 64
# Low enough that a 2-step model has detections to compare: YOLOX's scores start at
# obj x cls = 0.01 x 0.01 (its prior-probability bias init).
LOW_THRESH = 5e-5


def smallest_size(arch: str) -> str:
    """The family's size with the fewest parameters (built on the meta device: no memory)."""
    fam = ARCHITECTURES[arch]

    def numel(size: str) -> float:
        try:
            with torch.device("meta"):
                return sum(p.numel() for p in fam.build(size, 4).parameters())
        except Exception:  # a builder the meta device cannot run: rank it last
            return float("inf")

    return min(fam.sizes, key=numel)


class Tiny:
    def __init__(self, arch: str, out: Path, trainer, stats):
        self.arch, self.out, self.trainer, self.stats = arch, out, trainer, stats
        self.ckpt = out / "latest.pth"


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny(request, demo_small, tmp_path_factory) -> Tiny:
    from fastdet.runtime import dist
    from fastdet.engine.trainer import Trainer
    from fastdet.train import build_parser, resolve_config

    arch = request.param
    out = tmp_path_factory.mktemp(f"tiny_{arch}")
    args = build_parser().parse_args([
        "--arch", arch, "--size", smallest_size(arch), "--data", str(demo_small),
        "--device", "cpu", "--img-size", str(IMG), "--no-multiscale", "--batch-size", "4",
        "--max-steps", "2", "--output-dir", str(out), "--workers", "0",
        "--set", "data.eval_batch_size=8", "--set", "optim.warmup_steps=2"])
    torch.manual_seed(0)
    trainer = Trainer(resolve_config(args))
    try:
        stats = trainer.train()
    finally:
        dist.shutdown()
    return Tiny(arch, out, trainer, stats)


@pytest.fixture(scope="module")
def det(tiny):
    """The fused EMA detector of the tiny checkpoint (loading takes seconds on a busy CPU)."""
    return load_detector(tiny.ckpt)


def val_images(demo_small: Path, n: int = 3) -> list[np.ndarray]:
    files = sorted((demo_small / "val2017").glob("*.jpg"))[:n]
    return [decode_image(str(f)) for f in files]


def run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


# --------------------------------------------------------------------------- load_detector

def test_load_detector_matches_the_trainers_eval_model(tiny, det, demo_small):
    images, _ = preprocess_images(val_images(demo_small), det.info.preprocess, IMG)
    trainer = tiny.trainer  # what Trainer.evaluate scores: the EMA when the recipe keeps one (FCOS does not)
    evaluated = (trainer.ema.averaged() if trainer.ema is not None else trainer.model).eval()
    with torch.no_grad():
        ref = evaluated(images)
        plain = load_detector(tiny.ckpt, fuse=False)(images)
        fused = det(images)
    for r, p, f in zip(ref, plain, fused):
        assert torch.equal(r, p)
        torch.testing.assert_close(f, r, atol=2e-4, rtol=1e-4)
    raw = load_detector(tiny.ckpt, ema=False, fuse=False)
    with torch.no_grad():
        assert torch.equal(raw(images)[1], tiny.trainer.model.eval()(images)[1])
    assert not raw.training and raw.info.weights == "model"


def test_load_detector_carries_names_preprocessing_and_nms(tiny, det):
    info = det.info
    assert info.arch == tiny.arch and info.img_size == IMG
    assert info.class_names == ("circle", "rectangle", "triangle", "cross")
    assert info.cat_ids == (1, 3, 7, 12)
    assert info.preprocess == ARCHITECTURES[tiny.arch].preprocess
    from fastdet import registry

    assert info.predict_kwargs == registry.predict_kwargs(tiny.trainer.cfg)  # the recipe's NMS settings


def test_load_detector_postprocess_changes_only_the_nms_its_family_reads(tiny, det, demo_small):
    """``load_detector(postprocess=...)``: the recipe's NMS with those fields changed (in
    ``info.predict_kwargs`` and what detect keeps); a field the family's post-processing
    does not read (a training field; PP-YOLO's Matrix NMS has no IoU) or a value out of range
    is one ConfigError naming it."""
    from fastdet.config import ConfigError

    few = load_detector(tiny.ckpt, postprocess={"max_det": "3", "score_thresh": 0})
    assert few.info.predict_kwargs == {**det.info.predict_kwargs, "max_det": 3, "score_thresh": 0.0}
    kept = detect(few, val_images(demo_small, 2))
    assert [len(d["scores"]) for d in kept] == [3, 3]  # threshold 0: the best 3 of an untrained model
    reads = ", ".join(f"family.{f}" for f in ("score_thresh", "post_thresh", "max_det", "pre_nms_topk")) \
        if tiny.arch == "ppyolo" else "family.nms_iou"
    with pytest.raises(ConfigError, match=re.escape(reads)):
        load_detector(tiny.ckpt, postprocess={"flip_prob": 0.0})
    if tiny.arch == "ppyolo":
        with pytest.raises(ConfigError, match="family.nms_iou: only the post-processing can change here"):
            load_detector(tiny.ckpt, postprocess={"nms_iou": 0.5})
    with pytest.raises(ConfigError, match=re.escape("family.max_det must be at least 1, got 0")):
        load_detector(tiny.ckpt, postprocess={"max_det": 0})


def test_detect_maps_boxes_to_original_pixels(det, demo_small):
    imgs = val_images(demo_small, 3)
    out = detect(det, imgs, score_thresh=LOW_THRESH)
    assert sum(len(o["scores"]) for o in out) > 0
    pre = det.info.preprocess
    canvases = [pre.canvas(*img.shape[:2], IMG) for img in imgs]
    for i, (o, img) in enumerate(zip(out, imgs)):
        # Each image on the canvas of its orientation (alone, it gets that one too), in one
        # batch with the images of the same canvas, as detect runs them.
        assert tuple(preprocess_images([img], pre, IMG)[0].shape[-2:]) == canvases[i]
        group = [j for j, c in enumerate(canvases) if c == canvases[i]]
        batch, scales = preprocess_images([imgs[j] for j in group], pre, IMG, canvases[i])
        d = det.predict(batch, **{**det.info.predict_kwargs, "score_thresh": LOW_THRESH})[group.index(i)]
        s = scales[group.index(i)]
        h, w = img.shape[:2]
        torch.testing.assert_close(o["boxes"], boxes_to_original(d["boxes"], s, (h, w)))
        assert (o["boxes"][:, 2] <= w).all() and (o["boxes"][:, 3] <= h).all()


def test_not_a_checkpoint_is_one_line(tmp_path, tiny, det, caplog):
    junk = tmp_path / "junk.pth"
    junk.write_bytes(os.urandom(512))
    plain = tmp_path / "state_dict.pth"
    torch.save(det.state_dict(), plain)
    cut = tmp_path / "truncated.pth"
    cut.write_bytes(tiny.ckpt.read_bytes()[:4096])
    for path in (junk, plain, cut):
        with pytest.raises(CheckpointError) as e:
            load_detector(path)
        msg = str(e.value)
        assert "\n" not in msg and str(path) in msg and "not a fastdet checkpoint" in msg, msg
    ck = torch.load(tiny.ckpt, weights_only=False)
    nameless = tmp_path / "nameless.pth"
    torch.save({**ck, "config": {"model": {}}}, nameless)  # rebuilt as the defaults' model before
    with pytest.raises(CheckpointError, match="its stored config names no model.arch and model.size"):
        load_detector(nameless)
    if tiny.arch == "yolox":  # converted from Megvii's BGR-trained file before the stem was turned to RGB
        stale = tmp_path / "stale.pth"
        torch.save({**ck, "converted_from": {"file": "yolox_s.pth", "source": "megvii"}}, stale)
        with caplog.at_level(logging.WARNING, logger="fastdet"):
            load_detector(stale)
        assert caplog.text.count("convert yolox_s.pth again") == 1, caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastdet"):
            load_detector(stale, arch="yolox")  # through the converter's reader: the file read, and said, once
        assert caplog.text.count("convert yolox_s.pth again") == 1, caplog.text
    other = {**ck, "config": {"model": {"arch": "ppyoloe", "size": "x",
                                        "num_classes": ck["config"]["model"]["num_classes"]}}}
    if tiny.arch != "ppyoloe":
        torch.save(other, tmp_path / "other.pth")
        with pytest.raises(CheckpointError, match="its weights do not fit ppyoloe-x") as e:
            load_detector(tmp_path / "other.pth")
        assert len(str(e.value)) < 500, str(e.value)  # the first keys, not hundreds
    # With --arch (a released file to convert), the same files and a missing one say what they are.
    other = "ppyoloe" if tiny.arch != "ppyoloe" else "yolox"
    for path, says in ((junk, "neither a torch file"), (cut, "a zip archive that does not open"),
                       (tmp_path / "missing.pth", "no such file")):
        with pytest.raises((CheckpointError, ValueError)) as e:
            load_detector(path, arch=other)
        assert "\n" not in str(e.value) and str(path) in str(e.value) and says in str(e.value), str(e.value)
    # A fastdet checkpoint says what it is: arch=, size= or source= that say otherwise are refused.
    size = det.info.size
    for kw in ({"arch": other}, {"arch": tiny.arch, "size": "x"}, {"arch": tiny.arch, "source": "megvii"}):
        key = "arch" if kw["arch"] == other else next(iter(set(kw) - {"arch"}))
        with pytest.raises(CheckpointError, match=f"a fastdet {tiny.arch}-{size} checkpoint, but {key}="):
            load_detector(tiny.ckpt, **kw)
    assert load_detector(tiny.ckpt, arch=tiny.arch, size=size).info.arch == tiny.arch


# --------------------------------------------------------------------------- fastdet.predict

def test_predict_cli_draws_each_image_and_writes_coco_results(tiny, det, demo_small, tmp_path):
    from pycocotools.coco import COCO

    src = tmp_path / "src"
    src.mkdir()
    files = sorted((demo_small / "val2017").glob("*.jpg"))[:5]
    for f in files:
        shutil.copy(f, src / f.name)
    (src / "000009999999.jpg").write_bytes(b"\xff\xd8 not a jpeg")  # corrupt: a counted skip
    (src / "notes.txt").write_text("not an image")  # not an image file: ignored
    out = tmp_path / "out"
    r = run([sys.executable, "-m", "fastdet.predict", "--ckpt", str(tiny.ckpt), "--source", str(src),
             "--output-dir", str(out), "--score-thresh", str(LOW_THRESH), "--batch-size", "2",
             "--device", "cpu"])
    assert r.returncode == 0, r.stdout + r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert "predicted 5 image(s)" in summary and "skipped 1 unreadable file(s)" in summary, summary
    assert "000009999999.jpg" in summary
    assert sorted(p.name for p in out.glob("*.jpg")) == [f.name for f in files]
    drawn = decode_image(str(out / files[0].name))
    assert drawn.shape == decode_image(str(files[0])).shape  # drawn on the original
    results = json.loads((out / "predictions.json").read_text())
    assert results and {r["file_name"] for r in results} <= {f.name for f in files}
    gt = COCO(str(demo_small / "annotations" / "instances_val2017.json"))
    dt = gt.loadRes(results)  # numeric stems are the COCO image ids
    assert len(dt.getAnnIds()) == len(results)
    # The JSON holds what detect() gives on the same batch, in original pixels (COCO xywh).
    first = detect(det, [decode_image(str(f)) for f in files[:2]], score_thresh=LOW_THRESH)[0]
    mine = [r for r in results if r["file_name"] == files[0].name]
    assert len(mine) == len(first["scores"])
    if mine:
        b = first["boxes"][0].tolist()
        assert mine[0]["bbox"] == pytest.approx([b[0], b[1], b[2] - b[0], b[3] - b[1]], abs=0.02)
        assert mine[0]["category_id"] == det.info.cat_ids[int(first["labels"][0])]


def test_predict_cli_bad_flags_are_one_line_before_any_work(tiny, demo_small, tmp_path, capsys):
    from fastdet.predict import main

    image = str(sorted((demo_small / "val2017").glob("*.jpg"))[0])
    out = tmp_path / "never"
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"hello")
    links = tmp_path / "links"  # a folder of links to images elsewhere (a VOC split's)
    links.mkdir()
    (links / "a.jpg").symlink_to(image)
    video = tmp_path / "clip.MP4"
    video.write_bytes(b"\x00\x00\x00\x18ftypmp42")
    base = ["--ckpt", str(tiny.ckpt), "--source", image, "--output-dir", str(out)]
    for argv, needle in ((base + ["--score-thresh", "2"], "--score-thresh"),
                         (base + ["--img-size", "50"], "--img-size"),
                         (base + ["--batch-size", "0"], "--batch-size"),
                         (base[:2] + ["--source", str(tmp_path / "nothing*.png")] + base[4:], "matches no files"),
                         (base[:2] + ["--source", str(tmp_path / "missing.jpg")] + base[4:], "no such file"),
                         (["--ckpt", str(junk)] + base[2:], "not a fastdet checkpoint"),
                         (base[:2] + ["--source", str(Path(image).parent), "--output-dir", str(Path(image).parent)],
                          "is the folder of the source images"),
                         (base[:2] + ["--source", str(video)] + base[4:], "a video; fastdet.predict reads images"),
                         (base[:2] + ["--source", str(links), "--output-dir", str(links)],
                          "is the folder of the source images"),
                         (base + ["--set", "family.score_thresh=0.5"], "give --score-thresh"),
                         (base + ["--set", "optim.base_lr=1"], "--set optim.base_lr: only the post-processing"),
                         (base + ["--set", "family.max_det=0"], "family.max_det must be at least 1, got 0")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_drawn_copies_have_a_name_each():
    """Two sources of one stem (``a.jpg`` and ``a.png``, or in two folders) and a source
    whose stem is a renamed copy's (``a_1``): every drawn copy gets its own file, and a
    source keeps its own stem where it can."""
    from fastdet.predict import output_names

    files = [Path("x/a.jpg"), Path("x/a.png"), Path("x/a_1.jpg"), Path("y/a.jpg"), Path("y/b.jpg")]
    names = output_names(files)
    assert len(set(names)) == len(files)
    assert names[0] == "a.jpg" and names[2] == "a_1.jpg" and names[4] == "b.jpg"


def test_predict_and_export_never_replace_a_file_unasked(tiny, demo_small, tmp_path, capsys):
    """An earlier prediction's files, an existing .onnx and the checkpoint itself are refused
    in one line before any work, untouched; ``--exist-ok`` / ``--overwrite`` replace them."""
    from fastdet import export, predict

    image = sorted((demo_small / "val2017").glob("*.jpg"))[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "predictions.json").write_text("earlier")
    (out / image.name).write_bytes(b"a user's picture")
    argv = ["--ckpt", str(tiny.ckpt), "--source", str(image), "--output-dir", str(out), "--device", "cpu"]
    assert predict.main(argv) == 2
    err = capsys.readouterr().err
    assert "--exist-ok" in err and "predictions.json" in err and len(err.strip().splitlines()) == 1, err
    assert (out / "predictions.json").read_text() == "earlier"
    assert (out / image.name).read_bytes() == b"a user's picture"
    assert predict.main(argv + ["--exist-ok", "--score-thresh", "0"]) == 0
    assert json.loads((out / "predictions.json").read_text())
    assert decode_image(str(out / image.name)).shape == decode_image(str(image)).shape
    # The source now unreadable: nothing predicted is a failure, and its earlier drawn copy goes.
    broken = tmp_path / "broken" / image.name
    broken.parent.mkdir()
    broken.write_bytes(b"not a jpeg any more")
    assert predict.main(["--ckpt", str(tiny.ckpt), "--source", str(broken), "--output-dir", str(out),
                         "--device", "cpu", "--exist-ok"]) == 1
    assert "skipped 1 unreadable file(s)" in capsys.readouterr().out
    assert not (out / image.name).exists() and json.loads((out / "predictions.json").read_text()) == []

    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"an earlier export")
    for target in (onnx, tiny.ckpt):
        assert export.main(["--ckpt", str(tiny.ckpt), "--output", str(target)]) == 2
        err = capsys.readouterr().err
        assert str(target) in err and len(err.strip().splitlines()) == 1, err
    assert onnx.read_bytes() == b"an earlier export"
    assert export.main(["--ckpt", str(tiny.ckpt), "--output", str(tiny.ckpt), "--overwrite"]) == 2
    assert "is the checkpoint" in capsys.readouterr().err
    assert export.main(["--ckpt", str(tiny.ckpt), "--output", str(out), "--overwrite"]) == 2  # a folder
    assert f"--output {out} is a folder" in capsys.readouterr().err
    assert export.main(["--ckpt", str(tiny.ckpt), "--output", str(tmp_path / "d.onnx"), "--score-thresh", "0.5"]) == 2
    assert "give --nms too" in capsys.readouterr().err and not (tmp_path / "d.onnx").exists()
    assert load_detector(tiny.ckpt).info.arch == tiny.arch


# --------------------------------------------------------------------------- predictions while training

def test_training_logs_val_predictions(tiny):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pic = tiny.out / "val_predictions.jpg"
    img = decode_image(str(pic))
    assert img.shape[0] >= 2 * 320 and img.shape[1] >= 4 * 320  # 8 tiles, 4 per row
    acc = EventAccumulator(str(tiny.out / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert "val/predictions" in acc.Tags()["images"]
    assert [e.step for e in acc.Images("val/predictions")] == [tiny.trainer.step]
    final = [l for l in (tiny.out / "train.log").read_text().splitlines() if "final:" in l]
    assert final and str(pic) in final[-1]


# --------------------------------------------------------------------------- fastdet.export

def perturbed(det):
    """``det`` with noise on its head's parameters: distinct scores for every anchor, so
    NMS's greedy order has no ties (a 2-step model scores nearly everything at its prior)."""
    import copy

    g = torch.Generator().manual_seed(0)
    out = copy.deepcopy(det)
    with torch.no_grad():
        for p in out.head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return out


@pytest.fixture(scope="module")
def onnx_files(tiny, det, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from fastdet.export import export_nms_form, export_onnx

    out = tmp_path_factory.mktemp(f"onnx_{tiny.arch}")
    cli = run([sys.executable, "-m", "fastdet.export", "--ckpt", str(tiny.ckpt), "--format", "onnx",
               "--output", str(out / "dynamic.onnx"), "--dynamic-batch"])
    kw = {**det.info.predict_kwargs, "score_thresh": LOW_THRESH}
    # The static and NMS files are exported when a test first asks for them: the fast
    # suite reads only the CLI's file, and each export of FCOS r50 takes ~15 s here.
    return LazyFiles({"cli": cli, "dynamic": out / "dynamic.onnx"}, {
        "static": lambda: export_onnx(det, out / "static.onnx", IMG),
        "nms": lambda: (export_onnx(perturbed(det), out / "nms.onnx", IMG, dynamic_batch=True, nms=True,
                                    predict_kwargs=kw) if export_nms_form(det) else None),
        "portrait": lambda: (export_onnx(det, out / "portrait.onnx", IMG, canvas="portrait")
                             if "portrait" in det.info.preprocess.canvases().named(IMG) else None),
    })


class LazyFiles(dict):
    """A dict whose missing keys are made once, by the maker of that key."""

    def __init__(self, ready: dict, makers: dict):
        super().__init__(ready)
        self.makers = makers

    def __missing__(self, key):
        self[key] = made = self.makers[key]()
        return made


def exported_canvas(det) -> tuple[int, int]:
    """The (H, W) input of an export at ``IMG`` without --canvas: the family's first canvas
    (keep-ratio: landscape)."""
    return det.info.preprocess.canvases().buckets(IMG)[0]


def ort_run(path: Path, images: torch.Tensor) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"images": images.numpy()})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_onnx_dense_outputs_match_load_detector(det, onnx_files, demo_small, kind):
    import onnx

    assert onnx_files["cli"].returncode == 0, onnx_files["cli"].stderr
    proto = onnx.load(str(onnx_files[kind]))
    assert [i.name for i in proto.graph.input] == ["images"]
    assert [o.name for o in proto.graph.output] == ["boxes", "scores"]
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)  # no fastdet.ops kernel
    images, _ = preprocess_images(val_images(demo_small, 3), det.info.preprocess, IMG, exported_canvas(det))
    for batch in ([images[:1]] if kind == "static" else [images[:1], images]):
        boxes, scores = ort_run(onnx_files[kind], batch)
        with torch.no_grad():
            ref_boxes, ref_scores = det(batch)
        assert boxes.shape == tuple(ref_boxes.shape) and scores.shape == tuple(ref_scores.shape)
        # Boxes decoded through exp() (YOLO-style heads) carry the logits' relative error.
        torch.testing.assert_close(torch.from_numpy(boxes), ref_boxes, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(torch.from_numpy(scores), ref_scores, atol=1e-3, rtol=0)
    if kind == "static":
        from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

        # N is fixed at 1: onnxruntime refuses the batch of 3 on the input's first dimension.
        batch_dim = r"(?s)invalid dimensions for input: images.*index: 0 Got: 3 Expected: 1"
        with pytest.raises(InvalidArgument, match=batch_dim):
            ort_run(onnx_files[kind], images)


@pytest.mark.slow
def test_onnx_nms_matches_predict(det, onnx_files, demo_small, tmp_path):
    import onnx

    if onnx_files["nms"] is None:
        # PP-YOLO's Matrix NMS is exported dense only: --nms is refused before any export work.
        from fastdet.export import export_onnx

        with pytest.raises(ValueError, match=f"--nms: {type(det).__name__} has its own NMS"):
            export_onnx(det, tmp_path / "nms.onnx", IMG, nms=True)
        assert not (tmp_path / "nms.onnx").exists()
        return
    proto = onnx.load(str(onnx_files["nms"]))
    assert "NonMaxSuppression" in {n.op_type for n in proto.graph.node}
    from fastdet.export import export_nms_form

    assert {p.key: p.value for p in proto.metadata_props}["nms_form"] == export_nms_form(det)
    det = perturbed(det)
    kw = {**det.info.predict_kwargs, "score_thresh": LOW_THRESH}
    images, _ = preprocess_images(val_images(demo_small, 3), det.info.preprocess, IMG, exported_canvas(det))
    boxes, scores, labels, num = ort_run(onnx_files["nms"], images)
    ref = det.predict(images, **kw)
    assert sum(len(r["scores"]) for r in ref) > 0
    for j, r in enumerate(ref):
        k = int(num[j])
        assert k == len(r["scores"])
        assert (scores[j, k:] == 0).all()
        got_b, got_s, got_l = (torch.from_numpy(x[j, :k]) for x in (boxes, scores, labels))
        assert (got_s[:-1] >= got_s[1:]).all()  # best first
        # One to one, each detection with the torch one of its class whose box is nearest:
        # YOLOX's scores (obj x cls, ~1e-4 on this model) differ in their last bits between
        # onnxruntime and torch, so near-equal ones may be listed in another order.
        dist = (got_b[:, None] - r["boxes"][None].float()).abs().amax(-1)  # [k, k] px
        dist[got_l[:, None] != r["labels"][None]] = float("inf")
        near, idx = dist.min(1)
        assert (near < 1e-3).all() and sorted(idx.tolist()) == list(range(k)), near.max()
        torch.testing.assert_close(got_s, r["scores"][idx].float(), atol=1e-5, rtol=0)
    from fastdet.export import compare_with_torch  # what the CLI prints

    diff, unmatched, total = compare_with_torch(det, onnx_files["nms"], images, True, kw)
    assert unmatched == 0 and total == sum(len(r["scores"]) for r in ref) and diff < 1e-3


@pytest.mark.slow
def test_export_cli_prints_the_difference(tiny, onnx_files, tmp_path, capsys):
    from fastdet.export import main

    r = onnx_files["cli"]
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert "onnx.checker passed" in line and onnx_files["dynamic"].is_file(), line
    assert float(line.rsplit(" ", 1)[1]) < 1e-3
    for argv, needle in ((["--img-size", "33"], "--img-size"), (["--score-thresh", "-1"], "--score-thresh")):
        assert main(["--ckpt", str(tiny.ckpt), "--output", str(tmp_path / "m.onnx"), *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m.onnx").exists()


def test_export_canvas_of_another_family_is_one_line(tiny, det, tmp_path, capsys):
    from fastdet.export import main

    if det.info.preprocess.resize == "keep_ratio":
        pytest.skip("every --canvas is a keep-ratio family's (test_keep_ratio_exports_each_canvas)")
    assert main(["--ckpt", str(tiny.ckpt), "--output", str(tmp_path / "m.onnx"), "--canvas", "portrait"]) == 2
    err = capsys.readouterr().err
    assert "--canvas portrait: expected one of square" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("argv, message", [
    (["--set", "family.max_det=5"], "--set family.max_det changes the exported NMS: give --nms too"),
    (["--nms", "--set", "family.score_thresh=0.1", "--score-thresh", "0.2"],
     "--score-thresh and --set family.score_thresh: give one of them"),
    (["--nms", "--set", "family.max_det=0"], "family.max_det must be at least 1, got 0"),
])
def test_export_set_is_the_nms_s_and_one_line_otherwise(tiny, tmp_path, capsys, argv, message):
    from fastdet.export import main

    assert main(["--ckpt", str(tiny.ckpt), "--output", str(tmp_path / "m.onnx"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_keep_ratio_exports_each_canvas(det, onnx_files, demo_small):
    """FCOS evaluates a portrait image on the (L, S) canvas: ``--canvas portrait`` exports
    that input, says so, and gives det's outputs on portrait images preprocessed onto it."""
    import onnx

    path = onnx_files["portrait"]
    if path is None:
        pytest.skip(f"{det.info.arch} has one square canvas (its --canvas refusal: the test above)")
    hw = det.info.preprocess.canvases().named(IMG)["portrait"]
    proto = onnx.load(str(path))
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, *hw] and hw[0] > hw[1]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["canvas"] == "portrait" and json.loads(meta["input_size"]) == list(hw)
    portrait = [img for img in val_images(demo_small, 12) if img.shape[0] > 1.1 * img.shape[1]][:1]
    assert portrait and det.info.preprocess.canvas(*portrait[0].shape[:2], IMG) == hw
    images, _ = preprocess_images(portrait, det.info.preprocess, IMG, hw)
    boxes, scores = ort_run(path, images)
    with torch.no_grad():
        ref_boxes, ref_scores = det(images)
    torch.testing.assert_close(torch.from_numpy(boxes), ref_boxes, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(torch.from_numpy(scores), ref_scores, atol=1e-3, rtol=0)


def test_export_nms_refuses_a_family_with_its_own_nms(det, tmp_path):
    import copy

    from fastdet.export import export_onnx

    class OwnNMS(type(det)):
        def predict(self, images, **kw):
            return []

    own = copy.deepcopy(det)
    own.__class__ = OwnNMS
    with pytest.raises(ValueError, match="--nms: OwnNMS has its own NMS"):
        export_onnx(own, tmp_path / "x.onnx", IMG, nms=True)
    assert not (tmp_path / "x.onnx").exists()


def test_each_family_exports_the_nms_form_of_its_predict():
    from fastdet.export import export_nms_form
    from fastdet.models import build_model

    forms = {arch: export_nms_form(build_model(arch, smallest_size(arch), num_classes=3)) for arch in ARCHITECTURES}
    assert forms == {"ppyoloe": "multiclass", "fcos": "multiclass", "yolox": "best_class", "ppyolo": None}


@pytest.mark.parametrize("pre_nms_topk", [0, 40])
def test_best_class_nms_of_the_export_is_yoloxs_postprocess(pre_nms_topk):
    """``WithNMS(form="best_class")`` in torch (the graph ``--nms`` exports, with the ONNX
    op's torch twin) gives YOLOX's ``predict``: each point's best class, class-aware NMS,
    the best ``max_det``; on clustered random boxes where NMS removes many."""
    from fastdet.export import WithNMS
    from fastdet.models.yolox import yolox_postprocess

    gen = torch.Generator().manual_seed(0)
    n, a, c = 2, 300, 5
    centre = torch.rand(n, a, 2, generator=gen) * 60
    wh = 8 + torch.rand(n, a, 2, generator=gen) * 20
    boxes = torch.cat([centre - wh / 2, centre + wh / 2], -1)
    scores = torch.rand(n, a, c, generator=gen) ** 3  # distinct: one order

    class Dense(torch.nn.Module):
        def forward(self, images):
            return boxes, scores

    kw = dict(score_thresh=0.05, iou_thresh=0.45, max_det=50, pre_nms_topk=pre_nms_topk)
    got_b, got_s, got_l, num = WithNMS(Dense(), **kw, form="best_class")(torch.zeros(n, 3, 64, 64))
    ref = yolox_postprocess(boxes, scores, **kw)
    for j, r in enumerate(ref):
        k = int(num[j])
        assert 0 < k == len(r["scores"]) <= kw["max_det"]
        order = r["scores"].argsort(descending=True)
        torch.testing.assert_close(got_s[j, :k], r["scores"][order], rtol=0, atol=0)
        assert got_l[j, :k].tolist() == r["labels"][order].tolist()
        torch.testing.assert_close(got_b[j, :k], r["boxes"][order], rtol=0, atol=0)
        assert (got_s[j, k:] == 0).all()
    # The multiclass form keeps a point under several classes: other detections.
    multi = WithNMS(Dense(), **kw)(torch.zeros(n, 3, 64, 64))
    assert not torch.equal(multi[1], got_s)


def test_detect_takes_a_path_a_pil_image_and_one_array(det, demo_small):
    from PIL import Image

    f = sorted((demo_small / "val2017").glob("*.jpg"))[0]
    ref = detect(det, [decode_image(str(f))], score_thresh=LOW_THRESH)[0]
    for one in (f, str(f), Image.open(f), decode_image(str(f))):
        got = detect(det, one, score_thresh=LOW_THRESH)
        assert len(got) == 1, type(one)
        torch.testing.assert_close(got[0]["boxes"], ref["boxes"])
        torch.testing.assert_close(got[0]["scores"], ref["scores"])
    assert detect(det, []) == []  # one result per image: none
    for images, kw, says in ((np.zeros((1, 0, 3), np.uint8), {}, "an image of no pixels"),
                             (Image.open(f).crop((10, 10, 10, 10)), {}, "an image of no pixels"),
                             ([f], {"img_size": 0}, "img_size"), ([f], {"img_size": 100}, "img_size"),
                             ([f], {"score_thresh": 2.0}, "score_thresh")):
        with pytest.raises(ValueError, match=says):
            detect(det, images, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_detect_with_a_half_precision_detector(det, demo_small, dtype):
    """The batch takes the detector's dtype (a bfloat16 detector raised "Input type (float) and
    bias type (c10::BFloat16) should be the same"); detections come back float32, near the
    float32 detector's."""
    import copy

    imgs = val_images(demo_small, 2)
    low = copy.deepcopy(det).to(dtype)
    got = detect(low, imgs, score_thresh=LOW_THRESH)
    want = detect(det, imgs, score_thresh=LOW_THRESH)
    assert len(got) == 2
    for g, w, img in zip(got, want, imgs):
        assert g["boxes"].dtype == torch.float32 and g["scores"].dtype == torch.float32
        assert len(g["scores"]) > 0 and torch.isfinite(g["boxes"]).all()
        # The best detection of each: the same box and score to the dtype's precision.
        torch.testing.assert_close(g["scores"].max(), w["scores"].max(), rtol=0.05, atol=1e-5)
        h, wd = img.shape[:2]
        assert (g["boxes"][:, 0::2] <= wd).all() and (g["boxes"][:, 1::2] <= h).all()


def test_onnx_file_describes_its_input_and_classes(det, onnx_files):
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(onnx_files["dynamic"])).metadata_props}
    p = det.info.preprocess
    assert json.loads(meta["class_names"]) == list(det.info.class_names)
    assert json.loads(meta["category_ids"]) == list(det.info.cat_ids)
    assert json.loads(meta["input_size"]) == list(exported_canvas(det))
    assert meta["canvas"] == ("landscape" if p.resize == "keep_ratio" else "square")
    assert meta["resize"] == p.resize and json.loads(meta["pad_value"]) == p.pad_value
    assert json.loads(meta["mean"]) == (list(p.mean) if p.mean else None)
    assert json.loads(meta["std"]) == (list(p.std) if p.std else None)
    mode = {"nearest": "nearest-exact", "linear": "bilinear", "cubic": "bicubic"}[p.interp]
    assert f"mode='{mode}'" in meta["interpolation"]
    assert mode == "nearest-exact" or "antialias=False" in meta["interpolation"]


def formula(note: str) -> str:
    """The ``min(...)`` after ``r = `` in a resize note, up to its closing parenthesis."""
    start = note.index("r = min(") + len("r = ")
    depth = 0
    for i, ch in enumerate(note[start:], start):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ")" and depth == 0:
            return note[start : i + 1]
    raise AssertionError(f"no closed min(...) in {note!r}")


def map_back(note: str, r: float, h: int, w: int) -> tuple[float, float]:
    """``(sx, sy)`` as ``resize_note`` writes them (``sx = sy = r``, or ``sx = EXPR, sy = EXPR``
    up to the sentence's end), computed for an ``h`` x ``w`` image at the note's ``r``."""
    import math
    import re

    if "sx = sy = r" in note:
        return r, r
    m = re.search(r"sx = ([^,]+), sy = (.+?)(?:\. |$)", note)
    assert m, f"no sx, sy in {note!r}"
    names = {"floor": math.floor, "r": r, "h": h, "w": w}
    return eval(m[1], names), eval(m[2], names)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_onnx_metadata_states_the_canvas_and_the_resize_onto_it(arch):
    """``input_size`` is the exported canvas and ``resize_note``'s ``r`` (or sx, sy), computed
    as written, is the scale ``Preprocess`` gives an image on it: keep-ratio (FCOS) states
    its limits at this canvas's size, for every canvas, and which images the canvas is for.
    Its ``sx``, ``sy`` (what boxes are divided by, per the family's ``box_scale``: YOLOX
    ``r``, FCOS the content's true factor) are those ``Preprocess`` reports."""
    from types import SimpleNamespace

    from fastdet.export import export_canvas, onnx_metadata

    p = ARCHITECTURES[arch].preprocess
    info = SimpleNamespace(arch=arch, size="x", class_names=("a",), cat_ids=(1,), preprocess=p, predict_kwargs={})
    named = p.canvases().named(128)
    assert list(named) == (["landscape", "portrait", "square"] if p.resize == "keep_ratio" else ["square"])
    for canvas, hw in named.items():
        meta = onnx_metadata(info, 128, None, canvas=canvas)
        assert json.loads(meta["input_size"]) == list(hw) and meta["canvas"] == canvas
        assert json.loads(meta["canvases"]) == {k: list(v) for k, v in named.items()}
        note = meta["resize_note"]
        for h, w in ((200, 352), (352, 200), (140, 150), (60, 700), (900, 1600)):
            want = p.scale(h, w, hw)
            if "r = min(" in note:
                r = eval(formula(note), {"min": min, "max": max, "h": h, "w": w})
                assert (r, r) == pytest.approx(want, rel=1e-9), (arch, canvas, note)
            else:
                assert f"sx = {hw[1]} / w, sy = {hw[0]} / h" in note and want == (hw[1] / w, hw[0] / h)
                r = None
            _, reported = p(np.zeros((h, w, 3), np.uint8), hw)  # the (sx, sy) evaluation maps back by
            assert map_back(note, r, h, w) == pytest.approx(reported, rel=1e-9), (arch, canvas, h, w, note)
        if p.resize == "keep_ratio":
            assert "landscape" in note or "portrait" in note  # the other canvases to export
    assert export_canvas(p, 128) == next(iter(named.items()))
    if p.resize != "keep_ratio":
        with pytest.raises(ValueError, match="--canvas landscape: expected one of square"):
            export_canvas(p, 128, "landscape")


def test_an_image_over_pils_pixel_limit_is_a_decode_error(demo_small, monkeypatch):
    """PIL refuses a picture over twice ``MAX_IMAGE_PIXELS`` with DecompressionBombError,
    not an OSError: predict's decoder turns it into its counted skip, not a traceback."""
    from PIL import Image

    from fastdet.data.augment import ImageDecodeError

    f = sorted((demo_small / "val2017").glob("*.jpg"))[0]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageDecodeError, match="cannot decode image"):
        decode_image(str(f))


def test_the_export_check_counts_matches_between_none_and_all():
    """Each image's larger side is the total; a torch detection paired with an onnxruntime
    one counts once (the count went negative when both sides' leftovers were added)."""
    from fastdet.export import match_detections

    boxes = torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]])
    ref = {"boxes": boxes, "scores": torch.tensor([0.9, 0.8, 0.7]), "labels": torch.tensor([0, 0, 1])}
    moved = (boxes + 5).numpy()[None]  # nothing pairs
    outs = [moved, np.array([[0.9, 0.8, 0.7]]), np.array([[0, 0, 1]]), np.array([3])]
    assert match_detections(outs, [ref]) == (0.0, 3, 3)
    outs[0] = boxes.numpy()[None].copy()
    outs[0][0, 2] += 5  # two of three pair
    assert match_detections(outs, [ref])[1:] == (1, 3)
    assert match_detections([outs[0][:, :0], outs[1][:, :0], outs[2][:, :0], np.array([0])], [ref])[1:] == (3, 3)
