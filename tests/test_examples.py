"""The examples run (smoke test with a tiny model and few steps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_small():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--inner", "eager", "--steps", "1", "--small"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("fxremat budget")]
    assert len(lines) == 3, out.stdout
    assert "memory anatomy" in out.stdout
