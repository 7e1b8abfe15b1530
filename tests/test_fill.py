"""Plans between the solver's: when the plan that fits leaves much of the budget unused and the next
faster one peaks over it, the planner keeps part of the faster plan's values (``planner._filled``)."""

from __future__ import annotations

import pytest

from fxremat import planner
from fxremat.planner import CLOSE_ENOUGH, FILL_ROUNDS, Lowered
from fxremat.solvers import solve
from test_solvers import transformer

# The programs peak this much above the solver's model (under Inductor they differ).
OFFSET = 50_000


def _judge(calls: list):
    def judge(decision):
        calls.append(decision.kept)
        return Lowered(decision, None, None, None, peak=decision.peak_bytes + OFFSET)  # type: ignore[arg-type]

    return judge


@pytest.mark.parametrize("share", [0.2, 0.4, 0.6, 0.8])
def test_a_plan_between_a_fitting_plan_and_a_faster_one_uses_the_budget(share):
    problem = transformer(layers=4, pointwise=2, seq=128, hidden=64, heads=2, batch=2)
    fastest = solve(problem, None, "save_all")
    least = solve(problem, 1, "mincut")
    calls: list = []
    judge = _judge(calls)
    best, over = judge(least), judge(fastest)
    budget = int(best.peak + share * (over.peak - best.peak))
    assert best.peak < CLOSE_ENOUGH * budget < budget < over.peak
    calls.clear()
    got = planner._filled(problem, best, over, fastest, judge, budget)
    assert got.peak <= budget
    # Close to the budget, or short of it by less than one more value of the faster plan.
    left = [problem.nbytes[problem.storage[v]] for v in set(fastest.kept) - set(got.decision.kept)]
    assert got.peak >= CLOSE_ENOUGH * budget or budget - got.peak < max(left)
    assert got.decision.recompute_seconds < best.decision.recompute_seconds
    assert set(best.decision.kept) <= set(got.decision.kept)
    assert "more values kept than the solver's plan" in got.decision.note
    assert len(calls) <= FILL_ROUNDS
    # The same inputs, the same plan: the search counts lowerings, never the clock.
    assert planner._filled(problem, best, over, fastest, judge, budget).decision.kept == got.decision.kept


def _least_plan():
    """A 2-layer problem, its fastest plan, a counting judge, its calls, and the least plan judged."""
    problem = transformer(layers=2, pointwise=2, seq=128, hidden=64, heads=2, batch=2)
    calls: list = []
    judge = _judge(calls)
    best = judge(solve(problem, 1, "mincut"))
    calls.clear()
    return problem, solve(problem, None, "save_all"), judge, calls, best


def test_a_plan_close_to_the_budget_is_left_as_it_is():
    problem, fastest, judge, calls, best = _least_plan()
    assert planner._filled(problem, best, None, fastest, judge, best.peak + 1) is best
    assert not calls


def test_a_plan_that_recomputes_next_to_nothing_is_left_as_it_is():
    problem, fastest, judge, calls, best = _least_plan()
    budget = 2 * best.peak
    assert planner._filled(problem, best, None, fastest, judge, budget, best.decision.recompute_seconds) is best
    assert not calls
    assert planner._filled(problem, best, None, fastest, judge, budget) is not best
