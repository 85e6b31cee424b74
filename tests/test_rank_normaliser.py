"""Across ranks, each family's loss normaliser is the stated one (issue 43, item 4).

fastdet's choice, per family (README "Losses across ranks"; each family's docstring):

- PP-YOLOE, YOLOX, FCOS divide by the number of positives (PP-YOLOE: the sum of the
  assigned scores; FCOS: also the centerness sum of its box loss) averaged over the
  ranks, so every rank divides by the same number. With DDP averaging the gradients,
  2 ranks then train exactly as 1 process on the two batches together, and a rank whose
  batch has no positive weighs its negatives as that one process would.
  (Paddle's PP-YOLOE does the same; Megvii's YOLOX and Paddle's FCOS divide by each
  rank's own positives, clamped at 1, which gives such a rank's negatives up to the
  batch's positive count times their weight.)
- PP-YOLO sums each image's loss and takes the batch mean, as Paddle's YOLOv3 loss: no
  positive count, the same with any number of ranks of equal batches.

One spawn of 2 gloo ranks serves every family (a spawn costs seconds on a loaded CPU).
Rank 0 holds 2 images with boxes, rank 1 holds 2 images with none; the models are float64
in eval mode (running BatchNorm statistics, no DropBlock), so the batch split enters only
through the normalisers. The truth is one process on the 4 images.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from ports import spawn_gloo_ranks

from fastdet.data.layout import TARGET_KEYS
from fastdet.models import build_model

FAMILIES = {"ppyoloe": "s", "ppyolo": "r18vd", "yolox": "nano", "fcos": "r50"}
PER_RANK, SIZE, MAX_BOXES, BOXES = 2, 64, 16, 16


def whole_batch() -> dict[str, torch.Tensor]:
    """The 2 ranks' images together: rank 0's with ``BOXES`` boxes each, rank 1's with none.

    Boxes of 12 to 40 px in a 64 px image, class 0-3. 16 boxes an image, not fewer: the
    normalisers are clamped at 1 after the mean over ranks (as in Paddle's PP-YOLOE), so 2
    ranks equal 1 process while that mean is at least 1. PP-YOLOE's (the assigned scores:
    IoUs of an untrained model's boxes) sums to 1.8 over rank 0's images with 8 boxes
    each, a mean of 0.9 over the ranks; 2.4 with 16, a mean of 1.2.
    """
    gen = torch.Generator().manual_seed(5)
    n = 2 * PER_RANK
    xy = torch.rand(n, MAX_BOXES, 2, generator=gen) * (SIZE - 40)
    wh = 12 + torch.rand(n, MAX_BOXES, 2, generator=gen) * 28
    mask = (torch.arange(MAX_BOXES) < BOXES)[None, :] & (torch.arange(n) < PER_RANK)[:, None]  # [n, M]
    return {
        "images": torch.randn(n, 3, SIZE, SIZE, generator=gen, dtype=torch.float64),
        "gt_boxes": torch.cat([xy, xy + wh], -1) * mask[..., None],
        "gt_labels": torch.randint(0, 4, (n, MAX_BOXES), generator=gen) * mask,
        "gt_mask": mask,
        "gt_scores": mask.float(),
    }


def model_for(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(arch, FAMILIES[arch], num_classes=4).double().eval()


def loss_and_grads(model, batch, rows: slice):
    images = batch["images"][rows]
    targets = {k: batch[k][rows] for k in TARGET_KEYS}
    losses = model(images, targets)
    losses["total_loss"].backward()
    return ({k: float(v.detach()) for k, v in losses.items()},
            [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch = whole_batch()
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        out = {}
        for arch in FAMILIES:
            model = model_for(arch)
            ddp = torch.nn.parallel.DistributedDataParallel(model)  # averages the gradients
            images = batch["images"][rows]
            losses = ddp(images, {k: batch[k][rows] for k in TARGET_KEYS})
            losses["total_loss"].backward()
            out[arch] = ({k: float(v.detach()) for k, v in losses.items()},
                         [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_gloo_ranks(_worker)


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)))
    return num / math.sqrt(sum(float(y.pow(2).sum()) for y in b))


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_two_ranks_one_without_positives_train_as_one_process(two_ranks, arch):
    one_losses, one_grads = loss_and_grads(model_for(arch), whole_batch(), slice(None))
    (l0, g0), (l1, g1) = two_ranks[0][arch], two_ranks[1][arch]
    for k, v in {**l0, **l1}.items():
        assert math.isfinite(v), (arch, k, l0, l1)
    assert all(bool(torch.isfinite(g).all()) for g in g1)
    # Rank 1 has no positive: its box losses are 0, its negatives' losses are not.
    for k in ("loss_iou", "loss_dfl", "loss_box", "loss_ctr", "loss_xy", "loss_wh"):
        if k in l1:
            assert l1[k] == 0.0, (arch, k, l1)
    assert l1["total_loss"] > 0.0
    # The stated rule: every rank divides by the mean over ranks (PP-YOLO: the batch mean),
    # so the ranks' mean loss is the one process's loss on the 4 images, and DDP's
    # averaged gradient is that process's gradient. Both ranks hold the same gradient.
    for k, v in one_losses.items():
        assert (l0[k] + l1[k]) / 2 == pytest.approx(v, rel=1e-5, abs=1e-7), (arch, k, l0[k], l1[k], v)
    assert rel(g0, g1) == 0.0
    assert rel(g0, one_grads) < 1e-5, arch
