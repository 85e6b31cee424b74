"""The DALI check: every family's recipe through the DALI pipeline beside the torch loader.

For each family (its preset's training stages of epoch 0, every stage of its recipe) it
measures, in one run, each row in a fresh process:

- ``torch``: the torch DataLoader with ``--workers`` workers;
- ``dali``: the DALI pipeline of this tree (``num_threads = --workers``, plus its source
  workers), on ``--device`` ("cuda": mixed decoder and device stages; "cpu": CPU-only mode);
- ``dali@<label>`` for each ``--baseline-tree LABEL=PATH``: the DALI pipeline of another
  checkout of fastdet (e.g. ``git worktree add /tmp/dali-before <commit>``), the same way.

Each row gives images/s (median over windows, with spread; ``bench.loaders.measure_loader``:
no model, every batch fully produced on the device as the trainer receives it), the peak
host memory of the row's process tree (PSS, so the workers' shared pages count once), the
peak number of host threads in that tree, and on CUDA the peak device memory in use
(``cudaMemGetInfo``, sampled; it sees DALI's pools, which torch's allocator counters do not).

First it checks the decoder the pipeline uses against a reference on ``--decode-images``
images, decoded ``--decode-passes`` times as whole batches: on CUDA nvJPEG through DALI's
mixed decoder against DALI's CPU decoder (nvJPEG's batched hardware decode corrupted images
on some H100s: torchcodec PR #1634, pytorch/vision#9606); on the CPU, DALI's CPU decoder
against PIL (the torch back end's), which rehearses the same code. An image fails when its
luma's mean absolute difference exceeds 2 levels or more than 1 % of its luma values differ
by more than 32 (``compare_decodes``: the decoders' chroma upsampling differs at colour
edges, which luma does not see; a corrupted decode differs by tens over whole blocks). The
JSON is rewritten after the check and after every row, so a run cut short keeps them; the
rows' logs go beside it.

End to end with the compiled step is ``bench/throughput.py --modes data,e2e``.

    python bench/dali_check.py --device cuda --data /data/coco --workers 16 --store
    python bench/dali_check.py --device cpu --quick                 # the rehearsal, tiny sizes
    python bench/dali_check.py --device cpu --workers 2 --baseline-tree before=/tmp/dali-before --store

``--store`` writes ``bench/results/<date>_<device>_torch-<v>_dali-check.json`` (see its
README); ``--json PATH`` writes the same document anywhere. The exit status is 1 when the
decode check fails or a row fails to run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_RESULT = "DALI_CHECK_RESULT "
QUICK = dict(batch_size=2, size=128, batches=4, warmup=1, windows=2, decode_images=4, decode_passes=2)


# --------------------------------------------------------------------------- the process tree

def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int(d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _threads(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeMonitor:
    """Peak PSS (MB) and thread count of a process and its descendants, sampled every ``period`` s."""

    def __init__(self, pid: int, period: float = 0.2) -> None:
        self.pid, self.period = pid, period
        self.peak_pss_mb, self.peak_threads, self.peak_processes = 0.0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = _tree(self.pid)
            self.peak_pss_mb = max(self.peak_pss_mb, sum(_pss_kb(p) for p in pids) / 1024.0)
            self.peak_threads = max(self.peak_threads, sum(_threads(p) for p in pids))
            self.peak_processes = max(self.peak_processes, len(pids))
            self._stop.wait(self.period)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {"peak_host_pss_mb": round(self.peak_pss_mb, 1), "peak_host_threads": self.peak_threads,
                "peak_processes": self.peak_processes}


# --------------------------------------------------------------------------- in the row's process

def _use_tree(tree: Path) -> None:
    """Import fastdet (and ``bench``) from ``tree``: its ``fastdet/`` on the path, and its
    ``pipelines/`` as ``fastdet.pipelines`` (the editable install maps that name to this
    checkout's folder otherwise)."""
    import importlib.util

    sys.path.insert(0, str(tree))
    import fastdet

    if not Path(fastdet.__file__).resolve().is_relative_to(tree):
        raise RuntimeError(f"fastdet came from {fastdet.__file__}, not from {tree}")
    for name, folder in (("fastdet.pipelines", "pipelines"), ("fastdet._csrc", "csrc")):
        init = tree / folder / "__init__.py"
        if init.exists():
            spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(tree / folder)])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            setattr(fastdet, name.rsplit(".", 1)[1], mod)


class _DeviceMemory:
    """Peak device memory in use (MB) above what was in use at the start, sampled."""

    def __init__(self, device) -> None:
        import torch

        self.device, self.peak = device, 0
        free, total = torch.cuda.mem_get_info(device)
        self.base, self._stop = total - free, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch

        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free - self.base)
            self._stop.wait(0.05)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak / 2**20, 1)


def _config(spec: dict[str, Any]):
    from fastdet import registry
    from fastdet.config import apply_overrides

    arch = spec["family"]
    size_name = next(iter(registry.family(arch).sizes))
    cfg = registry.get_preset(arch, size_name)
    return apply_overrides(cfg, {
        "data.data": spec["data"], "data.batch_size": spec["batch_size"], "data.img_size": spec["size"],
        "data.train_sizes": (spec["size"],), "data.multiscale": False, "data.num_workers": spec["workers"],
        "data.max_boxes": 100, "data.check_images": "decode", **({"data.cache_dir": spec["cache_dir"]}
                                                                 if spec.get("cache_dir") else {}),
    }), size_name


def _row(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement (``spec``: family, backend, tree, device, sizes) in this process."""
    tree = Path(spec["tree"]).resolve()
    _use_tree(tree)
    import torch

    from bench.loaders import measure_loader
    from fastdet import registry
    from fastdet.data.formats import load_split

    cfg, size_name = _config(spec)
    ds = load_split(cfg.data, "train", check_images="decode")
    stages = registry.phase(cfg, 0).stages
    device = torch.device(spec["device"])
    mem = _DeviceMemory(device) if device.type == "cuda" else None
    out = measure_loader(cfg, ds, spec["backend"], device, spec["batches"], spec["warmup"],
                         windows=spec["windows"], stages=stages)
    if mem is not None:
        out["peak_device_mb"] = mem.stop()
    if spec["backend"] == "dali":
        out["pipelines_from"] = str(Path(sys.modules["fastdet.pipelines.stages"].__file__).resolve().parent)
    out.update(family=spec["family"], preset=size_name, stages=[repr(s) for s in stages], images_in_set=len(ds.records))
    return out


# Rec. 601 luma, the Y of JPEG's YCbCr: the same in both decoders whatever their chroma upsampling.
_LUMA = (0.299, 0.587, 0.114)


def compare_decodes(got, ref) -> dict[str, Any]:
    """One image decoded twice (uint8 HWC RGB): ``ok`` unless its luma's mean absolute
    difference exceeds 2 levels or more than 1 % of its luma values differ by more than 32.

    Luma, not RGB: nvJPEG (DALI's mixed decoder, ``jpeg_fancy_upsampling=False``) and the
    CPU decoder (libjpeg-turbo's fancy upsampling) rebuild the subsampled chroma
    differently, which moves R, G and B at every colour edge but not Y = 0.299 R + 0.587 G
    + 0.114 B (the two chroma terms cancel in it, up to clipping). On the demo set's
    textured images the two upsamplings differ by up to 6 levels of mean RGB difference
    (a tenth of its images over 2), their luma by at most 0.3; a corrupted decode is off by
    tens over whole blocks, in luma too. The RGB figures are kept for the record."""
    import numpy as np

    a, b = np.asarray(got, dtype=np.float32), np.asarray(ref, dtype=np.float32)
    if a.shape != b.shape:
        return {"shape": [list(a.shape), list(b.shape)], "ok": False}
    w = np.asarray(_LUMA, dtype=np.float32)
    dl, d = np.abs(a @ w - b @ w), np.abs(a - b)
    mean, big = float(dl.mean()), float((dl > 32).mean())
    return {"mean_abs_luma": round(mean, 3), "frac_luma_over_32": big, "max_abs_luma": round(float(dl.max()), 1),
            "mean_abs_rgb": round(float(d.mean()), 3), "max_abs_rgb": int(d.max()),
            "ok": mean <= 2.0 and big <= 0.01}


def _decode_check(spec: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's decoder against the reference on whole batches (see the module doc)."""
    _use_tree(Path(spec["tree"]).resolve())
    import numpy as np
    import nvidia.dali.fn as fn
    from nvidia.dali import pipeline_def

    from fastdet.data.augment import decode_image
    from fastdet.data.formats import load_split
    from fastdet.pipelines import stages

    cfg, _ = _config({**spec, "family": spec["families"][0]})
    records = load_split(cfg.data, "train", check_images="decode").records[: spec["decode_images"]]
    files = [r.file for r in records]
    encoded = [np.fromfile(f, dtype=np.uint8) for f in files]
    gpu = spec["device"] == "cuda"

    @pipeline_def(batch_size=len(files), num_threads=max(1, spec["workers"]), device_id=0 if gpu else None)
    def pipe():
        enc = fn.external_source(source=lambda: encoded, batch=True)
        if gpu:
            return stages.decode(enc, "gpu"), stages.decode(enc, "cpu")
        return stages.decode(enc, "cpu")

    p = pipe()
    p.build()
    reference = None if gpu else [decode_image(f) for f in files]
    worst, failed = [], set()
    for _ in range(spec["decode_passes"]):
        outs = p.run()
        got = outs[0].as_cpu() if gpu else outs[0]
        ref = [np.asarray(outs[1][i]) for i in range(len(files))] if gpu else reference
        for i, f in enumerate(files):
            r = compare_decodes(np.asarray(got[i]), ref[i])
            if not r.pop("ok"):
                failed.add(f)
            worst.append({"file": f, **r})
    worst.sort(key=lambda r: -r.get("mean_abs_luma", 1e9))
    return {"decoder": "mixed (nvJPEG) vs DALI cpu" if gpu else "DALI cpu vs PIL", "images": len(files),
            "passes": spec["decode_passes"], "batch": len(files), "failed": sorted(failed), "ok": not failed,
            "worst": worst[:5]}


# --------------------------------------------------------------------------- the driver

def _spawn(spec: dict[str, Any], log_dir: Path, timeout: float) -> dict[str, Any]:
    """Run ``spec`` in a fresh process, watching its process tree."""
    log = log_dir / f"{spec['what']}-{spec.get('family', 'all')}-{spec['label']}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_row", json.dumps(spec)]
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=spec["tree"])
        mon = TreeMonitor(proc.pid)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        tree = mon.stop()
    lines = [ln for ln in stdout.splitlines() if ln.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        return {"label": spec["label"], "error": f"exit {proc.returncode}: {' '.join(tail)[-300:]}", "log": str(log),
                **tree}
    return {"label": spec["label"], **json.loads(lines[-1][len(_RESULT):]), **tree,
            "process_s": round(time.perf_counter() - t0, 1)}


def _print_row(r: dict[str, Any]) -> None:
    rate = f"{r['images_per_s']:8.1f} img/s (spread {r['spread_pct']:.0f}%)" if "images_per_s" in r \
        else r.get("skipped") or r.get("error")
    print(f"{r['family']:>8} {r['label']:>16}: {rate}; peak host {r['peak_host_pss_mb']:.0f} MB PSS, "
          f"{r['peak_host_threads']} threads" + (f", device {r['peak_device_mb']:.0f} MB"
                                                 if r.get("peak_device_mb") is not None else ""), flush=True)


def _summary(rows: list[dict[str, Any]], families: list[str]) -> dict[str, Any]:
    """Per family and row label: the median over repeats of images/s and of the peaks; the ratios."""
    import statistics

    out: dict[str, Any] = {}
    for fam in families:
        by: dict[str, Any] = {}
        for lab in dict.fromkeys(r["label"] for r in rows if r["family"] == fam):
            ok = [r for r in rows if r["family"] == fam and r["label"] == lab and "images_per_s" in r]
            if ok:
                by[lab] = {k: statistics.median(r[k] for r in ok) for k in ("images_per_s", "peak_host_pss_mb",
                                                                              "peak_host_threads")}
                by[lab]["repeats"] = [round(r["images_per_s"], 1) for r in ok]
                if all(r.get("peak_device_mb") is not None for r in ok):
                    by[lab]["peak_device_mb"] = statistics.median(r["peak_device_mb"] for r in ok)
        rate = {lab: v["images_per_s"] for lab, v in by.items()}
        if rate.get("dali"):
            by["ratios"] = {f"dali_over_{lab}": rate["dali"] / v for lab, v in rate.items() if lab != "dali"}
        out[fam] = by
    return out


def _families() -> list[str]:
    from fastdet.models import ARCHITECTURES

    return [a for a, f in ARCHITECTURES.items() if f.recipe is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--data", default="demo", help="'demo' or a COCO root (annotations/, train2017/)")
    p.add_argument("--families", nargs="+", help="default: every family with a recipe")
    p.add_argument("--workers", type=int, default=16, help="DataLoader workers / DALI CPU threads (the same)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=640)
    p.add_argument("--batches", type=int, default=40, help="timed batches per row")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1,
                   help="measure each family's rows this many times, in alternating order (a loaded "
                        "machine drifts); a row's figure is then the median of its repeats")
    p.add_argument("--backends", nargs="+", default=["torch", "dali"], choices=["torch", "dali"])
    p.add_argument("--baseline-tree", action="append", default=[], metavar="LABEL=PATH",
                   help="also measure the DALI pipeline of another checkout (repeatable)")
    p.add_argument("--decode-images", type=int, default=64)
    p.add_argument("--decode-passes", type=int, default=8)
    p.add_argument("--cache-dir", help="data.cache_dir (the demo set and decode-check caches)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a rehearsal of every part")
    p.add_argument("--row-timeout", type=float, default=1800.0, help="seconds one row may take")
    p.add_argument("--json", type=Path)
    p.add_argument("--store", action="store_true", help="write the JSON under bench/results/ (see its README)")
    p.add_argument("--_row", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._row:  # one row, in its own process
        spec = json.loads(args._row)
        res = _decode_check(spec) if spec["what"] == "decode" else _row(spec)
        print(_RESULT + json.dumps(res, default=str), flush=True)
        return 0

    sys.path.insert(0, str(REPO))
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    trees = [("", REPO)]
    for item in args.baseline_tree:
        label, _, path = item.partition("=")
        if not path or not (Path(path) / "fastdet").is_dir():
            p.error(f"--baseline-tree {item!r}: expected LABEL=PATH to a fastdet checkout")
        trees.append((label, Path(path).resolve()))
    families = args.families or _families()
    common = dict(device=args.device, data=args.data, batch_size=args.batch_size, size=args.size,
                  workers=args.workers, batches=args.batches, warmup=args.warmup, windows=args.windows,
                  cache_dir=args.cache_dir)
    # The rows' own logs (a failed row's traceback) beside the JSON, so they travel with it.
    log_dir = (args.json.parent / f"{args.json.stem}-logs" if args.json
               else Path(os.environ.get("TMPDIR", "/tmp")) / f"dali-check-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    decode: dict[str, Any] = {"label": "decode", "error": "not run yet"}
    env, paths = None, []
    if args.json or args.store:
        import torch

        from bench.common import SCHEMA, env_info, result_stem

        env = env_info(torch.device(args.device), with_ops=False)
        paths = [args.json] if args.json else []
        if args.store:
            path = REPO / "bench" / "results" / f"{result_stem(env, 'dali-check')}.json"
            n = 2
            while path.exists():
                path = path.with_name(f"{result_stem(env, 'dali-check')}-{n}.json")
                n += 1
            paths.append(path)

    def write() -> None:
        """The document as measured so far (after every row: a run cut short keeps what finished)."""
        if not paths:
            return
        from bench.common import write_json

        doc = {"schema": SCHEMA, "kind": "dali-check",
               "command": "python bench/dali_check.py " + " ".join(argv or sys.argv[1:]),
               "settings": {**common, "quick": args.quick,
                            "baseline_trees": dict((lab, str(t)) for lab, t in trees[1:])},
               "summary": _summary(rows, families), "rows": rows, "decode_check": decode,
               "e2e": "not measured here: bench/throughput.py --modes data,e2e", "env": env}
        for path in paths:
            write_json(path, doc)

    # The decode check first: seconds, and the one correctness figure of the run.
    decode = _spawn(dict(common, what="decode", label="decode", tree=str(REPO), families=families,
                         decode_images=args.decode_images, decode_passes=args.decode_passes), log_dir,
                    args.row_timeout)
    print(f"decode check ({decode.get('decoder', '?')}): "
          + ("ok" if decode.get("ok") else f"FAILED {decode.get('failed') or decode.get('error')}"), flush=True)
    write()
    for i, fam in enumerate(families):
        specs = [dict(common, what="row", family=fam, backend="torch", label="torch", tree=str(REPO))] \
            if "torch" in args.backends else []
        if "dali" in args.backends:
            specs += [dict(common, what="row", family=fam, backend="dali", label=f"dali@{lab}" if lab else "dali",
                           tree=str(t)) for lab, t in trees]
        for rep in range(args.repeats):
            # Alternate the order between families and repeats: a drift of the shared machine hits every row.
            for spec in (specs[::-1] if (i + rep) % 2 else specs):
                r = _spawn(spec, log_dir, args.row_timeout)
                r.update(family=fam, repeat=rep)
                rows.append(r)
                _print_row(r)
                write()
    summary = _summary(rows, families)
    for fam, by in summary.items():
        print(f"{fam:>8}: " + "; ".join(f"{lab} {v['images_per_s']:.1f} img/s, {v['peak_host_pss_mb']:.0f} MB"
                                        for lab, v in by.items() if lab != "ratios")
              + "; " + ", ".join(f"{k} {v:.2f}x" for k, v in by.get("ratios", {}).items()))
    for path in paths:
        print(f"{'stored' if path != args.json else 'written:'} {path}")
    bad = not decode.get("ok") or any("error" in r for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
