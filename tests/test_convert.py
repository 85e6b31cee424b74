"""fastdet.convert: the authors' released files read safely, converted, and computing the
authors' function (their own code as the reference, random weights with non-trivial
BatchNorm statistics, saved in the released layout)."""

from __future__ import annotations

import importlib
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fastdet.convert import ConvertError, convert
from fastdet.runtime.checkpoint import UnsafeWeightsError, load_pdparams, load_torch_file, read_weights


# --------------------------------------------------------------------------- loading runs no code


class _Payload:
    def __reduce__(self):
        return (print, ("PAYLOAD-RAN",))


def test_pdparams_with_a_reduce_payload_is_refused_without_running_it(tmp_path, capsys):
    path = tmp_path / "evil.pdparams"
    path.write_bytes(pickle.dumps({"conv.weight": np.ones((2, 2), np.float32), "x": _Payload()}, protocol=4))
    with pytest.raises(UnsafeWeightsError, match=r"evil\.pdparams: refused: the pickle asks for builtins\.print"):
        load_pdparams(path)
    assert "PAYLOAD-RAN" not in capsys.readouterr().out
    # The same file through plain pickle does run it: the payload is real.
    pickle.loads(path.read_bytes())
    assert "PAYLOAD-RAN" in capsys.readouterr().out


def test_torch_file_with_a_reduce_payload_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pth"
    torch.save({"model": {"w": torch.ones(2)}, "x": _Payload()}, path)
    capsys.readouterr()
    with pytest.raises(UnsafeWeightsError, match="evil.pth: refused"):
        load_torch_file(path)
    assert "PAYLOAD-RAN" not in capsys.readouterr().out


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pdparams_of_numpy_arrays_load(tmp_path, protocol):
    """Paddle's layout: {name: float32 array} plus the name table, any pickle protocol."""
    state = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "a._mean": np.zeros(3, np.float32),
             "StructuredToParameterName@@": {"a.weight": "conv2d_0.w_0"}}
    path = tmp_path / "m.pdparams"
    path.write_bytes(pickle.dumps(state, protocol=protocol))
    got = read_weights(path)
    np.testing.assert_array_equal(got["a.weight"], state["a.weight"])
    assert got["StructuredToParameterName@@"] == {"a.weight": "conv2d_0.w_0"}


# --------------------------------------------------------------------------- helpers


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic random weights and non-trivial BatchNorm statistics (eval-mode outputs
    then depend on every stored tensor)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith(("running_mean", "bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif t.dim() == 1:  # norm weights
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:  # fan-in scaled, so activations stay O(1) through deep stacks
                fan_in = t[0].numel()
                t.copy_(torch.randn(t.shape, generator=g) / fan_in**0.5)
    return model.eval()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


def assert_authors_function(ours, theirs, x: torch.Tensor) -> None:
    """``ours(x)`` / ``theirs(x)`` -> (boxes, scores). In float64 they agree to 1e-4 relative;
    in float32 ours is within 4x the authors' own float32 error (both against float64)."""
    with torch.no_grad():
        ref64 = theirs(x.double(), torch.float64)
        ref32 = theirs(x, torch.float32)
        our64 = ours(x.double(), torch.float64)
        our32 = ours(x, torch.float32)
    for i, what in enumerate(("boxes", "scores")):
        assert ref64[i].shape == our64[i].shape, what
        assert rel_err(our64[i], ref64[i]) <= 1e-4, (what, rel_err(our64[i], ref64[i]))
        authors = rel_err(ref32[i], ref64[i])
        assert rel_err(our32[i], ref64[i]) <= max(4 * authors, 1e-6), (what, rel_err(our32[i], ref64[i]), authors)


def load_converted(ck: dict, arch: str, size: str):
    from fastdet import registry

    cfg = registry.config_from_dict(ck["config"])
    assert (cfg.model.arch, cfg.model.size) == (arch, size)
    model = registry.build_detector(cfg)
    model.load_state_dict(ck["model"])
    return model.eval()


def runner(model):
    def run(x, dtype):
        return model.to(dtype)(x)
    return run


# --------------------------------------------------------------------------- Megvii YOLOX


def authors_module(name: str):
    """The authors' code a test compares with. The project's test set-up installs it
    (Makefile, venv target), so a missing one fails: skipping would pass a suite that
    compared nothing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"{name} is missing ({e}): the authors' code these tests compare with is installed by "
                    "`make venv` (Makefile: pip install --no-build-isolation --no-deps yolox==0.3.0, with "
                    "loguru, thop, opencv-python-headless)", pytrace=False)


def megvii_yolox(size: str):
    """Megvii's own model as its exp files build it (``yolox_base.get_model``: BN eps 1e-3,
    momentum 0.03; nano depthwise)."""
    yolox_models = authors_module("yolox.models")
    from fastdet.models.yolox import SIZES

    depth, width, dw = SIZES[size]
    model = yolox_models.YOLOX(yolox_models.YOLOPAFPN(depth, width, depthwise=dw),
                               yolox_models.YOLOXHead(80, width, depthwise=dw))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps, m.momentum = 1e-3, 0.03
    return randomise(model, seed=1)


def megvii_dense(model):
    """Megvii's model on the BGR pixels of the RGB image ``x`` (its images come from
    ``cv2.imread`` and are not swapped; fastdet's are RGB)."""
    def run(x, dtype):
        out = model.to(dtype)(x.flip(1))  # [B, A, 5 + C]: cx, cy, w, h px, sigmoid obj, sigmoid cls
        boxes = torch.cat([out[..., :2] - out[..., 2:4] / 2, out[..., :2] + out[..., 2:4] / 2], -1)
        return boxes, out[..., 5:] * out[..., 4:5]
    return run


def megvii_trainer_checkpoint(model: nn.Module) -> dict:
    """What Megvii's 0.3.0 trainer writes (yolox/core/trainer.py ``save_ckpt``): the model's
    weights beside the SGD state of ``yolox_base.get_optimizer``'s three parameter groups
    after a step (momentum buffers; lr 0, so the weights stay), with an older release's
    ``amp`` entry."""
    pg0, pg1, pg2 = [], [], []  # BN weights, other weights (decayed), biases
    for k, v in model.named_modules():
        if hasattr(v, "bias") and isinstance(v.bias, nn.Parameter):
            pg2.append(v.bias)
        if isinstance(v, nn.BatchNorm2d) or "bn" in k:
            pg0.append(v.weight)
        elif hasattr(v, "weight") and isinstance(v.weight, nn.Parameter):
            pg1.append(v.weight)
    opt = torch.optim.SGD(pg0, lr=0.0, momentum=0.9, nesterov=True)
    opt.add_param_group({"params": pg1, "weight_decay": 5e-4})
    opt.add_param_group({"params": pg2})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    model.zero_grad(set_to_none=True)
    return {"start_epoch": 300, "model": model.state_dict(), "optimizer": opt.state_dict(), "best_ap": 40.5,
            "amp": {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}}


YOLOX_SIZES = ("nano", "tiny", "s", "m", "l", "x")


@pytest.mark.parametrize("size", YOLOX_SIZES)
def test_megvii_yolox_of_every_size_computes_megvii_function(tmp_path, size):
    """Each released size (``yolox_nano.pth`` ... ``yolox_x.pth``): Megvii's model of that size,
    saved in the release layout, through ``python -m fastdet.convert`` without ``--size`` (the
    size from the shapes) and ``load_detector``, computes Megvii's dense boxes and scores (x
    takes ~5 s at 64 x 96). The trainer layout converts on load (``--ckpt FILE --arch yolox``,
    load_detector's reader) to the same tensors; ``fastdet.train --ckpt`` takes it at its
    size, and a file of this size asked to be another is one line naming the size it is."""
    import fastdet
    from fastdet import registry
    from fastdet.api import read_any_checkpoint
    from fastdet.config import ConfigError, apply_overrides
    from fastdet.convert.__main__ import main as convert_main
    from fastdet.models.yolox import TEST_SIZES
    from fastdet.train import _check_weight_files

    ref = megvii_yolox(size)
    release, trainer, out = tmp_path / f"yolox_{size}.pth", tmp_path / "latest_ckpt.pth", tmp_path / "out.pth"
    torch.save({"model": ref.state_dict()}, release)
    torch.save(megvii_trainer_checkpoint(ref), trainer)
    assert convert_main([str(release), "--from", "megvii", "--arch", "yolox", "--output", str(out)]) == 0
    det = fastdet.load_detector(out, fuse=False)
    assert (det.info.size, det.info.img_size, det.info.class_names[0]) == (size, TEST_SIZES[size], "person")
    assert_authors_function(runner(det), megvii_dense(ref), torch.rand(2, 3, 64, 96) * 255)

    converted = load_torch_file(out)["model"]
    ck, cfg = read_any_checkpoint(trainer, "yolox")
    assert cfg.model.size == size and list(ck["model"]) == list(converted)
    assert all(torch.equal(ck["model"][k], v) for k, v in converted.items())

    other = YOLOX_SIZES[YOLOX_SIZES.index(size) - 1]  # the next smaller (x for nano)
    _check_weight_files(apply_overrides(registry.get_preset("yolox", size), {"run.ckpt": str(trainer)}))
    with pytest.raises(ConfigError) as e:
        _check_weight_files(apply_overrides(registry.get_preset("yolox", other), {"run.ckpt": str(trainer)}))
    msg = str(e.value)
    assert msg.startswith(f"--ckpt {trainer}: ") and "\n" not in msg and msg.endswith(f"this looks like yolox-{size}")
    for path in (release, trainer, out):  # up to 400 MB each (x)
        path.unlink()


def test_wrong_size_is_refused_naming_the_key_and_the_likely_size(tmp_path):
    ref = megvii_yolox("s")
    path = tmp_path / "yolox_s.pth"
    torch.save({"model": ref.state_dict()}, path)
    with pytest.raises(ConvertError) as e:
        convert(path, "yolox", "m")
    msg = str(e.value)
    assert "\n" not in msg and "yolox_s.pth" in msg
    assert "shape [32, 12, 3, 3], yolox-m expects [48, 12, 3, 3]; this looks like yolox-s" in msg
    with pytest.raises(ConvertError, match="not torchvision's fcos|converts weights from"):
        convert(path, "fcos", source="megvii")


def test_files_that_are_not_released_ones_say_what_they_are(tmp_path):
    """A fastdet checkpoint is said to be one (no --from value converts it); a plain state
    dict for a family that reads no torch files, a folder and a cut archive each say what
    they are, in one line naming the file, with no --from advice that cannot help."""
    from fastdet.models import build_model

    ours = tmp_path / "best.pth"
    torch.save({"config": {"model": {"arch": "ppyoloe", "size": "s"}}, "model": build_model("ppyoloe", "s", 2).state_dict()},
               ours)
    torch.save({"w": torch.zeros(3)}, tmp_path / "sd.pth")
    data = (tmp_path / "sd.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "adir.pth").mkdir()
    cases = [(ours, "ppyoloe", None, "already a fastdet checkpoint (ppyoloe-s): use it as is"),
             (ours, "yolox", "megvii", "already a fastdet checkpoint (ppyoloe-s): use it as is"),
             (tmp_path / "sd.pth", "ppyoloe", None, "not a fastdet checkpoint (no 'config' and 'model' entries), "
                                                    "nor a released ppyoloe file fastdet reads (ppyoloe converts paddle "
                                                    ".pdparams files)"),
             (tmp_path / "cut.pth", "yolox", None, "a zip archive that does not open (truncated or damaged)"),
             (tmp_path / "adir.pth", "yolox", None, "a folder, not a weight file")]
    for path, arch, source, says in cases:
        with pytest.raises(ConvertError) as e:
            convert(path, arch, source=source)
        msg = str(e.value)
        assert msg.startswith(f"{path}: ") and says in msg and "\n" not in msg and "--from" not in msg, msg


# --------------------------------------------------------------------------- torchvision FCOS


def torchvision_fcos():
    """torchvision's ``fcos_resnet50_fpn`` as its builder makes it for released weights
    (FrozenBatchNorm2d, so the file has no num_batches_tracked), 91 classes."""
    from torchvision.models import resnet50
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7
    from torchvision.ops.misc import FrozenBatchNorm2d

    torch.manual_seed(0)
    body = resnet50(norm_layer=FrozenBatchNorm2d)
    backbone = _resnet_fpn_extractor(body, 3, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))
    return randomise(FCOS(backbone, num_classes=91), seed=2)


def torchvision_dense(model):
    """Dense boxes and scores through torchvision's own anchor generator and box coder."""
    from torchvision.models.detection.image_list import ImageList

    def run(x, dtype):
        model.to(dtype)
        feats = list(model.backbone(x).values())
        out = model.head(feats)
        images = ImageList(x, [tuple(x.shape[-2:])] * x.shape[0])
        anchors = model.anchor_generator(images, feats)
        boxes = torch.stack([model.box_coder.decode(out["bbox_regression"][b], anchors[b]) for b in range(x.shape[0])])
        scores = torch.sqrt(out["cls_logits"].sigmoid() * out["bbox_ctrness"].sigmoid())
        return boxes, scores
    return run


def before_torchvision_0_13(state: dict) -> dict:
    """The FPN's names as torchvision before 0.13 saved them (``inner_blocks.i.weight``, no
    ``.0``): fcos_resnet50_fpn_coco-99b0c9b7.pth came out with 0.12; torchvision renames them
    on load (FeaturePyramidNetwork._load_from_state_dict, version < 2)."""
    return {re.sub(r"^(backbone\.fpn\.(?:inner|layer)_blocks\.\d+)\.0\.", r"\1.", k): v for k, v in state.items()}


@pytest.mark.parametrize("names", ["current", "before_0_13"])
def test_torchvision_fcos_computes_torchvision_function(tmp_path, names):
    """``fcos_resnet50_fpn_coco-99b0c9b7.pth`` in either FPN naming, through ``python -m
    fastdet.convert`` (the size from the shapes) and ``load_detector``, computes torchvision's
    dense boxes and scores (~2 s each: before, this was marked slow and left out of
    ``make test``). At 160 x 128 P6 is 3 x 2: torchvision's integer stride there is
    160 // 3 = 53 (not 64). Converted on load it gives the same tensors."""
    import fastdet
    from fastdet.api import read_any_checkpoint
    from fastdet.convert.__main__ import main as convert_main

    ref = torchvision_fcos()
    state = ref.state_dict()
    if names == "before_0_13":
        state = before_torchvision_0_13(state)
        assert "backbone.fpn.inner_blocks.2.weight" in state and len(state) == len(ref.state_dict())
    src, out = tmp_path / "fcos_resnet50_fpn_coco-99b0c9b7.pth", tmp_path / "out.pth"
    torch.save(state, src)
    assert convert_main([str(src), "--from", "torchvision", "--arch", "fcos", "--output", str(out)]) == 0
    ours = fastdet.load_detector(out, fuse=False)
    ck = load_torch_file(out)
    assert ours.info.size == "r50" and ck["config"]["family"]["decode"] == "torchvision"
    assert ck["config"]["model"]["num_classes"] == 91 and ck["class_names"][1] == "person" and ck["cat_ids"][1] == 1
    x = torch.randn(1, 3, 128, 160)
    assert_authors_function(runner(ours), torchvision_dense(ref), x)
    # The Paddle decode (half-stride points, nominal strides, no sqrt) is another function.
    ours.float().head.decode = "paddle"
    with torch.no_grad():
        boxes, scores = ours(x)
        want = torchvision_dense(ref)(x, torch.float32)
    assert rel_err(boxes, want[0]) > 1e-2 and rel_err(scores, want[1]) > 1e-2
    on_load, cfg = read_any_checkpoint(src, "fcos", source="torchvision")
    assert cfg.model.size == "r50" and list(on_load["model"]) == list(ck["model"])
    assert all(torch.equal(on_load["model"][k], v) for k, v in ck["model"].items())


# --------------------------------------------------------------------------- the converted file in use


def test_cli_output_and_the_official_file_load_as_detectors(tmp_path, caplog):
    """``python -m fastdet.convert`` writes a checkpoint load_detector takes (class names, the
    recipe's eval settings); load_detector(SRC, arch=...) converts the official file itself
    and says so; both give the same detections."""
    import logging

    import fastdet

    ref = megvii_yolox("nano")
    src, out = tmp_path / "yolox_nano.pth", tmp_path / "yolox_nano_fastdet.pth"
    torch.save({"model": ref.state_dict()}, src)
    r = subprocess.run([sys.executable, "-m", "fastdet.convert", "--from", "megvii", str(src), "--arch", "yolox",
                        "--output", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "yolox-nano, 80 classes" in r.stdout
    det = fastdet.load_detector(out)
    assert det.info.class_names[0] == "person" and det.info.img_size == 416
    with caplog.at_level(logging.INFO, logger="fastdet.convert"):
        direct = fastdet.load_detector(src, arch="yolox")
    assert "converted from megvii's released yolox weights (yolox-nano, 80 classes)" in caplog.text
    img = (np.random.default_rng(0).random((90, 120, 3)) * 255).astype(np.uint8)
    a, b = fastdet.detect(det, [img], score_thresh=0.0), fastdet.detect(direct, [img], score_thresh=0.0)
    torch.testing.assert_close(a[0]["boxes"], b[0]["boxes"])
    # A wrong size through the CLI: one line, exit status 2.
    r = subprocess.run([sys.executable, "-m", "fastdet.convert", str(src), "--arch", "yolox", "--size", "s",
                        "--output", str(tmp_path / "x.pth")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "this looks like yolox-nano" in r.stderr
    # An existing --output is replaced only with --overwrite.
    from fastdet.convert.__main__ import main as convert_main

    user_file = tmp_path / "mine.pth"
    user_file.write_bytes(b"a user's file")
    assert convert_main([str(src), "--arch", "yolox", "--output", str(user_file)]) == 2
    assert user_file.read_bytes() == b"a user's file"
    assert convert_main([str(src), "--arch", "yolox", "--output", str(user_file), "--overwrite"]) == 0
    assert fastdet.load_detector(user_file).info.size == "nano"


def test_a_released_file_is_read_once_and_each_size_built_once(tmp_path, monkeypatch):
    """Converting on load (load_detector, ``fastdet.eval --ckpt FILE --arch``, ``--ckpt`` for
    training) reads the released file once: before, it was read whole to see whether it is a
    fastdet checkpoint, then again to convert it (400 MB twice for yolox_x.pth). Finding its
    size, and the size a refused file looks like, builds each size's shapes (on the meta
    device) once per process: before, every conversion built every size, and once more
    for its own."""
    from fastdet.convert import core, load_any

    src = tmp_path / "yolox_tiny.pth"
    torch.save({"model": megvii_yolox("tiny").state_dict()}, src)
    reads, builds = [], []
    read, build = core.read_weights, core.build_model
    monkeypatch.setattr(core, "read_weights", lambda *a, **k: reads.append(a[0]) or read(*a, **k))
    monkeypatch.setattr(core, "build_model", lambda *a, **k: builds.append(a[:2]) or build(*a, **k))
    core._own_shapes.cache_clear()
    ck, converted = load_any(src, "yolox")
    assert converted and ck["config"]["model"]["size"] == "tiny" and reads == [src]
    assert builds == [("yolox", "nano"), ("yolox", "tiny")]  # the sizes tried, smallest first
    convert(src, "yolox")
    with pytest.raises(ConvertError, match="this looks like yolox-tiny"):
        convert(src, "yolox", "x")
    assert sorted(builds) == sorted(("yolox", s) for s in ("nano", "tiny", "s", "m", "l", "x"))


def test_finetuning_from_the_released_file_reinitialises_only_the_class_head(tmp_path):
    """What ``fastdet.train --ckpt yolox_nano.pth`` does (Checkpointer.finetune): the released file
    converted, everything but the 80-class predictors loaded into a 3-class model."""
    from fastdet.convert import load_any
    from fastdet.runtime.checkpoint import load_weights_tolerant

    ref = megvii_yolox("nano")
    src = tmp_path / "yolox_nano.pth"
    torch.save({"model": ref.state_dict()}, src)
    ck, converted = load_any(src, "yolox", "nano")
    assert converted
    from fastdet.models import build_model

    model = build_model("yolox", "nano", 3)
    skipped = load_weights_tolerant(model, ck["model"])
    assert sorted(s.split(" ")[0] for s in skipped) == sorted(
        f"head.cls_preds.{i}.{p}" for i in range(3) for p in ("weight", "bias"))
    torch.testing.assert_close(model.backbone.dark2[0].dconv.conv.weight, ref.backbone.backbone.dark2[0].dconv.conv.weight)
    # The stem reads RGB where Megvii's reads BGR: each space-to-depth patch's channels reversed.
    stem = ref.backbone.backbone.stem.conv.conv.weight
    torch.testing.assert_close(model.backbone.stem.conv.conv.weight, stem.unflatten(1, (4, 3)).flip(2).flatten(1, 2))
    with pytest.raises(ConvertError, match="this looks like yolox-nano"):
        load_any(src, "yolox", "s")


def test_ckpt_partial_takes_the_tensors_that_fit_from_a_released_file_of_another_size(tmp_path):
    """``fastdet.train --arch yolox --size s --ckpt yolox_nano.pth --ckpt-partial``
    (Checkpointer.finetune): the released file is converted at the size its shapes say
    (nano) and the tensors that fit yolox-s are loaded, as from its converted checkpoint;
    before, the conversion's size check refused it. Without --ckpt-partial it still is."""
    from types import SimpleNamespace

    from fastdet import registry
    from fastdet.config import apply_overrides
    from fastdet.convert import load_any
    from fastdet.engine.checkpointer import Checkpointer
    from fastdet.models import build_model

    src = tmp_path / "yolox_nano.pth"
    torch.save({"model": megvii_yolox("nano").state_dict()}, src)
    converted = load_any(src, "yolox")[0]["model"]

    def finetune(partial: bool):
        cfg = apply_overrides(registry.get_preset("yolox", "s"), {"run.ckpt_partial": partial})
        model = build_model("yolox", "s", 3)
        Checkpointer(cfg, tmp_path, None, model, None, None, SimpleNamespace(class_names=["a", "b", "c"]),
                     1).finetune(str(src))
        return model

    own = finetune(True).state_dict()
    fit = [k for k, v in converted.items() if v.is_floating_point() and k in own and own[k].shape == v.shape]
    assert fit  # the width differs: the 1x1 predictors' biases (box, objectness) fit
    for k in fit:
        assert torch.equal(own[k], converted[k]), k
    with pytest.raises(ConvertError, match="this looks like yolox-nano"):
        finetune(False)


def test_train_refuses_a_torch_file_of_another_model_before_reading_its_data(tmp_path):
    """``fastdet.train --ckpt`` with a torch file that is not a fastdet checkpoint: the check
    before any work (train._check_weight_files) converts it as the model build will, so a
    state dict of some other network, or Megvii's file of another size, is one line naming
    the file there; before, it passed that check (any torch file is a YOLOX source) and was
    refused once the data was read and the model built. --ckpt-partial takes the other size."""
    import torchvision

    from fastdet import registry
    from fastdet.config import ConfigError, apply_overrides
    from fastdet.train import _check_weight_files

    nano, other = tmp_path / "yolox_nano.pth", tmp_path / "resnet18.pth"
    torch.save({"model": megvii_yolox("nano").state_dict()}, nano)
    torch.save(torchvision.models.resnet18().state_dict(), other)

    def check(path, size="s", **overrides):
        _check_weight_files(apply_overrides(registry.get_preset("yolox", size), {"run.ckpt": str(path), **overrides}))

    check(nano, "nano")
    check(nano, "s", **{"run.ckpt_partial": True})
    for path, says in ((nano, "this looks like yolox-nano"), (other, "not megvii's yolox (conv1.weight")):
        with pytest.raises(ConfigError) as e:
            check(path)
        assert str(e.value).startswith(f"--ckpt {path}: ") and says in str(e.value) and "\n" not in str(e.value)


def test_eval_cli_scores_the_released_file_as_its_conversion(tmp_path, capsys):
    """``python -m fastdet.eval --ckpt RELEASED --arch yolox`` converts on load (through
    load_detector's reader) and prints the same AP as the converted checkpoint, far from 0:
    the released model's predictors give distinct, confident boxes (tests/own_truth.py) and
    the ground truth is the conversion's own best detections."""
    import json

    from own_truth import distinct_predictors_, rewrite_coco
    from PIL import Image

    from fastdet.convert import coco_classes
    from fastdet.eval.__main__ import main as eval_main

    ref = megvii_yolox("nano")
    src, out = tmp_path / "yolox_nano.pth", tmp_path / "yolox_nano_fastdet.pth"
    with torch.no_grad():
        torch.save({"model": distinct_predictors_(ref.state_dict(), "yolox", seed=0)}, src)
    assert subprocess.run([sys.executable, "-m", "fastdet.convert", str(src), "--arch", "yolox", "--output",
                           str(out)], capture_output=True).returncode == 0
    names, ids = coco_classes("coco80")
    images = []
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray((rng.random((96, 128, 3)) * 255).astype(np.uint8)).save(tmp_path / f"{i}.jpg")
        images.append({"id": i + 1, "file_name": f"{i}.jpg", "width": 128, "height": 96})
    ann = tmp_path / "val.json"
    ann.write_text(json.dumps({"images": images, "annotations": [],
                               "categories": [{"id": c, "name": n} for c, n in zip(ids, names)]}))
    rewrite_coco(ann, tmp_path, out, 128, ann, cat_ids=list(ids))
    common = ["--val-ann", str(ann), "--val-images", str(tmp_path), "--img-size", "128", "--batch-size", "2",
              "--device", "cpu", "--loader", "torch"]
    lines = []
    for argv in (["--ckpt", str(src), "--arch", "yolox"], ["--ckpt", str(out)]):
        assert eval_main(argv + common) == 0
        lines.append([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("COCO AP")])
    assert len(lines[0]) == 1 and lines[0] == lines[1]
    assert float(lines[1][0].split()[2]) > 0.5, lines[1]
    # Without --arch the released file is refused in one line naming it.
    assert eval_main(["--ckpt", str(src)] + common) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(src) in err[0] and "not a fastdet checkpoint" in err[0]


def test_coco_classes_are_torchvisions_91_and_the_80_of_coco_2017():
    """The class table the converters give released COCO models: torchvision's 91-entry
    list (label = category id, "N/A" for the ids COCO 2017 does not use), and its 80."""
    from torchvision.models.detection import FCOS_ResNet50_FPN_Weights

    from fastdet.convert import coco_classes

    names, ids = coco_classes("coco91")
    assert list(names) == FCOS_ResNet50_FPN_Weights.COCO_V1.meta["categories"] and ids == tuple(range(91))
    names80, ids80 = coco_classes("coco80")
    assert len(names80) == 80 and [names[i] for i in ids80] == list(names80)
