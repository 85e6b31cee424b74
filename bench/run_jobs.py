"""Run bench/gpu_check.sh's precompile jobs side by side within the GPU's memory.

    python bench/run_jobs.py JOBS --deadline EPOCH_S --logs DIR --done FILE \\
        [--max-parallel N] [--memory-gib GIB] [--per-job-gib GIB]

JOBS has a line per job, ``name<TAB>GiB<TAB>command``, in priority order; GiB is what the
job's step may hold on the GPU (bench/memory_estimate.py --gpu-check). Jobs start in that
order as long as at most N run and their GiB, plus ``--per-job-gib`` each for the CUDA
context and the allocator's slack, stay within ``--memory-gib``; a job that does not fit
waits, and a later one that fits starts before it; one larger than the budget starts when
nothing else runs. A count alone (five batch-64 graphs at once on an 80 GB H100) could
put PP-YOLO's 28 GiB, FCOS's 16, batch 128's 23 and two more on the GPU together. ``--memory-gib 0``
drops the memory rule (the CPU rehearsal). Every job is cut at the deadline (SIGTERM to
its process group, SIGKILL 5 s later: exit 124); one that cannot start 5 s before it is
not started. Each writes DIR/NAME.log; each end is a line of FILE, ``name<TAB>exit<TAB>s``,
or ``name not started: deadline``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    name: str
    gib: float
    command: list[str]
    proc: subprocess.Popen | None = None
    t0: float = 0.0
    killed_at: float | None = None
    log: object = field(default=None, repr=False)


def read_jobs(path: Path) -> list[Job]:
    jobs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t", 2)
        if len(parts) != 3:
            raise SystemExit(f"{path}:{n}: expected 'name<TAB>GiB<TAB>command', got {line!r}")
        jobs.append(Job(parts[0], float(parts[1]), shlex.split(parts[2])))
    return jobs


def run(jobs: list[Job], deadline: float, logs: Path, done: Path, max_parallel: int, memory_gib: float,
        per_job_gib: float, poll_s: float = 0.2, min_start_s: float = 5.0) -> None:
    """Run ``jobs`` (see the module's docstring); a job starts only ``min_start_s`` before the deadline."""
    logs.mkdir(parents=True, exist_ok=True)
    pending, running = list(jobs), []

    def record(line: str) -> None:
        with done.open("a") as f:
            f.write(line + "\n")

    def in_use() -> float:
        return sum(j.gib + per_job_gib for j in running)

    while pending or running:
        now = time.time()
        for j in list(running):
            rc = j.proc.poll()
            if rc is None and now >= deadline and j.killed_at is None:
                os.killpg(j.proc.pid, signal.SIGTERM)
                j.killed_at = now
            elif rc is None and j.killed_at is not None and now >= j.killed_at + 5:
                os.killpg(j.proc.pid, signal.SIGKILL)
            if rc is not None:
                running.remove(j)
                j.log.close()
                record(f"{j.name}\t{124 if j.killed_at is not None else rc}\t{round(now - j.t0)}")
                print(f"[jobs] {j.name} ended (exit {rc}) after {now - j.t0:.0f} s", flush=True)
        if deadline - now < min_start_s:
            for j in pending:
                record(f"{j.name} not started: deadline")
            pending = []
        for j in list(pending):
            if len(running) >= max_parallel:
                break
            fits = memory_gib <= 0 or not running or in_use() + j.gib + per_job_gib <= memory_gib
            if not fits:
                continue
            j.log = (logs / f"{j.name}.log").open("w")
            j.t0 = time.time()
            pending.remove(j)
            try:
                j.proc = subprocess.Popen(j.command, stdout=j.log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:  # a command that cannot start is that job's failure, not the lane's
                print(f"cannot start {j.command[:1]}: {e}", file=j.log, flush=True)
                j.log.close()
                record(f"{j.name}\t127\t0")
                print(f"[jobs] {j.name} could not start: {e}", flush=True)
                continue
            running.append(j)
            budget = f"{memory_gib:g}" if memory_gib > 0 else "unlimited"
            print(f"[jobs] {j.name} started ({j.gib:g} GiB; {in_use():g} of {budget} GiB reserved, "
                  f"{len(running)} running)", flush=True)
        if pending or running:
            time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", type=Path)
    p.add_argument("--deadline", type=float, required=True, help="seconds since the epoch")
    p.add_argument("--logs", type=Path, required=True)
    p.add_argument("--done", type=Path, required=True)
    p.add_argument("--max-parallel", type=int, default=2)
    p.add_argument("--memory-gib", type=float, default=0.0)
    p.add_argument("--per-job-gib", type=float, default=1.0)
    a = p.parse_args(argv)
    if a.max_parallel < 1:
        raise SystemExit(f"--max-parallel must be at least 1, got {a.max_parallel}")
    run(read_jobs(a.jobs), a.deadline, a.logs, a.done, a.max_parallel, a.memory_gib, a.per_job_gib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
