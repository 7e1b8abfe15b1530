"""Predicted vs measured peak for the test zoo at three budgets; writes docs/ACCURACY.md.

    .venv/bin/python benchmarks/accuracy.py [--inductor MODEL ...] [--keep-eager]

For every model of tests/zoo.py and three budgets (the fastest plan's peak,
halfway, and the least reachable peak), one compile with fxremat and one
measured training step; under Inductor also benchmarks/compare.py's models at
their full sizes ("bench:gpt2", ..., "bench:resnet18": HF models compiled
whole, timm CNNs with the loss outside the model). "predicted" is the largest
prediction of the plans the measured step ran (``fxremat.running_plans()``;
models with graph breaks compile into several graphs; the step's measured peak
spans them all). The measured step finds the parameters' ``.grad`` allocated
(``zero_grad(set_to_none=False)``), so each gradient is added in as it is
made. Each row runs in a fresh subprocess, with one intra-op thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MODELS = ["mlp", "cnn", "transformer", "dropout", "inplace_views", "gpt2", "llama"]
# Models of benchmarks/compare.py at their full size, named "bench:NAME" (Inductor rows only).
BENCH = "bench:"
BENCH_MODELS = [BENCH + name for name in ("gpt2", "llama", "bert", "mixtral", "resnet18", "convnext")]


def _model(model: str):
    """(the module users compile, what ``explain`` plans, its inputs, the step's loss of a module)."""
    if model.startswith(BENCH):
        # benchmarks/compare.py's workloads at their full sizes: HF models compiled whole with the loss
        # taken from ``.loss`` (explain plans the loss-only module, as that compile ends up planned),
        # timm CNNs with the loss computed outside the compiled model.
        import importlib.util

        spec = importlib.util.spec_from_file_location("fxremat_benchmarks_compare", ROOT / "benchmarks" / "compare.py")
        assert spec is not None and spec.loader is not None
        compare = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = compare
        spec.loader.exec_module(compare)
        work = compare.MODELS[model[len(BENCH) :]](False)
        return work.model, work.loss_only, work.inputs, work.loss
    from zoo import ZOO

    base, inputs = ZOO[model]()
    return base, base, inputs, lambda m: m(*inputs)


def row(model: str, inner: str, which: str) -> dict:
    import copy
    import warnings

    import torch

    import fxremat

    torch.set_num_threads(1)
    base, planned, inputs, loss = _model(model)
    fastest = fxremat.explain(planned, *inputs, inner=inner, time_slack=0).predicted_peak
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        least = fxremat.explain(planned, *inputs, inner=inner, budget=1, on_infeasible="min").predicted_peak
    budget = {"fastest": fastest, "half": (fastest + least) // 2, "least": least}[which]
    torch._dynamo.reset()
    fxremat.clear_plans()
    model_c = copy.deepcopy(base)
    compiled = torch.compile(model_c, backend=fxremat.backend(budget=budget, inner=inner))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss(compiled).backward()
        model_c.zero_grad(set_to_none=False)
        m = fxremat.measure(lambda: loss(compiled).backward(), reps=1, warmup=1)
    # The plans the measured step ran, predicted for it (the parameters' .grad exist: see README).
    plans = fxremat.running_plans()
    predicted = max(p.predicted_peak for p in plans)
    return {
        "model": model,
        "inner": inner,
        "budget_kind": which,
        "budget": budget,
        "predicted": predicted,
        "measured": m.peak_bytes,
        "graphs": len(plans),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", nargs=3, metavar=("MODEL", "INNER", "WHICH"))
    parser.add_argument("--inductor", nargs="*", default=["mlp", "transformer", "cnn", "llama", *BENCH_MODELS])
    parser.add_argument(
        "--keep-eager",
        action="store_true",
        help="reuse the eager rows of the current docs/ACCURACY.md; run only the Inductor rows",
    )
    args = parser.parse_args()
    if args.row:
        print(json.dumps(row(*args.row)))
        return
    rows = []
    jobs = [] if args.keep_eager else [(m, "eager", w) for m in MODELS for w in ("fastest", "half", "least")]
    if args.keep_eager:
        rows = _eager_rows(ROOT / "docs" / "ACCURACY.md")
    jobs += [(m, "inductor", w) for m in args.inductor for w in ("fastest", "half", "least")]
    started = time.time()
    for model, inner, which in jobs:
        out = subprocess.run([sys.executable, __file__, "--row", model, inner, which], capture_output=True, text=True)
        if out.returncode != 0:
            rows.append(
                {"model": model, "inner": inner, "budget_kind": which, "error": out.stderr.strip().splitlines()[-1]}
            )
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    write(rows, time.time() - started)


def _eager_rows(path: Path) -> list[dict]:
    """The eager rows of a table this script wrote."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) in (8, 9) and cells[1] == "eager" and cells[3].isdigit():
            rows.append(
                {
                    "model": cells[0],
                    "inner": "eager",
                    "budget_kind": cells[2],
                    "budget": int(cells[3]),
                    "predicted": int(cells[4]),
                    "measured": int(cells[5]),
                    "graphs": int(cells[-1]),
                }
            )
    return rows


def write(rows: list[dict], seconds: float) -> None:
    import torch

    lines = [
        "# Predicted vs measured peak memory",
        "",
        "Regenerate with `.venv/bin/python benchmarks/accuracy.py` "
        f"({seconds / 60:.0f} min on {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores, torch {torch.__version__}).",
        "",
        "Peak of one training step above the pre-step baseline, CPU profiler (`fxremat.measure`), against the",
        "plan's prediction (eager: liveness of the planned fx programs; Inductor: replay of the program it generates).",
        "Budgets: the fastest plan's peak, halfway, and the least reachable peak. Targets: |error| <= 5%",
        "and measured <= budget on every row (measured/budget > 1 is marked **over**).",
        "",
        "| model | inner | budget | budget bytes | predicted | measured | error | measured/budget | graphs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    within = total = over = 0
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['inner']} | {r['budget_kind']} | | | | failed: {r['error'][:80]} | |")
            continue
        err = (r["predicted"] - r["measured"]) / r["measured"]
        used = r["measured"] / r["budget"]
        total += 1
        within += abs(err) <= 0.05
        over += used > 1
        lines.append(
            f"| {r['model']} | {r['inner']} | {r['budget_kind']} | {r['budget']} | {r['predicted']} | "
            f"{r['measured']} | {err:+.1%} | {used:.3f}{' **over**' if used > 1 else ''} | {r['graphs']} |"
        )
    lines += ["", f"{within} of {total} rows within 5%; {over} rows over their budget.", ""]
    (ROOT / "docs" / "ACCURACY.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
