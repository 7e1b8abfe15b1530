"""Solver time and ILP gap on real joint graphs of 2..32 transformer layers; writes docs/SOLVER_SCALING.md.

    .venv/bin/python benchmarks/solver_scaling.py [--layers 2 4 8 16 32]

The joint graph of an HF GPT-2 (hidden 256, 4 heads, 256 tokens, batch 4,
fp32) is captured once per size with ``fxremat.explain`` on fake weights
(nothing runs), then each solver is timed on the plain problem at three
budgets between the fastest plan's peak and the least reachable peak.
Compile time is Dynamo + AOTAutograd + planning of that explain call.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import warnings
from pathlib import Path

import torch

import fxremat
from fxremat._torch_compat import FakeTensorMode
from fxremat.solvers import SolveOptions, SolveTimeout, solve
from fxremat.solvers.ilp import solve_ilp

ROOT = Path(__file__).resolve().parents[1]
# Every run plans afresh: the plan cache (fxremat/plan_cache.py) would hide planning time and planner changes.
os.environ.setdefault("FXREMAT_PLAN_CACHE", "0")


class LMLoss(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits.float().square().mean()


def capture(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers,
        n_embd=256,
        n_head=4,
        vocab_size=2048,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "sdpa"
    with FakeTensorMode():
        model = LMLoss(GPT2LMHeadModel(cfg))
        ids = torch.zeros(4, 256, dtype=torch.long)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = fxremat.explain(model, ids, inner="eager", solver="save_all")
    return plan, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="*", default=[2, 4, 8, 12, 16, 32])
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    options = SolveOptions(time_limit=args.time_limit)
    lines = [
        "# Solver scaling",
        "",
        f"Regenerate with `.venv/bin/python benchmarks/solver_scaling.py` on {os.cpu_count()} cores "
        f"({platform.machine()}), torch {torch.__version__}. GPT-2 (hidden 256, 256 tokens, batch 4, fp32) joint graphs;",
        "each solver timed at three budgets between the fastest plan's peak and the least reachable peak",
        f"(safety-net time limit {args.time_limit:g} s; the solvers stop on work limits). Target: at most 1 s for 12 layers and at most 10% of the compile time.",
        "",
        "| layers | joint nodes | capture s | budget | mincut s | mincut est. ms | ilp s | ilp est. ms | ilp gap "
        "| tied ilp s | tied est. ms | tied gap | auto s | auto est. ms | auto solver |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layers in args.layers:
        plan, capture_s = capture(layers)
        problem = plan.problem
        hi = solve(problem, None, "save_all", options).peak_bytes
        lo = solve(problem, 1, "mincut", options).peak_bytes
        for frac in (0.75, 0.5, 0.25):
            budget = int(lo + (hi - lo) * frac)
            row = [str(layers), str(problem.size), f"{capture_s:.1f}", f"{frac:.2f} of range"]
            for name in ("mincut", "ilp", "tied ilp", "auto"):
                t = time.perf_counter()
                try:
                    if name == "tied ilp":  # identical layers solved once (solvers/layers.py)
                        d = solve_ilp(problem, budget, options, tie_layers=True)
                    else:
                        d = solve(problem, budget, name, options)
                except SolveTimeout:
                    row += [f"> {args.time_limit:g}", "safety net"] + (["n/a"] if "ilp" in name else [])
                    row += ["n/a"] if name == "auto" else []
                    continue
                secs = time.perf_counter() - t
                row += [f"{secs:.2f}", f"{d.recompute_seconds * 1e3:.3f}" if d.feasible else "infeasible"]
                if name in ("ilp", "tied ilp"):
                    row.append("n/a" if d.gap is None else f"{d.gap:.1%}")
                if name == "auto":
                    row.append(d.solver)
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    lines.append("")
    (ROOT / "docs" / "SOLVER_SCALING.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
