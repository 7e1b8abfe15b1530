"""The solver registry: every solver by name, one signature, and ``solve``.

Every entry is ``(problem, budget, options) -> Decision`` and returns the
fastest plan it finds whose simulated peak fits the budget, else its
least-peak plan with ``feasible=False`` (it never raises for infeasibility).

Example:
    >>> d = solve(problem, budget=2 << 30, solver="auto")
    >>> d.solver
    'auto:ilp'
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

from .ilp import solve_ilp
from .mincut import solve_mincut
from .policies import rank, solve_per_layer, solve_save_all, solve_save_inputs, solve_sqrt_n
from .types import FORWARD, Decision, RematProblem, SolveOptions

__all__ = ["SOLVERS", "Solver", "get_solver", "solve", "solve_auto", "AUTO_ILP_MAX_FORWARD"]

logger = logging.getLogger(__name__)

Solver = Callable[[RematProblem, "int | None", SolveOptions], Decision]
"""What every registered solver is: ``(problem, budget, options) -> Decision``."""

# ``auto`` runs the ILP after min-cut up to this many forward nodes. Measured
# on the synthetic GPT stacks of tests/test_solvers.py: at 88 forward nodes
# HiGHS proves optimality in 0.2-4 s; at 256 it does at loose budgets in under
# a second and, at tight ones, improves on min-cut by 3-5% but stops at a
# 10 s limit with a 5-10% gap; each MILP round grows with the graph beyond.
AUTO_ILP_MAX_FORWARD = 400
# Share of the time limit ``auto`` gives min-cut before the ILP; min-cut needs
# well under a second on 3000-node graphs, so this only matters when it has to
# search for the least peak.
AUTO_MINCUT_SHARE = 0.3
# Seconds ``auto`` lets the ILP refine min-cut's plan. On transformer graphs the ILP
# proves optimality within a second or two when it can; past that it ran to the limit
# for 2-10% less recompute than min-cut (solver benchmarks), not worth a slower compile.
AUTO_ILP_SECONDS = 2.0


def solve_auto(problem: RematProblem, budget: int | None, options: SolveOptions = SolveOptions()) -> Decision:
    """Min-cut (with the reference policies as candidates), then the ILP warm-started from it on small graphs.

    The ILP's plan is used only when it proves it optimal within
    ``AUTO_ILP_SECONDS``: that keeps ``auto`` deterministic (the same graph and
    budget give the same plan on a loaded machine too). ``Decision.solver`` says
    which produced the plan: ``"auto:mincut"`` or ``"auto:ilp"``; gap 0.0 means
    proven optimal, None unknown.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None for the fastest plan.
        options: ``time_limit`` covers both solvers together.

    Returns:
        The decision.
    """
    started = time.perf_counter()
    forward = sum(1 for p in problem.phase if p == FORWARD)
    cut = solve_mincut(problem, budget, replace(options, time_limit=options.time_limit * AUTO_MINCUT_SHARE))
    result, name, notes = cut, "auto:mincut", [cut.note]
    left = options.time_limit - (time.perf_counter() - started)
    if forward > AUTO_ILP_MAX_FORWARD:
        notes.append(f"ILP skipped: {forward} forward nodes > {AUTO_ILP_MAX_FORWARD}")
    elif left > 0:
        exact = solve_ilp(problem, budget, replace(options, time_limit=min(left, AUTO_ILP_SECONDS)), warm=cut)
        if exact.gap != 0.0:
            # Only a proven optimum is independent of machine load; a plan the ILP
            # found before its time ran out could differ between two compiles of the
            # same graph (explain vs torch.compile, one rank vs another).
            result = replace(cut, gap=None)
            notes.append(f"ILP not proven optimal within {min(left, AUTO_ILP_SECONDS):g}s; kept min-cut's plan")
        elif rank(exact) < rank(cut):
            result, name, notes = exact, "auto:ilp", [exact.note]
        else:
            result = replace(cut, gap=0.0)
            notes.append("ILP proved it optimal")
    else:
        notes.append("ILP skipped: min-cut used the whole time limit")
    return replace(result, solver=name, solve_seconds=time.perf_counter() - started, note="; ".join(filter(None, notes)))


SOLVERS: MappingProxyType[str, Solver] = MappingProxyType(
    {
        "auto": solve_auto,
        "ilp": solve_ilp,
        "mincut": solve_mincut,
        "save_all": solve_save_all,
        "per_layer": solve_per_layer,
        "sqrt_n": solve_sqrt_n,
        "save_inputs": solve_save_inputs,
    }
)
"""Every solver by name. Read-only."""


def get_solver(name: str) -> Solver:
    """The solver registered under ``name``.

    Args:
        name: one of ``SOLVERS``.

    Returns:
        The solver function.

    Raises:
        ValueError: unknown name; the message lists the valid ones.

    Example:
        >>> get_solver("mincut").__name__
        'solve_mincut'
    """
    try:
        return SOLVERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown solver {name!r}; choose one of: {', '.join(SOLVERS)}") from None


def solve(problem: RematProblem, budget: int | None, solver: str = "auto", options: SolveOptions = SolveOptions()) -> Decision:
    """Choose what to keep and what to recompute for ``problem`` under ``budget``.

    Args:
        problem: the joint graph.
        budget: peak bytes of the step to fit, or None for the fastest plan.
        solver: a name in ``SOLVERS``.
        options: time limit and progress callback.

    Returns:
        The decision. ``feasible=False`` means nothing the solver found fits;
        its ``peak_bytes`` is then the least peak found.

    Raises:
        ValueError: unknown solver, or a ``must_recompute`` tag that cannot be
            honoured.

    Example:
        >>> plan = fxremat.explain(model, x)                  # Plan.problem is the graph as data
        >>> d = solve(plan.problem, 2 << 30, "per_layer")
        >>> d.feasible, d.peak_bytes, len(d.recomputed)
    """
    fn = get_solver(solver)
    d = fn(problem, budget, options)
    logger.debug("solve(%s): peak %d, recompute %.3gs, feasible %s in %.3fs", solver, d.peak_bytes, d.recompute_seconds, d.feasible, d.solve_seconds)
    return d
