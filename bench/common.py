"""What the benchmarks share: timed windows, peak memory, dynamo counters, the
environment block, result file names, terminal tables and JSON output.

Timing rules every benchmark here follows (they are what makes two figures comparable):

- nothing is timed before its warm-up is over (compilation, CUDA-graph capture, cuDNN
  and allocator warm-up, loader start-up);
- on CUDA the device is synchronised before a window starts and when it ends, so a
  window's wall time covers all the work queued in it; inside a window there is no
  sync beyond what the measured code itself does;
- a figure is the median over several windows, reported with its spread
  ``(max - min) / median``: a difference between two modes smaller than their spreads
  is noise.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from fastdet.runtime.outputs import refuse_replacing

SCHEMA = "fastdet.bench/1"
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- timing

def sync(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(rates: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and spread (percent of the median) of per-window rates."""
    rates = [float(r) for r in rates]
    if not rates:
        raise ValueError("summarize: no timed windows")
    med = statistics.median(rates)
    return {
        "median": med,
        "min": min(rates),
        "max": max(rates),
        "spread_pct": 100.0 * (max(rates) - min(rates)) / med if med > 0 else math.inf,
        "windows": rates,
    }


def time_windows(run_window: Callable[[], int], windows: int, device: torch.device) -> dict[str, Any]:
    """Call ``run_window`` ``windows`` times; each call does one window of work and
    returns how many items (images) it processed. Returns :func:`summarize` of the
    items/s of each window plus ``seconds`` (all windows) and ``items``."""
    if windows < 1:
        raise ValueError(f"need at least one timed window, got {windows}")
    rates, total_s, total_n = [], 0.0, 0
    sync(device)
    for _ in range(windows):
        t0 = time.perf_counter()
        n = run_window()
        sync(device)
        dt = time.perf_counter() - t0
        rates.append(n / dt)
        total_s += dt
        total_n += n
    return {**summarize(rates), "seconds": total_s, "items": total_n}


# --------------------------------------------------------------------------- memory

class PeakMemory:
    """Peak memory while the ``with`` block runs.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors of the caching allocator, CUDA
    graph pools included; DALI's own allocations are not in it). CPU: the process's
    peak resident set (``VmHWM``), reset on entry through ``/proc/self/clear_refs``;
    where that reset is refused it is the peak since the process started.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.mb: float | None = None
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss"

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not _reset_rss_peak():
            self.kind = "cpu_peak_rss_since_start"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self.mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self.mb = _rss_peak_mb()


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_peak_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return None


def release_memory(device: torch.device) -> None:
    """Free what the last mode left behind (its graphs, pools, cached blocks)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- dynamo

def dynamo_counts() -> dict[str, int]:
    """Graphs Dynamo compiled so far and graph breaks it recorded (process totals)."""
    import torch._dynamo.utils as du

    c = du.counters
    return {
        "graphs": int(c["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(c["graph_break"].values())),
    }


@contextmanager
def fresh_dynamo() -> Iterator[None]:
    """Start a mode with empty Dynamo caches (so one mode's guards or recompile budget
    never leak into the next); inductor's on-disk cache is kept, so a graph identical to
    one compiled earlier in the run is loaded instead of compiled again."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- environment

def _version(module: str) -> str | None:
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return str(getattr(mod, "__version__", "unknown"))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git() -> dict[str, Any]:
    """The checkout's commit; where the tree is a copy without ``.git`` (a lent GPU
    machine), ``$FASTDET_GIT_COMMIT`` as the caller passed it."""
    commit = _run(["git", "rev-parse", "HEAD"], REPO)
    if commit is None:
        return {"commit": os.environ.get("FASTDET_GIT_COMMIT"), "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO)
    return {"commit": commit, "dirty": bool(status)}


def gpu_info(device: torch.device) -> dict[str, Any] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    p = torch.cuda.get_device_properties(idx)
    driver = _run(["nvidia-smi", f"--id={idx}", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "name": p.name,
        "count": torch.cuda.device_count(),
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "multiprocessors": p.multi_processor_count,
        "driver": driver,
    }


def ops_backends(device: torch.device) -> dict[str, Any]:
    """The back end ``fastdet.ops`` picks for each op on ``device``, in eager code and
    under ``torch.compile`` (asking may build the C++/CUDA extension, once)."""
    try:
        from fastdet.ops import dispatch
    except ImportError as e:
        return {"error": one_line(e)}
    t = device.type
    return {
        "eager": dispatch.describe(t),
        "compiled": {op: dispatch.backend_for(op, t, True) for op in dispatch.OPS},
    }


def env_info(device: torch.device, with_ops: bool = True) -> dict[str, Any]:
    """The environment a figure was measured in (goes into every JSON result).
    ``with_ops=False`` leaves out :func:`ops_backends` (which may build the extension)."""
    import fastdet

    cudnn = torch.backends.cudnn
    env_vars = {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE", "FASTDET_", "OMP_NUM_THREADS",
                                 "CUDA_VISIBLE_DEVICES", "NCCL_", "TORCH_LOGS"))}
    try:
        threads = len(os.sched_getaffinity(0))
    except AttributeError:
        threads = os.cpu_count()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn.version() if cudnn.is_available() else None,
        "triton": _version("triton"),
        "dali": _version("nvidia.dali"),
        "torchvision": _version("torchvision"),
        "numpy": _version("numpy"),
        "fastdet": getattr(fastdet, "__version__", None),
        "git": _git(),
        "device": str(device),
        "gpu": gpu_info(device),
        "cpu": {"model": _cpu_model(), "cores_usable": threads, "torch_threads": torch.get_num_threads()},
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": cudnn.allow_tf32},
        "cudnn_benchmark": cudnn.benchmark,
        "ops_backends": ops_backends(device) if with_ops else None,
        "env_vars": env_vars,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")


def result_stem(env: dict[str, Any], what: str) -> str:
    """``<date>_<device>_torch-<version>_<what>``, the name a result file is stored under
    in ``bench/results/`` (see its README), e.g.
    ``2026-12-02_nvidia-h200_torch-2.11.0-cu130_throughput`` (only ``[a-z0-9._-]``)."""
    date = env["date"][:10]
    dev = env["gpu"]["name"] if env.get("gpu") else f"cpu-{env['cpu']['model']}"
    return f"{date}_{_slug(dev)}_torch-{_slug(env['torch'])}_{_slug(what)}"


# --------------------------------------------------------------------------- output

def check_output_file(path: str | Path, flag: str, overwrite: bool = False) -> None:
    """A ``ValueError`` (one line naming ``flag``) if a result file cannot go to ``path``: a
    folder there, a file where a folder above it should be, a folder that cannot be written,
    or, without ``overwrite``, a file there already. Called before measuring, so a run does
    not end in that error after its minutes, nor replace a user's file unasked."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; name the file to write in it")
    above = path.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent  # write_json makes the missing folders below it
    if not above.is_dir():
        raise ValueError(f"{flag} {path}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {above} cannot be written")
    if not overwrite:
        refuse_replacing([path], f"{flag} {path}", "--overwrite")


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically (a killed run never leaves half a file); a write that fails
    (or is interrupted) takes its temporary file away with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec) if spec else str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain text table; ``columns`` are ``(key, header, format spec)``. Columns
    with a format spec (numbers) are right-aligned, the others left-aligned."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([fmt(r.get(k), spec) for k, _, spec in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    right = [bool(spec) for _, _, spec in columns]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if right[i] and j > 0 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
