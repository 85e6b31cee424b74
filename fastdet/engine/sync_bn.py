"""SyncBatchNorm that torch.compile can trace: statistics combined through functional collectives.

``torch.nn.SyncBatchNorm`` takes a ``ProcessGroup`` and calls the eager ``torch.distributed``
API, which Dynamo cannot trace (pytorch #107372, #156680, #161302): under ``--compile`` a
model with it graph-breaks, and ``fullgraph=True`` refuses it. :class:`FunctionalSyncBatchNorm`
computes the same thing with ordinary tensor ops around one
``torch.distributed._functional_collectives`` all-gather, which Dynamo traces into the
graph (``_c10d_functional.all_gather_into_tensor``) and autograd differentiates (its
backward is a reduce-scatter), so the step stays one graph with 0 breaks; on NCCL the
collective is a kernel that a CUDA graph captures. It works with gloo on the CPU.

Training forward, per channel ``c`` (``x`` [N, C, *spatial]):

- each rank ``r``: ``n_r`` = elements per channel, ``mean_r`` [C], ``m2_r`` [C] = sum of
  squared deviations from ``mean_r`` (not the raw sum of squares, which cancels badly in
  fp32 when the mean is large);
- one all-gather of ``[n_r, mean_r, m2_r]`` ([2C + 1] per rank -> [W, 2C + 1]);
- combined (Chan et al.'s parallel variance): ``n = sum n_r``,
  ``mean = sum n_r mean_r / n``, ``m2 = sum (m2_r + n_r (mean_r - mean)^2)``,
  ``var = m2 / n`` (biased, normalises the batch), ``m2 / (n - 1)`` (unbiased) into
  ``running_var``, as ``nn.SyncBatchNorm`` does;
- ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

Ranks may hold different batch sizes (each rank's count is gathered). Momentum ``None``
is the cumulative average (factor ``1 / num_batches_tracked``), as in torch. In eval mode
(or without running statistics and not training) it is plain ``F.batch_norm``. With one
process (no group) the gather is skipped and it is ``nn.BatchNorm`` in training too.

The state dict (``weight``, ``bias``, ``running_mean``, ``running_var``,
``num_batches_tracked``) is ``nn.BatchNorm2d``'s, so checkpoints load into plain models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

try:  # torch >= 2.6 names it so; the older name warns outside compile
    from torch.distributed._functional_collectives import all_gather_single_autograd as _gather
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as _gather


class FunctionalSyncBatchNorm(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` (it accepts any ``x`` [N, C, ...]) whose training statistics are
    those of the batch over every rank of ``group`` (see the module docstring).

    ``group``: a process group name (``ProcessGroup.group_name``; a string, which Dynamo
    treats as a constant), or None for a single process.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, group: str | None = None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.group = group

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()  # statistics in fp32 under autocast, as cuDNN's BatchNorm keeps them
        n_local = x.numel() // c
        mean_r = xf.mean(dims)
        m2_r = (xf - _channel(mean_r, x.dim())).square().sum(dims)
        if self.group is not None:
            count = torch.full((1,), float(n_local), dtype=torch.float32, device=x.device)
            local = torch.cat([count, mean_r, m2_r])  # [2C + 1]
            gathered = _gather(local, 0, self.group).view(-1, 2 * c + 1)  # [W, 2C + 1]
            counts, means, m2s = gathered[:, :1], gathered[:, 1:c + 1], gathered[:, c + 1:]
            n = counts.sum()
            mean = (counts * means).sum(0) / n
            m2 = (m2s + counts * (means - mean).square()).sum(0)
        else:
            n = torch.tensor(float(n_local), device=x.device)
            mean, m2 = mean_r, m2_r
        var = m2 / n
        if self.training and self.track_running_stats:
            self._update_running(mean, m2, n)
        invstd = torch.rsqrt(var + self.eps)
        y = (xf - _channel(mean, x.dim())) * _channel(invstd, x.dim())
        if self.affine:
            y = y * _channel(self.weight, x.dim()) + _channel(self.bias, x.dim())
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean: Tensor, m2: Tensor, n: Tensor) -> None:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            factor = 1.0 / self.num_batches_tracked.to(torch.float32)
        else:
            factor = self.momentum
        unbiased = m2 / (n - 1).clamp(min=1)
        self.running_mean.mul_(1 - factor).add_(factor * mean.detach())
        self.running_var.mul_(1 - factor).add_(factor * unbiased.detach())


def _channel(t: Tensor, ndim: int) -> Tensor:
    """[C] -> [1, C, 1, ...] to broadcast over an ``ndim``-d input."""
    return t.view(1, -1, *([1] * (ndim - 2)))


def convert_sync_batchnorm(module: nn.Module, group: str | None = None) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` (and ``nn.SyncBatchNorm``) in ``module`` by a
    :class:`FunctionalSyncBatchNorm` holding the *same* parameter and buffer tensors, in
    place; returns ``module`` (or the replacement when ``module`` is one). An optimizer or
    EMA built on the module keeps working: nothing is copied. ``group`` defaults to the
    default process group when one is up with more than one rank.
    """
    if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.group.WORLD.group_name
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, FunctionalSyncBatchNorm):
        new = FunctionalSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                      module.track_running_stats, group=group)
        # Re-point the new module at the old tensors (same names, same order).
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(new, name, p)
        for name, b in list(module.named_buffers(recurse=False)):
            new._buffers[name] = b
        new.train(module.training)
        return new
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, group)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
