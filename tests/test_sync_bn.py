"""FunctionalSyncBatchNorm: 2 gloo ranks with different batch sizes, compiled with fullgraph.

One spawn of 2 processes serves every assertion (a spawn costs seconds on a loaded CPU).
The truth is plain ``nn.BatchNorm2d`` on the concatenated batch in one process, and a
float64 transcription of ``nn.SyncBatchNorm``'s formula (per-rank mean and biased
variance, combined with the per-rank counts; running variance unbiased over the total
count: torch/nn/modules/_functions.py), computed eagerly with ``dist.all_gather``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ports import spawn_gloo_ranks
from torch import nn

from fastdet.engine.sync_bn import FunctionalSyncBatchNorm, convert_sync_batchnorm

BATCH = {0: 3, 1: 5}  # ranks hold different batch sizes
C, H = 4, 6


def _net(momentum=0.1) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C, momentum=momentum), nn.ReLU(),
                        nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C, eps=1e-3, momentum=momentum))
    with torch.no_grad():  # non-trivial affine parameters and a large mean (fp32 cancellation)
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
        net[0].bias.add_(20.0)
    return net


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch (rank 0's rows first) and the loss weights of ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    n = sum(BATCH.values())
    return torch.randn(n, 3, H, H, generator=g) * 2 + 1, torch.randn(n, C, H, H, generator=g)


def _rows(rank: int) -> slice:
    start = sum(BATCH[r] for r in range(rank))
    return slice(start, start + BATCH[rank])


def _sync_bn_formula(x: torch.Tensor, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nn.SyncBatchNorm's training forward in float64: output, new running mean and var."""
    x = x.double()
    n_r = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64)
    mean_r, var_r = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    parts = [torch.empty(1 + 2 * C, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.cat([n_r, mean_r, var_r]))
    g = torch.stack(parts)
    counts, means, vars_ = g[:, :1], g[:, 1:C + 1], g[:, C + 1:]
    n = counts.sum()
    mean = (counts * means).sum(0) / n
    var = (counts * (vars_ + (means - mean) ** 2)).sum(0) / n
    m = bn.momentum
    rm = (1 - m) * bn.running_mean.double() + m * mean
    rv = (1 - m) * bn.running_var.double() + m * var * n / (n - 1)
    y = (x - mean[:, None, None]) / torch.sqrt(var[:, None, None] + bn.eps)
    y = y * bn.weight.double()[:, None, None] + bn.bias.double()[:, None, None]
    return y, rm, rv


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out: dict = {}
        # --- compiled (fullgraph, aot_eager), 2 steps, vs one process on the whole batch
        net = convert_sync_batchnorm(_net())
        assert isinstance(net[1], FunctionalSyncBatchNorm) and net[1].group is not None
        ref = _net()  # plain BatchNorm, one process, the concatenated batch
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        fwd = torch.compile(net, fullgraph=True, backend="aot_eager")
        for step in range(2):
            x_all, w_all = _data(step)
            x = x_all[_rows(rank)].clone().requires_grad_(True)
            y = fwd(x)
            (y * w_all[_rows(rank)]).sum().backward()
            xr = x_all.clone().requires_grad_(True)
            yr = ref(xr)
            (yr * w_all).sum().backward()
            out[f"y{step}"] = (y.detach() - yr[_rows(rank)].detach()).abs().max().item()
            out[f"dx{step}"] = (x.grad - xr.grad[_rows(rank)]).abs().max().item()
            out[f"yscale{step}"] = yr.abs().max().item()
        # Parameter gradients: the sum over ranks (what DDP's all-reduce averages) equals
        # the one-process gradient of the summed loss.
        # (Relative to the largest gradient: the bias of a conv followed by BatchNorm has a
        # gradient of 0 up to rounding.)
        scale = max(q.grad.abs().max().item() for q in ref.parameters())
        gdiff = 0.0
        for p, q in zip(net.parameters(), ref.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)
            gdiff = max(gdiff, (g - q.grad).abs().max().item() / scale)
        out["dparam_rel"] = gdiff
        out["stats"] = max((a - b).abs().max().item() for a, b in zip(net.buffers(), ref.buffers())
                           if a.is_floating_point())
        out["tracked"] = int(net[1].num_batches_tracked)
        out["breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        out["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        # --- eager, against nn.SyncBatchNorm's formula in float64 (one layer, raw input)
        bn = nn.BatchNorm2d(C, momentum=0.3)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
            bn.running_var.fill_(2.0)
        x = _data(5)[1][_rows(rank)] * 3 + 7
        want_y, want_rm, want_rv = _sync_bn_formula(x, bn)
        sbn = convert_sync_batchnorm(bn)
        y = sbn(x)
        out["formula_y"] = (y.double() - want_y).abs().max().item()
        out["formula_rm"] = (sbn.running_mean.double() - want_rm).abs().max().item()
        out["formula_rv"] = (sbn.running_var.double() - want_rv).abs().max().item()
        # Eval mode: the running statistics, no collective (rank 1 does not call it).
        sbn.eval()
        if rank == 0:
            out["eval"] = (sbn(x) - nn.functional.batch_norm(
                x, sbn.running_mean, sbn.running_var, sbn.weight, sbn.bias, False, 0.0, sbn.eps)).abs().max().item()
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results():
    return spawn_gloo_ranks(_worker)


def test_compiled_sync_bn_equals_batchnorm_over_the_concatenated_batch(two_rank_results):
    for rank, r in two_rank_results.items():
        assert r["breaks"] == 0 and r["graphs"] >= 1, (rank, r)
        for step in range(2):
            assert r[f"y{step}"] < 1e-4 * max(1.0, r[f"yscale{step}"]), (rank, step, r)
            assert r[f"dx{step}"] < 1e-4, (rank, step, r)
        assert r["dparam_rel"] < 1e-4, (rank, r)
        assert r["stats"] < 1e-4, (rank, r)  # running mean and (unbiased) variance, 2 steps
        assert r["tracked"] == 2


def test_sync_bn_equals_torch_sync_batchnorm_formula(two_rank_results):
    for rank, r in two_rank_results.items():
        assert r["formula_y"] < 1e-5 and r["formula_rm"] < 1e-5 and r["formula_rv"] < 1e-4, (rank, r)
    assert two_rank_results[0]["eval"] == 0.0


def test_one_process_is_plain_batchnorm_and_keeps_tensors():
    """Without a process group it is nn.BatchNorm2d (momentum None included); conversion
    keeps the very parameter and buffer tensors, so the optimizer and EMA built before it
    still hold them, and the state dict keys are unchanged."""
    for momentum in (0.1, None):
        ref, net = _net(momentum), _net(momentum)
        before = [t.data_ptr() for t in list(net.parameters()) + list(net.buffers())]
        keys = list(net.state_dict())
        net = convert_sync_batchnorm(net)
        assert isinstance(net[4], FunctionalSyncBatchNorm) and net[4].group is None
        assert [t.data_ptr() for t in list(net.parameters()) + list(net.buffers())] == before
        assert list(net.state_dict()) == keys
        for step in range(3):
            x = _data(step)[0]
            torch.testing.assert_close(net(x), ref(x), rtol=1e-5, atol=1e-4)
        for a, b in zip(net.buffers(), ref.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A 1-rank gloo process group in this process: the functional all-gather is the same
    op (``_c10d_functional.all_gather_into_tensor``) Dynamo traces with any world size."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _family_cases() -> list[str]:
    from test_contract import WITH_RECIPE  # tests/ is on sys.path (rootdir conftest)

    return WITH_RECIPE


@pytest.mark.parametrize("arch", _family_cases())
def test_every_family_traces_with_sync_bn_without_graph_breaks(arch, one_rank_group):
    """Each family's training forward (its first phase), every BatchNorm converted and
    gathering over a process group: one graph, 0 breaks (torch.nn.SyncBatchNorm breaks)."""
    from test_contract import _batch, _model_and_kwargs

    torch._dynamo.reset()
    model, kw = _model_and_kwargs(arch, 0)
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    model = convert_sync_batchnorm(model, group=one_rank_group)
    synced = [m for m in model.modules() if isinstance(m, FunctionalSyncBatchNorm)]
    assert len(synced) == n_bn and all(m.group == one_rank_group for m in synced)
    x, t = _batch()
    explanation = torch._dynamo.explain(model)(x, t, **kw)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    if n_bn:  # the collective is in the graph
        ops = [str(n.target) for g in explanation.graphs for n in g.graph.nodes]
        assert any("all_gather_into_tensor" in o for o in ops), arch
