"""``python -m fastdet.train`` with a fault injected at an exact step: what the fault tests
launch under torchrun in place of ``-m fastdet.train`` (the same arguments).

``FASTDET_FAULT="RANK:STEP[:SIGNAL]"``: rank RANK sends itself SIGNAL (``KILL``, what a
crashed node looks like; ``TERM``, a preemption; ``INT``) once it has run step STEP, in
the first attempt only (a torchrun restart or a resumed run goes on). The trainer calls
the hook after the step is counted, before the ranks agree on stopping (engine/hooks.py).
"""

from __future__ import annotations

import os
import signal
import sys

from fastdet.engine.faults import restart_count
from fastdet.engine.hooks import Hook
from fastdet.train import main


class InjectFault(Hook):
    def __init__(self, spec: str):
        parts = spec.split(":")
        self.rank, self.step = int(parts[0]), int(parts[1])
        self.signum = getattr(signal, "SIG" + (parts[2] if len(parts) > 2 else "KILL"))
        self.sent = False

    def after_step(self, trainer) -> None:
        if not self.sent and trainer.dist.rank == self.rank and trainer.step == self.step:
            self.sent = True  # once per process
            os.kill(os.getpid(), self.signum)


def hooks_from_env() -> list[Hook]:
    spec = os.environ.get("FASTDET_FAULT")
    return [InjectFault(spec)] if spec and restart_count() == 0 else []


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], hooks=hooks_from_env()))
