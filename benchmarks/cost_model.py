"""The cost model's time estimate for a transformer block vs its measured time; writes docs/COST_MODEL.md.

    .venv/bin/python benchmarks/cost_model.py

Estimated: the sum of the roofline seconds of the joint graph's forward nodes
under the ``cpu`` profile (measured on this host by passes/host.py). Measured:
the median wall time of the eager forward of the same block.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fxremat  # noqa: E402
from fxremat.passes.cost import get_hardware  # noqa: E402
from fxremat.solvers.types import FORWARD  # noqa: E402
from zoo import Block  # noqa: E402


def main() -> None:
    rows = []
    for dim, tokens, batch in ((256, 256, 4), (512, 512, 4), (1024, 256, 2)):
        torch.manual_seed(0)
        block = Block(dim, heads=8)
        x = torch.randn(batch, tokens, dim)
        plan = fxremat.explain(lambda x: block(x).square().mean(), x, inner="eager", solver="save_all")
        p = plan.problem
        estimated = sum(p.seconds[i] for i in range(p.size) if p.phase[i] == FORWARD)
        flops = sum(p.flops[i] for i in range(p.size) if p.phase[i] == FORWARD)
        with torch.no_grad():
            for _ in range(3):
                block(x)
            times = []
            for _ in range(9):
                t = time.perf_counter()
                block(x)
                times.append(time.perf_counter() - t)
        measured = statistics.median(times)
        rows.append((dim, tokens, batch, flops, estimated, measured))
        print(rows[-1], flush=True)
    hw = get_hardware("cpu")
    lines = [
        "# Cost model: estimated vs measured time",
        "",
        "Regenerate with `.venv/bin/python benchmarks/cost_model.py`. The `cpu` profile measured on this host: "
        f"{hw.peak_flops / 1e9:.1f} GFLOP/s, {hw.bandwidth / 1e9:.1f} GB/s, {hw.launch_seconds * 1e6:.1f} us per op.",
        "Forward of one pre-norm transformer block (tests/zoo.py `Block`, SDPA attention), fp32.",
        "Target: estimate within a factor of 2 of the measured time.",
        "",
        "| hidden | tokens | batch | forward GFLOP | estimated ms | measured ms | measured / estimated |",
        "|---|---|---|---|---|---|---|",
    ]
    for dim, tokens, batch, flops, est, meas in rows:
        lines.append(f"| {dim} | {tokens} | {batch} | {flops / 1e9:.2f} | {est * 1e3:.2f} | {meas * 1e3:.2f} | {meas / est:.2f} |")
    lines.append("")
    (ROOT / "docs" / "COST_MODEL.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
