"""COCO annotation fields as COCO defines them, without torch.

The background scorer (``fastdet.eval.async_scoring``) fills the ground truth's missing
fields as the loader does; it imports this module and not ``fastdet.data.coco``, whose
batch layout imports torch (~1.3 s of CPU in a process that only scores).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): what a COCO box coordinate or area may be."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fill_coco_defaults(doc: dict) -> Counter:
    """Fill in place the annotation fields many tools leave out, as COCO defines them, and
    count them by field: ``iscrowd`` 0 (an ordinary object), ``area`` the box's w*h (what
    pycocotools gives a box-only annotation, ``loadRes``), ``id`` numbered after the largest.
    pycocotools needs all three (``KeyError: 'iscrowd'`` at the first evaluation otherwise)."""
    filled: Counter = Counter()
    anns = [a for a in doc.get("annotations") or () if isinstance(a, dict)]
    next_id = 1 + max((a["id"] for a in anns if type(a.get("id")) is int), default=0)
    for a in anns:
        if "iscrowd" not in a:
            a["iscrowd"] = 0
            filled["iscrowd"] += 1
        b = a.get("bbox")
        if "area" not in a and isinstance(b, list) and len(b) == 4 and all(is_number(v) for v in b):
            a["area"] = float(b[2]) * float(b[3])
            filled["area"] += 1
        if "id" not in a:
            a["id"] = next_id
            next_id += 1
            filled["id"] += 1
    return filled
