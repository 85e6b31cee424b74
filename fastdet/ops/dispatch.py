"""The one place that chooses the back end of every fastdet op, per device type.

Back ends: ``triton`` (Triton kernels: CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``), ``cuda`` (the CUDA kernels of the ``csrc/`` extension), ``cpp``
(its C++ CPU kernels) and ``torch`` (``fastdet/ops/reference.py`` and
``fastdet/ops/assigners.py``; under ``torch.compile`` inductor compiles and fuses it).

Defaults (``DEFAULTS``): the faster path measured by ``bench/kernels.py`` for each op and
device, separately for eager code and for code traced by ``torch.compile`` (where the
reference is compiled, so a kernel has to beat the *compiled* reference to be used).

Overrides, strongest first:

- ``set_backend(name, device_type=None, op=None)`` (or the ``use_backend`` context manager);
- ``FASTDET_OPS_BACKEND``: a back end name for every device it can serve (``torch``,
  ``cpp``, ``cuda``, ``triton``), or a comma list of ``device=name`` and
  ``device:op=name`` entries, e.g. ``cuda=triton,cuda:task_aligned_assign=cuda``.

An override that cannot serve a device (``cpp`` for CUDA tensors) is ignored there; one
that is unavailable (no compiler, no triton) falls back to the default chain with one
warning. The choice is made while tracing (it is a constant to ``torch.compile``), so set
overrides before compiling.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from typing import Iterator, Optional

import torch

from fastdet.ops import _ext

log = logging.getLogger(__name__)

BACKENDS = ("triton", "cuda", "cpp", "torch")
OPS = ("box_iou", "generalized_box_iou", "giou_loss", "ema_update_", "task_aligned_assign", "atss_assign",
       "yolo_targets", "fcos_assign", "simota_assign")

# Which back ends can run tensors of each device type, in fallback order.
_SERVES = {"cpu": ("cpp", "triton", "torch"), "cuda": ("triton", "cuda", "torch")}

# The ops each back end has a kernel for (``torch`` has every op). An op asked of a back
# end without its kernel runs on the next back end of the chain that has one, says so once,
# and is reported as what ran (``describe``, the benchmarks' JSON).
KERNELS: dict[str, frozenset[str]] = {
    "triton": frozenset(OPS) - {"yolo_targets"},
    "cuda": frozenset(OPS),
    "cpp": frozenset(OPS),
    "torch": frozenset(OPS),
}

# Defaults, from bench/kernels.py. Keys: (device_type, compiling) -> op -> back end.
# CPU (bench/results/kernels_cpu_1thread_2026-12-02.json; a shared 2-core machine, 1
# thread, B=8 M=100 A=8400 C=80): every C++ kernel beats the inductor-compiled reference
# (box_iou 12x, generalized_box_iou 17x, giou_loss fwd+bwd 1.3x, EMA 1.7x, task-aligned
# 9x, ATSS 8x, at 1/10 of the reference's peak memory), so ``cpp`` is the default in
# eager and compiled code alike.
# fcos_assign (2026-12-03_cpu-amd-epyc_torch-2.14.1-cu130_kernels-fcos.json; B=16 M=100
# A=22400, 1 thread): C++ 4.2x the compiled reference, peak 5.5 MB (its outputs) against
# 1025 MB for the eager reference and 40 MB compiled.
# simota_assign (2026-12-03_cpu-amd-epyc_torch-2.14.1-cu130_kernels-simota.json; B=64
# M=100 A=8400 C=80, 2 threads): C++ 1.35 s, 8.1x the reference, 3.5x the compiled
# reference and 24x a per-image loop like Megvii's, at 9 MB peak against 2.8 GB (1.5 GB
# compiled). In a YOLOX-s step (320 px, batch 8, 30 boxes per image; ..._kernels-simota-
# step.json) the C++ assignment is 0.9 % of the step, the reference 2.3 %, the loop 13.7 %.
DEFAULTS: dict[tuple[str, bool], dict[str, str]] = {
    ("cpu", False): {
        "box_iou": "cpp",
        "generalized_box_iou": "cpp",
        "giou_loss": "cpp",
        "ema_update_": "cpp",
        "task_aligned_assign": "cpp",
        "atss_assign": "cpp",
        "yolo_targets": "cpp",
        "fcos_assign": "cpp",
        "simota_assign": "cpp",
    },
    ("cpu", True): {
        "box_iou": "cpp",
        "generalized_box_iou": "cpp",
        "giou_loss": "cpp",
        "ema_update_": "cpp",
        "task_aligned_assign": "cpp",
        "atss_assign": "cpp",
        "yolo_targets": "cpp",
        "fcos_assign": "cpp",
        "simota_assign": "cpp",
    },
    # Not measured yet (no GPU was lent when these were set): the GPU kernels are the
    # default until ``bench/kernels.py --device cuda`` says otherwise. The CUDA EMA needs
    # no warm-up before CUDA-graph capture (its table travels in the kernel parameters);
    # the CUDA assigners select top-k in registers in one pass over the anchors.
    ("cuda", False): {
        "box_iou": "triton",
        "generalized_box_iou": "triton",
        "giou_loss": "triton",
        "ema_update_": "cuda",
        "task_aligned_assign": "cuda",
        "atss_assign": "cuda",
        "yolo_targets": "cuda",
        "fcos_assign": "cuda",
        "simota_assign": "torch",
    },
    ("cuda", True): {
        "box_iou": "triton",
        "generalized_box_iou": "triton",
        "giou_loss": "triton",
        "ema_update_": "cuda",
        "task_aligned_assign": "cuda",
        "atss_assign": "cuda",
        "yolo_targets": "cuda",
        "fcos_assign": "cuda",
        "simota_assign": "torch",
    },
}

# (device_type or None, op or None) -> back end; None matches every device / op.
_overrides: dict[tuple[Optional[str], Optional[str]], str] = {}
_env_overrides: dict[tuple[Optional[str], Optional[str]], str] = {}
_warned: set[tuple[str, ...]] = set()
_resolved: dict[tuple[str, str, bool], str] = {}


def _parse_env(value: str) -> dict[tuple[Optional[str], Optional[str]], str]:
    out: dict[tuple[Optional[str], Optional[str]], str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, _, name = item.rpartition("=")
        device, _, op = key.partition(":")
        if name not in BACKENDS:
            raise ValueError(f"FASTDET_OPS_BACKEND: unknown back end {name!r} in {value!r} (one of {BACKENDS})")
        if device and device not in _SERVES:
            raise ValueError(f"FASTDET_OPS_BACKEND: unknown device type {device!r} in {value!r} (cpu or cuda)")
        if op and op not in OPS:
            raise ValueError(f"FASTDET_OPS_BACKEND: unknown op {op!r} in {value!r} (one of {OPS})")
        out[(device or None, op or None)] = name
    return out


def _load_env() -> None:
    _env_overrides.clear()
    _env_overrides.update(_parse_env(os.environ.get("FASTDET_OPS_BACKEND", "")))


_load_env()


def set_backend(name: Optional[str], device_type: Optional[str] = None, op: Optional[str] = None) -> None:
    """Force back end ``name`` (None: remove the override) for a device type and/or op."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"fastdet.ops.set_backend: unknown back end {name!r} (one of {BACKENDS})")
    if device_type is not None and device_type not in _SERVES:
        raise ValueError(f"fastdet.ops.set_backend: unknown device type {device_type!r} (cpu or cuda)")
    if op is not None and op not in OPS:
        raise ValueError(f"fastdet.ops.set_backend: unknown op {op!r} (one of {OPS})")
    if name is None:
        _overrides.pop((device_type, op), None)
    else:
        _overrides[(device_type, op)] = name
    _resolved.clear()


@contextlib.contextmanager
def use_backend(name: str, device_type: Optional[str] = None, op: Optional[str] = None) -> Iterator[None]:
    """Context manager form of :func:`set_backend` (restores the previous override)."""
    key = (device_type, op)
    previous = _overrides.get(key)
    set_backend(name, device_type, op)
    try:
        yield
    finally:
        set_backend(previous, device_type, op)


def _requested(op: str, device_type: str) -> Optional[str]:
    for table in (_overrides, _env_overrides):
        for key in ((device_type, op), (None, op), (device_type, None), (None, None)):
            name = table.get(key)
            if name is not None and name in _SERVES.get(device_type, ("torch",)):
                return name
    return None


def triton_usable(device_type: str) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    if device_type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return device_type == "cuda"


def has_kernel(name: str, op: str) -> bool:
    """Whether back end ``name`` implements ``op`` at all."""
    return op in KERNELS.get(name, ())


def available(name: str, device_type: str, op: Optional[str] = None) -> bool:
    """Whether back end ``name`` can run now on ``device_type`` (may build the extension),
    and, given ``op``, has a kernel for it."""
    if op is not None and not has_kernel(name, op):
        return False
    if name == "torch":
        return True
    if name not in _SERVES.get(device_type, ()):
        return False
    if name == "triton":
        if not triton_usable(device_type):
            return False
        import fastdet.ops.triton  # noqa: F401  (optional triton; importing it registers the fastdet_triton ops)

        return True
    if not _ext.load():
        return False
    return name == "cpp" or _ext.has_cuda_kernels()


@torch.compiler.assume_constant_result
def backend_for(op: str, device_type: str, compiling: bool = False) -> str:
    """The back end that runs ``op`` on tensors of ``device_type``.

    ``compiling`` is ``torch.compiler.is_compiling()`` at the call site. To
    ``torch.compile`` the answer is a constant computed while tracing.
    """
    key = (op, device_type, compiling)
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    requested = _requested(op, device_type)
    default = DEFAULTS.get((device_type, compiling), {}).get(op, "torch")
    chain = [b for b in (requested, default, *_SERVES.get(device_type, ())) if b is not None]
    chosen = "torch"
    for name in chain:
        if available(name, device_type, op):
            chosen = name
            break
    if requested is not None and chosen != requested and not has_kernel(requested, op):
        if (requested, device_type, op) not in _warned:
            _warned.add((requested, device_type, op))
            log.warning("fastdet.ops: %s has no %r kernel; it runs on %r on %s", op, requested, chosen,
                        device_type)
    elif requested is not None and chosen != requested and (requested, device_type) not in _warned:
        _warned.add((requested, device_type))
        log.warning("fastdet.ops: back end %r is unavailable on %s, using %r", requested, device_type, chosen)
    if requested is None and chosen != default and (default, device_type) not in _warned:
        # Not silent: on a GPU this is usually a failed extension build, and the fallback
        # is what the benchmarks measure and what CUDA graphs capture.
        _warned.add((default, device_type))
        log.warning("fastdet.ops: the default back end %r of %s on %s is unavailable (%s); using %r "
                    "for it and every op whose default is %r", default, op, device_type,
                    _unavailable_reason(default), chosen, default)
    _resolved[key] = chosen
    return chosen


def _unavailable_reason(name: str) -> str:
    if name == "triton":
        return "triton is not installed" if importlib.util.find_spec("triton") is None else "triton cannot run here"
    if _ext.error() is not None:
        return f"the extension did not build: {_ext.error()}"
    return f"the extension was built without CUDA kernels (variant {_ext.variant()!r})"


def fallbacks(device_type: str) -> dict[str, tuple[str, str]]:
    """Ops on ``device_type`` that run on another back end than their default although
    nothing asked for one: op -> (default, chosen), in eager or compiled code."""
    out: dict[str, tuple[str, str]] = {}
    for compiling in (False, True):
        for op in OPS:
            default = DEFAULTS.get((device_type, compiling), {}).get(op, "torch")
            chosen = backend_for(op, device_type, compiling)
            if _requested(op, device_type) is None and chosen != default:
                out[op] = (default, chosen)
    return out


def require_defaults(device_type: str, flag: str) -> None:
    """Raise if an op would silently fall back from its default back end (see ``fallbacks``):
    ``flag`` is the option that needs the defaults, e.g. ``--cuda-graphs``."""
    fb = fallbacks(device_type)
    if fb:
        default, chosen = next(iter(fb.values()))
        ops = ", ".join(f"{op} on {c!r} instead of {d!r}" for op, (d, c) in fb.items())
        raise ValueError(
            f"{flag}: {ops} ({_unavailable_reason(default)}); rebuild with "
            f"`python -m fastdet.ops.build`, or name the back end in FASTDET_OPS_BACKEND "
            f"(e.g. {device_type}={chosen}) to accept it")


def describe(device_type: str) -> dict[str, str]:
    """Op -> chosen back end in eager code on ``device_type`` (for logs and reports)."""
    return {op: backend_for(op, device_type, False) for op in OPS}
