"""Checkpoints: atomic writes, loadable with ``torch.load(weights_only=True)``.

A checkpoint holds the plain module's state (never the compiled or DDP wrapper's keys),
the EMA, optimizer, grad-scaler state, epoch, step, the resolved config and the RNG
states. Everything is tensors, numbers, strings, lists and dicts, so loading one from
elsewhere cannot run code.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": _to_lists(random.getstate()),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def save_checkpoint(path: str | Path, state: dict[str, Any], keep_previous: bool = False) -> None:
    """Write ``state`` to ``path`` atomically (temp file in the same folder, flushed to disk,
    + rename). ``keep_previous``: the file it replaces becomes :func:`previous_path` (the
    last two are kept, so a damaged newest one still leaves one to resume from)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def previous_path(path: str | Path) -> Path:
    """``latest.pth`` -> ``latest.prev.pth``: the checkpoint written before it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def load_with_fallback(path: str | Path, warn: Any = None, mmap: bool = False) -> tuple[dict[str, Any], Path]:
    """Load ``path``; if it is missing or unreadable (a kill or a full disk mid-write) and
    :func:`previous_path` exists, load that instead, calling ``warn(message)``. Returns the
    state and the path it came from; raises as :func:`load_checkpoint` when neither loads."""
    path = Path(path)
    prev = previous_path(path)
    try:
        return load_checkpoint(path, mmap=mmap), path
    except (ValueError, FileNotFoundError) as e:
        if not prev.is_file():
            raise
        reason = e
    state = load_checkpoint(prev, mmap=mmap)
    if warn is not None:
        warn(f"{path} cannot be read ({reason}); resuming from the checkpoint before it, {prev} "
             f"(step {state.get('step')})")
    return state, prev


def is_checkpoint_archive(path: str | Path) -> bool:
    """Whether ``path`` is a ``torch.save`` zip archive (cheap: reads the zip directory)."""
    return zipfile.is_zipfile(path)


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Load with ``weights_only=True``; every failure is a one-line ValueError naming the file
    (torch's own message advises ``weights_only=False``, wrong for a corrupt file).
    ``mmap``: tensors map the file instead of being read (a caller that needs the config only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not is_checkpoint_archive(path):
        raise ValueError(f"{path} is not a checkpoint: torch.save writes a zip archive and this "
                         "file is not one (corrupt, truncated or another format)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        raise ValueError(f"{path} holds Python objects other than tensors, numbers, strings and "
                         "containers; fastdet only loads checkpoints that need no code to "
                         "unpickle") from None
    except Exception as e:  # a damaged archive: a truncated record, a bad CRC
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{path} is not a readable checkpoint ({first})") from None


def select_weights(ck: dict[str, Any], ema: bool = True) -> tuple[dict[str, Any], str]:
    """The state dict to load and which it is (``"ema"`` or ``"model"``): the EMA weights when
    asked and present (what training evaluates), else the plain ones."""
    use_ema = ema and isinstance(ck.get("ema"), dict)
    weights = ck["ema"] if use_ema else ck["model"]
    if "module" in weights:  # ModelEMA.state_dict() layout
        weights = weights["module"]
    return weights, "ema" if use_ema else "model"


def load_weights_tolerant(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Load matching tensors; return the names skipped because their shape differs.

    Used by ``--ckpt`` fine-tuning, e.g. from an 80-class checkpoint into a 3-class
    head: the classification layers are skipped and stay freshly initialised.
    """
    own = model.state_dict()
    keep, skipped = {}, []
    for k, v in state.items():
        if k in own and own[k].shape == v.shape:
            keep[k] = v
        elif k in own:
            skipped.append(f"{k} {tuple(v.shape)}->{tuple(own[k].shape)}")
    missing = [k for k in own if k not in keep and not any(s.startswith(k + " ") for s in skipped)]
    if len(missing) > len(own) // 2:
        raise ValueError(
            f"checkpoint does not fit this model: {len(missing)} of {len(own)} tensors missing "
            f"(first: {missing[0]})"
        )
    model.load_state_dict(keep, strict=False)
    return skipped
