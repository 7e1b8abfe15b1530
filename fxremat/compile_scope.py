"""What the plans of one compile share: choices remembered, and plans set aside before code generation.

Compiling one graph can plan it several times: the budget refused, then the least-memory
plan (``on_infeasible="min"``); the loss whole, then in chunks (``chunking.py``); a step's
re-plan, then the plan of steps with ``.grad`` allocated (``steps.py``). Two tools keep
that from costing searches and code generation nobody uses:

- ``remembering``: inside the block, the planner reuses the choice it made for the same
  graph and options (``planner.choose``); the search is deterministic, so the choice is the
  one it would make again.
- ``vetoing(test)``: inside the block, a plan ``test`` refuses raises ``Vetoed`` from the
  partitioner, before Inductor generates any code for it (``planner.partition`` calls ``veto``);
  the block catches it and keeps the plan.

Example:
    >>> with remembering(), vetoing(lambda plan: plan.recompute_seconds > limit) as slower:
    ...     compiled = compile_graph(gm, example_inputs)
    >>> slower.plan  # the plan set aside (nothing compiled for it), or None
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["remembering", "remembered", "vetoing", "veto", "vetoes_active", "Vetoed", "SetAside"]

_REMEMBERED: list[dict[str, dict]] = []
_VETOES: list[Callable] = []


@contextlib.contextmanager
def remembering():
    """Inside the block, a graph planned again with the same options (whatever ``on_infeasible``)
    reuses the choice made for it in the block. Nested blocks share the outermost one's choices;
    leaving it forgets them."""
    outermost = not _REMEMBERED
    if outermost:
        _REMEMBERED.append({})
    try:
        yield
    finally:
        if outermost:
            _REMEMBERED.pop()


def remembered() -> dict[str, dict] | None:
    """The choices of the enclosing ``remembering`` block by key (``planner.choose`` fills it), or None."""
    return _REMEMBERED[-1] if _REMEMBERED else None


class Vetoed(Exception):
    """Raised by the partitioner inside ``vetoing`` when a test refused its plan: compiling stopped
    before any code was generated for it. ``plan`` is the refused plan (not recorded), ``test`` the
    test that refused it (a block catches only its own)."""

    def __init__(self, plan, test) -> None:
        super().__init__(f"fxremat {plan.graph}: plan set aside before code generation")
        self.plan, self.test = plan, test


@dataclass
class SetAside:
    """What a ``vetoing`` block yields: after it, the plan its test set aside, or None."""

    plan: "Plan | None" = None


@contextlib.contextmanager
def vetoing(test: Callable) -> Iterator[SetAside]:
    """Inside the block, a plan for which ``test(plan)`` is true stops the compile before code
    generation; the block ends there and its ``SetAside`` holds the plan. Blocks nest: the
    innermost test is asked first, and a block lets another block's ``Vetoed`` through."""
    set_aside = SetAside()
    _VETOES.append(test)
    try:
        yield set_aside
    except Vetoed as vetoed:
        if vetoed.test is not test:
            raise
        set_aside.plan = vetoed.plan
    finally:
        _VETOES.remove(test)


def veto(plan) -> None:
    """Raise ``Vetoed`` when a test of an enclosing ``vetoing`` block refuses ``plan``."""
    for test in reversed(_VETOES):
        if test(plan):
            raise Vetoed(plan, test)


def vetoes_active() -> bool:
    """Whether a ``vetoing`` block encloses the caller (``veto`` can refuse a plan)."""
    return bool(_VETOES)
