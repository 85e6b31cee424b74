"""Reading COCO-format ``instances`` files into per-image records, with a report.

``resolve_data`` turns the data section of the config into four paths;
``load_coco`` reads one annotation file into :class:`CocoDataset`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastdet.config import DataConfig
from fastdet.data import demo


class DataError(ValueError):
    """A problem with the user's data; the message is one line naming the file and field."""


@dataclass(frozen=True)
class DataPaths:
    train_ann: Path
    train_images: Path
    val_ann: Path
    val_images: Path


def coco_layout(root: str | Path) -> DataPaths:
    """The standard COCO 2017 layout under ``root`` (also the demo set's)."""
    root = Path(root)
    return DataPaths(
        train_ann=demo.ann_path(root, "train"),
        train_images=demo.image_dir(root, "train"),
        val_ann=demo.ann_path(root, "val"),
        val_images=demo.image_dir(root, "val"),
    )


_FLAGS = {
    "train_ann": "--train-ann",
    "train_images": "--train-images",
    "val_ann": "--val-ann",
    "val_images": "--val-images",
}


def resolve_data(data_cfg: DataConfig) -> DataPaths:
    """Where the training and validation annotations and images are.

    ``data_cfg.data`` is ``"demo"`` (the built-in set, generated on first use under
    ``data_cfg.cache_dir``) or a COCO root holding ``annotations/instances_{train,val}2017.json``
    and ``{train,val}2017/``. Each of ``train_ann``, ``train_images``, ``val_ann``,
    ``val_images`` that is set overrides the root's path. Every path is checked; a
    missing one raises :class:`DataError` naming the flag and the path.
    """
    explicit = {k: getattr(data_cfg, k) for k in _FLAGS}
    base: DataPaths | None = None
    if any(v is None for v in explicit.values()):
        if data_cfg.data == "demo":
            base = coco_layout(demo.demo_root(data_cfg.cache_dir))
        else:
            root = Path(data_cfg.data).expanduser()
            if not root.is_dir():
                raise DataError(
                    f"--data {data_cfg.data}: no such directory (expected 'demo' or a COCO root "
                    "with annotations/ and train2017/, val2017/)"
                )
            base = coco_layout(root)
    out = {}
    for key, flag in _FLAGS.items():
        if explicit[key] is not None:
            path, origin = Path(explicit[key]).expanduser(), flag
        else:
            assert base is not None
            path, origin = getattr(base, key), f"--data {data_cfg.data}"
        is_ann = key.endswith("_ann")
        if is_ann and not path.is_file():
            raise DataError(f"{origin}: annotation file {path} not found")
        if not is_ann and not path.is_dir():
            raise DataError(f"{origin}: image directory {path} not found")
        out[key] = path
    return DataPaths(**out)
