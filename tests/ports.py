"""A free TCP port for a test's process group or torchrun rendezvous.

``make test`` runs test files in parallel (pytest-xdist), so two torchrun tests must not
share a fixed ``--master_port``: the second would fail with "address already in use"
or, worse, join the first one's rendezvous. The port is free when asked for; the window
before torchrun binds it is short, and the OS hands out ephemeral ports in turn.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
