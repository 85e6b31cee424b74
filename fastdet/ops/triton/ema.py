"""Fused EMA update in Triton: one launch over a pointer table of every floating tensor.

``ema[i] = lerp(ema[i], src[i], 1 - decay)`` (torch's two-sided lerp formula) for
floating tensors; other tensors (BatchNorm counters) are copied with one
``torch._foreach_copy_``. The decay is read from a device tensor inside the kernel, so
the launch can be captured in a CUDA graph with a decay that changes every step.

The pointer table (data pointers, sizes and the program -> (tensor, offset) map) is
built on the device once per set of tensors and cached under their data pointers:
building it is a host -> device copy, which must not happen inside a captured region,
so warm up once before capturing. The cache holds the tables only (never the tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastdet.ops.triton._common import NAMESPACE, check_device

BLOCK = 4096
_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


@triton.jit
def _ema_kernel(dst_ptrs, src_ptrs, numels, blk_tensor, blk_start, decay_ptr, DTYPE: tl.constexpr,
                ACC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(blk_tensor + pid)
    start = tl.load(blk_start + pid)
    n = tl.load(numels + t)
    dst = tl.load(dst_ptrs + t).to(tl.pointer_type(DTYPE))
    src = tl.load(src_ptrs + t).to(tl.pointer_type(DTYPE))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(decay_ptr)
    w = (1.0 - d).to(ACC)  # 1 - decay in the decay's dtype, as the reference's `1.0 - decay`
    e = tl.load(dst + offs, mask=mask).to(ACC)
    s = tl.load(src + offs, mask=mask).to(ACC)
    r = tl.where(tl.abs(w) < 0.5, e + w * (s - e), s - (s - e) * (1.0 - w))
    tl.store(dst + offs, r.to(DTYPE), mask=mask)


class _Table:
    """Device tables for one group of same-dtype tensors."""

    def __init__(self, ema: list[Tensor], src: list[Tensor]):
        device = ema[0].device
        numels = [e.numel() for e in ema]
        blk_tensor, blk_start = [], []
        for i, n in enumerate(numels):
            for s in range(0, n, BLOCK):
                blk_tensor.append(i)
                blk_start.append(s)
        self.dst = torch.tensor([e.data_ptr() for e in ema], dtype=torch.int64, device=device)
        self.src = torch.tensor([s.data_ptr() for s in src], dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.blk_tensor = torch.tensor(blk_tensor, dtype=torch.int32, device=device)
        self.blk_start = torch.tensor(blk_start, dtype=torch.int64, device=device)
        self.blocks = len(blk_tensor)
        self.dtype = ema[0].dtype


def same_dense_layout(a: Tensor, b: Tensor) -> bool:
    """Both one dense block of memory with the elements in the same order (contiguous,
    channels-last, any same permutation): the kernel reads each as ``numel`` flat
    elements from ``data_ptr``. Strides of size-1 dims do not change the layout."""
    if a.shape != b.shape or any(sa != sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1):
        return False
    expected = 1  # the dims of size > 1, innermost first, must tile memory without gaps
    for stride, n in sorted((st, n) for n, st in zip(a.shape, a.stride()) if n > 1):
        if stride != expected:
            return False
        expected *= n
    return True


_cache: dict[tuple, list] = {}
_CACHE_MAX = 8


def _plan(ema: list[Tensor], src: list[Tensor]) -> list:
    """Groups by dtype -> [(_Table | None, fallback jobs, copy lists)] cached by data pointers."""
    key = tuple((e.data_ptr(), s.data_ptr(), e.numel(), e.dtype, s.dtype) for e, s in zip(ema, src))
    plan = _cache.get(key)
    if plan is not None:
        return plan
    groups: dict[torch.dtype, tuple[list, list]] = {}
    slow, copy_dst, copy_src = [], [], []
    for e, s in zip(ema, src):
        if e.shape != s.shape:
            raise ValueError(f"fastdet.ops.ema_update_: EMA tensor of shape {tuple(e.shape)} paired with a "
                             f"model tensor of shape {tuple(s.shape)}")
        if not e.is_floating_point():
            copy_dst.append(e)
            copy_src.append(s)
        elif e.dtype == s.dtype and e.dtype in _TL_DTYPES and same_dense_layout(e, s) and e.numel() > 0:
            groups.setdefault(e.dtype, ([], []))
            groups[e.dtype][0].append(e)
            groups[e.dtype][1].append(s)
        elif e.numel() > 0:
            slow.append((e, s))
    tables = [_Table(es, ss) for es, ss in groups.values()]
    plan = [tables, slow, (copy_dst, copy_src)]
    if len(_cache) >= _CACHE_MAX:
        _cache.pop(next(iter(_cache)))
    _cache[key] = plan
    return plan


@torch.library.custom_op(f"{NAMESPACE}::ema_update_", mutates_args=("ema",))
def ema_update_(ema: list[Tensor], src: list[Tensor], decay: Tensor) -> None:
    if len(ema) != len(src):
        raise ValueError(f"fastdet.ops.ema_update_: {len(ema)} EMA tensors but {len(src)} model tensors")
    if not ema:
        return
    check_device("ema_update_", decay, *ema[:1], *src[:1])
    tables, slow, (copy_dst, copy_src) = _plan(ema, src)
    d = decay.reshape(())
    if d.dtype not in (torch.float32, torch.float64):
        d = d.float()
    for tb in tables:
        acc = tl.float64 if tb.dtype == torch.float64 else tl.float32
        _ema_kernel[(tb.blocks,)](tb.dst, tb.src, tb.numels, tb.blk_tensor, tb.blk_start, d,
                                  DTYPE=_TL_DTYPES[tb.dtype], ACC=acc, BLOCK=BLOCK)
    for e, s in slow:
        e.lerp_(s.to(e.dtype), (1.0 - d).to(e.dtype))
    if copy_dst:
        torch._foreach_copy_(copy_dst, copy_src)


@ema_update_.register_fake
def _ema_update_fake(ema: list[Tensor], src: list[Tensor], decay: Tensor) -> None:
    return None
