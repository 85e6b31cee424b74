"""Training losses and gradients against the authors' own training code, on the same weights
and the same batch (train mode: BatchNorm on batch statistics; the authors' target builders).

- YOLOX: Megvii ``yolox`` 0.3.0 (a test dependency), run live: ``YOLOX.forward(x, labels)``
  (``YOLOXHead.get_losses`` with its SimOTA), with and without the L1 loss, in float64.

Each comparison also runs with a planted change (the IoU loss not squared, the normaliser
off by one) and must then fail: the references discriminate.
"""

from __future__ import annotations

import pytest
import torch

import fastdet.models.yolox as yolox_mod


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
    state = ref.state_dict(keep_vars=True)
    converted, num_classes = from_megvii(state)
    ours = build_yolox(size, num_classes).double().train()
    ours.load_state_dict(converted)
    by_id = {id(v): k for k, v in state.items()}
    names = {k: by_id[id(v)] for k, v in converted.items() if k in dict(ours.named_parameters())}
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
    theirs, their_grads = run_megvii(ref, x, labels, use_l1)
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
    foreground. The batch has foreground on every level and the L1 term when on."""
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
