"""Parameter groups, capturable momentum SGD and AdamW, and the registry of learning-rate schedules.

The optimizers keep each group's learning rate as a 0-d tensor on the training device
and do their update with foreach kernels only, so a step has no host sync and can be
replayed inside a CUDA graph: the schedule writes the new value with ``fill_`` before
each step. ``torch.optim.SGD`` cannot do that: with a tensor LR its eager foreach path
passes ``alpha=-lr`` to ``_foreach_add_``, which reads the tensor back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from fastdet.config import OptimConfig
from fastdet.ops.ema import ModelEMA

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def build_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decay / no-decay groups per LR multiplier.

    No weight decay on norm weights, biases and other 1-d parameters (PaddleDetection
    ``L2Decay`` as the seed ports it). A model may declare ``lr_multipliers()``
    returning ``{name_prefix: multiplier}`` for per-group learning rates.
    """
    mults: dict[str, float] = model.lr_multipliers() if hasattr(model, "lr_multipliers") else {}
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, _NORM_TYPES):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = not (id(p) in no_decay_ids or name.endswith(".bias") or p.ndim <= 1)
        mult = 1.0
        for prefix, m in mults.items():
            if name.startswith(prefix):
                mult = m
        groups.setdefault((decay, mult), []).append(p)
    return [
        {"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr_mult": mult}
        for (decay, mult), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))
    ]


class _DeviceLROptimizer(torch.optim.Optimizer):
    """Shared by the capturable optimizers: per-group LR tensors and state kept in place.

    ``group["lr"]`` is a 0-d float32 tensor on the training device holding
    ``base_lr * lr_mult``; :meth:`set_lr` rewrites it without a host sync. All state is
    allocated in ``__init__`` so that CUDA graphs see fixed addresses, and
    :meth:`load_state_dict` copies saved values into those same tensors.
    """

    def _init_lr(self, device: torch.device | str) -> None:
        for g in self.param_groups:
            g["lr"] = torch.tensor(float(g["lr"]) * g["lr_mult"], dtype=torch.float32, device=device)

    def set_lr(self, base_lr: float) -> None:
        """Write ``base_lr * lr_mult`` into each group's LR tensor (no sync)."""
        for g in self.param_groups:
            g["lr"].fill_(base_lr * g["lr_mult"])

    def load_state_dict(self, state_dict: dict) -> None:
        # Keep every state tensor (and its address) and copy the saved values into it.
        lrs = [g["lr"] for g in self.param_groups]
        saved = [g["lr"] for g in state_dict["param_groups"]]
        before = {id(p): dict(self.state[p]) for g in self.param_groups for p in g["params"]}
        super().load_state_dict(state_dict)
        for g, t, v in zip(self.param_groups, lrs, saved):
            t.copy_(torch.as_tensor(v, dtype=t.dtype))
            g["lr"] = t
        for g in self.param_groups:
            for p in g["params"]:
                for k, old in before[id(p)].items():
                    new = self.state[p].get(k)
                    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
                        old.copy_(new.to(device=old.device, dtype=old.dtype))
                        self.state[p][k] = old


class CapturableSGD(_DeviceLROptimizer):
    """SGD with momentum (PaddleDetection ``Momentum``: v = mu * v + g; p -= lr * v).

    L2 weight decay is added to the gradient (coupled, as Paddle's L2Decay and
    ``torch.optim.SGD``). ``group["lr"]`` is a 0-d device tensor; momentum buffers are
    created up front so that the state has fixed addresses for CUDA graphs.
    """

    def __init__(self, param_groups: list[dict], lr: float, momentum: float = 0.9,
                 nesterov: bool = False, device: torch.device | str = "cpu"):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0, lr_mult=1.0)
        super().__init__(param_groups, defaults)
        self._init_lr(device)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch.optim signature
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            if g["weight_decay"] != 0.0:
                grads = torch._foreach_add(grads, params, alpha=g["weight_decay"])
            torch._foreach_mul_(bufs, g["momentum"])
            torch._foreach_add_(bufs, grads)
            if g["nesterov"]:
                update = torch._foreach_add(grads, bufs, alpha=g["momentum"])
            else:
                update = bufs
            # p -= lr * update, with lr a device tensor (no host read).
            torch._foreach_sub_(params, torch._foreach_mul(update, g["lr"]))
        return None


class CapturableAdamW(_DeviceLROptimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) as ``torch.optim.AdamW``.

    The step count is a device tensor too, so the bias corrections are computed on
    the device and the update can be replayed in a CUDA graph. Preferred by short
    from-scratch schedules (Ultralytics picks it below ~10k iterations), where SGD
    needs far more steps to get going.
    """

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, device: torch.device | str = "cpu"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, lr_mult=1.0)
        super().__init__(param_groups, defaults)
        self._init_lr(device)
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st["step"] = torch.zeros((), dtype=torch.float32, device=device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch.optim signature
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            b1, b2 = g["betas"]
            grads = [p.grad for p in params]
            states = [self.state[p] for p in params]
            m = [st["exp_avg"] for st in states]
            v = [st["exp_avg_sq"] for st in states]
            # One step counter per group is enough (all its params step together);
            # each param keeps its own copy so state_dict matches torch's layout.
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1.0)
            t = steps[0]
            if g["weight_decay"] != 0.0:
                # p -= (lr * wd) * p, not p *= 1 - lr * wd: the float32 factor would round
                # lr * wd (~1e-6) to a multiple of 6e-8, several % of the decay.
                torch._foreach_sub_(params, torch._foreach_mul(params, g["lr"] * g["weight_decay"]))
            torch._foreach_lerp_(m, grads, 1.0 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1.0 - b2)
            # p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), all on the device.
            step_size = g["lr"] / (1.0 - torch.pow(b1, t))
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, torch.sqrt(1.0 - torch.pow(b2, t)))
            torch._foreach_add_(denom, g["eps"])
            update = torch._foreach_div(m, denom)
            torch._foreach_mul_(update, step_size)
            torch._foreach_sub_(params, update)
        return None


# optim.optimizer: what build_optimizer builds (the trainer's checks name them from here).
OPTIMIZERS = ("sgd", "adamw")


def build_optimizer(cfg: OptimConfig, model: nn.Module, lr: float,
                    device: torch.device | str) -> _DeviceLROptimizer:
    """``cfg.optimizer`` over :func:`build_param_groups` of ``model``."""
    groups = build_param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return CapturableSGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, device=device)
    if cfg.optimizer == "adamw":
        return CapturableAdamW(groups, lr=lr, betas=(cfg.momentum, cfg.beta2), device=device)
    raise ValueError(f"optim.optimizer: expected one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")


def build_optimizer_and_ema(cfg: OptimConfig, model: nn.Module, world_batch: int, device: torch.device,
                            fixed: Sequence[str] = ()) -> tuple[_DeviceLROptimizer, ModelEMA | None, float]:
    """The optimizer (LR scaled linearly by the global batch), the EMA, and that base LR.
    ``fixed``: the model's submodules that do not train (a frozen backbone), whose EMA is a
    copy (``ModelEMA(fixed=...)``); their parameters are left out of the optimizer by
    ``requires_grad``, which the caller has turned off."""
    base_lr = cfg.base_lr * world_batch / cfg.ref_batch
    optimizer = build_optimizer(cfg, model, base_lr, device)
    ema = ModelEMA(model, decay=cfg.ema_decay, kind=cfg.ema_type, fixed=fixed) if cfg.ema else None
    return optimizer, ema, base_lr


@dataclass(frozen=True)
class ScheduleArgs:
    """What a schedule function may read (steps are global optimizer steps)."""

    base_lr: float
    steps_per_epoch: int
    epochs: int
    cosine_epochs: int
    warmup: int  # steps
    start_factor: float
    min_lr_ratio: float
    no_aug_epochs: int
    milestones: tuple[int, ...]  # epochs
    gamma: float


def _linear_warmup(step: int, a: ScheduleArgs) -> float:
    """``start_factor`` of the LR at step 0, rising linearly to 1 at ``warmup`` (Paddle LinearWarmup)."""
    alpha = step / a.warmup
    return a.start_factor * (1 - alpha) + alpha


def cosine(step: int, a: ScheduleArgs) -> float:
    """PP-YOLOE: linear warm-up, then ``lr * 0.5 * (1 + cos(pi * step / (cosine_epochs *
    steps_per_epoch)))`` (PaddleDetection CosineDecay with ``max_epochs`` = cosine_epochs,
    which runs past the training length on purpose, so the LR never reaches 0)."""
    total = max(1, a.cosine_epochs * a.steps_per_epoch)
    if step < a.warmup:
        return a.base_lr * _linear_warmup(step, a)
    return a.base_lr * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))


def warmcos(step: int, a: ScheduleArgs) -> float:
    """YOLOX ``warmcos``: linear warm-up from ``start_factor * lr``, then cosine from the
    end of warm-up to 0 at the end of training."""
    total = a.epochs * a.steps_per_epoch
    if step < a.warmup:
        return a.base_lr * _linear_warmup(step, a)
    span = max(1, total - a.warmup)
    return a.base_lr * 0.5 * (1.0 + math.cos(math.pi * min(step - a.warmup, span) / span))


def quadratic_warmcos(step: int, a: ScheduleArgs) -> float:
    """Megvii YOLOX's ``yoloxwarmcos``: quadratic warm-up ``lr * (step / warmup)^2`` from 0, cosine
    down to ``min_lr_ratio * lr`` (YOLOX: 0.05), held there for the last ``no_aug_epochs``."""
    total = a.epochs * a.steps_per_epoch
    no_aug = a.no_aug_epochs * a.steps_per_epoch
    min_lr = a.base_lr * a.min_lr_ratio
    if step < a.warmup:
        return a.base_lr * (step / a.warmup) ** 2
    if step >= total - no_aug:
        return min_lr
    span = max(1, total - a.warmup - no_aug)
    return min_lr + 0.5 * (a.base_lr - min_lr) * (1.0 + math.cos(math.pi * (step - a.warmup) / span))


def piecewise(step: int, a: ScheduleArgs) -> float:
    """PaddleDetection LinearWarmup + PiecewiseDecay (PP-YOLO, FCOS): linear warm-up from
    ``start_factor * lr``, then ``lr * gamma^k`` with k the milestones (epochs) passed."""
    factor = _linear_warmup(step, a) if step < a.warmup else 1.0
    passed = sum(step >= m * a.steps_per_epoch for m in a.milestones)
    return a.base_lr * factor * a.gamma ** passed


# optim.schedule -> lr(step, args). A schedule is one small function of the global step.
SCHEDULES: dict[str, Callable[[int, ScheduleArgs], float]] = {
    "cosine": cosine,
    "warmcos": warmcos,
    "quadratic_warmcos": quadratic_warmcos,
    "piecewise": piecewise,
}


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a pure function of the global step: ``SCHEDULES[kind](step, args)``.

    The trainer writes the value into the optimizer's device LR tensors
    (``set_lr``, no recompile, no sync) before each step.
    """

    kind: str
    args: ScheduleArgs

    @classmethod
    def from_config(cls, cfg: OptimConfig, base_lr: float, steps_per_epoch: int) -> "LRSchedule":
        if cfg.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule: expected one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
        warmup = (round(cfg.warmup_epochs * steps_per_epoch) if cfg.warmup_epochs > 0
                  else cfg.warmup_steps)
        args = ScheduleArgs(base_lr, steps_per_epoch, cfg.epochs, cfg.cosine_epochs, warmup,
                            cfg.warmup_start_factor, cfg.min_lr_ratio, cfg.no_aug_epochs,
                            tuple(cfg.milestones), cfg.gamma)
        return cls(cfg.schedule, args)

    def __call__(self, step: int) -> float:
        return SCHEDULES[self.kind](step, self.args)
