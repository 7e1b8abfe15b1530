"""The GPT-2 budget and vision examples train and pass their own checks (smoke tests).

Each example runs in a subprocess with a tiny model, one timed step and the
eager inner compiler (Inductor would spend most of a minute compiling). The
assertions read the lines the examples print: the measured peak within the
budget, the first step's loss and gradients equal to eager's, the saved plan.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# "fxremat's measured peak 1.63 MiB (1705480 B) is within the budget 1.64 MiB (1715640 B)"
FITS = re.compile(r"fxremat's measured peak \S+ \S+ \((\d+) B\) is within the budget \S+ \S+ \((\d+) B\)")


def _run(script: str, *args: str, cwd: Path) -> str:
    """Run an example with the smoke-test flags; its stdout (the run must exit with status 0)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--small", "--steps", "1", "--inner", "eager", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        # One thread: `make test` runs two workers on two cores, and oversubscribed threads crawl.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out.stdout


def _peak(stdout: str, label: str) -> int:
    """Measured peak in bytes of the result row of ``label`` (``label  loss 6.9404  peak   3.32 MiB ...``)."""
    rows = [line for line in stdout.splitlines() if re.match(rf"{re.escape(label)} +loss ", line)]
    assert len(rows) == 1, f"no single '{label}' row:\n{stdout}"
    number, unit = re.search(r"peak +([\d.]+) (B|KiB|MiB|GiB)", rows[0]).groups()
    return int(float(number) * UNITS[unit])


def test_gpt2_budget_runs_small(tmp_path):
    pytest.importorskip("transformers")
    plan_dir = tmp_path / "plan"
    out = _run("gpt2_budget.py", "--out", str(plan_dir), cwd=tmp_path)

    eager, ckpt, fx = (_peak(out, row) for row in ("eager", "eager + per-layer checkpointing", "fxremat (eager)"))
    assert "first-step loss and gradients, checkpointing: match eager's" in out, out
    assert "first-step loss and gradients, fxremat: match eager's" in out, out
    fits = FITS.search(out)
    assert fits, out
    measured, budget = map(int, fits.groups())
    assert 0 < measured <= budget
    # The default budget lies between eager's peak and fxremat's least: remat saved memory.
    assert abs(fx - measured) <= 0.01 * measured  # the row shows the same measurement, rounded
    assert measured < eager and ckpt < eager
    assert "all checks passed" in out, out

    assert f"saved to {plan_dir.resolve()}" in out, out
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert plan["schema"] == "fxremat.plan/1"
    assert plan["budget"] == budget and plan["predicted_peak"] <= budget
    assert re.match(r"graph \d+: budget", (plan_dir / "plan.txt").read_text())
    assert (plan_dir / "backward.py").stat().st_size > 0


def test_vision_runs_small(tmp_path):
    pytest.importorskip("transformers")
    out = _run("vision.py", cwd=tmp_path)

    eager = _peak(out, "eager")
    assert _peak(out, "fxremat (eager)") < eager
    losses = re.search(r"first-step loss: fxremat (\d+\.\d+), eager (\d+\.\d+): match$", out, re.M)
    assert losses, out
    assert float(losses[1]) == pytest.approx(float(losses[2]), rel=1e-4)
    assert "first-step gradients: match eager's" in out, out
    fits = FITS.search(out)
    assert fits, out
    measured, budget = map(int, fits.groups())
    assert 0 < measured <= budget
    assert measured < eager
    assert "all checks passed" in out, out
