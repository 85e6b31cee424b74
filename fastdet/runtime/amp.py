"""The numeric settings a run uses: the AMP dtype, and cuDNN's and cuBLAS's flags."""

from __future__ import annotations

from typing import Any

import torch


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """``auto``: bf16 on GPUs that support it, fp32 elsewhere; ``off`` -> None."""
    if amp == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        return torch.float16
    if amp == "off":
        return None
    raise ValueError(f"--amp: expected bf16, fp16, off or auto, got {amp!r}")


def backend_flags(device: torch.device, tf32: bool) -> dict[str, Any]:
    """Set cuDNN's and cuBLAS's flags as the trainer runs with them, and return them.

    On CUDA: cuDNN's per-shape autotuning on (the input sizes are a fixed set of buckets,
    so it pays off; it runs at each bucket's first, warm-up step) and TF32 only on request
    (``compile.tf32``: it changes results, a 10-bit mantissa in convolutions and matmuls).
    The trainer and the benchmarks both call this, so a benchmark's "fp32" is the trainer's.
    Inductor's cache key holds the matmul TF32 flag: a process that fills the cache for
    another one must set the same. On the CPU nothing is set (the flags are CUDA's)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = bool(tf32)
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    return {"set_for": device.type, "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
