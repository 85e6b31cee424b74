"""PP-YOLO: the parameter/FLOP table, ResNet-vd's structure, DropBlock (device RNG, no graph
break, repeatable under a seed), the YOLOv3 loss (finite, every parameter learns, padded
boxes and absent scores), graph capture and compilation, IoU-aware decoding, and Matrix
NMS against a loop rendering of PaddleDetection's ``matrix_nms``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdet.models.backbones.resnet_vd import DeformConv2d, ResNetVd
from fastdet.models.flops import count_flops, count_params
from fastdet.models.ppyolo import DropBlock, build_ppyolo, matrix_nms

# PaddleDetection 2.6's modules built from configs/ppyolo/_base_/ppyolo_{r50vd_dcn,r18vd}.yml,
# 80 classes, parameters without BatchNorm statistics (M).
PADDLE_PARAMS = {"r50vd_dcn": 47.05, "r18vd": 13.14}
LOSS_KEYS = {"r50vd_dcn": {"total_loss", "loss_xy", "loss_wh", "loss_iou", "loss_obj", "loss_cls", "loss_iou_aware"},
             "r18vd": {"total_loss", "loss_xy", "loss_wh", "loss_iou", "loss_obj", "loss_cls"}}


def toy_batch(B: int = 2, img: int = 64, C: int = 3, scores: bool = True):
    g = torch.Generator().manual_seed(0)
    boxes = torch.tensor([[2.0, 2.0, 62.0, 62.0], [10.0, 10.0, 40.0, 50.0], [30.0, 20.0, 60.0, 60.0],
                          [5.0, 30.0, 20.0, 40.0], [0.0, 0.0, 0.0, 0.0]]) * (img / 64)
    targets = dict(
        gt_boxes=boxes.expand(B, 5, 4).clone(),
        gt_labels=torch.tensor([[0, 1, C - 1, 1, 0]]).expand(B, 5).clone(),
        gt_mask=torch.tensor([[True, True, True, True, False]]).expand(B, 5).clone(),
    )
    if scores:
        targets["gt_scores"] = torch.tensor([[1.0, 0.6, 0.4, 1.0, 0.0]]).expand(B, 5).clone()
    return torch.randn(B, 3, img, img, generator=g), targets


# --------------------------------------------------------------------------- sizes


def test_params_and_flops_table():
    rows = []
    for size, want in PADDLE_PARAMS.items():
        with torch.device("meta"):
            model = build_ppyolo(size)
        params = count_params(model, deploy=False) / 1e6
        flops = count_flops(model, 608, deploy=False) / 1e9
        rows.append(f"{size:10s} {params:8.3f} M (Paddle {want:.2f} M, {100 * (params / want - 1):+.2f} %)"
                    f"  {flops:7.2f} GFLOPs@608 (2xMAC)  {flops / 2:6.2f} GMACs")
        assert abs(params / want - 1) < 0.01, rows[-1]
    print("\nPP-YOLO, 80 classes\n" + "\n".join(rows))


def test_resnet_vd_structure():
    r50 = ResNetVd(50, return_idx=(1, 2, 3), dcn_stages=(3,))
    assert [m.conv.out_channels for m in list(r50.stem)[:3]] == [32, 32, 64]
    assert r50.out_channels == [512, 1024, 2048]
    first = r50.stages[1][0]
    assert first.branch2a.conv.stride == (1, 1) and first.branch2b.conv.stride == (2, 2)  # stride on the 3x3
    assert isinstance(first.short[0], torch.nn.AvgPool2d) and first.short[1].conv.stride == (1, 1)
    dcn = [n for n, m in r50.named_modules() if isinstance(m, DeformConv2d)]
    assert dcn == [f"stages.3.{i}.branch2b.conv" for i in range(3)]
    r18 = ResNetVd(18, return_idx=(2, 3))
    assert r18.out_channels == [256, 512]
    assert r18.stages[0][0].short is not None  # Paddle's projection even at 64 -> 64
    feats = r18(torch.randn(1, 3, 64, 96))
    assert [tuple(f.shape) for f in feats] == [(1, 256, 4, 6), (1, 512, 2, 3)]


def test_dcn_starts_as_a_plain_conv_with_half_mask():
    torch.manual_seed(0)
    dcn = DeformConv2d(4, 6, 3, stride=2)
    x = torch.randn(2, 4, 9, 9)
    want = torch.nn.functional.conv2d(x, dcn.weight, None, 2, 1) * 0.5
    torch.testing.assert_close(dcn(x), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- DropBlock


def test_dropblock_device_rng_seeded_and_graph_free():
    db = DropBlock(3, 0.9).train()
    x = torch.rand(4, 8, 16, 16) + 0.5
    torch.manual_seed(3)
    a = db(x)
    torch.manual_seed(3)
    b = db(x)
    c = db(x)
    assert torch.equal(a, b) and not torch.equal(b, c)  # repeatable under a seed, fresh otherwise
    dropped = (a == 0).float().mean().item()
    assert 0.04 < dropped < 0.2  # about 1 - keep_prob of the units
    torch.testing.assert_close(a.mean(), x.mean(), rtol=0.05, atol=0)  # rescaled to keep the mean
    assert torch.equal(db.eval()(x), x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(DropBlock(3, 0.9).train())(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    # Compiled with inductor's own Philox: still repeatable under a seed.
    compiled = torch.compile(DropBlock(3, 0.9).train(), fullgraph=True)
    torch.manual_seed(5)
    u = compiled(x)
    torch.manual_seed(5)
    assert torch.equal(u, compiled(x))


# --------------------------------------------------------------------------- model and loss


@pytest.mark.parametrize("size", ["r18vd", "r50vd_dcn"])
def test_contract(size):
    torch.manual_seed(0)
    model = build_ppyolo(size, num_classes=3).train()
    x, t = toy_batch()
    losses = model(x, t)
    assert set(losses) == LOSS_KEYS[size]
    assert not list(model.head.buffers())  # anchors are constants: an EMA must not average them
    assert all(torch.isfinite(v) for v in losses.values())
    losses["total_loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing[:5]
    assert any(p.grad.abs().sum() > 0 for p in model.backbone.stages[-1].parameters())
    model.eval()
    with torch.no_grad():
        boxes, scores = model(x)
    A = sum(3 * (64 // s) ** 2 for s in model.head.strides)
    assert boxes.shape == (2, A, 4) and scores.shape == (2, A, 3)
    # Paddle's one-sided yolo_box clip: x1, y1 >= 0, x2, y2 <= size - 1.
    assert (boxes[..., :2] >= 0).all() and (boxes[..., 2:] <= 63).all() and (scores >= 0).all() and (scores <= 1).all()
    dets = model.predict(x)
    assert len(dets) == 2 and all(d["boxes"].shape[0] <= 100 for d in dets)


def test_padded_boxes_and_absent_scores():
    torch.manual_seed(0)
    model = build_ppyolo("r18vd", num_classes=3).eval()  # eval: no DropBlock, BN fixed
    x, t = toy_batch(scores=False)
    base = model(x, t)
    # all-ones gt_scores equal absent scores; junk in padded slots changes nothing
    t2 = dict(t, gt_scores=torch.ones(2, 5))
    t2["gt_boxes"] = t["gt_boxes"].clone()
    t2["gt_boxes"][:, -1] = torch.tensor([3.0, 3.0, 50.0, 50.0])
    t2["gt_labels"] = t["gt_labels"].clone()
    t2["gt_labels"][:, -1] = 2
    for k, v in model(x, t2).items():
        torch.testing.assert_close(v, base[k], msg=k)
    # a mixup weight scales that box's positive terms
    t3 = dict(t, gt_scores=torch.tensor([[1.0, 0.5, 1.0, 1.0, 0.0]]).expand(2, 5))
    assert model(x, t3)["loss_cls"] < base["loss_cls"]


def test_extreme_size_logits_stay_finite():
    """An untrained model in eval mode can emit size logits that overflow exp(): the losses
    and the decoded boxes stay finite."""
    torch.manual_seed(0)
    model = build_ppyolo("r18vd", num_classes=3).eval()
    with torch.no_grad():
        for conv in model.head.outputs:
            bias = conv.bias.view(3, -1)  # [na, 5 + C]
            bias[:, 2] = 200.0  # w: exp overflows
            bias[:, 3] = -200.0  # h: exp underflows to 0
    x, t = toy_batch()
    losses = model(x, t)
    assert all(torch.isfinite(v) for v in losses.values()), losses
    boxes, scores = model(x)
    assert torch.isfinite(boxes).all() and torch.isfinite(scores).all()


def test_ignore_rule_drops_negatives_that_overlap_a_box():
    """R18 (strides 32, 16) on a 160-px image with a 128-px and a 40-px box. The output convs
    predict a constant per anchor (zero weights): centre in the middle of the cell, objectness
    logit 0, the first anchor of each level sized as the large box, the others as themselves.
    Negatives whose best IoU with a box exceeds 0.7 (counted by a plain loop) each drop
    softplus(0) = log 2 from loss_obj; positives keep theirs."""
    from fastdet.ops import yolo_targets

    model = build_ppyolo("r18vd", num_classes=3).double().eval()  # float64: exact sums of ~500 terms
    head = model.head
    img, C = 160, 3
    gt = [(24.0, 24.0, 152.0, 152.0), (110.0, 4.0, 150.0, 44.0)]
    t = dict(gt_boxes=torch.tensor([gt], dtype=torch.float64), gt_labels=torch.tensor([[0, 2]]), gt_mask=torch.tensor([[True, True]]))
    big_w, big_h = gt[0][2] - gt[0][0], gt[0][3] - gt[0][1]
    with torch.no_grad():
        for conv, mask in zip(head.outputs, head.anchor_masks):
            conv.weight.zero_()
            conv.bias.zero_()
            aw, ah = head.anchors[mask[0]]
            conv.bias[2] = np.log(big_w / aw)  # channels of anchor 0: x, y, w, h, obj, classes
            conv.bias[3] = np.log(big_h / ah)
        feats = model.features(torch.zeros(1, 3, img, img, dtype=torch.float64))

    def iou(a, b):
        iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        inter = iw * ih
        return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)

    grids = yolo_targets(t["gt_boxes"], t["gt_labels"], t["gt_mask"], None, head.anchors, head.anchor_masks,
                         head.strides, (img, img), C)
    ignored = positives = 0
    for level, (mask, s) in enumerate(zip(head.anchor_masks, head.strides)):
        n = img // s
        for a, k in enumerate(mask):
            w, h = (big_w, big_h) if a == 0 else head.anchors[k]
            for gy in range(n):
                for gx in range(n):
                    cx, cy = (gx + 0.5) * s, (gy + 0.5) * s
                    box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
                    positive = bool(grids[level][0, a, 5, gy, gx] > 0)
                    positives += positive
                    ignored += not positive and max(iou(box, g) for g in gt) > 0.7
    # The large box's anchor-0 twins: 1 on level 0 (8 px off in x and y, IoU 0.78), on level 1
    # the cell at its centre and the 4 beside it (IoU 1, 0.78); one positive per box, on other
    # anchors (the best-shaped: (135, 169) and (37, 58)).
    assert positives == 2 and ignored == 6

    with torch.no_grad():
        with_rule = head.loss(feats, t)["loss_obj"]
        head.ignore_thresh = 1.0  # nothing ignored: every prediction without a target is a negative
        without = head.loss(feats, t)["loss_obj"]
        head.ignore_thresh = -1.0  # everything ignored: only the positives remain
        only_pos = head.loss(feats, t)["loss_obj"]
    assert only_pos < with_rule < without
    torch.testing.assert_close(without - with_rule, torch.tensor(ignored * np.log(2.0), dtype=torch.float64))
    torch.testing.assert_close(only_pos, torch.tensor(positives * np.log(2.0), dtype=torch.float64))


def test_iou_aware_rescoring():
    torch.manual_seed(0)
    model = build_ppyolo("r50vd_dcn", num_classes=3).eval()
    x, _ = toy_batch(B=1)
    feats = model.features(x)
    head = model.head
    ioup, p = head._level(0, feats[0])
    obj = p[:, :, 4].sigmoid() ** 0.6 * ioup.sigmoid() ** 0.4
    want = obj[:, :, None] * p[:, :, 5:].sigmoid()  # [1, na, C, H, W]
    want = torch.where((obj >= 0.01)[:, :, None], want, 0.0).permute(0, 1, 3, 4, 2).reshape(1, -1, 3)
    _, scores = head.inference(feats)
    torch.testing.assert_close(scores[:, : want.shape[1]], want)


@pytest.mark.parametrize("size", ["r18vd", pytest.param("r50vd_dcn", marks=pytest.mark.slow)])
def test_training_forward_has_no_graph_breaks(size):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_ppyolo(size, num_classes=3).train()
    x, t = toy_batch()
    explained = torch._dynamo.explain(model)(x, t)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_compiled_training_matches_eager():
    """R18 on 64x64 images, DropBlock on: the whole training forward and backward captured
    as one graph (``fullgraph``, AOT autograd) agree with eager; under one seed both draw
    the same DropBlock masks."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_ppyolo("r18vd", num_classes=3).train()
    x, t = toy_batch()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    want = model(x, t)
    want["total_loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(1)
    got = compiled(x, t)
    got["total_loss"].backward()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.slow
def test_inductor_compiled_head_loss_matches_eager():
    """The head's loss (targets kernel, decoding, ignore rule, every term) through inductor."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_ppyolo("r18vd", num_classes=3).eval()
    x, t = toy_batch()
    with torch.no_grad():
        feats = model.features(x)
    feats = [f.clone().requires_grad_() for f in feats]
    want = model.head.loss(feats, t)
    want_grads = torch.autograd.grad(want["total_loss"], feats)
    got = torch.compile(model.head.loss, fullgraph=True)(feats, t)
    got_grads = torch.autograd.grad(got["total_loss"], feats)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-6)


# --------------------------------------------------------------------------- Matrix NMS


def _jaccard(a, b, normalized):
    """PaddleDetection's ``JaccardOverlap`` (phi/kernels/funcs/detection/nms_util.h)."""
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return 0.0
    norm = 0.0 if normalized else 1.0

    def area(t):
        if t[2] < t[0] or t[3] < t[1]:
            return 0.0
        return (t[2] - t[0] + norm) * (t[3] - t[1] + norm)

    iw = min(a[2], b[2]) - max(a[0], b[0]) + norm
    ih = min(a[3], b[3]) - max(a[1], b[1]) + norm
    inter = iw * ih
    return inter / (area(a) + area(b) - inter)


def matrix_nms_loop(boxes, scores, score_thresh, post_thresh, nms_top_k, keep_top_k, use_gaussian=False,
                    sigma=2.0, normalized=False):
    """PaddleDetection's ``MultiClassMatrixNMS`` / ``NMSMatrix`` for one image, class by class
    (phi/kernels/cpu/matrix_nms_kernel.cc), background_label -1."""
    A, C = scores.shape
    dets = []
    for c in range(C):
        s = scores[:, c]
        perm = [i for i in range(A) if s[i] > score_thresh]
        perm.sort(key=lambda i: -s[i])
        if nms_top_k > -1:
            perm = perm[:nms_top_k]
        n = len(perm)
        if n == 0:
            continue
        iou = np.zeros((n, n))
        iou_max = np.zeros(n)
        for i in range(1, n):
            for j in range(i):
                iou[i, j] = _jaccard(boxes[perm[i]], boxes[perm[j]], normalized)
            iou_max[i] = iou[i, :i].max()
        if s[perm[0]] > post_thresh:
            dets.append((s[perm[0]], c, perm[0]))
        for i in range(1, n):
            min_decay = 1.0
            for j in range(i):
                if use_gaussian:
                    decay = np.exp((iou_max[j] ** 2 - iou[i, j] ** 2) * sigma)
                else:
                    decay = (1.0 - iou[i, j]) / (1.0 - iou_max[j])
                min_decay = min(min_decay, decay)
            ds = min_decay * s[perm[i]]
            if ds > post_thresh:
                dets.append((ds, c, perm[i]))
    dets.sort(key=lambda d: -d[0])
    return dets[:keep_top_k] if keep_top_k > -1 else dets


@pytest.mark.parametrize("use_gaussian", [False, True])
def test_matrix_nms_matches_paddle_loop(use_gaussian):
    g = torch.Generator().manual_seed(0)
    B, A, C = 2, 60, 4
    xy = torch.rand(B, A, 2, generator=g) * 80
    wh = torch.rand(B, A, 2, generator=g) * 40 + 4
    boxes = torch.cat([xy, xy + wh], -1).double()
    # clusters of overlapping boxes: copy a few boxes with small shifts
    boxes[:, 30:45] = boxes[:, 0:15] + torch.rand(B, 15, 4, generator=g).double() * 3
    scores = torch.rand(B, A, C, generator=g).double() ** 3  # many below the thresholds
    out = matrix_nms(boxes, scores, score_thresh=0.05, post_thresh=0.08, max_det=30, pre_nms_topk=A * C,
                     use_gaussian=use_gaussian)
    for b in range(B):
        want = matrix_nms_loop(boxes[b].tolist(), scores[b].numpy(), 0.05, 0.08, -1, 30, use_gaussian)
        got = out[b]
        assert got["boxes"].shape[0] == len(want)
        np.testing.assert_allclose(got["scores"].numpy(), [d[0] for d in want], rtol=1e-5, atol=1e-6)
        assert got["labels"].tolist() == [d[1] for d in want]
        np.testing.assert_allclose(got["boxes"].numpy(), boxes[b, [d[2] for d in want]].numpy(), rtol=1e-6)


# --------------------------------------------------------------------------- PaddleDetection 2.6's numerics


def test_recipe_stages_follow_paddles_reader():
    """configs/ppyolo/_base_/ppyolo_reader.yml: Mixup (alpha = beta = 1.5), RandomDistort,
    RandomExpand (ImageNet-mean fill) + RandomCrop, RandomFlip, BatchRandomResize (stretch,
    a random interpolation), NormalizeImage (ImageNet). Paddle's dataset draws the mixup
    partner while ``_epoch < mixup_epoch`` (ppdet/data/source/dataset.py; epochs from 0):
    the stages of the last mixup epoch and of the first without. No test read PP-YOLO's
    phase before, so mixup kept one epoch past ``mixup_epochs`` passed."""
    from fastdet.config import apply_overrides
    from fastdet.data.records import IMAGENET_MEAN, IMAGENET_STD
    from fastdet.data.stages import Distort, ExpandCrop, Flip, MixUp, Normalize, Resize
    from fastdet.registry import demo_overrides, get_preset, phase

    cfg = get_preset("ppyolo", "r50vd_dcn")
    reader = (Distort(0.5), ExpandCrop(0.5, 4.0, True), Flip(0.5), Resize("stretch", interp="random"),
              Normalize(IMAGENET_MEAN, IMAGENET_STD))
    assert phase(cfg, 0).stages == (MixUp("beta_blend", 1.0, alpha=1.5, beta=1.5),) + reader
    assert phase(cfg, 0).loss_kwargs == {} and phase(cfg, cfg.optim.epochs - 1).stages == phase(cfg, 0).stages
    short = apply_overrides(cfg, {"family.mixup_epochs": 3})
    assert phase(short, 2).stages == phase(cfg, 0).stages and phase(short, 3).stages == reader
    demo = apply_overrides(cfg, demo_overrides("ppyolo"))
    assert phase(demo, 0).stages[:2] == (ExpandCrop(0.0, 4.0, False), Flip(0.5))  # p = 0 mixup and distort left out


def test_coord_conv_uses_paddledetection_ramps():
    """PaddleDetection 2.6 ``add_coord``: ``arange(n) / ((n - 1) * 2) - 1`` (-1 .. -0.5), the
    formula the released weights were trained with (not Liu et al.'s -1 .. 1)."""
    from fastdet.models.ppyolo import CoordConv

    cc = CoordConv(1, 1, 1)
    seen = {}
    cc.conv.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))  # [B, C + 2, H, W]
    cc(torch.zeros(1, 1, 3, 5))
    gx, gy = seen["x"][0, 1], seen["x"][0, 2]
    torch.testing.assert_close(gx[0], torch.tensor([-1.0, -0.875, -0.75, -0.625, -0.5]))
    torch.testing.assert_close(gy[:, 0], torch.tensor([-1.0, -0.75, -0.5]))
    assert (gx == gx[:1]).all() and (gy == gy[:, :1]).all()


def test_inference_clips_boxes_as_paddle_yolo_box():
    """Paddle ``yolo_box(clip_bbox=True)``: x1, y1 >= 0 and x2 <= w - 1, y2 <= h - 1 (not [0, w])."""
    torch.manual_seed(0)
    model = build_ppyolo("r18vd", num_classes=3).eval()
    head = model.head
    feats = [torch.zeros(1, c, 64 // s, 64 // s) for c, s in zip(model.neck.out_channels, head.strides)]
    level = head._level

    def huge(i, f):  # log-sizes of 5: every box spans far past the image on all sides
        ioup, p = level(i, f)
        p = p.clone()
        p[:, :, 2:4] = 5.0
        return ioup, p

    head._level = huge
    with torch.no_grad():
        boxes, _ = head.inference(feats)
    assert boxes[..., :2].min() == 0 and boxes[..., :2].max() == 0
    assert boxes[..., 2:].min() == 63 and boxes[..., 2:].max() == 63
