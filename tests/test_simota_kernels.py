"""The C++, Triton (interpreted) and CUDA SimOTA kernels against the torch reference.

``TRITON_INTERPRET=1`` must be set before triton is first imported, so the one test
collected normally re-runs this file in a fresh pytest subprocess with it set (as
tests/test_ops_triton.py does). The CUDA kernels compile wherever a toolkit is present
(one build with the rest of the extension) and run in the ``gpu`` tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastdet.ops as ops
from fastdet.ops import _ext
from fastdet.ops import simota as ref

sys.path.insert(0, os.path.dirname(__file__))
from test_simota import _one_gt_case, random_inputs  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _f32(args):
    return [a.float() if a.is_floating_point() else a for a in args]


if not INTERPRETED:

    def test_triton_simota_under_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env=env, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, f"interpreted Triton tests failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
        assert " passed" in r.stdout, r.stdout[-2000:]

    def test_cuda_kernel_compiles_and_is_registered():
        if _ext.find_cuda_home() is None or torch.version.cuda is None:
            pytest.skip("no CUDA toolkit (nvcc) on this machine")
        if not _ext.load():
            pytest.fail(f"the extension did not build: {_ext.error()}")
        if _ext.variant() != "cuda":
            pytest.skip("no GPU: the C++-only variant was built (tests/test_ops_build.py compiles the CUDA one)")
        assert "simota.cuda.o" in {p.name for p in _ext.build_dir("cuda").glob("*.o")}
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastdet::simota_assign", "CUDA")
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastdet::simota_assign", "CPU")

    # --------------------------------------------------------------------------- C++ kernel


    @pytest.fixture(scope="module")
    def F_ext():
        if not _ext.load():
            pytest.fail(f"the fastdet extension did not build: {_ext.error()}")
        return torch.ops.fastdet


    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
    @pytest.mark.parametrize("seed,on_points", [(0, False), (1, False), (0, True)])
    def test_cpp_matches_reference(F_ext, dtype, seed, on_points):
        """``on_points``: GT edges through point centres (integer annotations), where a
        ``>=`` in the kernel's inside tests would differ from the reference's ``>``."""
        args = random_inputs(seed=seed, dtype=dtype, on_points=on_points)
        want_gt, want_iou = ref.simota_assign(*args)
        got_gt, got_iou = F_ext.simota_assign(*args, 2.5, 10, 3.0)
        assert got_gt.dtype == torch.int64 and got_iou.dtype == dtype
        assert torch.equal(got_gt, want_gt)
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(got_iou, want_iou, rtol=tol, atol=tol)


    def test_cpp_constructed_cases_and_edges(F_ext):
        for case in (_one_gt_case(),):
            *args, _ = case
            want = ref.simota_assign(*args)
            got = F_ext.simota_assign(*args, 2.5, 10, 3.0)
            assert torch.equal(got[0], want[0])
        args = random_inputs(seed=6)
        for topk in (1, 3, 32):
            want = ref.simota_assign(*args, topk=topk)
            got = F_ext.simota_assign(*args, 2.5, topk, 3.0)
            assert torch.equal(got[0], want[0]), topk
        # No GT slots at all, and no image.
        scores, pred, points, strides, gt, labels, mask = args
        got_gt, got_iou = F_ext.simota_assign(scores, pred, points, strides, gt[:, :0], labels[:, :0], mask[:, :0],
                                              2.5, 10, 3.0)
        assert (got_gt == -1).all() and (got_iou == 0).all()
        got_gt, _ = F_ext.simota_assign(scores[:0], pred[:0], points, strides, gt[:0], labels[:0], mask[:0], 2.5, 10, 3.0)
        assert got_gt.shape == (0, points.shape[0])
        with pytest.raises(RuntimeError, match="pred_boxes must be"):
            F_ext.simota_assign(scores, pred[:, :-1], points, strides, gt, labels, mask, 2.5, 10, 3.0)


    def test_dispatch_cpp_in_eager_and_compiled(F_ext):
        args = [a.float() if a.is_floating_point() else a for a in random_inputs(seed=7)]
        want = ref.simota_assign(*args)
        with ops.use_backend("cpp", "cpu", "simota_assign"):
            assert ops.backend_for("simota_assign", "cpu") == "cpp"
            got = ops.simota_assign(*args)
            assert torch.equal(got[0], want[0])
            torch._dynamo.reset()
            explained = torch._dynamo.explain(ops.simota_assign)(*args)
            assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
            compiled = torch.compile(ops.simota_assign, fullgraph=True)(*args)
            assert torch.equal(compiled[0], want[0])
            torch.testing.assert_close(compiled[1], want[1])

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    @pytest.mark.parametrize("backend", ["cuda", "triton"])
    def test_gpu_kernels_match_reference(backend):
        if backend == "cuda" and not (_ext.load() and _ext.has_cuda_kernels()):
            pytest.fail(f"the CUDA kernels did not build: {_ext.error()}")
        for seed, kw in [(0, {}), (1, dict(B=8, M=40, C=80, img=640, valid=(40, 0, 3, 17, 40, 1, 25, 9))),
                         (0, dict(on_points=True))]:
            args = _f32(random_inputs(seed=seed, **kw))
            want = ref.simota_assign(*args)  # on the CPU: ties as the kernels break them
            with ops.use_backend(backend, "cuda", "simota_assign"):
                got = ops.simota_assign(*[a.cuda() for a in args])
            assert torch.equal(got[0].cpu(), want[0]), (backend, seed)
            torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-6)

else:
    import fastdet.ops.triton  # noqa: F401  (registers fastdet_triton ops)

    T = torch.ops.fastdet_triton

    @pytest.mark.parametrize("seed,on_points", [(0, False), (1, False), (0, True)])
    def test_triton_matches_reference(seed, on_points):
        args = _f32(random_inputs(seed=seed, B=2, M=5, img=128, valid=(5, 3), on_points=on_points))
        want = ref.simota_assign(*args)
        got = T.simota_assign(*args, 2.5, 10, 3.0)
        assert (want[0] >= 0).sum() > 5
        assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)

    def test_triton_constructed_cases_and_dispatch():
        *args, _ = _one_gt_case()
        args = _f32(args)
        assert torch.equal(T.simota_assign(*args, 2.5, 10, 3.0)[0], ref.simota_assign(*args)[0])
        args = _f32(random_inputs(seed=2, B=2, M=4, img=128, valid=(0, 4)))
        want = ref.simota_assign(*args, topk=20)
        with ops.use_backend("triton", "cpu", "simota_assign"):
            assert ops.backend_for("simota_assign", "cpu") == "triton"
            got = ops.simota_assign(*args, topk=20)
        assert torch.equal(got[0], want[0])
        assert (got[0][0] == -1).all()
