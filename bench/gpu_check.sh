#!/usr/bin/env bash
# The GPU check: one command for a GPU machine, no network needed.
#
#   bench/gpu_check.sh [OUT_DIR]      # default: $OUT, else bench/results/gpu-check-<UTC time>
#
# Parts, most valuable first: what only a GPU can show (the GPU tests, then the trainer
# as a user runs it), then the benchmarks. Each has its own timeout inside one overall
# budget (a part that no longer fits is skipped and says so), and each writes its log
# and JSON under OUT_DIR as it goes, with the run's record rewritten after every part,
# so a run cut short still leaves what it showed:
#
#   env       GPU, driver, versions; which optional packages (DALI, pycocotools) are missing
#   install   `pip install -e .` without network or dependencies when fastdet is not
#             importable as installed (the csrc/ and pipelines/ package data need it)
#   build     the C++/CUDA extension (python -m fastdet.ops.build)
#   tests     pytest -m gpu, verbose, each test under its own timeout, JUnit XML
#             (pytest_gpu.xml): kernels against their references on CUDA, the captured and
#             compiled CUDA-graph steps against eager, graphs of several buckets replayed
#             in alternation, the sync-free step, the Triton ATSS in a capture, no capture
#             after warm-up (tests/test_gpu_step.py, tests/test_ops_gpu.py)
#   smoke     the trainer on the demo set as a user runs it: DALI, --compile --cuda-graphs,
#             two sizes x both loss variants (ATSS in epoch 0, task-aligned in epoch 1),
#             channels-last, freeze_bn, --sync-debug (set_sync_debug_mode("error") around
#             every step after warm-up)
#   smoke_ddp the same through `torchrun --nproc_per_node 1` (one NCCL rank, DDP built on a
#             side stream, SyncBatchNorm, since --compile is off) with --cuda-graphs: DDP's
#             all-reduce inside the captured step (with one rank SyncBatchNorm computes
#             local statistics: its collective is not exercised)
#   tests_triton  tests/test_gpu_step.py again with FASTDET_OPS_BACKEND=triton (every op
#             on its Triton kernel), JUnit XML pytest_gpu_triton.xml
#   step      bench/throughput.py --modes step: PPYOLOE-s, 640, bf16, batch 64, eager fp32 /
#             eager bf16 / compiled / compiled + CUDA graphs
#   kernels   bench/kernels.py at production sizes
#   data_e2e  bench/throughput.py --modes data,e2e on a 4096-image demo set (generated in
#             the background while the GPU parts run); DALI rows say "unavailable" without DALI
#   layout    bench/throughput.py --modes layout: eager fp32 and compiled bf16 in NCHW and in
#             channels-last side by side (what the trainer's --channels-last rests on); last,
#             so it only spends what the budget has left
#
# Environment:
#   GPU_CHECK_BUDGET_S   overall seconds (default 540: the run ends inside 10 minutes)
#   GPU_CHECK_PARTS      comma list of the parts above (default: all, in the order above)
#   GPU_CHECK_TEST_TIMEOUT_S  seconds per GPU test (default 150; needs pytest-timeout)
#   PYTHON               the interpreter holding torch (default python3)
#   FASTDET_GIT_COMMIT   the commit of this tree, recorded where the copy has no .git
#   GPU_CHECK_DEVICE     cuda (default); cpu rehearses the script on a machine without a
#                        GPU (benchmarks in their --quick configuration, GPU tests skip)
#
# Outputs (OUT_DIR): <stem>_<part>.json (stem = date_gpu_torch-version, the name they
# take in bench/results/, see bench/results/README.md), <part>.log, pytest_gpu.xml,
# pytest_gpu_triton.xml, smoke/ and smoke_ddp/ (the runs' metrics.jsonl, eval.jsonl),
# env.json, <stem>_gpu-check.json (each part's status, exit code and seconds, rewritten
# after every part), summary.txt.
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # parts cd elsewhere
OUT_DIR=${1:-${OUT:-$REPO/bench/results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
PARTS=${GPU_CHECK_PARTS:-env,install,build,tests,smoke,smoke_ddp,tests_triton,step,kernels,data_e2e,layout}
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
# is loaded from inductor's cache by `tests` and `data_e2e`.
export FASTDET_EXT_DIR=${FASTDET_EXT_DIR:-/tmp/fastdet-gpu-check/ext}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fastdet-gpu-check/inductor}
mkdir -p "$FASTDET_EXT_DIR" "$TORCHINDUCTOR_CACHE_DIR"

elapsed() { echo $(( $(date +%s) - START )); }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }
note() { echo "[gpu_check $(elapsed)s] $*" | tee -a "$OUT_DIR/summary.txt"; }

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
        note "$name: skipped, the budget of ${BUDGET}s is spent"
        printf '%s\tskipped\t\t0\n' "$name" >> "$STATUS"
        return 0
    fi
    note "$name: start (limit ${limit}s): $*"
    local t0 rc status
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    status=ok
    (( rc == 124 || rc == 137 )) && status=timeout
    (( rc != 0 && rc != 124 && rc != 137 )) && status=failed
    note "$name: $status (exit $rc, $(( $(date +%s) - t0 ))s); log $name.log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" >> "$STATUS"
    tail -n 25 "$OUT_DIR/$name.log" | sed 's/^/    /' >> "$OUT_DIR/summary.txt"
    record
    return 0
}

# record: (re)write <stem>_gpu-check.json from the parts done so far.
record() {
    "$PY" - "$STATUS" "$OUT_DIR/${STEM:-unknown}_gpu-check.json" "$BUDGET" "$(elapsed)" "${STEM:-unknown}" <<'EOF'
import json, sys
status, out, budget, elapsed, stem = sys.argv[1:]
parts = []
for line in open(status):
    name, st, rc, secs = line.rstrip("\n").split("\t")
    parts.append({"part": name, "status": st, "exit": int(rc) if rc else None, "seconds": int(secs)})
json.dump({"schema": "fastdet.bench/1", "kind": "gpu_check", "stem": stem, "budget_s": int(budget),
           "elapsed_s": int(elapsed), "parts": parts}, open(out, "w"), indent=1)
EOF
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
for mod in nvidia.dali pycocotools triton; do
    if "$PY" -c "import $mod" > /dev/null 2>&1; then
        note "$mod: installed"
    else
        note "$mod: NOT installed here (the parts that need it skip with a note)"
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

part build 240 "$PY" -m fastdet.ops.build

# The GPU tests: verbose (each test's result is in the log as it finishes, even if the
# part is cut short before pytest writes its XML), each under its own timeout.
PYTEST=("$PY" -m pytest -m gpu -v -p no:cacheprovider --continue-on-collection-errors -o addopts="" -ra)
if "$PY" -c "import pytest_timeout" > /dev/null 2>&1; then
    PYTEST+=(--timeout "${GPU_CHECK_TEST_TIMEOUT_S:-150}")
else
    note "pytest-timeout is not installed: no per-test timeouts, only the part's"
fi
part tests 240 "${PYTEST[@]}" --junitxml="$OUT_DIR/pytest_gpu.xml" tests

# The trainer as a user runs it. Two sizes, and both loss variants: ATSS in epoch 0, the
# task-aligned assigner from epoch 1 (the demo set: 48 steps per epoch at batch 8, so
# 60 steps reach epoch 1; warm-up compiles and captures all 4 buckets first).
SMOKE=(--arch ppyoloe --size s --data demo --device "$DEVICE" --epochs 2 --max-steps 60
       --log-interval 12 --set data.train_sizes=192,256 --set family.static_assigner_epoch=1
       --set run.progress=false)
if "$PY" -c "import nvidia.dali" > /dev/null 2>&1; then
    SMOKE+=(--loader dali)
else
    note "smoke: DALI is not installed, the smoke runs use the torch loader"
fi
SMOKE_GPU=()
[[ "$DEVICE" == cuda ]] && SMOKE_GPU=(--cuda-graphs --sync-debug)
[[ "$DEVICE" == cpu ]] && SMOKE+=(--max-steps 2)  # a rehearsal of the script, not a check
part smoke 240 "$PY" -m fastdet.train "${SMOKE[@]}" "${SMOKE_GPU[@]}" --compile --channels-last \
    --set model.freeze_bn=true --output-dir "$OUT_DIR/smoke"
part smoke_ddp 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m fastdet.train \
    "${SMOKE[@]}" "${SMOKE_GPU[@]}" --output-dir "$OUT_DIR/smoke_ddp"
part tests_triton 150 env FASTDET_OPS_BACKEND=triton "${PYTEST[@]}" \
    --junitxml="$OUT_DIR/pytest_gpu_triton.xml" tests/test_gpu_step.py

part step 300 "$PY" bench/throughput.py "${BENCH_ARGS[@]}" --modes step \
    --json "$OUT_DIR/${STEM}_throughput-step.json"
part kernels 150 "$PY" bench/kernels.py "${BENCH_ARGS[@]}" --reps 20 --budget 3 \
    --json "$OUT_DIR/${STEM}_kernels.json"
if [[ -n "$PREP_PID" ]]; then
    wait "$PREP_PID" || note "prepare data: failed (see prepare_data.log)"
fi
part data_e2e 240 "$PY" bench/throughput.py "${BENCH_ARGS[@]}" --modes data,e2e --demo-images "$DEMO_IMAGES" \
    --json "$OUT_DIR/${STEM}_throughput-data-e2e.json"
part layout 150 "$PY" bench/throughput.py "${BENCH_ARGS[@]}" --modes layout \
    --json "$OUT_DIR/${STEM}_throughput-layout.json"

# --- the record of this run.
record
rm -f "$STATUS"
note "done in $(elapsed)s; results in $OUT_DIR"
