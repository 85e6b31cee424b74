"""The evaluation-time preprocessing of each resize mode, and the way boxes map back."""

import numpy as np
import pytest
import torch

from fastdet.data.preprocess import Preprocess, boxes_to_original


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
    # short side 100 -> 80 would make the long side 160 > 120: the long side limits, r = 0.6.
    _, (sx, sy) = p(_image(100, 200), (128, 128))
    assert sx == sy == pytest.approx(0.6)
    _, (sx, _) = p(_image(100, 120), (128, 128))
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
