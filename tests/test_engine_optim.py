"""Optimizer, parameter groups, LR schedules and checkpoints of the engine."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from fastdet.config import OptimConfig
from fastdet.runtime.checkpoint import (load_checkpoint, load_weights_tolerant, rng_state,
                                       save_checkpoint, set_rng_state, unwrap_model)
from fastdet.engine.optim import (SCHEDULES, CapturableAdamW, CapturableSGD, LRSchedule, build_optimizer,
                                  build_optimizer_and_ema, build_param_groups)


class Net(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, classes)
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x = self.gn(self.bn(self.conv(x))).mean((2, 3))
        return self.head(x) * self.alpha


def test_param_groups_no_decay_on_norm_and_bias():
    net = Net()
    groups = build_param_groups(net, 5e-4)
    decay = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decay == {id(net.conv.weight), id(net.head.weight)}
    assert no_decay == {id(p) for n, p in net.named_parameters()} - decay
    assert sum(len(g["params"]) for g in groups) == len(list(net.parameters()))


def test_param_groups_lr_multipliers():
    net = Net()
    net.lr_multipliers = lambda: {"head.": 2.0}
    groups = build_param_groups(net, 1e-4)
    mult = {id(p): g["lr_mult"] for g in groups for p in g["params"]}
    assert mult[id(net.head.weight)] == 2.0 and mult[id(net.head.bias)] == 2.0
    assert mult[id(net.conv.weight)] == 1.0


@pytest.mark.parametrize("nesterov", [False, True])
def test_capturable_sgd_matches_torch_sgd(nesterov):
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    ours = CapturableSGD(build_param_groups(a, 5e-4), lr=0.1, momentum=0.9, nesterov=nesterov)
    ref = torch.optim.SGD(build_param_groups(b, 5e-4), lr=0.1, momentum=0.9, nesterov=nesterov)
    for step in range(5):
        lr = 0.1 * (0.5 ** step)
        ours.set_lr(lr)
        for g in ref.param_groups:
            g["lr"] = lr * g["lr_mult"]
        x = torch.randn(4, 3, 8, 8)
        for net, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_capturable_sgd_state_dict_round_trip_keeps_lr_tensors():
    net = Net()
    opt = CapturableSGD(build_param_groups(net, 5e-4), lr=0.1)
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    opt.set_lr(0.05)
    sd = opt.state_dict()
    net2 = Net()
    net2.load_state_dict(net.state_dict())
    opt2 = CapturableSGD(build_param_groups(net2, 5e-4), lr=0.1)
    lr_tensor = opt2.param_groups[0]["lr"]
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] is lr_tensor  # same tensor: CUDA graphs keep its address
    assert float(lr_tensor) == pytest.approx(0.05)
    for p, p2 in zip(net.parameters(), net2.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], opt2.state[p2]["momentum_buffer"])


def _mlp() -> nn.Module:
    # No bias before a norm here: such a bias has a ~0 gradient, where Adam's
    # m / (sqrt(v) + eps) amplifies rounding differences into O(lr) ones.
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def test_capturable_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    a, b = _mlp(), _mlp()
    b.load_state_dict(a.state_dict())
    ours = CapturableAdamW(build_param_groups(a, 0.05), lr=0.01, betas=(0.9, 0.99))
    ref = torch.optim.AdamW(build_param_groups(b, 0.05), lr=0.01, betas=(0.9, 0.99), foreach=False)
    for step in range(6):
        lr = 0.01 * (0.7 ** step)
        ours.set_lr(lr)
        for g in ref.param_groups:
            g["lr"] = lr * g["lr_mult"]
        x = torch.randn(4, 6)
        for net, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(ours.state[pa]["exp_avg_sq"], ref.state[pb]["exp_avg_sq"])


def test_capturable_adamw_resume_keeps_state_tensors_and_continues_identically():
    torch.manual_seed(1)
    nets = [Net() for _ in range(3)]
    for n in nets[1:]:
        n.load_state_dict(nets[0].state_dict())
    opts = [build_optimizer(OptimConfig(optimizer="adamw", weight_decay=0.01), n, 0.01, "cpu") for n in nets]
    xs = [torch.randn(2, 3, 8, 8) for _ in range(4)]

    def run(net, opt, batches):
        for x in batches:
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()

    run(nets[0], opts[0], xs)  # uninterrupted
    run(nets[1], opts[1], xs[:2])  # two steps, then "resume" into nets[2]/opts[2]
    nets[2].load_state_dict(nets[1].state_dict())
    exp_avg = opts[2].state[next(nets[2].parameters())]["exp_avg"]
    opts[2].load_state_dict(opts[1].state_dict())
    assert opts[2].state[next(nets[2].parameters())]["exp_avg"] is exp_avg
    run(nets[2], opts[2], xs[2:])
    for pa, pb in zip(nets[0].parameters(), nets[2].parameters()):
        torch.testing.assert_close(pa, pb)


def test_build_optimizer_rejects_unknown_name():
    with pytest.raises(ValueError, match="optim.optimizer"):
        build_optimizer(OptimConfig(optimizer="lamb"), Net(), 0.1, "cpu")


def test_cosine_schedule_matches_paddle_formula():
    cfg = OptimConfig(schedule="cosine", epochs=300, cosine_epochs=360, warmup_steps=100,
                      warmup_start_factor=0.001)
    s = LRSchedule.from_config(cfg, base_lr=0.04, steps_per_epoch=50)
    assert s(0) == pytest.approx(0.04 * 0.001)
    assert s(50) == pytest.approx(0.04 * (0.001 * 0.5 + 0.5))
    t = 1000
    assert s(t) == pytest.approx(0.04 * 0.5 * (1 + math.cos(math.pi * t / (360 * 50))))
    # cosine over 360 epochs: at the end of 300 the LR is still above zero
    assert s(300 * 50) > 0.04 * 0.06


def _yolox_warm_cos_lr(lr, min_lr_ratio, total_iters, warmup_total_iters, warmup_lr_start, no_aug_iter, iters):
    """YOLOX yolox/utils/lr_scheduler.py yolox_warm_cos_lr, restated."""
    min_lr = lr * min_lr_ratio
    if iters <= warmup_total_iters:
        return (lr - warmup_lr_start) * (iters / warmup_total_iters) ** 2 + warmup_lr_start
    if iters >= total_iters - no_aug_iter:
        return min_lr
    return min_lr + 0.5 * (lr - min_lr) * (
        1 + math.cos(math.pi * (iters - warmup_total_iters) / (total_iters - warmup_total_iters - no_aug_iter)))


def _yolox_warm_cos(lr, total_iters, warmup_total_iters, warmup_lr_start, iters):
    """YOLOX warm_cos_lr, restated."""
    if iters <= warmup_total_iters:
        return (lr - warmup_lr_start) * iters / warmup_total_iters + warmup_lr_start
    return lr * 0.5 * (1 + math.cos(math.pi * (iters - warmup_total_iters) / (total_iters - warmup_total_iters)))


def _paddle_piecewise(base_lr, warmup, start_factor, milestones, gamma, spe, step):
    """PaddleDetection LinearWarmup + PiecewiseDecay: the boundary/value lists they build,
    read as paddle.optimizer.lr.PiecewiseDecay does (values[number of boundaries <= step])."""
    boundary, value = [], []
    for i in range(warmup + 1):
        alpha = i / warmup
        value.append(base_lr * (start_factor * (1 - alpha) + alpha))
        if i > 0:
            boundary.append(i)
    boundary += [spe * m for m in milestones]
    value += [base_lr * gamma ** (k + 1) for k in range(len(milestones))]
    return value[sum(step >= b for b in boundary)]


def test_schedule_registry_names():
    assert set(SCHEDULES) == {"cosine", "warmcos", "quadratic_warmcos", "piecewise"}


def test_quadratic_warmcos_schedule_matches_megvii_yoloxwarmcos():
    """YOLOX-s: 300 epochs, 5 warm-up, cosine to 0.05 lr, flat for the last 15."""
    cfg = OptimConfig(schedule="quadratic_warmcos", epochs=300, warmup_epochs=5, min_lr_ratio=0.05,
                      no_aug_epochs=15)
    spe, lr = 7, 0.01
    s = LRSchedule.from_config(cfg, base_lr=lr, steps_per_epoch=spe)
    for step in [0, 1, 17, 34, 35, 36, 500, 1000, 1994, 1995, 2000, 2099]:
        assert s(step) == pytest.approx(_yolox_warm_cos_lr(lr, 0.05, 300 * spe, 5 * spe, 0, 15 * spe, step)), step
    assert s(2099) == pytest.approx(0.05 * lr) and s(285 * spe) == pytest.approx(0.05 * lr)


def test_warmcos_schedule_matches_yolox():
    cfg = OptimConfig(schedule="warmcos", epochs=20, warmup_epochs=2, warmup_start_factor=0.0)
    s = LRSchedule.from_config(cfg, base_lr=0.02, steps_per_epoch=10)
    for step in [0, 5, 20, 21, 100, 199, 200]:
        assert s(step) == pytest.approx(_yolox_warm_cos(0.02, 200, 20, 0.0, step), abs=1e-12), step


@pytest.mark.parametrize("recipe", [
    dict(base_lr=0.01, warmup_steps=4000, warmup_start_factor=0.0, milestones=(243, 324), epochs=405),  # PP-YOLO 1x
    dict(base_lr=0.01, warmup_steps=500, warmup_start_factor=1 / 3, milestones=(8, 11), epochs=12),  # FCOS 1x
])
def test_piecewise_schedule_matches_paddle(recipe):
    spe = 97
    cfg = OptimConfig(schedule="piecewise", epochs=recipe["epochs"], warmup_steps=recipe["warmup_steps"],
                      warmup_start_factor=recipe["warmup_start_factor"], milestones=recipe["milestones"],
                      gamma=0.1)
    s = LRSchedule.from_config(cfg, base_lr=recipe["base_lr"], steps_per_epoch=spe)
    m0, m1 = (m * spe for m in recipe["milestones"])
    w = recipe["warmup_steps"]
    for step in sorted({0, 1, w // 2, w - 1, w, w + 1, m0 - 1, m0, m0 + 1, m1 - 1, m1, recipe["epochs"] * spe - 1}):
        want = _paddle_piecewise(recipe["base_lr"], w, recipe["warmup_start_factor"], recipe["milestones"],
                                 0.1, spe, step)
        assert s(step) == pytest.approx(want, rel=1e-12, abs=1e-15), step
    assert s(m1) == pytest.approx(recipe["base_lr"] * 0.01)


def test_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="optim.schedule"):
        LRSchedule.from_config(OptimConfig(schedule="step"), 0.1, 10)


def test_checkpoint_atomic_weights_only_round_trip(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    state = {"model": Net().state_dict(), "epoch": 3, "rng": rng_state(), "name": "x"}
    path = tmp_path / "ck" / "latest.pth"
    save_checkpoint(path, state)
    assert [p.name for p in path.parent.iterdir()] == ["latest.pth"]  # no temp file left
    a = (torch.rand(3), random.random(), np.random.rand())
    back = load_checkpoint(path)  # weights_only=True inside
    set_rng_state(back["rng"])
    b = (torch.rand(3), random.random(), np.random.rand())
    torch.testing.assert_close(a[0], b[0])
    assert a[1:] == b[1:]
    assert back["epoch"] == 3


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_gives_each_rank_the_random_streams_its_dropblock_draws_from(tmp_path, rank):
    """PP-YOLO's DropBlock draws its masks from torch's default generator (``torch.rand_like``):
    an exact resume needs each rank's streams back (``Checkpointer.resume`` sets rank r's
    from ``rng_ranks[r]``). The resume tests train PP-YOLOE and YOLOX, whose steps draw
    nothing from these streams, so a resume that left them alone passed them; here the
    block drops after the resume what the uninterrupted rank drops next."""
    from types import SimpleNamespace

    from fastdet.config import Config
    from fastdet.engine.checkpointer import Checkpointer
    from fastdet.models.ppyolo import DropBlock

    drop = DropBlock(block_size=3, keep_prob=0.8).train()
    x = torch.ones(2, 4, 12, 12)
    model = Net()
    dist = SimpleNamespace(rank=rank, world_size=2, is_main=rank == 0)
    ck = Checkpointer(Config(), tmp_path, dist, model, None, build_optimizer(OptimConfig(), model, 0.1, "cpu"),
                      SimpleNamespace(cat_ids=[1, 2, 3], class_names=["a", "b", "c"]), steps_per_epoch=5)
    with torch.random.fork_rng(devices=[]):
        saved_np, saved_py = np.random.get_state(), random.getstate()
        try:
            streams, want = [], []
            for seed in (3, 5):  # rank 0's and rank 1's streams at the checkpoint
                torch.manual_seed(seed)
                np.random.seed(seed)
                random.seed(seed)
                streams.append(rng_state())
                want.append((drop(x), np.random.random(), random.random()))  # what each rank draws next
            save_checkpoint(tmp_path / "latest.pth", ck.state(0, 2, -1.0, rng_ranks=streams))
            torch.manual_seed(99)  # a new process
            ck.resume((None, tmp_path / "latest.pth"), world_batch=8, base_lr=0.1)
            got = (drop(x), np.random.random(), random.random())
        finally:
            np.random.set_state(saved_np)
            random.setstate(saved_py)
    assert not torch.equal(want[0][0], want[1][0])  # the two ranks' masks differ
    assert torch.equal(got[0], want[rank][0]) and got[1:] == want[rank][1:]


def test_checkpoint_that_needs_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"obj": OptimConfig()}, path)  # a dataclass needs unpickling code
    with pytest.raises(ValueError, match="holds Python objects other than tensors"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pth")


def test_tolerant_load_skips_a_different_head():
    src, dst = Net(classes=80), Net(classes=3)
    skipped = load_weights_tolerant(dst, src.state_dict())
    assert sorted(s.split()[0] for s in skipped) == ["head.bias", "head.weight"]
    torch.testing.assert_close(dst.conv.weight, src.conv.weight)


def test_unwrap_compiled_module():
    net = Net()
    assert unwrap_model(torch.compile(net)) is net


def test_channels_last_step_matches_nchw():
    """`--channels-last` changes the memory layout only: one PPYOLOE-s train step in NHWC
    gives the losses and updated weights of the same step in NCHW."""
    from fastdet import registry
    from fastdet.config import apply_overrides
    from fastdet.engine.step import TrainStep, synthetic_batch
    from fastdet.train import build_parser, resolve_config

    assert resolve_config(build_parser().parse_args(["--channels-last"])).data.channels_last is True
    assert resolve_config(build_parser().parse_args([])).data.channels_last is False
    cfg = apply_overrides(registry.get_preset("ppyoloe", "s"), {"model.num_classes": 4})
    cpu = torch.device("cpu")
    results = []
    for nhwc in (False, True):
        torch.manual_seed(0)
        model = registry.build_detector(cfg)
        if nhwc:
            model = model.to(memory_format=torch.channels_last)
        model.train()
        opt, ema, _ = build_optimizer_and_ema(cfg.optim, model, 2, cpu)
        step = TrainStep(model, model, opt, ema, cpu, None, clip_grad_norm=cfg.optim.clip_grad_norm)
        batch = synthetic_batch(2, 64, 64, 8, cpu, torch.Generator().manual_seed(1), nhwc)
        assert batch["images"].is_contiguous(memory_format=torch.channels_last) == nhwc
        step(batch, registry.phase(cfg, 0).loss_kwargs)
        results.append((step.read_losses(), [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = results
    assert l0.keys() == l1.keys() and l0
    for k in l0:
        assert l1[k] == pytest.approx(l0[k], rel=1e-4, abs=1e-5), k
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
