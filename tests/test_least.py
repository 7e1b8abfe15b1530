"""The least-memory plan is judged on its programs: the search's, or per-layer checkpointing's when
those programs peak lower (the search ranks plans by the solver's model, which can disagree)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

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


class _Residual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        if stride == 1 and cin == cout:
            self.skip = nn.Identity()

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.skip(x))


class _ResNet(nn.Module):
    """benchmarks/compare.py's CNN, small: 4 stages x 2 residual blocks."""

    def __init__(self, widths=(8, 16, 32, 64)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, cout in enumerate(widths):
            blocks += [_Residual(cin, cout, 1 if i == 0 else 2), _Residual(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.blocks(self.stem(x)).mean(dim=(2, 3))), y)


def test_the_least_peak_search_is_bounded_by_work_not_by_a_flat_count(monkeypatch):
    # A flat 100 simulations stopped the greedy search before one pass over this CNN's values; the
    # work bound (GREEDY_MAX_WORK) lets it run to its end on graphs of this size.
    from fxremat.solvers import mincut

    torch.manual_seed(0)
    inputs = (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)))
    plans = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, work in (("flat", 0), ("work", mincut.GREEDY_MAX_WORK)):
            monkeypatch.setattr(mincut, "GREEDY_MAX_WORK", work)  # 0: GREEDY_MIN_EVALS simulations
            torch.manual_seed(0)
            plans[name] = fxremat.explain(_ResNet(), *inputs, inner="eager", budget=1, on_infeasible="min")
    assert "stopped at its limit of 100 simulations" in plans["flat"].note
    assert "stopped at its limit" not in plans["work"].note
    assert plans["work"].predicted_peak < plans["flat"].predicted_peak
