"""The torch DataLoader back end and the numpy augmentation it runs.

Behaviour shared with DALI (geometry through every augmentation, padding, multi-scale,
determinism, sharding, exactly-once evaluation, parity) is tested over both back ends
in ``test_loader_parity.py``. Here: PaddleDetection's RandomCrop/RandomExpand rules,
worker processes, and undecodable images (substituted in training, left out in
evaluation, always counted).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastdet import registry
from fastdet.config import Config, DataConfig
from fastdet.data import augment as A
from fastdet.data import stages as S
from fastdet.data.coco import load_coco
from fastdet.data.layout import BATCH_KEYS
from fastdet.data.loader import build_eval_loader, build_train_loader
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import ImageRecord


def train_loader(cfg, ds, **kw):
    """The loader API with DataConfig's PP-YOLOE stages every epoch (as the trainer asks today)."""
    return build_train_loader(cfg.data, ds, stages_for_epoch=lambda e: registry.phase(cfg, e).stages, **kw)


def eval_loader(cfg, ds, **kw):
    return build_eval_loader(cfg.data, ds, preprocess=Preprocess(), **kw)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cfg_for(**data) -> Config:
    base = dict(loader="torch", batch_size=4, eval_batch_size=3, img_size=96, train_sizes=(64, 96), max_boxes=8,
                num_workers=0)
    base.update(data)
    return Config(data=DataConfig(**base))


@pytest.fixture(scope="module")
def demo_train(demo_paths):
    return load_coco(demo_paths.train_ann, demo_paths.train_images, train=True)


# --------------------------------------------------------------------------- augmentation rules

def test_crop_window_follows_paddledetection_rules():
    rng = np.random.default_rng(0)
    boxes = np.array([[20, 30, 120, 90], [150, 40, 190, 180]], np.float32)
    full = 0
    for _ in range(300):
        win = A.random_crop_window(rng, boxes, 200, 200)
        assert 0 <= win[0] < win[2] <= 200 and 0 <= win[1] < win[3] <= 200
        if (win == [0, 0, 200, 200]).all():
            full += 1
            continue
        w, h = win[2] - win[0], win[3] - win[1]
        # scale in [0.3, 1] per side up to the aspect adjustment; aspect ratio in [0.5, 2]
        assert 0.5 - 0.02 <= w / h <= 2.0 + 0.02
        assert w * h >= (0.3 * 200) ** 2 * 0.95
        kept, _ = A.crop_boxes(boxes, np.zeros(2, np.int64), win.astype(np.float32))
        assert len(kept) >= 1  # some box keeps its centre in the window
    # "no crop" is one of seven outcomes drawn first: about 1/7 of the time.
    assert 0.05 < full / 300 < 0.3
    assert (A.random_crop_window(rng, np.zeros((0, 4), np.float32), 50, 40) == [0, 0, 50, 40]).all()


def test_crop_boxes_keeps_centres_inside_and_clips():
    boxes = np.array([[0, 0, 10, 10], [40, 40, 80, 80], [90, 0, 120, 20]], np.float32)
    kept, labels = A.crop_boxes(boxes, np.array([1, 2, 3]), np.array([30, 30, 100, 100], np.float32))
    assert labels.tolist() == [2]  # centre (5, 5) and (105, 10) are outside
    np.testing.assert_array_equal(kept, [[10, 10, 50, 50]])


def test_expand_and_extract():
    rng = np.random.default_rng(1)
    draws = [A.random_expand(rng, 100, 80, 0.5, 4.0) for _ in range(400)]
    expanded = [d for d in draws if d[0] > 100]
    assert 0.4 < len(expanded) / 400 < 0.6
    for cw, ch, ox, oy in expanded:
        assert cw <= 400 and ch <= 320 and 0 <= ox < cw - 100 and 0 <= oy < ch - 80
    img = np.full((4, 5, 3), 7, np.uint8)
    out = A.extract(img, -2, -1, 4, 3)  # 2 columns and 1 row of fill
    assert out.shape == (4, 6, 3)
    assert (out[0] == A.FILL).all() and (out[:, :2] == A.FILL).all() and (out[1:, 2:] == 7).all()


def test_finalize_drops_small_boxes_and_pads():
    boxes = np.array([[0, 0, 0.9, 5], [0, 0, 5, 5], [1, 1, 3, 1.5]], np.float32)
    t = A.finalize(boxes, np.array([1, 2, 3]), np.array([1.0, 0.25, 1.0], np.float32), 4)
    assert t["gt_mask"].tolist() == [True, False, False, False] and t["gt_labels"].tolist() == [2, 0, 0, 0]
    assert t["overflow"] == 0 and t["gt_scores"].tolist() == [0.25, 0, 0, 0]
    np.testing.assert_array_equal(t["gt_boxes"][0], [0, 0, 5, 5])


def test_finalize_batch_is_finalize_per_sample():
    """The DALI pipeline's batch-level targets equal the torch back end's per-sample ones, bit for bit:
    scaling, the 1 px filter, the M largest (ties by position), order, scores, overflow."""
    rng = np.random.default_rng(3)
    m = 5
    counts = [0, 3, 5, 9, 14, 1]
    boxes, labels, scales, scores = [], [], [], []
    for n in counts:
        xy = rng.uniform(0, 0.8, (n, 2)).astype(np.float32)
        wh = rng.choice([0.0, 0.001, 0.05, 0.1, 0.2], (n, 2)).astype(np.float32)  # ties and sub-pixel boxes
        boxes.append(np.concatenate([xy, xy + wh], 1))
        labels.append(rng.integers(0, 80, n).astype(np.int32))
        scales.append(rng.uniform(50, 700, 2).astype(np.float32))
        scores.append(rng.uniform(0, 1, n).astype(np.float32))
    for sc in (scores, None):
        got = A.finalize_batch(boxes, labels, scales, sc, m)
        for i in range(len(counts)):
            px = boxes[i] * np.array([scales[i][0], scales[i][1]] * 2, np.float32)
            ref = A.finalize(px, labels[i], sc[i] if sc else np.ones(counts[i], np.float32), m)
            for k in ("gt_boxes", "gt_labels", "gt_mask", "gt_scores"):
                assert got[k][i].dtype == ref[k].dtype and np.array_equal(got[k][i], ref[k]), (i, k)
            assert got["overflow"][i] == ref["overflow"], i
    assert got["overflow"].max() > 0 and got["gt_mask"].sum(1).min() == 0


def _megvii_augment_hsv():
    """Megvii yolox 0.3.0's ``augment_hsv`` (a test dependency; loaded from its file, as
    ``yolox.data`` imports its evaluators' dependencies)."""
    import importlib.util

    import yolox

    spec = importlib.util.spec_from_file_location("megvii_data_augment",
                                                  Path(yolox.__file__).parent / "data" / "data_augment.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.augment_hsv


class _GlobalStream:
    """``hsv_gains``' generator over numpy's global stream, the one Megvii's ``augment_hsv``
    draws from: the stage's probability draw passes (YOLOX's HSV probability is 1), and
    ``uniform`` / ``integers`` are ``np.random.uniform`` / ``randint``, which Megvii calls in
    that order."""

    def random(self) -> float:
        return 0.0

    def uniform(self, low, high, size):
        return np.random.uniform(low, high, size)

    def integers(self, low, high, size):
        return np.random.randint(low, high, size)


def test_hsv_is_megviis_augment_hsv():
    """YOLOX's HSV stage (``HSV()``'s gains drawn by ``hsv_gains``, applied by
    ``augment_hsv``) against Megvii's own ``augment_hsv`` (OpenCV's 8-bit HSV, the image as
    BGR) drawing from the same stream, on pixels of every hue. OpenCV rounds its hue in
    fixed point, fastdet in float: one hue unit (2 degrees) apart in ~3 % of the pixels,
    which moves a saturated channel by up to 9 levels. Measured: 1 % of the pixels more
    than 1 level off, at most 9. A wrong hue sector (the conversion's sign in one sector of
    six) put 23 % of the pixels over 1 level off, up to 250; a saturation gain of 20 instead
    of Megvii's 30, or gains never switched off per channel, fail too."""
    megvii = _megvii_augment_hsv()
    img = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8)
    state = np.random.get_state()
    drawn = []
    try:
        for seed in range(8):
            np.random.seed(seed)
            gains = A.hsv_gains(_GlobalStream(), S.HSV())
            np.random.seed(seed)
            bgr = np.ascontiguousarray(img[..., ::-1])
            megvii(bgr)  # in place
            diff = np.abs(A.augment_hsv(img, gains).astype(np.int64) - bgr[..., ::-1].astype(np.int64))
            assert diff.max() <= 10 and (diff.max(-1) > 1).mean() < 0.03, (seed, gains, diff.max())
            drawn.append(gains)
    finally:
        np.random.set_state(state)
    drawn = np.stack(drawn)
    assert (drawn[:, 1:] == 0).any() and (np.abs(drawn[:, 1:]) > 20).any()  # channels off, and gains over 20


# --------------------------------------------------------------------------- workers

def test_workers_give_the_same_batches(demo_train):
    """Per-sample seeds come from the sampler, so the number of workers changes nothing."""
    inline = train_loader(cfg_for(num_workers=0), demo_train, rank=0, world_size=1, device="cpu", seed=9)
    pooled = train_loader(cfg_for(num_workers=2), demo_train, rank=0, world_size=1, device="cpu", seed=9)
    steps = len(demo_train.records) // 4
    assert inline.backend == pooled.backend == "torch" and len(inline) == len(pooled) == steps
    n = 0
    for a, b in zip(inline, pooled):
        for k in BATCH_KEYS:
            assert torch.equal(a[k], b[k]), k
        n += 1
    assert n == steps


def test_a_worker_that_dies_is_one_loader_error_line(demo_train, monkeypatch):
    """A worker killed mid-epoch (what the kernel's out-of-memory killer does on a host short
    of memory) is one LoaderError naming it and what needs less memory (torch's RuntimeError
    traceback before, which ``fastdet.train`` does not say in one line)."""
    import os
    import signal

    from fastdet.data.schedule import LoaderError

    loader = train_loader(cfg_for(num_workers=1), demo_train, rank=0, world_size=1, device="cpu", seed=9)
    it = iter(loader)
    next(it)
    (worker,) = loader._producer._iterator._workers
    # SIGCHLD held back: torch's handler would raise wherever this thread is (train.py's main
    # says that one, test_train); the iteration then finds the worker gone itself.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    try:
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(LoaderError, match=r"^DataLoader worker \(pid\(?s?\)? \d+\) .*: a data loader worker "
                                              r"died \(killed when the host is out of memory\); fewer --workers "
                                              r"\(now 1\)"):
            for _ in it:
                pass
        loader.close()  # its workers' pids forgotten: the SIGCHLD let through below finds none
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
    # An error raised inside a worker (a bug in a stage, a decoder) is shown as it is, not
    # as a worker that died.
    from fastdet.data.torch_backend import ImageDataset

    def fails(self, *args, **kwargs):
        raise RuntimeError("a stage's own bug")

    monkeypatch.setattr(ImageDataset, "__getitem__", fails)  # the forked worker has it too
    broken = train_loader(cfg_for(num_workers=1), demo_train, rank=0, world_size=1, device="cpu", seed=9)
    with pytest.raises(RuntimeError, match="Caught RuntimeError in DataLoader worker process 0") as e:
        next(iter(broken))
    assert not isinstance(e.value, LoaderError) and "a stage's own bug" in str(e.value)
    broken.close()


# --------------------------------------------------------------------------- undecodable images

class _Report:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.image_skips: dict = {}

    def count(self, counter, reason, n=1, examples=()):
        self.calls.append((reason, n, list(examples)))


@pytest.fixture()
def broken_set(tmp_path: Path, demo_train):
    good = list(demo_train.records[:7])
    bad_file = tmp_path / "broken.jpg"
    bad_file.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    r0 = good[0]
    bad = ImageRecord(777, str(bad_file), r0.width, r0.height, r0.boxes, r0.labels)
    # A file whose real size differs from the annotation's: its boxes cannot be trusted.
    wrong = ImageRecord(778, r0.file, r0.width + 10, r0.height, r0.boxes, r0.labels)
    return SimpleNamespace(records=good + [bad, wrong], ann_file=tmp_path / "a.json", report=_Report()), bad, wrong


@pytest.mark.parametrize("workers", [0, 2])
def test_training_substitutes_and_counts_undecodable_images(broken_set, workers, caplog):
    ds, bad, wrong = broken_set
    loader = train_loader(cfg_for(num_workers=workers, batch_size=3), ds, rank=0, world_size=1, device="cpu",
                                seed=0)
    seen = []
    for _ in range(3):
        for b in loader:
            assert b["images"].shape[0] == 3  # full batches: another image took the bad one's place
            seen += b["image_ids"].tolist()
    assert 777 not in seen and 778 not in seen
    assert set(loader.skipped) == {bad.file, wrong.file}
    # Each is drawn once per epoch (9 records, 3 batches of 3), and again whenever it is drawn as a substitute.
    assert sum(loader.skipped.values()) >= 2 * 3
    assert sorted(c[0] for c in ds.report.calls) == ["corrupt", "size mismatch"]  # counted once per file
    assert "undecodable image reads" in loader.report()
    assert sum(bad.file in r.getMessage() for r in caplog.records) == 1  # logged once


def test_evaluation_leaves_out_and_counts_undecodable_images(broken_set):
    ds, bad, wrong = broken_set
    loader = eval_loader(cfg_for(), ds, rank=0, world_size=1, device="cpu")
    ids = [i for b in loader for i in b["image_ids"].tolist()]
    assert sorted(ids) == sorted(r.image_id for r in ds.records[:7])
    assert loader.dropped == 2 and "2 evaluation images left out" in loader.report()


def test_boxes_beyond_max_boxes_are_said_once_and_counted(demo_train, caplog):
    """An image with more boxes than --max-boxes loses its smallest: a warning the first
    time (with the flag that keeps them) and a count in the loader's report, which the
    trainer logs at each epoch's end; before, they were dropped in silence."""
    import logging

    loader = train_loader(cfg_for(max_boxes=1, batch_size=4), demo_train, rank=0, world_size=1, device="cpu", seed=0)
    with caplog.at_level(logging.WARNING):
        next(iter(loader))
    assert loader.boxes_truncated > 0 and f"{loader.boxes_truncated} boxes beyond max_boxes=1 dropped" in loader.report()
    assert sum("raise --max-boxes" in r.getMessage() for r in caplog.records) == 1
