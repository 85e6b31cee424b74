"""Building the extension: the CUDA sources compile where a toolkit is present, the build
is cached, and without a compiler fastdet says so once and falls back to the torch
reference."""

from __future__ import annotations

import os
import shutil
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
    """The CUDA variant builds with nvcc even without a GPU (asked for: the default there is
    the C++ variant) and registers a CUDA kernel for every op. In a fresh process, since one
    process loads one variant; cached by content, so it compiles once per source version."""
    script = textwrap.dedent("""
        import torch
        from fastdet.ops import _ext
        out = _ext.build("cuda")
        ops = ["box_iou", "generalized_box_iou", "giou_loss", "ema_update_", "task_aligned_assign", "atss_assign",
               "yolo_targets", "fcos_assign", "simota_assign"]
        missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key("fastdet::" + op, "CUDA")]
        print("missing", missing)
        print("dir", out)
    """)
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "missing []" in r.stdout, r.stdout
    out = Path(r.stdout.split("dir ", 1)[1].strip())
    objs = {p.name for p in out.glob("*.o")}
    assert {"kernels.cuda.o", "ops_cuda.o", "simota.cuda.o", "fcos.cuda.o", "yolo_targets.cuda.o"} <= objs, objs
    assert (out / "fastdet_ext_cuda.so").is_file()


def test_without_a_gpu_first_use_builds_the_cpu_variant(monkeypatch):
    """No GPU visible: the CUDA kernels could not run, so first use builds the C++ ones
    alone (about a minute instead of five), toolkit or not (issue 31, item 6)."""
    monkeypatch.delenv("FASTDET_EXT_CUDA", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not _ext.want_cuda()
    monkeypatch.setenv("FASTDET_EXT_CUDA", "1")  # asked for: built all the same
    assert _ext.want_cuda()


def _fake_toolkit(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 1\n")
    nvcc.chmod(0o755)
    return root


def test_find_cuda_home_looks_in_usr_local_cuda_and_asks_torch(monkeypatch, tmp_path):
    """nvcc off PATH and no CUDA_HOME: the toolkit in /usr/local/cuda, else torch's own
    CUDA_HOME, is found, instead of silently building the CPU variant (issue 24, item 6)."""
    from torch.utils import cpp_extension

    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    standard = _fake_toolkit(tmp_path / "usr-local-cuda")
    monkeypatch.setattr(_ext, "STANDARD_CUDA_ROOTS", (str(standard),))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert _ext.find_cuda_home() == str(standard)
    torchs = _fake_toolkit(tmp_path / "torch-cuda-home")
    monkeypatch.setattr(_ext, "STANDARD_CUDA_ROOTS", (str(tmp_path / "none"),))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(torchs))
    assert _ext.find_cuda_home() == str(torchs)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "no-nvcc-here"))
    assert _ext.find_cuda_home() is None


def test_build_directory_is_keyed_by_the_sources_content(monkeypatch, tmp_path):
    """Two checkouts with the same sources share one build directory (and one build); a
    changed source gets its own, so neither rebuilds over the other."""
    a, b = tmp_path / "checkout-a", tmp_path / "checkout-b"
    shutil.copytree(_ext.source_dir(), a)
    shutil.copytree(_ext.source_dir(), b)
    monkeypatch.setattr(_ext, "source_dir", lambda: a)
    dir_a = _ext.build_dir("cpu")
    monkeypatch.setattr(_ext, "source_dir", lambda: b)
    assert _ext.build_dir("cpu") == dir_a
    (b / "ema_cpu.cpp").write_text((b / "ema_cpu.cpp").read_text() + "\n// changed\n")
    assert _ext.build_dir("cpu") != dir_a
    assert _ext.build_dir("cuda") != _ext.build_dir("cpu")


@pytest.mark.parametrize("logging_set_up", [False, True])
def test_a_build_says_once_that_it_builds_and_how_long_it_took(monkeypatch, tmp_path, capsys, caplog,
                                                               logging_set_up):
    """The compiler itself is replaced (a real build takes minutes): the first build of a
    key says it is building and then how long it took; a cached one says nothing. The
    build compiles the copy of the sources in its own directory. The lines reach the user
    through fastdet's logging where it is set up (the train CLI), else on stderr: a logger
    that stops propagating, with no handler of its own, must not swallow them."""
    import logging

    from torch.utils import cpp_extension

    fd_log = logging.getLogger("fastdet")
    monkeypatch.setattr(fd_log, "handlers", [])
    monkeypatch.setattr(fd_log, "propagate", logging_set_up)  # caplog's handler sits on the root
    monkeypatch.setattr(fd_log, "level", logging.INFO)

    seen = {}

    def fake_load(name, sources, build_directory, **kw):
        seen.update(sources=sources, include=kw["extra_include_paths"])
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("FASTDET_EXT_DIR", str(tmp_path / "ext"))
    out = _ext.build("cpu")
    err = caplog.text if logging_set_up else capsys.readouterr().err
    assert f"fastdet.ops: building the cpu extension in {out}" in err
    assert "fastdet.ops: the cpu extension built in" in err
    assert all(s.startswith(str(out / "src")) for s in seen["sources"]), seen
    assert seen["include"] == [str(out / "src")]
    assert _ext.build("cpu") == out
    assert "building" not in caplog.text.replace(err, "") + capsys.readouterr().err


@pytest.mark.parametrize("other_build", ["ends", "is killed"])
def test_a_process_that_waits_for_another_s_build_says_it_waited(monkeypatch, tmp_path, other_build):
    """Two processes (torchrun ranks) load the extension at once: the second waits on the
    build lock while the first builds. It said "building the cpu extension" and then "built
    in N s", N counting the wait, though it built nothing. Now it says it waits for another
    process's build and how long it waited, and no "building" line when that build ended;
    when the other build was killed (no library), it builds, and its time leaves the wait out.
    The other process is this test holding the lock; the clock is a stand-in (the wait: 120 s,
    the build: 30 s), cpp_extension.load too."""
    import fcntl
    import threading
    from types import SimpleNamespace

    from torch.utils import cpp_extension

    clock = [1000.0]
    monkeypatch.setattr(_ext, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    said = []
    monkeypatch.setattr(_ext, "_say", said.append)

    def fake_load(name, sources, build_directory, **kw):
        lib = Path(build_directory) / f"{name}.so"
        if not lib.is_file():  # a real build: 30 s on the stand-in clock; else ninja's no-op
            clock[0] += 30
            lib.write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("FASTDET_EXT_DIR", str(tmp_path / "ext"))
    out = _ext.build_dir("cpu")
    out.mkdir(parents=True)
    real_flock = fcntl.flock
    waiting = threading.Event()

    def flock(f, op):
        if op == fcntl.LOCK_EX:  # the blocking call: the build thread now waits on the lock
            waiting.set()
        return real_flock(f, op)

    with open(out / ".fastdet-build.lock", "a+") as held:
        real_flock(held, fcntl.LOCK_EX)  # the other process, building
        monkeypatch.setattr(fcntl, "flock", flock)
        builder = threading.Thread(target=_ext.build, args=("cpu",), daemon=True)
        builder.start()
        try:
            assert waiting.wait(60), "the build did not wait on the lock another process holds"
            clock[0] += 120
            if other_build == "ends":
                _ext.library_path("cpu").write_bytes(b"")
        finally:
            real_flock(held, fcntl.LOCK_UN)
        builder.join(60)
    assert not builder.is_alive()
    assert said[0] == f"fastdet.ops: waiting for another process's build of the cpu extension in {out}", said
    if other_build == "ends":
        assert said[1:] == ["fastdet.ops: the cpu extension was built by another process; waited 120 s for it"], said
    else:
        assert said[1].startswith(f"fastdet.ops: building the cpu extension in {out}") and len(said) == 3, said
        assert said[2] == "fastdet.ops: the cpu extension built in 30 s", said


def test_a_build_killed_mid_way_does_not_hang_the_next_load(monkeypatch, tmp_path):
    """torch <= 2.13's cpp_extension.load (the GPU hosts have 2.11) builds while holding a
    file, ``<build dir>/lock``, that it removes when done; every other process waits while
    the file exists, for ever. A build killed at a time limit leaves it (bench/gpu_check.sh
    cuts its build part at 30 s): every later process that loaded the extension then hung,
    shown with torch 2.13 on this machine. Here ``load`` is that protocol on torch's own
    FileBaton, the compiler left out; the next build must take the baton and finish."""
    import threading

    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    built = []

    def load_as_torch_2_11(name, sources, build_directory, **kw):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            try:
                built.append(name)
                (Path(build_directory) / f"{name}.so").write_bytes(b"")
            finally:
                baton.release()
        else:
            baton.wait()

    monkeypatch.setattr(cpp_extension, "load", load_as_torch_2_11)
    monkeypatch.setattr(_ext, "torch_waits_on_its_lock_file", lambda: True)
    monkeypatch.setenv("FASTDET_EXT_DIR", str(tmp_path / "ext"))
    out = _ext.build_dir("cpu")
    out.mkdir(parents=True)
    (out / "lock").write_text("")  # what the killed build left
    done = threading.Event()
    threading.Thread(target=lambda: (_ext.build("cpu"), done.set()), daemon=True).start()
    assert done.wait(30), f"the build waits on {out / 'lock'}, which nothing will remove"
    assert built == ["fastdet_ext_cpu"] and not (out / "lock").exists()


def test_a_finished_build_s_lock_file_is_no_stale_baton_on_torch_2_14(monkeypatch, tmp_path, capsys):
    """From torch 2.14 ``load`` holds ``<build dir>/lock`` with a kernel lock and leaves the
    file after every build: every process after the first build said it "removed a file left
    by a build that was stopped" and removed torch's lock file. It is left alone there."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, build_directory, **kw: None)
    monkeypatch.setattr(_ext, "torch_waits_on_its_lock_file", lambda: False)
    monkeypatch.setattr(_ext.log, "isEnabledFor", lambda level: False)  # _say prints to stderr
    monkeypatch.setenv("FASTDET_EXT_DIR", str(tmp_path / "ext"))
    out = _ext.build_dir("cpu")
    out.mkdir(parents=True)
    (out / "lock").write_text("")  # what torch 2.14's finished build leaves
    _ext.build("cpu")
    assert (out / "lock").exists() and "stopped before it ended" not in capsys.readouterr().err


def test_this_torch_s_lock_protocol_is_known():
    """The predicate follows the installed torch: its cpp_extension waits on a FileBaton up
    to 2.13 and takes a filelock.FileLock from 2.14."""
    import inspect

    from torch.utils import cpp_extension

    takes_a_kernel_lock = "FileLock(" in inspect.getsource(cpp_extension)
    assert _ext.torch_waits_on_its_lock_file() == (not takes_a_kernel_lock)


@pytest.mark.parametrize("why", ["no fcntl (Windows)", "no flock on the file system (Lustre without -o flock)"])
def test_a_build_where_no_os_lock_can_be_had_still_builds(monkeypatch, tmp_path, why):
    """The build lock is an addition to torch's own baton: where it cannot be had, the build
    goes on as before it existed. flock on a Lustre mount without ``-o flock`` fails with
    ENOSYS, which made every build there fail ("building the cpu extension ... failed:
    [Errno 38] Function not implemented") though torch <= 2.13's baton builds there."""
    import errno

    from torch.utils import cpp_extension

    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, build_directory, **kw: built.append(name))
    if why.startswith("no fcntl"):
        monkeypatch.setitem(sys.modules, "fcntl", None)  # import fcntl raises ImportError
    else:
        import fcntl

        def no_flock(f, op):
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setenv("FASTDET_EXT_DIR", str(tmp_path / "ext"))
    _ext.build("cpu")
    assert built == ["fastdet_ext_cpu"]


def test_the_lock_protocol_is_read_from_cpp_extension_not_the_version(monkeypatch):
    """A source build or nightly of 2.14 is ``2.14.0a0`` / ``2.14.0.devN``, which sorts before
    2.14: a version test took this torch's FileLock protocol for the old FileBaton one there
    (and removed torch's lock file after every build, saying a build had been stopped)."""
    import inspect

    from torch.utils import cpp_extension

    takes_a_kernel_lock = "FileLock(" in inspect.getsource(cpp_extension)
    for version in ("2.14.0a0+git1b2c3d4", "2.14.0.dev20260301", "2.13.1", "2.11.0+cu128"):
        monkeypatch.setattr(torch, "__version__", version)
        assert _ext.torch_waits_on_its_lock_file() == (not takes_a_kernel_lock), version
    # A torch whose load holds a FileBaton (<= 2.13), whatever its version says.
    monkeypatch.delattr(cpp_extension, "FileLock", raising=False)
    monkeypatch.setattr(cpp_extension, "FileBaton", object, raising=False)
    assert _ext.torch_waits_on_its_lock_file()


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
