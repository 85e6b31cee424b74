"""Using a trained detector from Python.

    >>> import fastdet
    >>> det = fastdet.load_detector("runs/demo/best.pth")        # eval mode, EMA weights, fused
    >>> results = fastdet.detect(det, "img.jpg")                 # a path, PIL image, array or a list
    >>> boxes, scores = det(images)                              # dense outputs, [N,A,4], [N,A,C]

:func:`load_detector` returns the family's :class:`~fastdet.models.Detector` with a
:class:`DetectorInfo` as ``det.info``: class names, COCO category ids, the family's
evaluation preprocessing (``fastdet.data.preprocess.Preprocess``), the input size and the
post-processing settings of its recipe. ``det(images)`` and ``det.predict(images, ...)``
take images preprocessed as :func:`preprocess_images` does (which is also the input of
an exported ONNX model, on the canvas it was exported at).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from fastdet import registry
from fastdet.config import Config, ConfigError
from fastdet.convert import load_any, stale_conversion_note
from fastdet.data.augment import ImageDecodeError, decode_image, rgb_of
from fastdet.data.preprocess import Preprocess, boxes_to_original, by_canvas
from fastdet.runtime.checkpoint import UnsafeWeightsError, load_checkpoint, select_weights, weight_file_format
from fastdet.models import ARCHITECTURES, Detector


log = logging.getLogger("fastdet")


class CheckpointError(ValueError):
    """The file is not a fastdet checkpoint; the message is one line naming it."""


# How errors name load_detector's ``arch`` / ``size`` / ``source``: the keyword arguments
# from Python, the flags from a command line (``fastdet.eval``'s). A command without them
# (``fastdet.predict``, ``fastdet.export``) passes ``{}``, and a released file is pointed at
# ``python -m fastdet.convert``.
PYTHON_ARGS = MappingProxyType({"arch": "arch=", "size": "size=", "source": "source="})
CLI_ARGS = MappingProxyType({"arch": "--arch", "size": "--size", "source": "--from"})


def _given(names: Mapping[str, str], key: str, value: str) -> str:
    """``arch='yolox'`` (a keyword) or ``--arch yolox`` (a flag)."""
    name = names.get(key, key + "=")
    return f"{name}{value!r}" if name.endswith("=") else f"{name} {value}"


def _folder_error(path: Path) -> CheckpointError:
    inside = [n for n in ("best.pth", "latest.pth") if (path / n).is_file()]
    hint = f" (it holds {' and '.join(inside)}: pass {path / inside[0]})" if inside else ""
    return CheckpointError(f"{path}: a folder, not a checkpoint file{hint}")


@dataclass(frozen=True)
class DetectorInfo:
    """What a loaded detector needs besides its weights.

    Attributes:
        arch, size: the registry names it was built from.
        class_names: one per contiguous label (``labels`` of ``predict``).
        cat_ids: the COCO category id of each contiguous label.
        preprocess: the family's evaluation preprocessing (resize mode, normalisation).
        img_size: the evaluation input size ``S`` of the recipe: the canvas is ``S`` x ``S``,
            or for a keep-ratio family the one of the image's orientation
            (``preprocess.canvases().buckets(S)``; FCOS at 800: 800 x 1344, 1344 x 800, 800 x 800).
        predict_kwargs: ``Detector.predict``'s NMS settings of the recipe.
        weights: ``"ema"`` or ``"model"``, the weights that were loaded.
        checkpoint: the file it came from.
    """

    arch: str
    size: str
    class_names: tuple[str, ...]
    cat_ids: tuple[int, ...]
    preprocess: Preprocess
    img_size: int
    predict_kwargs: dict[str, Any] = field(default_factory=dict)
    weights: str = "ema"
    checkpoint: str = ""


def read_checkpoint(path: str | Path, names: Mapping[str, str] = PYTHON_ARGS) -> tuple[dict[str, Any], Config]:
    """The checkpoint dict and its config; :class:`CheckpointError` if it is not a fastdet one
    (``names``: how the message names ``arch``, see :data:`PYTHON_ARGS`)."""
    path = Path(path)
    if path.is_dir():
        raise _folder_error(path)
    try:
        ck = load_checkpoint(path)
    except UnsafeWeightsError as e:  # code to unpickle: its own line says so
        raise CheckpointError(str(e)) from None
    except ValueError:
        if _format_or_none(path) == "paddle":
            raise CheckpointError(f"{path}: not a fastdet checkpoint (a pickle, as Paddle's .pdparams are; "
                                  f"{_released_hint(names)})") from None
        raise CheckpointError(f"{path}: not a fastdet checkpoint (torch.load with weights_only "
                              "cannot read it: a corrupt file or another format)") from None
    note = stale_conversion_note(ck, path) if isinstance(ck, dict) else None
    if note:
        log.warning(note)
    return ck, _stored_config(ck, path, names)


def _format_or_none(path: Path) -> str | None:
    """:func:`weight_file_format`, None for a file that is neither format."""
    try:
        return weight_file_format(path)
    except (ValueError, FileNotFoundError):
        return None


def _released_hint(names: Mapping[str, str]) -> str:
    """How an authors' released file is read, in the caller's words (``names``)."""
    if "arch" in names:
        return (f"an authors' released file is converted on load with {names['arch']} "
                f"(e.g. {_given(names, 'arch', 'yolox')})")
    return "convert an authors' released file first: python -m fastdet.convert FILE --arch ARCH"


def _stored_config(ck: Any, path: Path, names: Mapping[str, str] = PYTHON_ARGS) -> Config:
    """The config a fastdet checkpoint dict stores; :class:`CheckpointError` naming ``path`` otherwise."""
    if not isinstance(ck, dict) or not isinstance(ck.get("config"), dict) or "model" not in ck:
        raise CheckpointError(f"{path}: not a fastdet checkpoint (no 'config' and 'model' entries; "
                              f"a plain state dict is not enough to rebuild the model; {_released_hint(names)})")
    model = ck["config"].get("model")
    if not isinstance(model, dict) or not model.get("arch") or not model.get("size"):
        # The defaults would build another model than the weights' (PP-YOLOE-s, 80 classes).
        raise CheckpointError(f"{path}: its stored config names no model.arch and model.size")
    try:
        return registry.config_from_dict(ck["config"])
    except (ConfigError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path}: its stored config does not load ({e})") from None


def read_any_checkpoint(path: str | Path, arch: str | None = None, size: str | None = None,
                        source: str | None = None, names: Mapping[str, str] = PYTHON_ARGS
                        ) -> tuple[dict[str, Any], Config]:
    """``(checkpoint dict, config)`` of a fastdet checkpoint or, with ``arch``, of the authors'
    released file converted on load (see :func:`load_detector`). ``names``: how errors name
    ``arch``, ``size`` and ``source`` (:data:`PYTHON_ARGS`, a CLI :data:`CLI_ARGS`)."""
    if Path(path).is_dir():
        raise _folder_error(Path(path))
    if arch is not None:
        ck, converted = load_any(path, arch, size, source)  # a fastdet one read (and warned about) once
        cfg = registry.config_from_dict(ck["config"]) if converted else _stored_config(ck, Path(path), names)
        if converted:
            return ck, cfg
    else:
        ck, cfg = read_checkpoint(path, names)
    asked = [(key, v) for key, v, own in (("arch", arch, cfg.model.arch), ("size", size, cfg.model.size))
             if v is not None and v != own] + ([("source", source)] if source is not None else [])
    if asked:  # a fastdet checkpoint says what it is: an argument that says otherwise is a mistake, not an order
        key, v = asked[0]
        raise CheckpointError(f"{path}: a fastdet {cfg.model.arch}-{cfg.model.size} checkpoint, but "
                              f"{_given(names, key, v)} was given (it is for the authors' released files): drop it")
    return ck, cfg


def detector_from_checkpoint(ck: dict[str, Any], cfg: Config, path: str | Path, ema: bool = True,
                             fuse: bool = True, device: str | torch.device = "cpu") -> Detector:
    """The family's detector of ``cfg`` with the weights of ``ck`` (:func:`select_weights`), in
    eval mode, with ``.info``; ``path`` names the file in errors."""
    arch = cfg.model.arch
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not registered here "
                              f"(available: {', '.join(sorted(ARCHITECTURES))})")
    model = registry.build_detector(cfg)
    weights, which = select_weights(ck, ema)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
        if len(first) > 240:  # the first keys of a list of hundreds
            first = first[:240].rsplit(", ", 1)[0] + ", ..."
        raise CheckpointError(f"{path}: its weights do not fit {arch}-{cfg.model.size} ({first})") from None
    model.eval()
    if fuse:
        model.fuse()
    n = cfg.model.num_classes
    cat_ids = tuple(int(c) for c in ck.get("cat_ids") or range(1, n + 1))
    names = tuple(str(c) for c in ck.get("class_names") or cat_ids)
    model.info = DetectorInfo(
        arch=arch, size=cfg.model.size, class_names=names, cat_ids=cat_ids,
        preprocess=ARCHITECTURES[arch].preprocess, img_size=cfg.data.img_size,
        predict_kwargs=registry.predict_kwargs(cfg), weights=which, checkpoint=str(path))
    return model.to(device)


def load_detector(ckpt_path: str | Path, ema: bool = True, fuse: bool = True,
                  device: str | torch.device = "cpu", arch: str | None = None, size: str | None = None,
                  source: str | None = None, *, arg_names: Mapping[str, str] = PYTHON_ARGS,
                  postprocess: Mapping[str, Any] | None = None) -> Detector:
    """The detector of a fastdet checkpoint, in eval mode, with ``.info`` (:class:`DetectorInfo`).

    Args:
        ckpt_path: a ``best.pth`` / ``latest.pth`` written by ``fastdet.train``.
        ema: load the EMA weights (what evaluation scores); the plain weights when False
            or when the run had no EMA.
        fuse: fold re-parameterisable blocks (RepVGG branches, conv+BN) for inference;
            the outputs stay the same up to float rounding.
        device: where the model lives.
        arch, size, source: with ``arch``, ``ckpt_path`` may also be the authors' released
            file (Megvii ``.pth``, Paddle ``.pdparams``, torchvision ``.pth``), converted on
            load as ``python -m fastdet.convert`` does (and logged); ``size`` is inferred
            from the shapes when None.
        arg_names: how errors name ``arch``, ``size`` and ``source``: the keywords
            (:data:`PYTHON_ARGS`); a command line passes its flags (:data:`CLI_ARGS`), or
            ``{}`` when it has none.
        postprocess: ``{field: value}`` of the recipe's post-processing to change, e.g.
            ``{"nms_iou": 0.7, "max_det": 300}`` (``info.predict_kwargs`` and what
            :func:`detect` uses); only the ``family`` fields the family's post-processing
            reads, each in its range (one ``ConfigError`` naming the field otherwise).
    """
    ck, cfg = read_any_checkpoint(ckpt_path, arch, size, source, arg_names)
    if postprocess:
        cfg = registry.postprocess_overrides(cfg, postprocess)
    return detector_from_checkpoint(ck, cfg, ckpt_path, ema=ema, fuse=fuse, device=device)


def preprocess_images(images: Any, preprocess: Preprocess, img_size: int,
                      canvas: Sequence[int] | None = None) -> tuple[Tensor, list[tuple[float, float]]]:
    """Images → the network input ``[N, 3, H, W]`` f32 and each ``(sx, sy)``.

    ``images`` as :func:`detect` takes them (:func:`as_rgb_images`: paths, PIL images,
    arrays or tensors, uint8 or float 0..255, refused in one line otherwise). Every image
    becomes RGB uint8 first, a float one rounded, so it gives the pixels of the same image
    decoded from a file, as evaluation reads it. This is the input of ``det(images)``,
    ``det.predict`` and an exported ONNX model's ``images``: the family's evaluation resize
    onto one canvas, then its normalisation (``Preprocess``). The canvas is ``canvas``
    (H, W) when given (an exported model's ``input_size``), else at input size ``img_size``:
    ``img_size`` square, or for a keep-ratio family (FCOS) the canvas of the images' most
    common orientation (``Canvases.pick``), an image of another orientation scaled down to
    fit. Images of one orientation get the evaluation loader's batch of them; evaluation
    and :func:`detect` put each image on its own orientation's canvas.
    """
    if canvas is not None and (len(canvas) != 2 or any(int(v) != v or v < 1 for v in canvas)):
        raise ValueError(f"canvas: expected (height, width) in px, got {tuple(canvas)}")
    images = as_rgb_images(images)
    if not images:
        raise ValueError("preprocess_images: no images")
    if canvas is None:
        canvas = preprocess.canvases().pick(img_size, np.array([img.shape[1] / img.shape[0] for img in images]))
    out, scales = [], []
    for img in images:
        x, s = preprocess(img, canvas)
        out.append(x)
        scales.append(s)
    return torch.stack(out), scales


def _one_rgb(image: Any, where: str) -> np.ndarray:
    """One image as RGB uint8 ``[H, W, 3]``; ``ValueError`` (one line) for what cannot be one."""
    if isinstance(image, (str, Path)):
        try:
            return decode_image(str(image))
        except ImageDecodeError as e:
            raise ValueError(str(e)) from None
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise ValueError(f"{where}: an image of no pixels ({image.width}x{image.height})")
        return rgb_of(image)  # grayscale (8 or 16 bits), palette, RGBA (alpha dropped)
    if isinstance(image, Tensor):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise ValueError(f"{where}: expected a path, a PIL image or an [H, W, C] array, got {type(image).__name__}")
    x = image
    if x.ndim == 2:
        x = x[:, :, None]
    if x.ndim != 3 or x.shape[2] not in (1, 3, 4):
        raise ValueError(f"{where}: expected an [H, W] or [H, W, 1|3|4] image, got shape {tuple(image.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{where}: an image of no pixels (shape {tuple(image.shape)})")
    if x.dtype.kind == "f":
        lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0 or hi > 255:
            raise ValueError(f"{where}: float image values must lie in 0..255, got {lo:g}..{hi:g}")
        if 0 < hi <= 1:
            raise ValueError(f"{where}: float image values lie in 0..{hi:g}; fastdet reads images as "
                             "0..255 (multiply a [0, 1] image by 255)")
        x = np.clip(np.rint(x), 0, 255).astype(np.uint8)
    elif x.dtype != np.uint8:
        raise ValueError(f"{where}: expected uint8 (or float 0..255) pixels, got {x.dtype}")
    if x.shape[2] == 1:
        x = np.repeat(x, 3, axis=2)
    elif x.shape[2] == 4:
        x = x[:, :, :3]  # alpha dropped, as PIL's convert("RGB") and the predict CLI do
    return x


def as_rgb_images(images: Any) -> list[np.ndarray]:
    """``images`` as a list of RGB uint8 ``[H, W, 3]`` arrays: one image or a list of them,
    each a path, a PIL image or an array / tensor ``[H, W]`` (grayscale), ``[H, W, 1|3|4]``
    (RGBA: alpha dropped), uint8 or float in 0..255; a 4-D array ``[N, H, W, C]`` is N images."""
    if isinstance(images, (str, Path)) or not isinstance(images, (list, tuple, np.ndarray, Tensor)):
        images = [images]
    elif isinstance(images, (np.ndarray, Tensor)) and images.ndim <= 3:
        images = [images]
    return [_one_rgb(im, f"images[{i}]") for i, im in enumerate(images)]


@torch.no_grad()
def detect(detector: Detector, images: Any, score_thresh: float | None = None,
           img_size: int | None = None) -> list[dict[str, Tensor]]:
    """Detections per image in its original pixels: ``{"boxes" [K,4] xyxy, "scores" [K], "labels" [K]}``.

    Args:
        images: one image or a list (see :func:`as_rgb_images`): file paths, PIL images,
            RGB/grayscale/RGBA arrays, uint8 or float in 0..255 (a float image in [0, 1]
            is refused in one line rather than read as near-black). Always a list back,
            one entry per image.
        score_thresh: overrides the recipe's (``detector.info.predict_kwargs``).
        img_size: overrides the recipe's evaluation input size ``S`` (a multiple of 32).

    Each image is resized as evaluation resizes it, on the canvas evaluation gives its
    orientation (``Preprocess.canvas``: ``S`` x ``S``; keep-ratio, FCOS: ``(S, L)``
    landscape, ``(L, S)`` portrait or ``(S, S)``); images of different canvases run as
    separate batches. The batch takes the detector's device and dtype (a ``.half()`` or
    ``.bfloat16()`` detector works); boxes and scores come back float32 on the CPU.
    """
    info: DetectorInfo = detector.info
    if img_size is not None and (img_size < 32 or img_size % 32):
        raise ValueError(f"img_size: expected a positive multiple of 32, got {img_size}")
    if score_thresh is not None and not 0.0 <= score_thresh <= 1.0:
        raise ValueError(f"score_thresh: expected a value in [0, 1], got {score_thresh}")
    size = img_size or info.img_size
    images = as_rgb_images(images)
    if not images:
        return []
    kw = dict(info.predict_kwargs)
    if score_thresh is not None:
        kw["score_thresh"] = score_thresh
    weight = next(detector.parameters())  # a half or bfloat16 detector takes its own dtype
    out: list[dict[str, Tensor]] = [{} for _ in images]
    # One batch per canvas: each image on the canvas evaluation gives its orientation.
    for canvas, idx in by_canvas([img.shape for img in images], info.preprocess, size).items():
        batch, scales = preprocess_images([images[i] for i in idx], info.preprocess, size, canvas)
        dets = detector.predict(batch.to(weight.device, weight.dtype), **kw)
        for i, det, s in zip(idx, dets, scales):
            boxes = boxes_to_original(det["boxes"].float().cpu(), s, images[i].shape[:2])
            out[i] = {"boxes": boxes, "scores": det["scores"].float().cpu(), "labels": det["labels"].cpu()}
    return out
