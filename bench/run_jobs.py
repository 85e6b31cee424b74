"""Run bench/gpu_check.sh's precompile jobs side by side within the GPU's memory.

    python bench/run_jobs.py JOBS --deadline EPOCH_S --logs DIR --done FILE \\
        [--max-parallel N] [--memory-gib GIB] [--per-job-gib GIB] [--urgent N] [--main-gib-file FILE] \\
        [--state FILE]

JOBS has a line per job, ``name<TAB>GiB<TAB>command``, in priority order; GiB is what the
job's step may hold on the GPU (bench/memory_estimate.py --gpu-check). Jobs start in that
order as long as at most N run and their GiB, plus ``--per-job-gib`` each for the CUDA
context and the allocator's slack, plus what the main lane holds, stay within
``--memory-gib`` (the GPU's memory); a job that does not fit waits, and a later one that
fits starts before it; one larger than the budget starts when nothing else runs and the
main lane holds nothing. ``--memory-gib 0`` drops the memory rule (the CPU rehearsal).

The main lane shares the GPU's memory with these jobs through two files. It writes two
figures into ``--main-gib-file`` (read at every poll; absent: 0 0), ``NOW LATER``: the GiB
it holds now, and the most it will hold while the jobs still to start run. The first
``--urgent`` jobs of the file (the graphs the main lane waits for next) start within NOW,
the others within LATER, so a job of lower priority never takes the room a main part will
need before it ends. This script writes ``--state`` after every poll,
``reserved<TAB>now later<TAB>names<TAB>pids``: the GiB its running jobs reserve, the main
lane's figures as it last read them (the main lane trusts ``reserved`` once they are its
own), the running jobs and their process ids (each the leader of its own process group). A
main part that waits for memory so waits only for jobs to end; should this script die
without writing its jobs' ends (a crash, SIGKILL), the main lane stops the jobs it left
running by those ids.

Every job is cut at the deadline, or when this script gets SIGTERM (the main lane's last
part needs the cores): SIGTERM to the job's process group, SIGKILL 5 s later, exit 124;
a job that cannot start 5 s before the deadline, or after SIGTERM, is not started. Each
writes DIR/NAME.log; each end is a line of FILE, ``name<TAB>exit<TAB>s``, or ``name not
started: deadline`` (``stopped`` after SIGTERM).
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


def read_main(path: Path | None) -> tuple[float, float] | None:
    """The main lane's ``NOW LATER`` GiB from ``path``; None while there is no file or no
    figures in it (the figures read before stay)."""
    if path is None:
        return None
    try:
        now, later = (float(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return now, max(now, later)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run(jobs: list[Job], deadline: float, logs: Path, done: Path, max_parallel: int, memory_gib: float,
        per_job_gib: float, poll_s: float = 0.2, min_start_s: float = 5.0, main_gib_file: Path | None = None,
        state: Path | None = None, urgent: int = 0) -> None:
    """Run ``jobs`` (see the module's docstring); a job starts only ``min_start_s`` before the deadline."""
    logs.mkdir(parents=True, exist_ok=True)
    pending, running = list(jobs), []
    stop = {"why": None}
    main = (0.0, 0.0)  # what the main lane holds now, the most it will hold later
    first = {j.name for j in jobs[:urgent]}

    def on_term(signum, frame):
        stop["why"] = "stopped"

    old = signal.signal(signal.SIGTERM, on_term)

    def record(line: str) -> None:
        with done.open("a") as f:
            f.write(line + "\n")

    def in_use() -> float:
        return sum(j.gib + per_job_gib for j in running)

    try:
        while pending or running:
            now = time.time()
            if stop["why"] is None and now >= deadline:
                stop["why"] = "deadline"
            main = read_main(main_gib_file) or main
            for j in list(running):
                rc = j.proc.poll()
                if rc is None and stop["why"] and j.killed_at is None:
                    os.killpg(j.proc.pid, signal.SIGTERM)
                    j.killed_at = now
                elif rc is None and j.killed_at is not None and now >= j.killed_at + 5:
                    os.killpg(j.proc.pid, signal.SIGKILL)
                if rc is not None:
                    running.remove(j)
                    j.log.close()
                    record(f"{j.name}\t{124 if j.killed_at is not None else rc}\t{round(now - j.t0)}")
                    print(f"[jobs] {j.name} ended (exit {rc}) after {now - j.t0:.0f} s", flush=True)
            if stop["why"] or deadline - now < min_start_s:
                for j in pending:
                    record(f"{j.name} not started: {stop['why'] or 'deadline'}")
                pending = []
            for j in list(pending):
                if len(running) >= max_parallel:
                    break
                beside = main[0] if j.name in first else main[1]
                fits = (memory_gib <= 0 or in_use() + j.gib + per_job_gib + beside <= memory_gib
                        or (not running and beside <= 0))
                if not fits:
                    continue
                j.log = (logs / f"{j.name}.log").open("w")
                j.t0 = time.time()
                pending.remove(j)
                try:
                    j.proc = subprocess.Popen(j.command, stdout=j.log, stderr=subprocess.STDOUT,
                                              start_new_session=True)
                except OSError as e:  # a command that cannot start is that job's failure, not the lane's
                    print(f"cannot start {j.command[:1]}: {e}", file=j.log, flush=True)
                    j.log.close()
                    record(f"{j.name}\t127\t0")
                    print(f"[jobs] {j.name} could not start: {e}", flush=True)
                    continue
                running.append(j)
                budget = f"{memory_gib:g}" if memory_gib > 0 else "unlimited"
                print(f"[jobs] {j.name} started ({j.gib:g} GiB; {in_use():g} of {budget} GiB reserved, "
                      f"main lane {beside:g}, {len(running)} running)", flush=True)
            if state is not None:
                write_atomic(state, f"{in_use():g}\t{main[0]:g} {main[1]:g}\t{','.join(j.name for j in running)}\t"
                                    f"{','.join(str(j.proc.pid) for j in running)}\n")
            if pending or running:
                time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", type=Path)
    p.add_argument("--deadline", type=float, required=True, help="seconds since the epoch")
    p.add_argument("--logs", type=Path, required=True)
    p.add_argument("--done", type=Path, required=True)
    p.add_argument("--max-parallel", type=int, default=2)
    p.add_argument("--memory-gib", type=float, default=0.0)
    p.add_argument("--per-job-gib", type=float, default=1.0)
    p.add_argument("--urgent", type=int, default=0, help="the first N jobs start beside what the main lane holds now")
    p.add_argument("--main-gib-file", type=Path, help="'NOW LATER': the GiB the main lane holds (read at every poll)")
    p.add_argument("--state", type=Path, help="written at every poll: reserved GiB, the main lane's figures, running jobs")
    a = p.parse_args(argv)
    if a.max_parallel < 1:
        raise SystemExit(f"--max-parallel must be at least 1, got {a.max_parallel}")
    run(read_jobs(a.jobs), a.deadline, a.logs, a.done, a.max_parallel, a.memory_gib, a.per_job_gib,
        main_gib_file=a.main_gib_file, state=a.state, urgent=a.urgent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
