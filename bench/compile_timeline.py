"""What a user waits for with ``--compile``: one real training launch, cold, then again warm.

    python bench/compile_timeline.py --arch fcos --size r50 --batch-size 2 --json fcos.json
    python bench/compile_timeline.py --arch ppyoloe --size s --batch-size 4 --ranks 2 --json s2.json

Each phase runs ``python -m fastdet.train ... --compile`` (``torchrun --nproc-per-node N``
with ``--ranks N``) on the family's recipe, its multi-scale sizes included, with the default
background warm-up, log interval 1, and no evaluation, and reads its log line by line:

- **cold** (an empty inductor cache, made here): the time to the first step (eager), each
  graph the workers compile and its seconds, the time until every graph of the running
  phase is compiled, each bucket's switch to its graph and what that step took, and the
  longest gap between two steps (``metrics.jsonl``'s ``max_step_gap_s``). The run is
  stopped (SIGTERM: the trainer saves ``latest.pth`` and exits 75) once every bucket runs
  compiled, or ``--after-all`` seconds after every graph is compiled (a bucket the random
  size schedule has not drawn again by then stays counted as not switched), or at
  ``--max-minutes``.
- **warm** (the same cache, a new output directory): the same launch again; the time to the
  first step, to the first compiled step, until every graph is loaded, and the cache hits
  and misses of each switch (a miss means the cache did not serve the relaunch).

The JSON holds both phases, the command lines and the environment, and is rewritten after
each phase. A SIGTERM to this script (bench/gpu_check.sh's part limit), whenever it comes,
stops the trainer with it (it runs in a session of its own, which the limit's kill does not
reach) and writes what was read, the phase marked ``cut``; a phase whose trainer had already
ended is written whole; no phase starts after it (``stopped_before`` names the next). The figures are wall-clock seconds of this machine: run nothing beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLAN = re.compile(r"compile: (\d+) graph\(s\) \((\d+) size bucket\(s\) x (\d+) loss variant\(s\)\) in (\d+) worker "
                  r"process\(es\) x (\d+) compile thread")
FIRST = re.compile(r"first step done ([\d.]+) s after start \((\w+)\)")
GRAPH = re.compile(r"compile: graph (\d+)/(\d+) \((.+?)\) compiled by worker \d+ in ([\d.]+) s \((.*)\)")
ALL = re.compile(r"compile: all (\d+) graph\(s\) compiled, ([\d.]+) s after training started")
SWITCH = re.compile(r"compile: bucket (\S+)(.*?) runs compiled from step (\d+) \(([\d.]+) s for that step: "
                    r"(\d+) graph\(s\), (.*)\)(; cache misses.*)?\s*$")
STEP = re.compile(r"epoch \d+  step (\d+)/")


class _Stopped(Exception):
    """This script was told to stop (SIGTERM: gpu_check.sh's part limit)."""


class _Run:
    """What the SIGTERM handler acts on, whenever the signal comes: the trainer running now
    (``proc``, set the moment it is started), whether the log is being read (the only place
    the handler raises, to leave a read that would wait for the next line), the signal's name
    once it came, and whether it stopped a live trainer (that phase is then ``cut``)."""

    proc: subprocess.Popen | None = None
    reading = False
    signal: str | None = None
    killed = False


def _on_sigterm(signum, frame):
    _Run.signal = signal.Signals(signum).name
    _kill_trainer()
    if _Run.reading:
        _Run.reading = False
        raise _Stopped(_Run.signal)


def _kill_trainer() -> None:
    """Stop the trainer now, with its session (torchrun's ranks, the compile workers): it runs
    in a session of its own, which this script's killer does not reach, and would otherwise
    train on, on the GPU of whatever runs next. Nothing once it has been waited for."""
    proc = _Run.proc
    if proc is not None and proc.returncode is None:
        _Run.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def at(point: str, proc: subprocess.Popen | None = None) -> None:
    """A no-op at the points between which a SIGTERM may fall ("started": the trainer
    ``proc`` just started; "ended": its log read to the end; "written": a phase written):
    tests replace it to send the signal there."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", required=True)
    p.add_argument("--size", required=True)
    p.add_argument("--batch-size", type=int, required=True, help="per rank")
    p.add_argument("--ranks", type=int, default=1, help="processes (torchrun --nproc-per-node) (default 1)")
    p.add_argument("--data", default=None, help="a COCO root (default: the demo set's, with the published recipe)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--phases", default="cold,warm", help="cold, warm or both (default cold,warm)")
    p.add_argument("--cache-dir", default=None,
                   help="the inductor cache (default: a new temporary directory); cold needs it absent or empty")
    p.add_argument("--after-all", type=float, default=300.0,
                   help="cold: seconds to go on after every graph is compiled, for the buckets to switch (300)")
    p.add_argument("--max-minutes", type=float, default=120.0, help="each phase stops by then (120)")
    p.add_argument("--max-steps", type=int, default=1_000_000,
                   help="the run's --max-steps: the plan holds the graphs of the phases up to it (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more trainer --set options")
    p.add_argument("--json", required=True, help="the figures go here")
    a = p.parse_args(argv)
    if a.ranks < 1 or a.batch_size < 1:
        p.error("--ranks and --batch-size must be at least 1")
    a.phases = [x for x in a.phases.split(",") if x]
    if not a.phases or set(a.phases) - {"cold", "warm"}:
        p.error(f"--phases takes cold and/or warm, got {','.join(a.phases)}")
    return a


def data_flags(a) -> list[str]:
    """The demo set as a COCO root: the family's published recipe (``--data demo`` would
    apply the demo preset, small sizes and few epochs)."""
    if a.data:
        return ["--data", a.data]
    from fastdet.config import DataConfig
    from fastdet.data.demo import demo_root

    return ["--data", str(demo_root(DataConfig().cache_dir))]


def command(a, cache: Path, out: Path) -> list[str]:
    launcher = [sys.executable, "-m", "fastdet.train"]
    if a.ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks),
                    "-m", "fastdet.train"]
    sets = ["compile.cache_dir=" + str(cache), "run.eval_interval=1000000", "run.tensorboard=false",
            "run.progress=false", *a.set]
    return [*launcher, "--arch", a.arch, "--size", a.size, "--batch-size", str(a.batch_size),
            "--device", a.device, *data_flags(a), "--compile", "--log-interval", "1",
            "--max-steps", str(a.max_steps), "--output-dir", str(out), *[x for s in sets for x in ("--set", s)]]


def run_phase(a, name: str, cache: Path, out: Path) -> dict:
    cmd = command(a, cache, out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    _Run.killed = False
    # A SIGTERM from here on only notes itself (and stops the trainer once there is one): it
    # raises nowhere but in the log's reading, so the trainer is known before it can come.
    proc = _Run.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
    if _Run.signal is not None:  # it came while the trainer was being started
        _kill_trainer()
    at("started", proc)
    row: dict = {"phase": name, "command": " ".join(cmd), "graphs_compiled": [], "switches": []}
    log_tail: list[str] = []
    state = {"all_at": None, "stop_sent": False}
    deadline = t0 + 60 * a.max_minutes

    def stop(why: str) -> None:
        if not state["stop_sent"]:
            state["stop_sent"] = True
            row["stopped_because"] = why
            os.kill(proc.pid, signal.SIGTERM)  # torchrun passes it on; the trainer saves and exits 75

    def watchdog() -> None:  # a step can take minutes: stop on time even between lines
        while proc.poll() is None:
            if time.perf_counter() > deadline:
                stop(f"--max-minutes {a.max_minutes}")
            if state["all_at"] is not None and time.perf_counter() - state["all_at"] > a.after_all:
                stop(f"--after-all {a.after_all} s after every graph was compiled")
            time.sleep(1.0)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        _Run.reading = True  # from here a SIGTERM raises _Stopped, caught below
        if _Run.signal is None:  # one that came before has stopped the trainer already
            read_log(proc, row, t0, log_tail, state, stop)
        _Run.reading = False
    except _Stopped:
        pass
    _Run.reading = False
    proc.wait()  # at once where the handler killed it
    at("ended", proc)
    if _Run.killed:
        row.update(status="cut", stopped_because=f"{_Run.signal} to bench/compile_timeline.py (its time limit)",
                   log_tail=log_tail[-40:])
    row.update(exit_code=proc.returncode, wall_s=round(time.perf_counter() - t0, 1))
    if proc.returncode not in (0, 75):
        row.setdefault("status", "failed")
        row.setdefault("log_tail", log_tail[-40:])
    metrics = out / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    if lines:
        worst = max(lines, key=lambda m: m["max_step_gap_s"])
        switched = {s["step"] for s in row["switches"]}
        eager = [m["max_step_gap_s"] for m in lines if m["step"] not in switched]
        row.update(steps=lines[-1]["step"], longest_step_gap_s=worst["max_step_gap_s"],
                   longest_step_gap_step=worst["step"],
                   longest_gap_without_a_switch_s=max(eager) if eager else None,
                   step_gaps_s=[m["max_step_gap_s"] for m in lines])
    row.setdefault("status", "ok")
    return row


def read_log(proc, row: dict, t0: float, log_tail: list[str], state: dict, stop) -> None:
    """Read the trainer's log to its end into ``row`` (``stop`` it once every bucket switched)."""
    for line in proc.stdout:
        now = time.perf_counter() - t0
        log_tail.append(line.rstrip())
        del log_tail[:-40]
        if m := PLAN.search(line):
            row.update(graphs=int(m.group(1)), size_buckets=int(m.group(2)), loss_variants=int(m.group(3)),
                       workers=int(m.group(4)), compile_threads=int(m.group(5)))
        elif m := FIRST.search(line):
            row.update(first_step_s=float(m.group(1)), first_step_kind=m.group(2), first_step_seen_s=round(now, 1))
        elif m := GRAPH.search(line):
            row["graphs_compiled"].append({"bucket": m.group(3), "seconds": float(m.group(4)), "cache": m.group(5),
                                           "seen_s": round(now, 1)})
        elif m := ALL.search(line):
            row.update(all_compiled_after_training_started_s=float(m.group(2)), all_compiled_seen_s=round(now, 1))
            state["all_at"] = time.perf_counter()
        elif m := SWITCH.search(line):
            row["switches"].append({"bucket": m.group(1) + m.group(2), "step": int(m.group(3)),
                                    "step_s": float(m.group(4)), "graphs": int(m.group(5)), "cache": m.group(6),
                                    "miss": bool(m.group(7)), "seen_s": round(now, 1)})
            if "first_compiled_step_seen_s" not in row:
                row["first_compiled_step_seen_s"] = round(now, 1)
            if row.get("graphs") and len({s["bucket"] for s in row["switches"]}) >= row["graphs"]:
                stop("every bucket runs compiled")
    proc.wait()


def commit() -> str | None:
    """This checkout's commit; where the tree is a copy without ``.git`` or git is not
    installed (a lent GPU machine), ``$FASTDET_GIT_COMMIT`` as the caller passed it."""
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        r = None
    return (r.stdout.strip() if r is not None and r.returncode == 0 else "") or os.environ.get("FASTDET_GIT_COMMIT")


def environment() -> dict:
    import torch

    return {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "commit": commit()}


def main(argv=None) -> int:
    a = parse_args(argv)
    # Before any trainer starts: a stop cuts the phase running, which is still written, and
    # starts no other, wherever it comes (_Run).
    _Run.proc, _Run.signal = None, None
    signal.signal(signal.SIGTERM, _on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="fastdet-timeline-"))
    cache = Path(a.cache_dir).expanduser() if a.cache_dir else root / "inductor"
    if "cold" in a.phases and cache.exists() and any(cache.iterdir()):
        print(f"compile_timeline: error: --cache-dir {cache} is not empty; the cold phase needs an empty cache",
              file=sys.stderr)
        return 2
    result = {"arch": a.arch, "size": a.size, "batch_per_rank": a.batch_size, "ranks": a.ranks,
              "cache_dir": str(cache), "env": environment(), "phases": {}}
    code = 0
    for name in a.phases:
        if _Run.signal is not None:  # told to stop between phases: none other starts
            result["stopped_before"] = {"phase": name, "because": f"{_Run.signal} to bench/compile_timeline.py "
                                                                    "(its time limit)"}
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
            print(f"{name}: not started: {result['stopped_before']['because']}", flush=True)
            code = 1
            break
        row = run_phase(a, name, cache, root / name)
        result["phases"][name] = row
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        at("written")
        brief = {k: row.get(k) for k in ("status", "graphs", "workers", "first_step_s", "first_step_kind",
                                          "first_compiled_step_seen_s", "all_compiled_seen_s", "steps",
                                          "longest_step_gap_s", "longest_step_gap_step",
                                          "longest_gap_without_a_switch_s", "stopped_because", "wall_s")}
        print(f"{name}: {json.dumps(brief)}", flush=True)
        if row["status"] != "ok":
            print("\n".join(row.get("log_tail", [])), file=sys.stderr)
            code = 1
        shutil.rmtree(root / name, ignore_errors=True)
    if not a.cache_dir:
        shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
