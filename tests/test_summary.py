"""The start-up model summary: parameters, trainable parameters, GFLOPs at the training sizes."""

from __future__ import annotations

import json

from fastdet.engine.summary import FILE_NAME, summarize_model, write_summary
from fastdet.models import build_model
from fastdet.models.flops import count_flops


def test_summary_counts(tmp_path):
    model = build_model("ppyoloe", "s", num_classes=4)
    total = sum(p.numel() for p in model.parameters())
    first = next(iter(dict(model.named_children())))
    for p in getattr(model, first).parameters():
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in getattr(model, first).parameters())
    s = summarize_model(model, "ppyoloe-s", (64, 128, 64))
    assert s.params == total and s.trainable == total - frozen and frozen > 0
    assert sum(n for n, _ in s.parts.values()) == total
    assert s.parts[first] == (frozen, 0)
    assert list(s.gflops) == [64, 128]
    assert s.gflops[64] * 1e9 == count_flops(model, 64, deploy=False)
    # Convolutions dominate: four times the pixels, about four times the FLOPs.
    assert 3.5 < s.gflops[128] / s.gflops[64] < 4.5
    text = str(s)
    assert f"{total / 1e6:.2f} M parameters, {(total - frozen) / 1e6:.2f} M trainable" in text
    assert "at 128x128" in text
    path = write_summary(s, tmp_path)
    assert path.name == FILE_NAME
    doc = json.loads(path.read_text().split("\n\n", 1)[1])
    assert doc["params"] == total and doc["trainable"] == total - frozen
    assert all(p.device.type == "cpu" for p in model.parameters())  # counted on a meta copy
