"""The dispatch: defaults per device, the FASTDET_OPS_BACKEND grammar, overrides that
cannot serve a device, and fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastdet.ops import _ext, dispatch


def test_env_grammar():
    parsed = dispatch._parse_env("triton")
    assert parsed == {(None, None): "triton"}
    parsed = dispatch._parse_env("cpu=torch, cuda=triton, cuda:task_aligned_assign=cuda")
    assert parsed == {("cpu", None): "torch", ("cuda", None): "triton", ("cuda", "task_aligned_assign"): "cuda"}
    for bad, msg in [("tensorrt", "unknown back end"), ("tpu=torch", "unknown device type"),
                     ("cpu:nms=torch", "unknown op")]:
        with pytest.raises(ValueError, match=msg):
            dispatch._parse_env(bad)


def test_overrides_and_defaults():
    assert dispatch.DEFAULTS.keys() == {("cpu", False), ("cpu", True), ("cuda", False), ("cuda", True)}
    for table in dispatch.DEFAULTS.values():
        assert set(table) == set(dispatch.OPS)
    with dispatch.use_backend("torch"):
        assert dispatch.backend_for("box_iou", "cpu") == "torch"
        with dispatch.use_backend("cpp", "cpu", "box_iou"):
            expected = "cpp" if _ext.load() else "torch"
            assert dispatch.backend_for("box_iou", "cpu") == expected
            assert dispatch.backend_for("giou_loss", "cpu") == "torch"
    # A back end that cannot serve CPU tensors is ignored there (cuda is for CUDA tensors).
    with dispatch.use_backend("cuda"):
        assert dispatch.backend_for("box_iou", "cpu") == dispatch.backend_for("box_iou", "cpu", False)
        assert dispatch.backend_for("box_iou", "cpu") in ("cpp", "torch")
    with pytest.raises(ValueError, match="unknown back end"):
        dispatch.set_backend("fast")


def test_env_variable_reaches_the_dispatch():
    code = ("from fastdet.ops import dispatch; "
            "print(dispatch.backend_for('box_iou', 'cpu'), dispatch.backend_for('task_aligned_assign', 'cpu'))")
    env = {**os.environ, "FASTDET_OPS_BACKEND": "cpu=torch,cpu:task_aligned_assign=cpp"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    want = "cpp" if _ext.load() else "torch"
    assert r.stdout.split() == ["torch", want]


def test_triton_on_cpu_only_under_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    with dispatch.use_backend("triton", "cpu"):
        # Without TRITON_INTERPRET, Triton cannot run CPU tensors: fall back (warned once).
        assert dispatch.backend_for("box_iou", "cpu") in ("cpp", "torch")


def test_a_missing_cuda_extension_on_a_gpu_is_not_a_silent_fallback(monkeypatch, caplog):
    """On a CUDA device without the extension's CUDA kernels, the ops whose default is
    ``cuda`` fall back to Triton with a warning naming the cause, and ``--cuda-graphs``
    (TrainStep) refuses to capture that fallback unless FASTDET_OPS_BACKEND names it."""
    def available(name, device_type, op=None):
        return name != "cuda" and (op is None or dispatch.has_kernel(name, op))

    monkeypatch.setattr(dispatch, "available", available)
    monkeypatch.setattr(_ext, "_state", {"variant": "cpu", "error": None})
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_resolved", {})
    with caplog.at_level("WARNING", logger="fastdet.ops.dispatch"):
        assert dispatch.backend_for("atss_assign", "cuda") == "triton"
    assert "default back end 'cuda' of atss_assign on cuda is unavailable" in caplog.text
    assert "built without CUDA kernels" in caplog.text
    fb = dispatch.fallbacks("cuda")
    on_cuda = [op for op, b in dispatch.DEFAULTS[("cuda", False)].items() if b == "cuda"]
    assert "atss_assign" in on_cuda
    # yolo_targets has no Triton kernel: its fallback is the torch reference
    assert fb == {op: ("cuda", "triton" if dispatch.has_kernel("triton", op) else "torch") for op in on_cuda}
    with pytest.raises(ValueError, match=rf"--cuda-graphs: {on_cuda[0]} on 'triton' instead of 'cuda'.*"
                                         r"FASTDET_OPS_BACKEND \(e.g. cuda=triton\)"):
        dispatch.require_defaults("cuda", "--cuda-graphs")
    with dispatch.use_backend("triton", "cuda"):  # asked for: accepted
        dispatch.require_defaults("cuda", "--cuda-graphs")
    dispatch.require_defaults("cpu", "--cuda-graphs")


def test_an_op_without_a_kernel_in_the_requested_back_end_says_so_and_reports_what_ran(monkeypatch, caplog):
    """FASTDET_OPS_BACKEND=triton: yolo_targets has no Triton kernel. It runs the kernel of
    the next back end (cpp on the CPU, the CUDA kernel on a GPU), not a torch reference
    that copies host tables per call; one warning says so, and describe() (what the
    benchmarks record) names the back end that ran (issue 24, item 2)."""
    assert not dispatch.has_kernel("triton", "yolo_targets")
    monkeypatch.setattr(dispatch, "triton_usable", lambda device_type: True)
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_resolved", {})
    with caplog.at_level("WARNING", logger="fastdet.ops.dispatch"), dispatch.use_backend("triton"):
        for _ in range(3):
            assert dispatch.backend_for("yolo_targets", "cpu") == "cpp"
        desc = dispatch.describe("cpu")
    assert desc["yolo_targets"] == "cpp"
    assert all(b == "triton" for op, b in desc.items() if op != "yolo_targets"), desc
    said = [r.getMessage() for r in caplog.records if "yolo_targets" in r.getMessage()]
    assert said == ["fastdet.ops: yolo_targets has no 'triton' kernel; it runs on 'cpp' on cpu"], said
