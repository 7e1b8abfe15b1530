"""Where planning time goes on a Llama-3-8B-shaped model built on the meta device; writes docs/PLANNING_TIME.md.

    .venv/bin/python benchmarks/planning_time.py                       # the default rows
    .venv/bin/python benchmarks/planning_time.py --rows 2:inductor 8:eager 32:eager
    .venv/bin/python benchmarks/planning_time.py --row 8 eager         # one row, one JSON line
    .venv/bin/python benchmarks/planning_time.py --rows 80:eager:70b   # the Llama-3-70B shape

The model is HF's ``LlamaForCausalLM`` from a config shaped like Llama-3-8B
(hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocabulary 128256, bf16, 4096
tokens, batch 1) with fewer layers where asked (a row spec ending in ``:70b``: shaped like
Llama-3-70B, hidden 8192, 64 heads, 8 KV heads, MLP 28672), built under
``torch.device("meta")``, its loss taken as users take it
(``model(input_ids=ids, labels=ids).loss``). Each row is a fresh process
running ``fxremat.explain`` with default options and no budget, on one
intra-op thread; nothing runs, no weight exists. Each row runs twice, in fresh
processes sharing an empty plan cache (``fxremat/plan_cache.py``): the first
plans, the second is a later run of the same job, which reads the plan.

Columns (seconds): ``total`` is explain's wall time; ``trace`` what precedes
fxremat's partitioner (Dynamo, AOTAutograd's joint graph, explain's own
setup), that is ``total`` less the partitioner's ``total``; then the plan's
``pass_seconds``: ``cost`` (FLOPs and bytes per node), ``problem`` (the
solver's problem), ``search`` (the solvers: ``solve`` less ``lower``),
``lower`` (lowering candidates to their programs and judging them: under
``inner="inductor"``, Inductor's dry lowering of each candidate's programs);
``a later run`` is the second process's ``total``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Every run plans afresh: the plan cache (fxremat/plan_cache.py) would hide planning time and planner changes.
os.environ.setdefault("FXREMAT_PLAN_CACHE", "0")
DOC = ROOT / "docs" / "PLANNING_TIME.md"
ROW_MARK = "ROW "
ROWS = ["2:inductor", "2:eager", "8:eager", "32:eager"]
TOKENS = 4096
# name -> (hidden, attention heads, KV heads, MLP width): Llama-3's 8B and 70B configs.
SHAPES = {"8b": (4096, 32, 8, 14336), "70b": (8192, 64, 8, 28672)}


def build(layers: int, shape: str = "8b"):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, mlp = SHAPES[shape]
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=128256,
        max_position_embeddings=TOKENS,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(1, TOKENS, dtype=torch.long)
    model.loss_type = "ForCausalLM"  # no warning inside forward, so no graph break before the loss
    return model, ids


class Loss(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def run_row(layers: int, inner: str, shape: str = "8b") -> dict:
    import fxremat

    torch.set_num_threads(1)
    model, ids = build(layers, shape)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = fxremat.explain(Loss(model), ids, inner=inner)
    total = time.perf_counter() - started
    s = plan.pass_seconds
    return {
        "layers": layers,
        "inner": inner,
        "shape": shape,
        "nodes": plan.problem.size,
        "total": total,
        "trace": total - s["total"],
        "cost": s["cost"],
        "problem": s["problem"],
        "search": s["solve"] - s["lower"],
        "lower": s["lower"],
        "solver": plan.solver,
        "peak": plan.predicted_peak,
    }


def run_subprocess(layers: int, inner: str, shape: str = "8b") -> dict:
    """The row in a fresh process with an empty plan cache, then once more, as a later run finds it."""
    with tempfile.TemporaryDirectory(prefix="fxremat-planning-time-") as plans:
        env = dict(os.environ, FXREMAT_PLAN_CACHE="1", FXREMAT_PLAN_CACHE_DIR=plans)
        runs = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, __file__, "--row", str(layers), inner, "--shape", shape],
                capture_output=True,
                text=True,
                timeout=3600,
                env=env,
            )
            if out.returncode != 0:
                return {"layers": layers, "inner": inner, "shape": shape, "error": out.stderr.strip().splitlines()[-1:]}
            line = next(x for x in out.stdout.splitlines() if x.startswith(ROW_MARK))
            runs.append(json.loads(line[len(ROW_MARK) :]))
    return {**runs[0], "later_total": runs[1]["total"], "later_peak": runs[1]["peak"]}


def render(rows: list[dict]) -> str:
    import fxremat

    lines = [
        "# Planning time",
        "",
        f"Regenerate with `.venv/bin/python benchmarks/planning_time.py` ({os.cpu_count()} cores, {platform.machine()}, "
        f"torch {torch.__version__}, one intra-op thread). A Llama-3-8B-shaped `LlamaForCausalLM` (hidden 4096, GQA 32/8, "
        f"MLP 14336, vocabulary 128256, bf16, {TOKENS} tokens, batch 1) with the layers shown, built on the meta device, "
        "`fxremat.explain` with default options and no budget; each row a fresh process. Seconds; the columns are "
        "defined in the script's docstring.",
        "",
        "| layers | inner | joint nodes | total | trace | cost | problem | search | lower | solver | predicted peak "
        "| a later run (plan cache) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def later(r: dict) -> str:
        if "later_total" not in r:
            return "not run"
        same = "" if r["later_peak"] == r["peak"] else f", predicted {fxremat.format_bytes(r['later_peak'])} (differs)"
        return f"{r['later_total']:.1f}{same}"

    for r in rows:
        layers = r["layers"] if r.get("shape", "8b") == "8b" else f"{r['layers']} ({r['shape'].upper()} shape)"
        if "error" in r:
            lines.append(f"| {layers} | {r['inner']} | failed: {' '.join(r['error'])} |")
            continue
        lines.append(
            f"| {layers} | {r['inner']} | {r['nodes']} | {r['total']:.1f} | {r['trace']:.1f} | {r['cost']:.2f} | "
            f"{r['problem']:.2f} | {r['search']:.1f} | {r['lower']:.1f} | {r['solver']} | "
            f"{fxremat.format_bytes(r['peak'])} | {later(r)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="*", default=ROWS, help="LAYERS:INNER[:SHAPE], SHAPE 8b (default) or 70b")
    parser.add_argument("--row", nargs=2, metavar=("LAYERS", "INNER"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="the model's shape (--row only)")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--render", type=Path, help="rewrite the doc's table from a saved --json run")
    args = parser.parse_args(argv)
    if args.row:
        print(ROW_MARK + json.dumps(run_row(int(args.row[0]), args.row[1], args.shape)), flush=True)
        return
    if args.render:
        rows = json.loads(args.render.read_text())
    else:
        rows = []
        for spec in args.rows:
            layers, inner, *shape = spec.split(":")
            rows.append(run_subprocess(int(layers), inner, *shape))
            print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    table = render(rows)
    # The prose below the table is kept: only the generated part is rewritten.
    old = args.doc.read_text() if args.doc.exists() else ""
    rest = old[old.index("\n## ") :] if "\n## " in old else ""
    args.doc.write_text(table + rest)
    print(table)


if __name__ == "__main__":
    main()
