"""Solvers: pure functions (problem, budget, options) -> Decision. No torch here.

``solve(problem, budget, solver)`` picks one from ``SOLVERS`` by name.
"""

from .registry import SOLVERS, get_solver, solve
from .types import Decision, RematProblem, SolveOptions

__all__ = ["SOLVERS", "get_solver", "solve", "Decision", "RematProblem", "SolveOptions"]
