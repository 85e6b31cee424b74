"""Classes by name outside training: a converted COCO model (COCO's ids 1..90) scores a
YOLO-format copy of COCO (ultralytics' ids 0..79, the same names), a VOC copy and a
Roboflow COCO export (ids 1..80 after the project's 0) as it scores COCO's own json, a
real mismatch is refused naming both sides, and predict labels with the checkpoint's own
names and category ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

# ultralytics' coco.yaml `names` (0..79), which are COCO 2017's category names, and COCO
# 2017's category ids in the same order (1..90 with gaps): written out here, not taken
# from fastdet or torchvision, so the test checks what the converter stores.
ULTRALYTICS_COCO_NAMES = [
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors",
    "teddy bear", "hair drier", "toothbrush"]
COCO_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
SIZE = 128


@pytest.fixture(scope="module")
def coco_model(tmp_path_factory):
    """A checkpoint shaped as ``fastdet.convert`` writes a released COCO YOLOX (80 classes,
    COCO's names and ids), random weights; and three images with their ground truth: the
    model's own top detections (classes spread over the 80), so a right class map scores
    AP near 1 and a wrong one near 0."""
    import fastdet
    from fastdet import registry
    from fastdet.config import apply_overrides
    from fastdet.convert import coco_classes
    from fastdet.runtime.checkpoint import save_checkpoint

    names, ids = coco_classes("coco80")
    assert list(names) == ULTRALYTICS_COCO_NAMES and list(ids) == COCO_IDS
    root = tmp_path_factory.mktemp("coco_model")
    cfg = apply_overrides(registry.get_preset("yolox", "nano"),
                          {"model.num_classes": 80, "data.img_size": SIZE})
    torch.manual_seed(0)
    model = registry.build_detector(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.startswith("head.cls_preds"):  # a class per box that differs from box to box
                t.copy_(torch.randn(t.shape, generator=g) * 3.0 if t.dim() > 1 else torch.zeros(t.shape))
            elif name.startswith("head.obj_preds") and name.endswith("bias"):  # every box an object
                t.fill_(4.0)
    ckpt = root / "yolox_nano_coco.pth"
    save_checkpoint(ckpt, {"config": cfg.to_dict(), "model": model.state_dict(), "class_names": list(names),
                           "cat_ids": list(ids), "converted_from": {"file": "yolox_nano.pth", "source": "megvii"}})
    det = fastdet.load_detector(ckpt, fuse=False)
    rng = np.random.default_rng(0)
    images = [(rng.random((96, SIZE, 3)) * 255).astype(np.uint8) for _ in range(3)]
    truth = []  # per image: (label 0..79, x0, y0, x1, y1)
    for d in fastdet.detect(det, images, score_thresh=0.0, img_size=SIZE):
        best: dict[int, list[float]] = {}  # each class's top box, for the first 4 classes
        for c, b in zip(d["labels"].tolist(), d["boxes"].tolist()):
            if len(best) < 4:
                best.setdefault(c, b)
        truth.append([(c, *b) for c, b in best.items()])
    assert len({c for t in truth for c, *_ in t} - set(range(11))) >= 2  # ids past 11: COCO's differ from 0..79
    return ckpt, images, truth


def write_coco_and_yolo(root: Path, images, truth, yolo_names=ULTRALYTICS_COCO_NAMES) -> tuple[Path, Path]:
    """The images with their boxes as a COCO json (sparse ids) and as an ultralytics set
    (``names`` as ultralytics' coco.yaml writes them: a mapping 0..79)."""
    (root / "images" / "val").mkdir(parents=True)
    (root / "labels" / "val").mkdir(parents=True)
    doc = {"images": [], "annotations": [],
           "categories": [{"id": i, "name": n, "supercategory": ""} for i, n in zip(COCO_IDS, ULTRALYTICS_COCO_NAMES)]}
    for k, (img, boxes) in enumerate(zip(images, truth)):
        h, w = img.shape[:2]
        name = f"{k:012d}.png"
        Image.fromarray(img).save(root / "images" / "val" / name)
        doc["images"].append({"id": k + 1, "file_name": name, "width": w, "height": h})
        lines = []
        for c, x0, y0, x1, y1 in boxes:
            doc["annotations"].append({"id": len(doc["annotations"]) + 1, "image_id": k + 1,
                                       "category_id": COCO_IDS[c], "bbox": [x0, y0, x1 - x0, y1 - y0],
                                       "area": (x1 - x0) * (y1 - y0), "iscrowd": 0})
            lines.append(f"{c} {(x0 + x1) / 2 / w!r} {(y0 + y1) / 2 / h!r} {(x1 - x0) / w!r} {(y1 - y0) / h!r}")
        (root / "labels" / "val" / f"{k:012d}.txt").write_text("\n".join(lines) + "\n")
    ann = root / "instances_val2017.json"
    ann.write_text(json.dumps(doc))
    (root / "coco.yaml").write_text(yaml.safe_dump({"path": str(root), "train": "images/val", "val": "images/val",
                                                    "names": dict(enumerate(yolo_names))}))
    return ann, root / "coco.yaml"


def ap_line(capsys) -> str:
    return next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("COCO AP"))


def test_a_converted_coco_model_scores_a_yolo_format_coco_as_coco_json(coco_model, tmp_path, capsys):
    from fastdet.eval.__main__ import main as eval_main

    ckpt, images, truth = coco_model
    ann, data_yaml = write_coco_and_yolo(tmp_path, images, truth)
    common = ["--ckpt", str(ckpt), "--img-size", str(SIZE), "--device", "cpu", "--loader", "torch",
              "--batch-size", "3"]
    assert eval_main(common + ["--val-ann", str(ann), "--val-images", str(tmp_path / "images" / "val")]) == 0
    coco_line = ap_line(capsys)
    assert eval_main(common + ["--data", str(data_yaml)]) == 0
    yolo_line = ap_line(capsys)
    coco_ap, yolo_ap = float(coco_line.split()[2]), float(yolo_line.split()[2])
    assert coco_ap > 0.5, coco_line  # the ground truth is the model's own detections
    assert yolo_ap == pytest.approx(coco_ap, abs=1e-3), (coco_line, yolo_line)


def write_voc(root: Path, images, truth) -> Path:
    """The same images and boxes as a VOC root: 1-based ``xmin``/``ymin`` as VOC writes them,
    the 80 names in ``label_list.txt`` (PaddleDetection's), PNGs named by ``<filename>``."""
    for d in ("Annotations", "ImageSets/Main", "JPEGImages"):
        (root / d).mkdir(parents=True)
    (root / "label_list.txt").write_text("\n".join(ULTRALYTICS_COCO_NAMES) + "\n")
    ids = []
    for k, (img, boxes) in enumerate(zip(images, truth)):
        h, w = img.shape[:2]
        stem = f"{k:06d}"
        ids.append(stem)
        Image.fromarray(img).save(root / "JPEGImages" / f"{stem}.png")
        objs = "".join(f"<object><name>{ULTRALYTICS_COCO_NAMES[c]}</name><difficult>0</difficult><bndbox>"
                       f"<xmin>{x0 + 1!r}</xmin><ymin>{y0 + 1!r}</ymin><xmax>{x1!r}</xmax><ymax>{y1!r}</ymax>"
                       "</bndbox></object>" for c, x0, y0, x1, y1 in boxes)
        (root / "Annotations" / f"{stem}.xml").write_text(
            f"<annotation><filename>{stem}.png</filename><size><width>{w}</width><height>{h}</height>"
            f"<depth>3</depth></size>{objs}</annotation>")
    for split in ("train", "val"):
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root


def write_roboflow_coco(root: Path, images, truth) -> Path:
    """The same images and boxes as Roboflow's COCO export: ``train/``, ``valid/`` and
    ``test/`` (the same images in each here), ids from 0, class k's id k + 1, and the
    project as category 0, the supercategory of every class, with no box."""
    cats = [{"id": 0, "name": "coco-xyz", "supercategory": "none"}]
    cats += [{"id": c + 1, "name": n, "supercategory": "coco-xyz"} for c, n in enumerate(ULTRALYTICS_COCO_NAMES)]
    for folder in ("train", "valid", "test"):
        (root / folder).mkdir(parents=True)
        doc = {"images": [], "annotations": [], "categories": cats}
        for k, (img, boxes) in enumerate(zip(images, truth)):
            name = f"img{k}_png.rf.{k:04x}.png"
            Image.fromarray(img).save(root / folder / name)
            doc["images"].append({"id": k, "file_name": name, "width": img.shape[1], "height": img.shape[0]})
            for c, x0, y0, x1, y1 in boxes:
                doc["annotations"].append({"id": len(doc["annotations"]), "image_id": k, "category_id": c + 1,
                                           "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0),
                                           "segmentation": [], "iscrowd": 0})
        (root / folder / "_annotations.coco.json").write_text(json.dumps(doc))
    return root


def test_one_checkpoint_scores_the_same_ap_on_the_coco_yolo_and_voc_forms_of_a_set(coco_model, tmp_path,
                                                                                    capsys):
    """Issue 41: classes are matched by name, so the forms of the same val images (COCO's
    sparse ids, YOLO's 0..79, VOC's names, Roboflow's 1..80 beside its project category 0,
    which is no class) score one checkpoint alike; Roboflow's valid/ and test/ splits too."""
    from fastdet.eval.__main__ import main as eval_main

    ckpt, images, truth = coco_model
    ann, data_yaml = write_coco_and_yolo(tmp_path / "coco_yolo", images, truth)
    voc = write_voc(tmp_path / "voc", images, truth)
    rf = write_roboflow_coco(tmp_path / "rf", images, truth)
    common = ["--ckpt", str(ckpt), "--img-size", str(SIZE), "--device", "cpu", "--loader", "torch",
              "--batch-size", "3"]
    aps = []
    for form in (["--val-ann", str(ann), "--val-images", str(tmp_path / "coco_yolo" / "images" / "val")],
                 ["--data", str(data_yaml)], ["--data", str(voc)], ["--data", str(rf)],
                 ["--data", str(rf), "--split", "test"]):
        assert eval_main(common + form) == 0, (form, capsys.readouterr().err)
        aps.append(float(ap_line(capsys).split()[2]))
    assert aps[0] > 0.5, aps  # the ground truth is the model's own detections
    assert aps[1:] == pytest.approx([aps[0]] * 4, abs=1e-3), aps


def test_split_test_with_val_ann_is_one_line_before_any_work(capsys):
    from fastdet.eval.__main__ import main as eval_main

    # --split test reads --data's own test split; --val-ann names a set to score as it is.
    assert eval_main(["--ckpt", "/nonexistent.pth", "--split", "test", "--val-ann", "v.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--split test scores the test split of --data" in err[0], err


def test_a_yolo_coco_with_other_names_is_refused_naming_both_sides(coco_model, tmp_path, capsys):
    from fastdet.eval.__main__ import main as eval_main

    ckpt, images, truth = coco_model
    renamed = ["tvmonitor" if n == "tv" else "sofa" if n == "couch" else n for n in ULTRALYTICS_COCO_NAMES]
    _, data_yaml = write_coco_and_yolo(tmp_path, images, truth, yolo_names=renamed)
    assert eval_main(["--ckpt", str(ckpt), "--data", str(data_yaml), "--device", "cpu", "--loader", "torch"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "only in the checkpoint ['couch', 'tv'], only in this set ['sofa', 'tvmonitor']" in err[0], err[0]


def test_predict_draws_and_writes_the_checkpoints_own_names_and_ids(coco_model, tmp_path, monkeypatch, capsys):
    """``fastdet.predict`` captions with the checkpoint's class names and writes its COCO
    category ids (label 16 is 'dog', id 18), whatever set it is run on."""
    import fastdet.predict as predict

    ckpt, images, truth = coco_model
    src = tmp_path / "src"
    src.mkdir()
    Image.fromarray(images[0]).save(src / "a.png")
    drawn = []
    real = predict.draw_detections

    def spy(image, boxes, scores, labels, class_names):
        drawn.append((labels.tolist(), list(class_names)))
        return real(image, boxes, scores, labels, class_names)

    monkeypatch.setattr(predict, "draw_detections", spy)
    out = tmp_path / "out"
    assert predict.main(["--ckpt", str(ckpt), "--source", str(src), "--output-dir", str(out),
                         "--score-thresh", "0", "--img-size", str(SIZE), "--device", "cpu"]) == 0
    (labels, names), = drawn
    assert names == ULTRALYTICS_COCO_NAMES and labels[0] == truth[0][0][0]
    results = json.loads((out / "predictions.json").read_text())
    assert len(results) == len(labels) and [r["category_id"] for r in results] == [COCO_IDS[c] for c in labels]
    assert results[0]["category_id"] == COCO_IDS[truth[0][0][0]]


def test_predict_finds_the_image_files_the_set_readers_read(tmp_path):
    """A folder predict is pointed at yields the files training would read from it (a
    Windows ``.jfif`` JPEG included), and not a phone's HEIC."""
    from fastdet.data.formats import IMAGE_EXTS
    from fastdet.predict import IMAGE_SUFFIXES, find_images

    assert sorted(IMAGE_SUFFIXES) == sorted(IMAGE_EXTS)
    for name in ("a.jpg", "b.JPG", "c.jfif", "d.HEIC", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [f.name for f in find_images(str(tmp_path))] == ["a.jpg", "b.JPG", "c.jfif"]
    # A folder whose images are one level down (an export's images/): the line says how to reach them.
    (tmp_path / "set" / "images").mkdir(parents=True)
    (tmp_path / "set" / "images" / "x.png").write_bytes(b"")
    with pytest.raises(ValueError, match=r"its subfolders hold 1: pass a pattern, e.g. --source '.*/set/\*\*/\*\.png'"):
        find_images(str(tmp_path / "set"))
    assert [f.name for f in find_images(str(tmp_path / "set" / "**" / "*.png"))] == ["x.png"]
