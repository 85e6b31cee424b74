"""PaddleDetection's naming conventions every Paddle-trained family shares (its converters,
``fastdet.convert``): the name table a ``.pdparams`` carries, BatchNorm statistics and the
``backbone.`` prefix of ImageNet files. The one module that names them."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fastdet.runtime.checkpoint import backbone_state, read_weights, to_tensors

log = logging.getLogger("fastdet.models")

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


def load_paddle_backbone(backbone: torch.nn.Module, path: str, rename) -> tuple[list[str], list[str]]:
    """Load an authors' ImageNet backbone file (``.pdparams``, read without running code) into
    ``backbone`` (``--backbone-weights``).

    Names may carry a ``backbone.`` prefix or not; ``rename(name) -> fastdet backbone name``
    maps the rest. A full fastdet checkpoint (a run's ``best.pth``) gives its backbone
    (``fastdet.runtime.checkpoint.backbone_state``). Tensors the backbone does not have (the ImageNet classifier) are ignored
    and named in one log line; a shape mismatch or a file that fits nothing is one
    ``ValueError`` line. Returns ``(missing, ignored)``.
    """
    raw, own_names = backbone_state(read_weights(path), path)
    state = to_tensors({k: v for k, v in raw.items() if k != NAME_TABLE})
    own = backbone.state_dict()
    keep, ignored = {}, []
    for k, v in state.items():
        # A fastdet checkpoint's backbone already has the model's names (rename maps Paddle's).
        name = k if own_names else rename(bn_name(k[len("backbone."):] if k.startswith("backbone.") else k))
        if name not in own:
            ignored.append(k)
        elif tuple(own[name].shape) != tuple(v.shape):
            raise ValueError(f"--backbone-weights {path}: {k} has shape {list(v.shape)}, the backbone's {name} "
                             f"expects {list(own[name].shape)} (another size?)")
        else:
            keep[name] = v.float()
    if not keep:
        raise ValueError(f"--backbone-weights {path}: none of its {len(state)} tensors fit this backbone "
                         f"(first: {next(iter(state), 'none')})")
    backbone.load_state_dict(keep, strict=False)
    missing = [k for k in own if k not in keep and not k.endswith("num_batches_tracked")]
    log.info("backbone weights: %d tensors loaded from %s", len(keep), path)
    if ignored:
        log.info("backbone weights: ignored in %s (not in the backbone, e.g. the ImageNet classifier): %s",
                 path, ", ".join(ignored))
    if missing:
        log.warning("backbone weights: missing in %s (left at their init): %s", path, ", ".join(missing))
    return missing, ignored
