"""Work kept per problem across solves: the planner solves one problem many times.

The budget search moves its target, ``solve_within`` bisects, ``auto`` runs
min-cut and then the ILP: each solve of the same ``RematProblem`` object cuts
the same pieces and simulates many of the same kept sets. What depends on the
problem alone is kept here for the last few problems (by identity: a problem
is immutable, and a changed one is a new object).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from .types import RematProblem

__all__ = ["PerProblem", "PROBLEMS_KEPT"]

T = TypeVar("T")

# Problems whose work is kept. A compile plans one problem at a time; a few more cover
# the chunked and whole variants of one graph and explain's neighbours.
PROBLEMS_KEPT = 8


class PerProblem(Generic[T]):
    """One value per problem, made by ``make`` on first use, for the last ``PROBLEMS_KEPT`` problems.

    Example:
        >>> seen = PerProblem(lambda problem: {})
        >>> seen.get(problem) is seen.get(problem)
        True
    """

    def __init__(self, make: Callable[[RematProblem], T]) -> None:
        self._make = make
        self._values: OrderedDict[int, tuple[weakref.ref, T]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, problem: RematProblem) -> T:
        with self._lock:
            entry = self._values.get(id(problem))
            if entry is not None and entry[0]() is problem:
                self._values.move_to_end(id(problem))
                return entry[1]
            value = self._make(problem)
            self._values[id(problem)] = (weakref.ref(problem), value)
            while len(self._values) > PROBLEMS_KEPT:
                self._values.popitem(last=False)
            return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
