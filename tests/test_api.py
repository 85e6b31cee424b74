"""The Python API without a trained model: ``preprocess_images``'s inputs. The tests that
need a checkpoint are in test_inference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastdet.api import preprocess_images
from fastdet.models import ARCHITECTURES


def _image(h: int = 45, w: int = 70) -> np.ndarray:
    """A smooth RGB uint8 image (interpolation between neighbours gives non-integer values)."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([(x * 3.7) % 256, (y * 5.3) % 256, ((x + y) * 2.1) % 256], -1).astype(np.uint8)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_preprocess_images_takes_what_detect_takes(arch, tmp_path):
    """Paths, PIL images, arrays and tensors, as ``detect``; a float image gives the pixels of
    the same uint8 image (the float path resized without rounding: up to 1.0 apart for YOLOX)."""
    pre = ARCHITECTURES[arch].preprocess
    img = _image()
    want, want_s = preprocess_images([img], pre, 64)
    path = tmp_path / "img.png"
    Image.fromarray(img).save(path)
    for same in ([img.astype(np.float32)], [torch.from_numpy(img).double()], [Image.open(path)], [path], str(path),
                 img, torch.from_numpy(img)[None]):
        got, s = preprocess_images(same, pre, 64)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=type(same).__name__)
        assert s == want_s
    gray, _ = preprocess_images([img[..., 0]], pre, 64)
    torch.testing.assert_close(gray, preprocess_images([np.repeat(img[..., :1], 3, 2)], pre, 64)[0], rtol=0, atol=0)


def test_preprocess_images_refuses_what_detect_refuses():
    pre = ARCHITECTURES["yolox"].preprocess
    img = _image()
    for bad, says in (([img / 255.0], r"images\[0\]: float image values lie in 0..1; .*multiply a \[0, 1\] image"),
                      ([img.astype(np.float32) * 2], r"images\[0\]: float image values must lie in 0..255"),
                      ([img.astype(np.int32)], r"images\[0\]: expected uint8 \(or float 0..255\) pixels"),
                      ([img[..., :2]], r"images\[0\]: expected an \[H, W\] or \[H, W, 1\|3\|4\] image"),
                      ([img, "no/such/file.jpg"], r"no/such/file.jpg"),
                      ([{"image": img}], r"images\[0\]: expected a path, a PIL image or an \[H, W, C\] array")):
        with pytest.raises(ValueError, match=says):
            preprocess_images(bad, pre, 64)
