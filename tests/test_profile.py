"""bench/profile_step.py: the step's time by category, on the CPU (and the CUDA trace
layout, from a synthetic Kineto trace, since no GPU runs here)."""

from __future__ import annotations

import json

import pytest

from bench import profile_step as ps


@pytest.mark.parametrize("kernel, ops, step_range, expected", [
    # cuDNN / CUTLASS convolution kernels on Hopper
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", ["aten::cudnn_convolution"],
     "forward", "convolution forward"),
    ("sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", ["aten::convolution_backward"], "backward",
     "convolution backward"),
    ("sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", [], None, "convolution backward"),
    # cuDNN's own layout transposes (the ones a channels-last model avoids)
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>(...)", ["aten::cudnn_convolution"], "forward",
     "layout, transposes and copies"),
    ("void at::native::batch_norm_collect_statistics_kernel<float, float, float>(...)",
     ["aten::native_batch_norm"], "forward", "BatchNorm and activations"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn", ["aten::mm"], "forward", "matrix products"),
    # inductor's fused kernels, grouped by the ops in their names
    ("triton_per_fused__native_batch_norm_legit_functional_silu_3", [], None, "inductor: batch_norm+activation"),
    ("triton_red_fused_convolution_backward_native_batch_norm_backward_0", [], None,
     "inductor: convolution+batch_norm"),
    ("triton_poi_fused_clone_permute_5", [], None, "inductor: copy"),
    ("cpp_fused_add_mul_7", [], None, "inductor: pointwise"),
    # a custom op wins over the range it runs in; the optimizer and EMA ranges over names
    ("void fastdet::atss_kernel<float>(...)", ["fastdet::atss_assign", "aten::empty"], "loss",
     "fastdet::atss_assign"),
    ("void at::native::multi_tensor_apply_kernel<...>", ["aten::_foreach_add_"], "optimizer", "optimizer"),
    ("triton_poi_fused_lerp_0", [], "ema", "EMA"),
    ("void at::native::vectorized_elementwise_kernel<...>", ["aten::sub"], "loss", "loss"),
    # the CPU: ops with self time, innermost first
    ("aten::mkldnn_convolution", ["aten::mkldnn_convolution", "aten::_convolution", "aten::convolution"], "forward",
     "convolution forward"),
    ("aten::copy_", ["aten::copy_", "aten::_convolution", "aten::convolution"], "forward",
     "layout, transposes and copies"),
    ("aten::empty", ["aten::empty", "aten::convolution_backward"], "backward", "convolution backward"),
    ("aten::add", ["aten::add"], "backward", "other"),
])
def test_categorize(kernel, ops, step_range, expected):
    assert ps.categorize(kernel, ops, step_range) == expected


def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1 if cat != "kernel" else 7,
            "ts": ts, "dur": dur, "args": args}


def test_parse_trace_cuda():
    """Kernels are tied to their launching op through correlation ids, the step ranges
    come from the launch time, and idle gaps are the window's time without a kernel."""
    ev = [
        _x("profile_step", "user_annotation", 0, 100),
        _x("forward", "user_annotation", 1, 40),
        _x("aten::convolution", "cpu_op", 2, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 3, 1, correlation=1),
        _x("sm90_xmma_fprop_implicit_gemm", "kernel", 10, 20, correlation=1),
        _x("fastdet::atss_assign", "cpu_op", 20, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 21, 1, correlation=2),
        _x("atss_kernel", "kernel", 30, 10, correlation=2),
        _x("optimizer", "user_annotation", 50, 30),
        _x("aten::_foreach_add_", "cpu_op", 51, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 52, 1, correlation=3),
        _x("multi_tensor_apply_kernel", "kernel", 60, 30, correlation=3),
        # a kernel whose launch is outside the profiled steps is not counted
        _x("cudaLaunchKernel", "cuda_runtime", 500, 1, correlation=4),
        _x("late_kernel", "kernel", 510, 5, correlation=4),
    ]
    bd = ps.parse_trace({"traceEvents": ev}, steps=1, device="cuda")
    cats = {r["category"]: r for r in bd.by_category()}
    assert cats["convolution forward"]["ms_per_step"] == pytest.approx(0.020)
    assert cats["fastdet::atss_assign"]["ms_per_step"] == pytest.approx(0.010)
    assert cats["optimizer"]["ms_per_step"] == pytest.approx(0.030)
    # window 10..90 us of device time (the step mark is 100 us): busy 20 + 10 + 30
    assert cats["idle gaps"]["ms_per_step"] == pytest.approx((100 - 60) / 1000)
    assert sum(r["share"] for r in cats.values()) == pytest.approx(1.0)
    assert "late_kernel" not in {k["kernel"] for k in bd.top_kernels()}
    top = bd.top_kernels()
    assert [k["kernel"] for k in top] == ["multi_tensor_apply_kernel", "sm90_xmma_fprop_implicit_gemm", "atss_kernel"]
    assert top[0]["calls_per_step"] == 1


def test_parse_trace_cpu_self_time():
    """On the CPU an op's self time is its duration less its children's."""
    ev = [
        _x("profile_step", "user_annotation", 0, 100),
        _x("profile_step", "user_annotation", 100, 100),
        _x("aten::convolution", "cpu_op", 10, 50),
        _x("aten::mkldnn_convolution", "cpu_op", 12, 40),
        _x("aten::copy_", "cpu_op", 14, 10),
        _x("aten::add", "cpu_op", 120, 30),
    ]
    bd = ps.parse_trace({"traceEvents": ev}, steps=2, device="cpu")
    self_us = {w.name: w.dur_us for w in bd.work}
    assert self_us == {"aten::convolution": 10, "aten::mkldnn_convolution": 30, "aten::copy_": 10, "aten::add": 30}
    cats = {r["category"]: r["ms_per_step"] for r in bd.by_category()}
    assert cats["layout, transposes and copies"] == pytest.approx(0.005)
    assert cats["convolution forward"] == pytest.approx(0.020)
    assert cats["idle gaps"] == pytest.approx((200 - 80) / 2 / 1000)
    with pytest.raises(ValueError, match="profile_step"):
        ps.parse_trace({"traceEvents": ev}, steps=3, device="cpu")


def _chain_by_scan(events, t):
    """The enclosing chain as first written: every earlier event scanned, innermost first."""
    out, depth_end = [], t
    for e in reversed([e for e in events if e["ts"] <= t]):
        end = e["ts"] + e.get("dur", 0.0)
        if end >= depth_end:
            out.append(e)
            depth_end = end
    return out


def test_enclosing_chain_is_the_scans_on_nested_and_overlapping_ops():
    import random

    rng = random.Random(0)
    for _ in range(50):
        events, t = [], 0.0
        for _ in range(rng.randint(1, 40)):
            t += rng.choice([0.0, 0.5, 1.0, 3.0])  # ties in start times too
            events.append({"ts": t, "dur": rng.choice([0.0, 1.0, 2.0, 5.0, 20.0])})
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        idx = ps._Enclosing(events)
        for q in [x / 2 for x in range(-2, int(2 * t) + 50)]:
            assert [id(e) for e in idx.chain(q)] == [id(e) for e in _chain_by_scan(events, q)], q


class _Counted(dict):
    """A trace event that counts the reads of its fields."""

    reads = 0

    def __getitem__(self, k):
        _Counted.reads += 1
        return super().__getitem__(k)

    def get(self, k, default=None):
        _Counted.reads += 1
        return super().get(k, default)


def test_parse_trace_reads_each_event_a_bounded_number_of_times():
    """An eager step on CUDA is ~11,000 ops and ~5,000 kernels: gpu_check.sh's profile part
    (40 s) parses 3 such steps. Each kernel looked for its launching op's enclosing ops by
    reading every earlier op, 22 s for those 3 steps here and 4 times that for twice the
    steps; the work must grow with the trace, not with its square."""
    n = 2000
    ev = [_x("profile_step", "user_annotation", 0, 10 * n + 10), _x("forward", "user_annotation", 1, 10 * n)]
    for i in range(n):  # n ops in sequence, each with a child that launches one kernel
        t = 2 + 10 * i
        ev += [_x("aten::conv2d", "cpu_op", t, 8), _x("aten::cudnn_convolution", "cpu_op", t + 1, 6),
               _x("cudaLaunchKernel", "cuda_runtime", t + 2, 1, correlation=i + 1),
               _x("sm90_xmma_fprop_implicit_gemm", "kernel", t + 3, 2, correlation=i + 1)]
    trace = {"traceEvents": [_Counted(e) for e in ev]}
    _Counted.reads = 0
    bd = ps.parse_trace(trace, steps=1, device="cuda")
    assert len(bd.work) == n and {w.category for w in bd.work} == {"convolution forward"}
    assert all(w.ops == ["aten::cudnn_convolution", "aten::conv2d"] and w.step_range == "forward" for w in bd.work)
    assert _Counted.reads <= 40 * len(ev), f"{_Counted.reads / len(ev):.0f} reads per event"


def run_profile(tmp_path, variants: str) -> dict:
    out = tmp_path / "prof"
    rc = ps.main(["--device", "cpu", "--img-size", "64", "--batch-size", "1", "--max-boxes", "4",
                  "--variants", variants, "--compile-backend", "aot_eager",
                  "--warmup", "0", "--iters", "1", "--steps", "1", "--matmul-n", "256", "--out", str(out)])
    assert rc == 0
    assert "convolution forward" in (out / "profile.md").read_text()
    return json.loads((out / "profile.json").read_text())


def check_profiled(r: dict) -> None:
    """The categories a detection step has, shares summing to 1, sorted top kernels, a
    trace Perfetto can open, and the model's TFLOP/s."""
    assert r["status"] == "ok", r
    cats = {c["category"]: c for c in r["categories"]}
    for want in ("convolution forward", "convolution backward", "BatchNorm and activations", "optimizer",
                 "fastdet::atss_assign", "idle gaps"):
        assert want in cats, (r["variant"], sorted(cats))
    assert sum(c["share"] for c in r["categories"]) == pytest.approx(1.0)
    assert cats["convolution forward"]["ms_per_step"] > 0
    assert r["model_tflops"] > 0
    top = r["top_kernels"]
    assert 0 < len(top) <= ps.TOP_KERNELS
    assert [t["ms_per_step"] for t in top] == sorted((t["ms_per_step"] for t in top), reverse=True)
    trace = json.loads(open(r["trace"]).read())
    assert any(e.get("name") == "profile_step" for e in trace["traceEvents"])


def test_profile_runs_on_the_cpu(tmp_path):
    """The whole tool on PP-YOLOE-s at 64 px, eager (the loss is its own category there);
    a variant that cannot run on the CPU is skipped with its reason."""
    doc = run_profile(tmp_path, "eager_fp32,compile_graphs")
    rows = {r["variant"]: r for r in doc["results"]}
    assert rows["compile_graphs"]["status"] == "skipped" and "CUDA" in rows["compile_graphs"]["reason"]
    assert doc["flops_per_step"] > 0 and doc["matmul"]["tflops"] > 0
    check_profiled(rows["eager_fp32"])
    assert "loss" in {c["category"] for c in rows["eager_fp32"]["categories"]}


@pytest.mark.slow
def test_profile_compiled_step(tmp_path):
    """The compiled step (aot_eager here) profiles into the same categories."""
    doc = run_profile(tmp_path, "compile")
    check_profiled(doc["results"][0])
