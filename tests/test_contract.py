"""The contract every registered family keeps, over ``ARCHITECTURES`` x its training phases.

As timm's tests run over its model registry: a family registered in
``fastdet.models.ARCHITECTURES`` with a recipe is covered here without a line of test
code. Each case builds the family's first (smallest) size for a few classes, on tiny
images, and runs it with the loss arguments of one of its phases (every distinct set a
full run of its smallest preset goes through):

- inference outputs: boxes ``[B, A, 4]``, scores ``[B, A, C]`` in [0, 1];
- training: a dict of finite losses with ``total_loss``; every parameter gets a gradient;
- padded ground truth (more masked slots, holding junk) changes no loss;
- the training forward traces with 0 graph breaks (``torch._dynamo.explain``);
- the training forward + backward compiled as one graph (AOT autograd) matches eager
  (for each family's last phase: compiling is the costly check);
- the recipe: presets resolve, phases give valid stage lists for every epoch of a run,
  post-processing settings are accepted by ``predict``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fastdet import registry
from fastdet.config import apply_overrides
from fastdet.data.stages import check_stages
from fastdet.models import ARCHITECTURES

NUM_CLASSES = 3
B, IMG = 2, 64


def _smallest_preset(arch: str):
    fam = ARCHITECTURES[arch]
    return apply_overrides(registry.get_preset(arch, fam.sizes[0]), {"model.num_classes": NUM_CLASSES})


# A family without a recipe fails test_every_family_declares_a_recipe, not the collection.
WITH_RECIPE = [arch for arch, fam in ARCHITECTURES.items() if fam.recipe is not None]


def _cases() -> list[tuple[str, int]]:
    """(arch, index of a distinct set of loss arguments over a full run of its smallest preset)."""
    out = []
    for arch in WITH_RECIPE:
        cfg = _smallest_preset(arch)
        for i, _ in enumerate(registry.loss_variants(cfg, 0, cfg.optim.epochs - 1)):
            out.append((arch, i))
    return out


CASES = _cases()
# Compiling forward + backward is the costly check (minutes per case on a loaded 2-core
# CPU): one case per family, its last phase (PP-YOLOE: the task-aligned assigner; a
# family's late switches, e.g. an extra loss term, come last). Every phase is traced by
# the graph-break test.
COMPILED_CASES = [(arch, max(i for a, i in CASES if a == arch)) for arch in dict.fromkeys(a for a, _ in CASES)]


def _model_and_kwargs(arch: str, i: int):
    cfg = _smallest_preset(arch)
    kw = registry.loss_variants(cfg, 0, cfg.optim.epochs - 1)[i]
    torch.manual_seed(0)
    return registry.build_detector(cfg), kw


def _batch(max_boxes: int = 4, junk: bool = False):
    """Images and padded targets: a box filling most of the image (so the coarsest level
    gets positives too), two smaller ones, then padded slots (zeros, or junk boxes)."""
    g = torch.Generator().manual_seed(0)
    real = torch.tensor([[2.0, 2.0, 62.0, 62.0], [10.0, 10.0, 40.0, 50.0], [30.0, 20.0, 60.0, 60.0]])
    pad = max_boxes - len(real)
    fill = torch.tensor([5.0, 5.0, 60.0, 50.0]) if junk else torch.zeros(4)
    boxes = torch.cat([real, fill.expand(pad, 4)]) * (IMG / 64)
    labels = torch.tensor([0, 1, NUM_CLASSES - 1] + [NUM_CLASSES - 1 if junk else 0] * pad)
    mask = torch.tensor([True] * len(real) + [False] * pad)
    targets = dict(gt_boxes=boxes.expand(B, -1, -1).clone(), gt_labels=labels.expand(B, -1).clone(),
                   gt_mask=mask.expand(B, -1).clone(), gt_scores=mask.float().expand(B, -1).clone())
    return torch.randn(B, 3, IMG, IMG, generator=g), targets


def test_every_family_declares_a_recipe():
    for arch, fam in ARCHITECTURES.items():
        assert fam.recipe is not None, f"{arch}: ArchFamily.recipe is missing"
        assert fam.sizes, arch


@pytest.mark.parametrize("arch", WITH_RECIPE)
def test_recipe_resolves_and_phases_are_valid(arch):
    fam = ARCHITECTURES[arch]
    for size in fam.sizes:
        cfg = registry.get_preset(arch, size)
        assert isinstance(cfg.family, fam.recipe.options)
        assert registry.config_from_dict(cfg.to_dict()) == cfg
    cfg = _smallest_preset(arch)
    demo = apply_overrides(cfg, registry.demo_overrides(arch))
    for c in (cfg, demo, apply_overrides(cfg, {"data.augment": False})):
        for e in range(c.optim.epochs):
            p = registry.phase(c, e)
            assert check_stages(p.stages) == p.stages
        # Warm-up compiles every distinct set of loss arguments: keep them few.
        assert 1 <= len(registry.loss_variants(c, 0, c.optim.epochs - 1)) <= 4
    model = registry.build_detector(cfg).eval()
    dets = model.predict(torch.zeros(1, 3, IMG, IMG), **registry.predict_kwargs(cfg))
    assert len(dets) == 1 and {"boxes", "scores", "labels"} <= set(dets[0])


@pytest.mark.parametrize("arch, variant", CASES)
def test_outputs_losses_and_gradients(arch, variant):
    model, kw = _model_and_kwargs(arch, variant)
    x, t = _batch()
    model.eval()
    with torch.no_grad():
        boxes, scores = model(x)
    assert boxes.dim() == 3 and boxes.shape[0] == B and boxes.shape[2] == 4
    assert scores.shape == (B, boxes.shape[1], NUM_CLASSES)
    assert bool(((scores >= 0) & (scores <= 1)).all())
    model.train()
    losses = model(x, t, **kw)
    assert "total_loss" in losses
    for k, v in losses.items():
        assert v.dim() == 0 and bool(torch.isfinite(v)), (k, v)
    losses["total_loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{arch} {kw}: no gradient for {missing[:5]}"
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    assert not bad, f"{arch} {kw}: non-finite gradient in {bad[:5]}"


@pytest.mark.parametrize("arch, variant", CASES)
def test_padded_ground_truth_changes_nothing(arch, variant):
    model, kw = _model_and_kwargs(arch, variant)
    model.eval()  # the same BatchNorm statistics for both calls
    x, t = _batch(4)
    _, junk = _batch(12, junk=True)
    with torch.no_grad():
        a, b = model(x, t, **kw), model(x, junk, **kw)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("arch, variant", CASES)
def test_training_forward_has_no_graph_breaks(arch, variant):
    torch._dynamo.reset()
    model, kw = _model_and_kwargs(arch, variant)
    x, t = _batch()
    explanation = torch._dynamo.explain(model)(x, t, **kw)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("arch, variant", COMPILED_CASES)
def test_compiled_training_matches_eager(arch, variant):
    """Forward + backward through dynamo and AOT autograd (functionalised, joint graph,
    partitioned) as one graph; inductor's numerics are each family's own (CPU C++ builds
    of a whole detector take minutes) and the GPU check's."""
    torch._dynamo.reset()
    eager, kw = _model_and_kwargs(arch, variant)
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x, t = _batch()
    # One seed before each call: a family may draw random numbers in training (PP-YOLO's
    # DropBlock); both calls then draw the same.
    torch.manual_seed(0)
    want = eager(x, t, **kw)
    torch.manual_seed(0)
    got = step(x, t, **kw)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
    want["total_loss"].backward()
    got["total_loss"].backward()
    # Per tensor, relative to its norm: AOT autograd decomposes BatchNorm's backward and
    # sums in another order, which moves single elements of the first layers' gradients
    # (many terms cancelling) by more than an elementwise rtol; a wrong gradient is off
    # by O(1) in this measure.
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        if p.grad is not None:
            err = float((q.grad - p.grad).norm() / p.grad.norm().clamp(min=1e-12))
            assert err < 1e-3, f"{name}: compiled gradient off by {err:.2e} of its norm"
