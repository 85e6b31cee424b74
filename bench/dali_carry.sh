#!/usr/bin/env bash
# Carry DALI to the bare GPU host, where nothing can be downloaded and one call carries at
# most 64 MiB (the working tree included, ~3 MB): the 257 MB of cp312 manylinux wheels DALI
# and its dependencies need there (../shared/GPU.md) travel as pieces under 60 MiB, one a
# call, in back-to-back calls on one warm machine (~30 s between calls).
#
#   bench/dali_carry.sh make       # here, once, on a machine with pip: download the wheels
#                                  # (and pycocotools'), tar them, split them into pieces of
#                                  # 55 MiB with their sha256, and print every call's command
#   bench/dali_carry.sh pack DIR   # only the tar, split and sha256 of the wheels in DIR
#   bench/dali_carry.sh stage K    # before call K: .whl/dali/ holds piece K alone (and
#                                  # SHA256SUMS); .whl/ is what every call carries
#   bench/dali_carry.sh commands   # print the calls again
#
# On the host, each call copies its piece to /tmp/dali (kept while the machine stays warm);
# the last call runs bench/gpu_check_dali.sh, which checks the sha256 of every piece, joins
# them and installs the wheels into /tmp/site with pip --no-index --no-deps --target.
#
# Environment: DALI_CARRY_PIECE_MB (default 55), PYTHON (python3), DALI_CARRY_DOWNLOAD
# (where the wheels are downloaded, default /tmp/fastdet-dali-wheels), DALI_CARRY_PARTS
# (where every piece is kept, default .dali-parts), DALI_CARRY_WHL (what a call carries,
# default .whl).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIECE_MB=${DALI_CARRY_PIECE_MB:-55}
DL=${DALI_CARRY_DOWNLOAD:-/tmp/fastdet-dali-wheels}
PARTS_DIR=${DALI_CARRY_PARTS:-.dali-parts}  # every piece, here only (ignored, never carried whole)
WHL=${DALI_CARRY_WHL:-.whl}                 # what each call carries: pycocotools' wheel and one DALI piece
# The versions GPU.md lists where it gives one (what a cu130 torch 2.11 host lacked).
PACKAGES=(nvidia-dali-cuda130==2.4.0 nvidia-libnvcomp-cu13==5.3.0.16 nvidia-nvimgcodec-cu13==0.9.0.20
          nvidia-nvjpeg2k-cu13 nvidia-nvjpeg==13.3.2.43 nvidia-nvtiff-cu13 nvtx libcst optree gast makefun
          astunparse)
PIP=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# pack DIR: DIR's wheels as one tar in pieces of PIECE_MB, with their sha256.
pack() {
    mkdir -p "$PARTS_DIR"
    rm -f "$PARTS_DIR"/dali.tar.part-* "$PARTS_DIR/SHA256SUMS"
    (cd "$1" && tar cf - ./*.whl) | split -b "${PIECE_MB}M" -d -a 2 - "$PARTS_DIR/dali.tar.part-"
    (cd "$PARTS_DIR" && sha256sum dali.tar.part-* > SHA256SUMS)
    du -ch "$1"/*.whl | tail -1
    ls -l "$PARTS_DIR"
}

pieces() { ls "$PARTS_DIR"/dali.tar.part-* 2>/dev/null | sort; }

commands() {
    local n k
    n=$(pieces | wc -l)
    if (( n == 0 )); then
        echo "no pieces in $PARTS_DIR: run bench/dali_carry.sh make first" >&2
        return 1
    fi
    echo "DALI in $n piece(s); back-to-back calls of the device tool on one warm machine, each with carry [\"$WHL\"]:"
    for k in $(seq 1 "$n"); do
        echo
        echo "  here:   bench/dali_carry.sh stage $k"
        if (( k < n )); then
            echo "  call $k: mkdir -p /tmp/dali && cp $WHL/dali/* /tmp/dali/ && ls -l /tmp/dali"
        else
            # The host's copy has no .git: the results record the commit given here.
            echo "  call $k: mkdir -p /tmp/dali; cp $WHL/dali/* /tmp/dali/; FASTDET_GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null) bash bench/gpu_check_dali.sh"
        fi
    done
    echo
    echo "Each call has ~30 s before the machine goes back: stage the next piece at once. If one is"
    echo "lost, gpu_check_dali.sh names the missing piece (sha256 check) and runs without DALI's rows."
}

case "${1:-}" in
    make)
        exclude=$(git rev-parse --git-path info/exclude)
        for d in "/$WHL/" "/$PARTS_DIR/"; do
            grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"
        done
        mkdir -p "$DL" "$WHL" "$PARTS_DIR"
        "$PY" -m pip download -q "${PIP[@]}" -d "$WHL" pycocotools
        "$PY" -m pip download -q "${PIP[@]}" -d "$DL" "${PACKAGES[@]}"
        pack "$DL"
        commands
        ;;
    pack)
        pack "${2:?"pack DIR: the folder of wheels"}"
        commands
        ;;
    stage)
        k=${2:?"stage K: which piece (1..N)"}
        piece=$(pieces | sed -n "${k}p")
        [[ -n "$piece" ]] || { echo "no piece $k in $PARTS_DIR" >&2; exit 1; }
        rm -rf "$WHL/dali"
        mkdir -p "$WHL/dali"
        cp "$piece" "$PARTS_DIR/SHA256SUMS" "$WHL/dali/"
        echo "staged $(basename "$piece") ($(du -h "$piece" | cut -f1)); $WHL holds $(du -sh "$WHL" | cut -f1)"
        ;;
    commands)
        commands
        ;;
    *)
        sed -n '2,/^set -euo/p' "$0" | sed '$d'
        exit 2
        ;;
esac
