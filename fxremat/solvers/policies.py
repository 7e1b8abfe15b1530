"""Reference policies: tiny functions ``problem -> kept ids``, named for what they keep.

Like JAX's ``checkpoint_policies``: ``keep_all``, ``keep_nothing``,
``keep_layer_inputs`` and ``keep_segment_boundaries``; ``schedule.close``
derives what is then recomputed. The ``solve_*`` wrappers at the end give each
policy the shared solver signature ``(problem, budget, options) -> Decision``.
The rules every solver shares (``rules``, ``admit``, ``rank``, ...) live in
``rules.py``.

Example:
    >>> kept = keep_layer_inputs(problem)
    >>> d = solve_per_layer(problem, budget=2 << 30, options=SolveOptions())
    >>> d.solver, d.feasible
    ('per_layer', True)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from . import schedule
from .rules import admit, rules
from .types import Decision, RematProblem, SolveOptions

__all__ = [
    "has_layers",
    "layer_inputs",
    "segment_boundaries",
    "sqrt_segments",
    "keep_all",
    "keep_nothing",
    "keep_layer_inputs",
    "keep_segment_boundaries",
    "solve_save_all",
    "solve_save_inputs",
    "solve_per_layer",
    "solve_sqrt_n",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Structure: layers and segments
# --------------------------------------------------------------------------


def has_layers(problem: RematProblem) -> bool:
    """Whether any forward node is tagged with a layer index."""
    return any(problem.layer[v] >= 0 for v in range(problem.size) if problem.is_forward(v)) if problem.layer else False


def layer_inputs(problem: RematProblem) -> list[tuple[int, ...]]:
    """Per layer, in layer-index order: the forward values produced outside it and read inside it.

    These are what ``torch.utils.checkpoint`` around each layer saves (its
    arguments). Empty when the problem has no layer tags.
    """
    if not has_layers(problem):
        return []
    inputs: dict[int, set[int]] = {}
    for v in sorted(problem.forward_ids()):
        layer = problem.layer[v]
        if layer < 0:
            continue
        outside = (u for u in problem.inputs[v] if problem.is_forward(u) and problem.layer[u] != layer)
        inputs.setdefault(layer, set()).update(outside)
    return [tuple(sorted(inputs[layer])) for layer in sorted(inputs)]


def segment_boundaries(problem: RematProblem, segments: int) -> list[tuple[int, ...]]:
    """Split the forward order into ``segments`` equal runs; per boundary, the values live across it.

    A value is live across a boundary when it is produced before it and read
    by a forward node at or after it.

    Args:
        problem: the joint graph.
        segments: number of runs (at least 1).

    Returns:
        One sorted tuple per boundary (``segments - 1`` of them).
    """
    order = sorted(problem.forward_ids())
    n = len(order)
    segments = max(1, min(segments, n))
    position = {v: i for i, v in enumerate(order)}
    # Last forward position at which each forward value is read.
    last_read: dict[int, int] = {}
    for v in order:
        for u in problem.inputs[v]:
            if problem.is_forward(u):
                last_read[u] = max(last_read.get(u, -1), position[v])
    boundaries = []
    for j in range(1, segments):
        b = math.ceil(j * n / segments)
        boundaries.append(tuple(sorted(u for u, last in last_read.items() if position[u] < b <= last)))
    return boundaries


def sqrt_segments(problem: RematProblem) -> int:
    """Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"): about sqrt(n) segments."""
    return max(1, round(math.sqrt(len(problem.forward_ids()))))


# --------------------------------------------------------------------------
# Policies: problem -> kept ids
# --------------------------------------------------------------------------


def keep_all(problem: RematProblem) -> tuple[int, ...]:
    # Keep every forward value the backward reads: nothing is recomputed.
    return schedule.bw_reads(problem)


def keep_nothing(problem: RematProblem) -> tuple[int, ...]:
    # Keep only what the user holds anyway (forward outputs); recompute the rest from graph inputs.
    return tuple(sorted(set(problem.fw_outputs)))


def keep_layer_inputs(problem: RematProblem) -> tuple[int, ...]:
    # Keep each layer's inputs (torch.utils.checkpoint per layer); outside layers keep what the backward reads.
    layer = problem.layer or (-1,) * problem.size
    outside = [v for v in schedule.bw_reads(problem) if layer[v] < 0]
    return tuple(sorted(set(outside).union(*layer_inputs(problem), problem.fw_outputs)))


def keep_segment_boundaries(problem: RematProblem, segments: int | None = None) -> tuple[int, ...]:
    # Keep values live across ~sqrt(n) evenly spaced cuts of the forward (Chen et al. 2016).
    segments = sqrt_segments(problem) if segments is None else segments
    return tuple(sorted(set(problem.fw_outputs).union(*segment_boundaries(problem, segments))))


# --------------------------------------------------------------------------
# Solver wrappers
# --------------------------------------------------------------------------


def _policy_decision(
    problem: RematProblem, kept, budget: int | None, solver: str, started: float, note: str = ""
) -> Decision:
    rule = rules(problem)
    d = schedule.decision(problem, admit(rule, kept), budget, solver, note=note)
    return replace(d, solve_seconds=time.perf_counter() - started)


def solve_save_all(problem: RematProblem, budget: int | None, options: SolveOptions = SolveOptions()) -> Decision:
    """Keep every forward value the backward reads (no recomputation).

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None.
        options: unused; accepted for the shared signature.

    Returns:
        The decision, ``feasible=False`` when its peak exceeds the budget.
    """
    return _policy_decision(problem, keep_all(problem), budget, "save_all", time.perf_counter())


def solve_save_inputs(problem: RematProblem, budget: int | None, options: SolveOptions = SolveOptions()) -> Decision:
    """Keep nothing: the backward recomputes every value it reads from the graph inputs.

    ``never_recompute`` and ``must_save`` values are still kept (closure), and
    so are forward outputs, which the user holds anyway.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None.
        options: unused; accepted for the shared signature.

    Returns:
        The decision, ``feasible=False`` when its peak exceeds the budget.
    """
    return _policy_decision(problem, keep_nothing(problem), budget, "save_inputs", time.perf_counter())


def solve_sqrt_n(problem: RematProblem, budget: int | None, options: SolveOptions = SolveOptions()) -> Decision:
    """Chen's sqrt(n) checkpoints: keep the values live across each of ~sqrt(n) segment boundaries.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None.
        options: unused; accepted for the shared signature.

    Returns:
        The decision, ``feasible=False`` when its peak exceeds the budget.
    """
    return _policy_decision(problem, keep_segment_boundaries(problem), budget, "sqrt_n", time.perf_counter())


def solve_per_layer(problem: RematProblem, budget: int | None, options: SolveOptions = SolveOptions()) -> Decision:
    """Keep only layer inputs, as ``torch.utils.checkpoint`` around every layer does.

    Without layer tags (``problem.layer`` empty or all -1) this falls back to
    ``sqrt_n`` and says so in ``Decision.note``.

    Args:
        problem: the joint graph.
        budget: peak bytes to fit, or None.
        options: unused; accepted for the shared signature.

    Returns:
        The decision, ``feasible=False`` when its peak exceeds the budget.
    """
    started = time.perf_counter()
    if not has_layers(problem):
        logger.info("per_layer: the problem has no layer tags; using sqrt_n segments instead")
        note = "no layer tags in the graph: used sqrt_n segments instead of layer inputs"
        return _policy_decision(problem, keep_segment_boundaries(problem), budget, "per_layer", started, note)
    return _policy_decision(problem, keep_layer_inputs(problem), budget, "per_layer", started)
