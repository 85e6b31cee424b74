"""Every family's losses over 20 demo steps equal the record taken before issue 40's move
(tools/record_step_losses.py; tests/fixtures/step_losses_20.json).

Slow (~90 s on 2 cores): `make test-all` runs it. Bit for bit on the machine that
recorded; elsewhere oneDNN may pick other kernels, hence the small tolerance here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import record_step_losses  # noqa: E402


def test_compare_flags_a_changed_loss():
    want = {"a-s": [{"step": 1, "lr": 0.1, "total_loss": 2.0}]}
    assert record_step_losses.compare(want, want, 0.0)[0]
    changed = {"a-s": [{"step": 1, "lr": 0.1, "total_loss": 2.0 + 1e-12}]}
    assert not record_step_losses.compare(want, changed, 0.0)[0]
    assert not record_step_losses.compare(want, {"a-s": []}, 0.0)[0]


@pytest.mark.slow
def test_twenty_steps_of_every_family_match_the_record():
    fixture = ROOT / "tests" / "fixtures" / "step_losses_20.json"
    want = json.loads(fixture.read_text())
    assert want["settings"] == record_step_losses.SETTINGS
    got = record_step_losses.record(threads=1, jobs=2)
    ok, lines = record_step_losses.compare(want["losses"], got, rtol=1e-5)
    assert ok, "\n".join(lines)
