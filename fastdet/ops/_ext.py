"""Build and load the C++/CUDA extension in ``csrc/`` and register its Python side.

The sources ship as package data (``fastdet._csrc``). On first use they are compiled
with ninja through ``torch.utils.cpp_extension.load`` into a cache directory
(``$FASTDET_EXT_DIR``, default ``~/.cache/fastdet/ext``), or ahead of time with
``python -m fastdet.ops.build``. Each build has its own sub-directory named by the
variant and a hash of what the build depends on (the sources' content, the flags, the
torch and Python versions, the CUDA arch list), and compiles a copy of the sources kept
there: checkouts and virtualenvs on one machine with the same sources share one build,
and a checkout with other sources never overwrites it. An unchanged rebuild is a ninja
no-op; a real build says once that it is building and how long it took, and a process that
waits for another one's build of the same folder (another torchrun rank) says that it waits
and then how long it waited, without building. Two variants:

- ``cuda``: the C++ CPU kernels (``*_cpu.cpp``) plus the CUDA ones (``ops_cuda.cpp``,
  ``kernels.cu``...). Built where torch has CUDA support, a GPU is visible and a CUDA
  toolkit is found; with no GPU it builds too when asked (``--variant cuda``,
  ``FASTDET_EXT_CUDA=1``: tests/test_ops_build.py proves the CUDA sources compile that way);
- ``cpu``: the C++ kernels only: the default where no GPU is visible (what can run there,
  about a minute to build instead of five), where there is no toolkit, or when the CUDA
  build fails.

``FASTDET_EXT_CUDA=0|1`` forces the choice. One process loads one variant (both define
the ``fastdet`` op namespace). When no compiler is there, or the build fails, fastdet
logs one warning naming the cause and the dispatch uses the torch reference instead.

After loading, this module registers the fake (meta) implementation of every op, so
``torch.compile`` traces through them, and the autograd formula of ``giou_loss``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.resources
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAMESPACE = "fastdet"
CPU_SOURCES = ("ops.cpp", "iou_cpu.cpp", "ema_cpu.cpp", "assign_cpu.cpp", "yolo_targets_cpu.cpp",
               "fcos_cpu.cpp", "simota_cpu.cpp")
CUDA_SOURCES = ("ops_cuda.cpp", "kernels.cu", "yolo_targets_cuda.cpp", "yolo_targets.cu", "fcos_cuda.cpp",
                "fcos.cu", "simota.cu")
# ninja tracks the headers through -MMD
HEADERS = ("ops.h", "box_math.h", "cuda_kernels.h", "yolo_targets.h", "yolo_targets_cuda.h", "fcos.h",
           "fcos_cuda.h", "simota_math.h", "block_topk.cuh")
# Hopper (H100/H200) unless the caller says otherwise; only used when no GPU is visible
# (with a GPU, torch builds for the GPU it sees).
DEFAULT_CUDA_ARCH = "9.0"

_lock = threading.Lock()
_state: dict[str, object] = {"variant": None, "error": None}


class ExtensionUnavailable(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


def source_dir() -> Path:
    return Path(str(importlib.resources.files("fastdet._csrc")))


def cache_root() -> Path:
    return Path(os.environ.get("FASTDET_EXT_DIR", "~/.cache/fastdet/ext")).expanduser()


def want_cuda() -> bool:
    """Whether to build the CUDA variant: ``FASTDET_EXT_CUDA=0|1`` decides, else whether
    torch has CUDA support, a GPU is visible and a CUDA toolkit is found (without a GPU
    the CUDA kernels could not run: the C++ ones alone build in a fifth of the time)."""
    env = os.environ.get("FASTDET_EXT_CUDA")
    if env is not None:
        return env.strip() not in ("", "0", "false", "no")
    return torch.version.cuda is not None and torch.cuda.is_available() and find_cuda_home() is not None


# Where a CUDA toolkit is installed when nothing on PATH or in the environment names one.
STANDARD_CUDA_ROOTS = ("/usr/local/cuda",)


def find_cuda_home() -> str | None:
    """The CUDA toolkit root to build with, or None.

    In order: ``$CUDA_HOME``/``$CUDA_PATH`` when they hold ``bin/nvcc``; the toolkit that
    the ``nvcc`` on PATH really runs (``--dryrun`` prints its own ``bin`` folder as
    ``_HERE_``, which sees through wrapper scripts that would make torch guess the
    wrapper's folder); ``/usr/local/cuda``; torch's own guess
    (``torch.utils.cpp_extension.CUDA_HOME``), each only when it holds ``bin/nvcc``.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return root
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for root in (*STANDARD_CUDA_ROOTS, _torch_cuda_home()):
            if root and (Path(root) / "bin" / "nvcc").is_file():
                return str(root)
        return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"_HERE_=(\S+)", out.stdout + out.stderr)
    if m and (Path(m.group(1)) / "nvcc").is_file():
        return str(Path(m.group(1)).parent)
    return str(Path(nvcc).resolve().parent.parent)


def _torch_cuda_home() -> str | None:
    """torch's own guess of the toolkit root (importing cpp_extension warns "No CUDA
    runtime is found" without a GPU, which is expected here)."""
    ext_log = logging.getLogger("torch.utils.cpp_extension")
    level = ext_log.level
    ext_log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension  # heavy (setuptools, compilers' probing): only to build
    except Exception:  # noqa: BLE001 - no torch build tooling: no guess
        return None
    finally:
        ext_log.setLevel(level)
    return cpp_extension.CUDA_HOME


CFLAGS = ("-O3", "-fopenmp")
CUDA_CFLAGS = ("-O3", "-lineinfo")


def _sources(variant: str) -> tuple[str, ...]:
    return (*CPU_SOURCES, *(CUDA_SOURCES if variant == "cuda" else ()), *HEADERS)


def _arch_list() -> str:
    if torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return "visible:" + ",".join(
            "%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    return os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH)


def build_key(variant: str) -> str:
    """A hash of everything a build of ``variant`` depends on: the sources' names and
    content, the flags, torch (version and CUDA version), Python, and for ``cuda`` the
    arch list. Two checkouts with the same sources get the same key."""
    h = hashlib.sha256()
    src = source_dir()
    for name in _sources(variant):
        path = src / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"<missing>") + b"\0")
    h.update(repr((variant, CFLAGS, CUDA_CFLAGS, torch.__version__, torch.version.cuda,
                   sys.version_info[:2], _arch_list() if variant == "cuda" else None)).encode())
    return h.hexdigest()[:16]


def build_dir(variant: str) -> Path:
    tag = f"{variant}-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{build_key(variant)}"
    return cache_root() / re.sub(r"[^A-Za-z0-9._-]", "_", tag)


def library_path(variant: str) -> Path:
    return build_dir(variant) / f"fastdet_ext_{variant}.so"


def _stage_sources(variant: str, out: Path) -> Path:
    """Copy the sources into ``out/src`` (the build compiles this copy, so its commands
    name the same paths whichever checkout asked). A file already there has the same
    content (the directory's key hashes it) and is left alone: rewriting it would change
    its mtime and make ninja rebuild."""
    src, dst = source_dir(), out / "src"
    dst.mkdir(parents=True, exist_ok=True)
    for name in _sources(variant):
        target = dst / name
        if not target.is_file():
            tmp = dst / f".{name}.{os.getpid()}.tmp"
            shutil.copyfile(src / name, tmp)
            os.replace(tmp, target)
    return dst


def _say(msg: str) -> None:
    """One line the user sees: through logging when fastdet's INFO lines reach a handler, else on
    stderr (``log.hasHandlers`` follows propagation: the root's handlers do not count when
    fastdet's logger stops propagating)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", msg)
    else:
        print(msg, file=sys.stderr, flush=True)


def build(variant: str | None = None, verbose: bool = False) -> Path:
    """Compile (or no-op rebuild) one variant and load it; returns its build directory.

    Raises :class:`ExtensionUnavailable` with the reason when it cannot.
    """
    variant = variant or ("cuda" if want_cuda() else "cpu")
    cuda_home = find_cuda_home()
    if cuda_home is not None:
        # torch.utils.cpp_extension fixes its CUDA_HOME when first imported and guesses a
        # wrapper script's folder wrong (then libcudart is not found at link time).
        os.environ["CUDA_HOME"] = cuda_home
    # Importing cpp_extension warns "No CUDA runtime is found" on machines without a GPU,
    # where building the CUDA sources is still wanted (CI compiles them): not a problem.
    ext_log = logging.getLogger("torch.utils.cpp_extension")
    level = ext_log.level
    ext_log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension  # heavy (setuptools, compilers' probing): only to build
    finally:
        ext_log.setLevel(level)

    if cuda_home is not None:
        cpp_extension.CUDA_HOME = cuda_home
    if variant not in ("cpu", "cuda"):
        raise ValueError(f"fastdet.ops._ext.build: variant must be 'cpu' or 'cuda', got {variant!r}")
    src = source_dir()
    missing = [n for n in (*CPU_SOURCES, *CUDA_SOURCES, *HEADERS) if not (src / n).is_file()]
    if missing:
        raise ExtensionUnavailable(f"the package data fastdet._csrc lacks {', '.join(missing)} (looked in {src})")
    kwargs: dict[str, object] = {}
    if variant == "cuda":
        if cuda_home is None:
            raise ExtensionUnavailable("no CUDA toolkit found (nvcc is not on PATH, CUDA_HOME is unset, "
                                       "no /usr/local/cuda, torch found none)")
        if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            # Without a GPU torch cannot pick an arch and fails with an IndexError.
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH
        kwargs["extra_cuda_cflags"] = list(CUDA_CFLAGS)
        kwargs["with_cuda"] = True
    else:
        kwargs["with_cuda"] = False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise ExtensionUnavailable(f"no C++ compiler found ({os.environ.get('CXX', 'c++')} is not on PATH)")
    out = build_dir(variant)
    out.mkdir(parents=True, exist_ok=True)
    staged = _stage_sources(variant, out)
    sources = [str(staged / s) for s in (*CPU_SOURCES, *(CUDA_SOURCES if variant == "cuda" else ()))]
    # A library there is a finished build of these sources (the folder's key hashes them):
    # loading it is a ninja no-op, and a wait for another process's lock is short and unsaid.
    built_before = library_path(variant).is_file()

    def on_wait() -> None:
        if not built_before:
            _say(f"fastdet.ops: waiting for another process's build of the {variant} extension in {out}")

    fresh = False
    try:
        with _one_build_at_a_time(out, on_wait) as waited_s:
            # Read once the lock is held: a build another process ended while this one waited
            # is done, and this process only loads it.
            fresh = not library_path(variant).is_file()
            if waited_s is not None and not fresh and not built_before:
                _say(f"fastdet.ops: the {variant} extension was built by another process; waited "
                     f"{waited_s:.0f} s for it")
            if fresh:
                _say(f"fastdet.ops: building the {variant} extension in {out} (once per machine and source "
                     f"version; {'a few minutes' if variant == 'cuda' else 'about a minute'} on 2 cores)")
            start = time.perf_counter()
            cpp_extension.load(
                name=f"fastdet_ext_{variant}",
                sources=sources,
                extra_cflags=list(CFLAGS),
                extra_include_paths=[str(staged)],
                build_directory=str(out),
                is_python_module=False,
                verbose=verbose,
                **kwargs,
            )
    except Exception as e:  # compiler errors, missing toolkit pieces, link errors
        raise ExtensionUnavailable(f"building the {variant} extension in {out} failed: {_summary(e)}") from e
    if fresh:
        _say(f"fastdet.ops: the {variant} extension built in {time.perf_counter() - start:.0f} s")
    return out


# The file torch's cpp_extension.load (torch <= 2.13, so the GPU hosts' 2.11) creates in
# the build directory while one process builds and removes when it is done: every other
# process waits while it exists, for ever (a loop on os.path.exists). A build killed
# meanwhile (a time limit's SIGTERM or SIGKILL, the OOM killer) leaves it behind, and then
# every later load of the extension on the machine hangs (pytorch/pytorch#189245; torch
# 2.14 holds a kernel lock there instead, which its holder's death releases).
TORCH_BATON = "lock"


def torch_waits_on_its_lock_file() -> bool:
    """Whether this torch's ``cpp_extension.load`` waits while ``<build dir>/lock`` exists
    (torch <= 2.13's FileBaton). From 2.14 the file is held with a kernel lock (FileLock) and
    stays in the build directory after every build: there it is no sign of a killed build.
    Read from the module ``load`` is in, not from the version: a source build or nightly
    of 2.14 (``2.14.0a0``, ``2.14.0.dev...``) sorts before 2.14 on either side of the change."""
    from torch.utils import cpp_extension  # heavy (setuptools, compilers' probing): only to build

    names = vars(cpp_extension)
    return "FileBaton" in names and "FileLock" not in names


# flock's errors where the file system has none (Lustre mounted without -o flock: ENOSYS; some
# network file systems: EOPNOTSUPP, ENOLCK). There the build goes on under torch's own baton.
_NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)


@contextlib.contextmanager
def _one_build_at_a_time(out: Path, on_wait=None):
    """Hold an OS lock on ``out`` (released by the kernel when its holder dies, however it
    dies) around ``cpp_extension.load``: every fastdet process loads through here, so a
    holder finds no other process inside ``load``, and a torch baton file there is one a
    killed build left; it is removed, with a line saying so, instead of waited on. Without
    fcntl (Windows) or flock on the build folder's file system, torch's baton alone, as
    before: a build that cannot lock still builds.

    Yields the seconds this process waited for another one's lock (another torchrun rank,
    a second checkout building the same sources), calling ``on_wait()`` when the wait starts,
    or None when it did not wait."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own baton alone
        yield None
        return
    with open(out / ".fastdet-build.lock", "a+") as f:
        waited_s = None
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process holds it: it builds (or loads) there now
                if on_wait is not None:
                    on_wait()
                t0 = time.perf_counter()
                fcntl.flock(f, fcntl.LOCK_EX)
                waited_s = time.perf_counter() - t0
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            locked = False  # no OS lock here: torch's own baton alone, as without fcntl
        else:
            locked = True
        if not locked:
            yield None
            return
        try:
            baton = out / TORCH_BATON
            if torch_waits_on_its_lock_file() and baton.exists():
                baton.unlink()
                _say(f"fastdet.ops: removed {baton}, left by a build of the extension that was stopped "
                     "before it ended; building again")
            yield waited_s
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _summary(e: Exception) -> str:
    """The first compiler error line of a build failure (the full log is in e.__cause__)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("FAILED")]
    return (errors or lines or [type(e).__name__])[0][:300]


def load() -> bool:
    """Load the extension once per process (building it if needed); False if unavailable.

    The first failure is logged once as a warning; later calls return False quietly.
    """
    if _state["variant"] is not None:
        return True
    if _state["error"] is not None:
        return False
    with _lock:
        if _state["variant"] is not None or _state["error"] is not None:
            return _state["variant"] is not None
        variant = "cuda" if want_cuda() else "cpu"
        reason = _try_build(variant)
        if reason is not None and variant == "cuda" and not torch.cuda.is_available():
            # No GPU to run them on: the C++ kernels alone still serve the CPU.
            log.warning("fastdet.ops: the CUDA kernels did not build, building the C++ ones alone (%s)", reason)
            variant = "cpu"
            reason = _try_build(variant)
        if reason is not None:
            _state["error"] = reason
            log.warning("fastdet.ops: the C++/CUDA kernels are unavailable, using the torch reference (%s)", reason)
            return False
        _register_python_side()
        _state["variant"] = variant
        return True


def _try_build(variant: str) -> str | None:
    try:
        build(variant)
    except ExtensionUnavailable as e:
        return str(e)
    return None


def variant() -> str | None:
    """``"cpu"`` or ``"cuda"`` once loaded, else None."""
    return _state["variant"]  # type: ignore[return-value]


def error() -> str | None:
    """Why the extension is unavailable, if it is."""
    return _state["error"]  # type: ignore[return-value]


def has_cuda_kernels() -> bool:
    return _state["variant"] == "cuda"


# ----------------------------------------------------------------------------- fakes, autograd


def _pairwise_fake(a: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-2]))


def _giou_loss_fake(pred: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    return pred.new_empty(pred.shape[:-1])


def _giou_loss_backward_fake(grad, pred, target, eps):
    return torch.empty_like(pred), torch.empty_like(target)


def _ema_fake(ema, src, decay) -> None:
    return None


def _tal_fake(pred_scores, pred_bboxes, anchor_points, gt_labels, gt_bboxes, pad_gt_mask, bg_index, topk, alpha,
              beta, eps):
    B, A, C = pred_scores.shape
    return (pred_scores.new_empty((B, A), dtype=torch.int64), pred_scores.new_empty((B, A, 4)),
            pred_scores.new_empty((B, A, C)))


def _atss_fake(anchors, num_anchors_list, gt_labels, gt_bboxes, pad_gt_mask, pred_bboxes, bg_index, num_classes,
               topk, eps):
    B = gt_bboxes.shape[0]
    A = anchors.shape[0]
    return (gt_bboxes.new_empty((B, A), dtype=torch.int64), gt_bboxes.new_empty((B, A, 4)),
            gt_bboxes.new_empty((B, A, num_classes)))


def _yolo_targets_fake(gt_boxes, gt_labels, gt_mask, gt_scores, anchors, anchor_level, anchor_slot, strides, img_h,
                       img_w, num_classes):
    B = gt_boxes.shape[0]
    return [gt_boxes.new_empty((B, sum(1 for a in anchor_level if a == lvl), 6 + num_classes, img_h // s, img_w // s))
            for lvl, s in enumerate(strides)]


def _fcos_fake(points, strides, size_ranges, gt_boxes, gt_labels, gt_mask, radius):
    B, A = gt_boxes.shape[0], points.shape[0]
    return gt_boxes.new_empty((B, A), dtype=torch.int64), gt_boxes.new_empty((B, A), dtype=torch.int64)


def _simota_fake(pred_scores, pred_boxes, anchor_points, strides, gt_boxes, gt_labels, gt_mask, center_radius, topk,
                 iou_weight):
    B, A = pred_scores.shape[:2]
    return pred_scores.new_empty((B, A), dtype=torch.int64), pred_scores.new_empty((B, A))


def _giou_setup_context(ctx, inputs, output):
    pred, target, eps = inputs
    ctx.save_for_backward(pred, target)
    ctx.eps = eps


def _giou_backward(ctx, grad):
    pred, target = ctx.saved_tensors
    gp, gt = torch.ops.fastdet.giou_loss_backward(grad.contiguous(), pred, target, ctx.eps)
    return gp, gt, None


def _register_python_side() -> None:
    ns = NAMESPACE
    torch.library.register_fake(f"{ns}::box_iou")(_pairwise_fake)
    torch.library.register_fake(f"{ns}::generalized_box_iou")(_pairwise_fake)
    torch.library.register_fake(f"{ns}::giou_loss")(_giou_loss_fake)
    torch.library.register_fake(f"{ns}::giou_loss_backward")(_giou_loss_backward_fake)
    torch.library.register_fake(f"{ns}::ema_update_")(_ema_fake)
    torch.library.register_fake(f"{ns}::task_aligned_assign")(_tal_fake)
    torch.library.register_fake(f"{ns}::atss_assign")(_atss_fake)
    torch.library.register_fake(f"{ns}::yolo_targets")(_yolo_targets_fake)
    torch.library.register_fake(f"{ns}::fcos_assign")(_fcos_fake)
    torch.library.register_fake(f"{ns}::simota_assign")(_simota_fake)
    torch.library.register_autograd(f"{ns}::giou_loss", _giou_backward, setup_context=_giou_setup_context)
