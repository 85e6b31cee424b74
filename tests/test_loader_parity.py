"""Both loader back ends (DALI in CPU-only mode, the torch DataLoader) against the same contract.

- geometry: images holding one white rectangle on black go through each augmentation
  (resize, flip, expand, crop, and the whole PP-YOLOE chain with colour distortion);
  the output box must be the tight box of the rectangle's pixels in the output image;
- padding and masks, multi-scale batches, determinism, sharding, exactly-once eval;
- with augmentation off the two back ends give the same boxes and nearly the same pixels.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fastdet import registry
from fastdet.config import Config, DataConfig
from fastdet.data import augment as A
from fastdet.data.coco import load_coco
from fastdet.data.loader import (
    EvalSchedule,
    TrainSchedule,
    build_eval_loader,
    build_train_loader,
    train_sizes,
)
from fastdet.data.layout import BATCH_KEYS
from fastdet.data.preprocess import Preprocess
from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD, ImageRecord
from fastdet.data.torch_backend import TorchTrainLoader
from fastdet.models.ppyoloe import PPYOLOEOptions
from fastdet.pipelines.adapter import DaliTrainLoader


def train_loader(cfg, ds, **kw):
    """The loader API with the stages of cfg's recipe (PP-YOLOE) every epoch, as the trainer asks."""
    return build_train_loader(cfg.data, ds, stages_for_epoch=lambda e: registry.phase(cfg, e).stages, **kw)


def eval_loader(cfg, ds, **kw):
    return build_eval_loader(cfg.data, ds, preprocess=Preprocess(), **kw)


def pp_stages(**family) -> tuple:
    """PP-YOLOE's stages with some of its augmentation options (the family section) set."""
    return registry.phase(Config(family=PPYOLOEOptions(**family)), 0).stages


BACKENDS = ("dali", "torch")
SIZES = (96, 128, 160)


@pytest.fixture(autouse=True)
def _one_thread():
    # In-process torch workers (num_workers=0) on a shared 2-core machine: avoid OpenMP contention.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_cfg(backend: str, tmp: Path, **data) -> Config:
    base = dict(
        loader=backend,
        batch_size=4,
        eval_batch_size=3,
        img_size=160,
        train_sizes=SIZES,
        max_boxes=8,
        num_workers=0,
        check_images="decode",
        cache_dir=str(tmp),
    )
    base.update(data)
    return Config(data=DataConfig(**base))


@pytest.fixture(scope="module")
def demo_train(demo_paths):
    return load_coco(demo_paths.train_ann, demo_paths.train_images, train=True, check_images="decode")


@pytest.fixture(scope="module")
def demo_val(demo_paths):
    return load_coco(demo_paths.val_ann, demo_paths.val_images, train=False, check_images="decode")


def pixels(images: torch.Tensor) -> np.ndarray:
    """Normalised [B, 3, H, W] → 0..255 float [B, H, W, 3]."""
    x = images.permute(0, 2, 3, 1).cpu().numpy()
    return x * np.asarray(IMAGENET_STD, np.float32) + np.asarray(IMAGENET_MEAN, np.float32)


def collect(loader, passes: int = 1) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for _ in range(passes) for b in loader]


# --------------------------------------------------------------------------- geometry

@pytest.fixture(scope="module")
def rect_set(tmp_path_factory):
    """8 PNGs, 160..256 px, each with one white rectangle (>= 48 px a side) on black."""
    root = tmp_path_factory.mktemp("rects")
    rng = np.random.default_rng(7)
    records = []
    for i in range(8):
        w, h = int(rng.integers(160, 257)), int(rng.integers(160, 257))
        rw, rh = int(rng.integers(48, w // 2)), int(rng.integers(48, h // 2))
        x0, y0 = int(rng.integers(0, w - rw)), int(rng.integers(0, h - rh))
        img = np.zeros((h, w, 3), np.uint8)
        img[y0 : y0 + rh, x0 : x0 + rw] = 255
        f = root / f"{i}.png"
        Image.fromarray(img).save(f)
        records.append(ImageRecord(i + 1, str(f), w, h, np.array([[x0, y0, x0 + rw, y0 + rh]], np.float32),
                                   np.array([i % 3], np.int64)))
    return records


def geometry_loader(backend: str, records, spec: tuple, tmp: Path, seed: int = 0):
    cfg = make_cfg(backend, tmp, batch_size=4, train_sizes=(128, 160))
    sched = TrainSchedule(len(records), 4, rank=0, world_size=1, seed=seed, sizes=(128, 160), random_interp=True)
    cls = DaliTrainLoader if backend == "dali" else TorchTrainLoader
    return cls(cfg.data, records, sched, stages_for_epoch=lambda e: spec, device=torch.device("cpu"))


def rect_pixel_box(img: np.ndarray, white: float) -> np.ndarray | None:
    """Tight [x0, y0, x1, y1] (pixel edges) of the rectangle's pixels in a 0..255 [H, W, 3] image.

    The rectangle's pixels are grey (distortion keeps R = G = B grey) and at the level
    ``white``; black is grey but at least 64 levels darker after any distortion, and the
    mean-filled canvas (and its blends with black) is not grey.
    """
    gray = img.mean(axis=2)
    spread = img.max(axis=2) - img.min(axis=2)
    ys, xs = np.nonzero((np.abs(gray - white) < 12) & (spread < 8))
    if len(xs) == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)


def run_geometry(backend, records, spec, tmp, *, adaptive=False, epochs=2):
    """Check every output box against the rectangle's pixels; return per-sample results."""
    loader = geometry_loader(backend, records, spec, tmp)
    out = []
    for _ in range(epochs):
        for batch in loader:
            imgs = pixels(batch["images"])
            size = imgs.shape[1]
            assert imgs.shape[1] == imgs.shape[2]
            for b in range(imgs.shape[0]):
                ids = int(batch["image_ids"][b])
                m = batch["gt_mask"][b]
                assert int(m.sum()) <= 1
                box = batch["gt_boxes"][b][m].numpy()
                res = dict(id=ids, size=size, box=box[0] if len(box) else None, img=imgs[b])
                if len(box):
                    # Distorted: the rectangle's level is read at the box centre.
                    cx, cy = int((box[0, 0] + box[0, 2]) / 2), int((box[0, 1] + box[0, 3]) / 2)
                    white = imgs[b][cy, cx].mean() if adaptive else 255.0
                    tight = rect_pixel_box(imgs[b], white)
                    assert tight is not None, f"{backend}: a box but no rectangle pixels (image {ids})"
                    assert np.abs(tight - box[0]).max() <= 2.0, (backend, ids, tight, box[0])
                    assert int(batch["gt_labels"][b][m][0]) == (ids - 1) % 3
                out.append(res)
    return out


NO_AUG = pp_stages(distort_prob=0.0, expand_prob=0.0, crop=False, flip_prob=0.0)


def scaled(rec: ImageRecord, size: int) -> np.ndarray:
    return rec.boxes[0] * np.array([size / rec.width, size / rec.height] * 2, np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometry_resize(backend, rect_set, tmp_path):
    by_id = {r.image_id: r for r in rect_set}
    for s in run_geometry(backend, rect_set, NO_AUG, tmp_path):
        np.testing.assert_allclose(s["box"], scaled(by_id[s["id"]], s["size"]), atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometry_flip(backend, rect_set, tmp_path):
    by_id = {r.image_id: r for r in rect_set}
    spec = pp_stages(distort_prob=0.0, expand_prob=0.0, crop=False, flip_prob=1.0)
    for s in run_geometry(backend, rect_set, spec, tmp_path):
        x0, y0, x1, y1 = scaled(by_id[s["id"]], s["size"])
        np.testing.assert_allclose(s["box"], [s["size"] - x1, y0, s["size"] - x0, y1], atol=1e-3)


def test_recipe_stages_stage_by_stage():
    from fastdet.data import stages as S

    assert registry.phase(Config(data=DataConfig(augment=False)), 0).stages == (
        S.Resize("stretch", interp="linear"), S.Normalize())
    assert pp_stages() == (S.Distort(0.5), S.ExpandCrop(0.5, 4.0, True), S.Flip(0.5),
                           S.Resize("stretch", interp="random"), S.Normalize())
    got = pp_stages(distort_prob=0.0, expand_prob=0.25, expand_max_ratio=1.5, crop=False, flip_prob=1.0)
    assert got == (S.ExpandCrop(0.25, 1.5, False), S.Flip(1.0), S.Resize("stretch", interp="random"), S.Normalize())
    with pytest.raises(ValueError, match="family.flip_prob"):
        pp_stages(flip_prob=1.5)
    with pytest.raises(ValueError, match="family.expand_max_ratio"):
        pp_stages(expand_max_ratio=0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_config_augmentation_reaches_the_loader(backend, rect_set, tmp_path):
    # The stages come from cfg's recipe, its options set in the family section (here: always flip, nothing else).
    cfg = replace(make_cfg(backend, tmp_path, batch_size=4, train_sizes=(128,), augment=True),
                  family=PPYOLOEOptions(distort_prob=0.0, expand_prob=0.0, crop=False, flip_prob=1.0))
    sched = TrainSchedule(len(rect_set), 4, rank=0, world_size=1, seed=0, sizes=(128,), random_interp=False)
    cls = DaliTrainLoader if backend == "dali" else TorchTrainLoader
    loader = cls(cfg.data, rect_set, sched, stages_for_epoch=lambda e: registry.phase(cfg, e).stages,
                 device=torch.device("cpu"))
    by_id = {r.image_id: r for r in rect_set}
    checked = 0
    for batch in loader:
        for b in range(batch["images"].shape[0]):
            m = batch["gt_mask"][b]
            if not bool(m.any()):
                continue
            x0, y0, x1, y1 = scaled(by_id[int(batch["image_ids"][b])], 128)
            np.testing.assert_allclose(batch["gt_boxes"][b][m][0].numpy(), [128 - x1, y0, 128 - x0, y1], atol=1e-3)
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometry_expand(backend, rect_set, tmp_path):
    by_id = {r.image_id: r for r in rect_set}
    spec = pp_stages(distort_prob=0.0, expand_prob=1.0, crop=False, flip_prob=0.0)
    samples = run_geometry(backend, rect_set, spec, tmp_path)
    shrunk, fill_frac = 0, []
    for s in samples:
        assert s["box"] is not None  # expansion never loses a box
        fill = (np.abs(s["img"] - np.asarray(A.FILL, np.float32)) <= 3).all(axis=2)
        assert fill.any(), "an expanded image shows the mean-filled canvas"
        fill_frac.append(fill.mean())
        ref = scaled(by_id[s["id"]], s["size"])
        shrunk += (s["box"][2] - s["box"][0]) < 0.9 * (ref[2] - ref[0])
    # ratio ~ U(1, 4): the canvas fills 1 - 1/ratio^2 of the image, 0.84 at the median ratio.
    assert np.median(fill_frac) > 0.5
    assert shrunk >= len(samples) // 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometry_crop(backend, rect_set, tmp_path):
    by_id = {r.image_id: r for r in rect_set}
    spec = pp_stages(distort_prob=0.0, expand_prob=0.0, crop=True, flip_prob=0.0)
    samples = run_geometry(backend, rect_set, spec, tmp_path)
    cropped = sum(
        s["box"] is None or not np.allclose(s["box"], scaled(by_id[s["id"]], s["size"]), atol=0.5) for s in samples
    )
    assert cropped >= 3, "RandomCrop changed the geometry of several samples"


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometry_full_chain(backend, rect_set, tmp_path):
    samples = run_geometry(backend, rect_set, pp_stages(), tmp_path, adaptive=True, epochs=3)
    assert sum(s["box"] is not None for s in samples) >= len(samples) // 2


# --------------------------------------------------------------------------- padding and masks

@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_truncation_and_tiny_boxes(backend, tmp_path):
    """12 boxes with M = 8 keeps the 8 largest; a box under 1 px after the resize is dropped."""
    img = np.zeros((200, 200, 3), np.uint8)
    f = tmp_path / "many.png"
    Image.fromarray(img).save(f)
    sides = np.array([10, 30, 12, 40, 14, 50, 16, 60, 18, 70, 20, 80], np.float32)
    boxes = np.stack([np.zeros(12), np.zeros(12), sides, sides], axis=1).astype(np.float32)
    boxes = np.concatenate([boxes, [[100, 100, 101, 150]]]).astype(np.float32)  # 1 px wide → 0.48 px at 96
    labels = np.arange(13, dtype=np.int64) % 4
    recs = [ImageRecord(i + 1, str(f), 200, 200, boxes, labels) for i in range(4)]
    ds = SimpleNamespace(records=recs, ann_file=tmp_path / "x.json")
    cfg = make_cfg(backend, tmp_path, augment=False, multiscale=False, img_size=96, max_boxes=8)
    loader = train_loader(cfg, ds, rank=0, world_size=1, device="cpu", seed=0)
    (batch,) = list(loader)
    assert batch["gt_boxes"].shape == (4, 8, 4) and batch["gt_boxes"].dtype == torch.float32
    assert batch["gt_labels"].dtype == torch.int64 and batch["gt_mask"].dtype == torch.bool
    largest = np.sort(np.argsort(-sides, kind="stable")[:8])
    expect = boxes[largest] * np.float32(96 / 200)
    for b in range(4):
        assert batch["gt_mask"][b].tolist() == [True] * 8
        np.testing.assert_allclose(batch["gt_boxes"][b].numpy(), expect, rtol=0, atol=1e-5)
        assert batch["gt_labels"][b].tolist() == labels[largest].tolist()
    assert loader.boxes_truncated == 4 * 4  # 12 valid boxes, 8 kept, per image


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_for_images_without_boxes(backend, demo_train, tmp_path):
    recs = list(demo_train.records[:4])
    empty = ImageRecord(999, recs[0].file, recs[0].width, recs[0].height, np.zeros((0, 4), np.float32),
                        np.zeros(0, np.int64))
    ds = SimpleNamespace(records=[empty] * 4, ann_file=demo_train.ann_file)
    loader = train_loader(make_cfg(backend, tmp_path), ds, rank=0, world_size=1, device="cpu", seed=0)
    for batch in loader:
        assert not batch["gt_mask"].any()
        assert (batch["gt_boxes"] == 0).all() and (batch["gt_labels"] == 0).all()


# --------------------------------------------------------------------------- multi-scale, determinism

@pytest.mark.parametrize("backend", BACKENDS)
def test_multiscale_one_size_per_batch(backend, demo_train, tmp_path):
    cfg = make_cfg(backend, tmp_path)
    loader = train_loader(cfg, demo_train, rank=0, world_size=1, device="cpu", seed=3)
    sched = TrainSchedule(len(demo_train.records), 4, rank=0, world_size=1, seed=3, sizes=SIZES, random_interp=True)
    seen = []
    for epoch in range(2):
        for step, batch in enumerate(loader):
            b, c, h, w = batch["images"].shape
            assert (b, c) == (4, 3) and h == w and h in SIZES  # one tensor: all samples share the size
            assert h == sched.size_and_interp(epoch, step)[0]
            boxes = batch["gt_boxes"][batch["gt_mask"]]
            assert (boxes >= 0).all() and (boxes <= h).all()
            assert ((boxes[:, 2:] - boxes[:, :2]) >= 1).all()
            seen.append(h)
    assert len(seen) == 2 * len(loader) and len(set(seen)) > 1
    assert any(a != b for a, b in zip(seen, seen[1:])), "the size changes between batches"


@pytest.mark.parametrize("backend", BACKENDS)
def test_determinism(backend, demo_train, tmp_path):
    def run(seed):
        loader = train_loader(make_cfg(backend, tmp_path), demo_train, rank=0, world_size=1, device="cpu",
                                    seed=seed)
        return collect(loader, passes=2)

    a, b, c = run(5), run(5), run(6)
    assert len(a) == len(b) == 2 * (len(demo_train.records) // 4)
    for x, y in zip(a, b):
        for k in BATCH_KEYS:
            assert torch.equal(x[k], y[k]), k
    assert any(not torch.equal(x["images"], z["images"]) for x, z in zip(a, c) if x["images"].shape == z["images"].shape)


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_epoch_jumps_and_reshuffles(backend, demo_train, tmp_path):
    cfg = make_cfg(backend, tmp_path, augment=False)
    loader = train_loader(cfg, demo_train, rank=0, world_size=1, device="cpu", seed=1)
    e0 = [b["image_ids"].tolist() for b in loader]
    e1 = [b["image_ids"].tolist() for b in loader]  # the next pass is epoch 1
    loader.set_epoch(0)
    again = [b["image_ids"].tolist() for b in loader]
    assert again == e0 and e1 != e0
    # A pass broken off early does not shift the next epoch.
    loader.set_epoch(1)
    next(iter(loader))
    loader.set_epoch(1)
    assert [b["image_ids"].tolist() for b in loader] == e1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pass_moves_on_to_the_next_epochs_stages(backend, rect_set, tmp_path):
    """The pass after epoch 0 is epoch 1 with epoch 1's stage list, set_epoch(1) or not
    (the DALI loader once went on with epoch 0's pipeline)."""
    flip = pp_stages(distort_prob=0.0, expand_prob=0.0, crop=False, flip_prob=1.0)
    cfg = make_cfg(backend, tmp_path, batch_size=4, train_sizes=(128,))
    cls = DaliTrainLoader if backend == "dali" else TorchTrainLoader

    def loader():
        sched = TrainSchedule(len(rect_set), 4, rank=0, world_size=1, seed=0, sizes=(128,), random_interp=True)
        return cls(cfg.data, rect_set, sched, stages_for_epoch=lambda e: flip if e else NO_AUG,
                   device=torch.device("cpu"))

    running = loader()
    collect(running)
    assert running.epoch == 1 and running.stages == flip and running.chain_changes == 2
    implicit = collect(running)
    jumped = loader()
    jumped.set_epoch(1)
    assert [b["image_ids"].tolist() for b in implicit] == [b["image_ids"].tolist() for b in collect(jumped)]
    by_id = {r.image_id: r for r in rect_set}
    for batch in implicit:
        for b, i in enumerate(batch["image_ids"].tolist()):
            x0, y0, x1, y1 = scaled(by_id[i], 128)
            np.testing.assert_allclose(batch["gt_boxes"][b][0].numpy(), [128 - x1, y0, 128 - x0, y1],
                                       atol=1e-3)


# --------------------------------------------------------------------------- sharding

@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_schedule_shards(world):
    n, bs = 23, 2
    shards = [TrainSchedule(n, bs, rank=r, world_size=world, seed=0, sizes=SIZES, random_interp=True)
              for r in range(world)]
    for epoch in (0, 1):
        parts = [s.shard(epoch) for s in shards]
        flat = np.concatenate(parts)
        assert len(set(flat.tolist())) == len(flat) == (n // world) * world  # disjoint, all but n % world
        steps = {s.steps_per_epoch for s in shards}
        assert steps == {(n // world) // bs}
        # Every rank draws the same size for a step.
        assert len({s.size_and_interp(epoch, 0) for s in shards}) == 1
    assert not np.array_equal(shards[0].shard(0), shards[0].shard(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_see_disjoint_training_images(backend, demo_train, tmp_path):
    cfg = make_cfg(backend, tmp_path, augment=False, batch_size=3)
    ids = []
    for rank in range(2):
        loader = train_loader(cfg, demo_train, rank=rank, world_size=2, device="cpu", seed=0)
        ids.append({i for b in loader for i in b["image_ids"].tolist()})
        assert len(loader) == (len(demo_train.records) // 2) // 3
    assert not ids[0] & ids[1]
    assert len(ids[0]) == len(ids[1]) == 3 * ((len(demo_train.records) // 2) // 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("count", [7, 8])
def test_eval_covers_every_image_once(backend, world, count, demo_val, tmp_path):
    ds = SimpleNamespace(records=demo_val.records[:count], ann_file=demo_val.ann_file)
    cfg = make_cfg(backend, tmp_path, eval_batch_size=2)
    loaders = [eval_loader(cfg, ds, rank=r, world_size=world, device="cpu") for r in range(world)]
    steps = -(-(-(-count // world)) // 2)  # ceil(ceil(count / world) / 2)
    assert [len(l) for l in loaders] == [steps] * world  # every rank runs the same number of steps
    for _ in range(2):  # and again on the next evaluation
        ids = []
        for rank, loader in enumerate(loaders):
            batches = list(loader)
            assert len(batches) == steps
            mine = len(range(rank, count, world))
            assert [b["images"].shape[0] for b in batches] == [min(2, max(mine - 2 * i, 0)) for i in range(steps)]
            for b in batches:  # a short rank's last batch may be empty, with the same layout
                n = b["images"].shape[0]
                assert b["images"].shape[1:] == (3, 160, 160)
                assert b["gt_boxes"].shape == (n, 8, 4) and b["orig_sizes"].shape == (n, 2)
                ids += b["image_ids"].tolist()
        assert sorted(ids) == sorted(r.image_id for r in ds.records)
    rec = {r.image_id: r for r in ds.records}
    b = next(iter(loaders[0]))
    assert b["orig_sizes"].tolist() == [[rec[i].height, rec[i].width] for i in b["image_ids"].tolist()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_twice_then_a_pass_starts_again(backend, demo_val, tmp_path):
    """close() releases the workers and may be called again; the next pass starts new ones."""
    ds = SimpleNamespace(records=demo_val.records[:5], ann_file=demo_val.ann_file)
    loader = eval_loader(make_cfg(backend, tmp_path, eval_batch_size=2, num_workers=1), ds, rank=0, world_size=1,
                         device="cpu")
    first = collect(loader)
    assert loader._producer is not None
    loader.close()
    loader.close()
    assert loader._producer is None
    again = collect(loader)
    assert len(again) == len(first) == 3
    for x, y in zip(first, again):
        for k in BATCH_KEYS:
            assert torch.equal(x[k], y[k]), k


# --------------------------------------------------------------------------- parity

def _parity_batches(backend, ds, tmp, train):
    cfg = make_cfg(backend, tmp, augment=False)
    if train:
        return collect(train_loader(cfg, ds, rank=0, world_size=1, device="cpu", seed=2))
    return collect(eval_loader(cfg, ds, rank=0, world_size=1, device="cpu"))


@pytest.mark.parametrize("train", [True, False], ids=["train-linear", "eval-cubic"])
def test_backends_agree_without_augmentation(train, demo_train, demo_val, tmp_path):
    ds = demo_train if train else demo_val
    dali, ref = _parity_batches("dali", ds, tmp_path, train), _parity_batches("torch", ds, tmp_path, train)
    assert len(dali) == len(ref) > 0
    for d, t in zip(dali, ref):
        for k in ("gt_boxes", "gt_labels", "gt_mask", "image_ids", "orig_sizes"):
            assert torch.equal(d[k], t[k]), k
        diff = np.abs(pixels(d["images"]) - pixels(t["images"]))  # 0..255 levels
        if train:  # bilinear: torch's uint8 kernel is within one level of DALI's
            assert diff.max() <= 1.01 and diff.mean() < 0.5
        else:  # bicubic: DALI's cubic kernel differs slightly from cv2's / torch's (a = -0.75)
            assert diff.mean() < 0.6 and np.percentile(diff, 99.9) < 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_channels_last_layout(backend, demo_train, tmp_path):
    cl = train_loader(make_cfg(backend, tmp_path, augment=False, channels_last=True), demo_train, rank=0,
                            world_size=1, device="cpu", seed=0)
    nchw = train_loader(make_cfg(backend, tmp_path, augment=False), demo_train, rank=0, world_size=1,
                              device="cpu", seed=0)
    a, b = next(iter(cl)), next(iter(nchw))
    assert a["images"].shape == b["images"].shape
    assert a["images"].is_contiguous(memory_format=torch.channels_last)
    assert b["images"].is_contiguous()
    assert torch.equal(a["images"], b["images"])


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_have_the_step_inputs_dtype_and_strides(backend, channels_last, demo_train, tmp_path):
    """A captured step copies a batch once, into its static inputs (clones of the warm-up's
    synthetic batch): every input the loader yields has that batch's dtype, shape and
    strides, so the copy is a plain one (no conversion, no relayout)."""
    from fastdet.engine.step import INPUT_KEYS, synthetic_batch

    cfg = make_cfg(backend, tmp_path, channels_last=channels_last)
    batch = next(iter(train_loader(cfg, demo_train, rank=0, world_size=1, device="cpu", seed=0)))
    b, _, h, w = batch["images"].shape
    static = synthetic_batch(b, h, w, cfg.data.max_boxes, torch.device("cpu"), channels_last=channels_last)
    for k in INPUT_KEYS:
        x, y = batch[k], static[k]
        assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()), k


def test_eval_schedule_counts():
    s = EvalSchedule(7, 3, rank=2, world_size=3, size=160)
    assert s.indices.tolist() == [2, 5] and s.steps == 1 and s.nonempty_steps == 1
    s = EvalSchedule(2, 1, rank=2, world_size=3, size=160)
    assert s.indices.tolist() == [] and s.steps == 1 and s.nonempty_steps == 0


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_eval_batches_hold_one_canvas(world, batch):
    """Keep-ratio evaluation puts every image on the canvas of its own orientation, the one
    fastdet.detect gives it (Preprocess.canvas): a batch never mixes orientations. Before,
    a batch took its records' most common orientation's canvas and a minority image was
    scaled down to fit it (a 480 x 640 portrait next to a landscape: 1.25 instead of 1.667
    at 800). Every rank still runs the same number of batches and every record appears
    once; a square family's batches are the strided shard's, in order, as before."""
    pre = Preprocess(resize="keep_ratio", short=800, max_long=1333)
    rng = np.random.default_rng(world * 10 + batch)
    n, size = 23, 128
    hw = rng.integers(100, 700, (n, 2))
    aspects = hw[:, 1] / hw[:, 0]
    scheds = [EvalSchedule(n, batch, rank=r, world_size=world, size=size, canvases=pre.canvases(), aspects=aspects)
              for r in range(world)]
    assert len({s.steps for s in scheds}) == 1
    steps = scheds[0].steps
    assert steps == max(s.nonempty_steps for s in scheds)
    seen = []
    for r, s in enumerate(scheds):
        assert sorted(s.indices.tolist()) == list(range(r, n, world))
        for k in range(steps):
            plan = s.batch(k)
            assert (len(plan.indices) > 0) == (k < s.nonempty_steps) and len(plan.indices) <= batch
            for i in plan.indices.tolist():
                assert plan.hw == pre.canvas(int(hw[i, 0]), int(hw[i, 1]), size), (i, hw[i], plan.hw)
            seen += plan.indices.tolist()
    assert sorted(seen) == list(range(n))
    assert len({pre.canvas(int(h), int(w), size) for h, w in hw}) == 3  # the set mixes all three
    for r in range(world):  # one canvas: the strided shard in order, as before
        sq = EvalSchedule(n, batch, rank=r, world_size=world, size=size, aspects=aspects)
        shard = list(range(r, n, world))
        assert sq.steps == -(-(-(-n // world)) // batch)
        assert [sq.batch(k).indices.tolist() for k in range(sq.steps)] == \
            [shard[k * batch:(k + 1) * batch] for k in range(sq.steps)]


def test_train_sizes_follow_config():
    assert train_sizes(make_cfg("torch", Path(".")).data) == SIZES
    assert train_sizes(make_cfg("torch", Path("."), multiscale=False, img_size=320).data) == (320,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_measure_loader_counts_what_it_times(backend, demo_train, tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "loaders.py"
    spec = importlib.util.spec_from_file_location("fastdet_bench_loaders", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.measure_loader(make_cfg("auto", tmp_path), demo_train, backend, "cpu", n_batches=4, warmup=1, windows=2)
    assert r["backend"] == backend and r["images"] == 4 * 4 and len(r["windows"]) == 2
    assert r["images_per_s"] > 0 and r["batches_per_epoch"] == len(demo_train.records) // 4


@pytest.mark.parametrize("box_scale", ["ratio", "content"])
@pytest.mark.parametrize("interp", ["linear", "cubic"])
def test_backends_floor_sizes_alike(interp, box_scale, tmp_path):
    """A keep-ratio content size of exactly .5 px floors on both back ends, as the authors'
    resizes (torchvision's FCOS transform; YOLOX's ``int(w * r)``). A 341 x 256 image at
    128 (r = 0.5) is 170.5 px wide: the torch evaluation loader once gave 170 (Python's
    round), DALI 171 (halves up), then both 171; both now place 170 px of content and
    report sx = 170 / 341 (``box_scale="content"``) or r = 0.5 (``"ratio"``)."""
    recs = []
    for i, (w, h) in enumerate(((341, 256), (256, 341))):
        f = tmp_path / f"{i}.png"
        Image.fromarray(np.full((h, w, 3), 255, np.uint8)).save(f)
        recs.append(ImageRecord(i + 1, str(f), w, h, np.array([[0.0, 0.0, w, h]], np.float32), np.zeros(1, np.int64)))
    pre = Preprocess(resize="keep_ratio", pad_value=0.0, mean=None, std=None, interp=interp, short=800,
                     max_long=1333, box_scale=box_scale)
    ds = SimpleNamespace(records=recs, ann_file="x.json")
    got = {}
    for backend in BACKENDS:
        cfg = make_cfg(backend, tmp_path, eval_batch_size=2, img_size=128)
        for b in collect(build_eval_loader(cfg.data, ds, preprocess=pre, rank=0, world_size=1, device="cpu")):
            for j, i in enumerate(b["image_ids"].tolist()):
                got[backend, i] = (b["images"][j], b["scale_factors"][j], b["gt_boxes"][j][0])
    for i, r in enumerate(recs, 1):
        (xd, sd, bd), (xt, st, bt) = got["dali", i], got["torch", i]
        assert xd.shape == xt.shape == ((3, 128, 224) if i == 1 else (3, 224, 128))
        content = [int(v) for v in ((xt > 127).any(0).nonzero().max(0).values + 1).tolist()]  # (h, w) extent
        assert content == [int(v) for v in ((xd > 127).any(0).nonzero().max(0).values + 1).tolist()]
        assert content == ([128, 170] if i == 1 else [170, 128])
        want = [content[1] / r.width, content[0] / r.height] if box_scale == "content" else [0.5, 0.5]
        assert sd.tolist() == pytest.approx(want, rel=1e-6) and st.tolist() == pytest.approx(want, rel=1e-6)
        torch.testing.assert_close(bd, bt)
