"""The Python API without a trained model: ``preprocess_images``'s inputs, the messages of
``load_detector`` (Python keywords, CLI flags), ``build_model``'s ``num_classes`` and
``dir(fastdet)``. The tests that need a checkpoint are in test_inference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import fastdet
from fastdet.api import CheckpointError, load_detector, preprocess_images
from fastdet.models import ARCHITECTURES, build_model
from fastdet.registry import get_preset


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


def test_dir_lists_the_lazy_api():
    names = dir(fastdet)
    assert {"load_detector", "detect", "preprocess_images", "DetectorInfo", "CheckpointError"} <= set(names)
    assert "__version__" in names and fastdet.load_detector is load_detector


def test_build_model_takes_any_integral_num_classes():
    for n in (np.int64(4), torch.tensor(3)):
        head = build_model("yolox", "nano", n).head
        assert type(head.num_classes) is int and head.num_classes == int(n)
    for bad in (4.0, True, "4", 0, np.int64(-1)):
        with pytest.raises(ValueError, match="num_classes must be a positive integer"):
            build_model("yolox", "nano", bad)


def test_load_detector_of_a_folder_names_the_checkpoints_in_it(tmp_path, capsys):
    from fastdet.predict import main as predict_main

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(CheckpointError, match=r"run: a folder, not a checkpoint file$"):
        load_detector(run)
    (run / "best.pth").write_bytes(b"")
    (run / "latest.pth").write_bytes(b"")
    for kw in ({}, {"arch": "yolox"}):
        with pytest.raises(CheckpointError, match=r"a folder, not a checkpoint file \(it holds best.pth and "
                                                  r"latest.pth: pass .*run/best.pth\)"):
            load_detector(run, **kw)
    Image.fromarray(_image()).save(tmp_path / "a.jpg")
    assert predict_main(["--ckpt", str(run), "--source", str(tmp_path / "a.jpg"), "--output-dir",
                         str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a folder, not a checkpoint file (it holds best.pth" in err[0], err


def _fastdet_checkpoint(tmp_path):
    """A fastdet checkpoint's header (config and a model entry): the argument checks run before
    any weight is read, so the weights need not be there."""
    path = tmp_path / "yolox_nano.pth"
    torch.save({"config": get_preset("yolox", "nano").to_dict(), "model": {}}, path)
    return path


def test_load_detector_names_its_keywords_and_the_cli_its_flags(tmp_path, capsys):
    from fastdet.eval.__main__ import main as eval_main
    from fastdet.predict import main as predict_main

    ck = _fastdet_checkpoint(tmp_path)
    for kw, says in (({"arch": "ppyoloe"}, "arch='ppyoloe'"), ({"arch": "yolox", "size": "s"}, "size='s'"),
                     ({"source": "megvii"}, "source='megvii'")):
        with pytest.raises(CheckpointError, match=f"a fastdet yolox-nano checkpoint, but {says} was given .*: drop it"):
            load_detector(ck, **kw)
    assert eval_main(["--ckpt", str(ck), "--arch", "ppyoloe"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "but --arch ppyoloe was given" in err[0], err

    released = tmp_path / "yolox_s.pth"  # what Megvii publishes: {"model": state dict, ...}
    torch.save({"model": {"backbone.weight": torch.zeros(2)}, "start_epoch": 300}, released)
    with pytest.raises(CheckpointError, match=r"a plain state dict .*; an authors' released file is converted on "
                                              r"load with arch= \(e.g. arch='yolox'\)\)$"):
        load_detector(released)
    assert eval_main(["--ckpt", str(released)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "converted on load with --arch (e.g. --arch yolox)" in err[0], err
    Image.fromarray(_image()).save(tmp_path / "a.jpg")
    assert predict_main(["--ckpt", str(released), "--source", str(tmp_path / "a.jpg"),
                         "--output-dir", str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python -m fastdet.convert FILE --arch ARCH" in err[0] and "arch=" not in err[0], err


def test_a_paddle_file_or_an_unsafe_one_says_what_it_is(tmp_path, capsys):
    """An authors' .pdparams (a pickle) given where a fastdet checkpoint is read says it is
    one and how it loads (arch= / --arch), and a torch file that needs code to unpickle says
    it was refused for that; before, both were "a corrupt file or another format"."""
    import argparse
    import pickle

    import numpy as np

    from fastdet.eval.__main__ import main as eval_main

    pd = tmp_path / "ppyoloe_crn_s_300e_coco.pdparams"
    with open(pd, "wb") as f:
        pickle.dump({"conv.w": np.zeros(3, np.float32)}, f, protocol=2)
    with pytest.raises(CheckpointError, match=r"a pickle, as Paddle's \.pdparams are; an authors' released file is "
                                              r"converted on load with arch="):
        load_detector(pd)
    assert eval_main(["--ckpt", str(pd)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "converted on load with --arch" in err[0], err
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"model": argparse.Namespace(a=1)}, unsafe)
    with pytest.raises(CheckpointError, match="refused: it holds Python objects other than tensors"):
        load_detector(unsafe)
