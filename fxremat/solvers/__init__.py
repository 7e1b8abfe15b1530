"""Solvers: pure functions (problem, budget, options) -> Decision. No torch here.

``solve(problem, budget, solver)`` picks one from ``SOLVERS`` by name. Modules:
``types`` (problem, decision, options), ``schedule`` (closure, programs,
liveness), ``rules`` (what every solver shares), ``memo`` (work kept per
problem across solves), ``policies`` (reference policies), ``mincut``, ``ilp``
and ``registry``.
"""

from .registry import SOLVERS, get_solver, solve
from .types import Decision, RematProblem, SolveOptions, SolveTimeout

__all__ = ["SOLVERS", "get_solver", "solve", "Decision", "RematProblem", "SolveOptions", "SolveTimeout"]
