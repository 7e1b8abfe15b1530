"""Reference policies, and the rules every solver shares.

A policy is a tiny function ``problem -> kept ids`` named for what it keeps,
like JAX's ``checkpoint_policies``; ``schedule.close`` derives what is then
recomputed. The ``solve_*`` wrappers at the end give each policy the shared
solver signature ``(problem, budget, options) -> Decision``.

The first section holds what every solver needs so that they all judge plans
the same way: ``rules`` resolves the problem's tags once (and raises when a
``must_recompute`` tag cannot be honoured), ``admit`` applies them to a kept
set, and ``rank``/``best`` order decisions (least recompute time among plans
that fit, else least peak).

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
from dataclasses import dataclass, replace

from . import schedule
from .types import FORWARD, Decision, RematProblem, SolveOptions

__all__ = [
    "Rules",
    "rules",
    "admit",
    "rank",
    "best",
    "forward_ancestors",
    "report_progress",
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
# Rules shared by every solver
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    """The problem's tags, resolved once into what any plan must respect.

    Attributes:
        needed: forward ids the backward reads, sorted.
        relevant: forward ids whose status can matter (``needed`` and their
            forward ancestors), sorted. Nothing else is ever kept or recomputed.
        no_keep: ``must_recompute`` ids: never in a kept set.
        always_keep: relevant ids kept whenever they are needed: values the
            user holds anyway (forward outputs: keeping them is free, and
            dominates recomputing a second copy) and readers of values that
            can be neither kept nor recomputed (a ``must_recompute`` value
            that is also ``never_recompute``/``must_save``).
        no_recompute: relevant ids that are never recomputed: ``always_keep``
            plus ``never_recompute`` and ``must_save``, and the stuck values
            above (which are also in ``no_keep``: no plan may need them).
    """

    needed: tuple[int, ...]
    relevant: tuple[int, ...]
    no_keep: frozenset[int]
    always_keep: frozenset[int]
    no_recompute: frozenset[int]


def forward_ancestors(problem: RematProblem, roots) -> set[int]:
    """The forward ids among ``roots`` and their forward ancestors."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        stack.extend(u for u in problem.inputs[v] if problem.phase[u] == FORWARD and u not in seen)
    return seen


def rules(problem: RematProblem) -> Rules:
    """Resolve the problem's tags into constraints on kept sets.

    A ``must_recompute`` value that is also ``never_recompute`` or
    ``must_save`` can be neither kept nor recomputed; neither can a
    ``must_recompute`` value that reads one. Plans avoid needing them by
    keeping their readers. When the backward itself reads such a value no
    plan exists.

    Args:
        problem: the joint graph.

    Returns:
        The resolved ``Rules``.

    Raises:
        ValueError: a ``must_recompute`` value is needed by the backward but
            cannot be recomputed; the message names it and the tag to drop.
    """
    needed = schedule.bw_reads(problem)
    relevant = forward_ancestors(problem, needed)
    no_keep = frozenset(problem.must_recompute)
    pinned_by_tag = set(problem.never_recompute) | set(problem.must_save)
    # Values that can be neither kept nor recomputed, in id (topological) order.
    stuck: dict[int, str] = {}
    for v in sorted(no_keep):
        if v in pinned_by_tag:
            why = "never_recompute" if v in problem.never_recompute else "must_save"
            stuck[v] = f"it is also tagged {why}"
        else:
            blocked_by = [u for u in problem.inputs[v] if u in stuck]
            if blocked_by:
                stuck[v] = f"it reads {problem.names[blocked_by[0]]} (id {blocked_by[0]}), which cannot be recomputed or kept"
    for v in needed:
        if v in stuck:
            raise ValueError(
                f"node {problem.names[v]} (id {v}) is tagged must_recompute, but the backward reads it and {stuck[v]}. "
                "Drop its MUST_RECOMPUTE tag (or the conflicting tag) so a plan can exist."
            )
    readers_of_stuck = {v for v in relevant if v not in stuck and any(u in stuck for u in problem.inputs[v])}
    free = {v for v in problem.fw_outputs if v in relevant}
    always_keep = frozenset((readers_of_stuck | free) - no_keep)
    no_recompute = frozenset(always_keep | (pinned_by_tag & relevant) | (set(stuck) & relevant))
    return Rules(needed=needed, relevant=tuple(sorted(relevant)), no_keep=no_keep, always_keep=always_keep, no_recompute=no_recompute)


def admit(rule: Rules, kept) -> tuple[int, ...]:
    """Make a kept set respect the rules: drop ``must_recompute`` ids, add ``always_keep``.

    Args:
        rule: from ``rules(problem)``.
        kept: any iterable of forward ids.

    Returns:
        The admitted kept set, a sorted tuple.
    """
    return tuple(sorted((set(kept) | rule.always_keep) - rule.no_keep))


def rank(d: Decision) -> tuple:
    """Sort key: plans that fit by (recompute seconds, peak), then the rest by (peak, seconds).

    Ties fall to fewer kept values, then to the kept ids themselves, so the
    order never depends on the order candidates were found in.
    """
    if d.feasible:
        return (0, d.recompute_seconds, d.peak_bytes, len(d.kept), d.kept)
    return (1, d.peak_bytes, d.recompute_seconds, len(d.kept), d.kept)


def best(decisions) -> Decision:
    """The decision a solver should return among candidates judged against one budget."""
    return min(decisions, key=rank)


def report_progress(options: SolveOptions, done: int, total: int, message: str) -> None:
    """Call ``options.progress(done, total, message)`` when one was given."""
    if callable(options.progress):
        options.progress(done, total, message)


# --------------------------------------------------------------------------
# Structure: layers and segments
# --------------------------------------------------------------------------


def _forward_ids(problem: RematProblem) -> list[int]:
    return [v for v in range(problem.size) if problem.phase[v] == FORWARD]


def has_layers(problem: RematProblem) -> bool:
    """Whether any forward node is tagged with a layer index."""
    return any(problem.layer[v] >= 0 for v in _forward_ids(problem)) if problem.layer else False


def layer_inputs(problem: RematProblem) -> list[tuple[int, ...]]:
    """Per layer, in layer-index order: the forward values produced outside it and read inside it.

    These are what ``torch.utils.checkpoint`` around each layer saves (its
    arguments). Empty when the problem has no layer tags.
    """
    if not has_layers(problem):
        return []
    inputs: dict[int, set[int]] = {}
    for v in _forward_ids(problem):
        layer = problem.layer[v]
        if layer < 0:
            continue
        inputs.setdefault(layer, set()).update(u for u in problem.inputs[v] if problem.phase[u] == FORWARD and problem.layer[u] != layer)
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
    order = _forward_ids(problem)
    n = len(order)
    segments = max(1, min(segments, n))
    position = {v: i for i, v in enumerate(order)}
    # Last forward position at which each forward value is read.
    last_read: dict[int, int] = {}
    for v in order:
        for u in problem.inputs[v]:
            if problem.phase[u] == FORWARD:
                last_read[u] = max(last_read.get(u, -1), position[v])
    boundaries = []
    for j in range(1, segments):
        b = math.ceil(j * n / segments)
        boundaries.append(tuple(sorted(u for u, last in last_read.items() if position[u] < b <= last)))
    return boundaries


def sqrt_segments(problem: RematProblem) -> int:
    """Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"): about sqrt(n) segments."""
    return max(1, round(math.sqrt(len(_forward_ids(problem)))))


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


def _policy_decision(problem: RematProblem, kept, budget: int | None, solver: str, started: float, note: str = "") -> Decision:
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
