"""ModelEMA: the flavours' decays against their published formulas, the averaged
weights against a hand-rolled EMA (PaddleDetection's zero-initialised, bias-corrected one
included), state round trips, and a compiled update."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fastdet.ops as ops
from fastdet.ops.ema import EMA_FLAVOURS, ModelEMA, ramp_decay, threshold_decay


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))


def test_decay_schedules_match_paddle_and_yolox():
    for n in (0, 1, 5, 100, 10_000, 1_000_000):
        # PaddleDetection ModelEMA (threshold): min(decay, (1 + step) / (10 + step)), step before +1.
        assert threshold_decay(torch.tensor(n), 0.9998).item() == pytest.approx(min(0.9998, (1 + n) / (10 + n)))
        # YOLOX ModelEMA: decay * (1 - exp(-updates / 2000)), updates after +1.
        assert ramp_decay(torch.tensor(n), 0.9998).item() == pytest.approx(0.9998 * (1 - math.exp(-n / 2000)))


@pytest.mark.parametrize("kind", ["threshold", "ramp"])
def test_update_matches_hand_rolled_ema(kind):
    model = _model()
    ema = ModelEMA(model, decay=0.99, kind=kind, tau=5.0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(2, 3, 6, 6))  # moves the BN running stats and counter
        d = min(0.99, (1 + step) / (10 + step)) if kind == "threshold" else 0.99 * (1 - math.exp(-(step + 1) / 5.0))
        assert ema.current_decay().item() == pytest.approx(d, rel=1e-6)
        ema.update(model)
        for k, v in model.state_dict().items():
            want[k] = d * want[k] + (1 - d) * v if v.is_floating_point() else v.clone()
    got = ema.module.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert got["1.num_batches_tracked"].item() == 4
    assert int(ema.updates) == 4
    assert not any(p.requires_grad for p in ema.module.parameters()) and not ema.module.training


def test_flavour_registry():
    assert set(EMA_FLAVOURS) == {"threshold", "paddle", "ramp"}
    for n in (0, 3, 1999, 50_000):
        t = torch.tensor(n)
        # YOLOX: 0.9998 * (1 - exp(-updates / 2000)) with updates counted after the +1.
        assert EMA_FLAVOURS["ramp"].decay(t, 0.9998, 2000.0).item() == pytest.approx(
            0.9998 * (1 - math.exp(-(n + 1) / 2000)))
        for kind in ("threshold", "paddle"):
            assert EMA_FLAVOURS[kind].decay(t, 0.9998, 2000.0).item() == pytest.approx(min(0.9998, (1 + n) / (10 + n)))


def test_paddle_flavour_matches_paddledetection_model_ema():
    """ppdet/optimizer/ema.py ModelEMA (threshold) restated: zeros, v = d v + (1 - d) p with
    d = min(decay, (1 + step) / (10 + step)), and apply() = v / (1 - d_last ** step)."""
    model = _model()
    ema = ModelEMA(model, decay=0.9, kind="paddle")
    assert all(float(t.abs().sum()) == 0 for t in ema.module.parameters())  # zero-initialised
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if v.is_floating_point()}
    for step in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(2, 3, 6, 6))
        d = min(0.9, (1 + step) / (10 + step))
        ema.update(model)
        for k in state:
            state[k] = d * state[k] + (1 - d) * model.state_dict()[k]
        last_d = d
    read = ema.averaged().state_dict()
    for k, v in state.items():
        torch.testing.assert_close(read[k], v / (1 - last_d ** 30), rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(ema.module.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # The checkpoint holds the weights as read (for evaluation, fine-tuning) and the raw
    # average (for resuming); a resumed EMA reads the same.
    sd = copy.deepcopy(ema.state_dict())
    other = ModelEMA(_model(), decay=0.9, kind="paddle")
    other.load_state_dict(sd)
    for k, v in other.averaged().state_dict().items():
        torch.testing.assert_close(v, read[k], msg=k)
    with pytest.raises(ValueError, match="optim.ema_type is 'threshold'"):
        ModelEMA(_model(), decay=0.9).load_state_dict(sd)
    other.reset(model)
    assert int(other.updates) == 0 and float(other.module[0].weight.abs().sum()) == 0


def test_state_dict_round_trip_and_reset():
    model = _model()
    ema = ModelEMA(model, decay=0.9)
    with torch.no_grad():
        model[0].weight.mul_(3)
    ema.update(model)
    ema.update(model)
    state = copy.deepcopy(ema.state_dict())
    assert set(state) == {"module", "updates", "decay", "kind"} and state["updates"] == 2
    other = ModelEMA(_model(), decay=0.9)
    other.load_state_dict(state)
    assert int(other.updates) == 2
    torch.testing.assert_close(other.module[0].weight, ema.module[0].weight)
    other.reset(model)
    assert int(other.updates) == 0
    torch.testing.assert_close(other.module[0].weight, model[0].weight)
    with pytest.raises(ValueError, match="no 'module' weights"):
        other.load_state_dict({"updates": 1})


def test_bad_config_and_mismatched_model():
    with pytest.raises(ValueError, match="optim.ema_type"):
        ModelEMA(_model(), kind="cosine")
    with pytest.raises(ValueError, match="optim.ema_decay"):
        ModelEMA(_model(), decay=1.5)
    ema = ModelEMA(_model())
    with pytest.raises(ValueError, match="pass the model the EMA was made from"):
        ema.update(nn.Linear(2, 2))


def test_state_tensors_cover_what_update_writes():
    model = _model()
    ema = ModelEMA(model)
    before = [t.clone() for t in ema.state_tensors()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    changed = [not torch.equal(a, b) for a, b in zip(before, ema.state_tensors())]
    assert changed[-1]  # the counter
    assert sum(changed) >= len(list(model.parameters())) + 1


def test_compiled_update_does_not_recompile():
    torch._dynamo.reset()
    model = _model()
    ema = ModelEMA(model, decay=0.9998, kind="ramp")
    ref = ModelEMA(model, decay=0.9998, kind="ramp")
    update = torch.compile(ema.update, fullgraph=True, backend="aot_eager")
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        update(model)
        ref.update(model)
    # One graph for three different decays: the decay is a tensor, never a recompile.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
    for a, b in zip(ema.module.state_dict().values(), ref.module.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_ema_update_api_accepts_float_decay():
    e, s = [torch.zeros(3)], [torch.ones(3)]
    ops.ema_update_(e, s, 0.75)
    torch.testing.assert_close(e[0], torch.full((3,), 0.25))
    with pytest.raises(ValueError, match="1 EMA tensors but 2 model tensors"):
        ops.ema_update_(e, s * 2, 0.5)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_ema_update_refuses_a_bad_decay_and_other_shapes_on_every_backend(backend):
    """A Python decay outside [0, 1] (NaN too) and a pair of other shapes are one line before
    any tensor is written: the torch back end broadcast a [3] model tensor into a [2, 3] EMA."""
    from fastdet.ops import reference

    with ops.use_backend(backend, "cpu"):
        assert ops.backend_for("ema_update_", "cpu") == backend
        for d in (1.5, -0.5, float("nan"), 2):
            e = [torch.zeros(3)]
            with pytest.raises(ValueError, match=r"ema_update_: decay must be in \[0, 1\], got"):
                ops.ema_update_(e, [torch.ones(3)], d)
            assert not e[0].any()
        for d in (0.0, 1.0, torch.tensor(0.25)):  # a tensor's value is not read (it would sync)
            e = [torch.zeros(3)]
            ops.ema_update_(e, [torch.ones(3)], d)
            torch.testing.assert_close(e[0], torch.full((3,), 1.0 - float(d)))
        e = [torch.zeros(4), torch.zeros(2, 3)]
        with pytest.raises(ValueError, match=r"tensor 1 has shape \[2, 3\] in the EMA but \[3\] in the model"):
            ops.ema_update_(e, [torch.ones(4), torch.ones(3)], 0.5)
        assert not any(t.any() for t in e)
    with pytest.raises(ValueError, match=r"tensor 0 has shape \[2, 3\] in the EMA but \[3\] in the model"):
        reference.ema_update_([torch.zeros(2, 3)], [torch.ones(3)], 0.5)


def _layouts():
    """EMA / model tensor pairs: channels-last conv weights (dense, the fused kernels' flat
    order), a size-1 dim with an odd stride (the same layout), and a mismatch (contiguous
    EMA of a channels-last weight) that only ATen can pair element by element."""
    g = torch.Generator().manual_seed(0)
    cl = torch.channels_last
    w = torch.randn(8, 3, 3, 3, generator=g).to(memory_format=cl)
    one = torch.randn(8, 1, 1, 1, generator=g)
    odd = one.as_strided(one.shape, (1, 5, 7, 9))
    dense = [(torch.randn(8, 3, 3, 3, generator=g).to(memory_format=cl), w),
             (torch.randn(4, 5, 2, 2, generator=g).to(memory_format=cl),
              torch.randn(4, 5, 2, 2, generator=g).to(memory_format=cl)),
             (torch.randn(8, 1, 1, 1, generator=g), odd)]
    mixed = [(torch.randn(8, 3, 3, 3, generator=g), torch.randn(8, 3, 3, 3, generator=g).to(memory_format=cl))]
    return dense, mixed


def _aten_lerps(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::lerp_")


def test_channels_last_weights_take_the_fused_kernel():
    """Channels-last tensors are dense: the C++ kernel updates them in its fused pass (no
    per-tensor ATen lerp_), with the reference's values; only a layout mismatch between the
    EMA and the model tensor still goes through ATen (issue 24, item 7)."""
    from fastdet.ops import _ext, reference

    if not _ext.load():
        pytest.fail(f"the extension did not build: {_ext.error()}")
    decay = torch.tensor(0.75)
    dense, mixed = _layouts()
    for pairs, lerps in ((dense, 0), (mixed, len(mixed))):
        ema, src = [e.clone(memory_format=torch.preserve_format) for e, _ in pairs], [s for _, s in pairs]
        want = [e.clone() for e, _ in pairs]
        reference.ema_update_(want, src, decay)
        with ops.use_backend("cpp", "cpu"):
            assert _aten_lerps(lambda: ops.ema_update_(ema, src, decay)) == lerps
        for got, w in zip(ema, want):
            torch.testing.assert_close(got, w, rtol=0, atol=1e-6)


def test_triton_ema_plans_channels_last_weights_into_its_fused_kernel():
    pytest.importorskip("triton")
    from fastdet.ops.triton import ema as tema

    dense, mixed = _layouts()
    tables, slow, _ = tema._plan([e for e, _ in dense], [s for _, s in dense])
    assert slow == [] and sum(len(t.numels) for t in tables) == len(dense)
    tables, slow, _ = tema._plan([e for e, _ in mixed], [s for _, s in mixed])
    assert len(slow) == len(mixed) and not tables
