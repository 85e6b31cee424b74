#!/usr/bin/env bash
# The DALI call (issue 42, item 3): the last of bench/dali_carry.sh's back-to-back calls, on
# the machine that ran bench/gpu_check.sh if it is still warm (its inductor cache then serves
# the compiled steps). It installs the carried DALI and measures, for every family:
#
# - the DALI GPU pipeline alone (img/s, host threads, GPU memory) beside the torch loader with
#   16 workers, and nvJPEG's batched decode against the CPU decoder on a sample
#   (bench/dali_check.py --device cuda; the check is skipped, saying so, where the tree lacks it);
# - end to end with the compiled, captured step, DALI and the torch loader (16 workers) in
#   the same run (bench/throughput.py --modes data_torch,data_dali,e2e_torch,e2e_dali).
#
#   bench/gpu_check_dali.sh [OUT_DIR]      # under the device tool: packed into $OUT/gpu_check_dali.tgz
#   bench/gpu_check_dali.sh --plan         # the plan as JSON
#   bench/gpu_check_dali.sh --rehearse     # on this CPU, tiny sizes, limits x10
#
#| part            | lane | limit_s | returns                                                          | GPU estimate (source)
#| dali_install    | main | 45      | the pieces' sha256 checked, joined, DALI + pycocotools installed | ~20 s: 257 MB of wheels, pip --no-deps (estimate)
#|                 |      |         | into /tmp/site (or why not: which piece is missing)              |
#| env             | main | 10      | GPU, versions, DALI importable                                   | ~5 s (GPU.md)
#| build           | main | 30      | the extension (already built when the machine is warm)           | 1-11 s (GPU.md)
#| precompile      | side | 230     | every family's e2e graphs: each loader canvas (FCOS: 3); the     | ~0 s warm for 3 families; FCOS's 2 new canvases
#|                 |      |         | demo set of the e2e rows (2048 images)                           | ~150 s in parallel (GPU.md's 103 s per graph)
#| dali_check      | main | 150     | per family: DALI GPU pipeline alone (img/s, host threads, GPU    | ~120 s: 8 rows, a process each, plus the decode
#|                 |      |         | memory), torch loader 16 workers; nvJPEG = CPU decoder check     | check (estimate)
#| tests_triton    | main | 60      | pytest -m gpu on the captured steps with the Triton kernels      | ~60 s (estimate, 2026-12-04 plan)
#| join_precompile | main | 20      | waits for precompile                                             | 0-20 s
#| e2e_ppyoloe     | main | 60      | PP-YOLOE-s 640 b64: data torch/DALI, e2e torch/DALI + compiled   | ~50 s (estimate)
#|                 |      |         | captured step, 16 workers                                        |
#| e2e_yolox       | main | 45      | YOLOX-s 640 b64, 120 boxes: the same four rows                   | ~45 s (estimate)
#| e2e_ppyolo      | main | 45      | PP-YOLO r50vd_dcn 608 b64, 50 boxes: the same four rows          | ~45 s (estimate)
#| e2e_fcos        | main | 45      | FCOS r50 800x1344 canvases b16: the same four rows               | ~45 s (estimate)
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
SELF="$REPO/bench/gpu_check_dali.sh"
KIND=gpu-check-dali
MODE=run
case "${1:-}" in
    --plan) MODE=plan; shift ;;
    --rehearse) MODE=rehearse; shift ;;
esac
PY=${PYTHON:-python3}
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
# shellcheck source=bench/gpu_check_lib.sh
source "$REPO/bench/gpu_check_lib.sh"
BUDGET=${GPU_CHECK_BUDGET_S:-540}
SCALE=${GPU_CHECK_LIMIT_SCALE:-1}
[[ $MODE == rehearse ]] && SCALE=${GPU_CHECK_LIMIT_SCALE:-10}
PARTS=${GPU_CHECK_PARTS:-$(plan_parts)}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
[[ $MODE == rehearse ]] && DEVICE=cpu
DALI_CHECK=${GPU_CHECK_DALI_CHECK:-bench/dali_check.py}

if [[ $DEVICE == cpu ]]; then
    E2E_ARGS=(--device cpu --quick --img-size 64 --windows 1 --iters 1 --warmup 0 --compile-backend eager
              --workers 2 --e2e-step compile)
    E2E_FCOS=(--img-size 128)
    DALI_ARGS=(--device cpu --quick)
    BATCH=2 BATCH_FCOS=2 DEMO_IMAGES=64
    PYTEST_SELECT=(--collect-only -q)
else
    E2E_ARGS=(--device cuda --windows 3 --iters 10 --warmup 3 --workers 16)
    E2E_FCOS=()
    DALI_ARGS=(--device cuda --workers 16)
    BATCH=64 BATCH_FCOS=16 DEMO_IMAGES=2048
    PYTEST_SELECT=(-m gpu -v)
fi
MODES=data_torch,data_dali,e2e_torch,e2e_dali
declare -A E2E_CMD=(
    [e2e_ppyoloe]="bench/throughput.py ${E2E_ARGS[*]} --arch ppyoloe --size s --batch-size $BATCH --modes $MODES"
    [e2e_yolox]="bench/throughput.py ${E2E_ARGS[*]} --arch yolox --size s --batch-size $BATCH --modes $MODES"
    [e2e_ppyolo]="bench/throughput.py ${E2E_ARGS[*]} --arch ppyolo --size r50vd_dcn --batch-size $BATCH --modes $MODES"
    [e2e_fcos]="bench/throughput.py ${E2E_ARGS[*]} ${E2E_FCOS[*]} --arch fcos --size r50 --batch-size $BATCH_FCOS --modes $MODES"
)
E2E_PARTS=(e2e_ppyoloe e2e_yolox e2e_ppyolo e2e_fcos)

if [[ $MODE == plan ]]; then
    PLAN_CMDS=$(for p in "${E2E_PARTS[@]}"; do printf '%s\t%s --demo-images %s\n' "$p" "${E2E_CMD[$p]}" "$DEMO_IMAGES"; done
                printf 'dali_check\t%s %s\n' "$DALI_CHECK" "${DALI_ARGS[*]}") \
        print_plan
    exit 0
fi

WORK_ROOT=${TMPDIR:-/tmp}/fastdet-gpu-check  # bench/gpu_check.sh's: its caches serve this call
start_run dali gpu-check-dali "${1:-}"
note "repo $REPO, output $OUT_DIR, budget ${BUDGET}s, mode $MODE, device $DEVICE, parts $PARTS"

# --- dali_install: the pieces bench/dali_carry.sh staged, one a call, into /tmp/dali.
# shellcheck disable=SC2016
install_dali='
set -e
site=${DALI_SITE:-/tmp/site}
mkdir -p "$site"
for w in .whl/pycocotools-*.whl; do
    [[ -e $w ]] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$w"
done
pieces=${DALI_PIECES:-/tmp/dali}
if [[ ! -f $pieces/SHA256SUMS ]]; then
    echo "no DALI pieces in $pieces (bench/dali_carry.sh): the DALI rows skip"
    exit 0
fi
cd "$pieces"
missing=$(awk "{print \$2}" SHA256SUMS | while read -r f; do [[ -f $f ]] || echo "$f"; done)
[[ -z $missing ]] || { echo "missing piece(s): $missing (a call was lost: stage them again)"; exit 3; }
sha256sum -c SHA256SUMS
mkdir -p wheels
cat dali.tar.part-* | tar xf - -C wheels
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" wheels/*.whl
ls wheels
'
if [[ $MODE == rehearse ]]; then
    part dali_install env DALI_SITE="$WORK_ROOT/site" DALI_PIECES="${DALI_PIECES:-$WORK_ROOT/no-pieces}" bash -c "$install_dali"
else
    part dali_install bash -c "$install_dali"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

T_ENV=$(date +%s)
STEM=$("$PY" - "$OUT_DIR/env.json" <<'EOF' 2>"$OUT_DIR/env.err"
import sys, torch
sys.path.insert(0, ".")
from bench.common import env_info, result_stem, write_json
env = env_info(torch.device("cuda" if torch.cuda.is_available() else "cpu"), with_ops=False)
write_json(sys.argv[1], env)
print(result_stem(env, "x")[:-2])
EOF
)
[[ -z "$STEM" ]] && STEM="$(date -u +%Y-%m-%d)_unknown"
[[ $MODE == rehearse ]] && STEM="${STEM}_rehearsal"
if why=$(import_error nvidia.dali); then
    note "nvidia.dali: installed"
else
    note "nvidia.dali: NOT importable ($why): the DALI rows skip with the reason"
fi
if wanted env; then
    status_line env ok 0 "$(( $(date +%s) - T_ENV ))" "" "$(limit env)" main
    record
fi
if ! (cd /tmp && "$PY" -c "import fastdet._csrc" > /dev/null 2>&1); then
    "$PY" -m pip install --no-deps --no-index --no-build-isolation -q -e "$REPO" > "$OUT_DIR/install.log" 2>&1 \
        || note "install: pip could not install fastdet (install.log)"
fi
if [[ $DEVICE == cpu ]]; then
    part build "$PY" -c "from fastdet.ops import dispatch; print(dispatch.__name__)"
else
    part build "$PY" -m fastdet.ops.build
fi

# --- precompile (side lane): each family's e2e graphs, every canvas its loader yields.
PRE_PID=
if wanted precompile && [[ -n "$(allowed precompile)" ]]; then
    PRE_LIM=$(allowed precompile)
    T_PRE=$(date +%s)
    mkdir -p "$OUT_DIR/precompile"
    note "precompile: start (limit ${PRE_LIM}s, side lane)"
    (
        # The demo set the e2e rows read, made beside the compiles (they need no data).
        timeout -k 5 "$PRE_LIM" "$PY" bench/throughput.py --prepare-data --device cpu --demo-images "$DEMO_IMAGES" \
            > "$OUT_DIR/precompile/prepare_data.log" 2>&1 &
        pids=($!)
        for p in "${E2E_PARTS[@]}"; do
            wanted "$p" || continue
            # shellcheck disable=SC2086
            # --overwrite: OUT_DIR is this script's; a rerun into the same OUT_DIR replaces
            # its own results there, as it does its record.
            timeout -k 5 "$PRE_LIM" "$PY" ${E2E_CMD[$p]} --demo-images "$DEMO_IMAGES" --precompile \
                --json "$OUT_DIR/precompile/$p.json" --overwrite > "$OUT_DIR/precompile/$p.log" 2>&1 &
            pids+=($!)
        done
        rc=0
        for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
        exit $rc
    ) &
    PRE_PID=$!
else
    skip precompile "not asked for, or the budget is spent"
fi

if [[ -f $DALI_CHECK ]]; then
    part dali_check "$PY" "$DALI_CHECK" "${DALI_ARGS[@]}" --json "$OUT_DIR/${STEM}_dali-check.json"
else
    skip dali_check "$DALI_CHECK is not in this tree: the pipeline-alone rows and the decode check need it"
fi
if [[ $DEVICE == cuda ]] && "$PY" -c "import pytest_timeout" > /dev/null 2>&1; then
    PYTEST_SELECT+=(--timeout 60)
fi
part tests_triton env FASTDET_OPS_BACKEND=triton "$PY" -m pytest "${PYTEST_SELECT[@]}" -p no:cacheprovider -o addopts="" -ra \
    --junitxml="$OUT_DIR/pytest_tests_triton.xml" tests/test_gpu_capture.py tests/test_gpu_step.py \
    -k "not test_compiled_graph_step_at_benchmark_size_trains_like_eager"

# join_precompile: every job is cut at precompile's deadline, inside the main parts' window.
if [[ -n "$PRE_PID" ]]; then
    t0=$(date +%s)
    wait "$PRE_PID"
    pre_rc=$?
    cat "$OUT_DIR"/precompile/*.log > "$OUT_DIR/precompile.log" 2>/dev/null
    finish precompile "$pre_rc" "$T_PRE" "$PRE_LIM"
    status_line join_precompile ok 0 "$(( $(date +%s) - t0 ))" "" "$(limit join_precompile)" main
    record
fi

for p in "${E2E_PARTS[@]}"; do
    # shellcheck disable=SC2086
    part "$p" "$PY" ${E2E_CMD[$p]} --demo-images "$DEMO_IMAGES" --json "$OUT_DIR/${STEM}_throughput-${p}.json" --overwrite
done

note "done in $(elapsed)s; results in $OUT_DIR${PACK_TO:+ (packed into $PACK_TO/gpu_check_dali.tgz)}"
record
rm -f "$STATUS"
