"""Training on batches whose sequence length changes every step (padded to their longest).

    .venv/bin/python benchmarks/dynamic_lengths.py                    # HF GPT-2 of compare.py, 10 lengths
    .venv/bin/python benchmarks/dynamic_lengths.py --model llama --rows fxremat
    .venv/bin/python benchmarks/dynamic_lengths.py --json out.json    # also the raw results

Each row runs in a fresh process (one intra-op thread, an empty kernel cache): the model of
``benchmarks/compare.py`` compiled whole, as users compile it, and one training step
(``model(input_ids=ids, labels=ids).loss.backward()``) at each length in turn, twice over:

- ``inductor``: plain ``torch.compile(model)``;
- ``fxremat``: ``torch.compile(model, backend="fxremat")``, no budget;
- ``fxremat budget``: under a budget of ``--budget-share`` times eager's measured peak at
  the longest length.

Columns: the compiled graphs fxremat planned (``fxremat.plans()``, re-plans included) and
Dynamo's compiles of the model's frame; seconds of the first pass over the lengths (compiles
included) and of the second; the largest measured peak over the lengths in the second pass
(``fxremat.measure``, the profiler's memory timeline), and how many lengths ran uncompiled
(Dynamo compiles one frame at most ``torch._dynamo.config.recompile_limit`` times, then runs
new sizes without compiling them); the largest relative gradient error against eager over
every length and parameter.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
LENGTHS = (256, 192, 224, 160, 240, 208, 176, 248, 232, 184)
ROWS = ("inductor", "fxremat", "fxremat budget")


def _row(model_name: str, row: str, lengths: tuple[int, ...], share: float) -> dict:
    import copy
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    import compare  # noqa: E402  (benchmarks/compare.py: the same models)
    import fxremat

    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = compare.MODELS[model_name](False)
    model = work.model
    model.train()
    vocab = model.config.vocab_size
    batch = work.inputs[0].shape[0]
    batches = {n: torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(n)) for n in lengths}
    reference = copy.deepcopy(model)

    def step(m, ids):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()

    longest = batches[max(lengths)]
    eager_peak = fxremat.measure(lambda: step(reference, longest), reps=1, warmup=1).peak_bytes
    options = {}
    if row == "fxremat budget":
        options = {"budget": int(share * eager_peak)}
    if row == "inductor":
        compiled = torch.compile(model)
    else:
        compiled = torch.compile(model, backend="fxremat", options=options)
    from torch._dynamo.utils import counters

    class Hits(logging.Handler):
        """Dynamo's warnings that a frame hit its recompile limit (it then runs new sizes uncompiled)."""

        count = 0

        def emit(self, record: logging.LogRecord) -> None:
            if "recompile_limit" in record.getMessage():
                Hits.count += 1

    logging.getLogger("torch._dynamo").addHandler(Hits())
    seconds = []
    worst = 0.0
    first_uncompiled = None  # the first length of the first pass Dynamo ran without compiling it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rep in range(2):
            start = time.perf_counter()
            for i, n in enumerate(lengths):
                hits = Hits.count
                step(compiled, batches[n])
                if rep == 0 and Hits.count > hits and first_uncompiled is None:
                    first_uncompiled = i
                if rep == 0:
                    step(reference, batches[n])
                    for p, q in zip(reference.parameters(), model.parameters()):
                        if p.grad is not None and p.grad.norm() > 1e-6:
                            worst = max(worst, float((p.grad - q.grad).norm() / p.grad.norm()))
            seconds.append(time.perf_counter() - start)
        frames = int(counters["stats"]["unique_graphs"])
        peaks = {n: fxremat.measure(lambda: step(compiled, batches[n]), reps=1, warmup=1).peak_bytes for n in lengths}
    plans = len(fxremat.plans()) if row != "inductor" else None
    limit = int(torch._dynamo.config.recompile_limit)
    return {
        "model": model_name,
        "row": row,
        "budget": options.get("budget"),
        "eager_peak_longest": eager_peak,
        "plans": plans,
        "compiles": frames,
        "recompile_limit": limit,
        # Every length of the first pass is new: from the first one Dynamo refused on, none is compiled.
        "uncompiled_lengths": 0 if first_uncompiled is None else len(lengths) - first_uncompiled,
        "first_pass_s": seconds[0],
        "second_pass_s": seconds[1],
        "peak": max(peaks.values()),
        "peaks": peaks,
        "worst_grad_rel_err": worst,
        "fxremat": fxremat.__file__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    parser.add_argument("--budget-share", type=float, default=0.6, help="budget row: this times eager's peak")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one row in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_row(args.model, args.one, tuple(args.lengths), args.budget_share)))
        return
    results = []
    for row in args.rows:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FXREMAT_PLAN_CACHE": "0"}
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dynlen-")
        cmd = [sys.executable, __file__, "--model", args.model, "--one", row, "--budget-share", str(args.budget_share)]
        cmd += ["--lengths", *map(str, args.lengths)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{row}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    mib = 1 << 20
    print(
        f"{args.model}, lengths {' '.join(map(str, args.lengths))}; eager's peak at the longest: "
        f"{results[0]['eager_peak_longest'] / mib:.1f} MiB"
        if results
        else "no results"
    )
    print()
    print(
        "| row | budget MiB | plans | Dynamo compiles | lengths run uncompiled | first pass s | second pass s "
        "| largest peak MiB | largest gradient error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        budget = f"{r['budget'] / mib:.1f}" if r["budget"] else ""
        plans = "" if r["plans"] is None else r["plans"]
        print(
            f"| {r['row']} | {budget} | {plans} | {r['compiles']} | {r['uncompiled_lengths']} | "
            f"{r['first_pass_s']:.1f} | {r['second_pass_s']:.1f} | {r['peak'] / mib:.1f} | "
            f"{r['worst_grad_rel_err']:.1e} |"
        )


if __name__ == "__main__":
    main()
