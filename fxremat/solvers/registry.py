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
from .layers import repeated_values
from .mincut import searched_greedily, solve_mincut
from .policies import solve_per_layer, solve_save_all, solve_save_inputs, solve_sqrt_n
from .rules import Deadline, rank, rules
from .types import Decision, RematProblem, SolveOptions

__all__ = [
    "SOLVERS",
    "Solver",
    "get_solver",
    "solve",
    "solve_auto",
    "solve_within",
    "WITHIN_ROUNDS",
    "WITHIN_RESOLUTION",
    "WITHIN_GREEDY_SHARE",
    "AUTO_ILP_MAX_FORWARD",
    "AUTO_TIED_MAX_RELEVANT",
    "AUTO_MILP_NODE_WORK",
    "AUTO_MILP_ROUNDS",
]

logger = logging.getLogger(__name__)

Solver = Callable[[RematProblem, "int | None", SolveOptions], Decision]
"""What every registered solver is: ``(problem, budget, options) -> Decision``."""

# ``auto`` runs the ILP after min-cut up to this many forward nodes. Measured
# on the synthetic GPT stacks of tests/test_solvers.py: at 88 forward nodes
# HiGHS proves optimality in 0.2-4 s; at 256 it does at loose budgets in under
# a second and, at tight ones, improves on min-cut by 3-5% but had not proven
# it after 10 s (5-10% gap); each MILP round grows with the graph beyond.
AUTO_ILP_MAX_FORWARD = 400
# Beyond it, the ILP with identical layers tied (``solve_ilp(tie_layers=True)``) up to this many
# values to choose among (tied ones included: the program is built over all of them). On HF GPT-2
# graphs (hidden 256, 256 tokens) at three budgets each, ``auto`` took 0.4-0.8 s at 12 layers (623
# values; 5.5% less recompute than min-cut at the loosest, proven optimal among tied plans) and
# 1.2-8.2 s at 32 layers (1583 values), where it found 0.5% once.
AUTO_TIED_MAX_RELEVANT = 1000
# Work limits of the ILP inside ``auto`` (see ``ilp.MILP_NODE_WORK``), which
# replaced 2 s by the clock. On the 2-8 layer synthetic transformers of
# tests/test_solvers.py (74-284 forward values), at 4 budgets each, ``auto``
# then takes up to 4 s of CPU (2.8 s by the clock before) and returns the ILP's
# plan at 9 of 12, 3-8% faster than min-cut's at the 5 where the clock-limited
# ILP had been cut short. Halving the work saved nothing: the cost of the hard
# rounds is HiGHS's root processing, not the nodes. On the small HF graphs of the
# zoo (tests/zoo.py, 2-layer GPT-2 and Llama: 500-900 columns) it is the other way
# round: strong branching makes a node cost 0.2-0.5 s, and the root's plan was the
# last found in 8 of 9 solves. Over the 33 ILP runs of tests/test_backend.py's zoo
# budgets, 5,000 gave plans of the same recompute time in all 33 (one a different
# kept set of equal time) in 92 s instead of 148; on the synthetic transformers the
# same plans at all 12 budgets, 21 s instead of 25. 2,500 gave 3 plans up to 8.9% slower.
AUTO_MILP_NODE_WORK = 5_000
# At most 3 rounds ran in those solves; 10 leave room on small graphs, where a
# round costs milliseconds, and bound the root work (<= 1 s a round) on large ones.
AUTO_MILP_ROUNDS = 10
# ``solve_within`` bisects the peak between the least and the fastest plan: at most this
# many solves, stopping once the interval is under this share of the fastest plan's
# peak (on the benchmark GPT-2: 106 MiB between the two, 5 rounds reach 3.3 MiB).
WITHIN_ROUNDS = 6
WITHIN_RESOLUTION = 0.02
# The share of ``mincut.GREEDY_MAX_WORK`` (and of its floor, ``GREEDY_MIN_EVALS``) the greedy
# search below min-cut's sweep may use for ``solve_within``'s lower end. On the Llama-3-8B shape's
# joint graphs under Inductor (2, 8 and 32 layers) that search never lowered the sweep's least
# peak: its flips only cut recompute at that peak, all of it by its 104th simulation of 806 (8
# layers). With a quarter of the work ``solve_within`` answers the same peak and estimated
# recompute (the same kept sets at 2 and 32 layers, one of equal peak and time at 8; the same at
# the Llama-3-70B shape's 80) in less time (32 layers: 4.6 -> 2.2 s; 8 layers: 3.1 -> 1.3 s; 80
# layers, where the floor of 100 simulations bound: 8.2 -> 3.9 s). The budgeted least plan's
# search keeps the whole: it is what that search is for.
WITHIN_GREEDY_SHARE = 0.25


def solve_auto(problem: RematProblem, budget: int | None, options: SolveOptions = SolveOptions()) -> Decision:
    """Min-cut (with the reference policies as candidates), then the ILP warm-started from it.

    On graphs of at most ``AUTO_ILP_MAX_FORWARD`` forward nodes the ILP solves the
    whole graph; on larger ones it runs only under a budget and when the graph has
    identical layers and at most ``AUTO_TIED_MAX_RELEVANT`` values to choose among, tied
    (``solve_ilp(tie_layers=True)``: one layer solved for every copy but those at the
    stack's ends, ``layers.py``). It does not run where no min-cut plan fits and the greedy
    least-peak search's does (within a few percent of the least peak, where it rarely finds a
    faster plan and runs to its node limit), nor on a graph run several times in a step.

    The ILP runs under smaller work limits than the ``ilp`` solver
    (``AUTO_MILP_NODE_WORK`` and ``AUTO_MILP_ROUNDS``, unless ``options``
    sets ``milp_nodes`` or ``milp_rounds``), and its plan is used when it is faster
    than min-cut's, proven optimal or not: both stop on counts, never on the
    clock, so the same graph and budget give the same plan on a loaded
    machine too. ``Decision.solver`` says which produced the plan:
    ``"auto:mincut"`` or ``"auto:ilp"``; gap 0.0 means proven optimal, None
    unknown.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None for the fastest plan.
        options: work limits, and ``time_limit``, a safety net over both
            solvers together.

    Returns:
        The decision.

    Raises:
        SolveTimeout: the solve ran past ``options.time_limit``.
    """
    started = time.perf_counter()
    deadline = Deadline.start("auto", options)
    forward = len(problem.forward_ids())
    cut = solve_mincut(problem, budget, options, deadline=deadline)
    result, name, notes = cut, "auto:mincut", [cut.note]
    # Beyond AUTO_ILP_MAX_FORWARD the ILP runs with identical layers tied (layers.py): one layer's
    # decision for every copy, a program the size of a few layers.
    tie = forward > AUTO_ILP_MAX_FORWARD
    rule = rules(problem) if tie else None
    if rule is not None and budget is None:
        notes.append(f"ILP skipped: {forward} forward nodes > {AUTO_ILP_MAX_FORWARD}")
    elif rule is not None and len(rule.relevant) > AUTO_TIED_MAX_RELEVANT:
        notes.append(
            f"ILP skipped: {forward} forward nodes > {AUTO_ILP_MAX_FORWARD} and {len(rule.relevant)} values "
            f"to choose > {AUTO_TIED_MAX_RELEVANT}"
        )
    elif rule is not None and not repeated_values(problem, rule):
        notes.append(f"ILP skipped: {forward} forward nodes > {AUTO_ILP_MAX_FORWARD}, and no identical layers")
    elif problem.copies:
        # Earlier calls' kept bytes add a dense term to every memory row: on a Llama decoder
        # layer run 4 times (82 forward nodes) HiGHS took 19 s more and found nothing faster.
        notes.append(f"ILP skipped: the graph runs {problem.copies + 1} times in a step")
    elif cut.feasible and budget is not None and searched_greedily(cut):
        # Within a few percent of the least peak, where no min-cut plan fits: each MILP round's plan
        # peaks over (its rows miss the step the replay peaks at) until the node limit ends the search.
        # Of the 33 ILP runs of tests/test_backend.py's zoo budgets, the 5 warm-started so took 121 of
        # their 140 s and found nothing faster; at budgets 1.00-1.06x the least peak of the zoo's HF
        # graphs (300-531 values), 27 such solves of 1-24 s each found a faster plan once (8.2%).
        notes.append("ILP skipped: no min-cut plan fits, the plan is the greedy least-peak search's")
    else:
        exact = solve_ilp(
            problem,
            budget,
            options,
            warm=cut,
            deadline=deadline,
            node_work=AUTO_MILP_NODE_WORK,
            max_rounds=AUTO_MILP_ROUNDS,
            tie_layers=tie,
        )
        if rank(exact) < rank(cut):
            result, name, notes = exact, "auto:ilp", [exact.note]
        elif exact.gap == 0.0 or exact.kept == cut.kept:
            # Min-cut's plan is at least as good as the ILP's: a proven optimum, or the ILP's
            # own answer, whose gap bound then holds for it.
            result = replace(cut, gap=exact.gap)
            among = " among plans tied across identical layers" if tie else ""
            proved = f"ILP proved it optimal{among}"
            notes.append(proved if exact.gap == 0.0 else f"ILP found nothing faster{among} ({exact.note})")
        else:
            notes.append(f"ILP found nothing faster ({exact.note})")
    return replace(
        result, solver=name, solve_seconds=time.perf_counter() - started, note="; ".join(filter(None, notes))
    )


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


def solve(
    problem: RematProblem, budget: int | None, solver: str = "auto", options: SolveOptions = SolveOptions()
) -> Decision:
    """Choose what to keep and what to recompute for ``problem`` under ``budget``.

    Args:
        problem: the joint graph.
        budget: peak bytes of the step to fit, or None for the fastest plan.
        solver: a name in ``SOLVERS``.
        options: work limits, safety-net time limit and progress callback.

    Returns:
        The decision. ``feasible=False`` means nothing the solver found fits;
        its ``peak_bytes`` is then the least peak found.

    Raises:
        ValueError: unknown solver, or a ``must_recompute`` tag that cannot be
            honoured.
        SolveTimeout: the solver ran past ``options.time_limit`` (a safety
            net: plans never depend on time).

    Example:
        >>> plan = fxremat.explain(model, x)                  # Plan.problem is the graph as data
        >>> d = solve(plan.problem, 2 << 30, "per_layer")
        >>> d.feasible, d.peak_bytes, len(d.recomputed)
    """
    fn = get_solver(solver)
    d = fn(problem, budget, options)
    logger.debug(
        "solve(%s): peak %d, recompute %.3gs, feasible %s in %.3fs",
        solver,
        d.peak_bytes,
        d.recompute_seconds,
        d.feasible,
        d.solve_seconds,
    )
    return d


def solve_within(
    problem: RematProblem,
    slack_seconds: float,
    solver: str = "auto",
    options: SolveOptions = SolveOptions(),
    fastest: Decision | None = None,
) -> Decision:
    """The least-peak plan whose estimated recompute time is at most ``slack_seconds``.

    Budget-driven solvers answer "fastest under a peak"; this turns them round:
    it bisects the budget between the least-memory plan's peak and the fastest
    plan's, keeping the lowest-peak answer that recomputes no more than the slack
    (at most ``WITHIN_ROUNDS`` solves: the same problem gives the same plan).

    Args:
        problem: the joint graph.
        slack_seconds: estimated recompute time allowed.
        solver: a name in ``SOLVERS``.
        options: as for ``solve``.
        fastest: the fastest plan when already solved (``solve(problem, None, solver)``).

    Returns:
        The decision (``fastest`` when nothing lower fits the slack).

    Example:
        >>> d = solve_within(problem, 0.02 * sum(problem.seconds))
        >>> d.recompute_seconds <= 0.02 * sum(problem.seconds)
        True
    """
    best = fastest if fastest is not None else solve(problem, None, solver, options)
    if slack_seconds <= best.recompute_seconds:
        return best
    # ``auto`` searches with min-cut (its first stage, 3x quicker than min-cut plus the ILP on
    # the benchmark GPT-2) and runs whole once, at the peak the search found.
    search = "mincut" if solver == "auto" else solver
    quickest = best
    least = _least(problem, search, options, slack_seconds)
    if least.recompute_seconds <= slack_seconds:
        best = _leaner(least, best)
    too_slow, fits = least.peak_bytes, best.peak_bytes  # below ``fits``: too slow or unknown
    resolution = max(1, int(WITHIN_RESOLUTION * best.peak_bytes))
    for _ in range(WITHIN_ROUNDS):
        if fits - too_slow <= resolution:
            break
        target = (too_slow + fits) // 2
        d = solve(problem, target, search, options)
        if d.feasible and d.recompute_seconds <= slack_seconds:
            best = _leaner(d, best)
            fits = min(target, d.peak_bytes)
        else:
            too_slow = target
    if search != solver and best is not quickest:
        d = solve(problem, best.peak_bytes, solver, options)
        if d.feasible and d.recompute_seconds <= slack_seconds:
            best = _leaner(d, best)
    return best


def _least(problem: RematProblem, search: str, options: SolveOptions, slack_seconds: float) -> Decision:
    """The bisection's lower end: the least peak ``search`` finds (budget 1).

    Min-cut's greedy search below its sweep (up to ``WITHIN_GREEDY_SHARE`` of
    ``GREEDY_MAX_WORK``) runs only when the sweep's least cut is within the slack, where
    its lower peak could be the answer. From a cut too slow for the slack its flips, most of them
    recomputing more, rarely come back within it: before, it mostly just moved this
    end (13 of the 21 s of a 32-layer Llama-3-8B shape's no-budget search).
    """
    if search != "mincut":
        return solve(problem, 1, search, options)
    least = solve_mincut(problem, 1, options, search_below=False)
    if least.recompute_seconds > slack_seconds:
        return least
    return solve_mincut(problem, 1, options, greedy_share=WITHIN_GREEDY_SHARE)


def _leaner(a: Decision, b: Decision) -> Decision:
    """The one with the lower peak (then less recompute); ``b`` on a tie."""
    return a if (a.peak_bytes, a.recompute_seconds) < (b.peak_bytes, b.recompute_seconds) else b
