# The machinery of bench/gpu_check.sh and bench/gpu_check_dali.sh (sourced by both): each
# part's limit from the plan table in the sourcing script's header, the budget, the record
# (<stem>_<KIND>.json) and the archive ($OUT/<KIND>.tgz, at most ARCHIVE_MB MiB), rewritten
# after every part so a call cut short keeps what finished.
#
# The sourcing script sets: SELF (its own path, holding the plan), KIND, MODE (run, rehearse),
# SCALE, BUDGET (already scaled), START, OUT_DIR, STATUS, PACK_TO (empty: no packing),
# ARCHIVE_MB, PARTS, PY; STEM once known.

# limit NAME / lane NAME: the part's row of the plan.
plan_field() { awk -F'|' -v p="$1" -v f="$2" '/^#\| / { gsub(/ /, "", $2); if ($2 == p) { gsub(/ /, "", $(f)); print $(f); exit } }' "$SELF"; }
limit() { echo $(( $(plan_field "$1" 4) * SCALE )); }
lane() { plan_field "$1" 3; }
plan_parts() { sed -n 's/^#| \([a-z_0-9]\+\) .*/\1/p' "$SELF" | grep -v '^part$' | paste -sd, -; }

# print_plan: the plan table of $SELF as JSON, each part with its command from PLAN_CMDS
# (lines "part<TAB>command"); PLAN_TRAIN (lines "family<TAB>flags"), when set, adds "train".
print_plan() {
    "$PY" - "$SELF" "$BUDGET" <<'EOF'
import json, os, sys
rows, cur = [], None
for line in open(sys.argv[1]):
    if not line.startswith("#| "):
        continue
    name, lane, limit, returns, est = ([c.strip() for c in line[2:].split("|")] + [""] * 5)[:5]
    if name == "part":
        continue
    if name:
        cur = {"part": name, "lane": lane, "limit_s": int(limit), "returns": returns, "gpu_estimate": est}
        rows.append(cur)
    else:  # a row continued on the next line
        cur["returns"] = (cur["returns"] + " " + returns).strip()
        cur["gpu_estimate"] = (cur["gpu_estimate"] + " " + est).strip()
table = lambda name: dict(l.split("\t", 1) for l in os.environ.get(name, "").splitlines() if l)
cmds = table("PLAN_CMDS")
for r in rows:
    r["command"] = cmds.get(r["part"])
doc = {"budget_s": int(sys.argv[2]), "parts": rows}
if os.environ.get("PLAN_TRAIN"):
    doc["train"] = table("PLAN_TRAIN")
print(json.dumps(doc, indent=1))
EOF
}

# start_run WORK_NAME RESULT_NAME [OUT_DIR]: the output folder (under the device tool, $OUT
# set and no OUT_DIR: $WORK_ROOT/WORK_NAME-<time>, packed into $OUT, since only 8 files come
# back from $OUT; else OUT_DIR or bench/results/RESULT_NAME-<time>), the budget scaled, the
# clock, the status file, and the caches every part shares (kept out of OUT_DIR: large
# files; what precompile compiles the timed parts load).
start_run() {
    PACK_TO=
    if [[ -z "${3:-}" && -n "${OUT:-}" ]]; then
        PACK_TO=$OUT
        OUT_DIR=$WORK_ROOT/$1-$(date -u +%Y%m%dT%H%M%SZ)
    else
        OUT_DIR=${3:-$REPO/bench/results/$2-$(date -u +%Y%m%dT%H%M%SZ)}
    fi
    ARCHIVE_MB=${GPU_CHECK_ARCHIVE_MB:-8}
    BUDGET=$(( BUDGET * SCALE ))
    mkdir -p "$OUT_DIR"
    OUT_DIR=$(cd "$OUT_DIR" && pwd)
    START=$(date +%s)
    STATUS="$OUT_DIR/.parts.tsv"
    : > "$STATUS"
    export PYTHONUNBUFFERED=1
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    export FASTDET_EXT_DIR=${FASTDET_EXT_DIR:-$WORK_ROOT/ext}
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK_ROOT/inductor}
    mkdir -p "$FASTDET_EXT_DIR" "$TORCHINDUCTOR_CACHE_DIR"
}

elapsed() { echo $(( $(date +%s) - START )); }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }
note() { echo "[gpu_check $(elapsed)s] $*" | tee -a "$OUT_DIR/summary.txt"; }

# pack: the archive, without checkpoints, cut to ARCHIVE_MB. Over the limit, one file at a
# time, largest first among those not yet touched: profiler traces, then logs (*.log,
# *.jsonl, *.txt) are cut to their first and last 200 lines (to their first and last 64 KiB
# where that leaves them over 256 KiB: a trace can be a few long lines); then other files
# over 64 KiB (the trainers' plots, TensorBoard events) are left out. Every pass touches a
# new file, so the loop ends; the record names each file cut (trimmed) or left out (dropped).
TRIMMED=()
DROPPED=()
# pack_victim: the next file to cut or drop, as "cut<TAB>path" or "drop<TAB>path"; none: "".
pack_victim() {
    local touched=" ${TRIMMED[*]:-} ${DROPPED[*]:-} " kind rel names
    for kind in trace text other; do
        case $kind in
            trace) names=(-name 'trace_*.json') ;;
            text) names=(\( -name '*.log' -o -name '*.jsonl' -o -name '*.txt' \)) ;;
            other) names=(! -name '*.log' ! -name '*.jsonl' ! -name '*.txt' ! -name '*.json') ;;
        esac
        while IFS=$'\t' read -r _ rel; do
            [[ -z "$rel" || "$touched" == *" $rel "* ]] && continue
            if [[ $kind == other ]]; then printf 'drop\t%s\n' "$rel"; else printf 'cut\t%s\n' "$rel"; fi
            return
        done < <(cd "$OUT_DIR" && find . -type f -size +64k "${names[@]}" ! -name '*.pth' ! -name '.parts.tsv' \
                     ! -name summary.txt -printf '%s\t%P\n' | sort -rn)
    done
}
pack() {
    [[ -n "$PACK_TO" ]] || return 0
    local max=$(( ARCHIVE_MB * 1024 * 1024 )) size action rel file
    find "$OUT_DIR" -name '*.pth' -delete
    while :; do
        tar czf "$PACK_TO/${KIND//-/_}.tgz.tmp" --exclude='*.pth' --exclude='.parts.tsv' \
            "${DROPPED[@]/#/--exclude=./}" -C "$OUT_DIR" . 2>/dev/null
        size=$(stat -c %s "$PACK_TO/${KIND//-/_}.tgz.tmp")
        (( size <= max )) && break
        IFS=$'\t' read -r action rel < <(pack_victim)
        if [[ -z "${rel:-}" ]]; then
            note "pack: archive ${size} B > ${ARCHIVE_MB} MiB and nothing left to cut: kept as is"
            break
        fi
        file="$OUT_DIR/$rel"
        if [[ $action == drop ]]; then
            DROPPED+=("$rel")
            note "pack: archive ${size} B > ${ARCHIVE_MB} MiB: left out $rel ($(stat -c %s "$file") B)"
            continue
        fi
        { head -n 200 "$file"; echo "... cut by gpu_check.sh to fit the ${ARCHIVE_MB} MiB archive ..."; tail -n 200 "$file"; } \
            > "$file.cut"
        if (( $(stat -c %s "$file.cut") > 256 * 1024 )); then
            { head -c 65536 "$file"; printf '\n... cut by gpu_check.sh to fit the %s MiB archive ...\n' "$ARCHIVE_MB"
              tail -c 65536 "$file"; } > "$file.cut"
        fi
        mv "$file.cut" "$file"
        TRIMMED+=("$rel")
        note "pack: archive ${size} B > ${ARCHIVE_MB} MiB: cut $rel"
    done
    mv "$PACK_TO/${KIND//-/_}.tgz.tmp" "$PACK_TO/${KIND//-/_}.tgz"
    ARCHIVE_BYTES=$size
}

# record: (re)write <stem>_<KIND>.json (every part: ran or not, status, why, exit code,
# seconds, limit, lane, the side lane's jobs that ran beside it; the parts never reached;
# the archive), then pack.
ARCHIVE_BYTES=0
record() {
    # A part before env (the DALI call's dali_install) is recorded before the stem is known.
    [[ -n "${STEM:-}" ]] && rm -f "$OUT_DIR/unknown_${KIND}.json"
    pack
    "$PY" - "$STATUS" "$OUT_DIR/${STEM:-unknown}_${KIND}.json" "$BUDGET" "$(elapsed)" "${STEM:-unknown}" \
        "$PARTS" "$ARCHIVE_BYTES" "$ARCHIVE_MB" "$MODE" "${TRIMMED[*]:-}" "${DROPPED[*]:-}" "${KIND//-/_}" <<'EOF'
import json, sys
status, out, budget, elapsed, stem, wanted, archive, archive_mb, mode, trimmed, dropped, kind = sys.argv[1:]
parts = []
for line in open(status):
    name, st, rc, secs, why, limit, lane, beside = (line.rstrip("\n").split("\t") + [""] * 8)[:8]
    parts.append({"part": name, "ran": st != "skipped", "status": st, "exit": int(rc) if rc else None,
                  "seconds": int(secs or 0), "why": why or None, "limit_s": int(limit) if limit else None,
                  "lane": lane or None, "beside": beside.split(",") if beside else []})
done = {p["part"] for p in parts}
json.dump({"schema": "fastdet.bench/1", "kind": kind, "mode": mode, "stem": stem, "budget_s": int(budget),
           "elapsed_s": int(elapsed), "parts": parts,
           "not_reached": [p for p in wanted.split(",") if p and p not in done],
           "archive": {"bytes": int(archive), "limit_mib": int(archive_mb), "trimmed": trimmed.split(),
                       "dropped": dropped.split()}},
          open(out, "w"), indent=1)
EOF
    if [[ -n "$PACK_TO" ]]; then
        cp "$OUT_DIR/summary.txt" "$PACK_TO/summary.txt" 2>/dev/null
        cp "$OUT_DIR/${STEM:-unknown}_${KIND}.json" "$PACK_TO/${KIND}.json" 2>/dev/null
    fi
    return 0
}

# status_line NAME STATUS EXIT SECONDS WHY LIMIT LANE [BESIDE]
status_line() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STATUS"; }

# import_error MODULE: nothing (status 0) when $PY imports MODULE, else the last line of the
# error (status 1): a carried wheel that lacks a dependency of its own (DALI's astunparse
# needs six) must read differently from a wheel that was never carried.
import_error() {
    local err
    err=$("$PY" -c "import $1" 2>&1 > /dev/null) && return 0
    echo "${err##*$'\n'}"
    return 1
}

# skip NAME WHY: record a part that does not run, and why.
skip() {
    wanted "$1" || return 0
    note "$1: skipped: $2"
    status_line "$1" skipped "" 0 "$2" "$(limit "$1")" "$(lane "$1")"
    record
}

# allowed NAME: the part's limit from the plan, cut to what is left of the budget; the last
# part (LAST_TAKES_REST, on a real run) takes all that is left. Empty when the budget no
# longer fits it.
allowed() {
    local lim left
    lim=$(limit "$1")
    left=$(( BUDGET - $(elapsed) - 5 ))
    [[ $1 == "${LAST_TAKES_REST:-}" && $MODE == run ]] && (( left > lim )) && lim=$left
    (( left < lim )) && lim=$left
    (( lim < 10 )) && return 0
    echo "$lim"
}

# finish NAME RC T0 LIMIT: record a part's end; PART_WHY, when set, says what the part left
# out, CUT_WHY why it was cut (default: its limit); beside_of, when the sourcing script
# defines it, names the side lane's jobs that ran beside it.
finish() {
    local name=$1 rc=$2 t0=$3 lim=$4 status=ok why=${PART_WHY:-} beside=
    (( rc == 124 || rc == 137 )) && status=timeout && why="${CUT_WHY:-cut at its limit of ${lim}s}${why:+; $why}"
    (( rc != 0 && rc != 124 && rc != 137 )) && status=failed
    declare -F beside_of > /dev/null && beside=$(beside_of)
    note "$name: $status (exit $rc, $(( $(date +%s) - t0 ))s)${beside:+, beside the precompile jobs $beside}${why:+: $why}; log $name.log"
    status_line "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$why" "$lim" "$(lane "$name")" "$beside"
    tail -n 25 "$OUT_DIR/$name.log" | sed 's/^/    /' >> "$OUT_DIR/summary.txt"
    record
}

# part NAME CMD...: run CMD under the part's limit (the plan's, cut to the budget left).
part() {
    local name=$1 lim t0 rc
    shift
    wanted "$name" || return 0
    lim=$(allowed "$name")
    if [[ -z "$lim" ]]; then
        skip "$name" "the budget of ${BUDGET}s is spent"
        return 0
    fi
    note "$name: start (limit ${lim}s): $*"
    t0=$(date +%s)
    timeout -k 10 "$lim" "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    finish "$name" "$rc" "$t0" "$lim"
}
