"""Every family's train step at every bucket its published recipe trains: the cases that
tests/test_capturable.py (CPU: no host sync, no host-to-device copy) and
tests/test_gpu_capture.py (CUDA: the whole step captured and replayed against eager)
run.

The buckets come from the recipes themselves, so a new phase or canvas is covered
without editing the tests: each loss variant of the whole schedule
(``registry.loss_variants``) times each canvas of the family's Resize at a tiny square
size (keep-ratio: landscape, portrait and square). Models are the family's first
(smallest) size with 4 classes; optimizer, EMA and clipping are the recipe's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fastdet import registry
from fastdet.data.loader import canvases_for
from fastdet.data.stages import Resize
from fastdet.engine.optim import build_optimizer_and_ema
from fastdet.engine.step import TrainStep, synthetic_batch
from fastdet.models import ARCHITECTURES

NUM_CLASSES = 4
MAX_BOXES = 8


@dataclass
class Case:
    arch: str
    size: str
    cfg: Any
    variants: list[dict[str, Any]]
    canvases: tuple[tuple[int, int], ...]

    def buckets(self) -> list[tuple[tuple[int, int], dict[str, Any]]]:
        return [(hw, kw) for hw in self.canvases for kw in self.variants]


def case(arch: str, square: int = 64) -> Case:
    size = ARCHITECTURES[arch].sizes[0]
    cfg = registry.get_preset(arch, size)
    cfg = replace(cfg, model=replace(cfg.model, num_classes=NUM_CLASSES))
    variants = registry.loss_variants(cfg, 0, cfg.optim.epochs - 1)
    rs = next(s for s in registry.phase(cfg, 0).stages if isinstance(s, Resize))
    canvases = canvases_for(rs.mode, rs.short, rs.max_long).buckets(square)
    return Case(arch, size, cfg, variants, canvases)


def make_step(c: Case, device: torch.device, *, cuda_graphs: bool = False, seed: int = 0,
              model: torch.nn.Module | None = None) -> TrainStep:
    """The trainer's step for case ``c``: its model (or ``model``), optimizer, EMA, clipping; fp32."""
    torch.manual_seed(seed)
    if model is None:
        model = registry.build_detector(c.cfg).to(device).train()
    batch = 2
    optimizer, ema, _ = build_optimizer_and_ema(c.cfg.optim, model, batch, device)
    return TrainStep(model, model, optimizer, ema, device, None, clip_grad_norm=c.cfg.optim.clip_grad_norm,
                     cuda_graphs=cuda_graphs)


def batch_for(hw: tuple[int, int], device: torch.device, seed: int, boxes: int = 4) -> dict[str, torch.Tensor]:
    """A synthetic batch of 2 images of ``hw`` with ``boxes`` valid boxes each."""
    b = synthetic_batch(2, hw[0], hw[1], MAX_BOXES, device, torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(b["gt_mask"])
    mask[:, :boxes] = True
    b.update(gt_mask=mask, gt_boxes=b["gt_boxes"] * mask[..., None], gt_labels=b["gt_labels"] * mask,
             gt_scores=mask.float())
    return b


FAMILIES = tuple(ARCHITECTURES)
