"""The before-training check's val images: one canvas, so its batch is the evaluation's largest.

On a GPU the check evaluates a whole eval batch per rank to show that the batch fits in
device memory. Keep-ratio evaluation (FCOS) batches hold one canvas each (``EvalSchedule``);
the first ``n`` val images mixed landscape, portrait and square and split into two or three
smaller batches, so the check saw a smaller batch than the evaluation's largest. The
selection is tested here without CUDA, as a function of ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdet.config import DataConfig
from fastdet.data.loader import build_eval_loader
from fastdet.data.records import ImageRecord
from fastdet.data.schedule import Canvases, EvalSchedule
from fastdet.engine.preflight import one_canvas, tiny_subset
from fastdet.models import ARCHITECTURES

FCOS = ARCHITECTURES["fcos"].preprocess
SIZE = 64  # FCOS canvases at 64: landscape (64, 128), portrait (128, 64), square (64, 64)
# w / h of each orientation (SQUARE_BAND 1.1): landscape, portrait, square
ASPECT = {"L": 1.5, "P": 1 / 1.5, "S": 1.0}


def _aspects(orientations: str) -> np.ndarray:
    return np.array([ASPECT[o] for o in orientations], np.float64)


@pytest.mark.parametrize("orientations, n, want", [
    ("LPSLLPLL", 4, [0, 3, 4, 6]),  # landscape: 5 >= 4, the largest area (ties with portrait: landscape)
    ("LPSPPSP", 4, [1, 3, 4, 6]),  # portrait: 4 of them, landscape 1
    ("SLSPSSL", 4, [0, 2, 4, 5]),  # only square has 4: the smaller canvas, but a full batch
    ("LPSSPLS", 4, [2, 3, 6]),  # none has 4: the most populated (square 3)
    ("LPLPSS", 4, [0, 2]),  # none has 4, ties at 2: the larger area (landscape, then portrait)
    ("LPSLLPLL", 1, [0]),  # one image: the first on the largest canvas
])
def test_the_check_takes_one_canvas_the_largest_the_val_set_fills(orientations, n, want):
    assert one_canvas(_aspects(orientations), n, FCOS.canvases(), SIZE).tolist() == want


def test_a_square_family_takes_the_first_images():
    aspects = _aspects("LPSLLPLL")
    for fam in ("ppyoloe", "ppyolo", "yolox"):
        canvases = ARCHITECTURES[fam].preprocess.canvases()
        assert canvases == Canvases()
        assert one_canvas(aspects, 4, canvases, SIZE).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_each_ranks_share_is_one_batch_as_large_as_the_evaluations_largest(world, batch):
    """On random val sets: each rank's share of the check's images (``n = batch x world``,
    split strided by the eval loader) is one batch, at least as large as the largest batch
    the whole evaluation runs on that rank; on one rank, on the largest canvas that holds
    a full batch (or, when none does, as large as the largest batch there is)."""
    rng = np.random.default_rng(world * 100 + batch)
    canvases = FCOS.canvases()
    area = {hw: hw[0] * hw[1] for hw in canvases.buckets(SIZE)}
    for trial in range(30):
        aspects = rng.choice([1.5, 1 / 1.5, 1.0, 2.0, 0.4], size=int(rng.integers(1, 40)))
        pick = one_canvas(aspects, batch * world, canvases, SIZE)
        assert len({canvases.own(aspects[pick][i:i + 1])[0] for i in range(len(pick))}) == 1
        for rank in range(world):
            full = EvalSchedule(len(aspects), batch, rank=rank, world_size=world, size=SIZE, canvases=canvases,
                                aspects=aspects)
            plans = [full.batch(k) for k in range(full.nonempty_steps)]
            tiny = EvalSchedule(len(pick), batch, rank=rank, world_size=world, size=SIZE, canvases=canvases,
                                aspects=aspects[pick])
            assert tiny.nonempty_steps <= 1
            got = len(tiny.batch(0).indices) if tiny.nonempty_steps else 0
            largest = max((len(p.indices) for p in plans), default=0)
            if len(pick) == batch * world:  # a canvas holds n: each rank a full batch on it
                assert got == batch >= largest, (trial, aspects)
            if world == 1:
                assert got == largest, (trial, aspects)
                fulls = [p.hw for p in plans if len(p.indices) == batch]
                if fulls:
                    assert area[tiny.batch(0).hw] == max(area[hw] for hw in fulls), (trial, aspects)


@dataclass(frozen=True)
class _Val:
    """The two fields of a CocoDataset the check's subset and the eval loader read."""

    records: list
    ann_file: Path = Path("val.json")


def test_the_eval_loader_yields_one_batch_of_the_checks_images(tmp_path):
    """The loader the check builds on its images (torch back end, FCOS at 64, eval batch 4)
    yields one batch of 4 on the landscape canvas; the first 4 images gave three batches
    (landscape 2, portrait 1, square 1), none of the evaluation's largest size."""
    recs = []
    for i, o in enumerate("LPSLLPLL"):
        h = 60
        w = round(h * ASPECT[o])
        f = tmp_path / f"{i}.png"
        Image.fromarray(np.full((h, w, 3), 100 + i, np.uint8)).save(f)
        recs.append(ImageRecord(i + 1, str(f), w, h, np.array([[1.0, 2.0, 20.0, 30.0]], np.float32),
                                np.zeros(1, np.int64)))
    val = _Val(recs)
    data = DataConfig(loader="torch", eval_batch_size=4, img_size=SIZE, num_workers=0, check_images="open")

    def shapes(ds):
        loader = build_eval_loader(data, ds, preprocess=FCOS, rank=0, world_size=1, device="cpu")
        return [(tuple(b["images"].shape), b["image_ids"].tolist()) for b in loader]

    assert shapes(tiny_subset(val, 4, FCOS.canvases(), SIZE)) == [((4, 3, 64, 128), [1, 4, 5, 7])]
    assert sorted(s for s, _ in shapes(_Val(recs[:4]))) == [(1, 3, 64, 64), (1, 3, 128, 64), (2, 3, 64, 128)]
    assert tiny_subset(val, 4).records == recs[:4]  # one canvas (the default): the first n
