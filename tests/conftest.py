"""Shared fixtures. Every test that needs data uses the small demo set made here once.

- ``demo_small``: ``Path`` of a COCO-layout root with 24 train and 8 val images
  (``annotations/instances_{train,val}2017.json``, ``{train,val}2017/*.jpg``), four
  classes with COCO ids 1, 3, 7, 12, and one image without objects in each split.
- ``demo_paths``: the same set as ``fastdet.data.coco.DataPaths``
  (``train_ann``, ``train_images``, ``val_ann``, ``val_images``).
- ``exact_fp32``: TF32 off for the test (the GPU step and capture tests).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from fastdet.data.coco import DataPaths, coco_layout
from fastdet.data.demo import make_demo

DEMO_SMALL = dict(num_train=24, num_val=8, seed=0)

# Under pytest-xdist (`make test`) the workers share the cores: each takes its share of
# torch's threads, so 2 workers on 2 cores do not run 4 spinning OpenMP threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))
# The commands the tests launch (python -m fastdet.train, torchrun's ranks, the bench
# scripts) inherit OMP_NUM_THREADS: the same share, at most 2 (64-128 px models; more
# threads only wait on each other). On CI's 2 cores that is 1 a process: with 2 a process
# beside the other worker's, the OpenMP threads of a process waited on each other's turn on
# a core; two 3-step ppyoloe-s runs side by side took 84-106 s each, 20-21 s at 1 thread.
os.environ["OMP_NUM_THREADS"] = str(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


# The order test files start in under pytest-xdist (Makefile: --dist loadfile
# --no-loadscope-reorder): each worker runs a file whole, so a file of several minutes
# that starts late keeps one core busy after the other has finished. These files (each
# over ~30 s of `make test` on a 2-core CPU, longest first: test_train ~360 s, then ~230,
# 190, 160, 135, 80, 80, 75 s ...) start first, the rest follow in their usual order:
# longest-processing-time-first scheduling, ~60 s off the suite against xdist's own order
# (files by number of tests). Only the speed of the suite depends on this list;
# tests/test_structure.py checks that each name exists.
LONGEST_FIRST = ("test_train.py", "test_background_compile.py", "test_inference.py", "test_families_cli.py",
                 "test_gpu_check.py", "test_formats.py", "test_user_path.py", "test_freeze.py", "test_ops_build.py",
                 "test_contract.py", "test_ppyoloe.py", "test_convert.py", "test_sync_bn.py", "test_yolox.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.fixture(scope="session")
def demo_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo(tmp_path_factory.mktemp("demo_small") / "demo", **DEMO_SMALL)


@pytest.fixture(scope="session")
def demo_paths(demo_small: Path) -> DataPaths:
    return coco_layout(demo_small)


@pytest.fixture
def exact_fp32():
    """fp32 without TF32, so eager and replayed kernels agree to rounding."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _restore_logging():
    """A test that runs a command's ``main()`` in process leaves that command's log set-up
    behind (``setup_logging`` binds the ``fastdet`` logger to the sys.stdout of the moment,
    ``basicConfig`` the root logger to sys.stderr): a later test in the same worker would log
    into the closed capture of the first. Each test gets the logging state it started with."""
    fd, root = logging.getLogger("fastdet"), logging.getLogger()
    saved = (list(fd.handlers), fd.level, fd.propagate, list(root.handlers), root.level)
    yield
    fd.handlers[:], fd.level, fd.propagate = saved[0], saved[1], saved[2]
    root.handlers[:], root.level = saved[3], saved[4]
