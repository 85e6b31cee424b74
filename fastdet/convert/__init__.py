"""The authors' released weights as fastdet checkpoints.

    python -m fastdet.convert --from megvii yolox_s.pth --arch yolox --output yolox_s_fastdet.pth
    python -m fastdet.convert --from paddle ppyoloe_crn_s_300e_coco.pdparams --arch ppyoloe --size s --output out.pth
    python -m fastdet.convert --from torchvision fcos_resnet50_fpn_coco.pth --arch fcos --output out.pth

The converted file is a normal checkpoint (config, class names, COCO category ids) that
``load_detector``, ``fastdet.eval``, ``fastdet.predict``, ``fastdet.export`` and
``fastdet.train --ckpt`` take. The logic is in :mod:`fastdet.convert.core`, the command
line in :mod:`fastdet.convert.__main__`; this module only names the public API.
"""

from fastdet.convert.core import ConvertError, coco_classes, convert, load_any, stale_conversion_note, unwrap

__all__ = ["ConvertError", "coco_classes", "convert", "load_any", "stale_conversion_note", "unwrap"]
