"""Where compiled graphs live and what keys them: the one module for buckets, inductor's
on-disk cache and its counters.

A *bucket* is one compiled graph of the train step: an image size (H, W) and a set of loss
arguments (e.g. PP-YOLOE's ATSS / task-aligned phases). ``bucket_sizes(cfg)`` lists the
sizes and ``train_buckets`` crosses them with the recipe's loss variants in order of use.
Compiling writes inductor's FX graph cache and AOTAutograd cache under one directory per
machine (:func:`resolve_cache_dir`, :func:`use_cache_dir`), read by every rank, every later
launch, the compile workers (``fastdet/engine/compile_workers.py``) and ``python -m
fastdet.compile``. A bucket compiled into it is recorded under ``graph_key(cfg, ...)``
(:func:`compiled_dir`), so a later launch of the same config knows which graphs it can load.

This module sits below the step and the workers: it imports nothing from ``fastdet.engine``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config

from fastdet import registry
from fastdet.data import stages as S
from fastdet.data.loader import canvases_for, train_sizes

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
    each square size of ``data.train_sizes`` and, with keep-ratio resizing, its canvases.

    The one list of compile buckets: the trainer, its workers, ``python -m fastdet.compile``
    and the benchmarks warm up these; the loader builds its ``TrainSchedule.sizes`` from the
    same config with the same two functions (``train_sizes``, ``canvases_for``), and a test
    checks the two agree for every recipe."""
    rs = S.resize_of(S.check_stages(registry.phase(cfg, 0).stages))
    canvases = canvases_for(rs.mode, rs.short, rs.max_long)
    return list(dict.fromkeys(hw for s in train_sizes(cfg.data) for hw in canvases.buckets(s)))


def train_buckets(sizes: list[tuple[int, int]], variants: list[dict[str, Any]]) -> list[Bucket]:
    """Buckets in the order training first meets them: the loss variants in order of use,
    each over the size buckets."""
    return [Bucket.of(h, w, kw) for kw in variants for h, w in sizes]


# --------------------------------------------------------------------------- the cache directory

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
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    os.environ[AUTOGRAD_FN_ENV] = "1"  # read by spawned workers when they import torch
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    return path


def same_keys_in_every_process() -> None:
    """Move ``__mp_main__`` to the end of ``sys.modules``, so this process computes the cache
    keys that the trainer, its compile workers and ``python -m fastdet.compile`` compute.

    Inductor's and AOTAutograd's keys hash pickles of every graph input's metadata, whose
    ``memory_format`` (``torch.contiguous_format``) pickles as a global named after the
    first module in ``sys.modules`` that holds it, ``__main__`` skipped: ``torch._utils``,
    unless ``__mp_main__`` comes first and holds ``torch``. It does where the main module
    imports torch: multiprocessing aliases ``__mp_main__`` to it when first imported, and a
    spawned worker re-imports the parent's main module under that name before torch. So the
    workers of ``python -m fastdet.compile`` wrote every graph under keys the trainer never
    computed, and training compiled them all again (``tests/test_background_compile.py``)."""
    main = sys.modules.pop("__mp_main__", None)
    if main is not None:
        sys.modules["__mp_main__"] = main


def cache_dir_in_use() -> str:
    """inductor's cache directory as this process uses it (for the log)."""
    return os.environ.get(CACHE_ENV, "default cache")


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


def graph_key(cfg, device: torch.device | str, ddp: bool, threads: int, world_size: int = 1) -> str:
    """What a bucket's compiled graph depends on besides its size and loss arguments: the
    graph-shaping config, the device, DDP's wrapping and the launch's world size (its
    collectives hold it), torch's CPU threads (inductor's CPU kernels and cache key hold
    them), torch's version and fastdet's sources."""
    d = cfg.to_dict()
    part = {sec: {k: v for k, v in d[sec].items() if k not in _NOT_IN_GRAPH.get(sec, ())}
            for sec in ("model", "family", "optim", "compile")}
    part["data"] = {k: d["data"][k] for k in _DATA_IN_GRAPH}
    dev = torch.device(device)
    ranks = int(world_size) if ddp else 0
    what = [part, str(dev), bool(ddp), int(threads) if dev.type == "cpu" else 0, torch.__version__, _source_hash()]
    if ranks > 1:  # keys of one process and of one-rank launches are unchanged
        what.append(ranks)
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def compiled_dir(cache: Path, key: str) -> Path:
    return cache / GRAPHS_DIR / key


def compiled_before(cache: Path, key: str, buckets: list[Bucket]) -> list[bool]:
    """For each bucket: did a worker or ``python -m fastdet.compile`` compile it into ``cache``
    under ``key``? (Its graph then loads from the cache at the bucket's first step.)"""
    d = compiled_dir(cache, key)
    return [(d / f"{b.file_id}.json").is_file() for b in buckets]


# --------------------------------------------------------------------------- this launch's ready directory

def launch_id() -> str:
    """One launch: the ranks agree on rank 0's (the caller broadcasts it)."""
    return f"{os.getpid()}-{int(time.time())}"


def ready_dir_for(output_dir: Path, launch: str) -> Path:
    """Where this machine's workers of ``launch`` mark finished buckets."""
    return output_dir / "compile" / f"{socket.gethostname()}-{launch}"
