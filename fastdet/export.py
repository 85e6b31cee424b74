"""``python -m fastdet.export --ckpt PATH --format onnx --output FILE``: an ONNX model of a checkpoint.

The graph's input is ``images`` float32 ``[N, 3, H, W]``, preprocessed as
``fastdet.predict`` does (``fastdet.api.preprocess_images``: the family's evaluation
resize onto the ``H`` x ``W`` canvas, then its normalisation); ``N`` is 1, or any with
``--dynamic-batch``. The canvas is fixed in the graph: ``S`` x ``S`` with ``S`` =
``--img-size`` (default: the recipe's evaluation size) for the families that stretch or
letterbox (PP-YOLOE, PP-YOLO, YOLOX). A keep-ratio family (FCOS) evaluates each image on
the canvas of its orientation, landscape ``(S, L)``, portrait ``(L, S)`` or square
``(S, S)`` (``L = ceil32(S * 1333 / 800)``; at 800: 800 x 1344, 1344 x 800, 800 x 800):
``--canvas`` picks the one exported (default ``landscape``); export once per canvas to
serve every orientation at evaluation's scale (an image of another orientation fed to a
landscape graph fits only scaled smaller than evaluation saw it).

Outputs, without ``--nms``: ``boxes`` ``[N, A, 4]`` (xyxy, input px) and ``scores``
``[N, A, C]`` (probabilities), the dense outputs of ``model(images)``. With ``--nms``:
the detections after the recipe's NMS (``Detector.predict``: top ``pre_nms_topk``
(anchor, class) scores, above ``score_thresh``, per-class NMS at ``iou_thresh``, the
best ``max_det``; ``--set family.<field>=value`` changes them, e.g. ``--set
family.nms_iou=0.5``), done by the ONNX ``NonMaxSuppression`` op, in fixed-size outputs:
``boxes`` ``[N, D, 4]``, ``scores`` ``[N, D]``, ``labels`` ``[N, D]`` int64 (contiguous
class index) and ``num_dets`` ``[N]`` int64; row ``j < num_dets[n]`` of image ``n`` is a
detection, by descending score; the rest are zeros. ``D = max_det``.

The exporter is ``torch.onnx.export(dynamo=True)`` (``torch.export`` + onnxscript), for
both graphs: it exports every registered family, and the NMS is one custom op whose
translation is the ONNX op, with a data-dependent output size that ``torch.export``
represents and the TorchScript exporter's tracing would freeze. The exported file is
checked with ``onnx.checker``, holds only standard ONNX ops (no ``fastdet.ops`` kernel),
and is run once with onnxruntime against torch; the largest difference is printed.
Needs ``pip install 'fastdet[export]'`` (onnx, onnxruntime, onnxscript).

``--nms`` builds each family's own NMS from the ONNX ``NonMaxSuppression`` op: the base
multiclass NMS (PP-YOLOE, FCOS: every (anchor, class) pair a candidate) and YOLOX's (each
anchor's best class only, class-aware NMS, every candidate above the threshold).
PP-YOLO's Matrix NMS decays scores instead, which the op cannot: PP-YOLO is exported
dense only (``--nms`` is refused, in one line).

The file is self-describing: its metadata (``onnx.load(f).metadata_props``, or
onnxruntime's ``get_modelmeta().custom_metadata_map``) holds ``class_names``,
``category_ids``, ``input_size`` (the canvas ``[H, W]``), ``canvas`` (its orientation:
landscape / portrait / square), ``canvases`` (the family's at this size), ``resize``
(stretch / letterbox / keep_ratio), ``resize_note`` (the resize onto this canvas as a
formula with its numbers; keep-ratio: which images the canvas is for),
``pad_value``, ``interpolation`` (the exact call: ``torch.nn.functional.interpolate`` on
uint8 pixels, ``antialias=False``; PIL's filters give other values), ``mean``/``std``
(on 0..255) and the NMS settings of the recipe (with ``--nms`` also ``nms_form``: which
candidates entered the NMS, ``multiclass`` or ``best_class``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import Tensor, nn

from fastdet.api import CheckpointError, load_detector, preprocess_images
from fastdet.config import parse_postprocess_args
from fastdet.data.preprocess import Preprocess
from fastdet.data.schedule import HW, ORIENTATION_OF, ORIENTATIONS
from fastdet.models import Detector
from fastdet.runtime.outputs import refuse_replacing

OPSET = 18
OUTPUTS_DENSE = ("boxes", "scores")
OUTPUTS_NMS = ("boxes", "scores", "labels", "num_dets")


# --------------------------------------------------------------------------- the NMS op

@torch.library.custom_op("fastdet_export::nms", mutates_args=())
def _nms(boxes: Tensor, scores: Tensor, max_per_class: int, iou_thresh: float, score_thresh: float) -> Tensor:
    """ONNX ``NonMaxSuppression`` in torch: boxes ``[N, A, 4]``, scores ``[N, C, A]`` →
    selected ``[K, 3]`` int64 rows ``(image, class, anchor)``; per image and class the
    boxes scoring above ``score_thresh`` after NMS at ``iou_thresh``, at most ``max_per_class``."""
    rows = [torch.zeros(0, 3, dtype=torch.int64, device=boxes.device)]
    for n in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[n, c]
            idx = (s > score_thresh).nonzero().flatten()
            keep = idx[torchvision.ops.nms(boxes[n, idx].float(), s[idx].float(), iou_thresh)[:max_per_class]]
            rows.append(torch.stack([torch.full_like(keep, n), torch.full_like(keep, c), keep], 1))
    return torch.cat(rows)


@_nms.register_fake
def _(boxes: Tensor, scores: Tensor, max_per_class: int, iou_thresh: float, score_thresh: float) -> Tensor:
    k = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((k, 3), dtype=torch.int64)


def _nms_onnx(boxes, scores, max_per_class: int, iou_thresh: float, score_thresh: float):
    from onnxscript import opset18 as op  # optional: the export extra

    return op.NonMaxSuppression(boxes, scores, op.Constant(value_ints=[max_per_class]),
                                op.Constant(value_floats=[iou_thresh]),
                                op.Constant(value_floats=[score_thresh]), center_point_box=0)


class Dense(nn.Module):
    """``images -> (boxes [N,A,4], scores [N,A,C])``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        return self.model(images)


class WithNMS(nn.Module):
    """``images -> (boxes [N,D,4], scores [N,D], labels [N,D], num_dets [N])``: the model's
    ``predict`` as fixed-size tensors, for an NMS of ``form`` ``multiclass`` or ``best_class``
    (``Detector.nms_form``)."""

    def __init__(self, model: nn.Module, score_thresh: float, iou_thresh: float, max_det: int,
                 pre_nms_topk: int, per_class_topk: bool = False, form: str = "multiclass"):
        super().__init__()
        self.model = model
        self.score_thresh, self.iou_thresh = float(score_thresh), float(iou_thresh)
        self.max_det, self.pre_nms_topk = int(max_det), int(pre_nms_topk)
        self.per_class_topk = bool(per_class_topk)
        self.best_class = form == "best_class"

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        boxes, scores = self.model(images)  # [N, A, 4], [N, A, C]
        n, a, c = scores.shape
        if self.best_class:
            # Each anchor keeps only its best class's score (ties: the lower class, as
            # argmax), so per-class NMS over these is the class-aware NMS of (box, best
            # score, best label) that yolox_postprocess runs.
            best = scores.argmax(-1, keepdim=True)  # [N, A, 1]
            scores = torch.zeros_like(scores).scatter(-1, best, scores.gather(-1, best))
        if self.best_class and self.pre_nms_topk <= 0:  # YOLOX's 0: every candidate enters the NMS
            cand = scores.transpose(1, 2)  # [N, C, A]
        elif self.per_class_topk:  # the top-k of each class survive, as multiclass_nms(per_class_topk=True)
            per_class = scores.transpose(1, 2)  # [N, C, A]
            top_s, top_i = per_class.topk(min(self.pre_nms_topk, a), dim=2)
            cand = torch.zeros_like(per_class).scatter(2, top_i, top_s)  # [N, C, A]
        else:
            flat = scores.reshape(n, a * c)  # anchor-major, as multiclass_nms ranks them
            top_s, top_i = flat.topk(min(self.pre_nms_topk, a * c), dim=1)
            cand = torch.zeros_like(flat).scatter(1, top_i, top_s)  # only the top-k survive
            cand = cand.reshape(n, a, c).transpose(1, 2)  # [N, C, A], NonMaxSuppression's layout
        sel = torch.ops.fastdet_export.nms(boxes, cand, self.max_det, self.iou_thresh, self.score_thresh)
        b, k, i = sel[:, 0], sel[:, 1], sel[:, 2]  # [K] each
        kept = torch.zeros_like(cand).index_put((b, k, i), cand[b, k, i]).reshape(n, c * a)
        det_s, det_i = kept.topk(min(self.max_det, c * a), dim=1)  # [N, D], class-major index
        labels = torch.div(det_i, a, rounding_mode="floor")
        anchor = det_i - labels * a
        det_b = boxes.gather(1, anchor.unsqueeze(-1).expand(-1, -1, 4))
        valid = det_s > 0
        return (det_b * valid.unsqueeze(-1), det_s, labels * valid, valid.sum(1))


# --------------------------------------------------------------------------- export + check

def export_nms_form(detector: nn.Module) -> str | None:
    """The form of ``detector.predict``'s NMS that ``WithNMS`` rebuilds (``Detector.nms_form``),
    as declared by the class that defines ``predict``: a subclass that overrides ``predict``
    without declaring its form gets None (refused), never the form of the NMS it replaced."""
    owner = next(k for k in type(detector).__mro__ if "predict" in vars(k))
    return vars(owner).get("nms_form") if issubclass(owner, Detector) else None


def export_canvas(preprocess: Preprocess | None, img_size: int, canvas: str | None = None) -> tuple[str, HW]:
    """``(orientation, (H, W))`` of the exported input at size ``img_size``: ``canvas`` of
    the family's canvases (``Preprocess.canvases``), by default its first (keep-ratio:
    ``landscape``; the others: their one ``square``). ``ValueError`` (one line) for a canvas
    the family does not have. Without a preprocessing (a bare model): the square."""
    named = preprocess.canvases().named(img_size) if preprocess is not None else {"square": (img_size, img_size)}
    if canvas is None:
        canvas = next(iter(named))
    if canvas not in named:
        how = f"resize {preprocess.resize}" if preprocess is not None else "no preprocessing"
        raise ValueError(f"--canvas {canvas}: expected one of {', '.join(named)} ({how} puts every image on "
                         + (f"the {img_size}x{img_size} canvas)" if len(named) == 1 else "one of these)"))
    return canvas, named[canvas]


def export_onnx(detector: nn.Module, output: str | Path, img_size: int, dynamic_batch: bool = False,
                nms: bool = False, predict_kwargs: dict[str, Any] | None = None, canvas: str | None = None) -> Path:
    """Write the ONNX model of ``detector`` (eval mode, on the CPU) to ``output``; checked with onnx.checker.

    The input is ``[N, 3, H, W]`` on the canvas ``canvas`` (:func:`export_canvas`) of size ``img_size``."""
    import onnx  # optional: the export extra (pip install 'fastdet[export]')

    output = Path(output)
    info = getattr(detector, "info", None)
    canvas, (height, width) = export_canvas(info.preprocess if info is not None else None, img_size, canvas)
    module: nn.Module = Dense(detector)
    names = OUTPUTS_DENSE
    table, form = None, None
    if nms:
        form = export_nms_form(detector)
        if form is None:
            raise ValueError(f"--nms: {type(detector).__name__} has its own NMS (its predict), which the ONNX "
                             "NonMaxSuppression op does not reproduce: export without --nms")
        kw = predict_kwargs or detector.info.predict_kwargs
        module = WithNMS(detector, kw["score_thresh"], kw["iou_thresh"], kw["max_det"], kw["pre_nms_topk"],
                         kw.get("per_class_topk", detector.predict_defaults.get("per_class_topk", False)), form)
        names = OUTPUTS_NMS
        table = {torch.ops.fastdet_export.nms.default: _nms_onnx}
    example = torch.zeros(2 if dynamic_batch else 1, 3, height, width)
    shapes = {"images": {0: torch.export.Dim("batch", min=1, max=4096)}} if dynamic_batch else None
    program = torch.onnx.export(module.eval(), (example,), None, input_names=["images"], output_names=list(names),
                                dynamic_shapes=shapes, custom_translation_table=table, dynamo=True,
                                opset_version=OPSET, verbose=False)
    output.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(output))
    proto = onnx.load(str(output))
    onnx.checker.check_model(proto, full_check=True)
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in proto.graph.node if n.domain not in ("", "ai.onnx")})
    if foreign or proto.functions:
        raise RuntimeError(f"{output}: the graph holds non-standard ops {foreign or [f.name for f in proto.functions]}")
    if info is not None:
        onnx.helper.set_model_props(proto, onnx_metadata(info, img_size, form, predict_kwargs, canvas))
        onnx.save(proto, str(output))
    return output


def resize_note(p: Preprocess, hw: HW, canvas: str, others: tuple[str, ...]) -> str:
    """What a consumer does to put an ``h`` x ``w`` image on the ``hw`` canvas as ``p`` does
    (``Preprocess.__call__``), with this canvas's numbers, and which images it is for."""
    H, W = hw
    placed = ("resized to floor(h * r) x floor(w * r), pasted top-left, the rest pad_value; "
              + ("sx = sy = r" if p.box_scale == "ratio" else "sx = floor(w * r) / w, sy = floor(h * r) / h"))
    if p.resize == "stretch":
        return f"each side scaled to the {H}x{W} canvas (aspect ratio not kept): sx = {W} / w, sy = {H} / h"
    if p.resize == "letterbox":
        return f"aspect kept: r = min({H} / h, {W} / w), {placed}"
    S = min(H, W)
    long_max = S * p.max_long / p.short  # Preprocess.scale's limit at this canvas's scale
    return (f"aspect kept: r = min({H} / h, {W} / w, {S} / min(h, w), {long_max:.10g} / max(h, w)) (short side "
            f"{S}, long side at most {S} * {p.max_long} / {p.short} = {long_max:.10g}, within the {H}x{W} "
            f"canvas), {placed}. The {canvas} canvas is evaluation's for images with {ORIENTATION_OF[canvas]}; "
            f"an image of another orientation fits it only scaled smaller than evaluation saw it: export "
            f"--canvas {' / '.join(others)} for those")


def onnx_metadata(info: Any, img_size: int, nms_form: str | None, predict_kwargs: dict[str, Any] | None = None,
                  canvas: str | None = None) -> dict[str, str]:
    """What a deployment needs to feed the graph and read its outputs, as ONNX metadata
    (``metadata_props``: string keys and values; lists and mappings as JSON). ``nms_form``:
    the NMS the graph ends with (``Detector.nms_form``), None for the dense outputs;
    ``canvas``: the exported one (:func:`export_canvas`).

    ``interpolation`` names the exact resize (``torch.nn.functional.interpolate`` on uint8
    pixels, ``align_corners=False, antialias=False``); PIL's resize filters an image before
    sampling and gives different input values."""
    import json

    p = info.preprocess
    canvas, hw = export_canvas(p, img_size, canvas)
    named = p.canvases().named(img_size)
    mode = {"nearest": "nearest-exact", "linear": "bilinear", "cubic": "bicubic"}[p.interp]
    interp = (f"torch.nn.functional.interpolate(uint8 NCHW, mode='{mode}'"
              + (")" if mode == "nearest-exact" else ", align_corners=False, antialias=False)"))
    kw = dict(predict_kwargs or info.predict_kwargs or {})
    meta = {
        "producer": "fastdet.export",
        "arch": info.arch, "size": info.size,
        "class_names": json.dumps(list(info.class_names)),
        "category_ids": json.dumps([int(c) for c in info.cat_ids]),
        "input": "images float32 [N, 3, H, W], RGB",
        "input_size": json.dumps(list(hw)),
        "canvas": canvas,
        "canvases": json.dumps({k: list(v) for k, v in named.items()}),
        "resize": p.resize,
        "resize_note": resize_note(p, hw, canvas, tuple(o for o in ORIENTATIONS if o in named and o != canvas)),
        "pad_value": json.dumps(float(p.pad_value)),
        "interpolation": interp,
        "mean": json.dumps(list(p.mean) if p.mean is not None else None),
        "std": json.dumps(list(p.std) if p.std is not None else None),
        "normalize": ("(pixel 0..255 - mean) / std per RGB channel" if p.mean is not None
                      else "none: raw 0..255 pixels as float32"),
        "boxes": "xyxy in input pixels; divide x by sx and y by sy (input px per original px) for the original image",
        "outputs": "boxes, scores, labels, num_dets (after NMS)" if nms_form else "boxes [N, A, 4], scores [N, A, C] (before NMS)",
        "nms": json.dumps({k: kw[k] for k in ("score_thresh", "iou_thresh", "max_det", "pre_nms_topk", "per_class_topk")
                           if k in kw}),
    }
    if nms_form:  # which candidates entered the NMS
        meta["nms_form"] = nms_form
    return meta


@torch.no_grad()
def compare_with_torch(detector: nn.Module, path: str | Path, images: Tensor, nms: bool = False,
                       predict_kwargs: dict[str, Any] | None = None) -> tuple[float, int, int]:
    """Run ``path`` with onnxruntime on ``images`` against torch.

    Returns ``(largest absolute difference, unmatched, total)``. Dense: over ``boxes`` and
    ``scores``; ``unmatched = total = 0``. NMS: each onnxruntime detection is paired with
    the torch detection (``detector.predict``) of the same image and class whose box is
    nearest; pairs within 0.01 px and 1e-4 in score match, the difference is taken over
    them. ``total`` is the larger side's count per image, ``unmatched`` the part of it left
    without a pair (0..total). Those appear where candidate scores tie (an untrained model
    scores every anchor at its prior): the greedy NMS order, and so the kept boxes, then
    depend on rounding.
    """
    import onnxruntime as ort  # optional: the export extra

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outs = sess.run(None, {"images": images.numpy()})
    if not nms:
        ref = detector(images)
        return max(float((torch.from_numpy(o) - r).abs().max()) for o, r in zip(outs, ref)), 0, 0
    kw = predict_kwargs or detector.info.predict_kwargs
    return match_detections(outs, detector.predict(images, **kw))


def match_detections(outs: list, refs: list[dict[str, Tensor]]) -> tuple[float, int, int]:
    """``(largest difference, unmatched, total)`` of the NMS outputs ``outs`` (boxes [N, K, 4],
    scores [N, K], labels [N, K], counts [N], numpy) against torch's detections per image
    (:func:`compare_with_torch`)."""
    diff, matched, total = 0.0, 0, 0
    for j, r in enumerate(refs):
        k = int(outs[3][j])
        boxes, scores = torch.from_numpy(outs[0][j, :k]), torch.from_numpy(outs[1][j, :k])
        labels = torch.from_numpy(outs[2][j, :k])
        total += max(k, len(r["scores"]))
        if k == 0 or len(r["scores"]) == 0:
            continue
        dist = (boxes[:, None] - r["boxes"][None].float()).abs().amax(-1)  # [k, K] px
        dist[labels[:, None] != r["labels"][None]] = float("inf")
        near, idx = dist.min(1)
        sdiff = (scores - r["scores"][idx].float()).abs()
        ok = (near < 1e-2) & (sdiff < 1e-4)
        matched += len(set(idx[ok].tolist()))  # torch detections with an onnxruntime one paired
        if ok.any():
            diff = max(diff, float(near[ok].max()), float(sdiff[ok].max()))
    return diff, total - matched, total


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastdet.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="PATH", help="a checkpoint written by fastdet.train")
    p.add_argument("--format", choices=["onnx"], default="onnx")
    p.add_argument("--output", required=True, metavar="FILE", help="the .onnx file to write")
    p.add_argument("--img-size", type=int, default=None, help="input size S (default: the recipe's evaluation size)")
    p.add_argument("--canvas", choices=ORIENTATIONS, default=None,
                   help="the input canvas of a keep-ratio family (FCOS): landscape (S, L) (default), portrait "
                        "(L, S) or square (S, S); the other families have the one square S x S")
    p.add_argument("--dynamic-batch", action="store_true", help="any batch size N (default: N = 1)")
    p.add_argument("--nms", action="store_true", help="detections after NMS instead of the dense outputs")
    p.add_argument("--score-thresh", type=float, default=None, help="with --nms (default: the recipe's)")
    p.add_argument("--weights", choices=["ema", "model"], default="ema")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--set", action="append", default=[], metavar="family.FIELD=VALUE",
                   help="with --nms: change the recipe's NMS, e.g. --set family.nms_iou=0.5 (repeatable; the "
                        "fields the family's post-processing reads)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.img_size is not None and (args.img_size < 32 or args.img_size % 32):
            raise ValueError(f"--img-size: expected a positive multiple of 32, got {args.img_size}")
        if args.score_thresh is not None and not 0.0 <= args.score_thresh <= 1.0:
            raise ValueError(f"--score-thresh: expected a value in [0, 1], got {args.score_thresh}")
        if args.score_thresh is not None and not args.nms:
            raise ValueError("--score-thresh is the threshold of the exported NMS: give --nms too (the dense "
                             "outputs keep every score, to threshold where they are read)")
        post = parse_postprocess_args(args.set)
        if post and not args.nms:
            raise ValueError(f"--set family.{next(iter(post))} changes the exported NMS: give --nms too (the dense "
                             "outputs are before any post-processing)")
        if "score_thresh" in post and args.score_thresh is not None:
            raise ValueError("--score-thresh and --set family.score_thresh: give one of them")
        if not Path(args.ckpt).exists():  # a folder: load_detector names the checkpoints in it
            raise ValueError(f"--ckpt {args.ckpt}: no such file")
        if Path(args.output).is_dir():
            raise ValueError(f"--output {args.output} is a folder; name the file to write (e.g. {Path(args.output) / 'model.onnx'})")
        if Path(args.output).resolve() == Path(args.ckpt).resolve():
            raise ValueError(f"--output {args.output} is the checkpoint; choose another path")
        if not args.overwrite:
            refuse_replacing([Path(args.output)], f"--output {args.output}", "--overwrite")
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--format onnx needs {e.name}: pip install 'fastdet[export]'") from None
        det = load_detector(args.ckpt, ema=args.weights == "ema", arg_names={}, postprocess=post)  # no --arch here
    except (ValueError, CheckpointError) as e:
        print(f"fastdet.export: error: {e}", file=sys.stderr)
        return 2
    size = args.img_size or det.info.img_size
    kw = dict(det.info.predict_kwargs)
    if args.score_thresh is not None:
        kw["score_thresh"] = args.score_thresh
    try:
        canvas, (height, width) = export_canvas(det.info.preprocess, size, args.canvas)  # before the export's work
        path = export_onnx(det, args.output, size, args.dynamic_batch, args.nms, kw, canvas)
    except ValueError as e:
        print(f"fastdet.export: error: {e}", file=sys.stderr)
        return 2
    # A check input: random pictures of the canvas's shape through the real preprocessing;
    # 2 images where N is dynamic.
    g = torch.Generator().manual_seed(0)
    pics = [torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
            for _ in range(2 if args.dynamic_batch else 1)]
    images, _ = preprocess_images(pics, det.info.preprocess, size, (height, width))
    diff, unmatched, total = compare_with_torch(det, path, images, args.nms, kw)
    n = "N" if args.dynamic_batch else "1"
    outs = ", ".join(OUTPUTS_NMS if args.nms else OUTPUTS_DENSE)
    counts = ""
    if args.nms:
        counts = f"; {total - unmatched} of {total} detections match torch's"
        if unmatched:
            counts += " (the others differ where scores tie, e.g. an untrained model)"
    print(f"exported {det.info.arch}-{det.info.size} ({det.info.weights} weights) to {path}: "
          f"images [{n},3,{height},{width}] ({canvas} canvas) -> {outs}; onnx.checker passed{counts}; onnxruntime vs "
          f"torch max abs difference {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
