"""COCO annotation fields as COCO defines them, and the categories that are no class,
without torch.

The background scorer (``fastdet.eval.async_scoring``) fills the ground truth's missing
fields and leaves out the grouping categories as the loader does; it imports this module
and not ``fastdet.data.coco``, whose batch layout imports torch (~1.3 s of CPU in a
process that only scores).
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


def grouping_categories(doc: dict) -> list[dict]:
    """The entry of ``doc["categories"]`` that only groups the others, as a list (empty or
    one): Roboflow's project entry, the category whose own ``supercategory`` is ``"none"``,
    that every other category names as its ``supercategory``, and that no annotation of
    ``doc`` is given.

    Roboflow's COCO export puts it first (id 0, named after the project). Read as a class it
    would be a class without a single box: an output channel trained only as background, a
    row of ``-`` in every AP table. The loader and the scorer both leave it out, so the
    labels and the scored categories agree. Nothing else is left out: a hierarchy's root or
    inner node may have boxes in one split and none in another, and the splits of a set must
    keep one class list, so only Roboflow's marker counts (a single-class project named
    after its class has two entries of that name, the project's and the class's: the
    project's goes).
    """
    cats = [c for c in doc.get("categories") or () if isinstance(c, dict)]
    used = {a.get("category_id") for a in doc.get("annotations") or ()
            if isinstance(a, dict) and type(a.get("category_id")) is int}
    for c in cats:
        others = [d for d in cats if d is not c]
        if others and c.get("supercategory") == "none" and type(c.get("id")) is int and c["id"] not in used \
                and isinstance(c.get("name"), str) and all(d.get("supercategory") == c["name"] for d in others):
            return [c]
    return []
