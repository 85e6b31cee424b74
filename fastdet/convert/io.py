"""Reading the authors' weight files without running code from them.

A pickle can call any importable function while it loads (``__reduce__``). Paddle's
``.pdparams`` is a pickle of ``{structured name: numpy array}``, so it goes through
:class:`_NumpyOnlyUnpickler`, which resolves only numpy's array reconstruction, dtypes
and plain containers and refuses anything else before calling it; torch files load
with ``torch.load(weights_only=True)``. Both return ``{name: torch.Tensor}`` plus the
non-tensor entries the caller may want to name (e.g. a trainer's ``start_epoch``).
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch


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
            import _codecs

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


def load_torch_file(path: str | Path) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers only."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise UnsafeWeightsError(f"{path}: refused: it needs code to unpickle, not just tensors and containers "
                                 f"({first})") from None
    except Exception as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {first})") from None


def is_torch_file(path: str | Path) -> bool:
    """``torch.save`` writes a zip archive (a legacy non-zip torch file is read as a pickle)."""
    return zipfile.is_zipfile(path)


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
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if is_torch_file(path):
        return load_torch_file(path)
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] != b"\x80":
        raise ValueError(f"{path}: neither a torch.save archive nor a pickle (.pdparams)")
    return load_pdparams(path)


__all__ = ["UnsafeWeightsError", "load_pdparams", "load_torch_file", "read_weights", "to_tensors", "is_torch_file"]
