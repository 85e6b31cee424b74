"""PaddleDetection's released layouts, against fixtures recorded with PaddleDetection 2.6's
own modules under paddlepaddle 3.3 (tools/record_paddle_fixtures.py; no paddle needed here).

Per recorded model (PP-YOLOE crn s, m, l and x; PP-YOLO r50vd_dcn and r18vd; FCOS r50): the
full-size key manifest converts onto the fastdet size exactly and onto no other size; a
tiny model filled with the recorded seed (PP-YOLOE at width 0.125 with its size's depth, so
each size's blocks per stage, the neck's SPP among them), saved as a ``.pdparams`` pickle,
converts and computes Paddle's dense boxes and scores on the recorded input (float64 within
1e-4 relative; float32 within 4x Paddle's own float32 error). Each model but PP-YOLOE l and
x (whose full-size files are 217 and 410 MB: the path is m's, which has their multi-block
neck) also goes the user's ways: the CLI, on load and ``--ckpt``.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdet.convert import ConvertError, convert, unwrap
from fastdet.convert.core import _fit
from fastdet.runtime.checkpoint import read_weights
from fastdet.models import ARCHITECTURES, build_model

FIXTURES = Path(__file__).parent / "fixtures" / "paddle"
_spec = importlib.util.spec_from_file_location("record_paddle_fixtures",
                                               Path(__file__).parents[1] / "tools" / "record_paddle_fixtures.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)

CASES = [("ppyoloe_crn_s", "ppyoloe", "s"), ("ppyoloe_crn_m", "ppyoloe", "m"), ("ppyoloe_crn_l", "ppyoloe", "l"),
         ("ppyoloe_crn_x", "ppyoloe", "x"), ("ppyolo_r50vd_dcn", "ppyolo", "r50vd_dcn"), ("ppyolo_r18vd", "ppyolo", "r18vd"),
         ("fcos_r50", "fcos", "r50")]
# The user's ways with a full-size file: l and x left out (a 217 / 410 MB pickle read six
# times, 5 s and 3 GB together); their layouts are held by the manifest test.
CLI_CASES = [c for c in CASES if c[0] not in ("ppyoloe_crn_l", "ppyoloe_crn_x")]


def manifest_arrays(fixture: str) -> dict[str, np.ndarray]:
    """Zeros of the released shapes (PP-YOLOE's fixed DFL projection holds 0..16)."""
    manifest = json.loads((FIXTURES / f"{fixture}_manifest.json").read_text())
    return {k: (np.arange(np.prod(s), dtype=np.float32).reshape(s) if k.endswith("proj_conv.weight")
                else np.zeros(s, np.float32)) for k, s in manifest}


def write_pdparams(path: Path, weights: dict[str, np.ndarray]) -> None:
    """As paddle.save writes it: protocol 4, the name table included."""
    state = dict(weights)
    state["StructuredToParameterName@@"] = {k: f"param_{i}" for i, k in enumerate(weights)}
    path.write_bytes(pickle.dumps(state, protocol=4))


@pytest.mark.parametrize("fixture,arch,size", CASES)
def test_released_key_manifest_converts_exactly(fixture, arch, size, tmp_path):
    """``build_model(arch, size)``'s state dict is exactly what the released file converts to,
    and no other size's. (PP-YOLOE m, l and x hold 2, 3 and 4 blocks per neck stage with the
    SPP among them in the first: a converter that shifted every stage's later blocks passed s
    and refused these.)"""
    state = manifest_arrays(fixture)
    conv = ARCHITECTURES[arch].weight_sources["paddle"].convert
    ours, num_classes = conv(unwrap(state, tmp_path))
    assert num_classes == 80
    assert _fit(ours, arch, size, num_classes, {}) is None
    for other in ARCHITECTURES[arch].sizes:
        assert other == size or _fit(ours, arch, other, num_classes, {}) is not None, other


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("fixture,arch,size", CASES)
def test_tiny_model_computes_paddles_function(fixture, arch, size, tmp_path):
    f = np.load(FIXTURES / f"{fixture}_tiny.npz")
    names = [str(n) for n in f["names"]]
    shapes = [tuple(s) for s in json.loads(str(f["shapes"]))]
    weights = record.fill(names, shapes, int(f["seed"]))
    path = tmp_path / f"{fixture}_tiny.pdparams"
    write_pdparams(path, weights)
    conv = ARCHITECTURES[arch].weight_sources["paddle"].convert
    state, num_classes = conv(unwrap(read_weights(path), path))
    tiny = json.loads(str(f["options"]))  # the recorded model: PP-YOLOE at a narrower (width, depth)
    options = {"width_mult": tiny[0], "depth_mult": tiny[1]} if arch == "ppyoloe" else {}
    model = build_model(arch, size, num_classes, **options).eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and all(k.endswith("num_batches_tracked") for k in result.missing_keys)
    x = torch.from_numpy(f["x"])
    with torch.no_grad():
        b32, s32 = model(x)
        b64, s64 = model.double()(x.double())
    for ours32, ours64, want32, want64 in ((b32, b64, f["boxes32"], f["boxes64"]), (s32, s64, f["scores32"], f["scores64"])):
        assert ours64.shape == want64.shape
        assert rel_err(ours64, want64) <= 1e-4
        assert rel_err(ours32, want64) <= max(4 * rel_err(want32, want64), 1e-6)


def convert_cli_on_load_and_ckpt(src: Path, arch: str, size: str, tmp_path: Path) -> Path:
    """What a user does with the released file ``src`` of ``arch``-``size``: ``python -m
    fastdet.convert`` without ``--size`` (the size from the shapes: said on stdout), the same
    tensors converted on load (load_detector's reader, ``fastdet.eval --ckpt SRC --arch``),
    ``fastdet.train --ckpt SRC`` at that size taken; asked for another size, the conversion
    (each other size) and the training check (one) refuse it in one line that names the size
    it is. Returns the converted checkpoint."""
    from fastdet import registry
    from fastdet.api import read_any_checkpoint
    from fastdet.config import ConfigError, apply_overrides
    from fastdet.convert.__main__ import main as convert_main
    from fastdet.runtime.checkpoint import load_torch_file
    from fastdet.train import _check_weight_files

    out = tmp_path / f"{src.stem}_fastdet.pth"
    assert convert_main([str(src), "--from", "paddle", "--arch", arch, "--output", str(out)]) == 0
    ck = load_torch_file(out)
    assert (ck["config"]["model"]["arch"], ck["config"]["model"]["size"]) == (arch, size)
    assert ck["converted_from"]["source"] == "paddle" and ck["class_names"][0] == "person"
    on_load, cfg = read_any_checkpoint(src, arch)
    assert cfg.model.size == size and list(on_load["model"]) == list(ck["model"])
    assert all(torch.equal(on_load["model"][k], v) for k, v in ck["model"].items())
    _check_weight_files(apply_overrides(registry.get_preset(arch, size), {"run.ckpt": str(src)}))
    others = [s for s in ARCHITECTURES[arch].sizes if s != size]
    refusals = []
    for other in others:
        with pytest.raises(ConvertError) as e:
            convert(src, arch, other)
        refusals.append(str(e.value))
    if others:  # the training check reads a Paddle file whole: once is enough
        with pytest.raises(ConfigError) as c:
            _check_weight_files(apply_overrides(registry.get_preset(arch, others[0]), {"run.ckpt": str(src)}))
        refusals.append(str(c.value))
    for msg in refusals:
        assert "\n" not in msg and f"{src}: " in msg and msg.endswith(f"this looks like {arch}-{size}"), msg
    return out


@pytest.mark.parametrize("fixture,arch,size", CLI_CASES)
def test_released_file_of_every_recorded_size_through_the_cli_and_on_load(fixture, arch, size, capsys, tmp_path):
    """The recorded full-size manifests (PaddleDetection's own models; PP-YOLOE m's neck stages
    hold 2 blocks, the SPP among them) saved as a ``.pdparams`` go the user's ways
    (:func:`convert_cli_on_load_and_ckpt`): the size found from the shapes, another size
    refused in one line naming it; their function is the tiny models' above."""
    src = tmp_path / f"{fixture}.pdparams"
    write_pdparams(src, manifest_arrays(fixture))
    out = convert_cli_on_load_and_ckpt(src, arch, size, tmp_path)
    assert f"{arch}-{size}, 80 classes" in capsys.readouterr().out
    from fastdet.runtime.checkpoint import load_torch_file

    model = load_torch_file(out)["model"]
    counters = [k for k in model if k.endswith("num_batches_tracked")]  # fastdet BatchNorm counters, not in the file
    assert all(model[k].item() == 0 for k in counters)


@pytest.mark.parametrize("prefix", ["", "backbone."])
def test_ppyoloe_backbone_weights_from_a_cspresnetb_file(tmp_path, prefix, caplog):
    """``--backbone-weights CSPResNetb_s_pretrained.pdparams``: Paddle's names (stem conv1..3,
    _mean/_variance), with or without ``backbone.``; the classifier is ignored and named.
    (Built from the released detector's backbone key layout; no real ImageNet file here.)"""
    import logging

    manifest = json.loads((FIXTURES / "ppyoloe_crn_s_manifest.json").read_text())
    rng = np.random.default_rng(0)
    file = {prefix + k[len("backbone."):]: rng.standard_normal(s).astype(np.float32)
            for k, s in manifest if k.startswith("backbone.")}
    file["fc.weight"], file["fc.bias"] = np.zeros((1024, 1000), np.float32), np.zeros(1000, np.float32)
    path = tmp_path / "CSPResNetb_s_pretrained.pdparams"
    write_pdparams(path, file)
    model = build_model("ppyoloe", "s")
    with caplog.at_level(logging.INFO, logger="fastdet.models"):
        model.load_backbone_weights(str(path))
    assert "ignored in" in caplog.text and "fc.weight, fc.bias" in caplog.text and "missing" not in caplog.text
    own = model.backbone.state_dict()
    np.testing.assert_array_equal(own["stem.0.conv.weight"].numpy(), file[prefix + "stem.conv1.conv.weight"])
    np.testing.assert_array_equal(own["stages.3.conv3.bn.running_var"].numpy(), file[prefix + "stages.3.conv3.bn._variance"])
    with pytest.raises(ValueError, match="expects"):
        build_model("ppyoloe", "m").load_backbone_weights(str(path))


@pytest.mark.parametrize("arch,size", [("ppyoloe", "s"), ("fcos", "r50")])
def test_backbone_weights_from_a_full_checkpoint_and_a_list_in_one_line(tmp_path, arch, size, caplog):
    """``--backbone-weights best.pth`` (a fastdet run's checkpoint, or ``{"state_dict": ...}``
    of a fastdet model): its ``backbone.`` tensors load (fastdet's own names, EMA weights
    where it has them); before, no tensor was found in it. A torch.save of a list is one
    line naming the file, not an AttributeError. PP-YOLOE reads through the Paddle loader,
    FCOS's torch files through the torchvision one."""
    import logging

    torch.manual_seed(0)
    src, ema = build_model(arch, size, 4), build_model(arch, size, 4)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(1.0)  # tells the EMA weights from the plain ones
    full = {"config": {"model": {"arch": arch, "size": size}}, "model": src.state_dict(),
            "ema": {"module": ema.state_dict()}}
    for name, obj, want in (("best.pth", full, ema), ("sd.pth", {"state_dict": src.state_dict()}, src)):
        torch.save(obj, tmp_path / name)
        model = build_model(arch, size, 2)
        with caplog.at_level(logging.INFO, logger="fastdet"):
            model.load_backbone_weights(str(tmp_path / name))
        for k, v in want.backbone.state_dict().items():
            assert torch.equal(model.backbone.state_dict()[k], v), (name, k)
        assert "neck and head, not loaded" in caplog.text and "missing" not in caplog.text
        caplog.clear()
    torch.save([torch.zeros(3)], tmp_path / "list.pth")
    with pytest.raises(ValueError) as e:
        build_model(arch, size, 2).load_backbone_weights(str(tmp_path / "list.pth"))
    assert "\n" not in str(e.value) and str(tmp_path / "list.pth") in str(e.value)
    assert "expected a dict of weights, found a list" in str(e.value)


@pytest.mark.parametrize("fixture,size,prefix", [("ppyolo_r18vd", "r18vd", ""), ("ppyolo_r50vd_dcn", "r50vd_dcn", "backbone.")])
def test_ppyolo_backbone_weights_from_a_resnet_vd_file(tmp_path, fixture, size, prefix, caplog):
    """``--backbone-weights ResNet50_vd_ssld_pretrained.pdparams``: Paddle's ResNet-vd names
    (the detector's backbone layout, DCN offsets included), with or without ``backbone.``;
    the classifier ignored and named. (No real ImageNet file here.)"""
    import logging

    manifest = json.loads((FIXTURES / f"{fixture}_manifest.json").read_text())
    rng = np.random.default_rng(0)
    file = {prefix + k[len("backbone."):]: rng.standard_normal(s).astype(np.float32)
            for k, s in manifest if k.startswith("backbone.")}
    file["fc_0.w_0"] = np.zeros((2048, 1000), np.float32)
    path = tmp_path / "ResNet_vd_pretrained.pdparams"
    write_pdparams(path, file)
    model = build_model("ppyolo", size)
    with caplog.at_level(logging.INFO, logger="fastdet.models"):
        model.load_backbone_weights(str(path))
    assert "fc_0.w_0" in caplog.text and "missing" not in caplog.text
    own = model.backbone.state_dict()
    np.testing.assert_array_equal(own["stem.2.bn.running_mean"].numpy(), file[prefix + "conv1.conv1_3.norm._mean"])


def test_fcos_backbone_weights_from_a_paddle_resnet_file(tmp_path, caplog):
    """FCOS also takes the authors' Paddle ResNet-50 (variant b) ImageNet file."""
    import logging

    manifest = json.loads((FIXTURES / "fcos_r50_manifest.json").read_text())
    rng = np.random.default_rng(0)
    file = {k[len("backbone."):]: rng.standard_normal(s).astype(np.float32)
            for k, s in manifest if k.startswith("backbone.")}
    file["fc_0.w_0"] = np.zeros((2048, 1000), np.float32)
    path = tmp_path / "ResNet50_cos_pretrained.pdparams"
    write_pdparams(path, file)
    model = build_model("fcos", "r50")
    with caplog.at_level(logging.INFO, logger="fastdet.models"):
        model.load_backbone_weights(str(path))
    assert "fc_0.w_0" in caplog.text and "missing" not in caplog.text
    own = model.backbone.state_dict()
    np.testing.assert_array_equal(own["layer4.2.bn3.running_var"].numpy(), file["res5.res5c.branch2c.norm._variance"])
    np.testing.assert_array_equal(own["layer2.0.downsample.0.weight"].numpy(), file["res3.res3a.short.conv.weight"])


def test_published_presets_name_their_backbone_file_and_say_when_it_is_missing():
    from fastdet import registry
    from fastdet.models.recipe import pretrained_backbone_note

    r = registry.recipe("ppyoloe")
    assert r.backbone_files["s"] == "CSPResNetb_s_pretrained.pdparams"
    note = pretrained_backbone_note(r, "s", "/data/coco", None, None)
    assert note and "CSPResNetb_s_pretrained.pdparams" in note and "--backbone-weights" in note
    assert pretrained_backbone_note(r, "s", "/data/coco", "CSPResNetb_s_pretrained.pdparams", None) is None
    assert pretrained_backbone_note(r, "s", "/data/coco", None, "yolox_s.pth") is None
    assert pretrained_backbone_note(r, "s", "demo", None, None) is None
    assert "ResNet50_vd_ssld" in registry.recipe("ppyolo").backbone_files["r50vd_dcn"]
