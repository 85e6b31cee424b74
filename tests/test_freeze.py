"""``--freeze-backbone`` (``model.freeze_backbone``): the backbone stays as the run starts it.

After training steps every backbone tensor (parameters and BatchNorm buffers, of the model
and of its EMA) is bit-identical to the one the run started from, the neck and head have
moved, and the optimizer holds no backbone parameter: for every family in one process
(the step as the trainer builds it), and through the command line eager (then resumed),
and under torchrun with 2 ranks compiled (aot_eager), from a ``--ckpt``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from in_process import main_in_process
from ports import free_port
from test_families_cli import SMALLEST  # tests/ is on sys.path (rootdir conftest)
from test_train import COMPILE, run, train_cmd

from fastdet import registry
from fastdet.config import apply_overrides
from fastdet.engine.step import build_train_parts, build_train_step, set_train_mode, synthetic_batch
from fastdet.engine.summary import summarize_model
from fastdet.models import ARCHITECTURES
from fastdet.ops.ema import EMA_FLAVOURS, ModelEMA
from fastdet.runtime.checkpoint import load_checkpoint, save_checkpoint
from fastdet.train import build_parser

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the suite runs a worker a core


def is_backbone(key: str) -> bool:
    return key.startswith("backbone.")


def assert_frozen(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor], what: str) -> None:
    """Every backbone tensor of ``end`` is ``start``'s exactly; most neck and head float
    tensors moved (a few, e.g. a fixed anchor buffer, never do)."""
    backbone = [k for k in end if is_backbone(k)]
    assert backbone, f"{what}: no backbone tensors"
    changed = [k for k in backbone if not torch.equal(end[k], start[k])]
    assert changed == [], f"{what}: backbone tensors changed: {changed[:5]}"
    rest = [k for k in end if not is_backbone(k) and end[k].is_floating_point() and end[k].numel() > 1]
    moved = [k for k in rest if not torch.equal(end[k], start[k])]
    assert len(moved) > len(rest) // 2, f"{what}: only {len(moved)} of {len(rest)} neck/head tensors moved"


def assert_optimizer_holds_no_backbone(opt_state: dict, model: torch.nn.Module) -> None:
    """The optimizer's parameters (each with its state: a momentum, or AdamW's moments and
    step) are the model's non-backbone parameters: as many, of the same shapes."""
    theirs = [i for g in opt_state["param_groups"] for i in g["params"]]
    ours = [p for n, p in model.named_parameters() if not is_backbone(n)]
    assert len(theirs) == len(ours) < len(list(model.parameters()))
    assert sorted(i for i in opt_state["state"]) == sorted(theirs)
    shapes = [{tuple(v.shape) for v in opt_state["state"][i].values() if v.dim() > 0} for i in theirs]
    assert all(len(s) == 1 for s in shapes)
    assert sorted(s.pop() for s in shapes) == sorted(tuple(p.shape) for p in ours)


# --------------------------------------------------------------------------- in one process

def family_config(arch: str, **more):
    cfg = apply_overrides(registry.get_preset(arch, SMALLEST[arch]), {
        **registry.demo_overrides(arch), "model.num_classes": 3, "model.freeze_backbone": True,
        "data.batch_size": 2, "compile.amp": "off", "run.device": "cpu", **more})
    return registry.resolve(cfg)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_family_trains_with_its_backbone_frozen(arch):
    """The step as the trainer builds it (build_train_parts, build_train_step): two steps
    leave the backbone and its EMA exactly as they were, move the neck and head, and the
    optimizer, the EMA's averaged tensors and the trainable count leave the backbone out.
    The trainer's train mode (after an evaluation's eval mode) keeps the backbone's
    BatchNorm in eval mode and the neck's and head's in train mode (FCOS's have GroupNorm)."""
    assert set(SMALLEST) == set(ARCHITECTURES)
    torch.manual_seed(0)
    cfg = family_config(arch)
    dev = torch.device("cpu")
    parts = build_train_parts(cfg, dev)
    step = build_train_step(cfg, dev, parts=parts)
    model, ema = parts.model, parts.ema
    start = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(not p.requires_grad for p in model.backbone.parameters())
    assert any(p.requires_grad for p in model.neck.parameters()) and any(p.requires_grad for p in model.head.parameters())
    trained = {id(p) for g in parts.optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in model.named_parameters() if not is_backbone(n)}
    named = [*ema.module.named_parameters(), *ema.module.named_buffers()]
    assert {id(t) for t in ema.state_tensors()[:-1]} == {id(t) for n, t in named if not is_backbone(n)}
    n_backbone, trainable = summarize_model(model, arch, sizes=()).parts["backbone"]
    assert n_backbone > 0 and trainable == 0

    model.eval()  # as an evaluation leaves it
    set_train_mode(model, cfg.model)
    bns = {n: m.training for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    assert not any(t for n, t in bns.items() if is_backbone(n + ".")), "a backbone BatchNorm is in train mode"
    assert all(t for n, t in bns.items() if not is_backbone(n + ".")), "a neck/head BatchNorm is in eval mode"
    assert model.training and model.neck.training and model.head.training

    kw = registry.phase(cfg, 0).loss_kwargs
    size = 64 if arch != "fcos" else 128
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        step(synthetic_batch(2, size, size, 8, dev, gen), kw)
    assert_frozen(start, model.state_dict(), f"{arch} model")
    assert_frozen(start, ema.averaged().state_dict(), f"{arch} EMA")


@pytest.mark.parametrize("kind", sorted(EMA_FLAVOURS))
def test_the_ema_of_a_fixed_submodule_is_that_submodule(kind):
    """ModelEMA(fixed=("0",)): the fixed submodule's tensors are the model's as the average
    started, never written by an update (not averaged: "paddle" would start them from zeros
    and divide by 1 - d^n when read), the others averaged as the plain EMA averages them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
    fixed = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("0.")}
    ema = ModelEMA(model, decay=0.9, kind=kind, fixed=("0",))
    plain = ModelEMA(model, decay=0.9, kind=kind)
    for _ in range(3):
        with torch.no_grad():
            model[2].weight.add_(0.5)
            model[1].running_mean.mul_(0.5)
        ema.update(model)
        plain.update(model)
    # update writes none of the fixed tensors (the others as the plain EMA does).
    writes = {id(t) for t in ema.state_tensors()}
    assert not writes & {id(t) for t in ema.module[0].state_dict().values()}
    assert len(writes) == len(plain.state_tensors()) - len(fixed)
    got, ref = ema.averaged().state_dict(), plain.averaged().state_dict()
    for k, v in fixed.items():
        assert torch.equal(got[k], v), k
    for k in ("1.running_mean", "2.weight", "2.bias"):
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
    with pytest.raises(ValueError, match="no submodule 'neck' to keep fixed"):
        ModelEMA(model, fixed=("neck",))


# --------------------------------------------------------------------------- the command line

@pytest.fixture(scope="module")
def start_ckpt(tmp_path_factory) -> Path:
    """A fastdet checkpoint of PP-YOLOE-s for the demo's 4 classes, from seed 1 (the trainer
    builds its own model from seed 0, so a backbone equal to this one was loaded and kept)."""
    cfg = apply_overrides(registry.get_preset("ppyoloe", "s"), {"model.num_classes": 4})
    torch.manual_seed(1)
    model = registry.build_detector(registry.resolve(cfg))
    path = tmp_path_factory.mktemp("start") / "start.pth"
    save_checkpoint(path, {"config": cfg.to_dict(), "model": model.state_dict()})
    return path


def test_freeze_backbone_from_a_ckpt_of_another_size_is_refused(demo_small, tmp_path, start_ckpt, capsys, caplog):
    """--ckpt-partial from another size starts the backbone tensors of another shape fresh:
    frozen, they would stay random for the whole run. One line, before the first step."""
    out = tmp_path / "out"
    code, _, err = main_in_process(frozen_cmd(demo_small, out, "--size", "m", "--ckpt", str(start_ckpt),
                                              "--ckpt-partial", "--freeze-backbone")[3:], capsys, caplog)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"--freeze-backbone with --ckpt {re.escape(str(start_ckpt))}: \d+ of \d+ backbone tensors are "
                     r"not in it at ppyoloe-m's shapes \(first: backbone\.\S+\) and would stay random", err), err
    assert not (out / "latest.pth").exists()


def frozen_cmd(data: Path, out: Path, *extra: str) -> list[str]:
    return train_cmd(data, out, "--max-steps", "3", *extra)


def check_run(out: Path, start_ckpt: Path) -> None:
    start = load_checkpoint(start_ckpt)["model"]
    end = load_checkpoint(out / "latest.pth")
    assert end["config"]["model"]["freeze_backbone"] is True
    assert_frozen(start, end["model"], "latest.pth model")
    assert_frozen(start, end["ema"]["module"], "latest.pth EMA")
    assert_optimizer_holds_no_backbone(end["optimizer"], registry.build_detector(
        registry.config_from_dict(end["config"])))


def test_freeze_backbone_keeps_the_backbone_eager_and_after_resume(demo_small, tmp_path, start_ckpt):
    """Two steps from --ckpt with --freeze-backbone, then --resume to step 3 without the
    flag (the stored config freezes again): latest.pth's model and EMA backbones are the
    checkpoint's bit for bit, the neck and head moved, no optimizer state for the backbone,
    and model_summary.txt counts the backbone as frozen."""
    out = tmp_path / "run"
    first = run(train_cmd(demo_small, out, "--max-steps", "2", "--ckpt", str(start_ckpt), "--freeze-backbone"),
                env=ONE_THREAD)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    check_run(out, start_ckpt)
    summary = json.loads((out / "model_summary.txt").read_text().split("\n\n", 1)[1])
    n_backbone, trainable = summary["parts"]["backbone"]
    assert n_backbone > 0 and trainable == 0 and summary["params"] - summary["trainable"] == n_backbone
    assert "(0.00 M trainable)" in first.stdout
    resumed = run(train_cmd(demo_small, out, "--max-steps", "3", "--resume"), env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert load_checkpoint(out / "latest.pth")["step"] == 3
    check_run(out, start_ckpt)


def test_freeze_backbone_under_torchrun_two_ranks_compiled(demo_small, tmp_path, start_ckpt):
    """torchrun, 2 ranks (gloo, DDP, SyncBatchNorm in the neck) with --compile (aot_eager:
    Dynamo and AOTAutograd's graphs, eager kernels), as users launch it: DDP's reducer holds
    the parameters that train, both ranks train them, the modes set before the warm-up are
    the ones trained in (no recompile), and the backbone stays."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           *frozen_cmd(demo_small, out, "--ckpt", str(start_ckpt), "--freeze-backbone", *COMPILE)[1:]]
    cmd[cmd.index("--batch-size") + 1] = "2"
    r = run(cmd, env=ONE_THREAD)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "x 2 rank(s)" in r.stdout and "compile True" in r.stdout
    assert "recompiled" not in r.stdout + r.stderr
    check_run(out, start_ckpt)


@pytest.mark.parametrize("arch, backbone_file", [("ppyoloe", "CSPResNetb_s_pretrained.pdparams"), ("yolox", None)])
def test_freeze_backbone_without_weights_is_refused(demo_small, tmp_path, capsys, caplog, arch, backbone_file):
    """A frozen backbone that would stay random: one line before any work, saying what to
    give (--backbone-weights only where the family reads a backbone file)."""
    out = tmp_path / "out"
    argv = train_cmd(demo_small, out, "--freeze-backbone")[3:]
    argv[argv.index("--arch") + 1] = arch
    argv[argv.index("--size") + 1] = SMALLEST[arch]
    code, _, err = main_in_process(argv, capsys, caplog)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--freeze-backbone without --ckpt, --backbone-weights or --resume would keep a random backbone" in err
    assert "give --ckpt PATH" in err
    assert ("--backbone-weights PATH" in err.split("give")[1]) == (backbone_file is not None), err
    if backbone_file:
        assert backbone_file in err
    assert not out.exists()


def test_freeze_backbone_is_a_flag_in_the_help_and_the_printed_config(demo_small, tmp_path, capsys, caplog,
                                                                        start_ckpt):
    assert "--freeze-backbone" in build_parser().format_help()
    code, printed, err = main_in_process(
        train_cmd(demo_small, tmp_path / "out", "--ckpt", str(start_ckpt), "--freeze-backbone", "--print-config")[3:],
        capsys, caplog)
    assert code == 0, err
    assert "  freeze_backbone: true" in printed
    code, printed, err = main_in_process(train_cmd(demo_small, tmp_path / "out", "--print-config")[3:], capsys, caplog)
    assert code == 0 and "  freeze_backbone: false" in printed, err
