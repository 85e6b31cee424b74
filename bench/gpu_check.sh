#!/usr/bin/env bash
# The GPU check: one command for a bare GPU machine (torch, no network, maybe no DALI or
# pycocotools), built to fit the device tool's 540 s and to keep what it measured if cut.
#
#   bench/gpu_check.sh [OUT_DIR]   # default: bench/results/gpu-check-<UTC time>; under the
#                                  # device tool ($OUT set, no OUT_DIR) a work folder in $TMPDIR,
#                                  # packed into $OUT after every part
#
# Parts, most valuable first. Each has its own timeout inside one overall budget (a part
# that no longer fits is skipped and says so) and writes its log, and for pytest parts its
# own JUnit XML, as it goes. After every part the record <stem>_gpu-check.json (each part:
# ran or not, ok / failed / timeout / skipped, why, exit code, seconds; the parts never
# reached) and summary.txt are rewritten and, under the device tool, everything is packed
# again into $OUT/gpu_check.tgz (the tool brings back at most 8 files): a run cut short
# keeps every part it finished. A part that needs a missing package (pycocotools) is
# skipped with the reason, never failed; without DALI the torch loader is used.
#
#   part            what                                                     H200, expected
#   env             GPU, driver, versions; DALI / pycocotools present?        ~5 s
#   install         pip install -e . (no network, no deps) when needed        ~15 s
#   build           the CUDA variant of the extension (fastdet.ops.build;     11 s (measured 2026-12-04)
#                   exit 2 = a GPU but no CUDA toolkit)
#   tests_kernels   pytest -m gpu on the kernel files, by name: IoU, EMA,     ~30 s
#                   assigners, yolo_targets, FCOS, SimOTA
#   tests_capture   every family's whole step captured and replayed against   ~60 s
#                   eager under sync-debug (tests/test_gpu_capture.py), the
#                   PP-YOLOE graph tests (tests/test_gpu_step.py) but its
#                   inductor test
#   tests_triton    the same with FASTDET_OPS_BACKEND=triton                  ~60 s
#   smoke           the trainer as a user runs it: --compile --cuda-graphs    ~100-120 s (2 graphs
#                   --sync-debug, channels-last, freeze_bn, ONE size x ONE     took 180 s)
#                   loss variant (one inductor graph), then COCO eval
#   smoke_ddp       one NCCL rank under torchrun: DDP in the captured step    ~40 s
#   step            bench/throughput.py --modes step (PPYOLOE-s 640 b64)      ~150 s (103 s compile)
#   tests_inductor  the whole-model inductor test (640, b64), after `step`    ~30 s (a warm cache)
#                   has put the same graph in inductor's cache
#   kernels         bench/kernels.py                                          ~60 s
#   profile         bench/profile_step.py (PPYOLOE-s 640 b64: eager fp32 /    ~90 s (graphs from
#                   bf16, compiled, + CUDA graphs): time by category, top      inductor's cache)
#                   kernels, TFLOP/s vs a bf16 matmul, Perfetto traces
#   data_e2e        bench/throughput.py --modes data,e2e                      what is left
#   layout          bench/throughput.py --modes layout                        what is left
#
# Those GPU times are estimates from the one H200 run so far (../shared/GPU.md), not
# measurements of this script; bench/README.md gives each part's time in a CPU rehearsal.
#
# Wheels for the bare machine (the device README's recipe; cp312, manylinux), made once in
# the repository root on a machine with pip:
#
#   echo /.whl/ >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   python3 -m pip download $P -d .whl pycocotools                        # 0.4 MB: every call
#   python3 -m pip download $P -d /tmp/dali nvidia-dali-cuda130==2.4.0 nvidia-libnvcomp-cu13 \
#       nvidia-nvimgcodec-cu13 nvidia-nvjpeg2k-cu13 nvidia-nvjpeg nvidia-nvtiff-cu13 nvtx libcst \
#       optree gast makefun astunparse                                      # 257 MB in all
#   (cd /tmp/dali && tar cf - *.whl | split -b 55M - dali.tar.part-)       # five < 60 MiB pieces
#   mkdir -p .whl/dali-parts && mv /tmp/dali/dali.tar.part-* .whl/dali-parts/
#   (cd .whl/dali-parts && sha256sum dali.tar.part-* > SHA256SUMS)
#
# A call carries 64 MiB, so DALI travels in five calls on one warm machine: before call k,
# keep only piece k (and SHA256SUMS) in .whl/dali-parts; each call (carry [".whl"]) begins
#
#   mkdir -p /tmp/dali && cp .whl/dali-parts/* /tmp/dali/ &&
#
# and the fifth then joins, checks and installs them before the check:
#
#   (cd /tmp/dali && sha256sum -c SHA256SUMS && cat dali.tar.part-* | tar xf - &&
#    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site *.whl) &&
#
# Every call that runs the check (pycocotools alone is enough for every part but DALI's):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pycocotools-*.whl &&
#   export PYTHONPATH=/tmp/site && bench/gpu_check.sh
#
# Environment:
#   GPU_CHECK_BUDGET_S   overall seconds (default 540: the run ends inside the tool's 10 minutes)
#   GPU_CHECK_PARTS      comma list of the parts above (default: all, in the order above)
#   GPU_CHECK_TEST_TIMEOUT_S  seconds per GPU test (default 120; needs pytest-timeout)
#   PYTHON               the interpreter holding torch (default python3)
#   FASTDET_GIT_COMMIT   the commit of this tree, recorded where the copy has no .git
#   GPU_CHECK_DEVICE     cuda (default); cpu rehearses the script on a machine without a
#                        GPU (benchmarks in their --quick configuration, GPU tests skip)
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # parts cd elsewhere
# Under the device tool only 8 files come back from $OUT: work in $TMPDIR, pack into $OUT.
WORK_ROOT=${TMPDIR:-/tmp}/fastdet-gpu-check
PACK_TO=
if [[ -z "${1:-}" && -n "${OUT:-}" ]]; then
    PACK_TO=$OUT
    OUT_DIR=$WORK_ROOT/out-$(date -u +%Y%m%dT%H%M%SZ)
else
    OUT_DIR=${1:-$REPO/bench/results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
fi
BUDGET=${GPU_CHECK_BUDGET_S:-540}
PARTS=${GPU_CHECK_PARTS:-env,install,build,tests_kernels,tests_capture,tests_triton,smoke,smoke_ddp,step,tests_inductor,kernels,profile,data_e2e,layout}
DEMO_IMAGES=4096
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BENCH_ARGS=(--device "$DEVICE")
[[ "$DEVICE" == cpu ]] && BENCH_ARGS+=(--quick) && DEMO_IMAGES=400
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
START=$(date +%s)
STATUS="$OUT_DIR/.parts.tsv"
: > "$STATUS"

export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# Kept out of OUT_DIR (large files), shared by all parts so a graph compiled by `step`
# is loaded from inductor's cache by `tests_inductor` and `data_e2e`.
export FASTDET_EXT_DIR=${FASTDET_EXT_DIR:-$WORK_ROOT/ext}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK_ROOT/inductor}
mkdir -p "$FASTDET_EXT_DIR" "$TORCHINDUCTOR_CACHE_DIR"

elapsed() { echo $(( $(date +%s) - START )); }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }
note() { echo "[gpu_check $(elapsed)s] $*" | tee -a "$OUT_DIR/summary.txt"; }

# record: (re)write <stem>_gpu-check.json from the parts done so far (which ran, which did
# not and why, which were never reached), and under the device tool pack it all into $OUT.
record() {
    "$PY" - "$STATUS" "$OUT_DIR/${STEM:-unknown}_gpu-check.json" "$BUDGET" "$(elapsed)" "${STEM:-unknown}" \
        "$PARTS" <<'EOF'
import json, sys
status, out, budget, elapsed, stem, wanted = sys.argv[1:]
parts = []
for line in open(status):
    name, st, rc, secs, why = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
    parts.append({"part": name, "ran": st != "skipped", "status": st, "exit": int(rc) if rc else None,
                  "seconds": int(secs or 0), "why": why or None})
done = {p["part"] for p in parts}
json.dump({"schema": "fastdet.bench/1", "kind": "gpu_check", "stem": stem, "budget_s": int(budget),
           "elapsed_s": int(elapsed), "parts": parts,
           "not_reached": [p for p in wanted.split(",") if p and p not in done]}, open(out, "w"), indent=1)
EOF
    if [[ -n "$PACK_TO" ]]; then
        tar czf "$PACK_TO/gpu_check.tgz.tmp" -C "$OUT_DIR" . 2>/dev/null \
            && mv "$PACK_TO/gpu_check.tgz.tmp" "$PACK_TO/gpu_check.tgz"
        cp "$OUT_DIR/summary.txt" "$PACK_TO/summary.txt" 2>/dev/null
        cp "$OUT_DIR/${STEM:-unknown}_gpu-check.json" "$PACK_TO/gpu-check.json" 2>/dev/null
    fi
    return 0
}

# skip NAME WHY: record a part that does not run, and why.
skip() {
    wanted "$1" || return 0
    note "$1: skipped: $2"
    printf '%s\tskipped\t\t0\t%s\n' "$1" "$2" >> "$STATUS"
    record
}

# part NAME TIMEOUT_S CMD...: run CMD with min(TIMEOUT_S, what is left of the budget).
part() {
    local name=$1 limit=$2
    shift 2
    if ! wanted "$name"; then
        return 0
    fi
    local left=$(( BUDGET - $(elapsed) - 5 ))
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then
        skip "$name" "the budget of ${BUDGET}s is spent"
        return 0
    fi
    note "$name: start (limit ${limit}s): $*"
    local t0 rc status why=
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    status=ok
    (( rc == 124 || rc == 137 )) && status=timeout && why="cut at its limit of ${limit}s"
    (( rc != 0 && rc != 124 && rc != 137 )) && status=failed
    note "$name: $status (exit $rc, $(( $(date +%s) - t0 ))s); log $name.log"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$why" >> "$STATUS"
    tail -n 25 "$OUT_DIR/$name.log" | sed 's/^/    /' >> "$OUT_DIR/summary.txt"
    record
    return 0
}

note "repo $REPO, output $OUT_DIR, budget ${BUDGET}s, parts $PARTS"

# --- env: what this machine is; the stem of every result file.
if wanted env; then
    { nvidia-smi || echo "nvidia-smi failed"; } > "$OUT_DIR/nvidia-smi.txt" 2>&1
fi
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
note "result stem: $STEM"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))" 2>&1 | tee -a "$OUT_DIR/summary.txt"
HAVE_DALI=0 HAVE_COCO=0
for mod in nvidia.dali pycocotools triton pytest_timeout; do
    if "$PY" -c "import $mod" > /dev/null 2>&1; then
        note "$mod: installed"
        [[ $mod == nvidia.dali ]] && HAVE_DALI=1
        [[ $mod == pycocotools ]] && HAVE_COCO=1
    else
        note "$mod: NOT installed here (the parts that need it skip or fall back, with a note)"
    fi
done

# --- install: make fastdet (with its package data) importable.
if wanted install; then
    if (cd /tmp && "$PY" -c "import fastdet._csrc, fastdet.ops" > /dev/null 2>&1); then
        note "install: fastdet already importable"
    else
        part install 120 "$PY" -m pip install --no-deps --no-index --no-build-isolation -q -e "$REPO"
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

# The data set of data_e2e, generated on the CPU while the GPU parts run.
PREP_PID=
if wanted data_e2e; then
    "$PY" bench/throughput.py --prepare-data --device cpu --demo-images "$DEMO_IMAGES" \
        > "$OUT_DIR/prepare_data.log" 2>&1 &
    PREP_PID=$!
fi

part build 150 "$PY" -m fastdet.ops.build

# The GPU tests, one pytest run and one JUnit file per part (a part cut short keeps the
# XML of the parts before it, and its verbose log has each finished test's result), each
# test under its own timeout. Kernel tests first, by file name; the whole-model inductor
# test last, after `step` has compiled the same graph into inductor's cache.
PYTEST=("$PY" -m pytest -m gpu -v -p no:cacheprovider -o addopts="" -ra)
if "$PY" -c "import pytest_timeout" > /dev/null 2>&1; then
    PYTEST+=(--timeout "${GPU_CHECK_TEST_TIMEOUT_S:-120}")
else
    note "pytest-timeout is not installed: no per-test timeouts, only the part's"
fi
KERNEL_TESTS=(tests/test_ops_gpu.py tests/test_simota_kernels.py tests/test_fcos_assign.py
              tests/test_ops_yolo_targets.py tests/test_ops_ema.py)
INDUCTOR_TEST=test_compiled_graph_step_at_benchmark_size_trains_like_eager
part tests_kernels 120 "${PYTEST[@]}" --junitxml="$OUT_DIR/pytest_tests_kernels.xml" "${KERNEL_TESTS[@]}"
part tests_capture 150 "${PYTEST[@]}" --junitxml="$OUT_DIR/pytest_tests_capture.xml" \
    tests/test_gpu_capture.py tests/test_gpu_step.py -k "not $INDUCTOR_TEST"
part tests_triton 120 env FASTDET_OPS_BACKEND=triton "${PYTEST[@]}" \
    --junitxml="$OUT_DIR/pytest_tests_triton.xml" tests/test_gpu_capture.py tests/test_gpu_step.py \
    -k "not $INDUCTOR_TEST"

# The trainer as a user runs it: one size, one loss variant (ATSS all along: the switch to
# the task-aligned assigner lies beyond the run), so warm-up compiles and captures one
# inductor graph; the demo set has 48 steps per epoch at batch 8.
SMOKE=(--arch ppyoloe --size s --data demo --device "$DEVICE" --epochs 1 --max-steps 30
       --log-interval 10 --set data.train_sizes=256 --set family.static_assigner_epoch=100
       --set run.progress=false)
if (( HAVE_DALI )); then
    SMOKE+=(--loader dali)
else
    note "smoke: DALI is not installed, the smoke runs use the torch loader"
    SMOKE+=(--loader torch)
fi
SMOKE_GPU=()
[[ "$DEVICE" == cuda ]] && SMOKE_GPU=(--cuda-graphs --sync-debug)
[[ "$DEVICE" == cpu ]] && SMOKE+=(--max-steps 2)  # a rehearsal of the script, not a check
if (( HAVE_COCO )); then
    part smoke 200 "$PY" -m fastdet.train "${SMOKE[@]}" "${SMOKE_GPU[@]}" --compile --channels-last \
        --set model.freeze_bn=true --output-dir "$OUT_DIR/smoke"
    part smoke_ddp 90 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m fastdet.train \
        "${SMOKE[@]}" "${SMOKE_GPU[@]}" --output-dir "$OUT_DIR/smoke_ddp"
else
    for p in smoke smoke_ddp; do
        skip "$p" "pycocotools is not installed: the trainer's final COCO evaluation needs it (carry its wheel: see the header)"
    done
fi

part step 200 "$PY" bench/throughput.py "${BENCH_ARGS[@]}" --modes step \
    --json "$OUT_DIR/${STEM}_throughput-step.json"
part tests_inductor 120 "${PYTEST[@]}" --junitxml="$OUT_DIR/pytest_tests_inductor.xml" \
    tests/test_gpu_step.py -k "$INDUCTOR_TEST"
part kernels 100 "$PY" bench/kernels.py "${BENCH_ARGS[@]}" --reps 20 --budget 3 \
    --json "$OUT_DIR/${STEM}_kernels.json"
part profile 120 "$PY" bench/profile_step.py "${BENCH_ARGS[@]}" --steps 3 --out "$OUT_DIR/profile"
if [[ -n "$PREP_PID" ]]; then
    wait "$PREP_PID" || note "prepare data: failed (see prepare_data.log)"
fi
part data_e2e 150 "$PY" bench/throughput.py "${BENCH_ARGS[@]}" --modes data,e2e --demo-images "$DEMO_IMAGES" \
    --json "$OUT_DIR/${STEM}_throughput-data-e2e.json"
part layout 120 "$PY" bench/throughput.py "${BENCH_ARGS[@]}" --modes layout \
    --json "$OUT_DIR/${STEM}_throughput-layout.json"

# --- the record of this run.
note "done in $(elapsed)s; results in $OUT_DIR${PACK_TO:+ (packed into $PACK_TO/gpu_check.tgz)}"
record
rm -f "$STATUS"
