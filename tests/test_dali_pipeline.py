"""The DALI pipelines (CPU-only mode here, ``device_id=None``; the GPU test needs CUDA).

Geometry, padding, multi-scale, sharding, exactly-once evaluation and parity with the
torch back end are in ``test_loader_parity.py``; this file covers what is DALI's own:
its colour operators against ``fastdet.data.augment``'s formulas, the iteration-keyed
sources, the decode check before a DALI loader, the error on an undecodable file,
and the back-end choice.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

import nvidia.dali.fn as fn  # noqa: E402
import nvidia.dali.types as types  # noqa: E402
from nvidia.dali import pipeline_def  # noqa: E402

from fastdet import registry  # noqa: E402
from fastdet.config import Config, DataConfig  # noqa: E402
from fastdet.data import augment as A  # noqa: E402
from fastdet.data.coco import load_coco  # noqa: E402
from fastdet.data.loader import (  # noqa: E402
    EvalSchedule,
    LoaderError,
    TrainSchedule,
    build_eval_loader,
    build_train_loader,
    resolve_backend,
)
from fastdet.data.layout import BATCH_KEYS  # noqa: E402
from fastdet.data.preprocess import Preprocess  # noqa: E402
from fastdet.data.records import ImageRecord  # noqa: E402
from fastdet.pipelines.sources import EvalSource, TrainSource  # noqa: E402


def train_loader(cfg, ds, **kw):
    """The loader API with DataConfig's PP-YOLOE stages every epoch (as the trainer asks today)."""
    return build_train_loader(cfg.data, ds, stages_for_epoch=lambda e: registry.phase(cfg, e).stages, **kw)


def eval_loader(cfg, ds, **kw):
    return build_eval_loader(cfg.data, ds, preprocess=Preprocess(), **kw)


def cfg_for(tmp: Path, **data) -> Config:
    base = dict(loader="dali", batch_size=2, eval_batch_size=2, img_size=96, train_sizes=(64, 96), max_boxes=4,
                num_workers=1, check_images="open", cache_dir=str(tmp / "cache"))
    base.update(data)
    return Config(data=DataConfig(**base))


@pytest.fixture(scope="module")
def demo_train(demo_paths):
    return load_coco(demo_paths.train_ann, demo_paths.train_images, train=True)


# --------------------------------------------------------------------------- colour operators

@pipeline_def(batch_size=1, num_threads=1, device_id=None)
def _colour_pipe(image, b, c, h, s):
    x = fn.external_source(source=lambda: [image], batch=True, layout="HWC")
    y = fn.brightness_contrast(x, brightness=b, contrast=c, contrast_center=A.CONTRAST_CENTER)
    return y, fn.hsv(y, hue=h, saturation=s, dtype=types.UINT8)


@pytest.mark.parametrize("b,c,h,s", [(1.3, 0.7, 12.0, 1.4), (0.6, 1.45, -17.0, 0.55), (1.0, 1.0, 5.0, 1.0)])
def test_distort_formulas_match_dali(b, c, h, s):
    """The torch back end's distortion computes what DALI's brightness_contrast + hsv compute."""
    image = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    pipe = _colour_pipe(image, b, c, h, s)
    pipe.build()
    bc, hsv = (np.asarray(o.at(0)).astype(int) for o in pipe.run())
    ours_bc = A.brightness_contrast(image, b, c)
    assert np.abs(bc - ours_bc).max() <= 1
    assert np.abs(hsv - A.adjust_hsv(bc.astype(np.uint8), h, s)).max() <= 1


def test_hsv_keeps_grey_grey():
    grey = np.full((4, 4, 3), 200, np.uint8)
    out = A.adjust_hsv(grey, 15.0, 1.5)
    assert (out.max(axis=2) - out.min(axis=2)).max() <= 1


@pipeline_def(batch_size=1, num_threads=1, device_id=None)
def _cut_pipe(image, win_boxes, window, canvas):
    from fastdet.pipelines.stages import _cut

    def const(v):
        return fn.external_source(source=lambda: [np.array(v, np.float32)], batch=True)

    x = fn.external_source(source=lambda: [image], batch=True, layout="HWC")
    boxes = const(win_boxes)
    labels = fn.external_source(source=lambda: [np.zeros(len(win_boxes), np.int32)], batch=True)
    (ax, ay, aw, ah), (cw, ch, ox, oy) = [const(v) for v in window], [const(v) for v in canvas]
    out, out_boxes, _ = _cut(x, boxes, labels, ax, ay, aw, ah, cw, ch, ox, oy)
    return out, out_boxes


def test_crop_boxes_are_exact_on_the_whole_pixel_window():
    """The DALI crop (``pipelines.stages._cut``): ``random_bbox_crop`` gives a float window
    and boxes relative to it; the pixels are cut on that window rounded to whole canvas
    pixels, and the boxes re-expressed relative to the integer window, so that a box stays
    the exact extent of its pixels. A 60 x 50 image at (20, 10) on a 100 x 80 canvas holds a
    rectangle at canvas (30, 22)-(60, 47); the float window starts 0.3 px right of and 0.3 px
    above a pixel edge, and 5 px left of the image (the ImageNet-mean fill). The loader tests resample after the crop and allow 2 px, which a
    re-expression off by twice that fraction passed."""
    image = np.zeros((50, 60, 3), np.uint8)
    image[12:37, 10:40] = 255
    cw, ch, ox, oy = 100.0, 80.0, 20.0, 10.0
    fx, fy, fw, fh = 15.3, 15.7, 50.4, 40.2  # the float window, canvas px
    rect = np.array([30.0, 22.0, 60.0, 47.0])
    win_boxes = [((rect - [fx, fy, fx, fy]) / [fw, fh, fw, fh]).tolist()]
    pipe = _cut_pipe(image, win_boxes, (fx / cw, fy / ch, fw / cw, fh / ch), (cw, ch, ox, oy))
    pipe.build()
    out, boxes = (np.asarray(o.at(0)) for o in pipe.run())
    x0, y0 = 15, 16  # the float window's edges rounded to whole pixels: [15, 66) x [16, 56)
    assert out.shape == (40, 51, 3)
    ys, xs = np.nonzero(out[..., 0] == 255)
    tight = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float64)
    np.testing.assert_array_equal(tight, rect - [x0, y0, x0, y0])  # [15, 6, 45, 31]
    np.testing.assert_allclose(boxes[0] * [51, 40, 51, 40], tight, atol=1e-3)
    assert (out[:, :5] == A.FILL).all() and (out[:, 5:15] == 0).all()  # canvas x 15..19: left of the image


# --------------------------------------------------------------------------- sources

def _records(n: int) -> list[ImageRecord]:
    return [ImageRecord(i, f"/nonexistent/{i}.jpg", 100, 50, np.array([[10, 5, 60, 45]], np.float32),
                        np.array([i % 3], np.int64)) for i in range(n)]


def test_train_source_is_keyed_by_iteration_across_epochs(monkeypatch):
    monkeypatch.setattr("fastdet.pipelines.sources._read", lambda path: np.frombuffer(path.encode(), np.uint8))
    recs = _records(10)
    sched = TrainSchedule(10, 3, rank=0, world_size=1, seed=4, sizes=(64, 96, 128), random_interp=True)
    src = TrainSource(recs, sched, start_epoch=2)
    names = src.outputs
    for g in (0, 2, 3, 7):  # 3 steps per epoch: g = 3 is epoch 3, step 0
        out = dict(zip(names, src(SimpleNamespace(iteration=g, epoch_idx=0))))
        plan = sched.batch(2 + g // 3, g % 3)
        assert [bytes(e).decode() for e in out["encoded"]] == [recs[i].file for i in plan.indices]
        assert all(s.tolist() == list(plan.hw) for s in out["size"])
        assert len({int(i) for i in out["interp"]}) == 1
        np.testing.assert_allclose(out["boxes"][0], [[0.1, 0.1, 0.6, 0.9]], rtol=1e-6)
        assert out["orig_hw"][0].tolist() == [50, 100] and out["wh"][0].tolist() == [100, 50]


def test_eval_source_cycles_and_omits_unused_outputs(monkeypatch):
    monkeypatch.setattr("fastdet.pipelines.sources._read", lambda path: np.zeros(1, np.uint8))
    sched = EvalSchedule(5, 2, rank=0, world_size=1, size=96)
    src = EvalSource(_records(5), sched)
    assert "wh" not in src.outputs
    sizes = [len(src(SimpleNamespace(iteration=g, epoch_idx=0))[0]) for g in range(6)]
    assert sizes == [2, 2, 1, 2, 2, 1]  # the last batch is shorter; nothing padded or repeated


def test_sources_run_in_worker_processes(demo_train, tmp_path, monkeypatch):
    """No Python per sample on the training thread: file reads and plans run in DALI's
    worker processes, so the loader's own process never calls the source; closing the
    loader ends the workers."""
    import os

    calls = []
    call = TrainSource.__call__

    def counted(self, info):
        calls.append(os.getpid())
        return call(self, info)

    monkeypatch.setattr(TrainSource, "__call__", counted)
    loader = train_loader(cfg_for(tmp_path, num_workers=2), demo_train, rank=0, world_size=1, device="cpu", seed=0)
    n = sum(b["images"].shape[0] for b in loader)
    assert n == len(loader) * 2 and os.getpid() not in calls
    pids = loader._producer._py_pool.pids()
    assert pids
    loader.close()

    def running(pid: int) -> bool:  # a zombie has ended
        stat = Path(f"/proc/{pid}/stat")
        return stat.exists() and stat.read_text().split()[2] != "Z"

    assert not [pid for pid in pids if running(pid)]


# --------------------------------------------------------------------------- undecodable images

@pytest.fixture()
def set_with_corrupt(tmp_path, demo_train):
    """Four demo records plus one whose file is a truncated JPEG (its header still opens)."""
    good = list(demo_train.records[:4])
    raw = Path(good[0].file).read_bytes()
    bad_file = tmp_path / "truncated.jpg"
    bad_file.write_bytes(raw[: len(raw) // 3])
    bad = ImageRecord(4242, str(bad_file), good[0].width, good[0].height, good[0].boxes, good[0].labels)
    report = SimpleNamespace(image_skips={}, calls=[])
    report.count = lambda counter, reason, n=1, examples=(): report.calls.append((reason, n, list(examples)))
    return SimpleNamespace(records=good + [bad], ann_file=tmp_path / "a.json", report=report), bad


def test_dali_loader_only_sees_decodable_images(set_with_corrupt, tmp_path):
    ds, bad = set_with_corrupt
    loader = train_loader(cfg_for(tmp_path), ds, rank=0, world_size=1, device="cpu", seed=0)
    assert loader.left_out == 1 and "1 images that do not decode left out" in loader.report()
    assert ds.report.calls == [("corrupt", 1, [bad.file])]
    ids = [i for _ in range(3) for b in loader for i in b["image_ids"].tolist()]
    assert 4242 not in ids and len(ids) == 3 * 2 * 2


def test_dali_names_the_file_it_cannot_decode(set_with_corrupt, tmp_path):
    ds, bad = set_with_corrupt
    # check_images="decode" says the set was verified; it was not, so DALI meets the file.
    cfg = cfg_for(tmp_path, check_images="decode", eval_batch_size=5)
    loader = eval_loader(cfg, ds, rank=0, world_size=1, device="cpu")
    with pytest.raises(LoaderError) as e:
        list(loader)
    msg = str(e.value)
    assert bad.file in msg and "check_images=decode" in msg and "\n" not in msg


def test_a_failed_pipeline_is_released_at_once(set_with_corrupt, tmp_path, monkeypatch):
    """DALI stops a pipeline for good on an error; the loader frees it then, though the error
    (and so the loader, and DALI's frames) lives on. Left to the garbage collector, a pipeline
    deadlocks a forked DataLoader worker that collects it (its threads do not exist there)."""
    import weakref

    from fastdet.pipelines import adapter

    built = []
    build = adapter.detection_pipeline

    def recorded(*args, **kwargs):
        pipe = build(*args, **kwargs)
        built.append(weakref.ref(pipe))
        return pipe

    monkeypatch.setattr(adapter, "detection_pipeline", recorded)
    ds, bad = set_with_corrupt
    loader = eval_loader(cfg_for(tmp_path, check_images="decode", eval_batch_size=5), ds, rank=0, world_size=1,
                         device="cpu")
    with pytest.raises(LoaderError) as e:
        list(loader)
    assert bad.file in str(e.value)
    assert len(built) == 1 and built[0]() is None


def test_dali_names_the_file_a_worker_read(set_with_corrupt, tmp_path):
    """Training reads in worker processes: the error still names the file (from the schedule)."""
    ds, bad = set_with_corrupt
    loader = train_loader(cfg_for(tmp_path, check_images="decode"), ds, rank=0, world_size=1, device="cpu", seed=0)
    with pytest.raises(LoaderError) as e:
        for epoch in range(6):  # 2 of the 5 records per epoch: the truncated one comes within a few
            loader.set_epoch(epoch)
            list(loader)
    msg = str(e.value)
    assert bad.file in msg and "check_images=decode" in msg and "\n" not in msg


# --------------------------------------------------------------------------- back-end choice

def test_backend_choice(monkeypatch, tmp_path):
    cpu = torch.device("cpu")
    assert resolve_backend(cfg_for(tmp_path, loader="auto").data, cpu) == "torch"
    assert resolve_backend(cfg_for(tmp_path, loader="dali").data, cpu) == "dali"  # CPU-only DALI
    assert resolve_backend(cfg_for(tmp_path, loader="torch").data, cpu) == "torch"
    with pytest.raises(LoaderError, match="data.loader must be one of"):
        resolve_backend(cfg_for(tmp_path, loader="fast").data, cpu)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as if not installed
    with pytest.raises(LoaderError) as e:
        resolve_backend(cfg_for(tmp_path, loader="dali").data, cpu)
    assert str(e.value).startswith("--loader dali: nvidia-dali is not installed") and "\n" not in str(e.value)
    assert resolve_backend(cfg_for(tmp_path, loader="auto").data, torch.device("cuda", 0)) == "torch"


# --------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pipeline_outputs_on_the_device(demo_train, tmp_path):
    cfg = cfg_for(tmp_path, batch_size=4, max_boxes=8)
    dev = torch.device("cuda", 0)
    loader = train_loader(cfg, demo_train, rank=0, world_size=1, device=dev, seed=0)
    assert loader.backend == "dali"
    cpu = train_loader(cfg, demo_train, rank=0, world_size=1, device="cpu", seed=0)
    for batch, ref in zip(loader, cpu):
        for k in BATCH_KEYS:
            assert batch[k].device.type == "cuda", k
            assert batch[k].dtype == ref[k].dtype and batch[k].shape == ref[k].shape, k
        assert torch.equal(batch["image_ids"].cpu(), ref["image_ids"])
        assert torch.isfinite(batch["images"]).all()
    ev = eval_loader(cfg, demo_train, rank=0, world_size=1, device=dev)
    n = sum(b["images"].shape[0] for b in ev)
    assert n == len(demo_train.records)
