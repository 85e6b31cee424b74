"""A command's ``main()`` run in the test's process, as its ``python -m`` process would run it
(a process start costs seconds on the 2-core CI machine)."""

from __future__ import annotations

import importlib
import logging
import warnings


def main_in_process(argv: list[str], capsys, caplog, command: str = "fastdet.train") -> tuple[int, str, str]:
    """``python -m COMMAND *argv`` as its main() in this process, for commands that fail
    or stop before much work (a process start costs seconds): (exit code, stdout, stderr).
    An exception main() lets out fails the test itself (where the process would print a
    traceback), and what that process would also print on stderr goes there too: warnings,
    as Python shows them by default, and log records of WARNING and above (logging's last
    resort)."""
    module = importlib.import_module(command)
    main = module.main if hasattr(module, "main") else importlib.import_module(command + ".__main__").main

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=quiet)
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    out, err = capsys.readouterr()
    err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    err += "".join(f"{r.getMessage()}\n" for r in caplog.records if r.levelno >= logging.WARNING)
    caplog.clear()  # the next call's records only
    return code, out, err
