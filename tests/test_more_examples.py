"""The Trainer and longer-context examples run (smoke tests with tiny models)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def test_hf_trainer_runs_small():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    out = _run(
        str(ROOT / "examples" / "hf_trainer.py"),
        "--small",
        "--steps",
        "1",
        "--inner",
        "eager",
        env={"FXREMAT_BUDGET": "64MiB"},
    )
    assert "FXREMAT_BUDGET=64MiB" in out.stdout
    assert "trained 1 steps" in out.stdout
    assert "every plan's predicted peak fits the budget 64.0 MiB" in out.stdout, out.stdout


def test_longer_context_runs_small():
    pytest.importorskip("transformers")
    out = _run(str(ROOT / "examples" / "longer_context.py"), "--small")
    # fxremat's length is not pinned: whether its measured step fits depends on the plan's accuracy.
    assert re.search(r"longest length within 3\.50 MiB: eager 128, fxremat \d+", out.stdout), out.stdout
    assert "fxremat peak" in out.stdout, out.stdout
