"""Checkpoints and weight files: atomic writes, and the one reader that runs no code.

A checkpoint holds the plain module's state (never the compiled or DDP wrapper's keys),
the EMA, optimizer, grad-scaler state, epoch, step, the resolved config and the RNG
states. Everything is tensors, numbers, strings, lists and dicts, so loading one from
elsewhere cannot run code.

The same reader takes the authors' released files (``fastdet.convert``, ``--backbone-weights``).
A pickle can call any importable function while it loads (``__reduce__``). Torch files
(our checkpoints, Megvii's and torchvision's releases) load with
``torch.load(weights_only=True)`` in :func:`load_torch_file`, the one place that calls it.
Paddle's ``.pdparams`` is a pickle of ``{structured name: numpy array}``, so it goes
through :class:`_NumpyOnlyUnpickler`, which resolves only numpy's array reconstruction,
dtypes and plain containers and refuses anything else before calling it.
"""

from __future__ import annotations

import _codecs
import logging
import os
import pickle
import random
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

log = logging.getLogger("fastdet")


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


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk or quota, a read-only or lost file
    system): one line naming the file, the cause and the space left; the file it would have
    replaced is untouched."""


def save_checkpoint(path: str | Path, state: dict[str, Any], keep_previous: bool = False) -> None:
    """Write ``state`` to ``path`` atomically (temp file in the same folder, flushed to disk,
    + rename). ``keep_previous``: the file it replaces becomes :func:`previous_path` (the
    last two are kept, so a damaged newest one still leaves one to resume from). A failed
    write is :class:`CheckpointWriteError` (torch.save says a full disk as "[enforce fail at
    inline_container.cc] unexpected pos ..."), its temp file removed."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        # torch.save's writer says a failed write as a RuntimeError of its zip container;
        # another RuntimeError (a device fault while reading a tensor) is not a write's.
        if isinstance(e, RuntimeError) and not any(w in str(e) for w in ("inline_container", "PytorchStreamWriter")):
            raise
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        try:
            free = f"{shutil.disk_usage(path.parent).free / 2**20:,.0f} MiB free on its file system"
        except OSError:
            free = "its file system cannot be read"
        raise CheckpointWriteError(f"cannot write {path}: {cause} ({free}); the checkpoint before it is kept") \
            from None
    finally:
        if tmp is not None and os.path.exists(tmp):
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
    try:
        state = load_checkpoint(prev, mmap=mmap)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{path} cannot be read ({reason}), nor can the checkpoint before it ({e})") from None
    if warn is not None:
        warn(f"{path} cannot be read ({reason}); resuming from the checkpoint before it, {prev} "
             f"(step {state.get('step')})")
    return state, prev


# Reading: the safe unpickler for every weight file fastdet takes.

class UnsafeWeightsError(ValueError):
    """A weight file asks to run something other than numpy's array reconstruction."""


# (module, name) pairs a numpy pickle of arrays needs, under numpy 1 (``numpy.core``) and
# numpy 2 (``numpy._core``) names; builtins for the containers protocol 2..5 may name.
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "bytearray"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("_codecs", "encode"),  # protocol 2 stores an array's bytes as codecs.encode(str, "latin1")
}
for _core in ("numpy.core", "numpy._core"):
    # protocol 5 rebuilds an array from its buffer with numeric._frombuffer(buf, dtype, shape, order)
    _ALLOWED |= {(f"{_core}.multiarray", "_reconstruct"), (f"{_core}.multiarray", "scalar"),
                 (f"{_core}.numeric", "_frombuffer")}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise UnsafeWeightsError(
                f"{self.path}: refused: the pickle asks for {module}.{name}, which is not a numpy array, dtype "
                "or plain container (a weight file needs nothing else; nothing from it was run)")
        if module == "_codecs":
            def encode(obj: Any, encoding: str = "utf-8") -> bytes:
                if not isinstance(obj, str) or encoding != "latin1":
                    raise UnsafeWeightsError(f"{self.path}: refused: codecs.encode({type(obj).__name__}, "
                                             f"{encoding!r}) is not an array's byte string")
                return _codecs.encode(obj, encoding)

            return encode
        if module.startswith("numpy._core") and not hasattr(np, "_core"):
            module = module.replace("numpy._core", "numpy.core")  # a numpy 2 file under numpy 1
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeWeightsError(f"{self.path}: refused: the pickle holds a persistent reference (not a plain "
                                 "pickle of numpy arrays)")


def load_pdparams(path: str | Path) -> dict[str, Any]:
    """A PaddlePaddle ``.pdparams`` file as ``{name: value}`` (arrays stay numpy).

    Raises :class:`UnsafeWeightsError` (one line) on anything but numpy arrays, dtypes and
    containers, ``ValueError`` on a file that is not a pickle of a dict.
    """
    path = Path(path)
    _refuse_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        try:
            obj = _NumpyOnlyUnpickler(f, path).load()
        except UnsafeWeightsError:
            raise
        except Exception as e:  # a truncated or foreign file
            first = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"{path}: not a readable Paddle .pdparams pickle ({type(e).__name__}: {first})") from None
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: a .pdparams file holds a dict of arrays, this one holds a {type(obj).__name__}")
    return dict(obj)


def load_torch_file(path: str | Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers only.

    Every failure is one line naming the file (torch's own message advises
    ``weights_only=False``, wrong for a file from elsewhere or a corrupt one):
    :class:`UnsafeWeightsError` for a file that needs code to unpickle, ``ValueError`` for
    a damaged one (a truncated record, a bad CRC). ``mmap``: tensors map the file instead
    of being read (a caller that needs the config only).
    """
    path = Path(path)
    _refuse_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise UnsafeWeightsError(f"{path}: refused: it holds Python objects other than tensors, numbers, strings "
                                 f"and containers; fastdet only loads files that need no code to unpickle "
                                 f"({first})") from None
    except Exception as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {first})") from None


def is_torch_file(path: str | Path) -> bool:
    """``torch.save`` writes a zip archive (a legacy non-zip torch file is read as a pickle)."""
    return zipfile.is_zipfile(path)


def _refuse_folder(path: Path) -> None:
    """A folder is not "no such file" (a run directory given where its best.pth was meant)."""
    if path.is_dir():
        raise ValueError(f"{path}: a folder, not a weight file")


def _starts_as_zip(path: Path) -> bool:
    """A zip's first local header, read when ``is_torch_file`` is False: the archive was cut
    short or damaged (its central directory, at the end, is what does not open)."""
    with open(path, "rb") as f:
        return f.read(2) == b"PK"


def weight_file_format(path: str | Path) -> str:
    """``"torch"`` (a zip archive, as ``torch.save`` writes) or ``"paddle"`` (a pickle, as
    ``paddle.save`` writes ``.pdparams``). ``FileNotFoundError`` for no file, ``ValueError``
    for a folder, a damaged zip archive or anything else: one line naming the path."""
    path = Path(path)
    _refuse_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if is_torch_file(path):
        return "torch"
    if _starts_as_zip(path):
        raise ValueError(f"{path}: a zip archive that does not open (truncated or damaged): not a readable "
                         "torch file")
    with open(path, "rb") as f:
        if f.read(1) == b"\x80":
            return "paddle"
    raise ValueError(f"{path}: neither a torch file (a zip archive) nor a Paddle .pdparams (a pickle): "
                     "not a weight file, or damaged")


def to_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` from numpy arrays or tensors; ``(name, array)`` tuple values (some
    third-party Paddle files) are unwrapped; other entries are dropped (the caller names them)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
            v = v[1]
        if isinstance(v, np.ndarray):
            out[k] = torch.from_numpy(np.ascontiguousarray(v).copy())
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def read_weights(path: str | Path) -> dict[str, Any]:
    """A weight file by its format: a torch zip archive, else a Paddle pickle."""
    path = Path(path)
    return load_torch_file(path) if weight_file_format(path) == "torch" else load_pdparams(path)


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """A fastdet checkpoint through :func:`load_torch_file`; a missing file or one that is not
    a ``torch.save`` archive is named as a checkpoint that is not one."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is not a checkpoint: a folder, not a file")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not is_torch_file(path):
        if _starts_as_zip(path):
            raise ValueError(f"{path} is not a checkpoint: a zip archive that does not open (truncated or damaged)")
        raise ValueError(f"{path} is not a checkpoint: torch.save writes a zip archive and this "
                         "file is not one (corrupt, truncated or another format)")
    return load_torch_file(path, mmap=mmap)


def backbone_state(raw: Any, path: str | Path) -> tuple[dict[str, Any], bool]:
    """The weights a ``--backbone-weights`` file holds, and whether they are a detector's
    backbone (names as the model's own ``backbone``, ``backbone.`` stripped).

    A flat dict (an ImageNet file) is returned as it is. A full checkpoint gives its
    ``backbone.`` tensors: a fastdet one (its EMA weights when it has them, as
    :func:`select_weights`), or a ``{"model": ...}`` / ``{"state_dict": ...}`` wrapper (one
    without ``backbone.`` names is a plain state dict, returned whole). Anything but a dict
    is one ``ValueError`` line naming the file."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"--backbone-weights {path}: expected a dict of weights, found a {type(raw).__name__}")
    if isinstance(raw.get("config"), Mapping) and isinstance(raw.get("model"), Mapping):
        nested, which = select_weights(dict(raw))
        entry = f"a fastdet checkpoint, its {which} weights"
    else:
        key = next((k for k in ("model", "state_dict") if isinstance(raw.get(k), Mapping)), None)
        if key is None:
            return dict(raw), False
        nested, entry = raw[key], f"its {key!r} entry"
    ours = {k[len("backbone."):]: v for k, v in nested.items() if isinstance(k, str) and k.startswith("backbone.")}
    if not ours:
        return dict(nested), False
    log.info("backbone weights: the %d backbone tensors of %s (%s; %d others, the neck and head, not loaded)",
             len(ours), path, entry, len(nested) - len(ours))
    return ours, True


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
