"""The trainer's extension point: work a caller adds at the loop's named points.

``Trainer(cfg, hooks=[...])``, ``engine.trainer.train(cfg, hooks)`` and
``fastdet.train.main(argv, hooks)`` take :class:`Hook` objects; the loop calls each one's
methods, in the order given, at the points their docstrings name. The tests inject faults
with one (``tests/fault_launch.py``: a signal on one rank after an exact step).
"""

from __future__ import annotations

from typing import Any


class Hook:
    """Extra work at the loop's named points (detectron2's ``HookBase``); each method gets
    the ``engine.trainer.Trainer`` (its ``step``, ``epoch``, ``dist``, ``out`` ...; typed
    ``Any``: this module sits below the trainer, which imports it). Given as
    ``Trainer(cfg, hooks=[...])``, ``train(cfg, hooks)`` or ``fastdet.train.main(argv, hooks)``."""

    def before_train(self, trainer: Any) -> None:
        """After warm-up, before the first step."""

    def after_step(self, trainer: Any) -> None:
        """``trainer.step`` has run and is counted, before the ranks agree on stopping and
        before that step's log line and checkpoint (a signal sent here stops at this step)."""

    def after_epoch(self, trainer: Any) -> None:
        """After an epoch's steps (or the run's last step), its checkpoint and evaluation."""

    def after_train(self, trainer: Any) -> None:
        """After the last scores, checkpoint and log lines."""

