"""bench/gpu_check.sh on a machine like the bare GPU one: without pycocotools the parts
that need it are skipped with the reason (not failed), a part the budget no longer fits
is skipped and says so, and the record says which parts ran; under the device tool
(``$OUT`` set) everything is packed into ``$OUT`` (at most 8 files come back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_missing_pycocotools_and_spent_budget_are_recorded_skips(tmp_path):
    blocker = tmp_path / "block"
    (blocker / "pycocotools").mkdir(parents=True)
    (blocker / "pycocotools" / "__init__.py").write_text("raise ImportError('pycocotools is blocked in this test')\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_BUDGET_S": "1",
           "GPU_CHECK_PARTS": "build,smoke,smoke_ddp", "OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp_path)}
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu_check.tgz", "summary.txt"]
    record = json.loads((out / "gpu-check.json").read_text())
    parts = {p["part"]: p for p in record["parts"]}
    assert set(parts) == {"build", "smoke", "smoke_ddp"} and record["not_reached"] == []
    assert not any(p["ran"] for p in parts.values())
    assert "budget" in parts["build"]["why"]
    for name in ("smoke", "smoke_ddp"):
        assert parts[name]["status"] == "skipped" and "pycocotools is not installed" in parts[name]["why"]
    with tarfile.open(out / "gpu_check.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("_gpu-check.json") for n in names) and any(n.endswith("summary.txt") for n in names)
