"""Record, or check, every family's losses over 20 training steps through the used-by line.

Issue 40 moves the trainer, the step and the compile code about; "nothing changes for
users" means the same losses, bit for bit, before and after. This runs

    python -m fastdet.train --arch A --size S --data demo --device cpu --max-steps 20 ...

for each family (eager, fp32, one train size, a loss line every step), reads each step's
losses from the run's ``metrics.jsonl`` (JSON floats round-trip exactly) and writes them,
or compares them with a record:

    python tools/record_step_losses.py --write tests/fixtures/step_losses_20.json   # before
    python tools/record_step_losses.py --check tests/fixtures/step_losses_20.json   # after

``--check`` prints, per family, the largest relative difference and exits 1 unless every
loss of every step is equal (``--rtol`` loosens it for another machine: oneDNN picks its
kernels by CPU, so bit-for-bit holds on the machine that recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# (arch, size): the smallest size of each family, as its demo trains.
FAMILIES = (("ppyoloe", "s"), ("yolox", "s"), ("ppyolo", "r18vd"), ("fcos", "r50"))
STEPS = 20
SETTINGS = ["--device", "cpu", "--max-steps", str(STEPS), "--img-size", "160", "--batch-size", "4",
            "--amp", "off", "--loader", "torch",
            "--set", "run.log_interval=1", "--set", "run.progress=false",
            "--set", "run.tensorboard=false", "--set", "data.train_sizes=[160]",
            "--set", "data.num_workers=0", "--set", "run.seed=0"]
META = ("epoch", "step", "lr", "images_per_s", "time_s", "max_step_gap_s")


def run_family(arch: str, size: str, workdir: Path, threads: int) -> list[dict[str, float]]:
    """Train 20 steps of (arch, size) on the demo set; each step's losses (and LR)."""
    out = workdir / f"{arch}-{size}"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "fastdet.train", "--arch", arch, "--size", size, "--data", "demo",
           "--output-dir", str(out), *SETTINGS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arch}-{size}: training failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "lr": r["lr"], **{k: v for k, v in r.items() if k not in META}}
            for r in rows]


def record(threads: int, jobs: int) -> dict[str, list[dict[str, float]]]:
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = {f"{a}-{s}": pool.submit(run_family, a, s, Path(tmp), threads) for a, s in FAMILIES}
        return {name: f.result() for name, f in futures.items()}


def compare(want: dict, got: dict, rtol: float) -> tuple[bool, list[str]]:
    ok, lines = True, []
    for name, rows in want.items():
        have = got.get(name, [])
        if [r["step"] for r in rows] != [r["step"] for r in have]:
            ok = False
            lines.append(f"{name}: steps {[r['step'] for r in have]} != recorded {[r['step'] for r in rows]}")
            continue
        worst, where = 0.0, ""
        for a, b in zip(rows, have):
            if set(a) != set(b):
                ok = False
                lines.append(f"{name} step {a['step']}: keys {sorted(b)} != recorded {sorted(a)}")
                continue
            for k in a:
                d = abs(a[k] - b[k]) / max(abs(a[k]), 1e-30)
                if d > worst:
                    worst, where = d, f" (step {a['step']} {k}: {b[k]!r} vs {a[k]!r})"
        ok = ok and worst <= rtol
        lines.append(f"{name}: {len(rows)} steps, largest relative difference {worst:.3g}"
                     f"{where}{'' if worst <= rtol else '  FAIL'}")
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", type=Path, help="record the losses into this JSON file")
    g.add_argument("--check", type=Path, help="compare with the losses recorded in this JSON file")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance of --check (default: equal)")
    p.add_argument("--jobs", type=int, default=2, help="families trained at once")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per training")
    args = p.parse_args(argv)
    got = record(args.threads, args.jobs)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps({"settings": SETTINGS, "losses": got}, indent=1) + "\n")
        print(f"wrote {args.write}: {', '.join(f'{k} ({len(v)} steps)' for k, v in got.items())}")
        return 0
    want = json.loads(args.check.read_text())
    if want.get("settings") != SETTINGS:
        print(f"{args.check} was recorded with other settings: {want.get('settings')}")
        return 1
    ok, lines = compare(want["losses"], got, args.rtol)
    print("\n".join(lines))
    print("same losses" if ok else "losses differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
