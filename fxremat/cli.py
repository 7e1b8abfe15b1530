"""The ``fxremat`` command: plan a model from the shell.

``MODULE:FACTORY`` names a zero-argument function returning ``(model,
example_args)``; MODULE is a dotted module name (found from the current
directory too) or a path to a ``.py`` file.

Example:
    $ fxremat explain mymodels.py:make_gpt --budget 2GiB --out plan/
    $ fxremat pareto mymodels.py:make_gpt --points 8 --out plan/
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["main"]

logger = logging.getLogger(__name__)

_EXPLAIN_EXAMPLES = """\
examples:
  fxremat explain mymodels.py:make_gpt --budget 2GiB
  fxremat explain mypkg.models:make_mlp --budget 512MiB --inner eager --out plan/
  fxremat explain mymodels.py:make_gpt --budget 1.5GB --solver mincut --out plan/ --full

FACTORY() must return (model, example_args), example_args a tuple of inputs.
--out writes plan.txt, plan.json, forward.py, backward.py, graph.dot,
graph.svg (when Graphviz is installed) and timeline.png.
"""

_PARETO_EXAMPLES = """\
examples:
  fxremat pareto mymodels.py:make_gpt
  fxremat pareto mypkg.models:make_mlp --points 12 --inner eager --out plan/

Prints one row per plan on the memory/time front; --out writes pareto.png.
"""


class _UsageError(Exception):
    """A bad command line: reported on one line, exit status 2."""


# ---------------------------------------------------------------------------
# Loading the user's factory
# ---------------------------------------------------------------------------


def load_factory(target: str):
    """Import ``MODULE:FACTORY`` and return the factory.

    Args:
        target: ``"pkg.module:name"`` or ``"path/to/file.py:name"``.

    Returns:
        The callable named FACTORY.

    Raises:
        _UsageError: the target is malformed, or the file or attribute is missing
            (``main`` reports it on one line with exit status 2).

    Example:
        >>> make = load_factory("mymodels.py:make_gpt")
        >>> model, args = make()
    """
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise _UsageError(f"{target!r} is not MODULE:FACTORY (e.g. mymodels.py:make_model or mypkg.models:make_model)")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        path = Path(module_name).resolve()
        if not path.is_file():
            raise _UsageError(f"no such file {module_name!r} (from {target!r})")
        # Sibling imports of the file work as they do under `python file.py`.
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(f"_fxremat_factory_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise _UsageError(f"{module_name!r} is not an importable Python file (from {target!r}); name a .py file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        # A console script's sys.path lacks the current directory; `python -m` has it.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _UsageError(
            f"{module_name!r} has no callable {attr!r}; expected MODULE:FACTORY where FACTORY() "
            f"returns (model, example_args)"
        )
    return factory


def _build(target: str):
    """Call the factory; returns (model, example_args tuple)."""
    made = load_factory(target)()
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise _UsageError(f"{target} returned {type(made).__name__}; expected a pair (model, example_args)")
    model, args = made
    if isinstance(args, list):
        args = tuple(args)
    elif not isinstance(args, tuple):
        args = (args,)  # a single example input
    return model, args


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def _options(args) -> dict:
    """The fxremat options given on the command line, validated (budget in bytes)."""
    import fxremat

    try:
        budget = (
            fxremat.parse_budget(args.budget, name="--budget") if getattr(args, "budget", None) is not None else None
        )
    except (TypeError, ValueError) as exc:
        raise _UsageError(str(exc)) from exc
    options = {
        k: v
        for k, v in (
            ("solver", args.solver),
            ("inner", args.inner),
            ("hardware", args.hardware),
            ("time_limit", args.time_limit),
            ("time_slack", getattr(args, "time_slack", None)),
        )
        if v is not None
    }
    try:
        fxremat.Options.from_mapping({**options, "budget": budget})
    except (TypeError, ValueError) as exc:
        raise _UsageError(str(exc)) from exc
    return {"budget": budget, **options}


def _progress(message: str) -> None:
    if sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


def _explain(args) -> int:
    import fxremat

    options = _options(args)
    model, example_args = _build(args.target)
    budget = "none" if options["budget"] is None else fxremat.format_bytes(options["budget"])
    _progress(f"planning {args.target} (budget {budget}) ...")
    t0 = time.perf_counter()
    try:
        plan = fxremat.explain(model, *example_args, **options)
    except fxremat.BudgetError as exc:
        # First line only: Dynamo appends its own debugging hints to the message.
        print(f"fxremat explain: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    _progress(f"planned in {time.perf_counter() - t0:.1f} s")
    print(plan)
    if args.out:
        out = Path(args.out)
        written = plan.save(out, full=args.full)
        print(f"\nwrote {len(written)} files to {out}/: " + ", ".join(p.name for p in written))
    return 0


def _pareto(args) -> int:
    import fxremat

    options = _options(args)
    options.pop("budget")
    model, example_args = _build(args.target)
    _progress(f"planning {args.target} at {args.points} budgets ...")
    t0 = time.perf_counter()
    points = fxremat.pareto(model, *example_args, points=args.points, **options)
    _progress(f"planned in {time.perf_counter() - t0:.1f} s")
    header = f"{'budget':>12} {'predicted peak':>15} {'est. recompute ms':>18}  solver"
    print(header)
    print("-" * len(header))
    for p in points:
        solver = getattr(p, "solver", None) or getattr(getattr(p, "plan", None), "solver", "?")
        budget = getattr(p, "budget", None)
        budget = "none" if budget is None else fxremat.format_bytes(budget)
        print(f"{budget:>12} {fxremat.format_bytes(p.predicted_peak):>15} {p.recompute_seconds * 1e3:>18.3f}  {solver}")
    if args.out:
        from . import viz

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(f"\nwrote {viz.pareto_png(points, out / 'pareto.png')}")
    return 0


# ---------------------------------------------------------------------------
# Parser and entry point
# ---------------------------------------------------------------------------


def _common(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="FACTORY() returns (model, example_args); MODULE is a dotted name or a .py file",
    )
    sub.add_argument("--solver", help="auto (default), ilp, mincut, save_all, per_layer, sqrt_n, save_inputs")
    sub.add_argument("--inner", help="compiler of the planned programs: inductor (default) or eager")
    sub.add_argument("--hardware", help="cost-model profile: cpu (default), a100, h100, h200")
    sub.add_argument("--time-limit", type=float, metavar="SECONDS", help="solver time per graph")
    sub.add_argument(
        "--time-slack",
        type=float,
        metavar="SHARE",
        help="no budget: estimated step time the plan may add to lower the peak (default 0.02; 0: fastest)",
    )
    sub.add_argument("--out", metavar="DIR", help="folder to write files into (created if missing)")
    sub.add_argument("-v", "--verbose", action="store_true", help="log fxremat's progress (INFO) to stderr")


def _parser() -> argparse.ArgumentParser:
    import fxremat

    parser = argparse.ArgumentParser(
        prog="fxremat",
        description="Plan activation recomputation so a training step's peak memory fits a budget.",
    )
    parser.add_argument("--version", action="version", version=f"fxremat {fxremat.__version__}")
    subs = parser.add_subparsers(dest="command", required=True, metavar="{explain,pareto}")
    explain = subs.add_parser(
        "explain",
        help="plan a model under a budget and print what is kept and recomputed",
        description="Plan a model's training step under a memory budget without running it.",
        epilog=_EXPLAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(explain)
    explain.add_argument(
        "--budget",
        metavar="BYTES",
        help='peak of the step: bytes or "512MiB", "1.5GB", "2GiB", "800kB"; omit: the least peak within --time-slack of the fastest plan\'s time',
    )
    explain.add_argument("--full", action="store_true", help="draw every node in graph.dot even in a large graph")
    explain.set_defaults(run=_explain)
    pareto = subs.add_parser(
        "pareto",
        help="the memory/recompute-time front across budgets",
        description="Solve a model's largest graph at several budgets and print the memory/time front.",
        epilog=_PARETO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(pareto)
    pareto.add_argument("--points", type=int, default=8, metavar="N", help="budgets to try (default 8)")
    pareto.set_defaults(run=_pareto)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fxremat`` command.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 1 when the budget is infeasible, 2 for
        a bad command line (one-line message on stderr).

    Example:
        >>> main(["explain", "mymodels.py:make_mlp", "--budget", "64MiB", "--out", "plan/"])
        0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse has printed them
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("fxremat").setLevel(logging.INFO)
    try:
        return args.run(args)
    except _UsageError as exc:
        print(f"fxremat {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
