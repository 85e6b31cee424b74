"""fastdet.ops.yolo_targets in every back end (torch reference, C++, CUDA on a GPU) against a
loop rendering of PaddleDetection's ``Gt2YoloTarget``, mixup scores, duplicates and
degenerate boxes included; bit-for-bit determinism; the custom op traces without a
graph break."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastdet.ops as ops
from fastdet.ops import _ext
from fastdet.ops.yolo import yolo_targets_reference

ANCHORS = [(10, 13), (16, 30), (33, 23), (30, 61), (62, 45), (59, 119), (116, 90), (156, 198), (373, 326)]
MASKS = [(6, 7, 8), (3, 4, 5), (0, 1, 2)]
STRIDES = [32, 16, 8]


def gt2yolo_loop(boxes, labels, mask, scores, anchors, masks, strides, img_hw, num_classes):
    """PaddleDetection ``Gt2YoloTarget.__call__`` (iou_thresh 1), sample by sample and box by
    box, on the normalised cxcywh boxes it receives (made from our xyxy px in float32).

    One liberty: Paddle's anchor IoU mixes float32 boxes with float64 anchors; here it is
    float32 like the op's, which can only matter for two anchors tied within 1e-7."""
    h, w = img_hw
    an_hw = np.array(anchors) / np.array([[w, h]])
    out = [np.zeros((boxes.shape[0], len(m), 6 + num_classes, h // s, w // s), np.float32)
           for m, s in zip(masks, strides)]
    b_np = boxes.numpy().astype(np.float32)
    W, H = np.float32(w), np.float32(h)
    for n in range(boxes.shape[0]):
        for b in range(boxes.shape[1]):
            if not mask[n, b]:
                continue  # PadBox's zero boxes: gw = gh = 0, skipped below too
            x1, y1, x2, y2 = b_np[n, b]
            gx, gy = (x1 + x2) * np.float32(0.5) / W, (y1 + y2) * np.float32(0.5) / H
            gw, gh = (x2 - x1) / W, (y2 - y1) / H
            cls, score = int(labels[n, b]), np.float32(scores[n, b])
            if gw <= 0.0 or gh <= 0.0 or score <= 0.0:
                continue
            best_iou, best_idx = 0.0, -1
            for an_idx in range(an_hw.shape[0]):
                aw, ah = np.float32(an_hw[an_idx, 0]), np.float32(an_hw[an_idx, 1])
                inter = min(gw, aw) * min(gh, ah)
                iou = inter / (gw * gh + aw * ah - inter)
                if iou > best_iou:
                    best_iou, best_idx = iou, an_idx
            for i, (m, s) in enumerate(zip(masks, strides)):
                grid_h, grid_w = h // s, w // s
                gi, gj = int(gx * np.float32(grid_w)), int(gy * np.float32(grid_h))
                if best_idx in m:
                    best_n = m.index(best_idx)
                    t = out[i][n]
                    t[best_n, 0, gj, gi] = gx * np.float32(grid_w) - gi
                    t[best_n, 1, gj, gi] = gy * np.float32(grid_h) - gj
                    t[best_n, 2, gj, gi] = np.log(gw * W / np.float32(anchors[best_idx][0]))
                    t[best_n, 3, gj, gi] = np.log(gh * H / np.float32(anchors[best_idx][1]))
                    t[best_n, 4, gj, gi] = 2.0 - gw * gh
                    t[best_n, 5, gj, gi] = score
                    t[best_n, 6 + cls, gj, gi] = 1.0
    return [torch.from_numpy(t) for t in out]


def make_inputs(B=3, M=12, img_hw=(96, 128), C=5, seed=0):
    """Random boxes of every size inside the image, mixup scores in (0, 1], padded slots,
    a zero-area box, a zero-score box and an exact duplicate cell (two boxes, two classes)."""
    g = torch.Generator().manual_seed(seed)
    h, w = img_hw
    c = torch.rand(B, M, 2, generator=g) * torch.tensor([w, h])
    wh = torch.rand(B, M, 2, generator=g) ** 2 * torch.tensor([w, h]) * 0.9 + 2.0
    boxes = torch.cat([c - wh / 2, c + wh / 2], -1)
    boxes[..., 0::2] = boxes[..., 0::2].clamp(0, w)
    boxes[..., 1::2] = boxes[..., 1::2].clamp(0, h)
    labels = torch.randint(0, C, (B, M), generator=g)
    scores = torch.where(torch.rand(B, M, generator=g) < 0.5, torch.rand(B, M, generator=g).clamp(min=0.05), 1.0)
    mask = torch.ones(B, M, dtype=torch.bool)
    mask[0, -3:] = False
    boxes[0, -3:] = 0.0
    boxes[1, 0, 2] = boxes[1, 0, 0]  # no width
    scores[1, 1] = 0.0  # mixup weight 0
    boxes[2, 1] = boxes[2, 0] + 0.5  # same anchor and cell as box 0 (the later wins)
    labels[2, 0], labels[2, 1] = 0, C - 1
    return boxes, labels, mask, scores


def run(boxes, labels, mask, scores, img_hw, C):
    return ops.yolo_targets(boxes, labels, mask, scores, ANCHORS, MASKS, STRIDES, img_hw, C)


def assert_matches_loop(got, boxes, labels, mask, scores, img_hw, C):
    want = gt2yolo_loop(boxes, labels, mask, scores, ANCHORS, MASKS, STRIDES, img_hw, C)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        g = g.cpu()
        # Same cells (exactly), same values up to an ulp of log().
        assert torch.equal(g[:, :, 5] > 0, w[:, :, 5] > 0)
        assert torch.equal(g[:, :, 6:], w[:, :, 6:])
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.fixture(params=["torch", "cpp"])
def backend(request):
    if request.param == "cpp" and not _ext.load():
        pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
    with ops.use_backend(request.param, "cpu"):
        assert ops.backend_for("yolo_targets", "cpu") == request.param
        yield request.param


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_gt2yolotarget_loop(backend, seed):
    img_hw, C = ((96, 128), 5) if seed < 2 else ((608, 608), 80)
    x = make_inputs(B=3, M=12 if seed < 2 else 50, img_hw=img_hw, C=C, seed=seed)
    got = run(*x, img_hw, C)
    assert_matches_loop(got, *x, img_hw, C)
    tobj = torch.cat([g[:, :, 5][g[:, :, 5] > 0] for g in got])
    assert tobj.numel() > 0 and (tobj < 1).any()  # mixup scores reach the grids


def test_duplicates_later_box_wins_and_classes_accumulate(backend):
    boxes = torch.tensor([[[10.0, 10.0, 40.0, 30.0], [11.0, 10.0, 41.0, 30.0], [0.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[1, 3, 0]])
    mask = torch.tensor([[True, True, False]])
    scores = torch.tensor([[0.7, 0.4, 0.0]])
    got = run(boxes, labels, mask, scores, (64, 64), 4)
    hits = [(lvl, idx) for lvl, g in enumerate(got) for idx in (g[:, :, 5] > 0).nonzero().tolist()]
    assert len(hits) == 1
    lvl, (b, n, j, i) = hits[0]
    cell = got[lvl][b, n, :, j, i]
    assert cell[5].item() == pytest.approx(0.4)  # the later box's score
    assert cell[0].item() == pytest.approx((11 + 41) / 2 / 64 * (64 // STRIDES[lvl]) - i, abs=1e-6)
    assert cell[6:].tolist() == [0.0, 1.0, 0.0, 1.0]  # Paddle's loop never clears the first class


def test_no_boxes_and_all_padded(backend):
    for M in (0, 4):
        boxes = torch.zeros(2, M, 4)
        out = run(boxes, torch.zeros(2, M, dtype=torch.long), torch.zeros(2, M, dtype=torch.bool), torch.zeros(2, M),
                  (64, 96), 3)
        assert [tuple(t.shape) for t in out] == [(2, 3, 9, 2, 3), (2, 3, 9, 4, 6), (2, 3, 9, 8, 12)]
        assert all(t.abs().sum() == 0 for t in out)


def test_deterministic_bit_for_bit(backend):
    x = make_inputs(B=4, M=50, img_hw=(320, 320), C=80, seed=3)
    a = run(*x, (320, 320), 80)
    b = run(*x, (320, 320), 80)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_cpp_equals_reference_bit_for_bit_on_cells():
    if not _ext.load():
        pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
    x = make_inputs(B=4, M=50, img_hw=(416, 416), C=80, seed=4)
    with ops.use_backend("cpp", "cpu"):
        a = run(*x, (416, 416), 80)
    b = yolo_targets_reference(*x, ANCHORS, MASKS, STRIDES, (416, 416), 80)
    for u, v in zip(a, b):
        assert torch.equal(u[:, :, [0, 1, 4, 5]], v[:, :, [0, 1, 4, 5]])  # no transcendental: exact
        assert torch.equal(u[:, :, 6:], v[:, :, 6:])
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)


def test_bad_arguments_get_a_sentence():
    x = make_inputs()
    with pytest.raises(ValueError, match="iou_thresh=1.0"):
        ops.yolo_targets(*x, ANCHORS, MASKS, STRIDES, (96, 128), 5, iou_thresh=0.5)
    with pytest.raises(ValueError, match="names anchor 9"):
        ops.yolo_targets(*x, ANCHORS, [(6, 7, 9)], [32], (96, 128), 5)
    with pytest.raises(ValueError, match="anchor masks but"):
        ops.yolo_targets(*x, ANCHORS, MASKS, [32, 16], (96, 128), 5)


def test_custom_op_traces_without_graph_break():
    if not _ext.load():
        pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
    torch._dynamo.reset()
    x = make_inputs()

    def f(boxes, labels, mask, scores):
        return [t.sum() for t in run(boxes, labels, mask, scores, (96, 128), 5)]

    with ops.use_backend("cpp", "cpu"):
        explained = torch._dynamo.explain(f)(*x)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        for u, v in zip(compiled(*x), f(*x)):
            torch.testing.assert_close(u, v)
    torch.library.opcheck(torch.ops.fastdet.yolo_targets.default,
                          (x[0], x[1], x[2], x[3], [float(v) for a in ANCHORS for v in a],
                           [2, 2, 2, 1, 1, 1, 0, 0, 0], [0, 1, 2, 0, 1, 2, 0, 1, 2], STRIDES, 96, 128, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_matches_loop_and_is_deterministic():
    if not (_ext.load() and _ext.has_cuda_kernels()):
        pytest.fail(f"the CUDA kernels did not build: {_ext.error()}")
    torch.use_deterministic_algorithms(True)
    try:
        for seed, (img_hw, C, M) in enumerate([((96, 128), 5, 12), ((608, 608), 80, 50), ((320, 416), 80, 200)]):
            x = make_inputs(B=8, M=M, img_hw=img_hw, C=C, seed=seed)
            xc = [t.cuda() for t in x]
            for backend in ("cuda", "torch"):
                with ops.use_backend(backend, "cuda"):
                    a = run(*xc, img_hw, C)
                    b = run(*xc, img_hw, C)
                assert all(torch.equal(u, v) for u, v in zip(a, b)), backend
                assert_matches_loop(a, *x, img_hw, C)
    finally:
        torch.use_deterministic_algorithms(False)
