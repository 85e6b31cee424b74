"""Compilation in one place: the trainer, its compile workers, ``python -m fastdet.compile``
and the benchmarks build their step with one function and plan their buckets from one
source, so inductor's cache key cannot drift between them (that the modules point one way is
the import contract "engine compiles one way" in pyproject.toml, tests/test_import_layers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fastdet import registry
from fastdet.config import apply_overrides
from fastdet.data.formats import load_split
from fastdet.data.loader import build_train_loader
from fastdet.engine import compile_workers, graph_cache, step as step_mod
from fastdet.engine.compile_workers import CompileWorkers

REPO = Path(__file__).resolve().parent.parent


def step_settings(step) -> dict:
    """What a config decides about a TrainStep (the parameters' shapes aside)."""
    bns = [m for m in step.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    convs = [p for p in step.model.parameters() if p.dim() == 4]
    opt = step.optimizer
    return {
        "compiled": step.compiled, "cuda_graphs": step.cuda_graphs, "amp": step.amp_dtype, "clip": step.clip,
        "dynamic_hw": step.mark_hw_dynamic, "graph_warmup_iters": step.graph_warmup_iters,
        "channels_last": all(p.is_contiguous(memory_format=torch.channels_last) for p in convs),
        "training": step.model.training, "bn_training": [m.training for m in bns],
        "optimizer": type(opt).__name__,
        "groups": [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in opt.param_groups],
        "ema": None if step.ema is None else type(step.ema).__name__,
    }


@pytest.fixture
def trainer(demo_small, tmp_path, monkeypatch):
    """A --compile trainer (not trained) with frozen BatchNorm statistics and channels-last."""
    from fastdet.engine.trainer import Trainer
    from fastdet.runtime import dist
    from fastdet.train import build_parser, resolve_config

    monkeypatch.setenv(graph_cache.CACHE_ENV, str(tmp_path / "cache"))
    args = build_parser().parse_args([
        "--arch", "ppyoloe", "--size", "s", "--data", str(demo_small), "--device", "cpu", "--img-size", "64",
        "--no-multiscale", "--batch-size", "2", "--epochs", "1", "--output-dir", str(tmp_path / "run"),
        "--workers", "0", "--compile", "--channels-last", "--set", "compile.backend=aot_eager",
        "--set", "model.freeze_bn=true", "--set", "family.static_assigner_epoch=100"])
    t = Trainer(resolve_config(args))
    yield t
    dist.shutdown()


def test_trainer_worker_and_bench_build_the_same_step(trainer, tmp_path, monkeypatch):
    """The worker's step is the trainer's (the same settings from the same config) and it
    records its graphs under the trainer's graph key; the benchmark builds through the
    same function."""
    built = []
    real = step_mod.build_train_step

    def spy(*a, **k):
        built.append(real(*a, **k))
        return built[-1]

    monkeypatch.setattr(compile_workers, "build_train_step", spy)
    monkeypatch.setattr(step_mod, "build_train_step", spy)
    assert compile_workers.compile_buckets(trainer.cfg.to_dict(), [], None, "cpu", False) == []
    (worker,) = built
    want = step_settings(trainer.train_step)
    assert want["channels_last"] and want["compiled"] and not any(want["bn_training"])
    assert step_settings(worker) == want
    key = graph_cache.graph_key(trainer.cfg, trainer.device, False, torch.get_num_threads())
    assert graph_cache.compiled_dir(graph_cache.resolve_cache_dir(), key).is_dir()

    sys.path.insert(0, str(REPO))
    from bench import throughput

    b = throughput.Bench(throughput.parse_args(["--device", "cpu", "--quick", "--compile-backend", "aot_eager"]))
    v = b.variant("compile_nhwc")
    _, bench_step, _, _ = b.build_step(v)
    assert built[-1] is bench_step and len(built) == 2
    got = step_settings(bench_step)
    assert got["compiled"] and got["channels_last"] and got["clip"] == want["clip"]


def test_fastdet_compile_plans_the_trainers_buckets_with_the_same_object(trainer, demo_small, tmp_path,
                                                                         monkeypatch):
    """``python -m fastdet.compile`` with the training's flags drives a CompileWorkers that
    plans the trainer's buckets under the trainer's graph key."""
    from fastdet import compile as compile_cli

    started = []
    monkeypatch.setattr(CompileWorkers, "start", lambda self, ready_dir: started.append(self))
    monkeypatch.setattr(CompileWorkers, "wait", lambda self: True)
    rc = compile_cli.main(["--arch", "ppyoloe", "--size", "s", "--data", str(demo_small), "--device", "cpu",
                           "--img-size", "64", "--no-multiscale", "--batch-size", "2", "--epochs", "1",
                           "--channels-last", "--set", "compile.backend=aot_eager", "--set", "model.freeze_bn=true",
                           "--set", "family.static_assigner_epoch=100"])
    assert rc == 0
    (cli,) = started
    ours = CompileWorkers(trainer.cfg, trainer.device, step=trainer.train_step, out_dir=trainer.out)
    every, known = ours.plan(registry.loss_variants(trainer.cfg, 0, 0))
    assert cli.key == ours.key and cli.buckets == every and known == [False]


@pytest.mark.parametrize("arch, size", [("ppyoloe", "s"), ("yolox", "s"), ("ppyolo", "r50vd_dcn"),
                                        ("fcos", "r50")])
def test_the_compile_buckets_are_the_sizes_the_loader_yields(demo_small, arch, size):
    cfg = apply_overrides(registry.get_preset(arch, size), {"data.data": str(demo_small), "data.loader": "torch",
                                                            "data.num_workers": 0, "data.batch_size": 2,
                                                            "model.num_classes": 4})
    ds = load_split(cfg.data, "train")
    loader = build_train_loader(cfg.data, ds, stages_for_epoch=lambda e: registry.phase(cfg, e).stages, rank=0,
                                world_size=1, device="cpu", seed=0)
    assert tuple(graph_cache.bucket_sizes(cfg)) == tuple(loader.sizes)


# Top to bottom: a module imports only modules below it (and none of these inside a function).
