"""``--ckpt`` fine-tuning maps the classification layers by class name
(``fastdet.engine.finetune.load_for_finetune``), for every family's head."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml

from fastdet.config import DataConfig
from fastdet.data.formats import load_split, yolo_label_path
from fastdet.engine.finetune import class_rows, load_for_finetune
from fastdet.models import ARCHITECTURES, build_model

FAMILIES = sorted(ARCHITECTURES)


def small(arch: str) -> str:
    return ARCHITECTURES[arch].sizes[0]


def checkpoint(arch: str, names: list[str], seed: int = 1, with_names: bool = True) -> dict:
    """A checkpoint of ``arch`` for ``names``, every tensor random (so rows tell apart)."""
    torch.manual_seed(seed)
    model = build_model(arch, small(arch), len(names))
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    ck = {"config": {"model": {"num_classes": len(names)}}, "model": state}
    if with_names:
        ck["class_names"] = list(names)
    return ck


def fresh(arch: str, n: int, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(arch, small(arch), n)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_head_declares_exactly_its_per_class_tensors(arch):
    """The tensors whose shape changes with the class count are the ones the head declares,
    and its rows of class c are distinct and inside the tensor."""
    a, b = fresh(arch, 3).state_dict(), fresh(arch, 4).state_dict()
    changing = {k for k in a if a[k].shape != b[k].shape}
    rows = class_rows(fresh(arch, 3), 3)
    assert set(rows) == changing and changing
    for k, r in rows.items():
        assert r.shape[0] == 3 and len(set(r.flatten().tolist())) == r.numel() and int(r.max()) < a[k].shape[0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_subset_and_overlap_of_classes_take_their_rows_by_name(arch):
    """Trained on (a, b, c, d), fine-tuned on (d, b, x): d and b take the checkpoint's rows
    of d and b, x keeps its fresh initialisation; every other tensor is the checkpoint's."""
    ck = checkpoint(arch, ["a", "b", "c", "d"])
    init = fresh(arch, 3).state_dict()
    model = fresh(arch, 3)
    msg = load_for_finetune(model, ck, ["d", "b", "x"])
    assert msg == "2 of 3 classes matched by name to the checkpoint's 4; start fresh: x"
    got = model.state_dict()
    new, old = class_rows(model, 3), class_rows(model, 4)
    for k, v in got.items():
        if k not in new:
            torch.testing.assert_close(v, ck["model"][k], rtol=0, atol=0)
            continue
        src = ck["model"][k]
        torch.testing.assert_close(v[new[k][0]], src[old[k][3]], rtol=0, atol=0)  # d
        torch.testing.assert_close(v[new[k][1]], src[old[k][1]], rtol=0, atol=0)  # b
        torch.testing.assert_close(v[new[k][2]], init[k][new[k][2]], rtol=0, atol=0)  # x: fresh
        assert not torch.equal(v[new[k][2]], src[old[k][2]])
        others = torch.ones(v.shape[0], dtype=torch.bool)
        others[new[k].flatten()] = False
        was = torch.ones(src.shape[0], dtype=torch.bool)
        was[old[k].flatten()] = False
        torch.testing.assert_close(v[others], src[was], rtol=0, atol=0)  # PP-YOLO's box/obj rows


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_same_names_in_another_order_permute_the_rows_exactly(arch):
    ck = checkpoint(arch, ["a", "b", "c", "d"])
    order = ["c", "a", "d", "b"]
    model = fresh(arch, 4)
    assert load_for_finetune(model, ck, order) == "4 of 4 classes matched by name to the checkpoint's 4"
    rows = class_rows(model, 4)
    for k, v in model.state_dict().items():
        want = ck["model"][k].clone()
        if k in rows:
            for j, name in enumerate(order):
                want[rows[k][j]] = ck["model"][k][rows[k]["abcd".index(name)]]
        torch.testing.assert_close(v, want, rtol=0, atol=0)
    # In the checkpoint's own order every tensor is the checkpoint's.
    same = fresh(arch, 4)
    load_for_finetune(same, ck, ["a", "b", "c", "d"])
    for k, v in same.state_dict().items():
        torch.testing.assert_close(v, ck["model"][k], rtol=0, atol=0)


def test_a_checkpoint_without_names_is_taken_by_position_or_starts_fresh():
    ck = checkpoint("yolox", ["a", "b", "c", "d"], with_names=False)
    model = fresh("yolox", 4)
    assert load_for_finetune(model, ck, ["w", "x", "y", "z"]) == \
        "the checkpoint names no classes: its 4 classes taken by position"
    torch.testing.assert_close(model.head.cls_preds[0].weight, ck["model"]["head.cls_preds.0.weight"], rtol=0, atol=0)
    init = fresh("yolox", 3)
    model = fresh("yolox", 3)
    msg = load_for_finetune(model, ck, ["x", "y", "z"])
    assert msg == "the checkpoint names no classes and has 4, this set 3; start fresh: x, y, z"
    torch.testing.assert_close(model.head.cls_preds[0].weight, init.head.cls_preds[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(model.head.reg_preds[0].weight, ck["model"]["head.reg_preds.0.weight"], rtol=0, atol=0)


def test_many_fresh_classes_are_named_then_counted():
    ck = checkpoint("yolox", ["a"])
    names = [f"n{i}" for i in range(13)]
    msg = load_for_finetune(fresh("yolox", 13), ck, names)
    fresh_ones = ", ".join(names[:10])
    assert msg == f"0 of 13 classes matched by name to the checkpoint's 1; start fresh: {fresh_ones} and 3 more"


def test_the_coco_and_yolo_forms_of_a_set_start_alike(demo_small, tmp_path):
    """The demo set's COCO form (ids 1, 3, 7, 12) and a YOLO form of it (ids 0..3, the same
    names) fine-tune from a checkpoint that lists the names in another order to the same
    start, each class on the checkpoint's row of its name."""
    coco = load_split(replace(DataConfig(), data=str(demo_small)), "train", check_images="none")
    root = tmp_path / "yolo"
    doc = json.loads((demo_small / "annotations" / "instances_train2017.json").read_text())
    label = {c["id"]: i for i, c in enumerate(doc["categories"])}
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    for im in doc["images"]:
        img = root / "images" / im["file_name"]
        img.symlink_to(demo_small / "train2017" / im["file_name"])
        W, H = im["width"], im["height"]
        yolo_label_path(img).write_text("".join(
            f"{label[a['category_id']]} {(a['bbox'][0] + a['bbox'][2] / 2) / W} "
            f"{(a['bbox'][1] + a['bbox'][3] / 2) / H} {a['bbox'][2] / W} {a['bbox'][3] / H}\n"
            for a in doc["annotations"] if a["image_id"] == im["id"]))
    names = [c["name"] for c in doc["categories"]]
    (root / "data.yaml").write_text(yaml.safe_dump({"train": "images", "val": "images", "names": names}))
    yolo = load_split(replace(DataConfig(), data=str(root / "data.yaml")), "train", check_images="none")
    assert coco.cat_ids != yolo.cat_ids and coco.class_names == yolo.class_names == names

    ck = checkpoint("ppyoloe", names[::-1])
    starts = []
    for ds in (coco, yolo):
        model = fresh("ppyoloe", ds.num_classes)
        assert load_for_finetune(model, ck, ds.class_names) == "4 of 4 classes matched by name to the checkpoint's 4"
        starts.append(model.state_dict())
    for k in starts[0]:
        torch.testing.assert_close(starts[0][k], starts[1][k], rtol=0, atol=0)
    w = starts[0]["head.pred_cls.0.bias"]
    torch.testing.assert_close(w, ck["model"]["head.pred_cls.0.bias"].flip(0), rtol=0, atol=0)


def test_a_converted_coco_model_fine_tunes_by_coco_names():
    """A converted COCO model's 80 names (``fastdet.convert``: COCO 2017's) map a set named
    (dog, person, unicorn) onto the rows of dog and person."""
    from fastdet.convert import coco_classes

    names, ids = coco_classes("coco80")
    assert len(names) == 80 and names[0] == "person" and names[16] == "dog" and ids[16] == 18
    ck = checkpoint("yolox", list(names))
    model = fresh("yolox", 3)
    msg = load_for_finetune(model, ck, ["dog", "person", "unicorn"])
    assert msg == "2 of 3 classes matched by name to the checkpoint's 80; start fresh: unicorn"
    for i in range(3):
        src = ck["model"][f"head.cls_preds.{i}.weight"]
        torch.testing.assert_close(model.head.cls_preds[i].weight[:2], src[[16, 0]], rtol=0, atol=0)


def test_ckpt_partial_from_another_familys_checkpoint_names_the_file(tmp_path):
    """``--ckpt other_family.pth --ckpt-partial``: nearly nothing fits; the one line says
    which file, what it holds and what the run trains (it named none of them)."""
    from types import SimpleNamespace

    from fastdet import registry
    from fastdet.config import apply_overrides
    from fastdet.engine.checkpointer import Checkpointer

    ck = checkpoint("ppyoloe", ["a", "b"])
    ck["config"]["model"].update(arch="ppyoloe", size=small("ppyoloe"))
    path = tmp_path / "ppyoloe_best.pth"
    torch.save(ck, path)
    cfg = apply_overrides(registry.get_preset("yolox", small("yolox")), {"run.ckpt_partial": True})
    ckpts = Checkpointer(cfg, tmp_path, None, fresh("yolox", 2), None, None, SimpleNamespace(class_names=["a", "b"]), 1)
    with pytest.raises(ValueError) as e:
        ckpts.finetune(str(path))
    msg = str(e.value)
    assert msg.startswith(f"--ckpt {path} (ppyoloe-{small('ppyoloe')} weights): checkpoint does not fit this model")
    assert msg.endswith(f"this run trains yolox-{small('yolox')}") and "\n" not in msg, msg
