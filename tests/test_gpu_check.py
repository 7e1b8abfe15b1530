"""benchmarks/gpu_check.py without a GPU and without compiling anything (well under a second).

The rows themselves need CUDA (or the GPU_CHECK_ALLOW_CPU=1 smoke test, minutes); here: the flags
parse, the wrapper reaches the module, the deadline skips rows without starting them, and the
markdown table is printed from the recorded rows, failed ones included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from checks import ROOT, load_benchmark

gpu_check = load_benchmark("gpu_check")

MIB = 2**20


def test_the_wrapper_reaches_the_module_and_the_knobs_parse():
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in ("--total-s", "--row-timeout", "--reps", "--layers", "--vocab", "--table"):
        assert flag in out


def test_flags_override_the_environment(monkeypatch):
    for name in ("REPS", "TOTAL_S", "WORK"):  # main() writes them: restored after the test
        monkeypatch.setenv(name, "5")
    monkeypatch.setattr(gpu_check, "table", lambda work=None: None)
    assert gpu_check.main(["--reps", "2", "--total-s", "12.5", "--table"]) == 0
    assert os.environ["REPS"] == "2" and os.environ["TOTAL_S"] == "12.5"


def test_past_the_deadline_every_row_is_skipped_and_still_tabled(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORK", str(tmp_path))
    monkeypatch.setenv("TOTAL_S", "0")
    monkeypatch.setattr(gpu_check.Driver, "subprocess_row", None)  # would fail if a row were started
    gpu_check.drive()
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == [
        "eager",
        "checkpoint",
        "inductor",
        "fxremat, no budget",
        "fxremat, least",
        "inductor_budget_0.5",
        "inductor_budget_0.0",
    ]
    assert all(r["error"].startswith("skipped") for r in rows)
    gpu_check.table(str(tmp_path))
    out = capsys.readouterr().out
    assert "### fxremat GPU check: ?" in out
    assert "| inductor_budget_0.0 |  | skipped: overall deadline (TOTAL_S) reached | | | | | | | |" in out


def _ok(label, strategy, peak_mib, step_ms, budget=None, **extra):
    return {
        "label": label,
        "strategy": strategy,
        "budget": budget,
        "description": "tiny",
        "device": "cpu (smoke test)",
        "peak_bytes": int(peak_mib * MIB),
        "step_s": step_ms / 1e3,
        "min_step_s": step_ms / 1e3,
        "compile_s": 1.0,
        "loss": 5.0,
        "grad_norm": 2.0,
        **extra,
    }


def test_the_table_compares_and_flags(tmp_path, monkeypatch, capsys):
    rows = [
        _ok("eager", "eager", 100, 10),
        _ok("inductor", "inductor", 80, 5),
        _ok("fxremat, least", "fxremat", 30, 8, budget=1, predicted_peak=30 * MIB, solve_s=0.5),
        _ok("fxremat 40.0 MiB", "fxremat", 50, 6, budget=40 * MIB, predicted_peak=40 * MIB, solve_s=0.5),
        {**_ok("fxremat, no budget", "fxremat", 90, 4), "loss": 6.0},
        {"label": "checkpoint", "strategy": "checkpoint", "budget": None, "error": "failed (rc 1): a | b"},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("REPS", "3")
    gpu_check.table(str(tmp_path))
    out = capsys.readouterr().out
    assert "tiny; 3 timed steps" in out
    assert "| fxremat, least |  | 30.0 | 8.0 | 8.0 | 1.0 | 0.50 | 30.0 | none at <= this peak | ok |" in out
    assert "| fxremat 40.0 MiB | 40.0 | 50.0 |" in out and "**OVER BUDGET**" in out
    assert "0.80x vs inductor | DIFFERS (loss 6.0000" in out
    assert "| checkpoint |  | failed (rc 1): a / b | | | | | | | |" in out
    assert "(d) least peak: fxremat 30 MiB vs inductor 80 MiB = 0.38x" in out
    assert "(c) at half of Inductor's peak (40 MiB): fxremat, least 8.0 ms vs Inductor 5.0 ms = 1.60x" in out
    assert "(b) vs eager (100 MiB, 10.0 ms): fxremat, no budget 0.40x time at 90 MiB" in out
