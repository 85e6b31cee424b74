"""A free TCP port for a test's process group or torchrun rendezvous, and ranks spawned on one.

``make test`` runs test files in parallel (pytest-xdist), so two torchrun tests must not
share a fixed ``--master_port``: the second would fail with "address already in use"
or, worse, join the first one's rendezvous. The port is free when asked for; the window
before torchrun binds it is short, and the OS hands out ephemeral ports in turn.
"""

from __future__ import annotations

import socket
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gloo_ranks(worker: Callable, world_size: int = 2) -> dict:
    """``worker(rank, world_size, port, results)`` in ``world_size`` spawned processes that
    meet on a free port (each sets up its gloo group there and writes ``results[rank]``);
    returns ``{rank: result}``. Skips where torch.distributed has no gloo."""
    import pytest
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(world_size, free_port(), results), nprocs=world_size, start_method="spawn")
        return dict(results)
