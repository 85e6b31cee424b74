"""Building the extension: the CUDA sources compile where a toolkit is present, the build
is cached, and without a compiler fastdet says so once and falls back to the torch
reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastdet.ops import _ext

HAS_NVCC = _ext.find_cuda_home() is not None and torch.version.cuda is not None


@pytest.mark.skipif(not HAS_NVCC, reason="no CUDA toolkit (nvcc) on this machine, so the CUDA sources cannot compile")
def test_cuda_sources_compile_and_library_loads():
    # With a toolkit, the one session build is the CUDA variant (it also serves the CPU).
    if not _ext.load():
        pytest.fail(f"the extension did not build: {_ext.error()}")
    assert _ext.variant() == "cuda"
    so = _ext.build_dir("cuda") / "fastdet_ext_cuda.so"
    assert so.is_file()
    objs = {p.name for p in _ext.build_dir("cuda").glob("*.o")}
    assert {"kernels.cuda.o", "ops_cuda.o"} <= objs, objs
    # The CUDA kernels are registered with the dispatcher even without a GPU.
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fastdet::task_aligned_assign", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fastdet::ema_update_", "CUDA")


def test_build_command_is_cached_no_op():
    if not _ext.load():
        pytest.fail(f"the extension did not build: {_ext.error()}")
    # A second build of the loaded variant in a fresh process: ninja finds nothing to do
    # (it appends to .ninja_log for every step it runs).
    ninja_log = _ext.build_dir(_ext.variant()) / ".ninja_log"
    before = ninja_log.read_text()
    env = {**os.environ, "FASTDET_EXT_CUDA": "1" if _ext.variant() == "cuda" else "0"}
    r = subprocess.run([sys.executable, "-m", "fastdet.ops.build"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{_ext.variant()} extension ready in {_ext.build_dir(_ext.variant())}" in r.stdout
    assert ninja_log.read_text() == before


def test_no_compiler_warns_once_and_falls_back(tmp_path: Path):
    script = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        import fastdet.ops as ops
        from fastdet.ops import reference
        from fastdet.ops.synthetic import random_boxes
        a, b = random_boxes(4), random_boxes(5, seed=1)
        for _ in range(3):
            assert torch.equal(ops.box_iou(a, b), reference.box_iou(a, b))
            ops.giou_loss(a, b[:4])
        print("backend", ops.backend_for("box_iou", "cpu"))
    """)
    env = {**os.environ, "CXX": "no-such-compiler-fastdet", "FASTDET_EXT_CUDA": "0",
           "FASTDET_EXT_DIR": str(tmp_path / "ext"), "FASTDET_OPS_BACKEND": ""}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "backend torch" in r.stdout
    warnings = [ln for ln in r.stderr.splitlines() if "kernels are unavailable" in ln]
    assert len(warnings) == 1 and "no-such-compiler-fastdet" in warnings[0], r.stderr
