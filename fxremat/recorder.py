"""The plans this process made: naming, a bounded history, dumps.

``fxremat.plans()`` reads from here. Planning (``planner.py``) hands each
finished plan to ``record``; nothing below the planner touches this state.
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from collections import deque
from pathlib import Path

from .budget import format_bytes
from .options import Options
from .plan import Plan

__all__ = ["plans", "clear_plans", "new_graph_name", "record", "MAX_PLANS"]

log = logging.getLogger("fxremat")

# Plans kept for fxremat.plans(). Each holds its problem and programs' source (a few
# MB for a large model): a long job that recompiles for every new shape must not
# grow without bound. 64 covers every graph of a model with breaks and its recompiles.
MAX_PLANS = 64

_LOCK = threading.Lock()
_PLANS: deque[Plan] = deque(maxlen=MAX_PLANS)
# Names are unique in the process, also across clear_plans(): "graph 14" is one graph.
_NAMES = itertools.count()


def new_graph_name() -> str:
    """A name for the graph being planned (``"graph 0"``, ``"graph 1"``, ...), never reused."""
    with _LOCK:
        return f"graph {next(_NAMES)}"


def plans() -> list[Plan]:
    """The plans the backend made in this process, oldest first (the last ``MAX_PLANS``).

    Returns:
        A new list (later compiles do not change it), one Plan per graph
        planned; a recompile (new shapes, a graph break) adds another.

    Example:
        >>> compiled = torch.compile(model, backend="fxremat", options={"budget": "1GiB"})
        >>> compiled(x).sum().backward()
        >>> print(fxremat.plans()[-1])
    """
    with _LOCK:
        return list(_PLANS)


def clear_plans() -> None:
    """Forget the recorded plans (later graphs keep counting: names are never reused).

    Returns:
        None.

    Example:
        >>> fxremat.clear_plans()
        >>> fxremat.plans()
        []
    """
    with _LOCK:
        _PLANS.clear()


def record(plan: Plan, options: Options) -> None:
    """Remember ``plan`` and save it where asked (graphs of one step share the budget: ``steps.py``)."""
    with _LOCK:
        _PLANS.append(plan)
    log.info(
        "%s: %d nodes, budget %s, predicted peak %s, kept %s, recomputed %d values (%.2f ms est.), solver %s in %.0f ms",
        plan.graph,
        plan.num_nodes,
        "none" if options.budget is None else format_bytes(options.budget),
        format_bytes(plan.predicted_peak),
        format_bytes(plan.saved_bytes),
        len(plan.recomputed),
        plan.recompute_seconds * 1e3,
        plan.solver,
        plan.solve_seconds * 1e3,
    )
    if options.dump_dir:
        try:
            plan.save(Path(options.dump_dir) / plan.graph.replace(" ", "_"))
        except OSError as exc:  # the plan is good and will run; only its files are missing
            warnings.warn(
                f"fxremat could not save {plan.graph}'s plan under dump_dir={options.dump_dir!r}: {exc}", stacklevel=3
            )
