"""Check fxremat's Inductor memory model against what Inductor really generates, for one model and budget.

    .venv/bin/python benchmarks/inductor_check.py gpt2 --budget least
    .venv/bin/python benchmarks/inductor_check.py llama --budget 56283140 --timeline /tmp/cmp.txt

Compiles the model under fxremat (Inductor inner), runs one measured step and
prints:

- the plan's predicted peak and the measured peak;
- the peak of each generated program, replayed from Inductor's wrapper code
  (``empty_strided`` allocations, ``# reuse`` hand-overs, ``del``): the
  bytes Inductor's program holds line by line, which is what the simulation
  is meant to equal before its 4% allowance. Graph inputs are counted as
  float32 at their own size from the program's start, so saved views of one
  storage count twice and the backward can read high on small models (GPT-2
  at benchmark size read exactly the measured 81.08 MiB);
- in-place reuses the simulation assumed that Inductor did not make (must be
  empty: each is a buffer the prediction leaves out).

``--timeline FILE`` writes the simulated timeline and Inductor's program side
by side (changes of half a MiB or more) to find where the two part. This is a
developer's tool for the rules in ``fxremat/passes/fusion.py`` and
``inplace.py``; it relies on the text of Inductor's CPU wrapper (torch 2.13).
MODEL is a benchmark workload (``benchmarks/compare.py``: gpt2, llama, bert,
mlp, cnn) or, with ``--zoo``, a model of ``tests/zoo.py``.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float64": 8,
}
_ALLOC = re.compile(r"(\w+) = empty_strided_cpu\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_ASSERT = re.compile(r"assert_size_stride\((\w+), \(([^)]*)\), \(([^)]*)\), '(.*)'\)")
_REUSE = re.compile(r"(\w+) = (?:reinterpret_tensor\()?(\w+)\b.*; del (\w+)  # reuse")
_DEL = re.compile(r"del (\w+)$")


def _storage_bytes(size: str, stride: str, dtype: str) -> int:
    sizes = [int(x) for x in size.split(",") if x.strip()]
    strides = [int(x) for x in stride.split(",") if x.strip()]
    if any(s == 0 for s in sizes):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(sizes, strides))) * _DTYPE_BYTES.get(dtype, 4)


def program_liveness(path: str) -> list[tuple[int, str]]:
    """(live bytes, line) after each line of a generated wrapper's ``call``.

    Inputs other than parameters (``primals_*``) are alive from the start;
    allocations add, ``# reuse`` lines hand a buffer to a new name, ``del``
    frees what a name owns, and an extern kernel's fresh outputs count from
    their ``assert_size_stride`` line.
    """
    source = Path(path).read_text()
    body = source[source.index("    def call(self, args):") :]
    owned: dict[str, int] = {}
    live = 0
    for match in _ASSERT.finditer(body):
        name, size, stride, what = match.groups()
        if what == "input" and not name.startswith("primals_"):
            owned[name] = _storage_bytes(size, stride, "float32")
            live += owned[name]
    out: list[tuple[int, str]] = []
    for line in body.splitlines():
        text = line.strip()
        if text.startswith("return"):
            break
        if m := _ALLOC.match(text):
            owned[m.group(1)] = _storage_bytes(m.group(2), m.group(3), m.group(4))
            live += owned[m.group(1)]
        elif (m := _ASSERT.match(text)) and m.group(4) != "input" and m.group(1) not in owned:
            owned[m.group(1)] = _storage_bytes(m.group(2), m.group(3), "float32")
            live += owned[m.group(1)]
        elif m := _REUSE.match(text):
            owned[m.group(1)] = owned.pop(m.group(2), 0)
        elif (m := _DEL.match(text)) and m.group(1) in owned:
            live -= owned.pop(m.group(1))
        out.append((live, text))
    return out


def observe(model, run, budget):
    """Compile under fxremat and return (plan, measured peak, generated files, our reuse writers, Inductor's)."""
    import torch

    import fxremat
    from fxremat._torch_compat import inductor_config, inductor_graph_lowering, inductor_kernel_args
    from fxremat import planner

    origins: dict[str, set[str]] = {}
    made: list[str] = []
    files: list[str] = []

    def post_fusion(nodes):
        for node in nodes:
            for out in node.get_outputs():
                origins.setdefault(out.get_name(), set()).update(o.name for o in getattr(out.node, "origins", ()))
        return nodes

    make_inplace, compile_to_module = inductor_kernel_args.make_inplace, inductor_graph_lowering.compile_to_module

    def record(self, input_name, output_name):
        made.append(output_name)
        return make_inplace(self, input_name, output_name)

    def compiled_module(self, *args, **kwargs):
        module = compile_to_module(self, *args, **kwargs)
        files.append(module.__file__)
        return module

    inductor_kernel_args.make_inplace = record
    inductor_graph_lowering.compile_to_module = compiled_module
    try:
        torch._dynamo.reset()
        fxremat.clear_plans()
        compiled = torch.compile(
            model, backend=fxremat.backend(budget=budget, on_infeasible="min", release_outputs=True)
        )
        with (
            inductor_config.patch(_post_fusion_custom_pass=post_fusion, fx_graph_cache=False),
            warnings.catch_warnings(),
            planner.watch() as planned,
        ):
            warnings.simplefilter("ignore")
            run(compiled).backward()
            measured = fxremat.measure(lambda: run(compiled).backward(), reps=1, warmup=1)
    finally:
        inductor_kernel_args.make_inplace = make_inplace
        inductor_graph_lowering.compile_to_module = compile_to_module
    sim = planned[-1][1].lowered.simulation
    ours = {sim.names[writer] for writer, _ in sim.timeline.reused}
    theirs = set().union(*(origins.get(name, {name}) for name in made)) if made else set()
    return fxremat.plans()[-1], measured.peak_bytes, files[-2:], ours, theirs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--budget", default="none", help="bytes, 'least' (budget 1 B, least reachable) or 'none'")
    parser.add_argument("--zoo", action="store_true", help="MODEL names a tests/zoo.py model")
    parser.add_argument("--quick", action="store_true", help="the benchmark workload's small size")
    parser.add_argument("--timeline", type=Path, default=None, help="write both timelines side by side here")
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    if args.zoo:
        from zoo import ZOO

        base, inputs = ZOO[args.model]()
        model, run = copy.deepcopy(base), (lambda m: m(*inputs))
    else:
        import compare

        workload = compare.MODELS[args.model](args.quick)
        model, run = workload.model, workload.loss
    budget = {"none": None, "least": 1}.get(args.budget)
    if budget is None and args.budget != "none":
        budget = int(args.budget)
    plan, measured, files, ours, theirs = observe(model, run, budget)
    mib = 2**20
    print(
        f"{args.model} budget {args.budget}: predicted {plan.predicted_peak / mib:.1f} MiB, measured {measured / mib:.1f} MiB"
    )
    programs = [program_liveness(f) for f in files]
    for name, trace in zip(("forward", "backward"), programs):
        live, line = max(trace, key=lambda t: t[0])
        print(f"  Inductor {name} program peak {live / mib:.1f} MiB at: {line[:100]}")
    wrong = sorted(ours - theirs)
    print(f"  in-place reuses assumed: {len(ours)}; not made by Inductor: {wrong or 'none'}")
    if args.timeline:
        lines, previous = [], 0
        for name, phase, live in plan.timeline:
            if abs(live - previous) >= mib // 2:
                lines.append(f"fxremat   {phase[:8]:8s} {live / mib:8.2f}  {name}")
            previous = live
        for name, trace in zip(("forward", "backward"), programs):
            previous = 0
            for live, line in trace:
                if abs(live - previous) >= mib // 2 or "extern_kernels" in line:
                    lines.append(f"inductor  {name[:8]:8s} {live / mib:8.2f}  {line[:120]}")
                previous = live
        args.timeline.write_text("\n".join(lines) + "\n")
        print(f"  timelines side by side: {args.timeline}")


if __name__ == "__main__":
    main()
