"""Estimated recompute time of fxremat's plans vs per-layer checkpointing, at budgets from its peak up.

    .venv/bin/python benchmarks/recompute_curve.py        # GPT-2 and Llama, writes docs/RECOMPUTE_CURVE.md

For each model (the benchmark workloads of ``benchmarks/compare.py``), the
budgets run from per-layer checkpointing's measured peak (docs/BENCHMARKS.md)
up to fxremat's fastest plan's predicted peak. At each budget fxremat plans
the step (``fxremat.explain``, Inductor memory model) and reports its
estimated recompute time; per-layer checkpointing's estimate is the
``per_layer`` policy (keep each block's inputs, recompute the rest) on the
same problem and cost model. The issue's target: fxremat's estimate is never
above per-layer checkpointing's at these budgets. Estimates, not
measurements: the measured step times are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# Per-layer checkpointing's measured peak in docs/BENCHMARKS.md (HF gradient_checkpointing_enable).
CHECKPOINT_PEAK_MIB = {"gpt2": 102.0, "llama": 103.2}
POINTS = 6


def curve(name: str) -> list[dict]:
    import torch

    import compare
    import fxremat
    from fxremat.solvers import solve

    torch.manual_seed(0)
    workload = compare.MODELS[name](False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fastest = fxremat.explain(workload.loss_only, *workload.inputs, release_outputs=True, time_slack=0)
    per_layer = solve(fastest.problem, None, "per_layer")
    low = int(CHECKPOINT_PEAK_MIB[name] * 2**20)
    high = max(low, fastest.predicted_peak)
    rows = []
    for i in range(POINTS):
        budget = low + (high - low) * i // (POINTS - 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = fxremat.explain(workload.loss_only, *workload.inputs, budget=budget, release_outputs=True)
        rows.append(
            {
                "budget": budget,
                "predicted": plan.predicted_peak,
                "fx_s": plan.recompute_seconds,
                "per_layer_s": per_layer.recompute_seconds,
                "solver": plan.solver,
            }
        )
        print(name, rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CHECKPOINT_PEAK_MIB))
    args = parser.parse_args()
    started = time.time()
    results = {name: curve(name) for name in args.models}
    mib = 2**20
    lines = [
        "# Estimated recompute time vs per-layer checkpointing",
        "",
        f"Regenerate with `.venv/bin/python benchmarks/recompute_curve.py` ({(time.time() - started) / 60:.0f} min on "
        f"{platform.machine()}, cpu cost profile). See the script's docstring for what is compared.",
        "",
    ]
    for name, rows in results.items():
        ok = all(r["fx_s"] <= r["per_layer_s"] + 1e-12 for r in rows)
        lines += [
            f"## {name}",
            "",
            "| budget MiB | fxremat predicted MiB | fxremat recompute ms (est.) | "
            "per-layer recompute ms (est.) | ratio | solver |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            ratio = r["fx_s"] / r["per_layer_s"] if r["per_layer_s"] else float("nan")
            lines.append(
                f"| {r['budget'] / mib:.1f} | {r['predicted'] / mib:.1f} | {r['fx_s'] * 1e3:.1f} | "
                f"{r['per_layer_s'] * 1e3:.1f} | {ratio:.2f} | {r['solver']} |"
            )
        lines += [
            "",
            f"fxremat's estimate at or below per-layer checkpointing's at every budget: **{'PASS' if ok else 'MISS'}**",
            "",
        ]
    (ROOT / "docs" / "RECOMPUTE_CURVE.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
