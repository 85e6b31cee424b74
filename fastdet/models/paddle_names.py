"""PaddleDetection's naming conventions every Paddle-trained family shares (its converters,
``fastdet.convert``): BatchNorm statistics and the ``backbone.`` prefix of ImageNet files."""

from __future__ import annotations

from typing import Any

import torch

NAME_TABLE = "StructuredToParameterName@@"  # Paddle's structured -> internal name map, not weights


def bn_name(key: str) -> str:
    """Paddle BatchNorm ``_mean`` / ``_variance`` -> torch ``running_mean`` / ``running_var``."""
    if key.endswith("._mean"):
        return key[: -len("_mean")] + "running_mean"
    if key.endswith("._variance"):
        return key[: -len("_variance")] + "running_var"
    return key


def dfl_projection_checked(v: Any, key: str) -> None:
    """PP-YOLOE's ``proj_conv`` is the fixed 0..reg_max projection (fastdet computes it)."""
    want = torch.arange(v.numel(), dtype=torch.float32)
    if not torch.equal(v.float().reshape(-1), want):
        raise KeyError(f"{key} (not the 0..{v.numel() - 1} DFL projection: another head)")
