"""Every Triton kernel of ``fastdet.ops`` compiles for the GPUs we are lent (Hopper, sm_90),
here, on a machine with no GPU, with the arguments and constexprs of the GPU path.

On the CPU the kernels run only in Triton's interpreter, which takes other branches where
the GPU differs (libdevice's log in SimOTA, the in-register sort of the assigners'
candidates: ``LIBDEVICE`` and ``SORT`` are false there) and never lowers a kernel to PTX.
A kernel that does not compile for the GPU would fail first on a lent device, inside its
15 minutes. Triton lowers and assembles without a driver (its wheel ships ``ptxas``):
this file's ``__main__`` calls each op of ``torch.ops.fastdet_triton`` on CPU tensors with
the launches recorded instead of run (outputs are not looked at), then compiles every
recorded launch with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``.
It runs in a subprocess: it replaces ``JITFunction.run`` and the ops' device check (so
triton and the kernels are imported inside the functions the subprocess runs, not here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch


def _record_launches() -> dict:
    """Patch Triton's launcher to record (kernel, signature, constexprs) and return the log."""
    import triton.runtime.jit as jit

    launches: dict = {}

    def record(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        for i, p in enumerate(self.params):
            value = bound[p.name] if p.name in bound else p.default
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[(i,)] = value
            else:
                signature[p.name] = jit.mangle_type(value)  # "*fp32", "i32", "fp32", ...
                if value is None:
                    constexprs[(i,)] = None
        named = {p.name: repr(bound.get(p.name, p.default)) for p in self.params if p.is_constexpr}
        key = (f"{self.fn.__module__}.{self.fn.__name__}", tuple(signature.items()), tuple(named.items()))
        launches.setdefault(key, (self, signature, constexprs))

    jit.JITFunction.run = record
    return launches


def _call_every_op() -> None:
    """Each op as ``fastdet.ops`` calls it on a GPU, in each dtype it takes there."""
    from fastdet.ops.synthetic import assign_inputs, random_boxes
    from fastdet.ops.triton import assign, ema, fcos, iou, simota

    for module in (assign, ema, fcos, iou, simota):
        module.check_device = lambda *a, **k: None  # CPU tensors stand in for CUDA ones
    T = torch.ops.fastdet_triton
    for dtype in (torch.float32, torch.float64):
        a, b = random_boxes(37, seed=1).to(dtype), random_boxes(150, seed=2).to(dtype)
        T.box_iou(a, b, 1e-9)
        T.generalized_box_iou(a, b, 1e-9)
        T.giou_loss(a, b[:37], 1e-10)
        T.giou_loss_backward(torch.ones(37, dtype=dtype), a, b[:37], 1e-10)
        x = assign_inputs(2, 5, 4, 256, valid=[3, 2], seed=0)
        scores, pred, points, labels, boxes, mask, C = x.tal_args()
        T.task_aligned_assign(scores.to(dtype), pred.to(dtype), points.to(dtype), labels, boxes.to(dtype),
                              mask.to(dtype), C, 13, 1.0, 6.0, 1e-9)
        an, counts = x.anchors.to(dtype), x.num_anchors_list
        for p in (pred.to(dtype), None):  # ATSS with and without the predictions' IoU
            T.atss_assign(an, counts, labels, boxes.to(dtype), mask.to(dtype), p, C, C, 9, 1e-9)
    x = assign_inputs(2, 5, 4, 256, valid=[3, 2], seed=0)
    T.simota_assign(*x.simota_args(), 2.5, 10, 3.0)
    strides = torch.cat([torch.full((n,), float(s)) for n, s in zip(x.num_anchors_list, (8, 16, 32))])
    ranges = torch.tensor([[-1.0, 64.0], [64.0, 128.0], [128.0, 1e8]]).repeat_interleave(
        torch.tensor(x.num_anchors_list), dim=0)
    T.fcos_assign(x.anchor_points, strides, ranges, x.gt_bboxes, x.gt_labels.reshape(2, 5).long(),
                  x.pad_gt_mask.reshape(2, 5).bool(), 1.5)
    params = [torch.randn(16, 3, 3, 3, dtype=dt) for dt in (torch.float32, torch.float16, torch.bfloat16,
                                                              torch.float64)]
    T.ema_update_(params, [p.clone() for p in params], torch.tensor(0.9))


def _compile_all(launches: dict) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)  # H100 / H200: compute capability 9.0, warps of 32
    done = []
    for (kernel, signature, constexprs), (fn, sig, consts) in launches.items():
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(fn, sig, consts), target=target)
        done.append({"kernel": kernel, "signature": dict(signature), "constexprs": dict(constexprs),
                     "cubin_bytes": len(k.asm["cubin"]), "ptx_target": "sm_90" in k.asm["ptx"] and "sm_90",
                     "seconds": round(time.perf_counter() - t0, 2)})
    return done


def _every_kernel() -> set[str]:
    """The launchable kernels: the ``*_kernel`` JIT functions of fastdet.ops.triton's modules."""
    import triton.runtime.jit as jit

    from fastdet.ops.triton import assign, ema, fcos, iou, simota

    return {f"{m.__name__}.{n}" for m in (assign, ema, fcos, iou, simota) for n, v in vars(m).items()
            if isinstance(v, jit.JITFunction) and n.endswith("_kernel")}


def test_every_triton_kernel_compiles_for_sm90_with_the_gpu_constexprs(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    report = json.loads(r.stdout.splitlines()[-1])
    compiled = report["compiled"]
    assert {c["kernel"] for c in compiled} == set(report["every_kernel"]), "a kernel no op launched here"
    assert all(c["cubin_bytes"] > 0 and c["ptx_target"] == "sm_90" for c in compiled)
    # The GPU branches, which the interpreter never takes, are the ones compiled.
    branches = [(c["kernel"], k, v) for c in compiled for k, v in c["constexprs"].items() if k in ("LIBDEVICE", "SORT")]
    assert len({k for k, _, _ in branches}) >= 5 and all(v == "True" for _, _, v in branches), branches
    assert {"*fp64", "*fp32"} <= {t for c in compiled for t in c["signature"].values()}


if __name__ == "__main__":
    launches = _record_launches()
    _call_every_op()
    print(json.dumps({"compiled": _compile_all(launches), "every_kernel": sorted(_every_kernel())}))
