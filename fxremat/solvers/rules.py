"""The rules every solver shares, so that they all judge plans the same way.

``rules`` resolves the problem's tags once (and raises when a
``must_recompute`` tag cannot be honoured), ``admit`` applies them to a kept
set, and ``rank``/``best`` order decisions (least recompute time among plans
that fit, else least peak). ``Deadline`` is the wall-clock safety net of one
solve: it never changes a plan, it raises ``SolveTimeout``.

Example:
    >>> rule = rules(problem)
    >>> kept = admit(rule, schedule.bw_reads(problem))
    >>> best([schedule.decision(problem, kept, budget, "mine")]).feasible
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from . import schedule
from .types import Decision, RematProblem, SolveOptions, SolveTimeout

__all__ = ["Rules", "rules", "admit", "rank", "best", "forward_ancestors", "report_progress", "Deadline"]


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
    return schedule.ancestors(problem, roots, problem.forward_ids())


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
                stuck[v] = (
                    f"it reads {problem.names[blocked_by[0]]} (id {blocked_by[0]}), which cannot be recomputed or kept"
                )
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
    return Rules(
        needed=needed,
        relevant=tuple(sorted(relevant)),
        no_keep=no_keep,
        always_keep=always_keep,
        no_recompute=no_recompute,
    )


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


@dataclass(frozen=True)
class Deadline:
    """The wall-clock safety net of one solve, shared by the solves nested in it.

    Plans never depend on it: solvers stop on work limits (MILP nodes and
    rounds, simulations), and ``check`` raises ``SolveTimeout`` rather than
    return whatever was found when the clock ran out.

    Attributes:
        solver: the solver whose limit it is, for the error message.
        limit: ``SolveOptions.time_limit``, seconds (``math.inf``: none).
        at: ``time.perf_counter()`` value past which ``check`` raises.
    """

    solver: str
    limit: float
    at: float

    @classmethod
    def start(cls, solver: str, options: SolveOptions) -> Deadline:
        """A deadline ``options.time_limit`` seconds from now."""
        return cls(solver, options.time_limit, time.perf_counter() + options.time_limit)

    def left(self) -> float:
        """Seconds until the deadline (negative once past it; ``math.inf`` without one)."""
        return math.inf if math.isinf(self.limit) else self.at - time.perf_counter()

    def check(self, doing: str) -> None:
        """Raise ``SolveTimeout`` when the deadline has passed.

        Args:
            doing: what the solver was doing, for the message.
        """
        if self.left() < 0:
            raise SolveTimeout(self.solver, self.limit, doing)
