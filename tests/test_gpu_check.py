"""bench/gpu_check.sh: its plan fits the device tool's 540 s and holds every row of issue
42's one call; its rehearsal on the CPU runs the parts' own command lines at tiny sizes and
keeps the archive under its limit; on a machine like the bare GPU one, without pycocotools
the parts that need it are skipped with the reason (not failed), a part the budget no
longer fits is skipped and says so, and the record says which parts ran; under the device
tool (``$OUT`` set) everything is packed into ``$OUT`` (at most 8 files come back)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import run_jobs, throughput  # noqa: E402

SCRIPT = ROOT / "bench" / "gpu_check.sh"
BUDGET_S = 540  # the device tool's 10 minutes less a machine's start and the transfers
# Each family's published training shape, box padding and batch (issue 42).
PUBLISHED = {"step_ppyoloe": ("ppyoloe", "s", (640, 640), 100, 64),
             "step_yolox": ("yolox", "s", (640, 640), 120, 64),
             "step_ppyolo": ("ppyolo", "r50vd_dcn", (608, 608), 50, 64),
             "step_fcos": ("fcos", "r50", (800, 1344), 100, 16),
             "step_b128": ("ppyoloe", "s", (640, 640), 100, 128)}


def plan(**env):
    r = subprocess.run(["bash", str(SCRIPT), "--plan"], env={**os.environ, "PYTHON": sys.executable, **env},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def bench_args(command: str):
    """The throughput.py flags of a planned command, parsed as that script parses them."""
    argv = command.split()[1:]
    argv[argv.index("--device") + 1] = "cpu"  # parse here without a GPU; nothing else changes
    return throughput.parse_args(argv)


def test_the_plan_fits_the_budget_and_compiles_beside_the_main_lane():
    p = plan()
    parts = {r["part"]: r for r in p["parts"]}
    main = [r for r in p["parts"] if r["lane"] == "main"]
    assert p["budget_s"] == BUDGET_S
    assert sum(r["limit_s"] for r in main) <= BUDGET_S, [(r["part"], r["limit_s"]) for r in main]
    assert [r["part"] for r in p["parts"] if r["lane"] == "side"] == ["precompile"]
    # precompile starts after build and is cut at its limit before join_precompile's ends.
    names = [r["part"] for r in p["parts"]]
    window = names[names.index("precompile") + 1: names.index("join_precompile") + 1]
    assert parts["precompile"]["limit_s"] <= sum(parts[n]["limit_s"] for n in window)
    assert names.index("build") < names.index("precompile") < names.index("tests_kernels")
    # The parts that load graphs, in priority order after the tests: the four families'
    # steps (issue 42's headline) first, batch 128 last; then the lane is stopped, and
    # cold_compile, which needs the cores, takes what is left.
    late = names[names.index("waits") + 1: names.index("join_precompile")]
    assert set(late[:4]) == set(PUBLISHED) - {"step_b128"} and late[-1] == "step_b128"
    assert set(late) == {*PUBLISHED, "profile", "train"}
    assert names.index("tests_capture") < names.index("waits")
    assert names[-2:] == ["join_precompile", "cold_compile"]  # it takes what is left
    for r in p["parts"]:
        assert r["limit_s"] > 0 and r["returns"] and r["gpu_estimate"], r


def test_the_plan_holds_every_family_and_row_at_its_published_shape():
    p = plan()
    parts = {r["part"]: r for r in p["parts"]}
    for name, (arch, size, hw, boxes, batch) in PUBLISHED.items():
        a = bench_args(parts[name]["command"])
        assert (a.arch, a.size, a.img_size, a.max_boxes, a.batch_size) == (arch, size, hw, boxes, batch), name
        assert "step_compile_graphs" in a.modes, name
    pp = bench_args(parts["step_ppyoloe"]["command"])
    assert set(pp.modes) == {"step_eager_fp32", "step_eager_amp", "step_eager_amp_nhwc", "step_compile",
                             "step_compile_graphs"}
    prof = parts["profile"]["command"].split()
    assert prof[prof.index("--variants") + 1].split(",") == ["compile_graphs", "eager_amp"]
    assert "--img-size" not in prof and "--max-boxes" not in prof  # step_ppyoloe's graph, from the cache
    assert set(p["train"]) == {"ppyoloe", "yolox", "ppyolo", "fcos"}
    for fam, flags in p["train"].items():
        f = flags.split()
        assert {"--compile", "--cuda-graphs"} <= set(f) and "compile.warmup=blocking" in f, fam
        assert f[f.index("--arch") + 1] == fam




def test_missing_pycocotools_and_spent_budget_are_recorded_skips(tmp_path):
    blocker = tmp_path / "block"
    (blocker / "pycocotools").mkdir(parents=True)
    (blocker / "pycocotools" / "__init__.py").write_text("raise ImportError('pycocotools is blocked in this test')\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_BUDGET_S": "1",
           "GPU_CHECK_PARTS": "build,train", "OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp_path)}
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu_check.tgz", "summary.txt"]
    record = json.loads((out / "gpu-check.json").read_text())
    parts = {p["part"]: p for p in record["parts"]}
    assert set(parts) == {"build", "train"} and record["not_reached"] == []
    assert not any(p["ran"] for p in parts.values())
    assert "budget" in parts["build"]["why"]
    # The import's own error, not only "missing": a carried wheel may lack a dependency.
    why = "pycocotools is not importable (ImportError: pycocotools is blocked in this test)"
    assert parts["train"]["status"] == "skipped" and why in parts["train"]["why"]
    assert "pycocotools: NOT importable here (ImportError: pycocotools is blocked in this test)" in (
        out / "summary.txt").read_text()
    with tarfile.open(out / "gpu_check.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("_gpu-check.json") for n in names) and any(n.endswith("summary.txt") for n in names)


def test_results_name_the_commit_on_a_host_without_git(tmp_path, monkeypatch):
    """The GPU host gets a copy of the tree without .git, and its image may have no git at
    all: every result records $FASTDET_GIT_COMMIT (bench/README.md's calls pass it), and the
    cold_compile part's timeline does not stop on the missing program before its trainer
    starts (it raised FileNotFoundError)."""
    from bench import common

    sys.path.insert(0, str(ROOT / "bench"))
    import compile_timeline

    monkeypatch.setenv("PATH", str(tmp_path))  # no git there
    monkeypatch.setenv("FASTDET_GIT_COMMIT", "0123abc")
    assert compile_timeline.environment()["commit"] == "0123abc"
    assert common._git() == {"commit": "0123abc", "dirty": None}


def test_the_cold_compile_timeline_cut_at_its_limit_stops_its_trainer_and_writes_what_it_read(tmp_path):
    """gpu_check.sh's cold_compile part ends with `timeout`'s SIGTERM to the timeline if its own
    stop comes late; the trainer it launched runs in a session of its own, which that signal
    does not reach. The timeline must stop it (else it trains on, with its compile workers,
    on the GPU of the calls after this one) and write the phase as far as it read it (before,
    it died with nothing written). The trainer here is a stand-in that logs its plan and waits."""
    import signal
    import time

    pid_file = tmp_path / "trainer.pid"
    trainer = ("import os, time; open({pid!r}, 'w').write(str(os.getpid())); "
               "print('12:00:00 compile: 3 graph(s) (3 size bucket(s) x 1 loss variant(s)) in 2 worker "
               "process(es) x 8 compile thread(s)', flush=True); time.sleep(600)").format(pid=str(pid_file))
    driver = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import compile_timeline as ct\n"
              f"ct.command = lambda a, cache, out: [sys.executable, '-c', {trainer!r}]\n"
              "sys.exit(ct.main(sys.argv[1:]))")
    out = tmp_path / "cold.json"
    proc = subprocess.Popen([sys.executable, "-c", driver, "--arch", "ppyoloe", "--size", "s", "--batch-size", "2",
                             "--phases", "cold", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trainer_pid = None
    try:
        deadline = time.time() + 120
        while not (pid_file.is_file() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        trainer_pid = int(pid_file.read_text())
        time.sleep(1.0)  # the plan line read
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
        with pytest.raises(ProcessLookupError):
            os.kill(trainer_pid, 0)
        trainer_pid = None
    finally:
        if trainer_pid is not None:
            os.kill(trainer_pid, signal.SIGKILL)
        proc.kill()
    cold = json.loads(out.read_text())["phases"]["cold"]
    assert proc.returncode == 1 and cold["status"] == "cut" and "SIGTERM" in cold["stopped_because"], log
    assert cold["graphs"] == 3 and cold["workers"] == 2


@pytest.mark.parametrize("point", ["started", "ended", "written"])
def test_a_sigterm_outside_the_log_s_reading_stops_the_timeline_cleanly(tmp_path, point):
    """The cold_compile part's SIGTERM may come at any point of the timeline's life, not only
    while it reads the trainer's log: right after it started the trainer ("started"), once
    the trainer ended ("ended"), or between two phases ("written"). Such a signal gave a
    traceback, the phase was not written, and right after the start the trainer ran on (in a
    session of its own, beyond the limit's kill). Now the trainer is stopped at once, the
    phase is written (cut if its trainer was running, whole if it had ended), and no further
    phase starts. The stand-in trainer logs its plan, then waits or ends; the timeline's own
    hook (``at``) sends the signal at the point, so nothing here waits on a clock."""
    pid_file = tmp_path / "trainer.pid"
    trainer = ("import time; print('12:00:00 compile: 3 graph(s) (3 size bucket(s) x 1 loss variant(s)) in 2 "
               f"worker process(es) x 8 compile thread(s)', flush=True); time.sleep({600 if point == 'started' else 0})")
    driver = (f"import os, signal, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import compile_timeline as ct\n"
              f"ct.command = lambda a, cache, out: [sys.executable, '-c', {trainer!r}]\n"
              "def at(point, proc=None):\n"
              f"    if proc is not None and not os.path.exists({str(pid_file)!r}):\n"
              f"        open({str(pid_file)!r}, 'w').write(str(proc.pid))\n"
              f"    if point == {point!r}:\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "ct.at = at\n"
              "sys.exit(ct.main(sys.argv[1:]))")
    out = tmp_path / "timeline.json"
    r = subprocess.run([sys.executable, "-c", driver, "--arch", "ppyoloe", "--size", "s", "--batch-size", "2",
                        "--phases", "cold,warm", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    trainer_pid = int(pid_file.read_text())
    try:
        assert _process_gone(trainer_pid), "the trainer runs on"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer_pid, signal.SIGKILL)
    log = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in log, log
    result = json.loads(out.read_text())
    assert list(result["phases"]) == ["cold"], log
    cold = result["phases"]["cold"]
    if point == "started":
        assert cold["status"] == "cut" and "SIGTERM" in cold["stopped_because"], cold
    else:
        assert cold["status"] == "ok" and cold["exit_code"] == 0 and cold["graphs"] == 3, cold
    assert result["stopped_before"]["phase"] == "warm" and "SIGTERM" in result["stopped_before"]["because"]


def rehearse(tmp_path, **env):
    """bench/gpu_check.sh --rehearse under a stand-in of the device tool ($OUT set)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "TMPDIR": str(tmp_path),
           "FASTDET_OPS_BACKEND": "torch", **env}
    r = subprocess.run(["bash", str(SCRIPT), "--rehearse"], env=env, capture_output=True, text=True, timeout=9000)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads((out / "gpu-check.json").read_text())
    with tarfile.open(out / "gpu_check.tgz") as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        names = list(members)
        files = {n: tar.extractfile(m).read() for n, m in members.items() if n.endswith(".json") and m.isfile()}
    return out, record, names, files


def test_rehearsal_of_precompile_then_the_timed_part_it_serves(tmp_path):
    """The CPU rehearsal of the chain precompile -> join -> timed part (PP-YOLOE-s's batch-128
    part, tiny): the precompile job is the timed part's own command with --precompile and
    compiles its step; the captured step itself skips on the CPU, saying so. The archive
    holds both JSON files and the record, no checkpoint, and stays under its limit."""
    out, record, names, files = rehearse(tmp_path, GPU_CHECK_PARTS="env,build,precompile,join_precompile,step_b128")
    parts = {p["part"]: p for p in record["parts"]}
    # In the order they ended: the side lane's precompile is recorded when joined.
    assert [p["part"] for p in record["parts"]] == ["env", "build", "step_b128", "precompile", "join_precompile"]
    assert all(p["status"] == "ok" for p in parts.values()), parts
    assert record["mode"] == "rehearse" and record["not_reached"] == []
    assert 0 < record["archive"]["bytes"] <= 8 * 2**20 and (out / "gpu_check.tgz").stat().st_size <= 8 * 2**20
    assert not any(n.endswith(".pth") for n in names)
    pre = json.loads(files["precompile/step_b128.json"])
    (job,) = pre["results"]
    assert pre["kind"] == "precompile" and job["status"] == "ok" and job["sizes"] == [[64, 64]]
    timed = json.loads(next(v for k, v in files.items() if k.endswith("_throughput-b128.json")))
    (row,) = timed["results"]
    assert row["mode"] == "step_compile_graphs" and row["status"] == "skipped" and "CUDA" in row["reason"]
    assert (timed["config"]["arch"], timed["config"]["batch_size"], timed["config"]["hw"]) == ("ppyoloe", 4, [64, 64])
    assert timed["config"]["backend_flags"]["set_for"] == "cpu"


def test_a_trainer_starts_once_precompile_has_compiled_its_graphs(tmp_path):
    """The train part runs beside the precompile lane: a trainer started before its family's
    precompile job ended would compile its graphs itself, cold (~90 s a graph on the GPU host,
    more than the part's 80 s, four of them taking the lane's cores). Each trainer starts when
    its job has ended, and not at all when the job failed. fastdet.compile and fastdet.train
    are stand-ins here (a job's seconds, then a time stamp); the rest is the script's own."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/bash
if [[ "$1 $2" == "-m fastdet.compile" || "$1 $2" == "-m fastdet.train" ]]; then
    what=$2 fam= out=
    while (( $# )); do case $1 in --arch) fam=$2; shift ;; --output-dir) out=$2; shift ;; esac; shift; done
    if [[ $what == fastdet.compile ]]; then
        case $fam in ppyoloe) sleep 2 ;; yolox) sleep 1; exit 1 ;; *) sleep 3 ;; esac
        date +%s.%N > {tmp_path}/compiled_$fam
    else
        mkdir -p "$out" && date +%s.%N > {tmp_path}/trained_$fam
    fi
    exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    out, record, names, files = rehearse(tmp_path, PYTHON=str(stub), GPU_CHECK_PARTS="precompile,train,join_precompile",
                                         GPU_CHECK_TRAIN_WAITS="1")  # the GPU's default
    with tarfile.open(out / "gpu_check.tgz") as tar:
        log = tar.extractfile("./train.log").read().decode()
    for fam in ("ppyoloe", "ppyolo", "fcos"):
        compiled, trained = (float((tmp_path / f"{what}_{fam}").read_text()) for what in ("compiled", "trained"))
        assert trained >= compiled, (fam, log)
    assert not (tmp_path / "trained_yolox").exists(), log
    assert "yolox:s: not started: precompile's job for it ended with exit 1" in log
    parts = {p["part"]: p for p in record["parts"]}
    assert parts["train"]["status"] == "failed" and parts["precompile"]["status"] == "failed"


def _process_gone(pid: int) -> bool:
    """No such process, or a zombie (its parent, init here, has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(") ", 1)[1].split()[0] == "Z"


def test_a_lane_that_dies_is_seen_at_once_and_its_jobs_count_as_failed(tmp_path):
    """Precompile's lane (bench/run_jobs.py) killed while it runs YOLOX's step graph and
    PP-YOLOE's trainer job, before it wrote their ends (or started the other trainers' jobs):
    the main lane waited for those jobs until the budget was spent and said precompile was
    "still compiling". It now sees the lane gone at once: the jobs it never ended count as
    failed, so YOLOX's step part is skipped and the train part runs at once without the
    trainers, each saying the lane is gone; the jobs the lane left running are stopped (they
    would hold GPU memory no one counts); the precompile row says so with the lane's exit.
    bench/throughput.py, fastdet.compile and fastdet.train are stand-ins here."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/bash
if [[ "$1" == bench/throughput.py ]]; then
    arch= pre=0 json=
    while (( $# )); do case $1 in --arch) arch=$2; shift ;; --json) json=$2; shift ;;
        --precompile) pre=1 ;; esac; shift; done
    (( pre )) || {{ touch {tmp_path}/timed_$arch; exit 0; }}
    [[ $arch == yolox ]] || exit 0
    # Once the lane runs PP-YOLOE's trainer job beside this one, this job kills the lane, its parent.
    for i in $(seq 1200); do grep -q train_ppyoloe "$(dirname "$json")/state" 2>/dev/null && break; sleep 0.1; done
    echo $$ > {tmp_path}/left_yolox
    kill -KILL $PPID
    sleep 300
    exit 0
fi
if [[ "$1 $2" == "-m fastdet.compile" || "$1 $2" == "-m fastdet.train" ]]; then
    what=$2 fam=
    while (( $# )); do case $1 in --arch) fam=$2; shift ;; esac; shift; done
    [[ $what == fastdet.train ]] && {{ touch {tmp_path}/trained_$fam; exit 0; }}
    echo $$ > {tmp_path}/left_train_$fam
    sleep 300
    exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    try:
        out, record, names, files = rehearse(
            tmp_path, PYTHON=str(stub), GPU_CHECK_PARTS="precompile,step_ppyoloe,step_yolox,train,join_precompile",
            GPU_CHECK_TRAIN_WAITS="1", GPU_CHECK_LIMIT_SCALE="1", GPU_CHECK_BUDGET_S="200")
        left = {job: int((tmp_path / f"left_{job}").read_text()) for job in ("yolox", "train_ppyoloe")}
        stopped = {job: _process_gone(pid) for job, pid in left.items()}
    finally:
        for f in tmp_path.glob("left_*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(f.read_text()), signal.SIGKILL)
    parts = {p["part"]: p for p in record["parts"]}
    assert parts["step_ppyoloe"]["status"] == "ok" and (tmp_path / "timed_ppyoloe").exists()
    assert parts["step_yolox"]["status"] == "skipped" and not (tmp_path / "timed_yolox").exists()
    assert "step_yolox (never ended: precompile's lane is gone" in parts["step_yolox"]["why"]
    with tarfile.open(out / "gpu_check.tgz") as tar:
        log = tar.extractfile("./train.log").read().decode()
    assert parts["train"]["status"] == "failed" and not list(tmp_path.glob("trained_*")), log
    for fam in ("ppyoloe:s", "yolox:s", "ppyolo:r50vd_dcn", "fcos:r50"):
        assert f"{fam}: not started: precompile's job for it never ended (its lane is gone)" in log, log
    gone = "precompile's lane (bench/run_jobs.py, pid "
    assert log.count(gone) == 1 and "still compiling" not in log, log
    assert parts["precompile"]["status"] == "failed" and gone in parts["precompile"]["why"]
    assert "(bench/run_jobs.py exit 137)" in parts["precompile"]["why"]
    assert "train_ppyoloe" in parts["precompile"]["why"] and "were stopped" in parts["precompile"]["why"]
    summary = (out / "summary.txt").read_text()
    assert summary.count(f"precompile: {gone}") == 1 and "still compiling" not in summary, summary
    assert all(stopped.values()), stopped  # the jobs the lane left running


def test_the_steps_run_as_their_graphs_come_and_a_failed_graph_costs_only_its_row(tmp_path):
    """The families' step graphs are precompile's first jobs, at a higher CPU priority than
    batch 128's; each timed part starts once its graph's job has ended, in the order they end
    (PP-YOLO's graph here before YOLOX's: the plan lists YOLOX first), not after the whole lane.
    A failed job costs only its own row: FCOS's part is skipped, saying why, and PP-YOLOE's
    keeps its eager rows. bench/throughput.py is a stand-in here (a job's seconds and exit,
    then time stamps); the rest is the script's own."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/bash
if [[ "$1" == bench/throughput.py ]]; then
    arch= batch= modes= pre=0
    while (( $# )); do case $1 in --arch) arch=$2; shift ;; --batch-size) batch=$2; shift ;;
        --modes) modes=$2; shift ;; --precompile) pre=1 ;; esac; shift; done
    if (( pre )); then
        echo "$(date +%s.%N) $(nice)" > {tmp_path}/started_${{arch}}_$batch
        case $arch-$batch in ppyoloe-2) sleep 0.5; exit 1 ;; fcos-*) sleep 1; exit 1 ;;
            ppyolo-*) sleep 2 ;; yolox-*) sleep 5 ;; *) sleep 1 ;; esac
        date +%s.%N > {tmp_path}/compiled_${{arch}}_$batch
    else
        echo "$(date +%s.%N) $modes" > {tmp_path}/timed_${{arch}}_$batch
    fi
    exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    out, record, names, files = rehearse(
        tmp_path, PYTHON=str(stub),
        GPU_CHECK_PARTS="precompile,step_ppyoloe,step_yolox,step_ppyolo,step_fcos,step_b128,join_precompile")
    read = lambda what, arch, b=2: (tmp_path / f"{what}_{arch}_{b}").read_text().split()
    jobs = (tmp_path / "fastdet-gpu-check").glob("*/precompile/jobs.tsv")
    assert [line.split("\t")[0] for line in next(jobs).read_text().splitlines()] == [
        "step_ppyoloe", "step_yolox", "step_ppyolo", "step_fcos", "step_b128"]
    # nice: 5 for the families' step graphs, 19 for batch 128's (from this test's own level)
    assert int(read("started", "ppyoloe", 4)[1]) - int(read("started", "ppyolo")[1]) == 14
    timed = {a: float(read("timed", a)[0]) for a in ("ppyoloe", "ppyolo", "yolox")}
    assert timed["ppyoloe"] < timed["ppyolo"] < timed["yolox"], timed
    for arch in ("ppyolo", "yolox"):
        assert timed[arch] >= float(read("compiled", arch)[0]), arch
    assert float(read("timed", "ppyoloe", 4)[0]) >= float(read("compiled", "ppyoloe", 4)[0])
    assert read("timed", "ppyoloe")[1] == "step_eager_fp32,step_eager_amp,step_eager_amp_nhwc"
    assert not (tmp_path / "timed_fcos_2").exists()
    parts = {p["part"]: p for p in record["parts"]}
    assert parts["step_fcos"]["status"] == "skipped"
    assert "precompile's job step_fcos (exit 1) failed" in parts["step_fcos"]["why"]
    assert parts["step_ppyoloe"]["status"] == "ok" and "only the eager rows run" in parts["step_ppyoloe"]["why"]
    assert all(parts[p]["status"] == "ok" for p in ("step_yolox", "step_ppyolo", "step_b128"))
    # Each part names the lane's jobs that ran beside it: PP-YOLO's ran while YOLOX compiled.
    assert "step_yolox" in parts["step_ppyolo"]["beside"]


@pytest.mark.parametrize("budget_s, b128_first", [(540, True), (150, False)])
def test_a_part_of_lower_priority_runs_ahead_only_with_time_to_spare(tmp_path, budget_s, b128_first):
    """Batch 128's graph (the least needed row) is compiled before PP-YOLOE's here: with the
    budget to spare its part runs while PP-YOLOE's graph compiles; when the budget would then
    no longer hold PP-YOLOE's part, join_precompile's and cold_compile's limits (rehearsal
    limits x10: 750 + 50 + 460 s beside batch 128's 250 of 1500 s), it waits for PP-YOLOE's."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/bash
case $1 in
bench/throughput.py)
    batch= pre=0
    while (( $# )); do case $1 in --batch-size) batch=$2; shift ;; --precompile) pre=1 ;; esac; shift; done
    if (( pre )); then (( batch == 2 )) && sleep 4; exit 0; fi
    date +%s.%N > {tmp_path}/timed_$batch; exit 0 ;;
bench/compile_timeline.py) exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    out, record, names, files = rehearse(tmp_path, PYTHON=str(stub), GPU_CHECK_BUDGET_S=str(budget_s),
                                         GPU_CHECK_PARTS="precompile,step_ppyoloe,step_b128,join_precompile,cold_compile")
    b64, b128 = (float((tmp_path / f"timed_{b}").read_text()) for b in (2, 4))
    assert (b128 < b64) == b128_first
    parts = {p["part"]: p for p in record["parts"]}
    assert all(parts[p]["status"] == "ok" for p in ("step_ppyoloe", "step_b128", "cold_compile")), parts


def test_a_timed_part_starts_once_its_gpu_memory_is_free_beside_precompile(tmp_path):
    """50 GiB to share (GPU_CHECK_MEMORY_GIB). PP-YOLOE's and PP-YOLO's step graphs (12 + 1
    and 28 + 1 GiB) start at once beside a main lane that holds nothing yet; PP-YOLOE's timed
    part (28) then waits for PP-YOLO's job to end, though its own graph is ready, and no job
    starts into the room it waits for. Batch 128's job (23 + 1), of lower priority, starts only
    when the main lane's pending parts leave it room: after PP-YOLO's part (29) has run. The
    record says the main lane waited."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/bash
if [[ "$1" == bench/throughput.py ]]; then
    arch= batch= pre=0
    while (( $# )); do case $1 in --arch) arch=$2; shift ;; --batch-size) batch=$2; shift ;;
        --precompile) pre=1 ;; esac; shift; done
    if (( pre )); then
        date +%s.%N > {tmp_path}/started_$arch$batch
        [[ $arch == ppyolo ]] && sleep 3 || sleep 1
        date +%s.%N > {tmp_path}/compiled_$arch$batch
    else
        date +%s.%N > {tmp_path}/timed_$arch$batch
    fi
    exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    out, record, names, files = rehearse(
        tmp_path, PYTHON=str(stub), GPU_CHECK_MEMORY_GIB="50",
        GPU_CHECK_PARTS="precompile,waits,step_ppyoloe,step_ppyolo,step_b128,join_precompile")
    t = {f"{what}_{job}": float((tmp_path / f"{what}_{job}").read_text())
         for what in ("started", "compiled", "timed") for job in ("ppyoloe2", "ppyolo2", "ppyoloe4")}
    assert t["started_ppyolo2"] < t["compiled_ppyoloe2"], t
    assert t["timed_ppyoloe2"] >= t["compiled_ppyolo2"], t
    assert t["started_ppyoloe4"] >= t["timed_ppyolo2"], t
    parts = {p["part"]: p for p in record["parts"]}
    assert parts["waits"]["seconds"] >= 1 and "step_ppyoloe" in parts["waits"]["why"], parts["waits"]
    assert all(parts[p]["status"] == "ok" for p in ("step_ppyoloe", "step_ppyolo", "step_b128")), parts


def test_precompile_jobs_of_lower_priority_keep_the_room_the_main_lane_will_need(tmp_path, capsys):
    """bench/run_jobs.py beside a main lane that holds 2 GiB now and will need 6 later, in 10 GiB:
    the urgent job (4) starts within what it holds now; the later ones (3 each) wait until the
    main lane says it needs nothing more, then start together. The state file says what is
    reserved, which of the main lane's figures it acted on, and the running jobs' process ids."""
    import threading
    import time

    main = tmp_path / "main_gib"
    main.write_text("2 6\n")
    state = tmp_path / "state"
    jobs = [_sleep_job("urgent", 4, 1.5), _sleep_job("later1", 3, 0.2), _sleep_job("later2", 3, 0.2)]
    seen = []

    def main_lane():
        deadline = time.time() + 30
        while time.time() < deadline and not (state.is_file() and "urgent" in state.read_text()):
            time.sleep(0.05)
        time.sleep(0.5)
        seen.append(state.read_text())
        main.write_text("0 0\n")

    t = threading.Thread(target=main_lane)
    t.start()
    run_jobs.run(jobs, time.time() + 60, tmp_path / "logs", tmp_path / "done.tsv", max_parallel=4, memory_gib=10,
                 per_job_gib=0, poll_s=0.05, main_gib_file=main, state=state, urgent=1)
    t.join()
    events = [" ".join(line.split()[1:3]) for line in capsys.readouterr().out.splitlines()]
    assert events[0] == "urgent started" and events.index("later1 started") < events.index("urgent ended"), events
    assert seen == [f"4\t2 6\turgent\t{jobs[0].proc.pid}\n"]  # 4 + 3 + 6 > 10: the later jobs waited
    assert state.read_text() == "0\t0 0\t\t\n"


def test_precompile_stops_its_jobs_on_sigterm(tmp_path):
    """join_precompile stops the lane (cold_compile needs the cores): SIGTERM to
    bench/run_jobs.py cuts its running jobs (exit 124) and starts no other."""
    import signal
    import time

    jobfile = tmp_path / "jobs.tsv"
    jobfile.write_text(f"slow\t1\t{sys.executable} -c 'import time; time.sleep(60)'\n"
                       f"next\t1\t{sys.executable} -c 'pass'\n")
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "run_jobs.py"), str(jobfile),
                             "--deadline", str(time.time() + 120), "--logs", str(tmp_path / "logs"),
                             "--done", str(tmp_path / "done.tsv"), "--max-parallel", "1", "--state", str(state)])
    deadline = time.time() + 30
    while time.time() < deadline and not (state.is_file() and "slow" in state.read_text()):
        time.sleep(0.05)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0 and time.time() - t0 < 10
    lines = (tmp_path / "done.tsv").read_text().splitlines()
    assert [line.split("\t")[:2] for line in lines if line.startswith("slow")] == [["slow", "124"]]
    assert "next not started: stopped" in lines


@pytest.mark.slow
def test_rehearsal_runs_every_part_and_keeps_the_archive_under_its_limit(tmp_path):
    """Every part of the plan, on the CPU at tiny sizes, limits x30 (on this shared 2-core
    CPU four trainers' warm-ups took over 800 s), with an archive limit of 1 MiB: every part
    ends ok, each family's trainer run keeps its log and metrics but no checkpoint; what
    packing cut or left out to fit is named in the record."""
    out, record, names, files = rehearse(tmp_path, GPU_CHECK_ARCHIVE_MB="1", GPU_CHECK_LIMIT_SCALE="30")
    p = plan()
    parts = {r["part"]: r for r in record["parts"]}
    # In the order they ended: the side lane's precompile is recorded when joined.
    assert len(record["parts"]) == len(parts) and record["not_reached"] == []
    assert sorted(parts) == sorted(r["part"] for r in p["parts"])
    assert all(r["status"] == "ok" for r in parts.values()), {k: (r["status"], r["why"]) for k, r in parts.items()}
    assert (out / "gpu_check.tgz").stat().st_size <= 2**20 and record["archive"]["limit_mib"] == 1
    assert not {n.removeprefix("./") for n in names} & set(record["archive"]["dropped"])
    assert not any(n.endswith(".pth") for n in names)
    for fam in ("ppyoloe", "yolox", "ppyolo", "fcos"):
        assert f"train/{fam}/metrics.jsonl" in names and f"train_{fam}.log" in names, fam
    for what in ("ppyoloe", "yolox", "ppyolo", "fcos", "b128"):
        assert any(k.endswith(f"_throughput-{what}.json") for k in files), what
    assert "profile/profile.json" in files and any(k.endswith("compile-timeline-cold.json") for k in files)


def test_the_dali_call_plan_fits_and_holds_every_family_end_to_end():
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check_dali.sh"), "--plan"],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    parts = {x["part"]: x for x in p["parts"]}
    assert sum(x["limit_s"] for x in p["parts"] if x["lane"] == "main") <= BUDGET_S
    names = [x["part"] for x in p["parts"]]
    window = names[names.index("precompile") + 1: names.index("join_precompile") + 1]
    assert parts["precompile"]["limit_s"] <= sum(parts[n]["limit_s"] for n in window)
    assert parts["dali_check"]["command"].split()[1:3] == ["--device", "cuda"]
    assert "--workers 16" in parts["dali_check"]["command"]
    for name, (arch, size, hw, boxes, batch) in PUBLISHED.items():
        if name == "step_b128":
            continue
        a = bench_args(parts["e2e_" + name.removeprefix("step_")]["command"])
        assert (a.arch, a.size, a.img_size, a.max_boxes, a.batch_size) == (arch, size, hw, boxes, batch), name
        assert a.modes == ["data_torch", "data_dali", "e2e_torch", "e2e_dali"] and a.workers == 16, name


def test_the_dali_call_without_its_check_script_skips_it_and_says_why(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "TMPDIR": str(tmp_path),
           "GPU_CHECK_PARTS": "dali_check", "GPU_CHECK_DALI_CHECK": str(tmp_path / "absent.py")}
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check_dali.sh"), "--rehearse"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads((out / "gpu-check-dali.json").read_text())
    (part,) = record["parts"]
    assert part["part"] == "dali_check" and part["status"] == "skipped" and "not in this tree" in part["why"]
    assert (out / "gpu_check_dali.tgz").is_file()


def test_dali_travels_in_pieces_that_join_back_to_the_same_wheels(tmp_path):
    """bench/dali_carry.sh: pieces under the size asked for, one staged per call with the
    checksums, and the host's join (sha256 -c, cat | tar x) gives back every wheel."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = {"a-1.0-cp312-cp312-manylinux_2_28_x86_64.whl": os.urandom(2 * 2**20),
               "b-2.0-py3-none-any.whl": os.urandom(700 * 2**10)}
    for name, data in payload.items():
        (wheels / name).write_bytes(data)
    parts, whl = tmp_path / "parts", tmp_path / "whl"
    env = {**os.environ, "DALI_CARRY_PIECE_MB": "1", "DALI_CARRY_PARTS": str(parts), "DALI_CARRY_WHL": str(whl)}
    script = str(ROOT / "bench" / "dali_carry.sh")
    r = subprocess.run(["bash", script, "pack", str(wheels)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    pieces = sorted(parts.glob("dali.tar.part-*"))
    assert len(pieces) == 3 and all(p.stat().st_size <= 2**20 for p in pieces)
    assert "call 2: mkdir -p /tmp/dali && cp" in r.stdout and "bash bench/gpu_check_dali.sh" in r.stdout.splitlines()[-4]
    # The host's copy has no .git: the last call names this checkout's commit for the results.
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert f"FASTDET_GIT_COMMIT={commit.strip()} bash" in r.stdout.splitlines()[-4]
    r = subprocess.run(["bash", script, "stage", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (whl / "dali").iterdir()) == ["SHA256SUMS", "dali.tar.part-01"]
    host = tmp_path / "host"
    host.mkdir()
    for p in [*pieces, parts / "SHA256SUMS"]:
        (host / p.name).write_bytes(p.read_bytes())
    r = subprocess.run(["bash", "-c", "sha256sum -c SHA256SUMS && mkdir wheels && cat dali.tar.part-* | tar xf - -C wheels"],
                       cwd=host, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert {n: (host / "wheels" / n).read_bytes() for n in payload} == payload


def test_a_carry_call_fits_the_device_tools_64_mib():
    """Each DALI call sends the working tree, pycocotools' wheel and one piece: at most 64 MiB
    (the device tool's limit). A large file committed to the tree would make every call fail."""
    import re

    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"not a git checkout ({r.stderr.decode().strip()[:200]}): the tree that travels is unknown")
    tree = sum((ROOT / f).stat().st_size for f in r.stdout.decode().split("\0") if f and (ROOT / f).is_file())
    piece_mb = int(re.search(r"PIECE_MB=\$\{DALI_CARRY_PIECE_MB:-(\d+)\}",
                             (ROOT / "bench" / "dali_carry.sh").read_text()).group(1))
    pycocotools_wheel = 2**19  # 402 kB for 2.0.11, cp312
    assert tree + piece_mb * 2**20 + pycocotools_wheel <= 64 * 2**20, f"tree {tree / 2**20:.1f} MiB"


def pack_with_record(work: Path, out: Path) -> tuple[Path, dict]:
    """bench/gpu_check_lib.sh's ``record`` (which packs) on the folder ``work``, with a 1 MiB
    limit, into ``out``: the archive (checked to fit) and the record. One minute at most: a
    packing loop that does not end fails the test."""
    (work / ".parts.tsv").write_text("")
    script = f"""
        SELF={ROOT / "bench" / "gpu_check.sh"} KIND=gpu-check MODE=run SCALE=1 BUDGET=540 START=$(date +%s)
        OUT_DIR={work} STATUS={work / ".parts.tsv"} PACK_TO={out} ARCHIVE_MB=1 PARTS=env PY={sys.executable} STEM=x
        source {ROOT / "bench" / "gpu_check_lib.sh"}
        record
    """
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    archive = out / "gpu_check.tgz"
    assert archive.stat().st_size <= 2**20
    return archive, json.loads((out / "gpu-check.json").read_text())


def test_packing_cuts_the_largest_trace_until_the_archive_fits_and_leaves_checkpoints_out(tmp_path):
    """The pack after every part (bench/gpu_check_lib.sh): over its limit, the largest
    profiler trace is cut to its first and last lines, the record names it; *.pth never
    goes in."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "profile").mkdir(parents=True)
    (work / "train" / "yolox").mkdir(parents=True)
    out.mkdir()
    lines = "\n".join(os.urandom(60).hex() for _ in range(40_000))  # ~4.8 MB that gzip cannot shrink much
    (work / "profile" / "trace_compile_graphs.json").write_text(lines)
    (work / "profile" / "profile.json").write_text("{}")
    (work / "train" / "yolox" / "latest.pth").write_bytes(os.urandom(2**20))
    (work / "train" / "yolox" / "metrics.jsonl").write_text('{"step": 1}\n')
    (work / "unknown_gpu-check.json").write_text("{}")  # recorded before the stem was known
    archive, record = pack_with_record(work, out)
    assert record["archive"]["trimmed"] == ["profile/trace_compile_graphs.json"]
    assert record["archive"]["bytes"] == archive.stat().st_size
    with tarfile.open(archive) as tar:
        names = [n.removeprefix("./") for n in tar.getnames()]
        trace = tar.extractfile("./profile/trace_compile_graphs.json").read().decode()
    assert "train/yolox/metrics.jsonl" in names and "profile/profile.json" in names
    assert not any(n.endswith(".pth") for n in names)
    assert "unknown_gpu-check.json" not in names and not (work / "unknown_gpu-check.json").exists()
    assert "cut by gpu_check.sh" in trace and trace.startswith(lines[:120]) and trace.endswith(lines[-120:])


def test_packing_leaves_out_plots_and_cuts_one_line_traces_and_ends(tmp_path):
    """Over the limit with files that line cuts cannot shrink (a one-line trace; the trainers'
    plots and TensorBoard events): the trace is cut to its first and last 64 KiB, the binary
    files are left out, largest first, until the archive fits, and the record names them.
    (The line cut alone looped for ever on a trainer's val_predictions.jpg.)"""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "profile").mkdir(parents=True)
    (work / "train" / "ppyolo" / "tb").mkdir(parents=True)
    out.mkdir()
    one_line = os.urandom(1_200_000).hex()  # 2.4 MB, no newline
    (work / "profile" / "trace_eager_bf16.json").write_text(one_line)
    (work / "train" / "ppyolo" / "val_predictions.jpg").write_bytes(os.urandom(700_000))
    (work / "train" / "ppyolo" / "results.png").write_bytes(os.urandom(500_000))
    (work / "train" / "ppyolo" / "tb" / "events.out.tfevents.1").write_bytes(os.urandom(100_000))
    (work / "train" / "ppyolo" / "metrics.jsonl").write_text('{"step": 1}\n')
    archive, record = pack_with_record(work, out)
    assert record["archive"]["trimmed"] == ["profile/trace_eager_bf16.json"]
    assert record["archive"]["dropped"] == ["train/ppyolo/val_predictions.jpg"]
    with tarfile.open(archive) as tar:
        names = [n.removeprefix("./") for n in tar.getnames()]
        trace = tar.extractfile("./profile/trace_eager_bf16.json").read().decode()
    assert "train/ppyolo/val_predictions.jpg" not in names
    assert "train/ppyolo/results.png" in names and "train/ppyolo/metrics.jsonl" in names
    assert trace.startswith(one_line[:65536]) and trace.endswith(one_line[-65536:]) and len(trace) < 140_000


def _sleep_job(name: str, gib: float, seconds: float) -> run_jobs.Job:
    return run_jobs.Job(name, gib, [sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_precompile_jobs_start_only_while_their_gpu_memory_fits(tmp_path, capsys):
    """bench/run_jobs.py with 10 GiB: big (6) and small (3) start together; big2 (6) waits for
    big to end although small ended first; huge (20, over the budget) waits until it runs alone."""
    import time

    jobs = [_sleep_job("big", 6, 1.0), _sleep_job("big2", 6, 0.2), _sleep_job("small", 3, 0.2),
            _sleep_job("huge", 20, 0.2)]
    done = tmp_path / "done.tsv"
    run_jobs.run(jobs, time.time() + 120, tmp_path / "logs", done, max_parallel=4, memory_gib=10, per_job_gib=0,
                 poll_s=0.05)
    events = [" ".join(line.split()[1:3]) for line in capsys.readouterr().out.splitlines()]
    assert events[:2] == ["big started", "small started"], events
    assert events.index("big ended") < events.index("big2 started") < events.index("big2 ended") \
        < events.index("huge started"), events
    assert sorted(line.split("\t")[:2] for line in done.read_text().splitlines()) == [
        ["big", "0"], ["big2", "0"], ["huge", "0"], ["small", "0"]]
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"big.log", "big2.log", "small.log", "huge.log"}


def test_precompile_jobs_are_cut_at_the_deadline_and_late_ones_not_started(tmp_path, capsys):
    """A job that cannot start fails alone (exit 127); one past the deadline is cut (124);
    one that would start too close to it is not started."""
    import time

    done = tmp_path / "done.tsv"
    t0 = time.time()
    missing = run_jobs.Job("missing", 1, [str(tmp_path / "no-such-program")])
    run_jobs.run([missing, _sleep_job("slow", 1, 60), _sleep_job("late", 1, 0.1)], t0 + 2.5, tmp_path / "logs",
                 done, max_parallel=1, memory_gib=0, per_job_gib=0, poll_s=0.05, min_start_s=1.0)
    assert time.time() - t0 < 10
    lines = done.read_text().splitlines()
    assert lines[0] == "missing\t127\t0" and "no-such-program" in (tmp_path / "logs" / "missing.log").read_text()
    assert "late not started: deadline" in lines
    assert [line.split("\t")[:2] for line in lines if line.startswith("slow")] == [["slow", "124"]]


@pytest.mark.slow
def test_the_precompile_jobs_gpu_memory_table_covers_the_estimate():
    """gpu_check.sh's JOB_GIB holds bench/memory_estimate.py --gpu-check's figures (rounded
    up): a model or recipe that grows is caught here, not by an out-of-memory on the GPU."""
    import re

    r = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_estimate.py"), "--gpu-check"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    estimate = {line.split("\t")[0]: int(line.split("\t")[1]) for line in r.stdout.splitlines() if "\t" in line}
    table = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A JOB_GIB=\(([^)]*)\)",
                                                         SCRIPT.read_text()).group(1)))
    assert set(estimate) == set(table) and len(table) == 9
    assert all(int(table[j]) >= estimate[j] for j in table), (table, estimate)
