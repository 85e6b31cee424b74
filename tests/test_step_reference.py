"""fastdet's train step against a plain hand-written loop, per family and recipe, on the CPU.

Every other CPU check of the step compares fastdet with itself (eager against compiled,
resumed against uninterrupted), so a wrong weight decay, warm-up, clipping, loss scaling
or optimizer/EMA order common to every path would pass them (issue 43, item 3). Here the
step is built as the trainer builds it (``registry.build_detector``,
``build_optimizer_and_ema``, ``LRSchedule.from_config``, ``TrainStep``) from each
family's published recipe and its demo recipe, and driven as the trainer's loop drives
it (``set_lr(schedule(step))``, then the step). The reference below calls the same
model's loss on a deep copy of the same weights and does everything after the backward
in plain per-tensor torch, written from the authors' definitions, never from fastdet's
helpers:

- parameter groups: Megvii ``get_optimizer`` (BN weights and biases without decay, other
  weights with it), which PaddleDetection's ``L2Decay(0.)`` on norm layers and biases
  agrees with; FCOS's tower conv biases at twice the LR (Paddle ``lr_scale`` 2);
- momentum SGD (``v = mu v + g + wd p``; ``p -= lr v``, or ``lr (g + wd p + mu v)`` with
  Nesterov, as ``torch.optim.SGD`` and Paddle ``Momentum``) and AdamW
  (``torch.optim.AdamW``'s documented algorithm);
- the warm-up LR at that step: Paddle ``LinearWarmup`` ``lr (f (1 - i / W) + i / W)``,
  Megvii ``yolox_warm_cos_lr`` ``lr (i / W)^2``;
- gradient clipping over the global norm of all trained gradients (Paddle
  ``ClipGradByGlobalNorm``; ``torch.nn.utils.clip_grad_norm_(model.parameters())`` in
  Ultralytics, which the demo's AdamW-with-clipping follows);
- the fp16 ``GradScaler`` (loss times 2^16, gradients divided back, a step with a
  non-finite gradient skipped and the scale halved; the EMA still folds the weights in,
  as Megvii's and Paddle's trainers call it every iteration);
- the EMA after the optimizer step with its decay at that update: Paddle ``ModelEMA``
  ``min(d, (1 + n) / (10 + n))`` (from zeros, read divided by ``1 - d^n``, for
  PP-YOLO's ``paddle`` flavour; from the weights for ``threshold``), Megvii ``ModelEMA``
  ``d (1 - exp(-n / 2000))`` with n counted after the increment.

The model is float64 (the losses cast to float32 inside, identically on both sides), so
the two sides differ by the rounding of fastdet's float32 device scalars: measured, per
tensor and relative to the change a step made, at most 2e-7 with SGD, 1e-5 with AdamW
(its bias corrections), 1e-5 for the EMA. Three steps from the middle of the warm-up: the
second one has a planted infinite gradient.

YOLOX's published step is also run against Megvii's own iteration, with Megvii's
``LRScheduler`` and ``ModelEMA`` (``test_yolox_step_matches_megvii_iteration``).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fastdet import registry
from fastdet.data.layout import TARGET_KEYS
from fastdet.engine.optim import LRSchedule, build_optimizer_and_ema
from fastdet.engine.step import TrainStep, synthetic_batch

FAMILIES = {"ppyoloe": "s", "ppyolo": "r18vd", "yolox": "nano", "fcos": "r50"}
CPU = torch.device("cpu")
BATCH, SIZE, MAX_BOXES = 2, 32, 8
STEPS_PER_EPOCH = 100  # what the loader's length would give; sets YOLOX's warm-up (5 epochs)
INF_STEP = 1  # of the three steps, the one whose gradient gets an inf
SCALE0 = 2.0**16  # torch.amp.GradScaler's init_scale
# ||fastdet - reference|| / ||reference - start|| after a step, per tensor. fastdet's LR
# and EMA decay are float32 device tensors: 6e-8 relative rounding of the LR, and of d in
# the EMA's change (1 - d) (p - e), 6e-8 d / (1 - d) (1.3e-5 at PP-YOLO's d = 0.9955);
# its AdamW takes the bias corrections from a float32 step tensor, as torch's capturable
# AdamW does: 1 - 0.999 is off by 1.3e-5 there.
TOL = {"sgd": 1e-6, "adamw": 3e-5, "ema": 3e-5}


# --------------------------------------------------------------------------- the recipe

def recipe_config(arch: str, which: str):
    """``arch``'s published recipe or its demo recipe, 4 classes."""
    cfg = registry.get_preset(arch, FAMILIES[arch])
    if which == "demo":
        from fastdet.config import apply_overrides

        cfg = registry.resolve(apply_overrides(cfg, registry.demo_overrides(arch)))
        # The demo clips at 10, which these small batches' gradients stay under for some
        # families (FCOS: ~4); clipping at 1 exercises it in every family.
        cfg = replace(cfg, optim=replace(cfg.optim, clip_grad_norm=1.0))
    return replace(cfg, model=replace(cfg.model, num_classes=4))


def published_warmup_lr(cfg, step: int) -> float:
    """The authors' warm-up at global step ``step`` (inside the warm-up), LR scaled
    linearly by the global batch as both codebases do."""
    o = cfg.optim
    lr = o.base_lr * BATCH / o.ref_batch
    if o.schedule == "quadratic_warmcos":  # Megvii yolox_warm_cos_lr, warmup_lr_start 0
        w = o.warmup_epochs * STEPS_PER_EPOCH
        assert step <= w
        return lr * (step / w) ** 2
    w = o.warmup_steps  # Paddle LinearWarmup: value[i] for boundary i
    assert step < w and o.schedule in ("cosine", "piecewise")
    alpha = step / w
    return lr * (o.warmup_start_factor * (1 - alpha) + alpha)


def reference_groups(model: nn.Module, arch: str) -> list[tuple[nn.Parameter, bool, float]]:
    """(parameter, weight decay on, LR multiplier) for every trained parameter."""
    out = []
    norms = (nn.BatchNorm2d, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm)
    for mod_name, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            decay = pname == "weight" and isinstance(m, (nn.Conv2d, nn.Linear)) and not isinstance(m, norms)
            tower_bias = (arch == "fcos" and pname == "bias" and isinstance(m, nn.Conv2d)
                          and re.fullmatch(r"head\.(cls|reg)_tower\.\d+", mod_name) is not None)
            out.append((p, decay, 2.0 if tower_bias else 1.0))
    return out


# --------------------------------------------------------------------------- the reference

class ReferenceEMA:
    """Paddle's and Megvii's ModelEMA over the floating parameters and buffers."""

    def __init__(self, model: nn.Module, cfg, updates: int):
        self.kind, self.decay, self.n = cfg.optim.ema_type, cfg.optim.ema_decay, updates
        zero = self.kind == "paddle"  # Paddle ModelEMA: paddle.zeros_like(v)
        self.avg = {k: (torch.zeros_like(v) if zero else v.detach().clone())
                    for k, v in model.state_dict().items() if v.is_floating_point()}
        self.last = None

    def d(self) -> float:
        if self.kind == "ramp":  # Megvii: self.updates += 1; d = decay * (1 - exp(-updates / 2000))
            return self.decay * (1 - math.exp(-(self.n + 1) / 2000))
        return min(self.decay, (1 + self.n) / (10 + self.n))  # Paddle 'threshold', step before += 1

    def update(self, model: nn.Module) -> None:
        d = self.d()
        sd = model.state_dict()
        for k, v in self.avg.items():
            v.mul_(d).add_((1 - d) * sd[k].detach())
        self.n += 1
        self.last = d

    def read(self) -> dict[str, Tensor]:
        """Paddle ``apply``: ``v / (1 - d_last^n)`` for its flavour; the average otherwise."""
        if self.kind != "paddle":
            return self.avg
        return {k: v / (1 - self.last**self.n) for k, v in self.avg.items()}


class ReferenceStep:
    """The recipe's step as plain per-tensor torch over a copy of the model."""

    def __init__(self, model: nn.Module, cfg, arch: str, updates: int):
        self.model, self.o = model, cfg.optim
        self.groups = reference_groups(model, arch)
        self.state: dict[int, dict[str, Any]] = {}
        for p, _, _ in self.groups:
            self.state[id(p)] = ({"buf": torch.zeros_like(p)} if self.o.optimizer == "sgd" else
                                 {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
        self.ema = ReferenceEMA(model, cfg, updates) if self.o.ema else None
        self.scale = SCALE0
        self.clipped = []  # per step: the global norm exceeded the limit

    def __call__(self, images: Tensor, targets: dict[str, Tensor], kw: dict, lr: float) -> dict[str, Tensor]:
        for p, _, _ in self.groups:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.float16):  # as TrainStep's fp16 (no-op on float64)
            losses = self.model(images, targets, **kw)
        (losses["total_loss"] * self.scale).backward()
        grads = {id(p): p.grad / self.scale for p, _, _ in self.groups}
        finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
        if self.o.clip_grad_norm > 0:
            total = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
            self.clipped.append(finite and total > self.o.clip_grad_norm)
            coef = min(1.0, self.o.clip_grad_norm / (total + 1e-6))
            grads = {k: g * coef for k, g in grads.items()}
        if finite:
            with torch.no_grad():
                for p, decay, mult in self.groups:
                    self._update(p, grads[id(p)], lr * mult, self.o.weight_decay if decay else 0.0)
        else:
            self.scale *= 0.5  # GradScaler backoff_factor; growth only after 2000 good steps
        if self.ema is not None:
            self.ema.update(self.model)
        return losses

    def _update(self, p: Tensor, g: Tensor, lr: float, wd: float) -> None:
        st = self.state[id(p)]
        if self.o.optimizer == "sgd":
            g = g + wd * p
            st["buf"] = self.o.momentum * st["buf"] + g
            p -= lr * (g + self.o.momentum * st["buf"] if self.o.nesterov else st["buf"])
            return
        b1, b2, eps = self.o.momentum, self.o.beta2, 1e-8
        st["t"] += 1
        t = st["t"]
        p *= 1 - lr * wd
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * g * g
        m_hat, v_hat = st["m"] / (1 - b1**t), st["v"] / (1 - b2**t)
        p -= lr * m_hat / (v_hat.sqrt() + eps)


# --------------------------------------------------------------------------- the test

def batches(n: int) -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        b = synthetic_batch(BATCH, SIZE, SIZE, MAX_BOXES, CPU, gen)
        b["images"] = b["images"].double()
        out.append(b)
    return out


def plant_inf(p: nn.Parameter, armed: list[bool]):
    """A gradient hook that makes one element of ``p``'s gradient infinite while armed."""
    def hook(g: Tensor) -> Tensor:
        if not armed[0]:
            return g
        g = g.clone()
        g.view(-1)[0] = float("inf")
        return g
    return p.register_hook(hook)


def rel_diff(got: list[Tensor], want: list[Tensor], start: list[Tensor]) -> float:
    """max over tensors of ||got - want|| / ||want - start||: the disagreement relative to
    the change made, tensor by tensor (a wrong rule for BatchNorm weights alone shows
    even where other tensors' changes are far larger). A change below 1e-9 of the
    tensor's norm counts as 1e-9 of it: float64 rounding (1e-16) is not a change to
    compare with."""
    worst, changed = 0.0, False
    for g, w, s in zip(got, want, start):
        num = float(torch.linalg.vector_norm((g.detach() - w.detach()).double()))
        den = float(torch.linalg.vector_norm((w.detach() - s.detach()).double()))
        floor = 1e-9 * float(torch.linalg.vector_norm(w.detach().double()))
        changed |= den > floor
        worst = max(worst, num / max(den, floor) if max(den, floor) > 0 else (0.0 if num == 0 else math.inf))
    assert changed, "the steps changed nothing: the comparison would prove nothing"
    return worst


def optimizer_state(step: TrainStep, ref: ReferenceStep, arch: str) -> dict[str, tuple[list[Tensor], list[Tensor]]]:
    """fastdet's and the reference's optimizer state, tensor for tensor, by name."""
    ps = [p for p, _, _ in reference_groups(step.model, arch)]
    st = step.optimizer.state
    names = ({"momentum_buffer": "buf"} if ref.o.optimizer == "sgd" else {"exp_avg": "m", "exp_avg_sq": "v"})
    return {k: ([st[p][k] for p in ps], [ref.state[id(q)][rk] for q, _, _ in ref.groups]) for k, rk in names.items()}


def ema_tensors(step: TrainStep, ref: ReferenceStep, read: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """fastdet's EMA (raw average, or as read) and the reference's, by state-dict key."""
    mod = step.ema.averaged() if read else step.ema.module
    got = mod.state_dict()
    want = ref.ema.read() if read else ref.ema.avg
    return [got[k] for k in want], list(want.values())


def clone(ts: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in ts]


def check_step(arch: str, which: str) -> dict[str, float]:
    """Three steps of fastdet and of the reference; returns the largest relative difference
    of each kind of state over the steps (asserting each step's)."""
    cfg = recipe_config(arch, which)
    torch.manual_seed(0)
    model = registry.build_detector(cfg).double().train()
    ref_model = copy.deepcopy(model)
    optimizer, ema, base_lr = build_optimizer_and_ema(cfg.optim, model, BATCH, CPU)
    schedule = LRSchedule.from_config(cfg.optim, base_lr, STEPS_PER_EPOCH)
    step = TrainStep(model, model, optimizer, ema, CPU, torch.float16, clip_grad_norm=cfg.optim.clip_grad_norm)
    warmup = (round(cfg.optim.warmup_epochs * STEPS_PER_EPOCH) if cfg.optim.warmup_epochs > 0
              else cfg.optim.warmup_steps)
    first = warmup // 2  # mid warm-up, where an off-by-one step changes the LR
    if ema is not None:
        ema.updates.fill_(first)  # as a run resumed at `first` has it
    ref = ReferenceStep(ref_model, cfg, arch, first)
    assert (ema is None) == (ref.ema is None)
    kw = registry.phase(cfg, 0).loss_kwargs
    armed = [False]
    hooks = [plant_inf(next(p for p in m.parameters() if p.requires_grad), armed) for m in (model, ref_model)]
    errs: dict[str, float] = {}

    def record(name: str, got, want, start) -> None:
        errs[name] = max(errs.get(name, 0.0), rel_diff(got, want, start))

    lrs = []
    for i, batch in enumerate(batches(3)):
        g = first + i  # the trainer's global step
        armed[0] = i == INF_STEP
        # The losses are float32 inside, and assignment (SimOTA's dynamic k, ATSS, top-k)
        # is discontinuous in the weights: two trajectories that differ by the rounding of
        # a float32 LR part by more than rounding a step later. Each step therefore starts
        # the reference from fastdet's weights; optimizer state and EMA stay its own.
        ref_model.load_state_dict(model.state_dict())
        p_before = clone(list(model.parameters()))
        opt_before = ({k: clone(v[0]) for k, v in optimizer_state(step, ref, arch).items()}
                      if i == INF_STEP else None)
        ema_before = clone(ema_tensors(step, ref)[0]) if ema is not None else None
        optimizer.set_lr(schedule(g))
        torch.manual_seed(100 + i)  # PP-YOLO's DropBlock draws the same masks on both sides
        step(batch, kw)
        lrs.append(published_warmup_lr(cfg, g))
        torch.manual_seed(100 + i)
        ref(batch["images"], {k: batch[k] for k in TARGET_KEYS}, kw, lrs[-1])
        assert step.scaler.get_scale() == ref.scale
        if i == INF_STEP:  # skipped: weights and optimizer state as they were, the scale halved
            assert ref.scale == SCALE0 / 2
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), p_before))
            for k, (got, _) in optimizer_state(step, ref, arch).items():
                assert all(torch.equal(a, b) for a, b in zip(got, opt_before[k])), k
        else:
            record("params", list(model.parameters()), list(ref_model.parameters()), p_before)
            for k, (got, want) in optimizer_state(step, ref, arch).items():
                record(k, got, want, [torch.zeros_like(w) for w in want])
        if ema is not None:
            record("ema", *ema_tensors(step, ref), ema_before)
            assert int(ema.updates) == ref.ema.n == g + 1
    if ema is not None:
        got, want = ema_tensors(step, ref, read=True)
        record("ema_read", got, want, [torch.zeros_like(w) for w in want])
    if cfg.optim.optimizer == "adamw":  # the skipped step did not count
        assert {float(s["step"]) for s in optimizer.state.values()} == {2.0}
    for h in hooks:
        h.remove()
    assert 0 < lrs[0] < lrs[-1], lrs  # inside the warm-up, rising
    if cfg.optim.clip_grad_norm > 0:
        assert any(ref.clipped), "no step's gradient norm reached the clipping limit: it went untested"
    return errs


@pytest.mark.parametrize("which", ["published", "demo"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_step_matches_a_plain_loop(arch, which):
    errs = check_step(arch, which)
    print(arch, which, {k: f"{v:.1e}" for k, v in errs.items()})
    for k, v in errs.items():
        assert v < TOL["ema" if k.startswith("ema") else recipe_config(arch, which).optim.optimizer], (k, errs)


def test_yolox_step_matches_megvii_iteration():
    """YOLOX's published step against Megvii's trainer iteration (yolox/core/trainer.py
    ``train_one_iter``: zero_grad, GradScaler scale/backward/step/update, ``ModelEMA.update``,
    the LR of ``LRScheduler.update_lr``), run with Megvii's own ``LRScheduler`` and
    ``ModelEMA`` (installed by the Makefile, so a missing one fails) and the torch SGD and
    GradScaler it builds. The parameter groups are ``Exp.get_optimizer``'s, restated:
    its module needs ``tabulate``, which the project does not install."""
    from test_convert import authors_module  # tests/ is on sys.path (rootdir conftest)

    megvii = authors_module("yolox.utils")
    cfg = recipe_config("yolox", "published")
    o = cfg.optim
    torch.manual_seed(0)
    model = registry.build_detector(cfg).double().train()
    ref_model = copy.deepcopy(model)
    optimizer, ema, base_lr = build_optimizer_and_ema(o, model, BATCH, CPU)
    schedule = LRSchedule.from_config(o, base_lr, STEPS_PER_EPOCH)
    step = TrainStep(model, model, optimizer, ema, CPU, torch.float16)
    first = round(o.warmup_epochs * STEPS_PER_EPOCH) // 2
    ema.updates.fill_(first)

    pg0, pg1, pg2 = [], [], []  # BN weights; other weights (decay); biases
    for _, v in ref_model.named_modules():
        if hasattr(v, "bias") and isinstance(v.bias, nn.Parameter):
            pg2.append(v.bias)
        if isinstance(v, nn.BatchNorm2d):
            pg0.append(v.weight)
        elif hasattr(v, "weight") and isinstance(v.weight, nn.Parameter):
            pg1.append(v.weight)
    lr = o.base_lr * BATCH / o.ref_batch  # Megvii: basic_lr_per_img * batch_size
    ref_opt = torch.optim.SGD(pg0, lr=lr, momentum=o.momentum, nesterov=True)
    ref_opt.add_param_group({"params": pg1, "weight_decay": o.weight_decay})
    ref_opt.add_param_group({"params": pg2})
    ref_sched = megvii.LRScheduler("yoloxwarmcos", lr, STEPS_PER_EPOCH, o.epochs, warmup_epochs=o.warmup_epochs,
                                   warmup_lr_start=0, no_aug_epochs=o.no_aug_epochs, min_lr_ratio=o.min_lr_ratio)
    ref_ema = megvii.ModelEMA(ref_model, o.ema_decay, updates=first)
    scaler = torch.amp.GradScaler("cpu")
    assert sorted(map(id, pg0 + pg1 + pg2)) == sorted(id(p) for p in ref_model.parameters())

    kw = registry.phase(cfg, 0).loss_kwargs
    armed = [False]
    hooks = [plant_inf(next(iter(m.parameters())), armed) for m in (model, ref_model)]
    errs: dict[str, float] = {}
    for i, batch in enumerate(batches(3)):
        g = first + i
        armed[0] = i == INF_STEP
        ref_model.load_state_dict(model.state_dict())  # why: see check_step
        p_before = clone(list(model.parameters()))
        ema_before = clone(list(ema.module.state_dict().values()))
        optimizer.set_lr(schedule(g))
        torch.manual_seed(100 + i)
        step(batch, kw)
        for pg in ref_opt.param_groups:  # set after iteration g - 1 as update_lr(progress_in_iter + 1)
            pg["lr"] = ref_sched.update_lr(g)
        torch.manual_seed(100 + i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref_model(batch["images"], {k: batch[k] for k in TARGET_KEYS}, **kw)["total_loss"]
        ref_opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_ema.update(ref_model)
        assert step.scaler.get_scale() == scaler.get_scale() == (SCALE0 / 2 if i >= INF_STEP else SCALE0)
        if i != INF_STEP:
            errs["params"] = max(errs.get("params", 0.0),
                                 rel_diff(list(model.parameters()), list(ref_model.parameters()), p_before))
            bufs = [ref_opt.state[q]["momentum_buffer"] for q in ref_model.parameters()]
            errs["momentum"] = max(errs.get("momentum", 0.0), rel_diff(
                [optimizer.state[p]["momentum_buffer"] for p in model.parameters()], bufs,
                [torch.zeros_like(b) for b in bufs]))
        else:
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), p_before))
        want = ref_ema.ema.state_dict()
        got = ema.module.state_dict()
        keys = [k for k, v in want.items() if v.is_floating_point()]
        before = dict(zip(got, ema_before))
        errs["ema"] = max(errs.get("ema", 0.0), rel_diff([got[k] for k in keys], [want[k] for k in keys],
                                                         [before[k] for k in keys]))
    for h in hooks:
        h.remove()
    assert int(ema.updates) == ref_ema.updates == first + 3
    print("yolox vs Megvii", {k: f"{v:.1e}" for k, v in errs.items()})
    assert errs["params"] < TOL["sgd"] and errs["momentum"] < TOL["sgd"] and errs["ema"] < TOL["ema"], errs
