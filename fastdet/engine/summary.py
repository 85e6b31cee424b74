"""The model summary printed at start-up and written to ``model_summary.txt`` in the run directory.

Parameters (all, and trainable: ``requires_grad``), per top-level part (backbone, neck,
head ...), and GFLOPs (2 x multiply-accumulates of convolutions and matrix products,
``fastdet.models.flops``' convention) of one image at each training size and at the
evaluation size, counted on the meta device (no real compute, no device memory), of the
model as it trains (not the re-parameterised deploy form the published tables count).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from torch import nn

from fastdet.models.flops import count_flops

FILE_NAME = "model_summary.txt"


@dataclass
class ModelSummary:
    name: str
    params: int
    trainable: int
    parts: dict[str, tuple[int, int]]  # top-level child -> (params, trainable)
    gflops: dict[int, float] = field(default_factory=dict)  # square input size -> GFLOPs of one image

    def lines(self) -> list[str]:
        out = [f"model {self.name}: {self.params / 1e6:.2f} M parameters, {self.trainable / 1e6:.2f} M trainable"
               + (f" ({self.params - self.trainable:,} frozen)" if self.params != self.trainable else "")]
        for part, (n, t) in self.parts.items():
            out.append(f"  {part:<12} {n / 1e6:8.2f} M" + ("" if n == t else f"  ({t / 1e6:.2f} M trainable)"))
        if self.gflops:
            out.append("  GFLOPs per image: " + ", ".join(f"{g:.2f} at {s}x{s}" for s, g in self.gflops.items()))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def summarize_model(model: nn.Module, name: str, sizes: Sequence[int]) -> ModelSummary:
    """The summary of ``model`` with GFLOPs at each of ``sizes`` (square inputs)."""
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    parts = {}
    for child_name, child in model.named_children():
        n = sum(p.numel() for p in child.parameters())
        if n:
            parts[child_name] = (n, sum(p.numel() for p in child.parameters() if p.requires_grad))
    gflops = {int(s): count_flops(model, int(s), deploy=False) / 1e9 for s in dict.fromkeys(sizes)}
    return ModelSummary(name, params, trainable, parts, gflops)


def write_summary(summary: ModelSummary, out_dir: Path) -> Path:
    """``model_summary.txt`` (the printed lines, then the same as JSON)."""
    path = Path(out_dir) / FILE_NAME
    path.write_text(str(summary) + "\n\n" + json.dumps(asdict(summary), indent=1) + "\n")
    return path
