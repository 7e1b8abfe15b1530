"""Solvers: pure functions (problem, budget, options) -> Decision. No torch here."""
