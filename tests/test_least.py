"""The least-memory plan is judged on its programs: the search's, or per-layer checkpointing's when
those programs peak lower (the search ranks plans by the solver's model, which can disagree)."""

from __future__ import annotations

import warnings

import fxremat
from fxremat import planner
from fxremat.solvers.policies import keep_all
from fxremat.solvers.schedule import decision as decision_of
from zoo import ZOO


def test_per_layer_checkpointing_is_the_least_plan_when_its_programs_peak_lower(monkeypatch):
    model, inputs = ZOO["transformer"]()
    per_layer: list[set[str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = fxremat.explain(model, *inputs, inner="eager", solver="per_layer")
        solve = planner.solve

        def worst_least_search(problem, budget, solver, options):
            if budget == 1:  # the least-peak search, made to return the save-all plan
                return decision_of(problem, sorted(keep_all(problem)), budget, solver)
            d = solve(problem, budget, solver, options)
            if solver == "per_layer":
                per_layer.append({problem.names[v] for v in d.kept})
            return d

        monkeypatch.setattr(planner, "solve", worst_least_search)
        least = fxremat.explain(model, *inputs, inner="eager", budget=1, on_infeasible="min")
    assert least.solver.endswith("per_layer") and "per-layer checkpointing's plan" in least.note
    assert least.predicted_peak == layers.predicted_peak
    # Names from the same trace: what Dynamo traced earlier in the process can rename the nodes of a
    # later trace of the same model (an explain of another model first adds two nodes to this one's).
    assert per_layer and {r.name for r in least.kept} == per_layer[-1]
