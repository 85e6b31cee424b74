"""What the command-line tools write never replaces a file unasked.

``fastdet.predict``, ``fastdet.export`` and ``fastdet.convert`` write to paths the user
names. A path that already holds a file (an earlier export, a user's own image with a
drawn copy's name) is refused in one line before any work, naming the file and the flag
that replaces it (``--exist-ok`` for a folder, ``--overwrite`` for a file). The trainer
has its own rule for run directories (``fastdet.engine.rundir``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def refuse_replacing(targets: Iterable[Path], what: str, flag: str) -> None:
    """``ValueError`` (one line) if any of ``targets`` exists: ``what`` names the option that
    chose them (``--output m.onnx``), ``flag`` the option that allows replacing them."""
    taken = [t for t in targets if t.exists() or t.is_symlink()]
    if not taken:
        return
    if len(taken) == 1:
        raise ValueError(f"{what}: {taken[0]} exists; add {flag} to replace it, or choose another path")
    listed = ", ".join(str(t) for t in taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
    raise ValueError(f"{what}: would replace {len(taken)} existing files ({listed}); "
                     f"add {flag} to replace them, or choose another path")
