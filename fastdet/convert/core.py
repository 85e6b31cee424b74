"""Converting the authors' released weights: the logic behind ``python -m fastdet.convert``,
``load_detector`` and ``fastdet.train --ckpt``.

Each family owns its converters (``ArchFamily.weight_sources``: the authors' names to its
own, the class count from the head, the family options the weights need); this module
only reads the file safely (:mod:`fastdet.runtime.checkpoint`, the one weight-file reader),
unwraps its layout, picks or checks the size against the shapes and returns a normal
checkpoint (config, class names, COCO category ids). Nothing here names a family.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

from fastdet import registry
from fastdet.config import apply_overrides
from fastdet.models import ARCHITECTURES, build_model
from fastdet.models.paddle_names import NAME_TABLE
from fastdet.runtime.checkpoint import UnsafeWeightsError, is_torch_file, read_weights, to_tensors
from fastdet.runtime.checkpoint import weight_file_format as file_format

log = logging.getLogger("fastdet.convert")


# COCO 2017's 80 categories by id (instances_val2017.json): the class names of the authors'
# released COCO models; ids 12, 26, 29, 30, 45, 66, 68, 69, 71, 83 are unused.
COCO_2017_CATEGORIES: dict[int, str] = {
    1: "person", 2: "bicycle", 3: "car", 4: "motorcycle", 5: "airplane", 6: "bus", 7: "train", 8: "truck",
    9: "boat", 10: "traffic light", 11: "fire hydrant", 13: "stop sign", 14: "parking meter", 15: "bench",
    16: "bird", 17: "cat", 18: "dog", 19: "horse", 20: "sheep", 21: "cow", 22: "elephant", 23: "bear",
    24: "zebra", 25: "giraffe", 27: "backpack", 28: "umbrella", 31: "handbag", 32: "tie", 33: "suitcase",
    34: "frisbee", 35: "skis", 36: "snowboard", 37: "sports ball", 38: "kite", 39: "baseball bat",
    40: "baseball glove", 41: "skateboard", 42: "surfboard", 43: "tennis racket", 44: "bottle",
    46: "wine glass", 47: "cup", 48: "fork", 49: "knife", 50: "spoon", 51: "bowl", 52: "banana", 53: "apple",
    54: "sandwich", 55: "orange", 56: "broccoli", 57: "carrot", 58: "hot dog", 59: "pizza", 60: "donut",
    61: "cake", 62: "chair", 63: "couch", 64: "potted plant", 65: "bed", 67: "dining table", 70: "toilet",
    72: "tv", 73: "laptop", 74: "mouse", 75: "remote", 76: "keyboard", 77: "cell phone", 78: "microwave",
    79: "oven", 80: "toaster", 81: "sink", 82: "refrigerator", 84: "book", 85: "clock", 86: "vase",
    87: "scissors", 88: "teddy bear", 89: "hair drier", 90: "toothbrush",
}


class ConvertError(ValueError):
    """The file cannot be converted; the message is one line naming the file."""


def coco_classes(kind: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Class names and COCO category ids of the released COCO models: ``"coco80"`` (the 80
    contiguous labels) or ``"coco91"`` (torchvision's: label = category id, unused ids "N/A")."""
    if kind == "coco91":
        names = ("__background__",) + tuple(COCO_2017_CATEGORIES.get(i, "N/A") for i in range(1, 91))
        return names, tuple(range(91))
    return tuple(COCO_2017_CATEGORIES.values()), tuple(COCO_2017_CATEGORIES)


def unwrap(raw: Any, path: Path) -> dict[str, torch.Tensor]:
    """The weights of a released or trainer file: ``{"model": ...}`` (Megvii's release and
    trainer layouts), ``{"state_dict": ...}``, or a flat dict (torchvision, Paddle)."""
    if not isinstance(raw, Mapping):
        raise ConvertError(f"{path}: expected a dict of weights, found a {type(raw).__name__}")
    for key in ("model", "state_dict"):
        if isinstance(raw.get(key), Mapping):
            others = sorted(k for k in raw if k != key)
            if others:
                log.info("%s: weights from its %r entry; ignored: %s", path, key, ", ".join(map(str, others)))
            raw = raw[key]
            break
    raw = {k: v for k, v in raw.items() if k != NAME_TABLE}
    state = to_tensors(raw)
    extra = [k for k in raw if k not in state]
    if extra:
        raise ConvertError(f"{path}: {extra[0]!r} is not an array ({type(raw[extra[0]]).__name__}); "
                           "expected a dict of weights")
    if not state:
        raise ConvertError(f"{path}: holds no weights")
    return state


@functools.lru_cache(maxsize=32)
def _own_shapes(arch: str, size: str, num_classes: int, build_opts: tuple[tuple[str, Any], ...]
                ) -> Mapping[str, tuple[int, ...]]:
    """{key: shape} of ``arch``-``size``'s state dict, in its order (read-only). Built once per
    process and model: a meta build takes up to ~0.2 s (yolox-x), and finding a file's size,
    or the size it looks like, tries every size."""
    with torch.device("meta"):  # shapes only: no memory, no init
        model = build_model(arch, size, num_classes, **dict(build_opts))
    return MappingProxyType({k: tuple(v.shape) for k, v in model.state_dict().items()})


def _shapes(arch: str, size: str, num_classes: int, options: Mapping[str, Any]) -> Mapping[str, tuple[int, ...]]:
    fields = ARCHITECTURES[arch].config_fields
    return _own_shapes(arch, size, num_classes, tuple(sorted((k, v) for k, v in options.items() if k in fields)))


def _fit(state: Mapping[str, torch.Tensor], arch: str, size: str, num_classes: int,
         options: Mapping[str, Any]) -> Optional[str]:
    """None if ``state`` fits ``arch``-``size`` exactly, else the first key that does not, and how."""
    own = _shapes(arch, size, num_classes, options)
    for k, v in state.items():
        if k not in own:
            return f"{k}: no such tensor in {arch}-{size}"
        if own[k] != tuple(v.shape):
            return f"{k}: shape {list(v.shape)}, {arch}-{size} expects {list(own[k])}"
    for k in own:
        if k not in state and not k.endswith("num_batches_tracked"):
            return f"{k}: {arch}-{size} needs it and the file lacks it"
    return None


def weight_file_format(path: Path) -> str:
    """``"torch"`` or ``"paddle"`` (``fastdet.runtime.checkpoint.weight_file_format``); no
    file, a folder or anything else is a :class:`ConvertError` line saying so."""
    try:
        return file_format(path)
    except (ValueError, FileNotFoundError) as e:
        raise ConvertError(str(e)) from None


def released_files(arch: str) -> str:
    """What ``arch`` converts, for a message: ``paddle .pdparams files`` / ``megvii torch files``."""
    sources = ARCHITECTURES[arch].weight_sources
    if not sources:
        return f"fastdet converts no released {arch} weights"
    return f"{arch} converts " + ", ".join(f"{n} {'.pdparams' if s.file_format == 'paddle' else 'torch'} files"
                                           for n, s in sorted(sources.items()))


def pick_source(arch: str, path: Path, source: Optional[str]) -> str:
    """The released file's source (``--from``, else the one of this family that writes its
    format); the file is one the caller knows is not a fastdet checkpoint."""
    fam = ARCHITECTURES[arch]
    if not fam.weight_sources:
        raise ConvertError(f"{path}: not a fastdet checkpoint, and {released_files(arch)}")
    if source is not None:
        if source not in fam.weight_sources:
            raise ConvertError(f"{path}: {arch} converts weights from {', '.join(sorted(fam.weight_sources))}, "
                               f"not {source!r}")
        return source
    fmt = weight_file_format(path)
    names = [n for n, s in fam.weight_sources.items() if s.file_format == fmt]
    if not names:
        raise ConvertError(f"{path}: a {fmt} file that is not a fastdet checkpoint (no 'config' and 'model' "
                           f"entries), nor a released {arch} file fastdet reads ({released_files(arch)})")
    if len(names) > 1:
        raise ConvertError(f"{path}: a {fmt} file; {arch} reads {fmt} files from {', '.join(names)}: say which "
                           "with --from")
    return names[0]


def _check_arch_size(arch: str, size: Optional[str]) -> None:
    if arch not in ARCHITECTURES:
        raise ConvertError(f"unknown --arch {arch!r}: available are {', '.join(sorted(ARCHITECTURES))}")
    sizes = ARCHITECTURES[arch].sizes
    if size is not None and size not in sizes:
        raise ConvertError(f"unknown --size {size!r} for {arch}: available are {', '.join(sizes)}")


def convert(path: str | Path, arch: str, size: Optional[str] = None, source: Optional[str] = None,
            ) -> tuple[dict[str, Any], str]:
    """Convert the authors' file at ``path`` for ``arch``; returns the fastdet checkpoint dict
    and the size (inferred from the shapes when ``size`` is None)."""
    path = Path(path)
    _check_arch_size(arch, size)
    weight_file_format(path)  # no file, a folder, a damaged one: said before anything else
    try:
        raw = read_weights(path)
    except (UnsafeWeightsError, FileNotFoundError):
        raise
    except ValueError as e:
        raise ConvertError(str(e)) from None
    return convert_weights(raw, path, arch, size, source)


def convert_weights(raw: Any, path: Path, arch: str, size: Optional[str] = None, source: Optional[str] = None,
                    ) -> tuple[dict[str, Any], str]:
    """:func:`convert` of the contents ``raw`` already read from ``path`` (``fastdet.train``
    checks a ``--ckpt`` this way before any work, on the file memory-mapped)."""
    fam = ARCHITECTURES[arch]
    if is_fastdet_checkpoint(raw):
        model = raw["config"].get("model") or {}
        raise ConvertError(f"{path}: already a fastdet checkpoint ({model.get('arch')}-{model.get('size')}): "
                           "use it as is")
    source = pick_source(arch, path, source)
    ws = fam.weight_sources[source]
    state = unwrap(raw, path)
    try:
        state, num_classes = ws.convert(state)
    except KeyError as e:
        raise ConvertError(f"{path}: not {source}'s {arch} ({e.args[0]})") from None
    if size is None:
        size = next((s for s in fam.sizes if _fit(state, arch, s, num_classes, ws.options) is None), None)
        if size is None:
            first = _fit(state, arch, fam.sizes[0], num_classes, ws.options)
            raise ConvertError(f"{path}: fits no {arch} size ({first})")
    elif (bad := _fit(state, arch, size, num_classes, ws.options)) is not None:
        like = [s for s in fam.sizes if s != size and _fit(state, arch, s, num_classes, ws.options) is None]
        hint = f"; this looks like {arch}-{like[0]}" if like else ""
        raise ConvertError(f"{path}: {bad}{hint}")
    own_order = _shapes(arch, size, num_classes, ws.options)
    model_state = {}
    for k in own_order:  # fastdet's order; BatchNorm counters the file lacks start at 0
        model_state[k] = state[k].float() if k in state and state[k].is_floating_point() else \
            state.get(k, torch.tensor(0, dtype=torch.long))
    cfg = registry.get_preset(arch, size)
    cfg = apply_overrides(cfg, {"model.num_classes": num_classes, **{f"family.{k}": v for k, v in ws.options.items()}})
    names, ids = coco_classes(ws.classes)
    if len(names) != num_classes:
        names, ids = tuple(str(i) for i in range(num_classes)), tuple(range(1, num_classes + 1))
    ck = {"config": cfg.to_dict(), "model": model_state, "class_names": list(names), "cat_ids": list(ids),
          "converted_from": {"file": str(path), "source": source, "pixels": "RGB"}}
    return ck, size


def stale_conversion_note(ck: dict[str, Any], path: str | Path) -> Optional[str]:
    """The warning for a checkpoint converted from Megvii's YOLOX before the converter turned
    its stem from Megvii's BGR input to fastdet's RGB (no ``pixels`` in ``converted_from``):
    its red and blue are swapped, which costs AP; None for any other checkpoint."""
    src = ck.get("converted_from")
    if isinstance(src, dict) and src.get("source") == "megvii" and src.get("pixels") != "RGB":
        return (f"{path}: converted from Megvii's YOLOX by an earlier fastdet, which fed its BGR-trained stem RGB "
                f"(red and blue swapped); convert {src.get('file', 'the released file')} again: python -m "
                "fastdet.convert --from megvii FILE --arch yolox --output OUT.pth")
    return None


def is_fastdet_checkpoint(raw: Any) -> bool:
    return isinstance(raw, Mapping) and isinstance(raw.get("config"), Mapping) and "model" in raw


def load_any(path: str | Path, arch: str, size: Optional[str] = None, source: Optional[str] = None
             ) -> tuple[dict[str, Any], bool]:
    """A fastdet checkpoint as it is, or the authors' released file converted for ``arch``
    (logged once: which source, which size); returns ``(checkpoint dict, converted)``."""
    path = Path(path)
    if is_torch_file(path):
        try:
            raw = read_weights(path)
        except ValueError as e:
            raise ConvertError(str(e)) from None
        if is_fastdet_checkpoint(raw):
            note = stale_conversion_note(raw, path)
            if note:
                log.warning(note)
            return raw, False
        _check_arch_size(arch, size)
        ck, size = convert_weights(raw, path, arch, size, source)  # read once (a yolox-x file: 400 MB)
    else:
        ck, size = convert(path, arch, size, source)
    log.info("%s: converted from %s's released %s weights (%s-%s, %d classes)", path, ck["converted_from"]["source"],
             arch, arch, size, ck["config"]["model"]["num_classes"])
    return ck, True
