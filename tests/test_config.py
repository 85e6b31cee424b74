"""Config presets against the published PP-YOLOE recipes, overrides (family options
included), dump/load and configs of the previous layout."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fastdet.config import Config, ConfigError, FamilyOptions, apply_overrides, parse_set_args
from fastdet.models.ppyoloe import PPYOLOEOptions
from fastdet import registry
from fastdet.registry import PRESETS, config_from_dict, demo_overrides, get_preset, load_config

DEMO_OVERRIDES = demo_overrides("ppyoloe")

# PaddleDetection ppyoloe_crn_{s,m,l,x}_300e_coco.yml (../shared/REFERENCE.md):
# images per GPU on 8 GPUs, base lr and the global batch it is given for, warmup steps.
PUBLISHED = {
    "s": dict(imgs_per_gpu=32, base_lr=0.04, ref_batch=8 * 32, warmup=2300),
    "m": dict(imgs_per_gpu=28, base_lr=0.03, ref_batch=8 * 20, warmup=3000),
    "l": dict(imgs_per_gpu=20, base_lr=0.03, ref_batch=8 * 20, warmup=3000),
    "x": dict(imgs_per_gpu=16, base_lr=0.03, ref_batch=8 * 20, warmup=3000),
}


@pytest.mark.parametrize("size", ["s", "m", "l", "x"])
def test_ppyoloe_presets_match_published_recipe(size):
    cfg = get_preset("ppyoloe", size)
    pub = PUBLISHED[size]
    assert (cfg.model.arch, cfg.model.size) == ("ppyoloe", size)
    assert cfg.data.batch_size == pub["imgs_per_gpu"]
    assert cfg.optim.warmup_steps == pub["warmup"]
    # REFERENCE.md: "base lr 0.03 for 8x20 (s: 0.04 at 8x32)"; the lr scales with the global batch.
    assert (cfg.optim.base_lr, cfg.optim.ref_batch) == (pub["base_lr"], pub["ref_batch"])
    assert cfg.optim.epochs == 300 and cfg.optim.cosine_epochs == 360
    assert cfg.optim.momentum == 0.9 and cfg.optim.weight_decay == 5e-4
    assert cfg.optim.ema_decay == 0.9998
    assert cfg.optim.schedule == "cosine" and cfg.optim.warmup_start_factor == 0.001
    assert cfg.optim.ema_type == "threshold"
    assert cfg.data.img_size == 640
    assert cfg.family == PPYOLOEOptions()
    assert cfg.family.static_assigner_epoch == 100
    # PP-YOLOE+ post-processing (REFERENCE.md / ARCHS.md §4): score 0.01, top 1000, IoU 0.7, keep 300.
    o = cfg.family
    assert (o.score_thresh, o.pre_nms_topk, o.nms_iou, o.max_det) == (0.01, 1000, 0.6, 100)  # ppyoloe_crn.yml
    # ppyoloe_reader.yml: RandomDistort, RandomExpand (ratio 4), RandomCrop, RandomFlip, all p 0.5.
    assert (o.distort_prob, o.expand_prob, o.expand_max_ratio, o.crop, o.flip_prob) == (0.5, 0.5, 4.0, True, 0.5)
    assert cfg.data.train_sizes == tuple(range(320, 769, 32)) and len(cfg.data.train_sizes) == 15


def test_preset_names_and_errors():
    assert set(PRESETS) == {"ppyoloe_s", "ppyoloe_m", "ppyoloe_l", "ppyoloe_x", "ppyolo_r18vd", "ppyolo_r50vd_dcn",
                            "fcos_r50"} | {f"yolox_{s}" for s in ("nano", "tiny", "s", "m", "l", "x")}
    with pytest.raises(ConfigError, match=r"unknown --arch 'yolov9'.*ppyoloe"):
        get_preset("yolov9", "s")
    with pytest.raises(ConfigError, match=r"unknown --size 'xxl' for ppyoloe.*l, m, s, x"):
        get_preset("ppyoloe", "xxl")


def test_configs_are_frozen():
    cfg = get_preset("ppyoloe", "s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.base_lr = 1.0  # type: ignore[misc]


def test_overrides_coerce_command_line_strings_to_field_types():
    base = get_preset("ppyoloe", "s")
    cfg = apply_overrides(base, parse_set_args([
        "optim.base_lr=0.01",
        "data.batch_size=4",
        "data.multiscale=false",
        "data.train_sizes=256, 288,320",
        "run.ckpt=/tmp/w.pt",
        "run.max_steps=1e3",
        "compile.compile=yes",
    ]))
    assert cfg.optim.base_lr == 0.01 and type(cfg.optim.base_lr) is float
    assert cfg.data.batch_size == 4 and type(cfg.data.batch_size) is int
    assert cfg.data.multiscale is False
    assert cfg.data.train_sizes == (256, 288, 320)
    assert cfg.run.ckpt == "/tmp/w.pt"
    assert cfg.run.max_steps == 1000 and type(cfg.run.max_steps) is int
    assert cfg.compile.compile is True
    # The preset itself is untouched, and untouched fields carry over.
    assert base.optim.base_lr == 0.04 and base.data.batch_size == 32
    assert cfg.optim.momentum == base.optim.momentum
    assert apply_overrides(cfg, {"run.ckpt": "none"}).run.ckpt is None


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("optim.base_lr", "fast", r"optim.base_lr: expected a number, got 'fast'"),
        ("data.batch_size", "3.5", r"data.batch_size: expected an integer, got '3.5'"),
        ("data.batch_size", True, r"data.batch_size: expected an integer"),
        ("data.multiscale", "maybe", r"data.multiscale: expected true/false, got 'maybe'"),
        ("data.train_sizes", "256,big", r"data.train_sizes: expected an integer, got 'big'"),
        ("optim.base_lrr", "0.1", r"unknown config field 'optim.base_lrr' \(did you mean optim.base_lr\?\)"),
        ("optimizer.base_lr", "0.1", r"unknown config section 'optimizer'"),
        ("base_lr", "0.1", r"must be section.field"),
    ],
)
def test_bad_overrides_give_one_line_errors(key, value, message):
    with pytest.raises(ConfigError, match=message) as e:
        apply_overrides(get_preset("ppyoloe", "s"), {key: value})
    assert "\n" not in str(e.value)


def test_parse_set_args_rejects_items_without_equals():
    assert parse_set_args(["a.b=c=d"]) == {"a.b": "c=d"}
    with pytest.raises(ConfigError, match="expected section.field=value"):
        parse_set_args(["optim.base_lr"])


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_dump_load_round_trip(tmp_path, suffix):
    cfg = apply_overrides(get_preset("ppyoloe", "m"), {**DEMO_OVERRIDES, "run.ckpt": "w.pt"})
    path = tmp_path / f"config{suffix}"
    cfg.dump(path)
    back = load_config(path)
    assert back == cfg
    assert isinstance(back.data.train_sizes, tuple)


def test_load_rejects_unknown_and_mistyped_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  base_lr: 0.1\n  warmup: 10\n")
    with pytest.raises(ConfigError, match=r"unknown config field optim.warmup"):
        load_config(path)
    path.write_text("data:\n  batch_size: eight\n")
    with pytest.raises(ConfigError, match=r"data.batch_size: expected an integer, got 'eight'"):
        load_config(path)
    path.write_text("family:\n  static_assigner_epoch: soon\n")
    with pytest.raises(ConfigError, match=r"family.static_assigner_epoch: expected an integer, got 'soon'"):
        load_config(path)
    path.write_text("model:\n  arch: yolov9\n")
    with pytest.raises(ConfigError, match=r"unknown --arch 'yolov9'"):
        load_config(path)


def test_demo_overrides_apply_to_every_preset():
    for name, preset in PRESETS.items():
        cfg = apply_overrides(preset, demo_overrides(preset.model.arch))
        # CPU-sized: 192 px (FCOS's demo 128, its ResNet-50 costs ten times as much per image)
        assert cfg.data.img_size <= 192 and cfg.data.max_boxes == 32, name
        assert max(cfg.data.train_sizes) <= cfg.data.img_size


def test_family_options_are_overridable_and_type_checked():
    cfg = apply_overrides(get_preset("ppyoloe", "s"), parse_set_args(
        ["family.static_assigner_epoch=30", "family.flip_prob=0", "family.nms_iou=0.6"]))
    assert cfg.family.static_assigner_epoch == 30 and cfg.family.flip_prob == 0.0 and cfg.family.nms_iou == 0.6
    with pytest.raises(ConfigError, match=r"family.flip_prob: expected a number, got 'often'"):
        apply_overrides(cfg, {"family.flip_prob": "often"})
    with pytest.raises(ConfigError, match=r"unknown config field 'family.use_l1'"):
        apply_overrides(cfg, {"family.use_l1": "true"})
    # The shared sections no longer hold family settings.
    with pytest.raises(ConfigError, match=r"unknown config field 'model.static_assigner_epoch'"):
        apply_overrides(cfg, {"model.static_assigner_epoch": 3})


def test_config_dict_of_the_previous_layout_still_loads():
    """A checkpoint written before the family section: its family fields sat in model/data."""
    old = get_preset("ppyoloe", "s").to_dict()
    family = old.pop("family")
    old["model"].update(static_assigner_epoch=8, score_thresh=0.02, nms_iou=0.7, max_det=300, pre_nms_topk=1000)
    old["data"].update(distort_prob=0.0, expand_prob=0.0, expand_max_ratio=4.0, crop=False, flip_prob=0.5)
    cfg = config_from_dict(old)
    want = PPYOLOEOptions(**{**family, "static_assigner_epoch": 8, "score_thresh": 0.02, "nms_iou": 0.7, "max_det": 300,
                             "distort_prob": 0.0, "expand_prob": 0.0, "crop": False})
    assert cfg.family == want
    assert cfg.model == get_preset("ppyoloe", "s").model
    old["model"]["mystery"] = 1
    with pytest.raises(ConfigError, match=r"unknown config field model.mystery"):
        config_from_dict(old)


@pytest.mark.parametrize("dynamic, shapes", [(False, "static"), (True, "dynamic")])
def test_a_checkpoints_compile_dynamic_reads_as_compile_shapes(dynamic, shapes):
    """compile.dynamic, a second switch for symbolic H and W, is gone: a stored config that
    has it still loads, its value read as compile.shapes; --set names the field unknown."""
    old = get_preset("ppyoloe", "s").to_dict()
    old["compile"]["dynamic"] = dynamic
    assert config_from_dict(old).compile.shapes == shapes
    with pytest.raises(ConfigError, match="unknown config field 'compile.dynamic'"):
        apply_overrides(get_preset("ppyoloe", "s"), {"compile.dynamic": "true"})


def test_bare_config_gets_the_family_defaults():
    from fastdet.registry import resolve

    assert Config().family == FamilyOptions()
    assert resolve(Config()).family == PPYOLOEOptions()


def test_print_config_shows_family_options(capsys):
    from fastdet.train import main

    assert main(["--arch", "ppyoloe", "--size", "m", "--data", "demo", "--set", "family.max_det=50",
                 "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "family:" in out and "max_det: 50" in out and "static_assigner_epoch: 8" in out
    assert main(["--arch", "ppyoloe", "--set", "family.nope=1", "--print-config"]) == 2
    assert "unknown config field 'family.nope'" in capsys.readouterr().err


def test_every_preset_and_demo_recipe_passes_the_trainers_checks():
    from fastdet.train import check_config

    for name, preset in PRESETS.items():
        check_config(preset)
        check_config(apply_overrides(preset, demo_overrides(preset.model.arch)))


@pytest.mark.parametrize("key, value, message", [
    ("run.log_interval", 0, "--log-interval must be at least 1, got 0"),
    ("run.eval_interval", 0, "--eval-interval must be at least 1, got 0"),
    ("data.max_boxes", 0, "--max-boxes must be at least 1, got 0"),
    ("data.size_period", 0, "data.size_period must be at least 1, got 0"),
    ("data.num_workers", -1, "--workers must be >= 0, got -1"),
    ("run.max_steps", -5, "--max-steps (0: the whole schedule) must be >= 0, got -5"),
    ("optim.warmup_steps", -1, "optim.warmup_steps must be >= 0, got -1"),
    ("optim.ema_decay", 1.5, "optim.ema_decay must be in [0, 1), got 1.5"),
])
def test_the_trainer_refuses_values_that_would_fail_an_epoch_in(key, value, message):
    """Before these checks: log_interval 0 and eval_interval 0 were a ZeroDivisionError
    traceback (eval_interval after the first epoch's training), max_boxes 0 and ema_decay 1.5
    failed after the data and model were built, a negative warm-up or worker count ran."""
    from fastdet.train import check_config

    with pytest.raises(ConfigError) as e:
        check_config(apply_overrides(get_preset("ppyoloe", "s"), {key: value}))
    assert str(e.value) == message


@pytest.mark.parametrize("arch, value, message", [
    ("yolox", 0, None),  # Megvii's eval: every candidate into the NMS
    ("yolox", -1, "family.pre_nms_topk must be >= 0 (0: every candidate), got -1"),
    ("ppyoloe", 0, "family.pre_nms_topk must be at least 1, got 0"),  # topk(0) would keep no box
    ("ppyolo", 0, "family.pre_nms_topk must be at least 1, got 0"),
    ("fcos", 0, "family.pre_nms_topk must be at least 1, got 0"),
])
def test_pre_nms_topk_0_is_every_candidate_only_where_the_family_reads_it_so(arch, value, message):
    from fastdet.train import check_config

    cfg = apply_overrides(get_preset(arch, registry.family(arch).sizes[0]), {"family.pre_nms_topk": value})
    if message is None:
        check_config(cfg)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_config(cfg)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_an_integer_field_given_a_non_finite_number_is_one_config_error(value):
    """int(float("inf")) raised OverflowError, int(nan) a ValueError naming no field: both
    were tracebacks through --set (train, and eval/predict/export's family.max_det)."""
    with pytest.raises(ConfigError, match=re.escape(f"family.max_det: expected an integer, got {value!r}")):
        apply_overrides(get_preset("ppyoloe", "s"), {"family.max_det": value})


def test_ppyolo_has_no_nms_iou_and_a_stored_one_is_dropped():
    """PP-YOLO's Matrix NMS cuts at no IoU: family.nms_iou, which it carried and never read,
    is gone (--set of it is an unknown field, predict takes no iou_thresh); a checkpoint's
    config that holds it, in the family section or the layout before it, still loads."""
    from fastdet.models.ppyolo import PPYOLO

    cfg = get_preset("ppyolo", "r18vd")
    with pytest.raises(ConfigError, match="unknown config field 'family.nms_iou'"):
        apply_overrides(cfg, {"family.nms_iou": "0.3"})
    stored = cfg.to_dict()
    stored["family"]["nms_iou"] = 0.7
    assert config_from_dict(stored) == cfg
    old = cfg.to_dict()
    family = old.pop("family")
    old["model"].update(score_thresh=family["score_thresh"], nms_iou=0.7, max_det=family["max_det"])
    assert config_from_dict(old).family == cfg.family
    assert "iou_thresh" not in PPYOLO.predict.__code__.co_varnames
    keeps = get_preset("ppyoloe", "s").to_dict()  # a family with an IoU cut keeps its own
    keeps["family"]["nms_iou"] = 0.5
    assert config_from_dict(keeps).family.nms_iou == 0.5


def test_a_stored_yoloxwarmcos_schedule_reads_as_quadratic_warmcos():
    """Schedules are named by their shape: a checkpoint of a YOLOX run stored Megvii's name."""
    stored = get_preset("yolox", "s").to_dict()
    assert stored["optim"]["schedule"] == "quadratic_warmcos"
    stored["optim"]["schedule"] = "yoloxwarmcos"
    assert config_from_dict(stored) == get_preset("yolox", "s")
