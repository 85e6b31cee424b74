"""Build the C++/CUDA extension of fastdet.ops ahead of time.

    python -m fastdet.ops.build            # the variant fastdet would build on first use
    python -m fastdet.ops.build --variant cuda --verbose

The build goes to ``$FASTDET_EXT_DIR`` (default ``~/.cache/fastdet/ext``), in a directory
keyed by the sources' content, where the first use of an op finds it; rebuilding unchanged
sources is a ninja no-op. ``auto`` builds the CUDA variant only where a GPU is visible;
there, a missing CUDA toolkit exits with status 2 after building the C++ kernels.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fastdet.ops import _ext


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastdet.ops.build", description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: C++ and CUDA kernels; cpu: C++ only; auto: what first use would build")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    variant = None if args.variant == "auto" else args.variant
    start = time.perf_counter()
    try:
        out = _ext.build(variant, verbose=args.verbose)
    except _ext.ExtensionUnavailable as e:
        print(f"fastdet.ops.build: {e}", file=sys.stderr)
        return 1
    chosen = variant or ("cuda" if _ext.want_cuda() else "cpu")
    print(f"fastdet.ops.build: {chosen} extension ready in {out} ({time.perf_counter() - start:.1f} s)")
    if chosen == "cpu" and variant is None and torch.cuda.is_available():
        # A GPU is there but its kernels were not built: not an "ok" for a GPU check.
        print("fastdet.ops.build: a GPU is visible but no CUDA toolkit was found (nvcc not on PATH, CUDA_HOME "
              "unset, no /usr/local/cuda): only the C++ kernels were built, the CUDA ops fall back to Triton "
              "or torch; set CUDA_HOME to the toolkit root", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
