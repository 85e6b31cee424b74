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
# (a part no longer in the budget is skipped and says so). `main` parts run one after the
# other, and their limits sum to <= 540 s, the device tool's 10 minutes less its start and
# transfers; a `side` part runs beside the main lane from its start until the main part that
# joins it, which waits for it at most its own limit, and the side part is cut at its limit.
# Graphs are compiled first, in parallel processes, by the very code each timed part runs
# (bench/throughput.py --precompile, python -m fastdet.compile), so the timed parts load them
# from inductor's cache (each timed row records its cache hits and misses).
#
#| part            | lane | limit_s | returns                                                          | GPU estimate (source)
#| env             | main | 10      | GPU, driver, versions, packages; the result stem                 | ~5 s (H200 run, GPU.md)
#| install         | main | 20      | fastdet importable (pip -e, no deps, no network)                 | ~15 s (2026-12-04 run)
#| build           | main | 30      | the extension's CUDA variant                                     | 11 s (GPU.md, measured)
#| precompile      | side | 200     | 5 bench graphs + each family's trainer graphs, compiled in       | ~150-200 s: 103 s per graph alone on 16 cores
#|                 |      |         | parallel: 9 jobs, 11 graphs (FCOS's trainer: 3 canvases), at     | (GPU.md), 11 graphs over 5-9 processes (estimate)
#|                 |      |         | most 5 at once (9 over 100 GB) in the GPU's memory less 12 GiB   |
#| tests_kernels   | main | 50      | pytest -m gpu: IoU, EMA, assigners, yolo_targets, FCOS, SimOTA   | ~30 s (GPU.md: 17 tests in 110 s with a compile)
#| tests_capture   | main | 60      | every family's whole step captured = eager, sync-debug           | ~60 s (estimate, seconds per bucket)
#| train           | main | 80      | a trainer run per family, in parallel: --compile --cuda-graphs,  | ~60 s: graphs from the cache, 40 steps at 256 px
#|                 |      |         | blocking warm-up, 40 steps; log + metrics.jsonl, no checkpoint;  | (estimate; the 2-graph smoke took 180 s cold)
#|                 |      |         | each once precompile's job for it ended (its graphs cached)      |
#| join_precompile | main | 20      | waits for precompile; its per-graph seconds and cache counts     | 0-20 s
#| step_ppyoloe    | main | 75      | PP-YOLOE-s 640 b64: eager fp32, eager bf16, eager bf16 NHWC,     | ~70 s: eager 3 x 8 s, 2 cache loads + trace
#|                 |      |         | compiled, compiled + CUDA graphs; img/s, peak memory, flags     | ~15 s each, capture 7 s (GPU.md)
#| step_yolox      | main | 28      | YOLOX-s 640 b64, 120 boxes: compiled + CUDA graphs               | ~25 s (a cache load + capture, estimate)
#| step_ppyolo     | main | 28      | PP-YOLO r50vd_dcn 608 b64, 50 boxes: compiled + CUDA graphs      | ~25 s (estimate)
#| step_fcos       | main | 28      | FCOS r50 800x1344 b16, 100 boxes: compiled + CUDA graphs         | ~25 s (estimate)
#| step_b128       | main | 25      | PP-YOLOE-s 640 b128: compiled + CUDA graphs                      | ~25 s (estimate)
#| profile         | main | 40      | profile table of PP-YOLOE-s compiled + captured and eager bf16   | ~35 s (from the cache; estimate)
#| cold_compile    | main | 46      | PP-YOLOE-s recipe, --compile, empty cache, 2 workers x 8 threads | what is left: the first step (eager, ~20 s) and
#|                 |      |         | (16 cores): time to the first step and to each graph compiled    | the graphs done by then; all 30 (15 sizes x 2
#|                 |      |         | within the limit (bench/compile_timeline.py)                     | variants) take ~26 min at 103 s/graph/worker
#
# The GPU estimates come from the one H200 run so far (../shared/GPU.md: one PP-YOLOE-s
# inductor graph 103 s cold at batch 64, 144 s at 128; capture 7 s; the build 11 s), not from
# this script: bench/README.md has the CPU rehearsal's seconds. Time a part does not use goes
# to cold_compile, the last part, which takes what is left of the budget.
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

# --- precompile (side lane): every graph the timed parts and the trainer runs use, each in
# its own process, several at a time, each job cut at the part's deadline.
CPUS=$(nproc)
GPU_MB=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 20 if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
# What each precompile job's compiled step should hold on the GPU, GiB, with room to spare
# (bench/memory_estimate.py --gpu-check, run on the CPU 2026-12-07: its eager bf16 step on
# fake tensors, scaled by the H200's measured PP-YOLOE-s figures). bench/run_jobs.py starts
# jobs while their sum, plus 1 GiB each for the CUDA context, fits in the GPU's memory less
# 12 GiB for the main lane (the 4 trainer runs, the GPU tests).
declare -A JOB_GIB=([step_ppyoloe]=12 [step_yolox]=13 [step_ppyolo]=28 [step_fcos]=16 [step_b128]=23
                    [train_ppyoloe]=1 [train_yolox]=1 [train_ppyolo]=1 [train_fcos]=1)
if [[ $DEVICE == cpu ]]; then
    JOBS_AT_ONCE=2 MEM_GIB=0  # the rehearsal: no GPU memory to share
elif (( GPU_MB < 100000 )); then
    JOBS_AT_ONCE=5 MEM_GIB=$(( GPU_MB / 1024 - 12 ))  # an H100's 80 GB: 67 GiB for the jobs
else
    JOBS_AT_ONCE=9 MEM_GIB=$(( GPU_MB / 1024 - 12 ))
fi
PRE_PID=
if wanted precompile; then
    PRE_LIM=$(allowed precompile)
    if [[ -z "$PRE_LIM" ]]; then
        skip precompile "the budget of ${BUDGET}s is spent"
    else
        mkdir -p "$OUT_DIR/precompile"
        JOBFILE="$OUT_DIR/precompile/jobs.tsv"
        : > "$JOBFILE"
        # Bench graphs first (PP-YOLOE's batch 64 feeds two timed parts and the profile),
        # then the trainer runs', then batch 128 (the slowest, 144 s on the H200).
        # Only the graphs of the parts this run has (profile's is step_ppyoloe's).
        # --overwrite: OUT_DIR is this script's; a rerun into the same OUT_DIR replaces its
        # own results there, as it does its record (throughput.py refuses that unasked).
        for p in step_ppyoloe step_yolox step_ppyolo step_fcos; do
            if wanted "$p" || { [[ $p == step_ppyoloe ]] && wanted profile; }; then
                printf '%s\t%s\t%s\n' "$p" "${JOB_GIB[$p]}" "$PY ${STEP_CMD[$p]} --precompile --json $OUT_DIR/precompile/$p.json --overwrite" >> "$JOBFILE"
            fi
        done
        if wanted train; then
            for fam in "${FAMILIES[@]}"; do
                printf '%s\t%s\t%s\n' "train_${fam%%:*}" "${JOB_GIB[train_${fam%%:*}]}" \
                    "$PY -m fastdet.compile $(train_flags "${fam%%:*}" "${fam#*:}") --output-dir $OUT_DIR/train/${fam%%:*}" >> "$JOBFILE"
            done
        fi
        if wanted step_b128; then
            printf '%s\t%s\t%s\n' step_b128 "${JOB_GIB[step_b128]}" "$PY ${STEP_CMD[step_b128]} --precompile --json $OUT_DIR/precompile/step_b128.json --overwrite" >> "$JOBFILE"
        fi
        DEADLINE=$(( $(date +%s) + PRE_LIM ))
        THREADS=$(( CPUS / JOBS_AT_ONCE )); (( THREADS < 1 )) && THREADS=1
        MEM_NOTE="no GPU memory to share"
        (( MEM_GIB > 0 )) && MEM_NOTE="within $MEM_GIB GiB of GPU memory"
        note "precompile: start (limit ${PRE_LIM}s, side lane): $(wc -l < "$JOBFILE") jobs, at most $JOBS_AT_ONCE at once x $THREADS compile threads, $MEM_NOTE"
        T_PRE=$(date +%s)
        # The jobs share the cores; inductor's cache key leaves compile_threads out, so the
        # timed parts (default threads) still hit these entries. Its decisions: jobs.log.
        TORCHINDUCTOR_COMPILE_THREADS=$THREADS "$PY" "$REPO/bench/run_jobs.py" "$JOBFILE" --deadline "$DEADLINE" \
            --logs "$OUT_DIR/precompile" --done "$OUT_DIR/precompile/done.tsv" --max-parallel "$JOBS_AT_ONCE" \
            --memory-gib "$MEM_GIB" > "$OUT_DIR/precompile/jobs.log" 2>&1 &
        PRE_PID=$!
    fi
fi

# --- the GPU tests, one pytest run and one JUnit file per part, each test under its own
# timeout; they run while precompile compiles.
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
# compiled, then 40 steps and the final COCO evaluation. A trainer starts once precompile's
# job for it has ended: its graphs are then in the cache (one that ended otherwise is not
# started, saying why). Started before, its warm-up compiles them itself, cold: ~90 s a graph
# on the GPU host alone (FCOS has 3), more than this part's limit, and four such compiles
# beside the precompile lane's would take its cores and cost the timed parts their graphs.
# Checkpoints are deleted before packing; the log, config and metrics.jsonl stay.
# job_end NAME: the exit code of precompile's job NAME once it ended, "-" if it was never
# started, nothing while it runs (bench/run_jobs.py's done file).
job_end() {
    local line
    line=$(grep -m1 -E "^$1("$'\t'"| not started)" "$OUT_DIR/precompile/done.tsv" 2>/dev/null) || return 0
    if [[ $line == *"not started"* ]]; then echo "-"; else echo "$line" | cut -f2; fi
}
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
    find "$OUT_DIR/train" -name '*.pth' -delete
    return $rc
}
if (( HAVE_COCO )); then
    export -f train_all train_flags job_end
    # On the CPU (the rehearsal) the trainers' eager backend has no graphs in a cache to wait
    # for: waiting there only lengthens the rehearsal (GPU_CHECK_TRAIN_WAITS=1 asks for it).
    if [[ -n "$PRE_PID" ]] && [[ ${GPU_CHECK_TRAIN_WAITS:-$([[ $DEVICE == cuda ]] && echo 1)} == 1 ]]; then
        export TRAIN_AFTER_PRECOMPILE=1
    fi
    export PY OUT_DIR DEVICE TRAIN_STEPS TRAIN_SIZE TRAIN_BATCH LOADER
    export FAMILIES_LIST="${FAMILIES[*]}"
    part train bash -c 'FAMILIES=($FAMILIES_LIST); TRAIN_GPU=('"${TRAIN_GPU[*]}"'); TRAIN_BACKEND=('"${TRAIN_BACKEND[*]}"'); train_all'
else
    skip train "pycocotools is not importable ($COCO_WHY): the trainer's final COCO evaluation needs it (carry its wheel: bench/README.md)"
fi

# --- join_precompile: wait for the side lane. Every job is cut at precompile's deadline,
# which the plan puts inside the window of the main parts up to this one (the test asserts
# it): main parts that end early leave the graphs that time, never the budget more.
if [[ -n "$PRE_PID" ]]; then
    t0=$(date +%s)
    wait "$PRE_PID" 2>/dev/null
    pre_rc=0
    [[ -f "$OUT_DIR/precompile/done.tsv" ]] || : > "$OUT_DIR/precompile/done.tsv"
    while IFS=$'\t' read -r job rc secs; do
        note "precompile: $job exit ${rc:-?} in ${secs:-?}s"
        [[ "${rc:-1}" == 0 ]] || pre_rc=1
    done < "$OUT_DIR/precompile/done.tsv"
    (( $(wc -l < "$OUT_DIR/precompile/done.tsv") < $(wc -l < "$JOBFILE") )) && pre_rc=124
    cat "$OUT_DIR"/precompile/*.log > "$OUT_DIR/precompile.log" 2>/dev/null
    finish precompile "$pre_rc" "$T_PRE" "$PRE_LIM"
    status_line join_precompile ok 0 "$(( $(date +%s) - t0 ))" "" "$(limit join_precompile)" main
    record
else
    skip join_precompile "precompile did not run"
fi

# --- the timed parts: every family's compiled + captured step at its published shape and
# box padding, PP-YOLOE-s's other rows, batch 128; then the profile from the same cache.
for p in "${STEP_PARTS[@]}"; do
    # shellcheck disable=SC2086
    part "$p" "$PY" ${STEP_CMD[$p]} --json "$OUT_DIR/${STEM}_throughput-${p#step_}.json" --overwrite
done
# shellcheck disable=SC2086
part profile "$PY" $PROFILE_CMD --out "$OUT_DIR/profile"

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
