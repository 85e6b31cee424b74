"""PP-YOLOE's torch batches are unchanged by the stage-list loader (issue 14).

The digests were taken on main before the loader took stage lists (commit 49ba6df,
``TorchTrainLoader(cfg, records, schedule)`` with its built-in PP-YOLOE chain, and
``TorchEvalLoader`` with its bicubic stretch): random-pixel PNGs with a few boxes each,
three epochs with and without augmentation over three sizes, and one evaluation pass.
The stage list PP-YOLOE's recipe (``registry.phase``) and ``Preprocess()`` must give the
same bytes for every field the old batch had.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from fastdet import registry
from fastdet.config import Config, DataConfig
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import ImageRecord
from fastdet.data.schedule import EvalSchedule, TrainSchedule
from fastdet.data.torch_backend import TorchEvalLoader, TorchTrainLoader

OLD_KEYS = ("images", "gt_boxes", "gt_labels", "gt_mask", "image_ids", "orig_sizes")
TRAIN_DIGEST = "3b5ef034858c98c3894189a41d24b016f6d5e72c73ce98790122a264cabf2f9a"
EVAL_DIGEST = "07f9b968e95bac7685aab83b75c30896ac6234801b8a4718dcac4bb1ec214ae1"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("digest")
    rng = np.random.default_rng(123)
    recs = []
    for i in range(8):
        w, h = int(rng.integers(96, 200)), int(rng.integers(96, 200))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        f = root / f"{i}.png"
        Image.fromarray(img).save(f)
        n = int(rng.integers(0, 4))
        x0, y0 = rng.uniform(0, w - 20, n), rng.uniform(0, h - 20, n)
        bw, bh = rng.uniform(4, 20, n), rng.uniform(4, 20, n)
        boxes = np.stack([x0, y0, x0 + bw, y0 + bh], 1).astype(np.float32).reshape(-1, 4)
        recs.append(ImageRecord(i + 1, str(f), w, h, boxes, rng.integers(0, 3, n).astype(np.int64)))
    return recs


def _update(h, batch) -> None:
    for k in OLD_KEYS:
        h.update(k.encode())
        h.update(batch[k].contiguous().numpy().tobytes())


def test_train_batches_match_main(records):
    torch.set_num_threads(1)
    h = hashlib.sha256()
    for aug in (True, False):
        data = DataConfig(loader="torch", batch_size=4, train_sizes=(64, 96, 128), max_boxes=6, num_workers=0,
                          augment=aug)
        sched = TrainSchedule(8, 4, rank=0, world_size=1, seed=5, sizes=(64, 96, 128), random_interp=aug)
        loader = TorchTrainLoader(data, records, sched, stages_for_epoch=lambda e: registry.phase(Config(data=data), e).stages,
                                  device=torch.device("cpu"))
        for e in range(3):
            loader.set_epoch(e)
            for b in loader:
                _update(h, b)
                # New fields: every real box scores 1 without mixup; the stretch's factors.
                assert torch.equal(b["gt_scores"], b["gt_mask"].float())
                assert b["scale_factors"].shape == (4, 2) and (b["scale_factors"] > 0).all()
    assert h.hexdigest() == TRAIN_DIGEST


def test_eval_batches_match_main(records):
    torch.set_num_threads(1)
    h = hashlib.sha256()
    data = DataConfig(loader="torch", eval_batch_size=3, img_size=96, max_boxes=6, num_workers=0)
    loader = TorchEvalLoader(data, records, EvalSchedule(8, 3, rank=0, world_size=1, size=96),
                             preprocess=Preprocess(), device=torch.device("cpu"))
    by_id = {r.image_id: r for r in records}
    for b in loader:
        _update(h, b)
        for i, sf in zip(b["image_ids"].tolist(), b["scale_factors"].tolist()):
            assert sf == pytest.approx([96 / by_id[i].width, 96 / by_id[i].height])
    assert h.hexdigest() == EVAL_DIGEST
