"""Identical layers solved once (``solvers/layers.py``, ``solve_ilp(tie_layers=True)``), on synthetic stacks.

Plain data, no torch: the GPT-like stacks of tests/test_solvers.py.
"""

from __future__ import annotations

import time

import pytest

from fxremat.solvers.ilp import solve_ilp
from fxremat.solvers.layers import FREE_FIRST, FREE_LAST, repeated_values
from fxremat.solvers.mincut import solve_mincut
from fxremat.solvers.policies import keep_all
from fxremat.solvers.registry import AUTO_ILP_MAX_FORWARD, solve_auto
from fxremat.solvers.rules import rules
from fxremat.solvers.schedule import decision
from test_solvers import transformer


def _budget(problem, share: float) -> int:
    """``share`` of the way from the least peak min-cut reaches to the fastest plan's peak."""
    least = solve_mincut(problem, 1).peak_bytes
    fastest = decision(problem, keep_all(problem), None, "save_all").peak_bytes
    return int(least + share * (fastest - least))


def test_each_class_holds_one_value_per_tied_layer_at_the_same_place():
    layers = 8
    problem = transformer(layers=layers, pointwise=2)
    rule = rules(problem)
    classes = repeated_values(problem, rule)
    assert classes
    tied = layers - FREE_FIRST - FREE_LAST
    per_layer = [v for v, layer in enumerate(problem.layer) if layer == FREE_FIRST and problem.is_forward(v)]
    stride = len(per_layer)  # every layer of the synthetic stack has as many forward nodes
    relevant = set(rule.relevant)
    for same in classes:
        assert len(same) == tied
        assert [problem.layer[v] for v in same] == list(range(FREE_FIRST, FREE_FIRST + tied))
        assert all(b - a == stride for a, b in zip(same, same[1:]))
        assert all(v in relevant for v in same)
    # A layer's output, read by the next layer, is never tied: the global problem places checkpoints.
    tied_ids = {v for same in classes for v in same}
    readers = {u: [v for v, ins in enumerate(problem.inputs) if u in ins] for u in tied_ids}
    assert all(problem.layer[w] == problem.layer[u] for u, ws in readers.items() for w in ws if problem.is_forward(w))


def test_no_classes_without_enough_identical_layers():
    fewest = FREE_FIRST + FREE_LAST + 3  # MIN_COPIES tied, the rest left free
    short = transformer(layers=fewest - 1, pointwise=2)
    assert repeated_values(short, rules(short)) == ()
    enough = transformer(layers=fewest, pointwise=2)
    assert {len(same) for same in repeated_values(enough, rules(enough))} == {3}


@pytest.mark.parametrize("share", [0.75, 0.25])
def test_tied_plans_are_uniform_and_as_fast_as_the_whole_graph_ilp(share):
    problem = transformer(layers=6, pointwise=2)
    budget = _budget(problem, share)
    warm = solve_mincut(problem, budget)
    whole = solve_ilp(problem, budget, warm=warm)
    tied = solve_ilp(problem, budget, warm=warm, tie_layers=True)
    assert tied.feasible and tied.peak_bytes <= budget
    kept = set(tied.kept)
    for same in repeated_values(problem, rules(problem)):
        assert len({v in kept for v in same}) == 1  # one decision for every copy
    assert tied.recompute_seconds <= whole.recompute_seconds * 1.01
    assert "identical layers solved as one" in tied.note


def test_auto_ties_the_layers_of_a_graph_too_large_for_the_whole_ilp():
    problem = transformer(layers=12, pointwise=6)
    assert len(problem.forward_ids()) > AUTO_ILP_MAX_FORWARD
    budget = _budget(problem, 0.5)
    started = time.perf_counter()
    d = solve_auto(problem, budget)
    assert time.perf_counter() - started < 20  # about 1 s; the net only catches a runaway search
    assert d.feasible and "tied across identical layers" in d.note
    assert d.recompute_seconds <= solve_mincut(problem, budget).recompute_seconds
