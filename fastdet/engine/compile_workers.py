"""Compile without the wait: worker processes fill inductor's on-disk caches while training runs.

With ``--compile`` (``compile.warmup=background``, the default) the trainer does not compile
before its first step. It lists every graph the run will need, one per *bucket*
(``fastdet/engine/graph_cache.py``: an image size (H, W) x a set of loss arguments), and
local rank 0 of each machine starts worker processes that compile those buckets, in the
order training first meets them, with the step :func:`~fastdet.engine.step.build_train_step`
builds for the trainer, on synthetic batches. Compiling writes inductor's caches under one
directory per machine, which every rank and every later launch reads. Meanwhile each step of
a bucket that is not ready runs the step's eager twin (the same module and the same
function, without ``torch.compile``); when a worker has written a bucket, the trainer
compiles that bucket itself, which now is a cache load of seconds, and the bucket runs
compiled (and, with ``--cuda-graphs``, captured) from then on.

Workers mark a finished bucket with a small JSON file in a directory of this launch
(``<output dir>/compile/<host>-<launch>``), so every rank on the machine sees it. A single
process checks the directory every step (a few ``stat`` calls); ranks check it at each log
interval and switch a bucket only once every rank has seen it (one small all-reduce there,
next to the loss all-reduce), so all ranks run the same kind of step.

Cache keys must match between a worker and the trainer: both build their step with
``build_train_step`` from the same config and, under torchrun, the worker wraps it in DDP
too, so Dynamo's DDP optimizer cuts the graph at the same bucket boundaries. The ranks'
graphs hold collectives of the launch's world size W (the loss normaliser's all-reduce and
its ``/ W``; SyncBatchNorm's all-gather, ``model.sync_bn``), so the worker traces in a fake
process group of W ranks (torch's ``fake`` backend: rank 0 of W, collectives that move no
data) and builds its step for W ranks; a one-process group would trace a graph without
them that no rank ever loads. Inductor's key holds the device (``cuda:N``), so on a GPU
machine launch with ``torchrun --virtual-local-rank`` (every rank's device is ``cuda:0``)
for ranks to share the graphs; otherwise ranks other than local rank 0 miss the cache and
compile at the switch.

:class:`CompileWorkers` is the one object that plans the buckets, starts, polls, reports and
closes the workers: the trainer drives it (``warmup`` before step 1, ``poll`` after steps,
``status`` for the progress bar, ``close`` at the end), and so does ``python -m
fastdet.compile`` (``plan``, ``start``, ``wait``, ``close``).
"""

from __future__ import annotations

import inspect
import json
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.distributed

from fastdet import registry
from fastdet.config import Config
from fastdet.engine.graph_cache import (Bucket, bucket_sizes, cache_counts, cache_dir_in_use, compiled_before,
                                        compiled_dir, count_delta, describe_cache, graph_key, launch_id,
                                        ready_dir_for, resolve_cache_dir, train_buckets, use_cache_dir)
from fastdet.engine.step import TrainStep, build_train_step
from fastdet.runtime import dist
from fastdet.runtime.amp import backend_flags
from fastdet.runtime.logging import StepGaps

log = logging.getLogger("fastdet")


class CompileError(RuntimeError):
    """A compile worker failed on a bucket: training stops loudly."""


def plan_workers(n_buckets: int, requested: int, local_ranks: int, cpus: int | None = None
                 ) -> tuple[int, int]:
    """(worker processes, compile threads per worker) for one machine.

    One worker per 8 cores (2 cores: 1; 16: 2), at most one per bucket, unless
    ``compile.workers`` says otherwise. Each worker's compile threads share the cores left
    by the training ranks, so ranks + workers x threads stays within the cores."""
    cpus = cpus or os.cpu_count() or 1
    workers = requested if requested > 0 else max(1, cpus // 8)
    workers = max(1, min(workers, n_buckets))
    threads = max(1, (cpus - local_ranks) // workers)
    return workers, threads


# --------------------------------------------------------------------------- the worker

def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a record."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _worker_process_group(world_size: int) -> None:
    """The process group a worker compiles a torchrun launch's graphs in: rank 0 of
    ``world_size``. One rank: a one-process gloo group (DDP's wrapping is all the graph
    sees). More: torch's ``fake`` backend, whose collectives move no data, so the traced
    all-reduce / all-gather carry the launch's group size and the default group's name, as
    on every rank (the values a worker computes are never used)."""
    if torch.distributed.is_initialized():
        return
    if world_size > 1:
        # Importing it registers the "fake" backend (torch keeps it beside its test
        # helpers); only a worker of a multi-rank launch needs it.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        return
    store_file = tempfile.NamedTemporaryFile(prefix="fastdet-compile-", delete=False).name
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store_file, 1),
                                         rank=0, world_size=1)


def _no_gradient_exchange(state, bucket):  # unannotated: DDP checks a hook's annotations by identity
    """DDP comm hook of a worker in a fake group: the bucket's gradients as they are (the
    fake all-reduce returns nothing, which DDP's reducer refuses). The hook runs outside
    the compiled graphs, so they are the ranks'."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def compile_buckets(cfg_dict: dict[str, Any], buckets: list[Bucket], ready_dir: str | None, device: str,
                    ddp: bool, nice: int = 0, parent: int | None = None,
                    report=None, torch_threads: int | None = None, world_size: int = 1) -> list[dict[str, Any]]:
    """Compile ``buckets`` as the trainer's step would (forward + loss + backward, on a
    synthetic batch), filling inductor's caches; one record per bucket, also written to
    ``ready_dir/<bucket.file_id>.json`` when given. ``report(record)`` is called after each.
    ``ddp``: the graphs of a torchrun launch of ``world_size`` ranks."""
    if nice:
        os.nice(nice)  # training ranks keep their share of the cores
    if torch_threads:
        # inductor's CPU kernels, and so its cache key, depend on torch's thread count:
        # the worker uses the trainer's, or the trainer would miss every entry.
        torch.set_num_threads(torch_threads)
    cfg = registry.config_from_dict(cfg_dict)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # The trainer's cuDNN / TF32 flags: inductor's cache key holds the matmul precision, so
    # a worker compiling with torch's defaults under compile.tf32=true fills entries the
    # trainer never hits.
    backend_flags(dev, cfg.compile.tf32)
    world_size = world_size if ddp else 1
    if ddp:
        _worker_process_group(world_size)
    step = build_train_step(cfg, dev, ddp=ddp, world_size=world_size, cuda_graphs=False)
    if ddp and world_size > 1:
        step.forward.register_comm_hook(None, _no_gradient_exchange)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(buckets) + 2)
    done_dir = compiled_dir(resolve_cache_dir(), graph_key(cfg, dev, ddp, torch.get_num_threads(), world_size))
    done_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for b in buckets:
        if parent is not None and os.getppid() != parent:
            break  # the trainer is gone: nothing will read the rest
        t0, c0 = time.perf_counter(), cache_counts()
        record: dict[str, Any] = {"bucket": b.name, "pid": os.getpid(), "nice": os.nice(0)}
        try:
            step.warmup([(b.h, b.w)], cfg.data.batch_size, cfg.data.max_boxes, [b.kwargs],
                        channels_last=cfg.data.channels_last)
            record["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which stops loudly
            record.update(ok=False, error=f"{type(e).__name__}: {e}".splitlines()[0][:500])
        record["seconds"] = time.perf_counter() - t0
        record["cache"] = count_delta(c0, cache_counts())
        records.append(record)
        if record["ok"]:  # later launches on this cache load it at the bucket's first step
            _write_json(done_dir / f"{b.file_id}.json", record)
        if ready_dir is not None:
            _write_json(Path(ready_dir) / f"{b.file_id}.json", record)
        if report is not None:
            report(record)
        if not record["ok"]:
            break
    return records


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """In a worker: exit once ``parent`` is gone (killed, SIGKILLed by a scheduler, out of
    memory). One graph compiles for minutes, up to an hour on a small CPU, so waiting for
    the end of the graph would leave an orphan taking the cores of the next launch.
    Inductor writes each cache entry to a temporary file and renames it, so stopping
    mid-compile leaves no partial entry."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="fastdet-parent-watch", daemon=True).start()


def _worker_entry(*args: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    parent = inspect.signature(compile_buckets).bind(*args).arguments.get("parent")
    if parent is not None:
        _exit_with_parent(parent)
    compile_buckets(*args)


# --------------------------------------------------------------------------- the workers of a launch

class CompileWorkers:
    """The compilation of one training launch or one ``python -m fastdet.compile``: which
    buckets to compile, the worker processes compiling them, what they have finished, and
    the log lines that say so.

    Args:
        step: the trainer's step (None for ``fastdet.compile``): finished buckets are marked
            ready in it, and its switches to compiled buckets are logged.
        out_dir: the run's output directory (the trainer's): holds this launch's ready directory.
        ddp: compile the graphs of a DDP launch of ``world_size`` ranks (default: ``ranks``'
            world size).
        ranks: a distributed trainer's :class:`~fastdet.runtime.dist.DistInfo`: local rank 0
            starts the workers, and every rank agrees on what is ready (one all-reduce).
        cores: the cores the workers may use (default: the machine's): workers x compile
            threads stay within them (``python -m fastdet.compile --cores``).
    """

    def __init__(self, cfg: Config, device: torch.device, *, step: TrainStep | None = None,
                 out_dir: Path | None = None, ddp: bool = False, ranks: dist.DistInfo | None = None,
                 world_size: int | None = None, cores: int | None = None):
        self.cfg, self.device, self.step, self.out_dir, self.ddp = cfg, device, step, out_dir, ddp
        self.cores = cores
        # The launch's ranks: the graphs' collectives hold their count.
        self.world_size = world_size or (ranks.world_size if ranks is not None else 1)
        self.agree_ranks = ranks is not None and ranks.distributed
        self.local_rank = ranks.local_rank if ranks is not None else 0
        # Training ranks on this machine (none beside fastdet.compile's workers).
        self.local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if step is not None else 0
        self.sizes: list[tuple[int, int]] = []  # (H, W) of the buckets
        self.buckets: list[Bucket] = []  # to compile (not compiled into the cache before)
        self.pending: list[Bucket] = []
        self.done: dict[Bucket, dict[str, Any]] = {}
        self.workers, self.threads = 0, 0
        self.procs: list[Any] = []
        self.ready_dir: Path | None = None
        self.cache: Path | None = None
        self.key = ""
        self.background = False  # the trainer's workers were started (compile.warmup=background)
        self.t0 = time.perf_counter()
        self.total_s: float | None = None
        self._dead_reported = False

    # ------------------------------------------------------------------ planning
    def plan(self, variants: list[dict[str, Any]]) -> tuple[list[Bucket], list[bool]]:
        """Every bucket of ``variants`` x the config's sizes, and whether each was compiled
        into the cache before (by an earlier launch or ``fastdet.compile``; ranks agree);
        the others are left to the workers, sized to the cores."""
        self.cache = use_cache_dir(resolve_cache_dir(self.cfg.compile.cache_dir))
        self.sizes = bucket_sizes(self.cfg)
        every = train_buckets(self.sizes, variants)
        self.key = graph_key(self.cfg, self.device, self.ddp, torch.get_num_threads(), self.world_size)
        known = compiled_before(self.cache, self.key, every)
        if self.agree_ranks:
            known = [bool(k) for k in self._agree_min([int(k) for k in known])]
        self.buckets = [b for b, k in zip(every, known) if not k]
        self.pending = list(self.buckets)
        self.workers, self.threads = plan_workers(max(1, len(self.buckets)), self.cfg.compile.workers,
                                                  self.local_ranks, cpus=self.cores)
        if not self.buckets:  # every graph was compiled before: no worker to start
            self.workers = 0
        return every, known

    def _agree_min(self, flags: list[int]) -> list[int]:
        t = torch.tensor(flags, dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return t.tolist()

    # ------------------------------------------------------------------ the processes
    def start(self, ready_dir: Path) -> None:
        """Local rank 0: a fresh ready directory and the worker processes, each given every
        ``workers``-th bucket in the order of use (so the first buckets come first)."""
        self.ready_dir = ready_dir
        self.t0 = time.perf_counter()
        if self.local_rank != 0:
            return
        ready_dir.mkdir(parents=True, exist_ok=True)
        for old in ready_dir.glob("*.json"):
            old.unlink()
        ctx = mp.get_context("spawn")
        # Workers read these when they import torch (their inductor compile threads: the
        # launch's share of the cores); the trainer keeps its own.
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")}
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(self.threads)
        try:
            for i in range(self.workers):
                share = self.buckets[i:: self.workers]
                p = ctx.Process(target=_worker_entry, name=f"fastdet-compile-{i}",
                                args=(self.cfg.to_dict(), share, str(ready_dir), str(self.device),
                                      self.ddp, self.cfg.compile.worker_nice, os.getpid(), None,
                                      torch.get_num_threads(), self.world_size))
                p.start()
                self.procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def poll_ready(self) -> list[tuple[Bucket, dict[str, Any]]]:
        """Buckets newly finished (on every rank of a distributed trainer)."""
        if self.ready_dir is None:
            return []
        seen = [(self.ready_dir / f"{b.file_id}.json").is_file() for b in self.pending]
        if self.agree_ranks and self.pending:
            seen = [bool(x) for x in self._agree_min([int(s) for s in seen])]
        out = []
        for b, s in zip(list(self.pending), seen):
            if s:
                record = json.loads((self.ready_dir / f"{b.file_id}.json").read_text())
                self.pending.remove(b)
                self.done[b] = record
                out.append((b, record))
        if not self.pending and self.total_s is None:
            self.total_s = time.perf_counter() - self.t0
        return out

    def dead_workers(self) -> list[str]:
        """Workers that exited with buckets of theirs unfinished (killed, out of memory)."""
        out = []
        for i, p in enumerate(self.procs):
            mine = self.buckets[i:: self.workers]
            if p.exitcode is not None and any(b in self.pending for b in mine):
                out.append(f"{p.name} (exit code {p.exitcode})")
        return out

    def close(self) -> None:
        """Stop the workers still compiling (training is over); the cache keeps what they wrote."""
        if self.background and self.pending:
            log.info("compile: training ended with %d of %d graph(s) not compiled; the workers stop "
                     "(the cache keeps what they finished)", len(self.pending), len(self.buckets))
        self.background = False
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=30)
        self.procs = []

    # ------------------------------------------------------------------ python -m fastdet.compile
    def wait(self, every_s: float = 0.5) -> bool:
        """Log each graph as the workers finish it, until none is pending; False when one
        failed or a worker stopped with graphs left."""
        while self.pending:
            failed = False
            for b, rec in self.poll_ready():
                if rec.get("ok"):
                    log.info("graph %d/%d (%s): %.1f s (%s)", len(self.done), len(self.buckets), b.name,
                             rec["seconds"], describe_cache(rec.get("cache", {})))
                else:
                    log.error("graph %s failed: %s", b.name, rec.get("error"))
                    failed = True
            dead = self.dead_workers()
            if dead:
                log.error("worker(s) %s stopped with %d graph(s) left", ", ".join(dead), len(self.pending))
            if dead or failed:
                return False
            time.sleep(every_s)
        return True

    # ------------------------------------------------------------------ the trainer's side
    def warmup(self, epoch: int, steps_per_epoch: int) -> None:
        """Before the first step of a run starting at ``epoch``: with ``--compile`` start the
        workers (compile.warmup=background) or compile every bucket now (blocking); with
        ``--cuda-graphs`` alone capture every bucket now."""
        cfg, step = self.cfg, self.step
        assert step is not None, "CompileWorkers.warmup drives a trainer's step"
        if not (cfg.compile.compile or cfg.compile.cuda_graphs):
            return
        last_epoch = cfg.optim.epochs - 1
        if cfg.run.max_steps > 0:
            last_epoch = min(last_epoch, (cfg.run.max_steps - 1) // steps_per_epoch)
        # Every phase the rest of the run goes through: its distinct loss arguments x the
        # loader's size buckets, so that nothing compiles after warm-up.
        variants = registry.loss_variants(cfg, epoch, last_epoch)
        if cfg.compile.compile and cfg.compile.warmup == "background":
            self._start_background(variants)
            return
        sizes = bucket_sizes(cfg)
        if cfg.compile.compile:  # blocking: the same shared cache as the workers and fastdet.compile
            use_cache_dir(resolve_cache_dir(cfg.compile.cache_dir))
        c0 = cache_counts()
        t = time.perf_counter()
        step.warmup(sizes, cfg.data.batch_size, cfg.data.max_boxes, variants, channels_last=cfg.data.channels_last)
        log.info("warm-up: %d size bucket(s) x %d loss variant(s) compiled%s in %.1f s (inductor %s, %s)",
                 len(sizes), len(variants), " and captured" if cfg.compile.cuda_graphs else "",
                 time.perf_counter() - t, cache_dir_in_use(), describe_cache(count_delta(c0, cache_counts())))

    def _start_background(self, variants: list[dict[str, Any]]) -> None:
        """compile.warmup=background: start the workers; training starts at once on the eager twin."""
        cfg, step = self.cfg, self.step
        assert step is not None and self.out_dir is not None
        # This process only loads graphs: its own compile threads must not take the cores
        # of the other ranks and the workers.
        torch._inductor.config.compile_threads = max(1, (os.cpu_count() or 1) // max(1, self.local_ranks))
        launch = dist.broadcast_object(launch_id())
        # Graphs an earlier launch (or python -m fastdet.compile) compiled into this cache are
        # loaded at their bucket's first step; the workers compile only the others.
        buckets, known = self.plan(variants)
        if self.device.type == "cuda" and self.ddp and self.device.index != 0:
            log.warning("compile: this rank's device is %s and inductor's cache key holds the device, "
                        "so it cannot load the graphs local rank 0's workers compile for cuda:0; "
                        "launch with torchrun --virtual-local-rank to share them", self.device)
        if len(self.buckets) < len(buckets):
            log.info("compile: %d of %d graph(s) were compiled into this cache by an earlier launch or "
                     "python -m fastdet.compile (%s): each loads at its bucket's first step",
                     len(buckets) - len(self.buckets), len(buckets), compiled_dir(self.cache, self.key))
        log.info("compile: %d graph(s) (%d size bucket(s) x %d loss variant(s)) in %d worker "
                 "process(es) x %d compile thread(s) at nice %d, backend %s; training starts eager and each "
                 "bucket switches to its compiled%s step when its graph is ready; inductor cache %s "
                 "(compile.cache_dir or TORCHINDUCTOR_CACHE_DIR moves it; python -m fastdet.compile "
                 "fills it ahead of time)", len(buckets), len(self.sizes), len(variants),
                 self.workers, self.threads, cfg.compile.worker_nice, cfg.compile.backend,
                 " and captured" if cfg.compile.cuda_graphs else "", self.cache)
        step.begin_background(len(buckets))
        for b, k in zip(buckets, known):
            if k:
                step.mark_ready(b.h, b.w, b.kwargs)
        dist.barrier()  # the ready directory is fresh before any rank looks into it
        self.start(ready_dir_for(self.out_dir, launch))
        self.background = True

    def poll(self, at_step: int, gaps: StepGaps) -> None:
        """After step ``at_step``: buckets the workers finished become ready; switches done by
        the last step are logged."""
        if not self.background:
            return
        assert self.step is not None
        for sw in self.step.take_switches():
            h, w, kw = sw.key
            how = describe_cache(sw.cache)
            msg = ("compile: bucket %dx%d%s runs compiled from step %d (%.1f s for that step: "
                   "%d graph(s), %s)")
            args = (h, w, "".join(f" {k}={v}" for k, v in kw), at_step, sw.seconds, sw.graphs, how)
            if sw.cache.get("fx_miss", 0) or sw.cache.get("aot_miss", 0):
                log.warning(msg + "; cache misses: the trainer compiled it itself", *args)
            else:
                log.info(msg, *args)
        if not self.pending:
            return
        for b, record in self.poll_ready():
            if not record.get("ok", False):
                raise CompileError(f"compile worker failed on bucket {b.name}: {record.get('error')}")
            log.info("compile: graph %d/%d (%s) compiled by worker %s in %.1f s (%s)", len(self.done),
                     len(self.buckets), b.name, record.get("pid"), record["seconds"],
                     describe_cache(record.get("cache", {})))
            self.step.mark_ready(b.h, b.w, b.kwargs)
        if self.total_s is not None:
            log.info("compile: all %d graph(s) compiled, %.1f s after training started; longest gap "
                     "between two steps so far %.1f s (step %d)", len(self.buckets), self.total_s,
                     gaps.longest, gaps.longest_step)
        dead = self.dead_workers()
        if dead and not self._dead_reported:
            self._dead_reported = True
            log.error("compile: worker(s) %s stopped with %d bucket(s) left; those train eagerly in "
                      "this run", ", ".join(dead), len(self.pending))

    def status(self) -> str:
        """The progress bar's postfix: how many graphs are compiled while some are not."""
        if not self.background or (not self.pending and not self.step.switches):
            return ""
        return f"compiled {len(self.done)}/{len(self.buckets)}, {self.step.compiled_buckets} running compiled"
