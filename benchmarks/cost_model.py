"""The cost model's forward-time estimate vs measured time; writes docs/COST_MODEL.md.

    .venv/bin/python benchmarks/cost_model.py

For transformer blocks (tests/zoo.py ``Block``) and every model of the test zoo:

- estimated: the sum of the seconds of the joint graph's forward nodes (all
  graphs, when a model has graph breaks), under the ``cpu`` profile, measured
  afresh at the start of each configuration (fxremat/hardware.py);
- calibrated: the same sum with each op timed on this host (passes/calibrate.py);
- measured: the median wall time of the model's eager forward (``no_grad``),
  and of the fxremat-compiled forward (``inner="eager"``, the graph the
  estimate describes, with Dynamo's guards and AOTAutograd's wrappers).

Each thread configuration runs in its own subprocess, all in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "1 thread": ({"threads": "1"}, {}),
    "2 threads": ({"threads": "2"}, {}),
    "2 threads, OMP_WAIT_POLICY=passive": ({"threads": "2"}, {"OMP_WAIT_POLICY": "passive"}),
}
BLOCKS = ((64, 32, 4), (256, 256, 4), (512, 512, 4), (1024, 256, 2))
ZOO_MODELS = ("mlp", "cnn", "transformer", "dropout", "inplace_views", "gpt2", "llama")
# Median of up to this many reps, fewer for slow forwards (about 3 s per measurement).
REPS = 15
MEASURE_SECONDS = 3.0


def _median_seconds(fn) -> float:
    for _ in range(2):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < REPS and (len(times) < 3 or time.perf_counter() - start < MEASURE_SECONDS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _forward_nodes(joint) -> list:
    """Nodes of a joint graph that do not depend on a tangent (the forward)."""
    backward: set = set()
    out = []
    for node in joint.graph.nodes:
        if (node.op == "placeholder" and "tangents" in str(node.target)) or any(
            a in backward for a in node.all_input_nodes
        ):
            backward.add(node)
        elif node.op == "call_function":
            out.append(node)
    return out


def _cases():
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import ZOO, Block

    for dim, tokens, batch in BLOCKS:
        torch.manual_seed(0)
        block = Block(dim, heads=8)
        yield (
            f"Block {dim}, {batch}x{tokens} tokens",
            block,
            (torch.randn(batch, tokens, dim),),
            (lambda b: lambda x: b(x).square().mean())(block),
        )
    for name in ZOO_MODELS:
        model, inputs = ZOO[name]()
        yield f"zoo {name}", model, inputs, model


def run_config(threads: int) -> list[dict]:
    """Every case under the current process's thread settings."""
    import warnings

    import torch

    torch.set_num_threads(threads)
    import fxremat
    from fxremat import planner
    from fxremat.passes.calibrate import calibrate_costs
    from fxremat.hardware import get_hardware

    hw = get_hardware("cpu")  # measured now: FXREMAT_CACHE_DIR is a fresh folder
    rows = []
    for name, model, inputs, fn in _cases():
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with planner.watch() as planned:  # see each joint graph the planner costs
                fxremat.explain(fn, *inputs, inner="eager", solver="save_all")
        joints = [(analysis.joint, analysis.costs) for analysis, _, _ in planned]
        graphs = len(joints)
        estimated = calibrated = flops = 0.0
        timed = total = 0
        for joint, costs in joints:
            cal = calibrate_costs(joint, costs)
            for node in _forward_nodes(joint):
                estimated += costs[node].seconds
                calibrated += cal[node].seconds
                flops += costs[node].flops
                total += 1
                timed += cal[node].timed
        with torch.no_grad():
            eager = _median_seconds(lambda: fn(*inputs))
        torch._dynamo.reset()
        compiled_fn = torch.compile(fn, backend=fxremat.backend(inner="eager", solver="save_all"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = _median_seconds(lambda: compiled_fn(*inputs))
        rows.append(
            {
                "case": name,
                "graphs": graphs,
                "gflop": flops / 1e9,
                "estimated": estimated,
                "calibrated": calibrated,
                "timed": timed,
                "nodes": total,
                "eager": eager,
                "compiled": compiled,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return [{"profile": {k: v for k, v in vars(hw).items() if k != "name"}, "load": os.getloadavg()[0]}] + rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=int, help="(internal) run every case with this many threads")
    args = parser.parse_args()
    if args.config:
        print(json.dumps(run_config(args.config)))
        return
    results = {}
    started = time.time()
    for label, (conf, env) in CONFIGS.items():
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run(
                [sys.executable, __file__, "--config", conf["threads"]],
                capture_output=True,
                text=True,
                env={**os.environ, **env, "FXREMAT_CACHE_DIR": cache},
            )
        if out.returncode != 0:
            raise SystemExit(f"{label} failed:\n{out.stderr[-3000:]}")
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
        print(label, "done", flush=True)
    write(results, time.time() - started)


def write(results: dict, seconds: float) -> None:
    lines = [
        "# Cost model: estimated vs measured forward time",
        "",
        f"Regenerate with `.venv/bin/python benchmarks/cost_model.py` ({seconds / 60:.0f} min; all rows from one run).",
        "Estimated: the sum of the roofline seconds of the joint graph's forward nodes under the `cpu` profile,",
        "measured afresh at the start of each configuration. Calibrated: the same nodes timed on this host",
        "(`calibrate=True`; timed/total forward nodes in the column). Measured: median wall time of the eager",
        'forward (`no_grad`) and of the fxremat-compiled forward (`inner="eager"`). Ratios are measured / estimated',
        "(above 1: the estimate is optimistic). Target: within a factor of 2. fp32, this 2-vCPU host shared with other sessions.",
        "",
    ]
    for label, data in results.items():
        head, rows = data[0], data[1:]
        p = head["profile"]
        lines += [
            f"## {label}",
            "",
            f"Profile: {p['peak_flops'] / 1e9:.1f} GFLOP/s matmul, {p['attention_flops'] / 1e9:.1f} GFLOP/s attention, "
            f"{p['bandwidth'] / 1e9:.1f} GB/s, {p['launch_seconds'] * 1e6:.1f} us per op, {p['view_seconds'] * 1e6:.1f} us per view, "
            f"{p['fresh_bandwidth'] / 1e9:.2f} GB/s fresh pages. Load average at the start: {head['load']:.1f}.",
            "",
            "| case | graphs | fwd GFLOP | estimated ms | calibrated ms (timed) | eager ms | compiled ms | eager / est. | compiled / est. | eager / calibrated |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['case']} | {r['graphs']} | {r['gflop']:.3f} | {r['estimated'] * 1e3:.2f} | "
                f"{r['calibrated'] * 1e3:.2f} ({r['timed']}/{r['nodes']}) | {r['eager'] * 1e3:.2f} | {r['compiled'] * 1e3:.2f} | "
                f"{r['eager'] / r['estimated']:.2f} | {r['compiled'] / r['estimated']:.2f} | {r['eager'] / r['calibrated']:.2f} |"
            )
        lines.append("")
    path = ROOT / "docs" / "COST_MODEL.md"
    notes = (
        path.read_text().split("<!-- notes -->", 1)[1] if path.exists() and "<!-- notes -->" in path.read_text() else ""
    )
    path.write_text("\n".join(lines) + "<!-- notes -->" + notes)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
