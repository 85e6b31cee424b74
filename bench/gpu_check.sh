#!/usr/bin/env bash
# The GPU check: one call of the device tool on a bare 16-core H100 or H200 host (torch,
# no network, maybe no DALI or pycocotools) brings back every figure of issue 42, item 1.
#
#   bench/gpu_check.sh [OUT_DIR]   # default: bench/results/gpu-check-<UTC time>; under the
#                                  # device tool ($OUT set, no OUT_DIR) a work folder in $TMPDIR,
#                                  # packed into $OUT/gpu_check.tgz after every part
#   bench/gpu_check.sh --plan      # the plan below as JSON (parts, lanes, limits, commands)
#   bench/gpu_check.sh --rehearse [OUT_DIR]
#                                  # every part on this CPU at tiny sizes (tests/test_gpu_check.py)
#
# The plan. Its limits are the script's own: `part` reads each part's limit from this table
# (a part no longer in the budget is skipped and says so). `main` parts run one at a time, and
# their limits sum to <= 540 s, the device tool's 10 minutes less its start and transfers; the
# `side` part, precompile, compiles every graph the later parts load, in parallel processes,
# by the very code each of them runs (bench/throughput.py --precompile, python -m
# fastdet.compile), so they load them from inductor's cache (each timed row records its cache
# hits and misses). It runs from its start until join_precompile stops it (cold_compile needs
# the cores), each job cut at its limit.
#
# The rows from step_ppyoloe to step_b128 are in priority order: the four families' steps
# first (issue 42's headline), then the profile, the trainer runs, cold_compile (always
# last: it stops precompile first), batch 128. Each starts once its graphs are compiled
# (precompile's job for it ended) and its GPU memory is free: the four steps in the order
# their graphs come, a part of lower priority ahead of a higher one only while the budget
# keeps the higher one's limit. When nothing is ready the main lane waits ("waits"); a wait
# beyond that row's limit takes the time of the parts of lower priority, which are then cut
# or skipped, each saying why. A part whose job failed is skipped (PP-YOLOE's step and the
# profile keep their eager rows), saying why; so is one whose job the lane never ended, the
# lane gone (lane_lost: no waiting on a dead lane). Each part records the precompile jobs that ran
# beside it ("beside"). bench/README.md ("Call 1: the plan") has the reasoning and timelines.
#
#| part            | lane | limit_s | returns                                                          | GPU estimate (source)
#| env             | main | 10      | GPU, driver, versions, packages; the result stem                 | ~5 s (H200 run, GPU.md)
#| install         | main | 20      | fastdet importable (pip -e, no deps, no network)                 | ~15 s (2026-12-04 run)
#| build           | main | 20      | the extension's CUDA variant                                     | 11 s (GPU.md, measured)
#| precompile      | side | 420     | 9 jobs, 11 graphs, in priority order: the 4 step graphs of the   | 4 step graphs 88-146 s (103 s x graph size, GPU.md),
#|                 |      |         | families' rows first (nice 5), then each trainer's (FCOS: 3      | ~130-220 s at 1.5x; all 9 jobs by ~350 s (H100,
#|                 |      |         | canvases), batch 128's last (nice 19); 16 cores / 4 threads each;| GPU.md-based) or ~510 s (1.5x); bench/README.md
#|                 |      |         | started while they fit in the GPU's memory beside the main lane  |
#| tests_kernels   | main | 50      | pytest -m gpu: IoU, EMA, assigners, yolo_targets, FCOS, SimOTA   | ~30 s (GPU.md: 17 tests in 110 s with a compile)
#| tests_capture   | main | 60      | every family's whole step captured = eager, sync-debug           | ~60 s (estimate, seconds per bucket)
#| waits           | main | 25      | the main lane's waits for graphs and GPU memory, in all          | 0-25 s (GPU.md-based); ~150 s at 1.5x, taken from
#|                 |      |         |                                                                  | train, batch 128, cold_compile (estimates)
#| step_ppyoloe    | main | 75      | PP-YOLOE-s 640 b64: eager fp32, eager bf16, eager bf16 NHWC,     | ~70 s: eager 3 x 8 s, 2 cache loads + trace
#|                 |      |         | compiled, compiled + CUDA graphs; img/s, peak memory, flags     | ~15 s each, capture 7 s (GPU.md)
#| step_yolox      | main | 28      | YOLOX-s 640 b64, 120 boxes: compiled + CUDA graphs               | ~25 s (a cache load + capture, estimate)
#| step_ppyolo     | main | 28      | PP-YOLO r50vd_dcn 608 b64, 50 boxes: compiled + CUDA graphs      | ~25 s (estimate)
#| step_fcos       | main | 28      | FCOS r50 800x1344 b16, 100 boxes: compiled + CUDA graphs         | ~25 s (estimate)
#| profile         | main | 40      | profile table of PP-YOLOE-s compiled + captured and eager bf16   | ~35 s (from the cache; estimate)
#| train           | main | 80      | a trainer run per family, in parallel: --compile --cuda-graphs,  | ~60 s: graphs from the cache, 40 steps at 256 px
#|                 |      |         | blocking warm-up, 40 steps; log + metrics.jsonl, no checkpoint;  | (estimate; the 2-graph smoke took 180 s cold)
#|                 |      |         | each once precompile's job for it ended (its graphs cached)      |
#| step_b128       | main | 25      | PP-YOLOE-s 640 b128: compiled + CUDA graphs                      | ~25 s (estimate)
#| join_precompile | main | 5       | stops precompile; its per-graph seconds and cache counts         | 0-5 s
#| cold_compile    | main | 46      | PP-YOLOE-s recipe, --compile, empty cache, 2 workers x 8 threads | what is left: the first step (eager, ~20 s) and
#|                 |      |         | (16 cores): time to the first step and to each graph compiled    | the graphs done by then; all 30 (15 sizes x 2
#|                 |      |         | within the limit (bench/compile_timeline.py)                     | variants) take ~26 min at 103 s/graph/worker
#
# The GPU estimates come from the one H200 run so far (../shared/GPU.md: one PP-YOLOE-s
# inductor graph 103 s cold at batch 64, 144 s at 128; capture 7 s; the build 11 s) and, for
# the other families' graphs, that 103 s scaled by their graphs' size (bench/README.md), not
# from this script: bench/README.md has the CPU rehearsal's seconds. Time a part does not use
# goes to cold_compile, the last part, which takes what is left of the budget.
#
# The archive ($OUT/gpu_check.tgz, at most GPU_CHECK_ARCHIVE_MB, default 8 MiB) is rewritten
# after every part, checkpoints (*.pth) left out; if it is over, the largest profiler traces
# and then the largest logs are cut to their first and last lines, and the record says so.
# Beside it: $OUT/summary.txt and $OUT/gpu-check.json (what each part did, the plan, the
# archive's size). A part that needs a missing package (pycocotools) is skipped with the
# reason; without DALI the torch loader is used. DALI's rows are the second call's
# (bench/gpu_check_dali.sh; bench/dali_carry.sh carries DALI there); bench/README.md has
# both calls' commands.
#
# Environment:
#   GPU_CHECK_BUDGET_S   overall seconds (default 540)
#   GPU_CHECK_PARTS      comma list of the parts above (default: all, in the order above)
#   GPU_CHECK_TEST_TIMEOUT_S  seconds per GPU test (default 60; needs pytest-timeout)
#   GPU_CHECK_ARCHIVE_MB the archive's limit in MiB (default 8)
#   PYTHON               the interpreter holding torch (default python3)
#   FASTDET_GIT_COMMIT   the commit of this tree, recorded where the copy has no .git
#   GPU_CHECK_DEVICE     cuda (default); cpu is what --rehearse sets
#   GPU_CHECK_MEMORY_GIB the GPU memory precompile's jobs and the main lane share (default: the
#                        GPU's less 1 GiB; 0, no memory rule, on the CPU)
#   GPU_CHECK_TRAIN_WAITS  1: each trainer starts once precompile's job for it ended (default
#                        on CUDA); 0: at once (default on the CPU: its eager backend caches nothing)
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
SELF="$REPO/bench/gpu_check.sh"
MODE=run
case "${1:-}" in
    --plan) MODE=plan; shift ;;
    --rehearse) MODE=rehearse; shift ;;
esac
BUDGET=${GPU_CHECK_BUDGET_S:-540}
# A rehearsal checks the script's flow on a loaded 2-core CPU, not its speed: its limits and
# budget are the plan's times GPU_CHECK_LIMIT_SCALE (default 10 there, 1 on the GPU).
SCALE=${GPU_CHECK_LIMIT_SCALE:-1}
[[ $MODE == rehearse ]] && SCALE=${GPU_CHECK_LIMIT_SCALE:-10}

PY=${PYTHON:-python3}
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # parts cd elsewhere
KIND=gpu-check
LAST_TAKES_REST=cold_compile
# shellcheck source=bench/gpu_check_lib.sh
source "$REPO/bench/gpu_check_lib.sh"
PARTS=${GPU_CHECK_PARTS:-$(plan_parts)}

DEVICE=${GPU_CHECK_DEVICE:-cuda}
[[ $MODE == rehearse ]] && DEVICE=cpu
# What differs in a rehearsal: tiny sizes, one timed iteration, Dynamo's eager backend (the
# commands, their flags and outputs as on the GPU, without minutes of inductor per graph).
if [[ $DEVICE == cpu ]]; then
    TINY=(--img-size 64 --windows 1 --iters 1 --warmup 0 --compile-backend eager --workers 1)
    TINY_FCOS=(--img-size 64x96 --windows 1 --iters 1 --warmup 0 --compile-backend eager --workers 1)
    STEP_ARGS=(--device cpu --quick --amp bf16)
    # torchvision's deform_conv2d has a CUDA autocast rule (fp32) but no bf16 CPU kernel.
    STEP_ARGS_PPYOLO=(--device cpu --quick --amp off)
    PROFILE_ARGS=(--device cpu --quick --amp bf16 --img-size 64 --compile-backend eager --steps 1 --iters 1 --warmup 0)
    TRAIN_SIZE=64 TRAIN_STEPS=2 TRAIN_BATCH=2 TRAIN_GPU=() TRAIN_BACKEND=(--set compile.backend=eager)
    COLD_ARGS=(--device cpu --batch-size 2 --set compile.backend=eager --set data.train_sizes=[64,96])
    BATCH_B64=2 BATCH_B128=4 BATCH_FCOS=2
    PYTEST_SELECT=(--collect-only -q)
else
    TINY=() TINY_FCOS=()
    STEP_ARGS=(--device cuda --windows 3 --iters 10 --warmup 3)
    STEP_ARGS_PPYOLO=("${STEP_ARGS[@]}")
    PROFILE_ARGS=(--device cuda --steps 3 --iters 10 --warmup 3)
    TRAIN_SIZE=256 TRAIN_STEPS=40 TRAIN_BATCH=8 TRAIN_GPU=(--cuda-graphs) TRAIN_BACKEND=()
    COLD_ARGS=(--device cuda --batch-size 32)
    BATCH_B64=64 BATCH_B128=128 BATCH_FCOS=16
    PYTEST_SELECT=(-m gpu -v)
fi
FAMILIES=(ppyoloe:s yolox:s ppyolo:r50vd_dcn fcos:r50)

# The timed parts' commands; precompile compiles each one's graph with the same flags.
PP=(bench/throughput.py "${STEP_ARGS[@]}" --arch ppyoloe --size s)
declare -A STEP_CMD=(
    [step_ppyoloe]="${PP[*]} --batch-size $BATCH_B64 ${TINY[*]} --modes step_eager_fp32,step_eager_amp,step_eager_amp_nhwc,step_compile,step_compile_graphs"
    [step_yolox]="bench/throughput.py ${STEP_ARGS[*]} --arch yolox --size s --batch-size $BATCH_B64 ${TINY[*]} --modes step_compile_graphs"
    [step_ppyolo]="bench/throughput.py ${STEP_ARGS_PPYOLO[*]} --arch ppyolo --size r50vd_dcn --batch-size $BATCH_B64 ${TINY[*]} --modes step_compile_graphs"
    [step_fcos]="bench/throughput.py ${STEP_ARGS[*]} --arch fcos --size r50 --batch-size $BATCH_FCOS ${TINY_FCOS[*]} --modes step_compile_graphs"
    [step_b128]="${PP[*]} --batch-size $BATCH_B128 ${TINY[*]} --modes step_compile_graphs"
)
STEP_PARTS=(step_ppyoloe step_yolox step_ppyolo step_fcos step_b128)
PROFILE_CMD="bench/profile_step.py ${PROFILE_ARGS[*]} --variants compile_graphs,eager_amp"

# train_flags ARCH SIZE: the trainer run of one family (and fastdet.compile's, for its graphs).
# No TensorBoard: its events (1.2-1.9 MB a family after 2 steps in the rehearsal) would take
# the archive's room; the log and metrics.jsonl hold the same figures.
train_flags() {
    local f=(--arch "$1" --size "$2" --data demo --device "$DEVICE" --epochs 1 --max-steps "$TRAIN_STEPS"
             --log-interval 10 --img-size "$TRAIN_SIZE" --no-multiscale --batch-size "$TRAIN_BATCH" --workers 2
             --compile "${TRAIN_GPU[@]}" "${TRAIN_BACKEND[@]}" --set compile.warmup=blocking
             --set run.progress=false --set run.eval_interval=1000000 --set run.tensorboard=false
             --set "data.loader=${LOADER:-torch}")
    [[ $1 == ppyoloe ]] && f+=(--set family.static_assigner_epoch=100)  # one loss variant, one graph
    echo "${f[@]}"
}

if [[ $MODE == plan ]]; then
    export PLAN_STEP_CMDS PLAN_TRAIN
    PLAN_STEP_CMDS=$(for p in "${STEP_PARTS[@]}"; do printf '%s\t%s\n' "$p" "${STEP_CMD[$p]}"; done; printf 'profile\t%s\n' "$PROFILE_CMD")
    PLAN_TRAIN=$(for fam in "${FAMILIES[@]}"; do printf '%s\t%s\n' "${fam%%:*}" "$(train_flags "${fam%%:*}" "${fam#*:}")"; done)
    PLAN_CMDS=$PLAN_STEP_CMDS print_plan
    exit 0
fi

# Under the device tool only 8 files come back from $OUT: work in $TMPDIR, pack into $OUT.
WORK_ROOT=${TMPDIR:-/tmp}/fastdet-gpu-check
start_run out gpu-check "${1:-}"  # cold_compile has its own, empty inductor cache

note "repo $REPO, output $OUT_DIR, budget ${BUDGET}s, mode $MODE, device $DEVICE, parts $PARTS"

# --- env: what this machine is; the stem of every result file.
if wanted env; then
    { nvidia-smi || echo "nvidia-smi failed"; } > "$OUT_DIR/nvidia-smi.txt" 2>&1
fi
T_ENV=$(date +%s)
STEM=$("$PY" - "$OUT_DIR/env.json" <<'EOF' 2>"$OUT_DIR/env.err"
import sys, torch
sys.path.insert(0, ".")
from bench.common import env_info, result_stem, write_json
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
env = env_info(dev, with_ops=False)  # the ops' back ends are recorded by each benchmark, after the build
write_json(sys.argv[1], env)
print(result_stem(env, "x")[:-2])
EOF
)
[[ -z "$STEM" ]] && STEM="$(date -u +%Y-%m-%d)_unknown"
[[ $MODE == rehearse ]] && STEM="${STEM}_rehearsal"
note "result stem: $STEM"
HAVE_DALI=0 HAVE_COCO=0 COCO_WHY=
for mod in nvidia.dali pycocotools triton pytest_timeout; do
    if why=$(import_error "$mod"); then
        note "$mod: installed"
        [[ $mod == nvidia.dali ]] && HAVE_DALI=1
        [[ $mod == pycocotools ]] && HAVE_COCO=1
    else
        note "$mod: NOT importable here ($why): the parts that need it skip or fall back, with a note"
        [[ $mod == pycocotools ]] && COCO_WHY=$why
    fi
done
LOADER=torch
(( HAVE_DALI )) && [[ $DEVICE == cuda ]] && LOADER=dali
if wanted env; then
    status_line env ok 0 "$(( $(date +%s) - T_ENV ))" "" "$(limit env)" main
    record
fi

# --- install: make fastdet (with its package data) importable.
if wanted install; then
    if (cd /tmp && "$PY" -c "import fastdet._csrc, fastdet.ops" > /dev/null 2>&1); then
        note "install: fastdet already importable"
        status_line install ok 0 0 "already importable" "$(limit install)" main
    else
        part install "$PY" -m pip install --no-deps --no-index --no-build-isolation -q -e "$REPO"
        if ! (cd /tmp && "$PY" -c "import fastdet._csrc" > /dev/null 2>&1); then
            # No install possible: lay the tree out as installed (fastdet._csrc = csrc/,
            # fastdet.pipelines = pipelines/, as pyproject maps them) for this run only.
            LINKS=()
            for pair in _csrc:csrc pipelines:pipelines; do
                if [[ ! -e "$REPO/fastdet/${pair%%:*}" ]]; then
                    ln -s "../${pair#*:}" "$REPO/fastdet/${pair%%:*}" && LINKS+=("$REPO/fastdet/${pair%%:*}")
                fi
            done
            trap 'rm -f "${LINKS[@]}"' EXIT
            export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
            note "install: pip could not install fastdet; using PYTHONPATH=$REPO with links ${LINKS[*]:-none} (removed at exit)"
        fi
    fi
fi

if [[ $DEVICE == cpu ]]; then
    # The rehearsal times the script, not a build: the extension is the CPU one of this tree.
    part build "$PY" -c "from fastdet.ops import dispatch; print(dispatch.__name__)"
else
    part build "$PY" -m fastdet.ops.build
fi

# --- the main lane beside precompile. job_end NAME: the exit code of precompile's job NAME
# once it ended, "-" if it was never started, "lost" once the lane is gone without writing its
# end (lane_lost), nothing while it runs or when precompile has no such job (bench/run_jobs.py's
# done file); queued NAME: precompile has that job.
job_end() {
    local line
    if line=$(grep -m1 -E "^$1("$'\t'"| not started)" "$OUT_DIR/precompile/done.tsv" 2>/dev/null); then
        if [[ $line == *"not started"* ]]; then echo "-"; else echo "$line" | cut -f2; fi
    elif queued "$1" && lane_lost; then
        echo lost
    fi
    return 0
}
queued() { [[ -n "$PRE_PID" ]] && grep -q -m1 "^$1"$'\t' "$JOBFILE"; }
# proc_stat PID: the fields of /proc/PID/stat after the command's name (0: the state, 2: the
# process group, 19: the start time); status 1 when there is no such process.
proc_stat() {
    local stat
    read -r stat < "/proc/$1/stat" 2>/dev/null || return 1
    echo "${stat##*) }"
}
# lane_alive: bench/run_jobs.py runs: not a zombie, and not another process given its pid
# since (its start time is the one seen at launch, PRE_START).
lane_alive() {
    local f
    [[ -n "$PRE_PID" ]] || return 1
    [[ -n "${PRE_START:-}" ]] || { kill -0 "$PRE_PID" 2>/dev/null; return; }  # no /proc
    read -r -a f <<< "$(proc_stat "$PRE_PID")"
    [[ ${f[0]:-Z} != Z && ${f[19]:-} == "$PRE_START" ]]
}
# lane_lost: precompile's lane is gone (crashed, killed) before writing the end of every job:
# those jobs count as failed (job_end says "lost"), so no part waits for them; the jobs it
# left running (its last state's process groups) are stopped, for no one counts their GPU
# memory any more; the one line saying so is written once, to $PRE_DIR/lane_lost. Status 0
# from then on; 1 while the lane runs, or when it ended having written every job's end.
lane_lost() {
    local j pid f missing=() stopped=()
    [[ -n "$PRE_PID" ]] || return 1
    [[ -s "$PRE_DIR/lane_lost" ]] && return 0
    lane_alive && return 1
    while IFS=$'\t' read -r j _; do
        grep -q -m1 -E "^$j("$'\t'"| not started)" "$PRE_DIR/done.tsv" 2>/dev/null || missing+=("$j")
    done < "$JOBFILE"
    (( ${#missing[@]} )) || return 1
    for pid in $(cut -f4 "$STATE_FILE" 2>/dev/null | tr ',' ' '); do
        # Still the leader of its own process group: the job's, not another process given its pid.
        read -r -a f <<< "$(proc_stat "$pid")"
        [[ ${f[2]:-} == "$pid" ]] && kill -KILL -- "-$pid" 2>/dev/null && stopped+=("$pid")
    done
    echo "precompile's lane (bench/run_jobs.py, pid $PRE_PID) is gone (crashed or killed: precompile/jobs.log) without the end of its jobs $(printf '%s\n' "${missing[@]}" | paste -sd, -): they count as failed, no part waits for them${stopped[*]:+; the jobs it left running were stopped (process groups ${stopped[*]})}" \
        > "$PRE_DIR/lane_lost.tmp" && mv "$PRE_DIR/lane_lost.tmp" "$PRE_DIR/lane_lost"
    return 0
}
# lane_state FIELD: bench/run_jobs.py's state: 1 the GiB its jobs reserve, 2 the main lane's
# figures it last read, 3 the running jobs (comma list).
lane_state() { lane_alive && cut -f "$1" "$STATE_FILE" 2>/dev/null; }
# declare_main NOW: tell precompile the GiB the main lane holds or is about to take now (the
# four step graphs' jobs start beside it) and the most its pending parts will need (every later
# job starts beside that, so none takes the room of a part to come; not less the GiB of the
# jobs those parts wait for: a job that ends frees them in the very poll that could start
# another into them); status 0 when it changed.
PENDING=()
DECLARED=
LANE=
declare_main() {
    local later=0 p n
    [[ -n "$LANE" ]] || return 1
    for p in ${PENDING[@]+"${PENDING[@]}"}; do
        n=${MAIN_GIB[$p]:-0}
        (( n > later )) && later=$n
    done
    (( later < $1 )) && later=$1
    [[ "$1 $later" == "$DECLARED" ]] && return 1
    DECLARED="$1 $later"
    echo "$DECLARED" > "$MAIN_FILE.tmp" && mv "$MAIN_FILE.tmp" "$MAIN_FILE"
}
# ready_gib: the most GiB a pending part whose graphs are compiled needs: what the main lane
# is about to take (it starts such a part as soon as its memory is free).
ready_gib() {
    local p n=0
    for p in ${PENDING[@]+"${PENDING[@]}"}; do
        part_ready "$p" && (( ${MAIN_GIB[$p]:-0} > n )) && n=${MAIN_GIB[$p]:-0}
    done
    echo "$n"
}
# part_ready PART: precompile's jobs for PART's graphs have ended (or it has none).
part_ready() {
    local j
    [[ -n "$PRE_PID" ]] || return 0
    [[ $1 == train && -z ${TRAIN_AFTER_PRECOMPILE:-} ]] && return 0
    for j in ${DEPS[$1]:-}; do
        queued "$j" && [[ -z $(job_end "$j") ]] && return 1
    done
    return 0
}
# part_fits PART: PART's GPU memory is free beside precompile's jobs, which have seen what
# the main lane declared (so none starts into it).
part_fits() {
    local reserved
    (( MEM_GIB > 0 )) && lane_alive || return 0
    [[ "$(lane_state 2)" == "$DECLARED" ]] || return 1
    reserved=$(lane_state 1)
    awk -v r="${reserved:-0}" -v n="${MAIN_GIB[$1]:-0}" -v m="$MEM_GIB" 'BEGIN { exit !(r + n <= m) }'
}
# deps_failed PART: its jobs that ended other than with 0, as "job (exit N)", or that the lane,
# gone, never ended.
deps_failed() {
    local j e out=()
    for j in ${DEPS[$1]:-}; do
        queued "$j" || continue
        e=$(job_end "$j")
        if [[ $e == lost ]]; then
            out+=("$j (never ended: precompile's lane is gone, precompile/lane_lost)")
        elif [[ -n $e && $e != 0 ]]; then
            out+=("$j (exit $e)")
        fi
    done
    echo "${out[*]:-}"
}
left() { echo $(( BUDGET - $(elapsed) - 5 )); }
# reserve PART [BELOW]: the seconds the pending parts of PART's priority or higher (BELOW:
# only higher) need, with join_precompile and, when it ranks so, cold_compile.
reserve() {
    local q sum=0 r=$(( RANK[$1] - ${2:-0} ))
    for q in ${PENDING[@]+"${PENDING[@]}"}; do
        (( RANK[$q] <= r )) && sum=$(( sum + $(limit "$q") ))
    done
    [[ -n "$PRE_PID" ]] && sum=$(( sum + $(limit join_precompile) ))
    wanted cold_compile && (( RANK[cold_compile] <= r )) && sum=$(( sum + $(limit cold_compile) ))
    echo "$sum"
}
# pick_part: the next part to run: the four steps in the order their graphs came, then the
# others by priority; the first that is ready and fits, and, below the four steps, only with
# the time the parts of higher priority need left after it.
pick_part() {
    local heads=() rest=() q key
    for q in ${PENDING[@]+"${PENDING[@]}"}; do
        if (( RANK[$q] == 0 )); then
            key=$(grep -n -m1 -E "^$q("$'\t'"| not started)" "$PRE_DIR/done.tsv" 2>/dev/null | cut -d: -f1)
            heads+=("${key:-9999} $q")
        else
            rest+=("$q")
        fi
    done
    for q in $(printf '%s\n' ${heads[@]+"${heads[@]}"} | sort -n -s -k1,1 | cut -d' ' -f2) ${rest[@]+"${rest[@]}"}; do
        part_ready "$q" && part_fits "$q" || continue
        if (( RANK[$q] == 0 || $(left) >= $(limit "$q") + $(reserve "$q" 1) )); then
            echo "$q"
            return
        fi
    done
}
drop_pending() {
    local q keep=()
    for q in ${PENDING[@]+"${PENDING[@]}"}; do [[ $q == "$1" ]] || keep+=("$q"); done
    PENDING=(${keep[@]+"${keep[@]}"})
}
# beside_of (called by finish): the precompile jobs that ran beside the part that just ended.
beside_of() {
    [[ -n ${BESIDE_ON:-} ]] || return 0
    { tr ',' '\n' <<< "$BESIDE_FROM"; lane_state 3 | tr ',' '\n'
      tail -n +"$(( BESIDE_N0 + 1 ))" "$PRE_DIR/done.tsv" 2>/dev/null | grep -v "not started" | cut -f1
    } | grep -v '^$' | sort -u | paste -sd, -
}

# --- precompile (side lane): every graph the later parts load, each job in its own process,
# several at a time, in priority order, each job cut at the part's deadline or when
# join_precompile stops the lane.
CPUS=$(nproc)
GPU_MB=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 20 if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
# What each precompile job's compiled step should hold on the GPU, GiB, with room to spare
# (bench/memory_estimate.py --gpu-check, run on the CPU 2026-12-07: its eager bf16 step on
# fake tensors, scaled by the H200's measured PP-YOLOE-s figures); FCOS's trainer job has 3
# worker processes, each with its CUDA context. bench/run_jobs.py adds 1 GiB a job for its
# CUDA context.
declare -A JOB_GIB=([step_ppyoloe]=12 [step_yolox]=13 [step_ppyolo]=28 [step_fcos]=16 [step_b128]=23
                    [train_ppyoloe]=1 [train_yolox]=1 [train_ppyolo]=1 [train_fcos]=4)
# What each main part holds on the GPU, GiB, its CUDA context included: the tests (batch 2-4,
# 64-320 px); PP-YOLOE's eager fp32 row (23.6 measured, GPU.md) and the other steps' compiled
# graphs (JOB_GIB + 1); the profile's eager bf16 step (13.8 measured); the 4 trainers at 256 px.
# The main lane writes what it holds or waits for into main_gib, and bench/run_jobs.py starts
# a job only while it fits beside that (bench/README.md: the four step graphs at once on an
# H100, 73 GiB reserved, beside the tests' 4).
declare -A MAIN_GIB=([tests]=4 [step_ppyoloe]=28 [step_yolox]=14 [step_ppyolo]=29 [step_fcos]=17
                     [profile]=16 [train]=10 [step_b128]=24)
# The parts after the tests, in priority order (the plan's rows), and the precompile jobs
# each loads its graphs from.
LATE=(step_ppyoloe step_yolox step_ppyolo step_fcos profile train step_b128)
declare -A RANK=([step_ppyoloe]=0 [step_yolox]=0 [step_ppyolo]=0 [step_fcos]=0 [profile]=1 [train]=2
                 [cold_compile]=3 [step_b128]=4)
declare -A DEPS=([step_ppyoloe]=step_ppyoloe [step_yolox]=step_yolox [step_ppyolo]=step_ppyolo
                 [step_fcos]=step_fcos [profile]=step_ppyoloe [step_b128]=step_b128
                 [train]="train_ppyoloe train_yolox train_ppyolo train_fcos")
if [[ $DEVICE == cpu ]]; then
    JOBS_AT_ONCE=2 MEM_GIB=0  # the rehearsal: no GPU memory to share
else
    # All at once as far as the GPU's memory goes (1 GiB of it left to the driver): the nice
    # levels, not a count, keep the cores for the four step graphs first.
    JOBS_AT_ONCE=9 MEM_GIB=$(( GPU_MB / 1024 - 1 ))
fi
MEM_GIB=${GPU_CHECK_MEMORY_GIB:-$MEM_GIB}
# The four step graphs' jobs fill the cores (4 x 4 threads on 16), each alone on its cores
# but for the main lane (nice 0) and the later jobs' share of idle cores (nice 19).
THREADS=$(( CPUS / 4 )); (( THREADS < 1 )) && THREADS=1
PRE_PID=
for p in "${LATE[@]}"; do
    wanted "$p" && { [[ $p != train ]] || (( HAVE_COCO )); } && PENDING+=("$p")
done
PRE_DIR="$OUT_DIR/precompile"
JOBFILE="$PRE_DIR/jobs.tsv"
MAIN_FILE="$PRE_DIR/main_gib"
STATE_FILE="$PRE_DIR/state"
if wanted precompile; then
    PRE_LIM=$(allowed precompile)
    if [[ -z "$PRE_LIM" ]]; then
        skip precompile "the budget of ${BUDGET}s is spent"
    else
        mkdir -p "$PRE_DIR"
        : > "$JOBFILE"
        # The families' step graphs first, at nice 5 (PP-YOLOE's batch 64 also feeds the
        # profile); then the trainer runs' (FCOS's 3 canvases in 3 workers) and batch 128's
        # (the least needed row, its graph the slowest: 144 s on the H200) at nice 19.
        # Only the graphs of the parts this run has, and no trainer's without pycocotools
        # (its part is skipped). --overwrite: OUT_DIR is this script's; a rerun into the same
        # OUT_DIR replaces its own results there, as it does its record.
        URGENT=0
        for p in step_ppyoloe step_yolox step_ppyolo step_fcos; do
            if wanted "$p" || { [[ $p == step_ppyoloe ]] && wanted profile; }; then
                printf '%s\t%s\t%s\n' "$p" "${JOB_GIB[$p]}" "nice -n 5 $PY ${STEP_CMD[$p]} --precompile --json $PRE_DIR/$p.json --overwrite" >> "$JOBFILE"
                URGENT=$(( URGENT + 1 ))
            fi
        done
        if wanted train && (( HAVE_COCO )); then
            for fam in "${FAMILIES[@]}"; do
                printf '%s\t%s\t%s\n' "train_${fam%%:*}" "${JOB_GIB[train_${fam%%:*}]}" \
                    "nice -n 19 $PY -m fastdet.compile $(train_flags "${fam%%:*}" "${fam#*:}") --cores $THREADS --set compile.workers=$THREADS --output-dir $OUT_DIR/train/${fam%%:*}" >> "$JOBFILE"
            done
        fi
        if wanted step_b128; then
            printf '%s\t%s\t%s\n' step_b128 "${JOB_GIB[step_b128]}" "nice -n 19 $PY ${STEP_CMD[step_b128]} --precompile --json $PRE_DIR/step_b128.json --overwrite" >> "$JOBFILE"
        fi
        DEADLINE=$(( $(date +%s) + PRE_LIM ))
        MEM_NOTE="no GPU memory to share"
        (( MEM_GIB > 0 )) && MEM_NOTE="within $MEM_GIB GiB of GPU memory beside the main lane's"
        note "precompile: start (limit ${PRE_LIM}s, side lane): $(wc -l < "$JOBFILE") jobs, the first $URGENT at nice 5, the rest at nice 19, at most $JOBS_AT_ONCE at once x $THREADS compile threads, $MEM_NOTE"
        T_PRE=$(date +%s)
        LANE=1
        declare_main "${MAIN_GIB[tests]}"
        # inductor's cache key leaves compile_threads out, so the timed parts (default
        # threads) still hit these entries. The lane's decisions: jobs.log.
        TORCHINDUCTOR_COMPILE_THREADS=$THREADS "$PY" "$REPO/bench/run_jobs.py" "$JOBFILE" --deadline "$DEADLINE" \
            --logs "$PRE_DIR" --done "$PRE_DIR/done.tsv" --max-parallel "$JOBS_AT_ONCE" \
            --memory-gib "$MEM_GIB" --urgent "$URGENT" --main-gib-file "$MAIN_FILE" --state "$STATE_FILE" \
            > "$PRE_DIR/jobs.log" 2>&1 &
        PRE_PID=$!
        PRE_START=  # its start time, which a process given its pid later would not have
        if [[ -r /proc/self/stat ]]; then
            read -r -a pre_stat <<< "$(proc_stat "$PRE_PID")"
            PRE_START=${pre_stat[19]:-}
        fi
        # On the CPU (the rehearsal) the trainers' eager backend has no graphs in a cache to
        # wait for: waiting there only lengthens the rehearsal (GPU_CHECK_TRAIN_WAITS=1 asks for it).
        [[ ${GPU_CHECK_TRAIN_WAITS:-$([[ $DEVICE == cuda ]] && echo 1)} == 1 ]] && export TRAIN_AFTER_PRECOMPILE=1
    fi
fi

# --- the GPU tests, one pytest run and one JUnit file per part, each test under its own
# timeout; they run while precompile compiles the four step graphs.
PYTEST=("$PY" -m pytest "${PYTEST_SELECT[@]}" -p no:cacheprovider -o addopts="" -ra)
if [[ $DEVICE == cuda ]] && "$PY" -c "import pytest_timeout" > /dev/null 2>&1; then
    PYTEST+=(--timeout "${GPU_CHECK_TEST_TIMEOUT_S:-60}")
fi
KERNEL_TESTS=(tests/test_ops_gpu.py tests/test_simota_kernels.py tests/test_fcos_assign.py
              tests/test_ops_yolo_targets.py tests/test_ops_ema.py)
INDUCTOR_TEST=test_compiled_graph_step_at_benchmark_size_trains_like_eager
part tests_kernels "${PYTEST[@]}" --junitxml="$OUT_DIR/pytest_tests_kernels.xml" "${KERNEL_TESTS[@]}"
part tests_capture "${PYTEST[@]}" --junitxml="$OUT_DIR/pytest_tests_capture.xml" \
    tests/test_gpu_capture.py tests/test_gpu_step.py -k "not $INDUCTOR_TEST"

# --- train: each family's trainer run, in parallel (a check that the trainer really takes
# compiled, captured steps, not a timing): blocking warm-up loads the graphs precompile
# compiled, then 40 steps and the final COCO evaluation. The part starts once precompile's
# jobs for the trainers have ended (their graphs are then in the cache), or, when waiting
# longer would take the time of the parts before it, with those whose job has ended; each
# trainer starts when its job has ended (one that ended otherwise is not started, saying why).
# Started before, its warm-up compiles them itself, cold: ~90 s a graph on the GPU host alone
# (FCOS has 3), more than this part's limit. Checkpoints are deleted before packing; the log,
# config and metrics.jsonl stay.
train_all() {
    local pids=() names=() waiting=("${FAMILIES[@]}") still fam end i rc=0
    # Cut at the part's limit: the trainers go too, or they would share the GPU with the timed parts.
    trap 'kill "${pids[@]}" 2>/dev/null; wait; find "$OUT_DIR/train" -name "*.pth" -delete
          for fam in "${waiting[@]}"; do echo "$fam: not started: precompile was still compiling its graphs"; done
          exit 124' TERM
    while (( ${#waiting[@]} )); do
        still=()
        for fam in "${waiting[@]}"; do
            end=0
            [[ -n ${TRAIN_AFTER_PRECOMPILE:-} ]] && end=$(job_end "train_${fam%%:*}")
            if [[ -z $end ]]; then
                still+=("$fam")
            elif [[ $end == 0 ]]; then
                [[ -n ${TRAIN_AFTER_PRECOMPILE:-} ]] && echo "$fam: started at $(date +%s), precompile's job for it done"
                # shellcheck disable=SC2046
                "$PY" -m fastdet.train $(train_flags "${fam%%:*}" "${fam#*:}") \
                    --output-dir "$OUT_DIR/train/${fam%%:*}" --exist-ok > "$OUT_DIR/train_${fam%%:*}.log" 2>&1 &
                pids+=($!)
                names+=("$fam")
            elif [[ $end == lost ]]; then
                (( rc )) || cat "$PRE_DIR/lane_lost"
                rc=1
                echo "$fam: not started: precompile's job for it never ended (its lane is gone), so its graphs are not in the cache"
            else
                rc=1
                echo "$fam: not started: precompile's job for it ended with exit $end (precompile/train_${fam%%:*}.log), so its graphs are not in the cache"
            fi
        done
        waiting=(${still[@]+"${still[@]}"})
        (( ${#waiting[@]} )) && sleep 1
    done
    for i in "${!pids[@]}"; do
        if wait "${pids[$i]}"; then
            echo "${names[$i]}: ok"
        else
            rc=1
            echo "${names[$i]}: FAILED (train_${names[$i]%%:*}.log)"
        fi
        grep -h -E "warm-up|runs compiled|captured|first step done" "$OUT_DIR/train_${names[$i]%%:*}.log" | tail -n 4
    done
    find "$OUT_DIR/train" -name '*.pth' -delete 2>/dev/null  # no folder when no trainer started
    return $rc
}
run_train() {
    export -f train_all train_flags job_end queued proc_stat lane_alive lane_lost
    export PY OUT_DIR DEVICE TRAIN_STEPS TRAIN_SIZE TRAIN_BATCH LOADER PRE_PID PRE_START PRE_DIR JOBFILE STATE_FILE
    export FAMILIES_LIST="${FAMILIES[*]}"
    part train bash -c 'FAMILIES=($FAMILIES_LIST); TRAIN_GPU=('"${TRAIN_GPU[*]}"'); TRAIN_BACKEND=('"${TRAIN_BACKEND[*]}"'); train_all'
}

# run_late PART: one of the parts after the tests, its graphs compiled (or their job failed).
run_late() {
    local p=$1 failed
    failed=$(deps_failed "$p")
    BESIDE_FROM=$(lane_state 3) BESIDE_N0=$(cat "$PRE_DIR/done.tsv" 2>/dev/null | wc -l) BESIDE_ON=1
    PART_WHY=
    if [[ -n $failed ]]; then
        PART_WHY="precompile's job ${failed} failed (precompile/${DEPS[$p]}.log): its graph is not in the cache and a cold compile (100-150 s a graph, GPU.md) does not fit the part's limit, so only the eager rows run"
    fi
    case $p in
        step_ppyoloe)
            local cmd=${STEP_CMD[$p]}
            [[ -n $failed ]] && cmd=${cmd/--modes */--modes step_eager_fp32,step_eager_amp,step_eager_amp_nhwc}
            # shellcheck disable=SC2086
            part "$p" "$PY" $cmd --json "$OUT_DIR/${STEM}_throughput-${p#step_}.json" --overwrite ;;
        profile)
            local cmd=$PROFILE_CMD
            [[ -n $failed ]] && cmd=${cmd/--variants */--variants eager_amp}
            # shellcheck disable=SC2086
            part profile "$PY" $cmd --out "$OUT_DIR/profile" ;;
        train)
            PART_WHY=
            run_train ;;
        *)
            PART_WHY=
            if [[ -n $failed ]]; then
                skip "$p" "precompile's job ${failed} failed (precompile/$p.log): its graph is not in the cache, and a cold compile (100-150 s a graph, GPU.md) does not fit the part's limit"
            else
                # shellcheck disable=SC2086
                part "$p" "$PY" ${STEP_CMD[$p]} --json "$OUT_DIR/${STEM}_throughput-${p#step_}.json" --overwrite
            fi ;;
    esac
    BESIDE_ON= PART_WHY=
}
# give_up PART: waiting longer for PART would take the time the parts before it need.
give_up() {
    local p=$1 j ok=0 still=()
    for j in ${DEPS[$p]:-}; do
        queued "$j" || continue
        [[ $(job_end "$j") == 0 ]] && ok=1
        [[ -z $(job_end "$j") ]] && still+=("$j")
    done
    if [[ $p == train ]] && (( ok )); then
        note "train: starts with the trainers whose graphs are compiled; precompile is still compiling ${still[*]}, and waiting longer would take the time the parts before it need"
        run_late train
    elif part_ready "$p" && part_fits "$p"; then
        skip "$p" "its limit of $(limit "$p")s no longer fits beside the $(reserve "$p" 1)s the parts before it need ($(left)s left)"
    elif part_ready "$p"; then
        skip "$p" "its GPU memory (${MAIN_GIB[$p]} GiB) was not free: precompile's jobs $(lane_state 3) hold $(lane_state 1) GiB of $MEM_GIB, and waiting longer would take the time the parts before it need"
    else
        skip "$p" "its graph was still compiling (precompile's job ${still[*]}), and waiting longer would take the time the parts before it need"
    fi
}

# --- the parts that load graphs, in the order above: each once its graphs are compiled and
# its GPU memory is free; a wait only while the budget keeps the limits of the parts before
# the one waited for.
if wanted train && (( ! HAVE_COCO )); then
    skip train "pycocotools is not importable ($COCO_WHY): the trainer's final COCO evaluation needs it (carry its wheel: bench/README.md)"
    drop_pending train
fi
WAIT_S=0 WAITED_FOR=() LOST_SAID=
while (( ${#PENDING[@]} )); do
    if [[ -z $LOST_SAID ]] && lane_lost; then
        note "precompile: $(cat "$PRE_DIR/lane_lost")"
        LOST_SAID=1
    fi
    declare_main "$(ready_gib)" && sleep 0.5  # bench/run_jobs.py reads it at its next poll
    p=$(pick_part)
    if [[ -n $p ]]; then
        drop_pending "$p"
        declare_main "${MAIN_GIB[$p]:-0}"
        run_late "$p"
        continue
    fi
    top=${PENDING[0]}
    if (( $(left) > $(reserve "$top") )); then
        [[ " ${WAITED_FOR[*]} " == *" $top "* ]] || WAITED_FOR+=("$top")
        sleep 1
        WAIT_S=$(( WAIT_S + 1 ))
        continue
    fi
    drop_pending "$top"
    give_up "$top"
done
if wanted waits; then
    why=
    (( WAIT_S > 0 )) && why="waited for ${WAITED_FOR[*]} (their graphs or GPU memory)"
    (( WAIT_S > $(limit waits) )) && why="$why; beyond this row's limit, in the time of the parts of lower priority"
    note "waits: ${WAIT_S}s${why:+: $why}"
    status_line waits ok 0 "$WAIT_S" "$why" "$(limit waits)" main
    record
fi

# --- join_precompile: the lane's jobs are done, or their parts gave up on them: it gets at
# most this part's limit to end, then is stopped (SIGTERM: bench/run_jobs.py cuts its jobs),
# for cold_compile needs the cores.
if [[ -n "$PRE_PID" ]]; then
    t0=$(date +%s)
    while lane_alive && (( $(date +%s) - t0 < $(limit join_precompile) )); do sleep 1; done
    CUT_WHY=
    if lane_alive; then
        CUT_WHY="stopped by join_precompile (cold_compile needs the cores) with $(lane_state 3) running; their parts had given up on them"
        note "join_precompile: stopping precompile's jobs $(lane_state 3)"
        kill -TERM "$PRE_PID"
    fi
    wait "$PRE_PID" 2>/dev/null
    lane_rc=$?
    PART_WHY=
    lane_lost && PART_WHY="$(cat "$PRE_DIR/lane_lost")"
    pre_rc=0
    [[ -f "$PRE_DIR/done.tsv" ]] || : > "$PRE_DIR/done.tsv"
    while IFS=$'\t' read -r job rc secs; do
        note "precompile: $job${rc:+ exit $rc in ${secs:-?}s}"
        if [[ -z $rc || $rc == 124 ]]; then
            (( pre_rc == 0 )) && pre_rc=124
        elif [[ $rc != 0 ]]; then
            pre_rc=1
        fi
    done < "$PRE_DIR/done.tsv"
    (( $(wc -l < "$PRE_DIR/done.tsv") < $(wc -l < "$JOBFILE") )) && (( pre_rc == 0 )) && pre_rc=124
    if [[ -n $PART_WHY ]]; then
        # Its lost jobs failed; the lane's own end says how it went (137: SIGKILL, 1: a crash).
        pre_rc=1 PART_WHY="$PART_WHY (bench/run_jobs.py exit $lane_rc)"
        [[ -z $LOST_SAID ]] && note "precompile: $(cat "$PRE_DIR/lane_lost")"
    fi
    cat "$PRE_DIR"/*.log > "$OUT_DIR/precompile.log" 2>/dev/null
    finish precompile "$pre_rc" "$T_PRE" "$PRE_LIM"
    CUT_WHY= PART_WHY=
    status_line join_precompile ok 0 "$(( $(date +%s) - t0 ))" "" "$(limit join_precompile)" main
    record
else
    skip join_precompile "precompile did not run"
fi

# --- cold_compile: what is left of the budget, on an empty cache of its own; the timeline
# stops itself 15 s before the part's limit, so it writes its JSON.
COLD_S=$(allowed cold_compile)
COLD_S=${COLD_S:-30}
# shellcheck disable=SC2046
part cold_compile env TORCHINDUCTOR_CACHE_DIR="$WORK_ROOT/inductor-cold-$START" "$PY" bench/compile_timeline.py \
    --arch ppyoloe --size s "${COLD_ARGS[@]}" --phases cold \
    --max-minutes "$(awk -v s="$(( COLD_S - 15 ))" 'BEGIN { printf "%.2f", (s > 10 ? s : 10) / 60 }')" \
    --after-all 0 --json "$OUT_DIR/${STEM}_compile-timeline-cold.json"

# --- the record of this run.
note "done in $(elapsed)s; results in $OUT_DIR${PACK_TO:+ (packed into $PACK_TO/gpu_check.tgz)}"
record
rm -f "$STATUS"
