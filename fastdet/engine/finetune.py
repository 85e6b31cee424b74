"""``--ckpt`` fine-tuning: a checkpoint's weights loaded into a model for another set,
its classes matched by name.

Everything but the classification layers loads as it is (tensors of another shape start
fresh, as ``load_weights_tolerant`` does). In the classification layers, each of this
set's classes takes the checkpoint's rows of the class with the same name, wherever that
class sat in the checkpoint (a permutation, a subset, an overlap of its classes); a name
the checkpoint does not have starts fresh. A checkpoint that names no classes is matched
by position when its class count is this set's.

Which rows of which tensors hold a class is the head's to say, not this module's: a head
declares ``class_layers`` (the modules whose output row ``c`` is class ``c``), or, where
the class channels are interleaved with others, a ``class_rows(num_classes)`` method
(PP-YOLO's YOLOv3 head: per anchor ``[x, y, w, h, obj, classes...]``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from fastdet.runtime.checkpoint import load_weights_tolerant, select_weights

_NAMED = 10  # fresh classes named in the log line; the rest counted


def class_rows(model: nn.Module, num_classes: int) -> dict[str, Tensor]:
    """``{state-dict key: LongTensor [num_classes, k]}``: for each per-class tensor of the
    model's head, the dim-0 rows that hold class ``c`` (``k`` = 1 for a plain classifier,
    the anchors per cell for PP-YOLO), laid out as for a model of ``num_classes`` classes."""
    head = model.head
    rows_of = getattr(head, "class_rows", None)
    if rows_of is not None:
        rows = rows_of(num_classes)
    else:
        one = torch.arange(num_classes)[:, None]  # [C, 1]
        rows = {f"{layer}.{name}": one for layer in head.class_layers
                for name, _ in head.get_submodule(layer).named_parameters()}
    return {f"head.{k}": v for k, v in rows.items()}


def _others(rows: Tensor, total: int) -> Tensor:
    """The rows of a per-class tensor that hold no class (PP-YOLO's box and objectness), in order."""
    keep = torch.ones(total, dtype=torch.bool)
    keep[rows.flatten()] = False
    return keep.nonzero().flatten()


def _num_classes_of(checkpoint: dict[str, Any], theirs: Sequence[str] | None) -> int:
    if theirs:
        return len(theirs)
    return int(checkpoint["config"]["model"]["num_classes"])


def load_for_finetune(model: nn.Module, checkpoint: dict[str, Any], class_names: Sequence[str]) -> str:
    """Load ``checkpoint`` (a fastdet checkpoint dict, its EMA weights when present) into
    ``model``, built for ``class_names``; returns the log line's text (what was matched by
    name, which classes start fresh, which tensors of another shape start fresh)."""
    weights, _ = select_weights(checkpoint)
    names = [str(n) for n in checkpoint.get("class_names") or []]
    ours = [str(n) for n in class_names]
    n_theirs = _num_classes_of(checkpoint, names)
    if names:
        index: dict[str, int] = {}
        for i, n in enumerate(names):  # torchvision's 91 repeat "N/A": the first one counts
            index.setdefault(n, i)
        source = [index.get(n) for n in ours]
    else:
        source = list(range(len(ours))) if n_theirs == len(ours) else [None] * len(ours)

    new_rows, old_rows = class_rows(model, len(ours)), class_rows(model, n_theirs)
    skipped = load_weights_tolerant(model, {k: v for k, v in weights.items() if k not in new_rows})
    own = model.state_dict()  # shares storage with the parameters: written in place below
    with torch.no_grad():
        for key, rows in new_rows.items():
            dst, src, old = own[key], weights.get(key), old_rows[key]
            if src is None:
                continue
            fits = (src.shape[1:] == dst.shape[1:] and int(old.max()) < src.shape[0]
                    and len(_others(old, src.shape[0])) == len(_others(rows, dst.shape[0])))
            if not fits:
                skipped.append(f"{key} {tuple(src.shape)}->{tuple(dst.shape)}")
                continue
            dst[_others(rows, dst.shape[0])] = src[_others(old, src.shape[0])].to(dst.dtype)
            for j, i in enumerate(source):
                if i is not None:
                    dst[rows[j]] = src[old[i]].to(dst.dtype)

    fresh = [n for n, i in zip(ours, source) if i is None]
    matched = len(ours) - len(fresh)
    if names:
        msg = f"{matched} of {len(ours)} classes matched by name to the checkpoint's {n_theirs}"
    elif matched:
        msg = f"the checkpoint names no classes: its {n_theirs} classes taken by position"
    else:
        msg = f"the checkpoint names no classes and has {n_theirs}, this set {len(ours)}"
    if fresh:
        more = f" and {len(fresh) - _NAMED} more" if len(fresh) > _NAMED else ""
        msg += f"; start fresh: {', '.join(fresh[:_NAMED])}{more}"
    if skipped:
        msg += f"; {len(skipped)} tensors of another shape start fresh: {', '.join(skipped[:4])}"
    return msg
