"""FCOS R50-FPN: registry, the parameter table against torchvision, the frozen and from-scratch
backbone forms, the contract (losses, gradients exactly where they should be, dense outputs,
detections), loading a torchvision ResNet-50 state dict, graph capture and compilation,
and the loss's targets."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torchvision
from torchvision.ops import FrozenBatchNorm2d

from fastdet.models.fcos import FAMILY, build_fcos
from fastdet.models.fcos import FCOSHead, feature_shapes
from fastdet.models.flops import count_flops, count_params

TORCHVISION_PARAMS = 32_269_600  # torchvision fcos_resnet50_fpn, 91-class head
LOSS_KEYS = {"total_loss", "loss_cls", "loss_box", "loss_ctr"}
# Ranges / 16, so that a 128-px image has positives on all five levels.
SMALL_RANGES = ((0.0, 4.0), (4.0, 8.0), (8.0, 16.0), (16.0, 32.0), (32.0, float("inf")))


def toy_batch(B: int = 1, img: int = 128):
    """One box per level for SMALL_RANGES (largest first) and a padded slot holding junk."""
    g = torch.Generator().manual_seed(0)
    boxes = torch.tensor([[2.0, 2.0, 126.0, 126.0], [8.0, 8.0, 56.0, 56.0], [36.0, 36.0, 60.0, 60.0],
                          [18.0, 18.0, 30.0, 30.0], [9.0, 9.0, 15.0, 15.0], [5.0, 5.0, 90.0, 70.0]])
    targets = dict(
        gt_boxes=(boxes * img / 128).expand(B, 6, 4).clone(),
        gt_labels=torch.tensor([[0, 1, 2, 0, 1, 2]]).expand(B, 6).clone(),
        gt_mask=torch.tensor([[True, True, True, True, True, False]]).expand(B, 6).clone(),
    )
    return torch.randn(B, 3, img, img, generator=g), targets


def small_model(**options):
    torch.manual_seed(0)
    model = build_fcos("r50", num_classes=3, **options)
    model.head.size_ranges = SMALL_RANGES
    return model


# --------------------------------------------------------------------------- registry, table


def test_family_and_its_preprocessing():
    assert FAMILY.sizes == ("r50",) and FAMILY.build is build_fcos
    p = FAMILY.preprocess
    assert (p.resize, p.short, p.max_long, p.interp) == ("keep_ratio", 800, 1333, "linear")
    assert p.mean == (123.675, 116.28, 103.53) and p.std == (58.395, 57.12, 57.375)


def test_params_within_half_a_percent_of_torchvision():
    """91 classes: torchvision's count + the 5 per-level scales (torchvision has none).
    FLOPs (2 x MACs, fastdet.models.flops) at 800x1344, the stride-32 canvas of 800x1333."""
    with torch.device("meta"):
        model = build_fcos("r50", num_classes=91)
    params = count_params(model)
    flops = count_flops(model, (800, 1344))
    print(f"\nFCOS R50-FPN, 91 classes: {params:,} params (torchvision {TORCHVISION_PARAMS:,}, "
          f"{params / TORCHVISION_PARAMS - 1:+.5%}); {flops / 1e9:.1f} GFLOPs at 800x1344")
    assert abs(params / TORCHVISION_PARAMS - 1) < 0.005
    assert params == TORCHVISION_PARAMS + 5
    assert 425e9 < flops < 436e9


# --------------------------------------------------------------------------- backbone forms


def test_pretrained_form_freezes_statistics_stem_and_res2():
    model = build_fcos("r50", num_classes=3)
    bb = model.backbone
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in bb.modules())
    assert sum(isinstance(m, FrozenBatchNorm2d) for m in bb.modules()) == 53
    frozen = {n.split(".")[0] for n, p in bb.named_parameters() if not p.requires_grad}
    trained = {n.split(".")[0] for n, p in bb.named_parameters() if p.requires_grad}
    assert frozen == {"conv1", "layer1"} and trained == {"layer2", "layer3", "layer4"}
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("backbone."))


def test_from_scratch_form_trains_everything():
    model = build_fcos("r50", num_classes=3, from_scratch=True)
    assert all(p.requires_grad for p in model.parameters())
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.backbone.modules()) == 53
    assert not any(isinstance(m, FrozenBatchNorm2d) for m in model.modules())


def test_backbone_weights_from_a_torchvision_state_dict(tmp_path, caplog):
    torch.manual_seed(1)
    tv = torchvision.models.resnet50(weights=None)
    path = tmp_path / "resnet50.pth"
    torch.save(tv.state_dict(), path)
    with caplog.at_level(logging.INFO, logger="fastdet.models.backbones.resnet"):
        model = build_fcos("r50", num_classes=3, backbone_weights=str(path))
    own = model.backbone.state_dict()
    for k, v in own.items():
        assert torch.equal(v, tv.state_dict()[k]), k
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"backbone weights: unexpected in {path} (ignored): fc.weight, fc.bias"]
    # The frozen form keeps the loaded statistics and the freezing.
    assert not model.backbone.conv1.weight.requires_grad

    partial = {k: v for k, v in tv.state_dict().items() if not k.startswith("layer4.2.")}
    torch.save(partial, path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastdet.models.backbones.resnet"):
        build_fcos("r50", num_classes=3, backbone_weights=str(path))
    missing = [r.getMessage() for r in caplog.records if "missing" in r.getMessage()]
    assert len(missing) == 1 and "layer4.2.conv1.weight" in missing[0] and "layer4.2.bn3.running_var" in missing[0]

    bad = dict(tv.state_dict(), **{"conv1.weight": torch.zeros(64, 3, 3, 3)})
    torch.save(bad, path)
    with pytest.raises(ValueError, match=r"conv1.weight has shape \(64, 3, 3, 3\)"):
        build_fcos("r50", num_classes=3, backbone_weights=str(path))
    path.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="cannot read a state dict"):
        build_fcos("r50", num_classes=3, backbone_weights=str(path))


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("from_scratch", [False, True])
def test_contract(from_scratch):
    """Named, finite losses with positives on every level; every parameter that trains gets a
    finite, non-zero gradient and the frozen ones none; eval gives dense outputs and detections."""
    C = 3
    model = small_model(from_scratch=from_scratch)
    # With zero-mean distance outputs some positives start as zero-area boxes (ReLU), whose
    # GIoU has no gradient; positive distances make every level's scale reachable.
    torch.nn.init.constant_(model.head.bbox_reg.bias, 1.0)
    x, t = toy_batch()
    model.train()
    losses = model(x, t)
    assert set(losses) == LOSS_KEYS
    for k, v in losses.items():
        assert v.dim() == 0 and torch.isfinite(v), (k, v)
    assert losses["loss_box"] > 0 and losses["loss_ctr"] > 0
    losses["total_loss"].backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert model.head.scales.grad.ne(0).all()  # positives on all five levels

    assert [tuple(f.shape[-2:]) for f in model.features(x)] == feature_shapes(128, 128)

    model.eval()
    A = sum((128 // s) ** 2 for s in (8, 16, 32)) + 2 * 2 + 1
    boxes, scores = model(x)
    assert boxes.shape == (1, A, 4) and scores.shape == (1, A, C)
    assert ((scores >= 0) & (scores <= 1)).all()
    assert (boxes[..., 2:] >= boxes[..., :2]).all()
    dets = model.predict(x, score_thresh=0.0, max_det=50)
    assert len(dets) == 1 and 0 < dets[0]["boxes"].shape[0] <= 50
    assert int(dets[0]["labels"].max()) < C


def test_predict_defaults_are_paddles(monkeypatch):
    """``predict()`` runs the base multiclass NMS (the one ``export --nms`` reproduces) at
    Paddle's values, the same as the recipe's post-processing settings."""
    from fastdet import registry
    from fastdet.export import export_nms_form
    from fastdet.models import detector

    model = build_fcos("r50", num_classes=2).eval()
    assert export_nms_form(model) == "multiclass"
    seen = {}

    def spy(boxes, scores, *args):
        seen["args"] = args
        return []

    monkeypatch.setattr(detector, "multiclass_nms", spy)
    model.predict(torch.zeros(1, 3, 64, 64))
    assert seen["args"] == (0.025, 0.6, 100, 1000, True)
    model.predict(torch.zeros(1, 3, 64, 64), score_thresh=0.3)
    assert seen["args"] == (0.3, 0.6, 100, 1000, True)
    cfg = registry.get_preset("fcos", "r50")
    assert registry.predict_kwargs(cfg) == dict(zip(("score_thresh", "iou_thresh", "max_det", "pre_nms_topk", "per_class_topk"),
                                                   (0.025, 0.6, 100, 1000, True)))


def test_lr_multipliers_double_the_tower_biases():
    from fastdet.engine.optim import build_param_groups

    model = build_fcos("r50", num_classes=2)
    mults = model.lr_multipliers()
    assert len(mults) == 8 and all(v == 2.0 for v in mults.values())
    assert "head.cls_tower.0.bias" in mults and "head.reg_tower.9.bias" in mults
    groups = build_param_groups(model, 1e-4)
    doubled = [g for g in groups if g["lr_mult"] == 2.0]
    assert len(doubled) == 1 and len(doubled[0]["params"]) == 8 and doubled[0]["weight_decay"] == 0.0


# --------------------------------------------------------------------------- head and targets


def test_points_scales_and_init():
    head = FCOSHead(32, num_classes=4)
    feats = [torch.zeros(1, 32, 128 // s, 128 // s) for s in (8, 16, 32)] + [torch.zeros(1, 32, 2, 2),
                                                                         torch.zeros(1, 32, 1, 1)]
    points, strides, ranges = head.points(feats)
    assert points.shape == (256 + 64 + 16 + 4 + 1, 2)
    assert points[0].tolist() == [4.0, 4.0] and points[1].tolist() == [12.0, 4.0]  # (i + 0.5) * stride
    assert points[-1].tolist() == [64.0, 64.0] and strides[-1] == 128 and ranges[-1, 1] == float("inf")
    assert ranges[0].tolist() == [0.0, 64.0] and ranges[256].tolist() == [64.0, 128.0]
    assert torch.equal(head.scales.detach(), torch.ones(5))
    torch.testing.assert_close(head.cls_logits.bias.sigmoid(), torch.full((4,), 0.01))
    assert isinstance(head.cls_tower[1], torch.nn.GroupNorm) and head.cls_tower[1].num_groups == 32


def test_perfect_regression_gives_zero_box_loss_and_centerness_targets():
    """Drive the distance outputs to the exact targets: the GIoU term vanishes; the
    centerness BCE is then minimal at the centerness target sqrt(min/max(l,r) min/max(t,b))."""
    head = FCOSHead(32, num_classes=2, size_ranges=SMALL_RANGES)
    feats = [torch.zeros(1, 32, 128 // s, 128 // s) for s in (8, 16, 32)] + [torch.zeros(1, 32, 2, 2),
                                                                         torch.zeros(1, 32, 1, 1)]
    _, t = toy_batch()
    points, strides, ranges = head.points(feats)
    from fastdet.ops import fcos_assign

    assigned, _ = fcos_assign(points, strides, ranges, t["gt_boxes"], t["gt_labels"], t["gt_mask"])
    fg = assigned[0] >= 0
    box = t["gt_boxes"][0][assigned[0].clamp(min=0)]
    ltrb = torch.cat([points - box[:, :2], box[:, 2:] - points], -1) / strides[:, None]
    lr, tb = ltrb[:, 0::2], ltrb[:, 1::2]
    ctr = ((lr.min(-1).values / lr.max(-1).values) * (tb.min(-1).values / tb.max(-1).values)).sqrt()

    def fake_raw_outputs(_feats):
        reg = torch.where(fg[:, None], ltrb, 0.5)[None]
        logit = torch.logit(ctr.where(fg, 0.5).clamp(1e-6, 1 - 1e-6))[None]
        return torch.zeros(1, points.shape[0], 2), reg, logit

    head.raw_outputs = fake_raw_outputs
    losses = head.loss(feats, t)
    assert fg.sum() == 5  # one positive per level
    assert float(losses["loss_box"]) < 1e-5
    entropy = -(ctr * ctr.log() + (1 - ctr) * (1 - ctr).clamp(min=1e-12).log())[fg].sum() / fg.sum()
    torch.testing.assert_close(losses["loss_ctr"], entropy, rtol=1e-4, atol=1e-5)


def test_losses_match_torchvisions_fcos_head():
    """The same outputs and matching through torchvision's ``FCOSHead.compute_loss``: the
    focal and centerness terms are equal; with ``box_loss="giou"`` the box term is
    torchvision's GIoU (on boxes decoded in pixels) weighted by the centerness targets,
    Paddle's choice (torchvision averages it)."""
    from types import SimpleNamespace

    from torchvision.models.detection._utils import BoxLinearCoder
    from torchvision.models.detection.fcos import FCOSHead as TorchvisionHead
    from torchvision.ops import generalized_box_iou_loss

    from fastdet.ops import fcos_assign

    B, C, h, w = 2, 4, 128, 160
    head = FCOSHead(32, num_classes=C, box_loss="giou")  # Paddle's and torchvision's ranges
    feats = [torch.zeros(B, 32, *hw) for hw in feature_shapes(h, w)]
    points, strides, ranges = head.points(feats)
    g = torch.Generator().manual_seed(0)
    wh = 8 + torch.rand(B, 6, 2, generator=g) * 150
    xy = torch.rand(B, 6, 2, generator=g) * (torch.tensor([w, h]) - wh).clamp(min=0)
    t = dict(gt_boxes=torch.cat([xy, xy + wh], -1),
             gt_labels=torch.randint(0, C, (B, 6), generator=g), gt_mask=torch.rand(B, 6, generator=g) < 0.8)
    A = points.shape[0]
    cls, ltrb, ctr = torch.randn(B, A, C, generator=g), torch.rand(B, A, 4, generator=g) * 3, torch.randn(B, A, generator=g)
    head.raw_outputs = lambda _feats: (cls, ltrb, ctr)
    ours = head.loss(feats, t)

    assigned, _ = fcos_assign(points, strides, ranges, t["gt_boxes"], t["gt_labels"], t["gt_mask"])
    slots = [t["gt_mask"][i].cumsum(0) - 1 for i in range(B)]  # padded slot -> index among the valid boxes
    matched = [torch.where(assigned[i] >= 0, slots[i][assigned[i].clamp(min=0)], -1) for i in range(B)]
    targets = [{"boxes": t["gt_boxes"][i][t["gt_mask"][i]], "labels": t["gt_labels"][i][t["gt_mask"][i]]}
               for i in range(B)]
    anchors = [torch.cat([points - strides[:, None] / 2, points + strides[:, None] / 2], 1)] * B
    tv_head = SimpleNamespace(box_coder=BoxLinearCoder(normalize_by_size=True))
    outputs = {"cls_logits": cls, "bbox_regression": ltrb, "bbox_ctrness": ctr[..., None]}
    theirs = TorchvisionHead.compute_loss(tv_head, targets, outputs, anchors, matched)
    assert sum(int((m >= 0).sum()) for m in matched) > 20 and len(set(strides[(assigned >= 0).any(0)].tolist())) >= 2
    torch.testing.assert_close(ours["loss_cls"], theirs["classification"])
    torch.testing.assert_close(ours["loss_ctr"], theirs["bbox_ctrness"])

    fg = assigned >= 0
    gt = t["gt_boxes"].gather(1, assigned.clamp(min=0)[..., None].expand(-1, -1, 4))  # [B, A, 4] px
    pred = tv_head.box_coder.decode(ltrb, torch.stack(anchors))  # px
    rel = tv_head.box_coder.encode(torch.stack(anchors), gt)[fg]  # ltrb / stride
    pred, gt = pred[fg], gt[fg]
    lr, tb = rel[:, 0::2], rel[:, 1::2]
    weight = ((lr.amin(-1) / lr.amax(-1)) * (tb.amin(-1) / tb.amax(-1))).sqrt()
    want_box = (generalized_box_iou_loss(pred, gt, reduction="none") * weight).sum() / weight.sum()
    torch.testing.assert_close(ours["loss_box"], want_box, rtol=1e-5, atol=1e-6)


def test_padded_ground_truth_changes_nothing():
    """The five real boxes alone, and with masked slots holding junk boxes smaller than the
    real ones they overlap (so each would win its points, FCOS taking the smallest box) and
    of other labels: the same losses."""
    model = small_model().eval()
    x, t = toy_batch()
    real = {k: v[:, :5] for k, v in t.items()}
    extra = torch.tensor([[20.0, 60.0, 50.0, 100.0], [70.0, 70.0, 110.0, 110.0], [3.0, 3.0, 20.0, 20.0]])
    junk = dict(gt_boxes=torch.cat([t["gt_boxes"], extra.expand(1, 3, 4)], 1),
                gt_labels=torch.cat([t["gt_labels"], torch.tensor([[1, 0, 2]])], 1),
                gt_mask=torch.cat([t["gt_mask"], torch.zeros(1, 3, dtype=torch.bool)], 1))
    with torch.no_grad():
        a, b = model(x, real), model(x, junk)
    for k in LOSS_KEYS:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- graph capture


def test_training_forward_has_no_graph_breaks():
    torch._dynamo.reset()
    model = small_model()
    x, t = toy_batch()
    explanation = torch._dynamo.explain(model)(x, t)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.slow
def test_fullgraph_compiled_training_matches_eager():
    """The whole training forward + backward as one graph (dynamo + AOT autograd), and the
    head's loss and assignment through inductor, forward and backward, against eager.
    (Inductor over ResNet-50 on a CPU costs minutes of C++ builds; the GPU check does that.)"""
    torch._dynamo.reset()
    eager = small_model(from_scratch=True)
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x, t = toy_batch()
    want = eager(x, t)
    got = step(x, t)
    for k in LOSS_KEYS:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    want["total_loss"].backward()
    got["total_loss"].backward()
    # Per tensor, relative to its norm: AOT autograd decomposes BatchNorm's backward and
    # sums in another order, which moves single elements of the stem's gradient (many
    # terms cancelling) past an elementwise rtol; a wrong gradient is off by O(1) here.
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            err = float((q.grad - p.grad).norm() / p.grad.norm().clamp(min=1e-12))
            assert err < 1e-3, f"{name}: compiled gradient off by {err:.2e} of its norm"

    torch._dynamo.reset()
    with torch.no_grad():
        feats = [f.detach() for f in eager.features(x)]
    head = eager.head
    compiled = torch.compile(copy.deepcopy(head).loss, fullgraph=True)
    f_eager = [f.clone().requires_grad_() for f in feats]
    f_comp = [f.clone().requires_grad_() for f in feats]
    want = head.loss(f_eager, t)
    got = compiled(f_comp, t)
    for k in LOSS_KEYS:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    want["total_loss"].backward()
    got["total_loss"].backward()
    for a, b in zip(f_comp, f_eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-6)


def test_fused_focal_loss_matches_torchvision():
    """fastdet.losses.sigmoid_focal_loss (one autograd node, closed-form backward) against
    torchvision's, value and gradient, and it traces without a graph break."""
    from fastdet.losses import sigmoid_focal_loss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 5, generator=g, dtype=torch.float64).requires_grad_()
    t = (torch.rand(2, 300, 5, generator=g) < 0.2).double()
    for alpha, gamma in ((0.25, 2.0), (-1.0, 1.5)):
        want = torchvision.ops.sigmoid_focal_loss(x, t, alpha, gamma, "sum")
        got = sigmoid_focal_loss(x, t, alpha, gamma)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        (gw,) = torch.autograd.grad(want, x)
        (gg,) = torch.autograd.grad(got, x)
        torch.testing.assert_close(gg, gw, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda x: sigmoid_focal_loss(x, t))(x)
    assert explained.graph_break_count == 0, explained.break_reasons



def paddle_fcos_box_loss(pred: torch.Tensor, tgt: torch.Tensor, pos: torch.Tensor, ctr: torch.Tensor) -> torch.Tensor:
    """PaddleDetection 2.6 ``FCOSLoss`` (quality "centerness", iou_loss_type "giou"), its box
    term written out as ppdet/modeling/losses/fcos_loss.py computes it: both sides masked to
    0 off the positives, IoU (inter + 1) / (union + 1), the GIoU term over the unsmoothed union
    and the enclosing area + 1e-7, weighted by the centerness target, divided by the sum of
    the centerness targets over the positives. pred, tgt [N, 4] ltrb / stride; pos, ctr [N]."""
    p, t = pred * pos[:, None], tgt * pos[:, None]
    inner, outer = torch.minimum(p, t), torch.maximum(p, t)
    area_p = (p[:, 0] + p[:, 2]) * (p[:, 1] + p[:, 3])
    area_t = (t[:, 0] + t[:, 2]) * (t[:, 1] + t[:, 3])
    area_i = (inner[:, 0] + inner[:, 2]) * (inner[:, 1] + inner[:, 3])
    ious = (area_i + 1.0) / (area_p + area_t - area_i + 1.0) * pos
    area_c = (outer[:, 0] + outer[:, 2]) * (outer[:, 1] + outer[:, 3]) + 1e-7
    union = area_p + area_t - area_i
    loss = (1.0 - (ious - (area_c - union) / area_c)) * ctr
    return (loss * pos / (ctr * pos).sum()).sum()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_box_loss_is_paddles_smoothed_iou(compiled):
    """The box term and its gradient are PaddleDetection's ``FCOSLoss`` (float64, on random
    distances and the fcos_assign targets), in eager code and through ``torch.compile``
    (where the classification term is the fused focal loss). torchvision's plain GIoU, the
    ``box_loss="giou"`` option, is off by percents and fails the same comparison."""
    from fastdet.ops import fcos_assign

    B, C, h, w = 2, 4, 128, 160
    g = torch.Generator().manual_seed(1)
    wh = 8 + torch.rand(B, 6, 2, generator=g, dtype=torch.float64) * 150
    xy = torch.rand(B, 6, 2, generator=g, dtype=torch.float64) * (torch.tensor([w, h]) - wh).clamp(min=0)
    t = dict(gt_boxes=torch.cat([xy, xy + wh], -1),
             gt_labels=torch.randint(0, C, (B, 6), generator=g), gt_mask=torch.rand(B, 6, generator=g) < 0.8)
    feats = [torch.zeros(B, 32, *hw) for hw in feature_shapes(h, w)]
    head = FCOSHead(32, num_classes=C)
    points, strides, ranges = head.points(feats)
    A = points.shape[0]
    cls = torch.randn(B, A, C, generator=g, dtype=torch.float64).requires_grad_()
    ltrb = (torch.rand(B, A, 4, generator=g, dtype=torch.float64) * 6).requires_grad_()
    ctr = torch.randn(B, A, generator=g, dtype=torch.float64).requires_grad_()

    assigned, _ = fcos_assign(points, strides, ranges, t["gt_boxes"].float(), t["gt_labels"], t["gt_mask"])
    gt = t["gt_boxes"].gather(1, assigned.clamp(min=0)[..., None].expand(-1, -1, 4))
    pts = points.double()
    tgt = torch.cat([pts - gt[..., :2], gt[..., 2:] - pts], -1) / strides[:, None]
    pos = (assigned >= 0).double()
    lr, tb = tgt[..., 0::2].abs(), tgt[..., 1::2].abs()
    ctr_t = ((lr.amin(-1) / lr.amax(-1)) * (tb.amin(-1) / tb.amax(-1))).sqrt() * pos
    assert pos.sum() > 20
    want = paddle_fcos_box_loss(ltrb.reshape(-1, 4), tgt.reshape(-1, 4), pos.reshape(-1), ctr_t.reshape(-1))
    (want_grad,) = torch.autograd.grad(want, ltrb)

    def box_loss_and_grad(option: str):
        head = FCOSHead(32, num_classes=C, box_loss=option)
        head.raw_outputs = lambda _feats: (cls, ltrb, ctr)
        loss = torch.compile(head.loss, fullgraph=True, backend="aot_eager") if compiled else head.loss
        got = loss(feats, t)["loss_box"]
        return got, torch.autograd.grad(got, ltrb)[0]

    torch._dynamo.reset()
    got, got_grad = box_loss_and_grad("paddle")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-15)
    plain, plain_grad = box_loss_and_grad("giou")
    assert abs(float(plain.detach() / want) - 1) > 1e-3
    assert float((plain_grad - want_grad).abs().max() / want_grad.abs().max()) > 1e-2


# --------------------------------------------------------------------------- recipe, CLI


def test_registered_with_its_recipe():
    from fastdet import registry
    from fastdet.data.stages import Flip, Normalize, Resize
    from fastdet.engine.optim import LRSchedule
    from fastdet.models import ARCHITECTURES, build_model

    assert ARCHITECTURES["fcos"] is FAMILY
    assert isinstance(build_model("fcos", "r50", num_classes=2), type(build_fcos("r50", 2)))
    cfg = registry.get_preset("fcos", "r50")
    o = cfg.optim
    assert (o.optimizer, o.momentum, o.weight_decay, o.base_lr, o.ref_batch, o.epochs) == ("sgd", 0.9, 1e-4, 0.01, 16, 12)
    assert (o.schedule, tuple(o.milestones), o.gamma, o.warmup_steps, o.ema) == ("piecewise", (8, 11), 0.1, 500, False)
    assert (cfg.data.batch_size, cfg.data.img_size, tuple(cfg.data.train_sizes)) == (2, 800, (800,))
    stages = registry.phase(cfg, 0).stages
    assert stages == (Flip(0.5), Resize("keep_ratio", interp="linear", short=800, max_long=1333), Normalize())
    assert registry.phase(cfg, 11) == registry.phase(cfg, 0) and registry.phase(cfg, 0).loss_kwargs == {}
    assert registry.predict_kwargs(cfg) == dict(score_thresh=0.025, iou_thresh=0.6, max_det=100, pre_nms_topk=1000,
                                               per_class_topk=True)
    # lr 0.01 per 16 images: warm-up from 1/3 over 500 steps, x0.1 at epochs 8 and 11.
    sched = LRSchedule.from_config(o, 0.01, steps_per_epoch=1000)
    for step, lr in ((0, 0.01 / 3), (500, 0.01), (7999, 0.01), (8000, 0.001), (11000, 0.0001)):
        assert sched(step) == pytest.approx(lr), step
    assert isinstance(registry.build_detector(cfg, 2).backbone.bn1, FrozenBatchNorm2d)


def test_demo_recipe_trains_from_scratch():
    from fastdet import registry
    from fastdet.config import apply_overrides

    cfg = apply_overrides(registry.get_preset("fcos", "r50"), registry.demo_overrides("fcos"))
    assert cfg.family.from_scratch and cfg.data.img_size < 800 and cfg.optim.epochs < 12
    model = registry.build_detector(cfg, 4)
    assert isinstance(model.backbone.bn1, torch.nn.BatchNorm2d)
    assert all(p.requires_grad for p in model.parameters())


def test_backbone_weights_flag_reaches_the_model(tmp_path):
    """``--backbone-weights`` sets model.backbone_weights, which the trainer hands to
    ``Detector.load_backbone_weights`` on a fresh start; a family without a torchvision
    backbone says so in one sentence."""
    from fastdet.models import build_model
    from fastdet.train import build_parser, resolve_config

    path = tmp_path / "r50.pth"
    args = build_parser().parse_args(["--arch", "fcos", "--size", "r50", "--backbone-weights", str(path)])
    assert resolve_config(args).model.backbone_weights == str(path)
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), path)
    model = build_fcos("r50", num_classes=2)
    model.load_backbone_weights(str(path))
    torch.testing.assert_close(model.backbone.layer4[2].conv3.weight, torch.load(path)["layer4.2.conv3.weight"])
    # PP-YOLOE and PP-YOLO read Paddle's CSPResNetb / ResNet-vd files: a torchvision
    # ResNet-50 fits none of their tensors.
    for arch, size in (("ppyoloe", "s"), ("ppyolo", "r18vd")):
        with pytest.raises(ValueError, match="none of its 320 tensors fit this backbone"):
            build_model(arch, size, num_classes=2).load_backbone_weights(str(path))


def test_bench_adapter_is_torchvisions_fcos(monkeypatch):
    """bench/fcos_torchvision.py trains torchvision's FCOS through fastdet's trainer (the
    side-by-side check of ours): through its adapter the model gives the losses torchvision's
    own ``FCOS.forward`` gives on the same batch, and dense outputs on fastdet's points."""
    import sys
    from pathlib import Path

    from fastdet.models import ARCHITECTURES

    # Importing the bench module registers "fcos_tv": a fresh import, and the registry
    # restored after the test, so later tests in this process see fastdet's families only.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    monkeypatch.delitem(sys.modules, "bench.fcos_torchvision", raising=False)
    monkeypatch.setitem(ARCHITECTURES, "fcos_tv", None)  # the import replaces it; undone after
    from bench.fcos_torchvision import build_torchvision_fcos

    assert ARCHITECTURES["fcos_tv"].recipe is FAMILY.recipe
    with pytest.raises(ValueError, match="family.from_scratch"):
        build_torchvision_fcos("r50", 3)
    torch.manual_seed(0)
    model = build_torchvision_fcos("r50", 3, from_scratch=True)
    tv = model.head._tv[0]
    # torchvision's input transform as the identity: no normalisation, and the image is
    # already at its size (scale 1, no padding for a multiple of 32).
    tv.transform.image_mean, tv.transform.image_std = [0.0] * 3, [1.0] * 3
    tv.transform.min_size, tv.transform.max_size = (128,), 160
    x, t = toy_batch(B=2)
    x = torch.cat([x, x[..., :32]], -1)  # 128 x 160
    want = tv(list(x), [{"boxes": t["gt_boxes"][i][t["gt_mask"][i]], "labels": t["gt_labels"][i][t["gt_mask"][i]]}
                        for i in range(2)])
    got = model(x, t)
    torch.testing.assert_close(got["loss_cls"], want["classification"])
    torch.testing.assert_close(got["loss_box"], want["bbox_regression"])
    torch.testing.assert_close(got["loss_ctr"], want["bbox_ctrness"])
    model.eval()
    with torch.no_grad():
        boxes, scores = model(x)
    assert boxes.shape == (2, 16 * 20 + 8 * 10 + 4 * 5 + 2 * 3 + 1 * 2, 4) and scores.shape[-1] == 3
    assert bool(((scores >= 0) & (scores <= 1)).all())


def test_torchvision_decode_is_torchvisions():
    """``decode="torchvision"``: torchvision's AnchorGenerator (points at j * (W // w_l), no
    half stride, integer strides) and BoxLinearCoder(normalize_by_size=True), scores
    sqrt(cls * centerness), no per-level scales; the Paddle decode differs from it."""
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.image_list import ImageList
    from torchvision.models.detection._utils import BoxLinearCoder

    from fastdet.models.fcos import FCOSHead, feature_shapes

    torch.manual_seed(0)
    head = FCOSHead(32, num_classes=3, decode="torchvision").eval()
    with torch.no_grad():
        head.scales.fill_(3.0)  # ignored by torchvision's decode
    H, W = 128, 160  # P6 is 2 x 3: torchvision's stride there is 160 // 3 = 53
    feats = [torch.randn(1, 32, h, w) for h, w in feature_shapes(H, W)]
    with torch.no_grad():
        boxes, scores = head.inference(feats)
        gen = AnchorGenerator(((8,), (16,), (32,), (64,), (128,)), ((1.0,),) * 5)
        anchors = gen(ImageList(torch.zeros(1, 3, H, W), [(H, W)]), feats)[0]
        cls, ltrb, ctr = head.raw_outputs(feats)
    want = BoxLinearCoder(normalize_by_size=True).decode(ltrb[0], anchors)
    torch.testing.assert_close(boxes[0], want)
    torch.testing.assert_close(scores, (cls.sigmoid() * ctr.sigmoid()[..., None]).sqrt())
    head.decode = "paddle"
    with torch.no_grad():
        paddle_boxes, _ = head.inference(feats)
    assert not torch.allclose(paddle_boxes[0], want, atol=1.0)
