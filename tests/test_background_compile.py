"""Compile without the wait (issue 31): the eager twin, the switch, the workers, the log.

The orchestration is what is tested, on the ``aot_eager`` backend (Dynamo and AOTAutograd
trace the same graphs and guards as inductor, in seconds instead of minutes).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from ports import free_port

from fastdet import registry
from fastdet.config import ConfigError, apply_overrides
from fastdet.engine import graph_cache as gcache
from fastdet.engine.compile_workers import plan_workers
from fastdet.runtime.checkpoint import load_checkpoint
from fastdet.runtime.logging import Progress, setup_logging
from fastdet.engine.optim import build_optimizer_and_ema
from fastdet.engine.step import TrainStep, compiled_graph_count, synthetic_batch

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS: tests/conftest.py
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- planning

def test_workers_are_sized_to_the_cores_and_threads_do_not_oversubscribe():
    assert plan_workers(30, 0, 1, cpus=2) == (1, 1)  # 2 cores: one worker
    assert plan_workers(30, 0, 8, cpus=16) == (2, 4)  # 8 ranks + 2 x 4 threads = 16
    assert plan_workers(3, 0, 1, cpus=64) == (3, 21)  # never more workers than graphs
    assert plan_workers(30, 5, 1, cpus=2) == (5, 1)  # compile.workers wins
    for n, ranks, cpus in ((30, 1, 2), (30, 8, 16), (22, 4, 32), (10, 2, 8)):
        w, t = plan_workers(n, 0, ranks, cpus=cpus)
        assert ranks + w * t <= max(cpus, ranks + w), (n, ranks, cpus, w, t)


def test_buckets_are_the_recipes_sizes_times_its_loss_variants_in_order_of_use():
    counts = {}
    for arch, size in (("ppyoloe", "s"), ("yolox", "s"), ("ppyolo", "r50vd_dcn"), ("fcos", "r50")):
        cfg = registry.get_preset(arch, size)
        sizes = gcache.bucket_sizes(cfg)
        variants = registry.loss_variants(cfg, 0, cfg.optim.epochs - 1)
        buckets = gcache.train_buckets(sizes, variants)
        counts[arch] = len(buckets)
        assert buckets[0].kwargs == variants[0] and (buckets[0].h, buckets[0].w) == sizes[0]
        assert len({b.file_id for b in buckets}) == len(buckets)
    # The counts of the published recipes: 15 x 2, 11 x 2, 10, 3 keep-ratio canvases.
    assert counts == {"ppyoloe": 30, "yolox": 22, "ppyolo": 10, "fcos": 3}


def test_cache_dir_setting_then_environment_then_default(monkeypatch, tmp_path):
    monkeypatch.setenv(gcache.CACHE_ENV, str(tmp_path / "env"))
    assert gcache.resolve_cache_dir(str(tmp_path / "set")) == tmp_path / "set"
    assert gcache.resolve_cache_dir("") == tmp_path / "env"
    monkeypatch.delenv(gcache.CACHE_ENV)
    assert gcache.resolve_cache_dir("") == Path("~/.cache/fastdet/inductor").expanduser().resolve()


def test_bad_compile_settings_are_one_clear_error():
    from fastdet.train import check_config

    cfg = registry.get_preset("ppyoloe", "s")
    with pytest.raises(ConfigError, match="compile.warmup"):
        check_config(apply_overrides(cfg, {"compile.warmup": "later"}))
    with pytest.raises(ConfigError, match="compile.workers"):
        check_config(apply_overrides(cfg, {"compile.workers": -1}))
    for nice in (-1, 20):
        with pytest.raises(ConfigError, match="compile.worker_nice must be a niceness from 0 to 19"):
            check_config(apply_overrides(cfg, {"compile.worker_nice": nice}))


def test_log_lines_print_above_the_progress_bar(monkeypatch):
    """A log line during training is a whole line of its own, not glued to the bar's text."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    fd_log = logging.getLogger("fastdet")  # setup_logging changes these: later tests get them back
    monkeypatch.setattr(fd_log, "handlers", list(fd_log.handlers))  # a copy: setup_logging clears in place
    monkeypatch.setattr(fd_log, "propagate", fd_log.propagate)
    monkeypatch.setattr(fd_log, "level", fd_log.level)
    setup_logging(None, True)
    bar = Progress(10, True, force=True)
    try:
        bar.step("compiled 0/2")
        logging.getLogger("fastdet").info("compile: graph 1/2 ready")
        bar.step("compiled 1/2")
        assert bar.bar.n == 2
    finally:
        bar.close()
    lines = [seg.split("\r")[-1] for seg in out.getvalue().split("\n")]
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d compile: graph 1/2 ready", ln) for ln in lines), lines


# --------------------------------------------------------------------------- the step

def _step(background: bool):
    cfg = apply_overrides(registry.get_preset("ppyoloe", "s"), {"model.num_classes": 3})
    torch.manual_seed(0)
    model = registry.build_detector(cfg).train()
    opt, ema, _ = build_optimizer_and_ema(cfg.optim, model, 2, torch.device("cpu"))
    step = TrainStep(model, model, opt, ema, torch.device("cpu"), None, clip_grad_norm=cfg.optim.clip_grad_norm,
                     compile=background, backend="aot_eager", background=background)
    return model, step


def test_a_bucket_runs_eager_until_ready_then_compiled_with_eager_results():
    """Before mark_ready a bucket compiles nothing; its next step loads the graph (1 graph),
    later steps compile nothing more, another bucket stays eager, and the weights after the
    mixed run match an all-eager run. A graph compiled after a switch fails loudly."""
    gen = torch.Generator().manual_seed(1)
    a = synthetic_batch(2, 64, 64, 6, torch.device("cpu"), gen)
    b = synthetic_batch(2, 96, 96, 6, torch.device("cpu"), gen)
    kw = {"static_assigner": True}
    ref_model, ref = _step(False)
    for batch in (a, a, a, b):
        ref(batch, kw)
    model, step = _step(True)
    step.begin_background(2)
    g0 = compiled_graph_count()
    step(a, kw)
    assert compiled_graph_count() == g0 and not step.is_compiled(64, 64, kw)
    step.mark_ready(64, 64, kw)
    step(a, kw)  # the switch
    assert step.is_compiled(64, 64, kw) and compiled_graph_count() == g0 + 1
    assert [(s.key[:2], s.graphs) for s in step.switches] == [((64, 64), 1)]
    step(a, kw)
    step(b, kw)  # not ready: eager
    assert compiled_graph_count() == g0 + 1 and not step.is_compiled(96, 96, kw)
    step.check_recompiles()
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    ref_losses, losses = ref.read_losses(), step.read_losses()
    for k in ref_losses:
        assert losses[k] == pytest.approx(ref_losses[k], rel=1e-4), k
    # A bucket compiled behind the trainer's back (a guard leak) is a recompile.
    step._twin.compiled(b["images"], {k: b[k] for k in ("gt_boxes", "gt_labels", "gt_mask", "gt_scores")},
                        **kw)["total_loss"].backward()
    with pytest.raises(RuntimeError, match="recompiled 1 time"):
        step.check_recompiles()


# --------------------------------------------------------------------------- through the CLI

# Runs fastdet.train with one hook: at step WAIT the trainer waits until the workers have
# compiled every bucket (also right after a resumed run starts at or past WAIT), so the
# switch falls on step WAIT + 1 in every run whatever the machine's load.
HOOKED_TRAIN = textwrap.dedent("""
    import sys, time
    from fastdet.engine import trainer as T
    from fastdet.engine.compile_workers import CompileWorkers as W
    from fastdet.runtime.logging import StepGaps

    WAIT = int(sys.argv[1])
    init, poll, warmup = T.Trainer.__init__, W.poll, W.warmup
    run = {}

    def hooked_init(self, *a, **kw):
        run["trainer"] = self
        init(self, *a, **kw)

    def wait_all(workers, step, gaps):
        t0 = time.time()
        while workers.pending:
            poll(workers, step, gaps)
            if workers.dead_workers() or time.time() - t0 > 1200:
                raise SystemExit("compile workers did not finish")
            time.sleep(0.5)

    def hooked_poll(self, step, gaps):
        if self.background and step == WAIT:
            wait_all(self, step, gaps)
        poll(self, step, gaps)

    def hooked_warmup(self, *a):
        warmup(self, *a)
        step = run["trainer"].step
        if self.background and step >= WAIT:
            wait_all(self, step, StepGaps())

    if __name__ == "__main__":  # the compile workers (spawned) import this file again
        T.Trainer.__init__, W.poll, W.warmup = hooked_init, hooked_poll, hooked_warmup
        from fastdet.train import main
        sys.exit(main(sys.argv[2:]))
""")


def hooked_train_script(tmp: Path) -> str:
    path = tmp / "hooked_train.py"
    path.write_text(HOOKED_TRAIN)
    return str(path)


def _train(data: Path, out: Path, wait: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, hooked_train_script(out.parent), str(wait), "--arch", "ppyoloe", "--size", "s",
           "--data", str(data), "--device", "cpu", "--img-size", "64", "--no-multiscale",
           "--batch-size", "4", "--epochs", "2", "--output-dir", str(out), "--workers", "0",
           "--log-interval", "1", "--set", "data.eval_batch_size=8", "--set", "optim.warmup_steps=2",
           "--set", "run.eval_interval=100", "--set", "family.static_assigner_epoch=100",
           "--compile", "--set", "compile.backend=aot_eager",
           "--set", f"compile.cache_dir={out.parent / ('cache-' + out.name)}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800)


@pytest.mark.slow
def test_background_compile_switches_and_resumes_exactly_across_the_switch(demo_small, tmp_path):
    """Training starts eager with a worker compiling; the bucket switches to its compiled
    step; a run stopped before the switch and resumed matches the uninterrupted one."""
    full, part = tmp_path / "full", tmp_path / "part"
    a = _train(demo_small, full, 2, "--max-steps", "5")
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    log = a.stdout
    assert "1 graph(s) (1 size bucket(s) x 1 loss variant(s)) in 1 worker process(es)" in log
    assert "training starts eager" in log and str(tmp_path / "cache-full") in log
    assert re.search(r"compile: graph 1/1 \(64x64 static_assigner=True\) compiled by worker \d+ in", log)
    assert "runs compiled from step 3" in log
    assert "recompiled" not in log + a.stderr
    # The log says it before training, then each graph, then the switch.
    assert log.index("training starts eager") < log.index("step 1/5") < log.index("compiled by worker") \
        < log.index("runs compiled from step 3")
    ready = list((full / "compile").glob("*/*.json"))
    assert len(ready) == 1 and json.loads(ready[0].read_text())["ok"] is True

    b1 = _train(demo_small, part, 2, "--max-steps", "2")
    assert b1.returncode == 0, b1.stdout[-3000:] + b1.stderr[-3000:]
    assert "runs compiled" not in b1.stdout  # stopped on the eager twin
    b2 = _train(demo_small, part, 2, "--max-steps", "5", "--resume")
    assert b2.returncode == 0, b2.stdout[-3000:] + b2.stderr[-3000:]
    assert "resumed from" in b2.stdout and "runs compiled from step 3" in b2.stdout
    ma = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in mb] == [m["step"] for m in ma] == [1, 2, 3, 4, 5]
    for x, y in zip(ma, mb):
        for k in ("total_loss", "loss_cls", "loss_iou", "loss_dfl", "lr"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
    wa, wb = load_checkpoint(full / "latest.pth"), load_checkpoint(part / "latest.pth")
    for k, v in wa["model"].items():
        torch.testing.assert_close(wb["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_compile_cli_rejects_bad_input_before_any_work(compile_cli, tmp_path, capsys):
    main, made = compile_cli
    assert main(["--arch", "ppyoloe", "--size", "s", "--num-classes", "0"]) == 2
    assert "--num-classes must be at least 1" in capsys.readouterr().err
    assert main(["--arch", "ppyoloe", "--size", "s", "--data", str(tmp_path / "missing")]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err
    assert made == []


@pytest.fixture
def compile_cli(monkeypatch):
    """``fastdet.compile.main`` in this process, with its CompileWorkers replaced by a record
    of their making: a refused command must not get that far."""
    from fastdet import compile as cli

    made = []
    monkeypatch.setattr(cli, "CompileWorkers", lambda *a, **k: made.append((a, k)) or pytest.fail("compiled"))
    return cli.main, made


def test_compile_cli_keeps_its_workers_and_threads_within_cores(monkeypatch, tmp_path, capsys):
    """--cores N: the fill's worker processes x inductor compile threads stay within N cores
    (bench/gpu_check.sh runs several fills beside each other; each took every core of the
    machine). FCOS's three canvases in three workers of one thread; a bad count is one line."""
    from fastdet import compile as cli
    from fastdet.engine.compile_workers import CompileWorkers

    started = []
    monkeypatch.setattr(CompileWorkers, "start", lambda self, ready_dir: started.append(self))
    monkeypatch.setattr(CompileWorkers, "wait", lambda self: True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    base = ["--arch", "fcos", "--size", "r50", "--num-classes", "4", "--device", "cpu", "--img-size", "64",
            "--no-multiscale", "--batch-size", "2", "--epochs", "1", "--set", "compile.backend=aot_eager"]
    assert cli.main([*base, "--cores", "4", "--set", "compile.workers=4"]) == 0
    assert cli.main([*base, "--cores", "4"]) == 0
    fcos, one = started
    assert len(fcos.buckets) == 3 and (fcos.workers, fcos.threads) == (3, 1)
    assert (one.workers, one.threads) == (1, 4)
    assert cli.main([*base, "--cores", "0"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("--cores must be at least 1, got 0\n") and err.count("\n") == 1 and len(started) == 2


@pytest.mark.parametrize("flag", ["--cuda-graphs", "--sync-debug"])
def test_compile_cli_refuses_cuda_only_flags_on_the_cpu_as_training_does(compile_cli, capsys, flag):
    main, made = compile_cli
    assert main(["--arch", "ppyoloe", "--size", "s", "--num-classes", "4", "--device", "cpu", flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag} needs a CUDA device" in err and err.count("\n") == 1, err
    assert made == []


def test_compile_cli_print_config_prints_the_compiled_config_and_exits(compile_cli, capsys):
    main, made = compile_cli
    assert main(["--arch", "yolox", "--size", "s", "--num-classes", "7", "--device", "cpu", "--batch-size", "3",
                 "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["arch"] == "yolox" and cfg["model"]["num_classes"] == 7
    assert cfg["data"]["batch_size"] == 3 and cfg["compile"]["compile"] is True
    assert made == []


def test_compile_cli_num_classes_must_match_the_data_it_is_given(compile_cli, demo_small, tmp_path, capsys):
    """The demo set has 4 classes: training on it builds a 4-class model, so graphs of 7
    classes would never load. A set that cannot be read here leaves --num-classes as given."""
    main, made = compile_cli
    base = ["--arch", "ppyoloe", "--size", "s", "--device", "cpu"]
    assert main([*base, "--num-classes", "7", "--data", str(demo_small)]) == 2
    err = capsys.readouterr().err
    assert f"--num-classes 7 differs from the 4 classes of the training set of --data {demo_small}" in err
    assert err.count("\n") == 1 and made == []
    for data, n in ((demo_small, 4), (tmp_path / "elsewhere", 7)):
        assert main([*base, "--num-classes", str(n), "--data", str(data), "--print-config"]) == 0
        assert yaml.safe_load(capsys.readouterr().out)["model"]["num_classes"] == n


@pytest.mark.slow
def test_compile_cli_fills_the_cache_that_training_then_loads(demo_small, tmp_path):
    """inductor: ``python -m fastdet.compile`` compiles the recipe's graph; a training
    launch on the same cache loads it (FX graph and AOTAutograd cache hits, no miss) and
    switches to it; a second ``fastdet.compile`` finds everything compiled."""
    cache = tmp_path / "cache"
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    flags = ["--arch", "ppyoloe", "--size", "s", "--data", str(demo_small), "--device", "cpu",
             "--img-size", "64", "--no-multiscale", "--batch-size", "2", "--epochs", "1",
             "--set", "family.static_assigner_epoch=100"]
    c = subprocess.run([sys.executable, "-m", "fastdet.compile", *flags], capture_output=True, text=True,
                       env=env, timeout=3600)
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    assert "1 graph(s) (1 size bucket(s) x 1 loss variant(s))" in c.stderr
    assert re.search(r"graph 1/1 \(64x64 static_assigner=True\): [\d.]+ s \(cache: 0 FX hit", c.stderr)
    again = subprocess.run([sys.executable, "-m", "fastdet.compile", *flags], capture_output=True, text=True,
                           env=env, timeout=3600)
    assert again.returncode == 0 and "1 of 1 graph(s) were compiled into" in again.stderr, again.stderr
    out = tmp_path / "run"
    cmd = [sys.executable, hooked_train_script(tmp_path), "0", *flags, "--output-dir", str(out), "--workers", "0",
           "--max-steps", "3", "--log-interval", "1", "--set", "run.eval_interval=100", "--compile"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert str(cache) in r.stdout
    # fastdet.compile recorded the bucket under the trainer's key: no worker, it loads at step 1.
    assert "1 of 1 graph(s) were compiled into this cache" in r.stdout, r.stdout[-3000:]
    assert "in 0 worker process(es)" in r.stdout
    m = re.search(r"runs compiled from step 1 \(([\d.]+) s for that step: 1 graph\(s\), cache: (\d+) FX hit\(s\) "
                  r"/ 0 miss\(es\), (\d+) AOTAutograd hit\(s\) / 0 miss", r.stdout)
    assert m and int(m.group(2)) + int(m.group(3)) > 0, r.stdout[-3000:]


@pytest.mark.slow
def test_compile_cli_fills_the_cache_that_a_torchrun_launch_then_loads(demo_small, tmp_path):
    """inductor: ``python -m fastdet.compile --ddp 2`` compiles the graph a 2-rank launch
    runs (DDP-wrapped, SyncBatchNorm from the recipe, the collectives of 2 ranks); ``torchrun
    --nproc_per_node 2 -m fastdet.train`` on the same cache starts no worker and both ranks
    switch at step 1 loading it (hits, no miss), as a cluster job after a fill does."""
    cache = tmp_path / "cache"
    # torchrun gives each of several ranks 1 thread; the fill's threads must be the ranks'.
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    flags = ["--arch", "ppyoloe", "--size", "s", "--data", str(demo_small), "--device", "cpu",
             "--img-size", "64", "--no-multiscale", "--batch-size", "2", "--epochs", "1",
             "--set", "family.static_assigner_epoch=100"]
    c = subprocess.run([sys.executable, "-m", "fastdet.compile", *flags, "--ddp", "2"], capture_output=True,
                       text=True, env=env, timeout=3600)
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    assert re.search(r"graph 1/1 \(64x64 static_assigner=True\): [\d.]+ s", c.stderr), c.stderr[-3000:]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "fastdet.train", *flags, "--output-dir", str(out), "--workers", "0", "--max-steps", "2",
           "--log-interval", "1", "--set", "run.eval_interval=100", "--compile"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SyncBatchNorm" in r.stdout and "in 0 worker process(es)" in r.stdout, r.stdout[-3000:]
    m = re.search(r"runs compiled from step 1 \([\d.]+ s for that step: 1 graph\(s\), cache: (\d+) FX hit\(s\) "
                  r"/ 0 miss\(es\), (\d+) AOTAutograd hit\(s\) / 0 miss", r.stdout)
    assert m and int(m.group(1)) + int(m.group(2)) > 0, r.stdout[-3000:]


KEY_BYTES = textwrap.dedent("""
    def key_bytes():
        import torch
        from torch._inductor.codecache import FxGraphCachePickler, extract_tensor_metadata_for_cache_key

        from fastdet.engine.step import TrainStep

        # A process that compiles or loads graphs builds its compiled step first.
        net = torch.nn.Linear(2, 2)
        TrainStep(net, net, torch.optim.SGD(net.parameters(), lr=0.1), None, torch.device("cpu"), None,
                  compile=True, backend="aot_eager")
        # What inductor's and AOTAutograd's keys hash of each graph input: its metadata.
        pickler = FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
        return pickler.dumps(extract_tensor_metadata_for_cache_key(torch.zeros(2, 3))).hex()
""")
# python -m fastdet.compile: a main module holding torch, whose spawned workers compile.
FILL = "import multiprocessing as mp\nimport torch\n" + KEY_BYTES + textwrap.dedent("""
    def worker(queue):
        queue.put(key_bytes())

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")  # as CompileWorkers.start
        queue = ctx.Queue()
        p = ctx.Process(target=worker, args=(queue,))
        p.start()
        print(queue.get(timeout=120))
        p.join(60)
""")
# python -m fastdet.train: its main module imports torch only inside functions.
TRAIN = KEY_BYTES + "\nprint(key_bytes())\n"


def test_a_compile_worker_computes_the_trainers_cache_keys(tmp_path):
    """The workers of ``python -m fastdet.compile`` wrote inductor and AOTAutograd entries
    under keys training never computed (0 hits at the switch): pickle named
    ``torch.contiguous_format`` in each input's metadata after the first module holding it,
    ``__mp_main__`` in a worker spawned from a main module importing torch (spawn re-imports
    it under that name before torch) and ``torch._utils`` in the trainer."""
    keys = []
    for name, code in (("fill.py", FILL), ("train.py", TRAIN)):
        (tmp_path / name).write_text(code)
        r = subprocess.run([sys.executable, str(tmp_path / name)], capture_output=True, text=True, env=ENV,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        keys.append(bytes.fromhex(r.stdout.strip()))
    assert keys[0] == keys[1], keys


@pytest.mark.slow
def test_two_ranks_share_one_worker_and_switch_together(demo_small, tmp_path):
    """torchrun with 2 ranks: local rank 0 alone starts the worker (each graph compiled once
    on the machine), both ranks see the bucket ready at the same log point and switch at
    the same step (the run finishes: DDP's all-reduces stay paired)."""
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           hooked_train_script(tmp_path), "2", "--arch", "ppyoloe", "--size", "s", "--data", str(demo_small),
           "--device", "cpu", "--img-size", "64", "--no-multiscale", "--batch-size", "2", "--epochs", "2",
           "--output-dir", str(out), "--workers", "0", "--log-interval", "1", "--max-steps", "4",
           "--set", "run.eval_interval=100", "--set", "family.static_assigner_epoch=100",
           "--compile", "--set", "compile.backend=aot_eager", "--set", f"compile.cache_dir={tmp_path / 'cache'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "in 1 worker process(es)" in r.stdout and "runs compiled from step 3" in r.stdout
    assert len(list((out / "compile").glob("*/*.json"))) == 1
    assert len({ln.split("compiled by worker ")[1].split()[0] for ln in r.stdout.splitlines()
                if "compiled by worker" in ln}) == 1
    assert "recompiled" not in r.stdout + r.stderr


def test_bench_warmup_modes_bring_their_baseline_and_stay_out_of_all():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import throughput

    assert throughput.parse_modes("warmup") == ["step_compile", "step_compile_dynamic", "warmup_cold",
                                                "warmup_warm"]
    assert not set(throughput.parse_modes("all")) & {"step_compile_dynamic", "warmup_cold", "warmup_warm"}
    assert throughput.BASELINE_OF["step_compile_dynamic"] == "step_compile"


def test_compile_timeline_reads_the_whole_cache_phrase_of_a_switch():
    """inductor's switch lines hold parentheses ("2 FX hit(s)"): the cache phrase and the
    miss flag are read whole."""
    sys.path.insert(0, str(REPO / "bench"))
    from compile_timeline import SWITCH

    hit = ("12:00:01 compile: bucket 800x1344 runs compiled from step 1 (28.3 s for that step: 1 graph(s), "
           "cache: 2 FX hit(s) / 0 miss(es), 1 AOTAutograd hit(s) / 0 miss(es))\n")
    m = SWITCH.search(hit)
    assert m.group(1, 3, 6) == ("800x1344", "1", "cache: 2 FX hit(s) / 0 miss(es), 1 AOTAutograd hit(s) / 0 miss(es)")
    assert m.group(7) is None
    miss = ("12:00:02 compile: bucket 64x64 static_assigner=True runs compiled from step 3 (2.3 s for that step: "
            "1 graph(s), cache: 0 FX hit(s) / 2 miss(es), 0 AOTAutograd hit(s) / 1 miss(es)); cache misses: "
            "the trainer compiled it itself")
    m = SWITCH.search(miss)
    assert m.group(2, 6) == (" static_assigner=True", "cache: 0 FX hit(s) / 2 miss(es), 0 AOTAutograd hit(s) / 1 miss(es)")
    assert m.group(7)


def test_compile_timeline_reads_a_real_launch_and_a_relaunch_starts_compiled(demo_small, tmp_path):
    """bench/compile_timeline.py runs the trainer and reads its log: the plan, the first
    (eager) step, the graph the worker compiled, the bucket's switch, and the longest gap
    between steps from metrics.jsonl; it stops the run (SIGTERM, exit 75) once every bucket
    runs compiled. The relaunch on the same cache starts no worker: the bucket the worker
    compiled before loads at its first step, so the first step already runs compiled.
    Dynamo's eager backend: the orchestration, not inductor's minutes."""
    out, cache = tmp_path / "timeline.json", tmp_path / "cache"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "compile_timeline.py"), "--arch", "ppyoloe",
                        "--size", "s", "--batch-size", "2", "--data", str(demo_small), "--cache-dir", str(cache),
                        "--max-minutes", "10", "--json", str(out),
                        "--set", "compile.backend=eager", "--set", "data.train_sizes=64",
                        "--set", "data.img_size=64", "--set", "data.num_workers=0",
                        "--set", "family.static_assigner_epoch=100", "--set", "optim.epochs=50",
                        # Nice 3, not the default 11: on CI's 2 busy cores a worker at 11
                        # gets a few % of a core and the launch waits minutes for its graph.
                        "--set", "compile.worker_nice=3"],
                       capture_output=True, text=True, env={**ENV, "FASTDET_OPS_BACKEND": "torch"}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The worker ran at the niceness asked for, above the trainer's (this process's).
    (record,) = [json.loads(f.read_text()) for f in (cache / gcache.GRAPHS_DIR).glob("*/*.json")]
    assert record["nice"] == min(19, os.nice(0) + 3), record
    phases = json.loads(out.read_text())["phases"]
    cold, warm = phases["cold"], phases["warm"]
    for row in (cold, warm):
        assert row["status"] == "ok" and row["exit_code"] == 75, row
        assert row["graphs"] == 1 and row["stopped_because"] == "every bucket runs compiled"
    assert (cold["workers"], cold["first_step_kind"]) == (1, "eager")
    assert [g["bucket"] for g in cold["graphs_compiled"]] == ["64x64 static_assigner=True"]
    (sw,) = cold["switches"]
    assert sw["bucket"] == "64x64 static_assigner=True" and not sw["miss"] and sw["step"] >= 2
    assert cold["first_step_seen_s"] <= cold["graphs_compiled"][0]["seen_s"] <= sw["seen_s"]
    # The switch's step is a step of the run, and no gap is longer than the longest.
    gaps = cold["step_gaps_s"]
    assert len(gaps) == cold["steps"] >= sw["step"]
    assert cold["longest_step_gap_s"] == max(gaps) == gaps[cold["longest_step_gap_step"] - 1]
    assert gaps[sw["step"] - 1] >= sw["step_s"] - 0.25
    assert (warm["workers"], warm["first_step_kind"], warm["graphs_compiled"]) == (0, "compiled", [])
    assert [(s["bucket"], s["step"]) for s in warm["switches"]] == [("64x64 static_assigner=True", 1)]
    assert (cache / gcache.GRAPHS_DIR).is_dir()
    # fastdet.compile with the training's flags finds the graph the launch compiled: it
    # starts no worker (a stopped or repeated fill compiles only what is missing).
    c = subprocess.run([sys.executable, "-m", "fastdet.compile", "--arch", "ppyoloe", "--size", "s",
                        "--batch-size", "2", "--data", str(demo_small), "--device", "cpu",
                        "--set", f"compile.cache_dir={cache}", "--set", "compile.backend=eager",
                        "--set", "data.train_sizes=64", "--set", "data.img_size=64",
                        "--set", "family.static_assigner_epoch=100", "--set", "optim.epochs=50"],
                       capture_output=True, text=True, env={**ENV, "FASTDET_OPS_BACKEND": "torch"}, timeout=300)
    assert c.returncode == 0, c.stderr[-3000:]
    assert f"1 of 1 graph(s) were compiled into {cache} before; 0 to go" in c.stderr, c.stderr[-3000:]
    assert "worker process" not in c.stderr


def test_graph_key_holds_what_shapes_the_graph_and_nothing_else():
    """A relaunch that changes only the run (steps, schedule, data paths, warm-up) finds the
    graphs of the earlier launch; one that changes the graph (batch, classes, AMP, layout,
    DDP, threads on the CPU, the device) does not."""
    cfg = registry.get_preset("ppyoloe", "s")
    key = gcache.graph_key(cfg, "cpu", False, 2)
    same = {"run.max_steps": 10, "optim.epochs": 3, "optim.base_lr": 0.1, "data.data": "/elsewhere",
            "compile.warmup": "blocking", "compile.workers": 3, "run.log_interval": 1,
            "model.backbone_weights": "/w.pth"}
    for k, v in same.items():
        assert gcache.graph_key(apply_overrides(cfg, {k: v}), "cpu", False, 2) == key, k
    other = {"data.batch_size": 3, "model.num_classes": 3, "compile.amp": "off", "data.channels_last": True,
             "data.max_boxes": 7, "compile.shapes": "dynamic"}
    keys = {gcache.graph_key(apply_overrides(cfg, {k: v}), "cpu", False, 2) for k, v in other.items()}
    keys |= {gcache.graph_key(cfg, "cpu", True, 2), gcache.graph_key(cfg, "cpu", False, 1),
             gcache.graph_key(cfg, "meta", False, 2)}
    # A DDP launch's graphs hold its world size (the collectives' group size, the mean's / W).
    keys |= {gcache.graph_key(cfg, "cpu", True, 2, 2), gcache.graph_key(cfg, "cpu", True, 2, 8)}
    assert len(keys) == len(other) + 5 and key not in keys
    assert gcache.graph_key(cfg, "cpu", True, 2, 1) == gcache.graph_key(cfg, "cpu", True, 2)
    assert gcache.graph_key(cfg, "cpu", False, 2, 8) == key  # no DDP: no collective in the graph
    # A bucket is known once a worker has recorded it under the key.
    b = gcache.Bucket.of(64, 96, {"static_assigner": True})
    assert gcache.compiled_before(Path("/nonexistent"), key, [b]) == [False]


def _processes_with(text: str) -> list[int]:
    """Live processes whose environment holds ``text`` (a test's own cache path: the
    fastdet.compile process, its workers and anything they started)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env, stat = (d / "environ").read_bytes(), (d / "stat").read_text()
            except OSError:
                continue
            if text.encode() in env and stat.rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(d.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_compile_cli_leaves_no_worker_behind_when_stopped(tmp_path, sig):
    """A killed ``fastdet.compile`` (a scheduler's SIGTERM, or SIGKILL mid-graph) takes its
    workers with it: an orphan would go on compiling for up to an hour on the cores of
    the next launch. SIGTERM also says what was compiled and exits 143."""
    import signal
    import time

    cache = tmp_path / f"cache-{sig}"
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "fastdet.compile", "--arch", "ppyoloe", "--size", "s", "--num-classes", "4",
           "--device", "cpu", "--img-size", "64", "--no-multiscale", "--batch-size", "2", "--epochs", "1",
           "--set", "family.static_assigner_epoch=100"]
    log = tmp_path / f"compile-{sig}.log"
    with open(log, "w") as f:  # a file, not a pipe: an orphan holding it would block a reader
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)

    def started() -> bool:
        # SIGKILL: mid-graph (inductor has begun writing kernels into the cache, past the
        # worker's check between graphs); SIGTERM: the worker (and multiprocessing's
        # resource tracker) are up.
        if "in 1 worker process(es)" not in log.read_text():
            return False
        if sig == "SIGKILL":
            return cache.is_dir() and any(f.is_file() for f in cache.rglob("*"))
        return len(_processes_with(str(cache))) >= 3

    try:
        deadline = time.monotonic() + 300
        while not started() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert started() and p.poll() is None, log.read_text()[-3000:]
        p.send_signal(getattr(signal, sig))
        p.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _processes_with(str(cache)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _processes_with(str(cache))
        assert left == [], f"{sig}: {len(left)} process(es) of the stopped fastdet.compile still running"
    finally:
        for pid in [p.pid] * (p.poll() is None) + _processes_with(str(cache)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    rest = log.read_text()
    if sig == "SIGTERM":
        assert p.returncode == 143, rest[-2000:]
        assert "fastdet.compile: stopped (SIGTERM) with 0 of 1 graph(s) compiled" in rest, rest[-2000:]


def test_a_graph_with_a_custom_autograd_function_loads_from_the_autograd_cache(tmp_path):
    """FCOS's fused focal loss is a torch.autograd.Function: with the trainer's cache set-up
    (``use_cache_dir``) AOTAutograd caches its graphs (a miss, then a hit in a new process)
    instead of bypassing them, so a relaunch does not redo the joint trace and partition."""
    script = textwrap.dedent("""
        import json, sys
        from pathlib import Path
        import torch
        from fastdet.engine import graph_cache as gcache
        from fastdet.losses import sigmoid_focal_loss

        gcache.use_cache_dir(Path(sys.argv[1]))
        c0 = gcache.cache_counts()
        f = torch.compile(lambda x, t: sigmoid_focal_loss(x * 2, t), backend="inductor", fullgraph=True)
        x = torch.linspace(-3, 3, 24).reshape(6, 4).requires_grad_()
        t = (torch.arange(24).reshape(6, 4) % 3 == 0).float()
        f(x, t).backward()
        print(json.dumps(gcache.count_delta(c0, gcache.cache_counts())))
    """)
    counts = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], capture_output=True,
                           text=True, env=ENV, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        counts.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert (counts[0]["aot_miss"], counts[0]["aot_hit"]) == (1, 0), counts
    assert (counts[1]["aot_miss"], counts[1]["aot_hit"]) == (0, 1), counts


# --------------------------------------------------------------------------- a worker's graphs under torchrun


def _capture_backend(codes: list[str]):
    """A torch.compile backend that records the code of every forward and backward graph
    AOTAutograd hands on (the graphs inductor would compile and key its cache on)."""
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        codes.append(gm.code)
        return gm

    return aot_autograd(fw_compiler=record, bw_compiler=record)


class _TinySyncBNNet(torch.nn.Module):
    """Convs with SyncBatchNorm and a loss divided by the rank-mean of a normaliser: the two
    collectives a family's step traces under torchrun with ``model.sync_bn``."""

    def __init__(self):
        super().__init__()
        from fastdet.engine.sync_bn import convert_sync_batchnorm

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                  torch.nn.Conv2d(8, 4, 1))
        self.net = convert_sync_batchnorm(net)

    def forward(self, x):
        from fastdet.losses import all_reduce_mean

        y = self.net(x)
        return y.square().sum() / all_reduce_mean(y.detach().abs().sum()).clamp(min=1)


def _tiny_graphs(ddp_module) -> list[str]:
    codes: list[str] = []
    compiled = torch.compile(_TinySyncBNNet(), fullgraph=True, backend=_capture_backend(codes))
    model = ddp_module(compiled)
    model(torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))).backward()
    return codes


def _tiny_rank(rank, world_size, port, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results[rank] = _tiny_graphs(torch.nn.parallel.DistributedDataParallel)
    finally:
        dist.destroy_process_group()


def _tiny_worker(world_size, results):
    """What a compile worker of a ``world_size``-rank launch does before compiling."""
    from fastdet.engine import compile_workers

    compile_workers._worker_process_group(world_size)

    def ddp(module):
        wrapped = torch.nn.parallel.DistributedDataParallel(module)
        if world_size > 1:
            wrapped.register_comm_hook(None, compile_workers._no_gradient_exchange)
        return wrapped

    results["worker"] = _tiny_graphs(ddp)


def test_a_compile_worker_traces_the_graphs_of_a_two_rank_launch():
    """Under torchrun the ranks' graphs hold their collectives (SyncBatchNorm's all-gather,
    the loss normaliser's all-reduce and its / 2); a worker compiling for them, one process,
    must trace the very same forward and backward graphs, or every graph it compiles misses
    the ranks' cache lookup (it did: its one-process group traced neither collective)."""
    import torch.multiprocessing as mp
    from ports import spawn_gloo_ranks

    ranks = spawn_gloo_ranks(_tiny_rank)
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        p = mp.get_context("spawn").Process(target=_tiny_worker, args=(2, results))
        p.start()
        p.join(300)
        worker = results.get("worker")
    assert p.exitcode == 0 and worker is not None
    assert ranks[0] == ranks[1] and len(ranks[0]) == 2  # forward, backward
    assert "_c10d_functional.all_gather_into_tensor" in ranks[0][0] and "_c10d_functional.all_reduce" in ranks[0][0]
    assert worker == ranks[0]


def _step_rank(rank, world_size, port, results):
    import torch.distributed as dist
    from torch._dynamo import register_backend

    codes: list[str] = []
    register_backend(name="fastdet_test_capture")(_capture_backend(codes))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        from fastdet.engine.step import build_train_step

        cfg = registry.config_from_dict(results["cfg"])
        step = build_train_step(cfg, torch.device("cpu"), ddp=True, world_size=world_size, cuda_graphs=False)
        variants = registry.loss_variants(cfg, 0, cfg.optim.epochs - 1)[:1]
        step.warmup([(64, 64)], cfg.data.batch_size, cfg.data.max_boxes, variants)
        results[rank] = codes
    finally:
        dist.destroy_process_group()


def _step_worker(cfg_dict, cache, results):
    from torch._dynamo import register_backend

    from fastdet.engine import compile_workers

    codes: list[str] = []
    register_backend(name="fastdet_test_capture")(_capture_backend(codes))
    cfg = registry.config_from_dict(cfg_dict)
    variants = registry.loss_variants(cfg, 0, cfg.optim.epochs - 1)[:1]
    (bucket,) = gcache.train_buckets([(64, 64)], variants)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    (record,) = compile_workers.compile_buckets(cfg_dict, [bucket], None, "cpu", True, world_size=2)
    results["worker"] = (record["ok"], record.get("error"), codes)


@pytest.mark.slow
def test_a_compile_worker_compiles_the_step_every_rank_of_a_sync_bn_launch_runs(tmp_path):
    """The real thing: PP-YOLOE-s's train step with SyncBatchNorm (its recipe's
    ``model.sync_bn``), as ``compile_buckets`` builds it for a 2-rank launch, against the step
    the trainer builds on each of 2 gloo ranks: the same forward and backward graphs."""
    import torch.multiprocessing as mp

    cfg = apply_overrides(registry.resolve(registry.get_preset("ppyoloe", "s")), {
        "data.batch_size": 2, "data.max_boxes": 4, "data.img_size": 64, "data.train_sizes": (64,),
        "model.num_classes": 4, "model.sync_bn": True, "compile.compile": True,
        "compile.backend": "fastdet_test_capture"})
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        p = mp.get_context("spawn").Process(target=_step_worker, args=(cfg.to_dict(), str(tmp_path), results))
        p.start()
        p.join(1200)
        ok, error, worker = results["worker"]
    assert p.exitcode == 0 and ok, error

    with mp.get_context("spawn").Manager() as manager:
        shared = manager.dict(cfg=cfg.to_dict())
        mp.start_processes(_step_rank, args=(2, free_port(), shared), nprocs=2, start_method="spawn")
        ranks = {0: shared[0], 1: shared[1]}
    assert ranks[0] == ranks[1] and len(ranks[0]) >= 2
    assert any("all_gather_into_tensor" in c for c in ranks[0]) and any("_c10d_functional.all_reduce" in c
                                                                        for c in ranks[0])
    assert worker == ranks[0]
