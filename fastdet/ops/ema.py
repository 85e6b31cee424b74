"""Model EMA for the trainer: decay schedules as device tensors and one fused update.

Two flavours (``OptimConfig.ema_type``):

- ``"threshold"`` (PaddleDetection ``ModelEMA``, ``ema_decay_type='threshold'``):
  ``d_n = min(decay, (1 + n) / (10 + n))`` with ``n`` the number of updates done before
  this one (the first update uses ``n = 0``);
- ``"ramp"`` (YOLOX ``ModelEMA``): ``d_n = decay * (1 - exp(-n / tau))`` with ``n`` the
  update count including this one (``tau = 2000``).

The decay is computed from a device counter with tensor ops, so an update has no host
sync and can be captured in a CUDA graph or traced by ``torch.compile`` (a Python float
decay would be specialised: one recompile per value). The EMA weights live in a copy of
the model (``ema.module``, ``requires_grad`` off, eval mode), initialised from the model:
PaddleDetection starts from zeros and divides by ``1 - d^n`` when applying; under the
threshold schedule the initial weights' share ``prod d_k`` falls like ``n^-9``, so the
two agree after the first few hundred steps and the copy needs no correction.

Floating parameters and buffers (BatchNorm running stats included) are averaged; other
buffers (``num_batches_tracked``) are copied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from fastdet.ops import ema_update_

KINDS = ("threshold", "ramp")


def threshold_decay(n: Tensor, decay: float) -> Tensor:
    """PaddleDetection: ``min(decay, (1 + n) / (10 + n))``; ``n`` = updates done before this one."""
    n = n.to(torch.float64)
    return torch.clamp((1.0 + n) / (10.0 + n), max=decay)


def ramp_decay(n: Tensor, decay: float, tau: float = 2000.0) -> Tensor:
    """YOLOX: ``decay * (1 - exp(-n / tau))``; ``n`` = updates including this one."""
    return decay * (1.0 - torch.exp(-n.to(torch.float64) / tau))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


class ModelEMA:
    """Exponential moving average of a model's parameters and buffers.

    Args:
        model: the model to average (DDP / compiled wrappers are looked through).
        decay: the final decay (PP-YOLOE: 0.9998).
        kind: ``"threshold"`` or ``"ramp"`` (see the module docstring).
        tau: time constant of the ramp.

    ``update(model)`` runs under torch.compile and CUDA-graph capture (device tensors
    only). ``state_dict()`` is ``{"module": <EMA weights>, "updates": int, "decay": float,
    "kind": str}``; ``state_tensors()`` lists every tensor ``update`` writes.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9998, kind: str = "threshold", tau: float = 2000.0):
        if kind not in KINDS:
            raise ValueError(f"ModelEMA: kind must be one of {KINDS}, got {kind!r} (config field optim.ema_type)")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ModelEMA: decay must be in [0, 1), got {decay} (config field optim.ema_decay)")
        self.decay = float(decay)
        self.kind = kind
        self.tau = float(tau)
        src = unwrap_model(model)
        self.module = copy.deepcopy(src).eval()
        self.module.requires_grad_(False)
        device = next((t.device for t in src.parameters()), torch.device("cpu"))
        self.updates = torch.zeros((), dtype=torch.int64, device=device)
        # Static address for cudagraph trees: a plain tensor attribute is not a module buffer.
        torch._dynamo.mark_static_address(self.updates, guard=False)
        self._ema_tensors = self._tensors(self.module)

    @staticmethod
    def _tensors(module: nn.Module) -> list[Tensor]:
        return [p for p in module.parameters()] + [b for b in module.buffers()]

    def current_decay(self) -> Tensor:
        """The decay the next ``update`` will use, as a 0-d float32 tensor on the device."""
        if self.kind == "threshold":
            d = threshold_decay(self.updates, self.decay)
        else:
            d = ramp_decay(self.updates + 1, self.decay, self.tau)
        return d.to(torch.float32)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current weights into the average (one fused kernel)."""
        src = self._tensors(unwrap_model(model))
        if len(src) != len(self._ema_tensors):
            raise ValueError(f"ModelEMA.update: the model has {len(src)} parameters and buffers, the EMA "
                             f"{len(self._ema_tensors)}: pass the model the EMA was made from")
        ema_update_(self._ema_tensors, src, self.current_decay())
        self.updates.add_(1)

    def state_tensors(self) -> list[Tensor]:
        """Every tensor that ``update`` writes (for snapshots around CUDA-graph warm-up)."""
        return [*self._ema_tensors, self.updates]

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Restart the average from the model's current weights (e.g. after loading weights)."""
        for e, s in zip(self._ema_tensors, self._tensors(unwrap_model(model))):
            e.copy_(s)
        self.updates.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": int(self.updates), "decay": self.decay,
                "kind": self.kind}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "module" not in state:
            raise ValueError("ModelEMA.load_state_dict: checkpoint field 'ema' has no 'module' weights")
        self.module.load_state_dict(state["module"])
        self.updates.fill_(int(state.get("updates", 0)))
