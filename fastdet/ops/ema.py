"""Model EMA for the trainer: a registry of decay flavours as device tensors, one fused update.

Flavours (``OptimConfig.ema_type``, :data:`EMA_FLAVOURS`), each a decay function of the
number ``n`` of updates done before this one, plus how the average starts and is read:

- ``"threshold"``: PaddleDetection's decay ``d_n = min(decay, (1 + n) / (10 + n))``,
  the average started from the model's weights and read as is (PP-YOLOE here);
- ``"paddle"``: PaddleDetection ``ModelEMA`` exactly: the same decay, the average
  started from zeros and read divided by ``1 - d_last^n`` (``d_last`` the decay of the
  last update: ppdet/optimizer/ema.py ``apply``). This is not the exact debiasing
  ``1 - prod d_k``: with the threshold decay ``prod d_k`` is ~0 after a few updates
  while ``d_last^n`` stays large for thousands of steps, so the read weights are scaled
  up (by 1 / (1 - 0.9998^n): 1.58 at n = 5000); kept as Paddle does it;
- ``"ramp"``: YOLOX ``ModelEMA``, ``d_n = decay * (1 - exp(-(n + 1) / tau))`` (``tau``
  2000), started from the model.

The decay is computed from a device counter with tensor ops, so an update has no host
sync and can be captured in a CUDA graph or traced by ``torch.compile`` (a Python float
decay would be specialised: one recompile per value). The average lives in a copy of
the model (``ema.module``, ``requires_grad`` off, eval mode); :meth:`ModelEMA.averaged`
is the module as it is read (evaluation, checkpoints).

Floating parameters and buffers (BatchNorm running stats included) are averaged; other
buffers (``num_batches_tracked``) are copied. The tensors of the submodules named ``fixed``
(a frozen backbone: ``model.freeze_backbone``) do not change in training, and their EMA is
the tensor itself: taken from the model when the average starts (or is loaded), never
averaged, zeroed or debiased (an average of a constant drifts by rounding, and the
``"paddle"`` flavour's debiasing would rescale it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from fastdet.ops import ema_update_
from fastdet.runtime.checkpoint import unwrap_model


def threshold_decay(n: Tensor, decay: float) -> Tensor:
    """PaddleDetection: ``min(decay, (1 + n) / (10 + n))``; ``n`` = updates done before this one."""
    n = n.to(torch.float64)
    return torch.clamp((1.0 + n) / (10.0 + n), max=decay)


def ramp_decay(n: Tensor, decay: float, tau: float = 2000.0) -> Tensor:
    """YOLOX: ``decay * (1 - exp(-n / tau))``; ``n`` = updates including this one."""
    return decay * (1.0 - torch.exp(-n.to(torch.float64) / tau))


@dataclass(frozen=True)
class EMAFlavour:
    """``decay(n, d, tau) -> d_n`` (float64 0-d tensor; ``n`` updates done before this one);
    ``zero_init``: the average starts from zeros, not the model; ``debias``: it is read
    divided by ``1 - d_last^n``."""

    decay: Callable[[Tensor, float, float], Tensor]
    zero_init: bool = False
    debias: bool = False


EMA_FLAVOURS: dict[str, EMAFlavour] = {
    "threshold": EMAFlavour(lambda n, d, tau: threshold_decay(n, d)),
    "paddle": EMAFlavour(lambda n, d, tau: threshold_decay(n, d), zero_init=True, debias=True),
    "ramp": EMAFlavour(lambda n, d, tau: ramp_decay(n + 1, d, tau)),
}
KINDS = tuple(EMA_FLAVOURS)


class ModelEMA:
    """Exponential moving average of a model's parameters and buffers.

    Args:
        model: the model to average (DDP / compiled wrappers are looked through).
        decay: the final decay (PP-YOLOE: 0.9998).
        kind: a name in :data:`EMA_FLAVOURS` (see the module docstring).
        tau: time constant of the ramp.
        fixed: names of the model's submodules that do not train (``"backbone"``): their
            parameters and buffers are copied from the model once, not averaged.

    ``update(model)`` runs under torch.compile and CUDA-graph capture (device tensors
    only). ``state_dict()`` is ``{"module": <EMA weights as read>, "updates": int,
    "decay": float, "kind": str}``, plus ``"average"`` (the raw average) for a debiased
    flavour; ``state_tensors()`` lists every tensor ``update`` writes.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9998, kind: str = "threshold", tau: float = 2000.0,
                 fixed: Sequence[str] = ()):
        if kind not in EMA_FLAVOURS:
            raise ValueError(f"ModelEMA: kind must be one of {KINDS}, got {kind!r} (config field optim.ema_type)")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ModelEMA: decay must be in [0, 1), got {decay} (config field optim.ema_decay)")
        self.decay = float(decay)
        self.kind = kind
        self.flavour = EMA_FLAVOURS[kind]
        self.tau = float(tau)
        src = unwrap_model(model)
        for name in fixed:
            try:
                src.get_submodule(name)
            except AttributeError:
                raise ValueError(f"ModelEMA: the model has no submodule {name!r} to keep fixed") from None
        self.module = copy.deepcopy(src).eval()
        self.module.requires_grad_(False)
        # Per tensor of _tensors(model): averaged (True) or a fixed submodule's (False).
        names = [n for n, _ in src.named_parameters()] + [n for n, _ in src.named_buffers()]
        self._averaged = [not any(n.startswith(f + ".") for f in fixed) for n in names]
        device = next((t.device for t in src.parameters()), torch.device("cpu"))
        self.updates = torch.zeros((), dtype=torch.int64, device=device)
        # Static address for cudagraph trees: a plain tensor attribute is not a module buffer.
        torch._dynamo.mark_static_address(self.updates, guard=False)
        self._all_tensors = self._tensors(self.module)
        self._ema_tensors = self._only_averaged(self._all_tensors)  # what update writes
        self._debiased: nn.Module | None = None
        if self.flavour.zero_init:
            self._zero_floats()

    @staticmethod
    def _tensors(module: nn.Module) -> list[Tensor]:
        return [p for p in module.parameters()] + [b for b in module.buffers()]

    def _only_averaged(self, tensors: list[Tensor]) -> list[Tensor]:
        return [t for t, avg in zip(tensors, self._averaged) if avg]

    @torch.no_grad()
    def _zero_floats(self) -> None:
        for t in self._ema_tensors:
            if t.is_floating_point():
                t.zero_()

    def current_decay(self) -> Tensor:
        """The decay the next ``update`` will use, as a 0-d float32 tensor on the device."""
        return self.flavour.decay(self.updates, self.decay, self.tau).to(torch.float32)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current weights into the average (one fused kernel)."""
        src = self._tensors(unwrap_model(model))
        if len(src) != len(self._all_tensors):
            raise ValueError(f"ModelEMA.update: the model has {len(src)} parameters and buffers, the EMA "
                             f"{len(self._all_tensors)}: pass the model the EMA was made from")
        ema_update_(self._ema_tensors, self._only_averaged(src), self.current_decay())
        self.updates.add_(1)

    def state_tensors(self) -> list[Tensor]:
        """Every tensor that ``update`` writes (for snapshots around CUDA-graph warm-up)."""
        return [*self._ema_tensors, self.updates]

    @torch.no_grad()
    def averaged(self) -> nn.Module:
        """The EMA weights as they are read (evaluation, checkpoints): ``module`` itself, or
        for a debiased flavour a copy of it divided by ``1 - d_last^n`` (host-side, not in
        the training step)."""
        n = int(self.updates)
        if not self.flavour.debias or n == 0:
            return self.module
        d_last = float(self.flavour.decay(self.updates - 1, self.decay, self.tau))
        scale = 1.0 / (1.0 - d_last ** n)
        if self._debiased is None:
            self._debiased = copy.deepcopy(self.module)
        for dst, src, avg in zip(self._tensors(self._debiased), self._all_tensors, self._averaged):
            dst.copy_(src * scale if avg and src.is_floating_point() else src)
        return self._debiased

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Restart the average (e.g. after loading weights): from the model's current
        weights, or from zeros for a zero-initialised flavour."""
        for e, s in zip(self._all_tensors, self._tensors(unwrap_model(model))):
            e.copy_(s)
        if self.flavour.zero_init:
            self._zero_floats()
        self.updates.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = {"module": self.averaged().state_dict(), "updates": int(self.updates), "decay": self.decay,
                 "kind": self.kind}
        if self.flavour.debias:
            state["average"] = self.module.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "module" not in state:
            raise ValueError("ModelEMA.load_state_dict: checkpoint field 'ema' has no 'module' weights")
        kind = state.get("kind", self.kind)
        if kind != self.kind:
            raise ValueError(f"ModelEMA.load_state_dict: the checkpoint's EMA is {kind!r}, this run's "
                             f"optim.ema_type is {self.kind!r}")
        self.module.load_state_dict(state.get("average", state["module"]))
        self.updates.fill_(int(state.get("updates", 0)))
