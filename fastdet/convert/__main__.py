"""``python -m fastdet.convert``: the authors' released weights as a fastdet checkpoint.

    python -m fastdet.convert --from megvii yolox_s.pth --arch yolox --output yolox_s_fastdet.pth
    python -m fastdet.convert --from paddle ppyoloe_crn_s_300e_coco.pdparams --arch ppyoloe --size s --output out.pth
    python -m fastdet.convert --from torchvision fcos_resnet50_fpn_coco.pth --arch fcos --output out.pth
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

from fastdet.convert.core import ConvertError, convert
from fastdet.models import ARCHITECTURES
from fastdet.runtime.checkpoint import save_checkpoint
from fastdet.runtime.outputs import refuse_replacing


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastdet.convert",
                                 description="The authors' released weights as fastdet checkpoints.")
    ap.add_argument("src", metavar="SRC", help="the authors' released file (.pth, .pdparams)")
    ap.add_argument("--from", dest="source", choices=sorted({s for f in ARCHITECTURES.values() for s in f.weight_sources}),
                    help="whose file it is (default: the family's source for this file format)")
    ap.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
    ap.add_argument("--size", help="the model size (default: inferred from the shapes)")
    ap.add_argument("--output", "-o", required=True, help="the fastdet checkpoint to write")
    ap.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.output)
    try:
        if out.resolve() == Path(args.src).resolve():
            raise ConvertError(f"--output {out} is the source file; choose another path")
        if not args.overwrite:
            refuse_replacing([out], f"--output {out}", "--overwrite")
        ck, size = convert(args.src, args.arch, args.size, args.source)
    except (ValueError, FileNotFoundError) as e:
        print(f"fastdet.convert: error: {e}", file=sys.stderr)
        return 2
    save_checkpoint(out, ck)
    n = ck["config"]["model"]["num_classes"]
    print(f"{args.src} ({ck['converted_from']['source']}) -> {out}: {args.arch}-{size}, {n} classes, "
          f"{len(ck['model'])} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
