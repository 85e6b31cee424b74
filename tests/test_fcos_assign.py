"""``fastdet.ops.fcos_assign`` in every back end against a loop rendering of its semantics,
against torchvision's FCOS matching (``FCOS.compute_loss``), and against constructed cases: a point on a box's edge, a point in two boxes (smaller wins,
then the lower slot), a box larger than every range, centre sampling, padded slots.

The Triton kernel runs in Triton's interpreter, which must be switched on before triton is
imported: the one test collected normally for it re-runs this file in a subprocess with
``TRITON_INTERPRET=1``, where only the Triton back end is tested.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from types import SimpleNamespace

from torchvision.models.detection.fcos import FCOS as TorchvisionFCOS

import fastdet.ops as ops
from fastdet.models.fcos import feature_shapes, level_points
from fastdet.ops import _ext
from fastdet.ops.fcos import fcos_assign as reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["triton"] if INTERPRETED else ["torch", "cpp"]


def fcos_points(h: int, w: int):
    """Points, strides and ranges of the FCOS head for an ``h`` x ``w`` input."""
    return level_points(feature_shapes(h, w))


def loop_rendering(points, strides, ranges, boxes, labels, mask, radius=1.5):
    """The semantics written out point by point, box by box, in float32 numpy scalars."""
    f = np.float32
    P, S, R = points.numpy(), strides.numpy(), ranges.numpy()
    G, L, V = boxes.numpy(), labels.numpy(), mask.numpy()
    B, M = G.shape[:2]
    A = P.shape[0]
    out_gt = np.full((B, A), -1, np.int64)
    out_label = np.full((B, A), -1, np.int64)
    for b in range(B):
        for a in range(A):
            x, y = P[a]
            rs = f(S[a]) * f(radius)
            best, best_area = -1, None
            for m in range(M):
                if not V[b, m]:
                    continue
                x1, y1, x2, y2 = G[b, m]
                l, t, r, bb = x - x1, y - y1, x2 - x, y2 - y
                inside = min(l, t, r, bb) > 0
                cx, cy = (x1 + x2) / f(2), (y1 + y2) / f(2)
                near = max(abs(x - cx), abs(y - cy)) < rs
                far = max(l, t, r, bb)
                if inside and near and R[a, 0] < far < R[a, 1]:
                    area = (x2 - x1) * (y2 - y1)
                    if best < 0 or area < best_area:
                        best, best_area = m, area
            out_gt[b, a] = best
            out_label[b, a] = -1 if best < 0 else L[b, best]
    return torch.from_numpy(out_gt), torch.from_numpy(out_label)


def random_case(B: int, M: int, h: int, w: int, seed: int):
    """Boxes of every scale (10 to 700 px) on a grid of 4 px, so that points fall on edges
    and centres exactly; duplicated boxes (equal areas); padded slots holding junk boxes."""
    g = torch.Generator().manual_seed(seed)
    wh = (torch.exp(torch.rand(B, M, 2, generator=g) * math.log(70)) * 10 / 4).round() * 4 + 4
    ctr = (torch.rand(B, M, 2, generator=g) * torch.tensor([w, h]) / 4).round() * 4
    boxes = torch.cat([ctr - wh / 2, ctr + wh / 2], -1)
    boxes[:, 1] = boxes[:, 0]  # a duplicate: equal areas, the lower slot must win
    labels = torch.randint(0, 5, (B, M), generator=g)
    mask = torch.rand(B, M, generator=g) < 0.8
    mask[:, :2] = True
    return boxes, labels, mask


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "cpp" and not _ext.load():
        pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
    with ops.use_backend(request.param, "cpu"):
        assert ops.backend_for("fcos_assign", "cpu") == request.param
        yield request.param


def _run(points, strides, ranges, boxes, labels, mask, radius=1.5):
    return ops.fcos_assign(points, strides, ranges, boxes, labels, mask, radius)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop_rendering(backend, seed):
    h, w = 256, 320
    points, strides, ranges = fcos_points(h, w)
    boxes, labels, mask = random_case(2, 12, h, w, seed)
    want_gt, want_label = loop_rendering(points, strides, ranges, boxes, labels, mask)
    got_gt, got_label = _run(points, strides, ranges, boxes, labels, mask)
    assert got_gt.dtype == torch.int64 and got_gt.shape == (2, points.shape[0])
    assert torch.equal(got_gt, want_gt)
    assert torch.equal(got_label, want_label)
    assert (want_gt >= 0).sum() > 40  # the case has positives on several levels
    assert len(set(strides[(want_gt >= 0).any(0)].tolist())) >= 3
    # The reference (which forms [B, M, A]) agrees with the loop rendering too.
    ref_gt, ref_label = reference(points, strides, ranges, boxes, labels, mask)
    assert torch.equal(ref_gt, want_gt) and torch.equal(ref_label, want_label)


def torchvision_matching(points, strides, shapes, boxes, mask):
    """torchvision's FCOS point-to-box matching, run as it is: ``FCOS.compute_loss`` up to
    the head's loss, which here returns the matched indices. Its anchors are boxes of one
    stride centred on the points; each image gets its valid boxes only, and the indices
    come back as slots of the padded ``boxes``."""
    fcos = SimpleNamespace(center_sampling_radius=1.5,
                           head=SimpleNamespace(compute_loss=lambda targets, outputs, anchors, matched: matched))
    half = strides[:, None] / 2
    anchors = torch.cat([points - half, points + half], dim=1)  # [A, 4]
    targets = [{"boxes": boxes[i][mask[i]]} for i in range(boxes.shape[0])]
    per_level = [h * w for h, w in shapes]
    matched = TorchvisionFCOS.compute_loss(fcos, targets, {}, [anchors] * len(targets), per_level)
    out = []
    for i, m in enumerate(matched):
        slots = mask[i].nonzero().flatten()
        out.append(torch.where(m >= 0, slots[m.clamp(min=0)], -1) if len(slots) else m)
    return torch.stack(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_torchvision_fcos(backend, seed):
    """Same ranges ((0, 64) ... (512, inf) are torchvision's 4x and 8x the stride), the same
    strict inequalities, smallest box first and the lower slot on equal areas."""
    h, w = 256, 320
    points, strides, ranges = fcos_points(h, w)
    boxes, labels, mask = random_case(3, 12, h, w, seed)
    mask[2] = False  # an image without boxes
    want = torchvision_matching(points, strides, feature_shapes(h, w), boxes, mask)
    got, _ = _run(points, strides, ranges, boxes, labels, mask)
    assert (want[:2] >= 0).sum() > 40 and (want[2] < 0).all()
    assert torch.equal(got, want)


def _one_level(xs, ys, stride=8.0, lo=0.0, hi=64.0):
    points = torch.tensor([[x, y] for x, y in zip(xs, ys)], dtype=torch.float32)
    A = points.shape[0]
    return points, torch.full((A,), stride), torch.tensor([[lo, hi]]).expand(A, 2).contiguous()


def test_point_on_an_edge_is_not_inside(backend):
    # Box 0..20 x 0..20 (centre 10, 10): points on the left edge, the bottom edge, a corner,
    # and just inside the left edge.
    points, strides, ranges = _one_level([0.0, 10.0, 20.0, 0.5], [10.0, 20.0, 20.0, 10.0])
    boxes = torch.tensor([[[0.0, 0.0, 20.0, 20.0]]])
    gt, label = _run(points, strides, ranges, boxes, torch.tensor([[3]]), torch.tensor([[True]]))
    assert gt.tolist() == [[-1, -1, -1, 0]]
    assert label.tolist() == [[-1, -1, -1, 3]]


def test_point_in_two_boxes_goes_to_the_smaller(backend):
    points, strides, ranges = _one_level([10.0], [10.0])
    big = [0.0, 0.0, 20.0, 20.0]
    small = [2.0, 4.0, 18.0, 16.0]  # same centre, area 192 < 400
    same = [4.0, 2.0, 16.0, 18.0]  # area 192 too: ties go to the lower slot
    mask = torch.tensor([[True, True, True]])
    labels = torch.tensor([[1, 2, 3]])
    gt, label = _run(points, strides, ranges, torch.tensor([[big, small, same]]), labels, mask)
    assert gt.tolist() == [[1]] and label.tolist() == [[2]]
    gt, _ = _run(points, strides, ranges, torch.tensor([[big, same, small]]), labels, mask)
    assert gt.tolist() == [[1]]
    gt, label = _run(points, strides, ranges, torch.tensor([[small, big, same]]), labels, mask)
    assert gt.tolist() == [[0]] and label.tolist() == [[1]]
    # The smaller box padded away: the big one takes the point.
    gt, _ = _run(points, strides, ranges, torch.tensor([[big, small, same]]), labels,
                 torch.tensor([[True, False, False]]))
    assert gt.tolist() == [[0]]


def test_box_larger_than_every_range(backend):
    # A 2000 px box: max(l, t, r, b) ~ 1000 px near its centre, beyond every finite range.
    h, w = 2048, 2048
    points, strides, ranges = fcos_points(h, w)
    boxes = torch.tensor([[[24.0, 24.0, 2024.0, 2024.0]]])
    labels, mask = torch.tensor([[4]]), torch.tensor([[True]])
    gt, _ = _run(points, strides, ranges, boxes, labels, mask)
    pos = gt[0] >= 0
    assert pos.any() and (strides[pos] == 128).all()  # only the last level, whose range is (512, inf)
    # With the last range closed at 512 the box fits no level at all.
    finite = ranges.clone()
    finite[:, 1] = finite[:, 1].clamp(max=512.0)
    gt, label = _run(points, strides, finite, boxes, labels, mask)
    assert (gt == -1).all() and (label == -1).all()


def test_centre_sampling_and_level_range(backend):
    # Box 0..160 x 0..40 (centre 80, 20) at stride 8: radius 1.5 x 8 = 12 px around the centre.
    xs = [80.0, 91.0, 93.0, 68.5, 80.0]
    ys = [20.0, 20.0, 20.0, 20.0, 31.0]
    points, strides, ranges = _one_level(xs, ys, hi=128.0)
    boxes = torch.tensor([[[0.0, 0.0, 160.0, 40.0]]])
    gt, _ = _run(points, strides, ranges, boxes, torch.tensor([[0]]), torch.tensor([[True]]))
    assert gt.tolist() == [[0, 0, -1, 0, 0]]
    # max(l, t, r, b) = 80 at the centre: outside (0, 64), inside (64, 128).
    gt, _ = _run(points, strides, ranges.clone().fill_(0.0) + torch.tensor([0.0, 64.0]), boxes, torch.tensor([[0]]),
                 torch.tensor([[True]]))
    assert (gt == -1).all()


def test_empty_and_all_padded(backend):
    points, strides, ranges = fcos_points(64, 64)
    A = points.shape[0]
    gt, label = _run(points, strides, ranges, torch.zeros(2, 0, 4), torch.zeros(2, 0, dtype=torch.long),
                     torch.zeros(2, 0, dtype=torch.bool))
    assert gt.shape == (2, A) and (gt == -1).all() and (label == -1).all()
    boxes = torch.tensor([[[0.0, 0.0, 64.0, 64.0]]]).expand(2, 3, 4).contiguous()
    gt, _ = _run(points, strides, ranges, boxes, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool))
    assert (gt == -1).all()


if not INTERPRETED:

    def test_triton_kernel_under_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"interpreted Triton tests failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
        assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]

    def test_bad_shapes_get_a_sentence():
        points, strides, ranges = fcos_points(64, 64)
        boxes, labels, mask = random_case(1, 3, 64, 64, 0)
        with pytest.raises(ValueError, match="points must be"):
            ops.fcos_assign(points[:, :1], strides, ranges, boxes, labels, mask)
        with pytest.raises(ValueError, match="strides must be"):
            ops.fcos_assign(points, strides[:-1], ranges, boxes, labels, mask)
        with pytest.raises(ValueError, match="gt_labels and gt_mask"):
            ops.fcos_assign(points, strides, ranges, boxes, labels[:, :2], mask)

    @pytest.mark.parametrize("name", ["cpp", "torch"])
    def test_compiles_without_graph_break(name):
        """A torch custom op with a fake: dynamo traces through it (no graph break), and the
        inductor-compiled call matches eager."""
        if name == "cpp" and not _ext.load():
            pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
        torch._dynamo.reset()
        points, strides, ranges = fcos_points(128, 128)
        boxes, labels, mask = random_case(2, 5, 128, 128, 3)

        def fn(boxes):
            gt, label = ops.fcos_assign(points, strides, ranges, boxes, labels, mask)
            return (gt >= 0).sum(), label

        with ops.use_backend(name, "cpu"):
            explained = torch._dynamo.explain(fn)(boxes)
            assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
            got = torch.compile(fn, fullgraph=True)(boxes)
        want = fn(boxes)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def test_cuda_kernel_is_registered():
        if not _ext.load():
            pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
        if _ext.variant() != "cuda":
            pytest.skip("the C++-only variant was built (no GPU, or no toolkit; tests/test_ops_build.py compiles the CUDA one)")
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastdet::fcos_assign", "CUDA")
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastdet::fcos_assign", "CPU")

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    @pytest.mark.parametrize("name", ["cuda", "triton"])
    def test_gpu_kernels_match_reference(name):
        h, w = 800, 1344
        points, strides, ranges = (t.cuda() for t in fcos_points(h, w))
        boxes, labels, mask = (t.cuda() for t in random_case(4, 100, h, w, 5))
        want = reference(points, strides, ranges, boxes, labels, mask)
        with ops.use_backend(name, "cuda"):
            assert ops.backend_for("fcos_assign", "cuda") == name
            got = ops.fcos_assign(points, strides, ranges, boxes, labels, mask)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
