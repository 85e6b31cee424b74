"""The evaluation-time preprocessing of each resize mode, and the way boxes map back."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from fastdet.data.preprocess import Preprocess, boxes_to_original
from fastdet.models import ARCHITECTURES


def _image(h=100, w=200):
    return np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)


def test_letterbox_pastes_top_left_and_pads():
    p = Preprocess(resize="letterbox", pad_value=114, mean=None, std=None)
    x, (sx, sy) = p(_image(), (96, 160))
    assert (sx, sy) == (0.8, 0.8)  # min(96/100, 160/200)
    assert x.shape == (3, 96, 160)
    assert torch.all(x[:, 80:, :] == 114)  # 100 * 0.8 = 80 rows of content
    assert not torch.all(x[:, :80, :] == 114)


def test_stretch_normalises_with_imagenet_stats():
    img = np.full((50, 70, 3), 128, np.uint8)
    x, scale = Preprocess()(img, (64, 64))
    assert scale == pytest.approx((64 / 70, 64 / 50))
    expect = (128 - torch.tensor([123.675, 116.28, 103.53])) / torch.tensor([58.395, 57.12, 57.375])
    assert torch.allclose(x[:, 10, 10], expect, atol=1e-5)


def test_keep_ratio_short_side_and_long_limit():
    p = Preprocess(resize="keep_ratio", short=80, max_long=120)
    # On a canvas of short side 80 (the limits' own scale): short side 100 -> 80 would make
    # the long side 160 > 120: the long side limits, r = 0.6.
    _, (sx, sy) = p(_image(100, 200), (80, 160))
    assert sx == sy == pytest.approx(0.6)
    _, (sx, _) = p(_image(100, 120), (80, 160))
    assert sx == pytest.approx(0.8)  # short side 100 -> 80, long 96 <= 120


@pytest.mark.parametrize("mode", ["stretch", "letterbox", "keep_ratio"])
def test_boxes_round_trip(mode):
    p = Preprocess(resize=mode, short=90, max_long=150)
    _, s = p(_image(), (96, 160))
    orig = torch.tensor([[10.0, 20.0, 50.0, 60.0], [150.0, 0.0, 260.0, 120.0]])
    on_input = orig * torch.tensor([s[0], s[1], s[0], s[1]])
    back = boxes_to_original(on_input, s, (100, 200))
    assert torch.allclose(back[0], orig[0], atol=1e-4)
    assert back[1].tolist() == pytest.approx([150.0, 0.0, 200.0, 100.0])  # clipped to the image


def test_read_only_image_needs_no_warning():
    """np.asarray of a PIL image is read-only; torch warns (once per process, hence the
    subprocess) when it wraps one. The image is copied instead, and left as it was."""
    import subprocess
    import sys

    code = """
import warnings
import numpy as np
from PIL import Image
from fastdet.data.preprocess import Preprocess
img = np.asarray(Image.new("RGB", (40, 30), (10, 20, 30)))
assert not img.flags.writeable
warnings.simplefilter("error")
x, _ = Preprocess(resize="letterbox")(img, (32, 64))
assert x.shape == (3, 32, 64) and (img == (10, 20, 30)).all()
"""
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- keep-ratio at another input size

@pytest.mark.parametrize("hw", [(128, 224), (224, 128), (128, 128), (800, 1344), (1344, 800), (800, 800)])
@pytest.mark.parametrize("image_hw", [(200, 352), (352, 200), (140, 150), (480, 640), (800, 1333), (60, 700)])
def test_keep_ratio_limits_scale_with_the_canvas_as_the_training_resize(hw, image_hw):
    """FCOS's 800 / 1333 are the limits at the recipe's 800: on a canvas of short side S they
    are S and S * 1333 / 800, as the training Resize stage (augment.resize_scale, the
    reference) and the DALI evaluation put them, not 800 / 1333 capped by the canvas (at
    128: a 352 x 200 image to a long side of 224, the canvas, instead of 213)."""
    from fastdet.data import stages as S
    from fastdet.data.augment import resize_scale

    p = Preprocess(resize="keep_ratio", short=800, max_long=1333, interp="linear")
    h, w = image_hw
    (_, _), (r, _) = resize_scale(S.Resize("keep_ratio", short=800, max_long=1333, interp="linear"), h, w, hw)
    assert p.scale(h, w, hw) == (r, r)
    _, (sx, sy) = p(np.zeros((h, w, 3), np.uint8), hw)
    assert (sx, sy) == (np.floor(w * r) / w, np.floor(h * r) / h)
    if (h, w, hw) == (200, 352, (128, 224)):
        assert np.floor(w * r) == 213  # 128 * 1333 / 800 = 213.3


# --------------------------------------------------------------------------- the authors' resize

def _half_up_cases(pre, size, n, fits=lambda h, w, canvas: True):
    """``n`` (h, w) whose content size at ``size`` floors to another value than halves up
    (``h r`` or ``w r`` with a fraction of .5 or more), spread over the grid, of those ``fits``."""
    cases = []
    for h in range(97, 1000, 37):
        for w in range(61, 1000, 53):
            canvas = pre.canvas(h, w, size)
            r = pre.scale(h, w, canvas)[0]
            if fits(h, w, canvas) and (math.floor(h * r + 0.5) != math.floor(h * r)
                                       or math.floor(w * r + 0.5) != math.floor(w * r)):
                cases.append((h, w))
    assert len(cases) >= n
    return cases[:: len(cases) // n][:n]


def _megvii_preproc():
    """``yolox.data.data_augment.preproc``, the file loaded alone: the ``yolox.data`` package
    imports its evaluators, which need ``tabulate`` (not installed); the file needs only cv2,
    numpy and ``yolox.utils``."""
    import importlib.util
    from pathlib import Path

    from test_convert import authors_module  # tests/ is on sys.path (rootdir conftest)

    root = Path(authors_module("yolox.utils").__file__).parent.parent
    spec = importlib.util.spec_from_file_location("megvii_data_augment", root / "data" / "data_augment.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.preproc


@pytest.mark.parametrize("size", [128, 416, 640])
def test_yolox_letterbox_is_megvii_preproc(size):
    """YOLOX's evaluation input is Megvii's ``yolox.data.data_augment.preproc``: content
    ``int(w r) x int(h r)`` on a 114 canvas (a 167 x 134 image at 128 was 103 px tall,
    halves up, where preproc gives 102; a 644 x 97 image 128 px wide, where preproc's
    ``int(644 * (128 / 644))`` is 127), and boxes map back divided by ``r``, as its
    COCOEvaluator does (not by the content's true factor ``int(w r) / w``)."""
    preproc = _megvii_preproc()
    pre = ARCHITECTURES["yolox"].preprocess
    cases = _half_up_cases(pre, size, 12) + [(134, 167), (97, 644), (256, 341), (341, 256)]
    for h, w in cases:
        img = np.full((h, w, 3), 255, np.uint8)  # any resize keeps it 255: the extent is exact
        ref, r = preproc(img, (size, size))
        x, (sx, sy) = pre(img, pre.canvas(h, w, size))
        assert torch.equal(x, torch.from_numpy(ref)), (h, w)
        assert (sx, sy) == (r, r)
        # Megvii's evaluator: bboxes /= min(size / h, size / w)
        boxes = torch.tensor([[0.0, 0.0, w * r, h * r], [3.0, 5.0, 0.5 * w * r, 0.75 * h * r]])
        torch.testing.assert_close(boxes_to_original(boxes, (sx, sy), (h, w)), boxes / r)


@pytest.mark.parametrize("size", [128, 800])
def test_fcos_keep_ratio_is_torchvisions_transform(size):
    """FCOS's evaluation input size is torchvision's ``GeneralizedRCNNTransform`` (min_size
    S, max_size S * 1333 / 800): ``interpolate(scale_factor=r, recompute_scale_factor=True)``
    floors ``h r`` and ``w r`` (halves used to round up), and its ``postprocess`` maps boxes
    back by the ratio of the original to the resized size (``resize_boxes``), not by ``r``.
    Of the images whose torchvision size fits their canvas: a near-square image (w / h within
    the square band) gets the S x S canvas and is scaled to fit it (fastdet's buckets)."""
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    pre = ARCHITECTURES["fcos"].preprocess
    max_size = size * pre.max_long / pre.short
    ref = GeneralizedRCNNTransform(min_size=size, max_size=max_size,
                                   image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0]).eval()

    def fits(h, w, canvas):  # torchvision's r (_resize_image_and_masks) within the canvas
        return min(size / min(h, w), max_size / max(h, w)) <= min(canvas[0] / h, canvas[1] / w)

    cases = _half_up_cases(pre, size, 8 if size == 800 else 16, fits) + [(256, 341), (341, 256)]
    for h, w in cases:
        img = np.full((h, w, 3), 255, np.uint8)
        with torch.no_grad():
            images, _ = ref([torch.from_numpy(img).permute(2, 0, 1).float()])
        rh, rw = images.image_sizes[0]
        canvas = pre.canvas(h, w, size)
        x, (sx, sy) = pre(img, canvas)
        assert pre.resized_hw(h, w, canvas) == (rh, rw), (h, w, size)
        white = pre.normalize_(torch.full((3, 1, 1), 255.0))  # a resized 255 stays 255
        content = (x == white).all(0)  # [H, W] where the image is: its top-left (rh, rw)
        assert content[:rh, :rw].all() and int(content.sum()) == rh * rw, (h, w, size)
        boxes = torch.tensor([[0.0, 0.0, rw, rh], [3.0, 5.0, 0.5 * rw, 0.75 * rh]])
        want = ref.postprocess([{"boxes": boxes.clone()}], [(rh, rw)], [(h, w)])[0]["boxes"]
        torch.testing.assert_close(boxes_to_original(boxes, (sx, sy), (h, w)), want)


# --------------------------------------------------------------------------- detect feeds what evaluation feeds

class _Recorder(torch.nn.Module):
    """A detector that records the inputs ``predict`` gets and finds one box, ``BOX`` in input px."""

    BOX = (10.0, 20.0, 50.0, 60.0)

    def __init__(self, preprocess, img_size):
        from fastdet.api import DetectorInfo

        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.info = DetectorInfo(arch="stub", size="x", class_names=("a",), cat_ids=(1,), preprocess=preprocess,
                                 img_size=img_size)
        self.inputs: list[torch.Tensor] = []

    def predict(self, images, **kw):
        self.inputs.append(images.clone())
        return [{"boxes": torch.tensor([self.BOX]), "scores": torch.ones(1), "labels": torch.zeros(1, dtype=torch.long)}
                for _ in images]


@pytest.fixture(scope="module")
def oriented(tmp_path_factory):
    """Landscape, portrait and square PNGs of random pixels, as ImageRecords."""
    from fastdet.data.records import ImageRecord

    root = tmp_path_factory.mktemp("oriented")
    rng = np.random.default_rng(5)
    recs = []
    for i, (h, w) in enumerate(((200, 352), (352, 200), (140, 150), (150, 260))):
        f = root / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(f)
        recs.append(ImageRecord(i + 1, str(f), w, h, np.array([[1.0, 2.0, 30.0, 40.0]], np.float32),
                                np.zeros(1, np.int64)))
    return recs


def _eval_batches(records, preprocess, img_size, batch_size):
    from types import SimpleNamespace

    from fastdet.config import DataConfig
    from fastdet.data.loader import build_eval_loader

    data = DataConfig(loader="torch", eval_batch_size=batch_size, img_size=img_size, num_workers=0,
                      check_images="open")
    ds = SimpleNamespace(records=list(records), ann_file="x.json")
    return list(build_eval_loader(data, ds, preprocess=preprocess, rank=0, world_size=1, device="cpu"))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_detect_feeds_each_image_as_evaluation_does(arch, oriented):
    """For every family, the tensor fastdet.detect gives the model for an image is the one
    the evaluation loader gives it (same canvas, same pixels), for landscape, portrait and
    square images in one call, and each image's boxes come back by its own scale; at batch
    size 1, the recipe's eval batch size (FCOS: 2) and the whole mixed list. FCOS
    (keep-ratio) used to get a square S x S canvas here, its images 25-40 % smaller than
    evaluated; and its evaluation batches used to put a minority-orientation image on the
    batch's canvas, scaled down to fit (at eval batch size 2: the portrait image of the
    first pair on the landscape canvas)."""
    from fastdet.api import detect, preprocess_images
    from fastdet.config import DataConfig

    fam = ARCHITECTURES[arch]
    pre, size = fam.preprocess, 128
    det = _Recorder(pre, size)
    out = detect(det, [r.file for r in oriented])
    fed = [x for batch in det.inputs for x in batch]
    assert len(fed) == len(oriented)
    recipe_batch = fam.recipe.base.get("data.eval_batch_size", DataConfig().eval_batch_size)
    for batch_size in sorted({1, recipe_batch, len(oriented)}):
        by_id = {}
        for b in _eval_batches(oriented, pre, size, batch_size):
            for j, i in enumerate(b["image_ids"].tolist()):
                by_id[i] = (b["images"][j], b["scale_factors"][j])
        assert sorted(by_id) == [r.image_id for r in oriented]
        for r, o in zip(oriented, out):
            x, scale = by_id[r.image_id]
            assert sum(f.shape == x.shape and torch.equal(f, x) for f in fed) == 1, \
                (arch, batch_size, r.width, r.height)
            sx, sy = scale.tolist()
            x0, y0, x1, y1 = _Recorder.BOX
            expect = torch.tensor([[x0 / sx, y0 / sy, min(x1 / sx, r.width), min(y1 / sy, r.height)]])
            torch.testing.assert_close(o["boxes"], expect)
    shapes = {tuple(f.shape[-2:]) for f in fed}
    assert shapes == ({(128, 224), (224, 128), (128, 128)} if pre.resize == "keep_ratio" else {(128, 128)})
    # preprocess_images of a list of one orientation is the evaluation loader's batch of it.
    group = [r for r in oriented if r.width > 1.1 * r.height]
    assert len(group) == 2
    (batch,) = _eval_batches(group, pre, size, len(group))
    x, scales = preprocess_images([np.asarray(Image.open(r.file).convert("RGB")) for r in group], pre, size)
    assert torch.equal(x, batch["images"])
    torch.testing.assert_close(torch.tensor(scales, dtype=torch.float32), batch["scale_factors"])
    # Of a mixed list: one canvas, its most common orientation's (landscape here).
    x, _ = preprocess_images([np.asarray(Image.open(r.file).convert("RGB")) for r in oriented], pre, size)
    assert tuple(x.shape[-2:]) == ((128, 224) if pre.resize == "keep_ratio" else (128, 128))
