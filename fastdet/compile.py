"""``python -m fastdet.compile``: fill inductor's on-disk cache ahead of training.

Takes the training command's flags (the recipe, ``--data``, ``--batch-size``, ``--amp``,
``--channels-last``, ``--set ...``) and compiles every graph that training would: each
(image size x loss variant) bucket of the recipe, in worker processes sized to the cores.
A later ``python -m fastdet.train ... --compile`` on this machine (or a cluster job that
reuses the cache directory) then loads each graph in seconds instead of compiling it::

    python -m fastdet.compile --arch ppyoloe --size s --data /data/coco
    python -m fastdet.compile --arch yolox --size s --num-classes 80 --ddp 8   # for torchrun, 8 ranks
    TORCHINDUCTOR_CACHE_DIR=/shared/inductor python -m fastdet.compile --arch fcos --size r50 ...

The model's class count comes from the training annotations (``--data``), or
``--num-classes`` without reading them (given both, they must agree where the set can be
read here). ``--print-config`` prints the config whose graphs would be compiled, and exits.
``--cores N`` keeps the worker processes x their inductor compile threads within N cores
(default: every core of the machine), for fills that run beside other work.
``--ddp W`` compiles the graphs a ``torchrun`` launch of W ranks in all (nodes x processes
per node) uses: DDP cuts them at its gradient buckets, and they hold collectives of W ranks
(the loss normaliser's all-reduce, SyncBatchNorm's all-gather), so a fill for one world size serves launches of that size.
On a GPU machine the graphs are compiled for ``cuda:0``: launch training with ``torchrun
--virtual-local-rank`` so every rank loads them. On the CPU inductor's kernels (and its cache key) depend on torch's
thread count: run this with the training's ``OMP_NUM_THREADS`` (torchrun sets 1 per rank
when it starts several).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from fastdet import registry
from fastdet.config import Config, ConfigError, apply_overrides
from fastdet.data.coco import DataError
from fastdet.data.formats import train_num_classes
from fastdet.engine.compile_workers import CompileWorkers
from fastdet.runtime.dist import check_device_flags, resolve_device
from fastdet.train import PATH_KEYS, check_config, explicit_overrides, flag_of, resolve_config
from fastdet.train import build_parser as train_parser


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped(signal.Signals(signum).name)


def build_parser():
    p = train_parser()
    p.prog = "python -m fastdet.compile"
    p.description = __doc__
    p.add_argument("--num-classes", type=int, default=None,
                   help="classes of the model (default: counted from the training annotations of --data; "
                        "with --data, the set's count where it can be read here)")
    p.add_argument("--ddp", type=int, default=None, metavar="W",
                   help="compile the graphs of a torchrun launch of W ranks in all (nodes x processes per node): "
                        "DDP's gradient-bucket cuts and the collectives of W ranks")
    p.add_argument("--cores", type=int, default=None, metavar="N",
                   help="the cores this fill may use (default: all of this machine's): its worker processes x "
                        "their inductor compile threads stay within N, for a fill that shares the machine "
                        "(bench/gpu_check.sh runs several beside each other)")
    return p


def num_classes(args: argparse.Namespace, cfg: Config) -> int:
    """The model's class count: --num-classes, else the training set's. Given both --num-classes
    and a dataset (--data or its paths), the two must agree: training counts the set's classes,
    so graphs of another count would never be loaded. A set that cannot be read here (a
    cluster's path) leaves --num-classes as given, which is what it is for."""
    if args.num_classes is None:
        return train_num_classes(cfg.data)
    given = [k for k in PATH_KEYS if k in explicit_overrides(args)]
    if not given:
        return args.num_classes
    try:
        counted = train_num_classes(cfg.data)
    except (DataError, OSError, ValueError):
        return args.num_classes
    if counted != args.num_classes:
        key = "data.data" if "data.data" in given else "data.train_ann"
        where = f"{flag_of(key)} {getattr(cfg.data, key.split('.')[1])}"
        raise ConfigError(f"--num-classes {args.num_classes} differs from the {counted} classes of the training set "
                          f"of {where}: training builds a {counted}-class model and would not load these graphs; "
                          "drop --num-classes")
    return counted


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("fastdet")
    try:
        cfg = resolve_config(args)
        check_config(cfg)
        if args.num_classes is not None and args.num_classes < 1:
            raise ConfigError(f"--num-classes must be at least 1, got {args.num_classes}")
        if args.ddp is not None and args.ddp < 1:
            raise ConfigError(f"--ddp takes the launch's number of ranks (at least 1), got {args.ddp}")
        if args.cores is not None and args.cores < 1:
            raise ConfigError(f"--cores must be at least 1, got {args.cores}")
        device = resolve_device(cfg.run.device)
        check_device_flags(cfg, device)
        n = num_classes(args, cfg)
        cfg = apply_overrides(registry.resolve(cfg), {"model.num_classes": n, "compile.compile": True})
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"fastdet.compile: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    variants = registry.loss_variants(cfg, 0, cfg.optim.epochs - 1)
    workers = CompileWorkers(cfg, device, ddp=args.ddp is not None, world_size=args.ddp, cores=args.cores)
    # What an earlier fastdet.compile or training launch compiled into this cache under the
    # same graph key is not compiled again: a stopped or repeated fill does only the rest.
    every, _ = workers.plan(variants)
    buckets, cache = workers.buckets, workers.cache
    if len(buckets) < len(every):
        log.info("fastdet.compile: %d of %d graph(s) were compiled into %s before; %d to go",
                 len(every) - len(buckets), len(every), cache, len(buckets))
    if not buckets:
        return 0
    log.info("fastdet.compile: %s-%s, %d classes, batch %d on %s: %d graph(s) (%d size bucket(s) x %d loss "
             "variant(s)) in %d worker process(es) x %d compile thread(s), backend %s, into %s",
             cfg.model.arch, cfg.model.size, n, cfg.data.batch_size, device, len(buckets), len(workers.sizes),
             len(variants), workers.workers, workers.threads, cfg.compile.backend, cache)
    t0 = time.perf_counter()
    # A scheduler's SIGTERM (or a second Ctrl-C's) unwinds through the ``finally`` below,
    # which stops the workers; what they finished stays in the cache.
    signal.signal(signal.SIGTERM, _raise_stopped)
    with tempfile.TemporaryDirectory(prefix="fastdet-compile-") as tmp:
        workers.start(Path(tmp))
        try:
            ok = workers.wait()
        except (_Stopped, KeyboardInterrupt) as e:
            workers.poll_ready()
            log.error("fastdet.compile: stopped (%s) with %d of %d graph(s) compiled; the cache keeps them, "
                      "and the same command compiles the rest", e or "Ctrl-C", len(workers.done), len(buckets))
            return 130 if isinstance(e, KeyboardInterrupt) else 143
        finally:
            workers.close()
    if not ok:
        return 1
    log.info("fastdet.compile: %d graph(s) in %.1f s; cache %s", len(buckets), time.perf_counter() - t0, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
