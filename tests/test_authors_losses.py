"""Training losses and gradients against the authors' own training code, on the same weights
and the same batch (train mode: BatchNorm on batch statistics; the authors' target builders).

- YOLOX: Megvii ``yolox`` 0.3.0 (a test dependency), run live: ``YOLOX.forward(x, labels)``
  (``YOLOXHead.get_losses`` with its SimOTA), with and without the L1 loss, in float64.
- PaddleDetection 2.6: fixtures recorded by tools/record_loss_fixtures.py from its own
  heads, losses and batch target builders (``tests/fixtures/paddle/loss_*.npz``): FCOS r50
  with centre sampling (``FCOSLoss`` on ``Gt2FCOSTarget``); PP-YOLOE in both assigner phases
  (``PPYOLOEHead.get_loss`` with ``ATSSAssigner`` and ``TaskAlignedAssigner``); PP-YOLO
  r18vd and r50vd_dcn with mixup weights, DropBlock at keep_prob 1 (``YOLOv3Loss`` +
  ``IouLoss`` on ``Gt2YoloTarget``; r50vd_dcn also with DCNv2 in res5, CoordConv, SPP and
  ``IouAwareLoss``).

Each comparison also runs with planted changes (the IoU loss not squared or not smoothed,
a normaliser off by one, another centre-sampling radius, the IoU-aware loss's weight, the
DCN offsets read in the other order) and must then fail: the references discriminate.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fastdet.models.yolox as yolox_mod
from fastdet.models.yolox import BGR_TO_RGB, STEM_WEIGHT


def max_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise difference relative to the reference's largest magnitude."""
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-300))


# --------------------------------------------------------------------------- Megvii YOLOX


def yolox_batch(B: int = 2, h: int = 96, w: int = 128):
    """A fixed batch: images in [0, 255] and 3 / 2 boxes (Megvii's padded [B, 120, 5] labels:
    class, cx, cy, w, h px; all-zero rows are padding) and fastdet's padded targets."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(B, 3, h, w, generator=g, dtype=torch.float64) * 255
    boxes = torch.tensor([[[10.0, 12.0, 70.0, 60.0], [60.0, 30.0, 120.0, 90.0], [30.0, 50.0, 50.0, 80.0]],
                          [[5.0, 5.0, 40.0, 30.0], [20.0, 20.0, 110.0, 85.0], [0.0, 0.0, 0.0, 0.0]]],
                         dtype=torch.float64)
    labels = torch.tensor([[3, 7, 3], [0, 5, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    megvii = torch.zeros(B, 120, 5, dtype=torch.float64)
    cxcywh = torch.cat([(boxes[..., :2] + boxes[..., 2:]) / 2, boxes[..., 2:] - boxes[..., :2]], -1)
    megvii[:, :3] = torch.cat([labels[..., None].double(), cxcywh], -1) * mask[..., None]
    return x, megvii, dict(gt_boxes=boxes, gt_labels=labels, gt_mask=mask)


def yolox_pair(size: str = "s"):
    """Megvii's model (random weights and BatchNorm statistics, test_convert.megvii_yolox) and
    fastdet's loaded from its state dict by ``from_megvii``, both float64 in train mode, and
    {fastdet name: Megvii name} of every parameter."""
    from test_convert import megvii_yolox

    from fastdet.models.yolox import build_yolox, from_megvii

    ref = megvii_yolox(size).double().train()
    converted, num_classes = from_megvii(ref.state_dict())
    ours = build_yolox(size, num_classes).double().train()
    ours.load_state_dict(converted)
    megvii_name = {"backbone": "backbone.backbone", "neck": "backbone", "head": "head"}
    names = {k: f"{megvii_name[k.split('.', 1)[0]]}.{k.split('.', 1)[1]}" for k, _ in ours.named_parameters()}
    return ref, ours, names


def run_megvii(ref, x, labels, use_l1: bool):
    ref.head.use_l1 = use_l1
    ref.zero_grad()
    out = ref(x, labels)
    out["total_loss"].backward()
    return out, {k: p.grad.clone() for k, p in ref.named_parameters()}


def run_ours(ours, x, targets, use_l1: bool):
    ours.zero_grad()
    out = ours(x, targets, use_l1=use_l1)
    out["total_loss"].backward()
    return out, {k: p.grad.clone() for k, p in ours.named_parameters()}


def yolox_differences(ref, ours, names, use_l1: bool) -> dict[str, float]:
    """Largest relative difference of each loss component and of all gradients."""
    x, labels, targets = yolox_batch()
    theirs, their_grads = run_megvii(ref, x.flip(1), labels, use_l1)  # Megvii reads BGR (from_megvii)
    their_grads[names[STEM_WEIGHT]] = their_grads[names[STEM_WEIGHT]][:, BGR_TO_RGB]
    got, our_grads = run_ours(ours, x, targets, use_l1)
    # Megvii reports 5 x the IoU loss as iou_loss; L1 is a float 0.0 when off.
    pairs = {"total_loss": ("total_loss", 1.0), "loss_iou": ("iou_loss", 5.0), "loss_obj": ("conf_loss", 1.0),
             "loss_cls": ("cls_loss", 1.0), "loss_l1": ("l1_loss", 1.0)}
    diffs = {}
    for ours_key, (their_key, scale) in pairs.items():
        want = torch.as_tensor(theirs[their_key], dtype=torch.float64)
        diffs[ours_key] = abs(float(got[ours_key].detach()) * scale - float(want)) / max(abs(float(want)), 1e-300)
    diffs["grad"] = max(max_rel(our_grads[k], their_grads[names[k]]) for k in names)
    return diffs


@pytest.fixture(scope="module")
def yolox_models():
    return yolox_pair("s")


@pytest.mark.parametrize("use_l1", [False, True], ids=["no_l1", "l1"])
def test_yolox_loss_and_gradients_are_megviis(yolox_models, use_l1):
    """YOLOX-s, float64: every loss component to 1e-12 relative, every parameter's gradient
    (head to stem) to 1e-10 of its largest element; Megvii 0.3.0's own SimOTA picks the
    foreground (7 points for the 5 boxes)."""
    ref, ours, names = yolox_models
    assert len(names) == len(list(ours.parameters()))
    diffs = yolox_differences(ref, ours, names, use_l1)
    losses = {k: v for k, v in diffs.items() if k != "grad" and (use_l1 or k != "loss_l1")}
    assert max(losses.values()) < 1e-12, diffs
    assert diffs["grad"] < 1e-10, diffs


@pytest.mark.parametrize("plant", ["iou_not_squared", "normaliser_off_by_one"])
def test_yolox_comparison_catches_a_planted_change(yolox_models, monkeypatch, plant):
    ref, ours, names = yolox_models
    if plant == "iou_not_squared":
        squared = yolox_mod.iou_loss
        monkeypatch.setattr(yolox_mod, "iou_loss", lambda p, t: (1 - (1 - squared(p, t)).sqrt()))
    else:
        monkeypatch.setattr(yolox_mod, "all_reduce_mean", lambda x: x + 1)
    diffs = yolox_differences(ref, ours, names, use_l1=True)
    assert diffs["total_loss"] > 1e-3 and diffs["grad"] > 1e-3, diffs


# --------------------------------------------------------------------------- PaddleDetection fixtures

FIXTURES = Path(__file__).parent / "fixtures" / "paddle"
_spec = importlib.util.spec_from_file_location("record_paddle_fixtures",
                                               Path(__file__).parents[1] / "tools" / "record_paddle_fixtures.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)


class PaddleCase:
    """A recorded case of tools/record_loss_fixtures.py: the batch, the authors' losses and
    gradients, and the weights rebuilt from the recorded names, shapes and seed, converted to
    fastdet's names by the family's Paddle converter (``ours_name`` maps the recorded
    gradients' Paddle names to fastdet's)."""

    def __init__(self, fixture: str, arch: str):
        from fastdet.convert import unwrap
        from fastdet.models import ARCHITECTURES

        f = np.load(FIXTURES / f"loss_{fixture}.npz")
        self.options = json.loads(str(f["options"]))
        self.x = torch.from_numpy(f["x"]).double() / 255
        self.losses = {k[len("loss/"):]: float(f[k]) for k in f.files if k.startswith("loss/")}
        self.grads = {k[len("grad/"):]: torch.from_numpy(f[k]) for k in f.files if k.startswith("grad/")}
        names = [str(n) for n in f["names"]]
        weights = record.fill(names, [tuple(s) for s in json.loads(str(f["shapes"]))], int(f["seed"]))
        torch_weights = unwrap(weights, Path(fixture))
        self.state, self.num_classes = ARCHITECTURES[arch].weight_sources["paddle"].convert(torch_weights)
        self.ours_name = {}
        for name in self.grads:
            hits = [k for k, v in self.state.items()
                    if v.shape == torch_weights[name].shape and torch.equal(v, torch_weights[name])]
            if len(hits) == 1:
                self.ours_name[name] = hits[0]

    def load(self, model: torch.nn.Module) -> torch.nn.Module:
        result = model.load_state_dict(self.state, strict=False)
        assert not result.unexpected_keys and all(k.endswith("num_batches_tracked") for k in result.missing_keys)
        return model.double().train()

    def grad_differences(self, model: torch.nn.Module, special=None) -> dict[str, float]:
        """Per recorded gradient, the largest difference relative to its largest element. A
        recorded gradient with fewer elements than its parameter is the leading block
        ``grad[:n0, :n1, ...]`` of the same rank (the recorder's ``blocks``)."""
        params = dict(model.named_parameters())
        out = {}
        for name, want in self.grads.items():
            got = special(name, params) if special and name not in self.ours_name else params[self.ours_name[name]].grad
            if got.numel() != want.numel():
                got = got[tuple(slice(0, n) for n in want.shape)]
            out[name] = max_rel(got.reshape(want.shape), want)
        return out


def loss_differences(got: dict, want: dict, pairs: dict[str, str]) -> dict[str, float]:
    return {ours: abs(float(got[ours].detach()) - want[theirs]) / abs(want[theirs]) for ours, theirs in pairs.items()}


# FCOS -----------------------------------------------------------------------------------------


def fcos_run(case: PaddleCase, box_loss: str = "paddle"):
    from fastdet.models.fcos import build_fcos

    o = case.options
    model = case.load(build_fcos("r50", case.num_classes, from_scratch=True, box_loss=box_loss))
    bounds = [0.0] + [float(b) for b in o["boundaries"]] + [float("inf")]
    model.head.size_ranges = tuple(zip(bounds[:-1], bounds[1:]))
    model.head.radius = o["radius"]
    classes = torch.tensor(o["classes"])
    targets = dict(gt_boxes=torch.tensor(o["boxes"], dtype=torch.float64), gt_labels=classes.clamp(min=0),
                   gt_mask=classes >= 0)
    out = model(case.x, targets)
    out["total_loss"].backward()
    losses = loss_differences(out, case.losses, {"loss_cls": "loss_cls", "loss_box": "loss_box",
                                                 "loss_ctr": "loss_quality", "total_loss": "total"})

    def scales(name, params):  # fcos_head.p{3..7}_feat.scale_reg -> head.scales[0..4]
        return params["head.scales"].grad[int(name.split(".")[1][1]) - 3]

    return losses, case.grad_differences(model, scales)


@pytest.fixture(scope="module")
def fcos_case():
    return PaddleCase("fcos_r50", "fcos")


def test_fcos_loss_and_gradients_are_paddles(fcos_case):
    """FCOS r50 (4 classes, trainable BatchNorm) on a 2 x 64 x 96 batch with centre sampling,
    against FCOSHead + FCOSLoss + Gt2FCOSTarget: each loss component and the gradients of
    the regression, classification and centerness outputs' biases, the five per-level scales, the
    towers, the FPN and the backbone's last and first BatchNorm. Both in float64, but
    Gt2FCOSTarget rounds the centerness targets to float32 (the box loss's weights and the
    centerness BCE's targets): 3.5e-9 on loss_ctr, 2e-8 on the gradients."""
    assert len(fcos_case.ours_name) == len(fcos_case.grads) - 5 == 9  # all but the five scales
    losses, grads = fcos_run(fcos_case)
    assert max(losses.values()) < 1e-7, losses
    assert max(grads.values()) < 1e-6, grads


@pytest.mark.parametrize("plant", ["plain_giou", "radius_1", "normaliser_off_by_one"])
def test_fcos_comparison_catches_a_planted_change(fcos_case, monkeypatch, plant):
    import fastdet.models.fcos as fcos_mod

    box_loss = "giou" if plant == "plain_giou" else "paddle"
    if plant == "radius_1":
        monkeypatch.setitem(fcos_case.options, "radius", 1.0)
    elif plant == "normaliser_off_by_one":
        monkeypatch.setattr(fcos_mod, "all_reduce_mean", lambda x: x + 1)
    losses, grads = fcos_run(fcos_case, box_loss)
    assert max(losses.values()) > 1e-3 and max(grads.values()) > 1e-3, (losses, grads)


# PP-YOLOE ---------------------------------------------------------------------------------------


def ppyoloe_run(case: PaddleCase, static_assigner: bool, loss_weights: dict | None = None):
    from fastdet.models import build_model

    o = case.options
    model = case.load(build_model("ppyoloe", "s", case.num_classes, width_mult=o["width"], depth_mult=o["depth"]))
    model.head.loss_weights.update(loss_weights or {})
    classes = torch.tensor(o["classes"])
    targets = dict(gt_boxes=torch.tensor(o["boxes"], dtype=torch.float64), gt_labels=classes.clamp(min=0),
                   gt_mask=classes >= 0)
    out = model(case.x, targets, static_assigner=static_assigner)
    out["total_loss"].backward()
    pairs = {"loss_cls": "loss_cls", "loss_iou": "loss_iou", "loss_dfl": "loss_dfl", "total_loss": "total"}
    return loss_differences(out, case.losses, pairs), case.grad_differences(model)


@pytest.fixture(scope="module")
def ppyoloe_cases():
    return {phase: PaddleCase(f"ppyoloe_{phase}", "ppyoloe") for phase in ("atss", "tal")}


@pytest.mark.parametrize("phase", ["atss", "tal"])
def test_ppyoloe_loss_and_gradients_are_paddles(ppyoloe_cases, phase):
    """PP-YOLOE-s at width 0.125, 4 classes, on a 2 x 96 x 128 batch with a padded slot,
    against PPYOLOEHead.get_loss with its ATSSAssigner (epoch 0) and TaskAlignedAssigner
    (epoch 100), float64: each loss component, and the gradients of the class and distance
    outputs' biases, the ESE attention and head stems, the neck, the backbone's last stage
    and its stem. Both assigners build their soft targets on a float32 one-hot in place
    (``F.one_hot(...) * ious``), so Paddle's loss weights are float32: 1.4e-7 on the class
    loss, 3e-6 on the gradients."""
    case = ppyoloe_cases[phase]
    assert len(case.ours_name) == len(case.grads)
    losses, grads = ppyoloe_run(case, static_assigner=phase == "atss")
    assert max(losses.values()) < 1e-6, losses
    assert max(grads.values()) < 1e-5, grads


@pytest.mark.parametrize("plant", ["other_assigner", "normaliser_off_by_one", "dfl_weight"])
@pytest.mark.parametrize("phase", ["atss", "tal"])
def test_ppyoloe_comparison_catches_a_planted_change(ppyoloe_cases, monkeypatch, phase, plant):
    import fastdet.models.ppyoloe as ppyoloe_mod

    static = phase == "atss"
    if plant == "other_assigner":
        static = not static
    elif plant == "normaliser_off_by_one":
        monkeypatch.setattr(ppyoloe_mod, "all_reduce_mean", lambda x: x + 1)
    losses, grads = ppyoloe_run(ppyoloe_cases[phase], static, {"dfl": 0.25} if plant == "dfl_weight" else None)
    assert max(losses.values()) > 1e-3 and max(grads.values()) > 1e-3, (losses, grads)


# PP-YOLO ----------------------------------------------------------------------------------------


def ppyolo_run(case: PaddleCase, tweak=None):
    from fastdet.models.ppyolo import DropBlock, build_ppyolo

    o = case.options
    model = case.load(build_ppyolo(o["size"], case.num_classes))
    for m in model.modules():
        if isinstance(m, DropBlock):
            m.keep_prob = 1.0  # as recorded: no draw, the input passes through
    if tweak:
        tweak(model)
    classes = torch.tensor(o["classes"])
    targets = dict(gt_boxes=torch.tensor(o["boxes"], dtype=torch.float64), gt_labels=classes.clamp(min=0),
                   gt_mask=classes >= 0, gt_scores=torch.tensor(o["scores"], dtype=torch.float64))
    out = model(case.x, targets)
    out["total_loss"].backward()
    pairs = {k: k for k in case.losses if k != "total"} | {"total_loss": "total"}
    assert set(pairs) == set(out), (sorted(pairs), sorted(out))
    return loss_differences(out, case.losses, pairs), case.grad_differences(model)


@pytest.fixture(scope="module")
def ppyolo_case():
    return PaddleCase("ppyolo_r18vd", "ppyolo")


def test_ppyolo_loss_and_gradients_are_paddles(ppyolo_case):
    """PP-YOLO r18vd, 4 classes, on a 2 x 96 x 128 batch with mixup weights and a padded
    slot, against YOLOv3Head + YOLOv3Loss + IouLoss on Gt2YoloTarget's grid targets,
    float64: each loss component, and the gradients of both output convs' biases, the neck's
    BatchNorm, res5 and the stem. Gt2YoloTarget writes its targets into float32 arrays, which
    bounds the agreement."""
    assert len(ppyolo_case.ours_name) == len(ppyolo_case.grads)
    losses, grads = ppyolo_run(ppyolo_case)
    assert max(losses.values()) < 1e-6, losses
    assert max(grads.values()) < 1e-5, grads


@pytest.fixture(scope="module")
def ppyolo_r50_case():
    return PaddleCase("ppyolo_r50vd_dcn", "ppyolo")


def test_ppyolo_r50vd_dcn_loss_and_gradients_are_paddles(ppyolo_r50_case):
    """PP-YOLO r50vd_dcn at full width, 4 classes, on the same batch (its 7 boxes on all
    three levels), against ResNet-vd with DCNv2 in res5, PPYOLOFPN (CoordConv, SPP),
    YOLOv3Head with the IoU-aware branch and YOLOv3Loss + IouLoss + IouAwareLoss on
    Gt2YoloTarget's grid targets, float64 (Paddle's deformable conv included): each loss
    component, loss_iou_aware among them, and the gradients of the three output convs'
    biases, a CoordConv tip's and the SPP's BatchNorm, res5's DCN (the strided res5a:
    leading blocks of its offset/mask conv and deformable weight, their biases and norm;
    res5c's offset bias) and the stem. Measured: 4.6e-7 on loss_xy, 2e-7 on the gradients
    (the DCN weight). Bound by the float32 grid targets (Gt2YoloTarget's and fastdet's
    yolo_targets): given Paddle's targets in float64, 3e-9 / 1e-8, the rest being Paddle's
    IoU eps added in normalised image units (fastdet's cell units: 3e-9 on loss_iou) and
    its float64 BatchNorm's one-pass variance."""
    case = ppyolo_r50_case
    assert len(case.ours_name) == len(case.grads)
    losses, grads = ppyolo_run(case)
    assert "loss_iou_aware" in losses
    assert max(losses.values()) < 1e-6, losses
    assert max(grads.values()) < 1e-6, grads


def _swap_dcn_offsets(deform_conv2d):
    """The DCN offsets read as (dx, dy) pairs instead of (dy, dx)."""
    def swapped(x, offset, *args, **kwargs):
        b, n, h, w = offset.shape
        return deform_conv2d(x, offset.reshape(b, n // 2, 2, h, w).flip(2).reshape(b, n, h, w), *args, **kwargs)
    return swapped


@pytest.mark.parametrize("size, plant", [("r18vd", "iou_not_squared"), ("r18vd", "no_mixup_weights"),
                                         ("r18vd", "ignore_thresh"), ("r50vd_dcn", "iou_aware_weight"),
                                         ("r50vd_dcn", "dcn_offsets_swapped")])
def test_ppyolo_comparison_catches_a_planted_change(request, monkeypatch, size, plant):
    """r50vd_dcn: IouAwareLoss weighted 0.5 instead of 1.0; the deformable conv's offsets
    read in the other (dx, dy) order. (The iou_aware_factor is used at inference only, not
    in the loss.)"""
    import fastdet.models.backbones.resnet_vd as resnet_vd
    import fastdet.models.ppyolo as ppyolo_mod

    case = request.getfixturevalue("ppyolo_case" if size == "r18vd" else "ppyolo_r50_case")
    if plant == "no_mixup_weights":
        monkeypatch.setitem(case.options, "scores", [[1.0] * 4, [1.0] * 3 + [0.0]])
    if plant == "iou_not_squared":
        paired = ppyolo_mod._iou_paired
        monkeypatch.setattr(ppyolo_mod, "_iou_paired", lambda a, b: paired(a, b).sqrt())
    if plant == "dcn_offsets_swapped":
        monkeypatch.setattr(resnet_vd, "deform_conv2d", _swap_dcn_offsets(resnet_vd.deform_conv2d))
    tweak = {"ignore_thresh": lambda m: setattr(m.head, "ignore_thresh", 0.5),
             "iou_aware_weight": lambda m: setattr(m.head, "iou_aware_loss_weight", 0.5)}.get(plant)
    losses, grads = ppyolo_run(case, tweak)
    assert max(losses.values()) > 1e-3 and max(grads.values()) > 1e-3, (losses, grads)
