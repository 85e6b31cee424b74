"""Compile without the wait: worker processes fill inductor's on-disk caches while training runs.

With ``--compile`` (``compile.warmup=background``, the default) the trainer does not compile
before its first step. It lists every graph the run will need, one per *bucket* (an image
size (H, W) x a set of loss arguments, e.g. PP-YOLOE's ATSS / task-aligned phases), and
local rank 0 of each machine starts worker processes that compile those buckets, in the
order training first meets them, with the trainer's own :class:`~fastdet.engine.step.TrainStep`
on synthetic batches. Compiling writes inductor's FX graph cache and AOTAutograd cache under
one directory per machine (:func:`resolve_cache_dir`), which every rank and every later
launch reads. Meanwhile each step of a bucket that is not ready runs the step's eager twin
(the same module and the same function, without ``torch.compile``); when a worker has
written a bucket, the trainer compiles that bucket itself, which now is a cache load of
seconds, and the bucket runs compiled (and, with ``--cuda-graphs``, captured) from then on.

Workers mark a finished bucket with a small JSON file in a directory of this launch
(``<output dir>/compile/<host>-<launch>``), so every rank on the machine sees it. A single
process checks the directory every step (a few ``stat`` calls); ranks check it at each log
interval and switch a bucket only once every rank has seen it (one small all-reduce there,
next to the loss all-reduce), so all ranks run the same kind of step.

Cache keys must match between a worker and the trainer: the worker builds the same model,
optimizer, AMP, layout, BatchNorm mode and, under torchrun, the same DDP wrapping (a
one-process gloo group, so Dynamo's DDP optimizer cuts the graph at the same bucket
boundaries). Inductor's key holds the device (``cuda:N``), so on a GPU machine launch with
``torchrun --virtual-local-rank`` (every rank's device is ``cuda:0``) for ranks to share the
graphs; otherwise ranks other than local rank 0 miss the cache and compile at the switch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fastdet")

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


# --------------------------------------------------------------------------- buckets

@dataclass(frozen=True)
class Bucket:
    """One compiled graph: an image size and the loss arguments (sorted (name, value) pairs)."""

    h: int
    w: int
    kw: tuple

    @classmethod
    def of(cls, h: int, w: int, kwargs: dict[str, Any]) -> "Bucket":
        return cls(int(h), int(w), tuple(sorted(kwargs.items())))

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.kw)

    @property
    def name(self) -> str:
        args = " ".join(f"{k}={v}" for k, v in self.kw)
        return f"{self.h}x{self.w}" + (f" {args}" if args else "")

    @property
    def file_id(self) -> str:
        return hashlib.sha1(repr((self.h, self.w, self.kw)).encode()).hexdigest()[:16]


def bucket_sizes(cfg) -> list[tuple[int, int]]:
    """Every (H, W) the training loader of ``cfg`` can yield (without reading the data):
    each square size of ``data.train_sizes`` and, with keep-ratio resizing, its canvases."""
    from fastdet import registry
    from fastdet.data import stages as S
    from fastdet.data.loader import canvases_for, train_sizes

    rs = S.resize_of(S.check_stages(registry.phase(cfg, 0).stages))
    canvases = canvases_for(rs.mode, rs.short, rs.max_long)
    return list(dict.fromkeys(hw for s in train_sizes(cfg.data) for hw in canvases.buckets(s)))


def train_buckets(sizes: list[tuple[int, int]], variants: list[dict[str, Any]]) -> list[Bucket]:
    """Buckets in the order training first meets them: the loss variants in order of use,
    each over the size buckets."""
    return [Bucket.of(h, w, kw) for kw in variants for h, w in sizes]


# --------------------------------------------------------------------------- where and how many

def resolve_cache_dir(setting: str = "") -> Path:
    """inductor's cache directory: ``compile.cache_dir``, else ``$TORCHINDUCTOR_CACHE_DIR``,
    else ``~/.cache/fastdet/inductor`` (one per user and machine, shared by ranks, relaunches,
    the compile workers and ``python -m fastdet.compile``)."""
    path = setting or os.environ.get(CACHE_ENV) or "~/.cache/fastdet/inductor"
    return Path(path).expanduser().resolve()


# AOTAutograd's cache skips ("bypasses") a graph holding a custom autograd.Function unless
# this is set; FCOS's fused focal loss is one, so without it every load of an FCOS graph
# re-runs AOTAutograd's joint trace and partition. Dynamo traces the Function's forward and
# backward into the graph, so the cache key covers their code.
AUTOGRAD_FN_ENV = "TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD"


def use_cache_dir(path: Path) -> Path:
    """Point inductor (this process and the workers it starts) at ``path``, with the
    AOTAutograd cache serving graphs that hold a custom autograd.Function."""
    import torch._functorch.config

    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    os.environ[AUTOGRAD_FN_ENV] = "1"  # read by spawned workers when they import torch
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    return path


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


# --------------------------------------------------------------------------- cache counters

def cache_counts() -> dict[str, int]:
    """inductor's FX graph cache and AOTAutograd cache hits and misses in this process."""
    c = torch._dynamo.utils.counters
    return {"fx_hit": int(c["inductor"]["fxgraph_cache_hit"]), "fx_miss": int(c["inductor"]["fxgraph_cache_miss"]),
            "aot_hit": int(c["aot_autograd"]["autograd_cache_hit"]),
            "aot_miss": int(c["aot_autograd"]["autograd_cache_miss"])}


def count_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def describe_cache(d: dict[str, int]) -> str:
    """Inductor's cache counters as a log phrase; none (``{}`` or all zero) on a backend without a cache."""
    if not any(d.values()):
        return "no inductor cache (backend without one)"
    return (f"cache: {d['fx_hit']} FX hit(s) / {d['fx_miss']} miss(es), "
            f"{d['aot_hit']} AOTAutograd hit(s) / {d['aot_miss']} miss(es)")


# --------------------------------------------------------------------------- graphs compiled before

GRAPHS_DIR = "fastdet-graphs"  # under the inductor cache: what earlier launches compiled into it

# The config fields a bucket's graph does not depend on: where the data is, the run's
# length and intervals, the LR schedule (the step reads the LR from a tensor), and how the
# warm-up itself runs. Everything else is in the key, so a changed setting misses (its
# graphs compile again in the workers) rather than loading a graph of another config.
_NOT_IN_GRAPH = {
    "model": {"backbone_weights"},
    "optim": {"base_lr", "ref_batch", "epochs", "schedule", "cosine_epochs", "warmup_steps", "warmup_epochs",
              "warmup_start_factor", "min_lr_ratio", "no_aug_epochs", "milestones", "gamma"},
    "compile": {"warmup", "workers", "worker_nice", "cache_dir"},
}
_DATA_IN_GRAPH = ("batch_size", "max_boxes", "channels_last")
_SOURCE_HASH: str | None = None


def _source_hash() -> str:
    """Of fastdet's Python and C++ sources: changed code may trace another graph."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha1()
        for f in sorted([*root.rglob("*.py"), *(root.parent / "csrc").glob("*.*")]):
            h.update(str(f.relative_to(root.parent)).encode())
            h.update(f.read_bytes())
        _SOURCE_HASH = h.hexdigest()
    return _SOURCE_HASH


def graph_key(cfg, device: torch.device | str, ddp: bool, threads: int) -> str:
    """What a bucket's compiled graph depends on besides its size and loss arguments: the
    graph-shaping config, the device, DDP's wrapping, torch's CPU threads (inductor's CPU
    kernels and cache key hold them), torch's version and fastdet's sources."""
    d = cfg.to_dict()
    part = {sec: {k: v for k, v in d[sec].items() if k not in _NOT_IN_GRAPH.get(sec, ())}
            for sec in ("model", "family", "optim", "compile")}
    part["data"] = {k: d["data"][k] for k in _DATA_IN_GRAPH}
    dev = torch.device(device)
    what = [part, str(dev), bool(ddp), int(threads) if dev.type == "cpu" else 0, torch.__version__, _source_hash()]
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def compiled_dir(cache: Path, key: str) -> Path:
    return cache / GRAPHS_DIR / key


def compiled_before(cache: Path, key: str, buckets: list[Bucket]) -> list[bool]:
    """For each bucket: did a worker or ``python -m fastdet.compile`` compile it into ``cache``
    under ``key``? (Its graph then loads from the cache at the bucket's first step.)"""
    d = compiled_dir(cache, key)
    return [(d / f"{b.file_id}.json").is_file() for b in buckets]


# --------------------------------------------------------------------------- the worker

def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a record."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def compile_buckets(cfg_dict: dict[str, Any], buckets: list[Bucket], ready_dir: str | None, device: str,
                    ddp: bool, threads: int, nice: int = 0, parent: int | None = None,
                    report=None, torch_threads: int | None = None) -> list[dict[str, Any]]:
    """Compile ``buckets`` as the trainer's step would (forward + loss + backward, on a
    synthetic batch), filling inductor's caches; one record per bucket, also written to
    ``ready_dir/<bucket.file_id>.json`` when given. ``report(record)`` is called after each."""
    from fastdet import registry
    from fastdet.engine.optim import build_optimizer_and_ema
    from fastdet.engine.step import TrainStep
    from fastdet.runtime.amp import backend_flags, resolve_amp
    from fastdet.engine.trainer import freeze_bn_stats

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
    wrap = None
    if ddp:
        import torch.distributed as dist
        from functools import partial

        if not dist.is_initialized():
            store_file = tempfile.NamedTemporaryFile(prefix="fastdet-compile-", delete=False).name
            dist.init_process_group("gloo", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
        wrap = (partial(torch.nn.parallel.DistributedDataParallel, device_ids=[dev.index])
                if dev.type == "cuda" else torch.nn.parallel.DistributedDataParallel)
    model = registry.build_detector(cfg).to(dev)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    if cfg.model.freeze_bn:
        freeze_bn_stats(model)
    optimizer, ema, _ = build_optimizer_and_ema(cfg.optim, model, cfg.data.batch_size, dev)
    step = TrainStep(model, model, optimizer, ema, dev, resolve_amp(cfg.compile.amp, dev),
                     clip_grad_norm=cfg.optim.clip_grad_norm, compile=True, cuda_graphs=False,
                     dynamic=cfg.compile.dynamic, ddp=wrap, backend=cfg.compile.backend,
                     shapes=cfg.compile.shapes)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(buckets) + 2)
    done_dir = compiled_dir(resolve_cache_dir(), graph_key(cfg, dev, ddp, torch.get_num_threads()))
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
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="fastdet-parent-watch", daemon=True).start()


def _worker_entry(*args: Any) -> None:
    import inspect

    logging.basicConfig(level=logging.WARNING)
    parent = inspect.signature(compile_buckets).bind(*args).arguments.get("parent")
    if parent is not None:
        _exit_with_parent(parent)
    compile_buckets(*args)


# --------------------------------------------------------------------------- the trainer's side

class BackgroundCompile:
    """The compile workers of one launch and what they have finished.

    Local rank 0 starts the workers; every rank polls ``ready_dir``. ``agree`` (a callable
    taking a list of 0/1 and returning their minimum over ranks) makes ranks switch
    together."""

    def __init__(self, cfg, buckets: list[Bucket], ready_dir: Path, device: torch.device, *,
                 local_rank: int, local_ranks: int, ddp: bool):
        self.cfg, self.buckets, self.ready_dir = cfg, buckets, ready_dir
        self.device, self.local_rank, self.ddp = device, local_rank, ddp
        self.workers, self.threads = plan_workers(max(1, len(buckets)), cfg.compile.workers, local_ranks)
        if not buckets:  # every graph was compiled before: no worker to start
            self.workers = 0
        self.procs: list[Any] = []
        self.pending = list(buckets)
        self.done: dict[Bucket, dict[str, Any]] = {}
        self.t0 = time.perf_counter()
        self.total_s: float | None = None

    def start(self) -> None:
        """Local rank 0: a fresh ready directory and the worker processes, each given every
        ``workers``-th bucket in the order of use (so the first buckets come first)."""
        if self.local_rank != 0:
            return
        import multiprocessing as mp

        self.ready_dir.mkdir(parents=True, exist_ok=True)
        for old in self.ready_dir.glob("*.json"):
            old.unlink()
        ctx = mp.get_context("spawn")
        # Workers read these when they import torch; the trainer keeps its own.
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")}
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(self.threads)
        try:
            for i in range(self.workers):
                share = self.buckets[i:: self.workers]
                p = ctx.Process(target=_worker_entry, name=f"fastdet-compile-{i}",
                                args=(self.cfg.to_dict(), share, str(self.ready_dir), str(self.device),
                                      self.ddp, self.threads, self.cfg.compile.worker_nice, os.getpid(), None,
                                      torch.get_num_threads()))
                p.start()
                self.procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def poll(self, agree=None) -> list[tuple[Bucket, dict[str, Any]]]:
        """Buckets newly finished (on every rank when ``agree`` is given)."""
        seen = [(self.ready_dir / f"{b.file_id}.json").is_file() for b in self.pending]
        if agree is not None:
            seen = [bool(x) for x in agree([int(s) for s in seen])] if self.pending else seen
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

    def status(self) -> str:
        return f"compiled {len(self.done)}/{len(self.buckets)}"

    def close(self) -> None:
        """Stop the workers still compiling (training is over); the cache keeps what they wrote."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=30)
        self.procs = []


def launch_id() -> str:
    """One launch: the ranks agree on rank 0's (the caller broadcasts it)."""
    return f"{os.getpid()}-{int(time.time())}"


def ready_dir_for(output_dir: Path, launch: str) -> Path:
    """Where this machine's workers of ``launch`` mark finished buckets."""
    return output_dir / "compile" / f"{socket.gethostname()}-{launch}"
