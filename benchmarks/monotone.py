"""Measured peak at five budgets from the fastest plan's peak down to the least reachable; writes docs/MONOTONE.md.

    .venv/bin/python benchmarks/monotone.py            # GPT-2 and Llama (benchmark size), about 10 min

Issue 4's check: on HF GPT-2 and Llama, the measured step peak at each budget
is under the budget and does not grow as the budget shrinks. The budgets are
fxremat's fastest predicted peak, its least reachable predicted peak
(``fxremat.explain``), and three evenly between. Each row is one
``benchmarks/compare.py --row`` process (fresh allocator, Inductor inner,
one timed step: only memory is compared here).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
MODELS = ("gpt2", "llama")
POINTS = 5


def budgets(name: str) -> list[int]:
    import torch

    import compare
    import fxremat

    torch.manual_seed(0)
    workload = compare.MODELS[name](False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fastest = fxremat.explain(
            workload.loss_only, *workload.inputs, release_outputs=True, time_slack=0
        ).predicted_peak
        least = fxremat.explain(
            workload.loss_only, *workload.inputs, budget=1, on_infeasible="min", release_outputs=True
        ).predicted_peak
    return [fastest - (fastest - least) * i // (POINTS - 1) for i in range(POINTS)]


def measure(name: str, budget: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "compare.py"),
            "--row",
            name,
            "fxremat",
            "--budget",
            str(budget),
            "--reps",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    for line in out.stdout.splitlines():
        if line.startswith("FXREMAT_BENCH_ROW "):
            return json.loads(line.split(" ", 1)[1])
    return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}


def main() -> None:
    started = time.time()
    mib = 2**20
    lines = ["# Measured peak across budgets (issue 4: under budget, non-increasing)", ""]
    body: list[str] = []
    for name in MODELS:
        rows = [(b, measure(name, b)) for b in budgets(name)]
        for b, r in rows:
            print(name, b, {k: r.get(k) for k in ("peak_bytes", "predicted_peak", "error")}, flush=True)
        peaks = [r.get("peak_bytes") for _, r in rows]
        ok = all(p is not None and p <= b for p, (b, _) in zip(peaks, rows)) and all(
            a >= c for a, c in zip(peaks, peaks[1:]) if a is not None and c is not None
        )
        body += [
            f"## {name}",
            "",
            "| budget MiB | predicted MiB | measured MiB | measured / budget |",
            "|---|---|---|---|",
        ]
        for b, r in rows:
            if "error" in r:
                body.append(f"| {b / mib:.1f} | | failed: {r['error'][:80]} | |")
            else:
                body.append(
                    f"| {b / mib:.1f} | {r['predicted_peak'] / mib:.1f} | {r['peak_bytes'] / mib:.1f} | "
                    f"{r['peak_bytes'] / b:.2f} |"
                )
        body += ["", f"Under every budget and non-increasing: **{'PASS' if ok else 'MISS'}**", ""]
    lines += [
        f"Regenerate with `.venv/bin/python benchmarks/monotone.py` ({(time.time() - started) / 60:.0f} min on "
        f"{platform.machine()}). Budgets: fxremat's fastest and least predicted peaks and three evenly "
        "between; one fresh process per row.",
        "",
    ] + body
    (ROOT / "docs" / "MONOTONE.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
