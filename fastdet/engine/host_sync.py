"""A CPU stand-in for "this step would fail a CUDA-graph capture or ``--sync-debug``".

A CUDA graph refuses, and ``torch.cuda.set_sync_debug_mode("error")`` rejects, two kinds
of operation inside a training step: a tensor made from host data on the device (a
pageable host-to-device copy: ``torch.tensor(list, device=dev)``, ``t_host.to(dev)``)
and a device value read back to the host (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool(t)``, ``int(t)``, and the ops that size their output from data:
``nonzero``, boolean indexing, ``masked_select``, ``unique``...). On a machine without
a GPU neither fails, so nothing would show them before a GPU run.

:class:`HostSyncGuard` records them on any device: a ``TorchFunctionMode`` sees the
Python-level calls (tensor creation from host data with an explicit ``device=`` of the
step's device, copies of host-made tensors to that device, read-backs of its tensors)
and a ``TorchDispatchMode`` the data-dependent ATen ops (``_local_scalar_dense``, which
every ``.item()``/``bool()`` reaches, ``nonzero``, ``masked_select``, boolean
``index``/``index_put_``...). Tensors made from host data without a device (CPU
constants, which a CUDA kernel takes as scalars) are remembered as host tensors, and
reading them is not a sync.

On the CPU the step's device *is* the host, so ``t.to("cpu")`` of a step tensor cannot be
told from a no-op move and is not flagged; ``.cpu()``, ``.numpy()``, ``.tolist()`` and
``.item()`` are. Use after warm-up (first calls may legitimately build tables)::

    with HostSyncGuard(device) as guard:
        step(batch, kw)
    assert not guard.violations, guard.report()
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

_CREATORS = {torch.tensor, torch.as_tensor, torch.asarray}
_READBACKS = {Tensor.item: "item()", Tensor.tolist: "tolist()", Tensor.cpu: "cpu()", Tensor.numpy: "numpy()",
              Tensor.__bool__: "bool(tensor)", Tensor.__int__: "int(tensor)", Tensor.__float__: "float(tensor)",
              Tensor.__index__: "index(tensor)"}
_aten = torch.ops.aten
# Ops that read device data on the host to size their output, or read a scalar back.
_SYNC_OPS = {
    _aten._local_scalar_dense.default: "a device scalar read on the host (.item(), bool(), int(), float())",
    _aten.nonzero.default: "nonzero (output sized from the data)",
    _aten.masked_select.default: "masked_select (output sized from the data)",
    _aten.is_nonzero.default: "is_nonzero (a device value read on the host)",
    _aten.equal.default: "torch.equal (a device value read on the host)",
    _aten._unique2.default: "unique (output sized from the data)",
    _aten.unique_consecutive.default: "unique_consecutive (output sized from the data)",
    _aten.unique_dim.default: "unique (output sized from the data)",
    _aten.repeat_interleave.Tensor: "repeat_interleave without output_size (output sized from the data)",
}
_BOOL_INDEXED = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                 _aten._index_put_impl_.default}


@dataclass
class Violation:
    what: str
    where: str  # the innermost frames of fastdet code that made the call

    def __str__(self) -> str:
        return f"{self.what}\n{self.where}"


def _same(device, ref: torch.device) -> bool:
    if device is None:
        return False
    d = torch.device(device)
    return d.type == ref.type and (d.index is None or ref.index is None or d.index == ref.index)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _skipped_frame(filename: str) -> bool:
    stdlib = "/lib/python3" in filename and "site-packages" not in filename
    return (filename.startswith(_TORCH_DIR) or stdlib or "/_pytest/" in filename or "/pluggy/" in filename
            or filename.endswith("host_sync.py"))


def _caller() -> str:
    """The innermost frames of the code that made the call (torch and other installed
    packages left out): the model, loss or op that needs fixing."""
    frames = [f for f in traceback.extract_stack()[:-3] if not _skipped_frame(f.filename)]
    return "".join(traceback.format_list(frames[-3:])).rstrip() or "(unknown)"


class _FunctionGuard(TorchFunctionMode):
    def __init__(self, owner: "HostSyncGuard"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self.owner
        if func in _CREATORS:
            out = func(*args, **kwargs)
            data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
            if not isinstance(data, Tensor):
                if _same(kwargs.get("device"), g.device):
                    g._flag(f"torch.{func.__name__}(<host data>, device={kwargs['device']}): a host-to-device "
                            "copy (make it once outside the step, or with torch.full/arange on the device)")
                elif isinstance(out, Tensor):
                    g.host.setdefault(out, True)
            return out
        if func in _READBACKS:
            t = args[0]
            if isinstance(t, Tensor) and _same(t.device, g.device) and t not in g.host:
                g._flag(f"tensor.{_READBACKS[func]} on {t.device}: a device value read back to the host")
                g._reported = True  # its aten._local_scalar_dense is the same read-back
                try:
                    return func(*args, **kwargs)
                finally:
                    g._reported = False
        elif func is Tensor.to or func is Tensor.cuda:
            t = args[0]
            if isinstance(t, Tensor) and t in g.host:
                if func is Tensor.cuda:
                    target = torch.device("cuda")
                else:
                    target = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
                if _same(target, g.device):
                    g._flag(f"a tensor made from host data moved to {target} with .{func.__name__}(): "
                            "a host-to-device copy")
        elif func is Tensor.copy_:
            dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(src, Tensor) and src in g.host and _same(dst.device, g.device) and dst not in g.host:
                g._flag(f"copy_ of a tensor made from host data into a {dst.device} tensor: a host-to-device copy")
        return func(*args, **kwargs)


class _DispatchGuard(TorchDispatchMode):
    def __init__(self, owner: "HostSyncGuard"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self.owner
        first = args[0] if args else None
        on_device = isinstance(first, Tensor) and _same(first.device, g.device) and first not in g.host
        if on_device and func in _SYNC_OPS and not g._reported:
            g._flag(f"aten.{func.__name__}: {_SYNC_OPS[func]}")
        elif on_device and func in _BOOL_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                g._flag(f"aten.{func.__name__} with a boolean mask (runs nonzero: output sized from the data)")
        return func(*args, **kwargs)


class HostSyncGuard:
    """Records every host sync and host-to-device copy on ``device`` while active.

    ``violations``: what was seen, each with the fastdet frames that made it;
    ``report()``: them as text. ``strict=True`` raises at the first one instead.
    """

    def __init__(self, device: torch.device | str, strict: bool = False):
        self.device = torch.device(device)
        self.strict = strict
        self.violations: list[Violation] = []
        self.host = WeakIdKeyDictionary()
        self._reported = False
        self._modes = (_FunctionGuard(self), _DispatchGuard(self))

    def _flag(self, what: str) -> None:
        v = Violation(what, _caller())
        self.violations.append(v)
        if self.strict:
            raise RuntimeError(f"host sync in the step: {v}")

    def report(self) -> str:
        seen: dict[str, int] = {}
        for v in self.violations:
            seen[str(v)] = seen.get(str(v), 0) + 1
        return "\n".join(f"[{n}x] {s}" for s, n in seen.items())

    def __enter__(self) -> "HostSyncGuard":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
