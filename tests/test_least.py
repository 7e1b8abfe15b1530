"""The least-memory plan is judged on its programs: the search's, or per-layer checkpointing's when
those programs peak lower (the search ranks plans by the solver's model, which can disagree)."""

from __future__ import annotations

import warnings

import torch

import fxremat
from fxremat import planner
from fxremat.solvers.policies import keep_all
from fxremat.solvers.schedule import decision as decision_of
from checks import load_benchmark
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
        # Nested checkpoints start from the least plan and go lower (tests/test_twice.py); this test is
        # about which plan they start from.
        monkeypatch.setattr(planner, "nested_least", lambda problem, start: (tuple(start), 0, 0))
        least = fxremat.explain(model, *inputs, inner="eager", budget=1, on_infeasible="min")
    assert least.solver.endswith("per_layer") and "per-layer checkpointing's plan" in least.note
    assert least.predicted_peak == layers.predicted_peak
    # Names from the same trace: what Dynamo traced earlier in the process can rename the nodes of a
    # later trace of the same model (an explain of another model first adds two nodes to this one's).
    assert per_layer and {r.name for r in least.kept} == per_layer[-1]


# convolution_backward's workspace in the benchmark CNN at batch 2 (weight shape -> bytes), measured once
# with oneDNN and frozen here: what oneDNN picks differs between hosts (Xeon, EPYC) and thread counts,
# and with it where the greedy search ends. Frozen, the problem is the same on every host.
_CONV_BACKWARD_SCRATCH = {
    (8, 3, 3, 3): 17248, (8, 8, 3, 3): 51456, (16, 8, 1, 1): 61976, (16, 8, 3, 3): 66072,
    (16, 16, 3, 3): 33792, (32, 16, 1, 1): 51224, (32, 16, 3, 3): 67608, (32, 32, 3, 3): 77824,
    (64, 32, 1, 1): 51224, (64, 32, 3, 3): 151552, (64, 64, 3, 3): 748800,
}  # fmt: skip


def _frozen_scratch(nodes, channels_last=False):
    assert not channels_last  # the eager inner compiler lays nothing out
    conv_backward = torch.ops.aten.convolution_backward.default
    return {
        n: _CONV_BACKWARD_SCRATCH[tuple(n.args[2].meta["val"].shape)]
        for n in nodes
        if n.op == "call_function" and n.target is conv_backward
    }


def test_the_least_peak_search_is_bounded_by_work_not_by_a_flat_count(monkeypatch):
    # A flat 100 simulations stopped the greedy search before one pass over the values of the benchmark
    # CNN (4 stages, small); the work bound (GREEDY_MAX_WORK) lets it run to its end on such graphs.
    from fxremat.solvers import mincut

    compare = load_benchmark("compare")
    monkeypatch.setattr(planner, "measure_scratch", _frozen_scratch)
    plans = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, work in (("flat", 0), ("work", mincut.GREEDY_MAX_WORK)):
            monkeypatch.setattr(mincut, "GREEDY_MAX_WORK", work)  # 0: GREEDY_MIN_EVALS simulations
            torch.manual_seed(0)  # the CNN's weights and inputs
            cnn = compare.build_cnn(False, size=dict(widths=(8, 16, 32, 64), image=16, batch=2))
            plans[name] = fxremat.explain(cnn.model, *cnn.inputs, inner="eager", budget=1, on_infeasible="min")
    assert "stopped at its limit of 100 simulations" in plans["flat"].note
    assert "stopped at its limit" not in plans["work"].note
    assert plans["work"].predicted_peak < plans["flat"].predicted_peak


def test_a_share_of_the_greedy_work_scales_its_floor_too():
    """``solve_within``'s lower end searches with a share of the work (``WITHIN_GREEDY_SHARE``): of
    ``GREEDY_MAX_WORK`` on small graphs, of the floor of ``GREEDY_MIN_EVALS`` simulations on large ones
    (the Llama-3-70B shape's 17,341 nodes: the floor bound it, 100 simulations; ``solve_within`` 8.2 -> 3.9 s)."""
    from types import SimpleNamespace

    from fxremat.solvers import mincut

    small, large = SimpleNamespace(names=range(1_000)), SimpleNamespace(names=range(20_000))
    assert mincut.greedy_max_evals(small) == mincut.GREEDY_MAX_WORK // 1_000
    assert mincut.greedy_max_evals(small, 0.25) == mincut.GREEDY_MAX_WORK // 4 // 1_000
    assert mincut.greedy_max_evals(large) == mincut.GREEDY_MIN_EVALS
    assert mincut.greedy_max_evals(large, 0.25) == mincut.GREEDY_MIN_EVALS // 4


def test_the_least_plan_never_peaks_above_the_plan_without_a_budget():
    # HF Llama in bf16 with its loss whole: under Inductor, PyTorch's own partition (the plan with no
    # budget) peaks lower than the least-peak search's plan and per-layer checkpointing's, so the least
    # plan was above the no-budget one and budgets between them were refused. One layer, vocabulary 8192,
    # 64 tokens: without PyTorch's partition among the least plan's candidates, the least plan peaks at
    # 4375432 B, above the no-budget plan's 4368520 B; with it, at 4368264 B. (The former size, two
    # layers, vocabulary 4096, 128 tokens, no longer showed it: per-layer checkpointing was lower there.)
    model, _ = ZOO["llama"](
        vocab_size=8192,
        intermediate_size=256,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        num_hidden_layers=1,
    )
    model = model.to(torch.bfloat16)
    inputs = (torch.randint(0, 8192, (1, 64)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = fxremat.explain(model, *inputs, chunk_loss="off")
        least = fxremat.explain(model, *inputs, chunk_loss="off", budget=1, on_infeasible="min")
        # A budget the plan without one meets is never refused.
        held = fxremat.explain(model, *inputs, chunk_loss="off", budget=free.predicted_peak)
    assert least.predicted_peak <= free.predicted_peak
    assert held.feasible and held.predicted_peak <= free.predicted_peak
