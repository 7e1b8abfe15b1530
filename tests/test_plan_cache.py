"""The plan cache: a graph planned in one run is not searched and lowered again in the next.

The suite runs with the cache off (``tests/conftest.py``); these tests turn it on, each in its own folder.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxremat
from fxremat import plan_cache, planner
from fxremat.passes import inductor_memory
from zoo import ZOO


@pytest.fixture
def cache(tmp_path, monkeypatch):
    # Its own folder (not FXREMAT_CACHE_DIR, which would also move the measured hardware profile).
    folder = tmp_path / "plans"
    monkeypatch.setenv("FXREMAT_PLAN_CACHE", "1")
    monkeypatch.setattr(plan_cache, "folder", lambda: folder)
    return folder


@pytest.fixture
def counted(monkeypatch):
    """Counts of solver runs and of Inductor dry lowerings."""
    calls = {"solve": 0, "lower": 0}
    solve, events = planner.solve, inductor_memory.inductor_program_events

    def counting_solve(problem, budget, name, *args):
        calls["solve"] += name != "save_all"  # the fastest plan's kept set is rebuilt on a hit: no search
        return solve(problem, budget, name, *args)

    def counting_events(*args, **kwargs):
        calls["lower"] += 1
        return events(*args, **kwargs)

    monkeypatch.setattr(planner, "solve", counting_solve)
    monkeypatch.setattr(inductor_memory, "inductor_program_events", counting_events)
    return calls


def _explain(name: str = "mlp", **options) -> fxremat.Plan:
    torch._dynamo.reset()
    model, inputs = ZOO[name]()
    return fxremat.explain(model, *inputs, **options)


def _same(a: fxremat.Plan, b: fxremat.Plan) -> None:
    assert [r.name for r in a.kept] == [r.name for r in b.kept]
    assert [r.name for r in a.recomputed] == [r.name for r in b.recomputed]
    assert (a.predicted_peak, a.released_peak, a.solver, a.feasible) == (
        b.predicted_peak,
        b.released_peak,
        b.solver,
        b.feasible,
    )


def test_a_graph_planned_once_is_not_searched_or_lowered_again(cache, counted):
    first = _explain("transformer")  # inner="inductor": the candidates are judged on Inductor's programs
    assert counted["solve"] > 0 and counted["lower"] > 0
    assert len(list(cache.glob("*.json"))) == 1
    counted.update(solve=0, lower=0)
    again = _explain("transformer")
    assert counted == {"solve": 0, "lower": 0}
    _same(first, again)
    assert "plan cache" in again.note and "plan cache" not in first.note
    # What the plan's judgement went on, the hand-over's included (its time slack counts the programs' kernels).
    assert again.accumulating_peak == first.accumulating_peak
    assert [part for part in again.note.split("; ") if "plan cache" not in part] == first.note.split("; ")


def test_a_plan_from_the_cache_counts_its_programs_kernels_as_the_search_did(cache, monkeypatch):
    """The hand-over's time slack counts the kernels of the programs (``Lowered.kernels``): a plan read
    from the cache, whose programs are not lowered again, must count as many, or a later run could
    decide otherwise."""
    counts = []
    real = planner._step_seconds

    def spy(analysis, options, lowered):
        counts.append(lowered.kernels)
        return real(analysis, options, lowered)

    def explain() -> fxremat.Plan:
        # Weights as large as its activations: adding the gradients in as made lowers the peak.
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)]
        )
        return fxremat.explain(model, torch.randn(32, 256))

    monkeypatch.setattr(planner, "_step_seconds", spy)
    explain()
    searched, counts[:] = list(counts), []
    again = explain()
    assert "plan cache" in again.note
    assert searched and all(k > 0 for k in searched)
    assert counts == searched


def test_other_options_are_planned_afresh_and_kept_apart(cache, counted):
    fastest = _explain(inner="eager", time_slack=0)
    budget = (fastest.predicted_peak * 3) // 4
    tight = _explain(inner="eager", budget=budget)
    assert len(list(cache.glob("*.json"))) == 2
    counted.update(solve=0)
    _same(tight, _explain(inner="eager", budget=budget))
    _same(fastest, _explain(inner="eager", time_slack=0))
    assert counted["solve"] == 0


def test_a_refused_budget_is_refused_again_without_planning(cache, counted):
    with pytest.raises(fxremat.BudgetError) as first:
        _explain(inner="eager", budget=1)
    counted.update(solve=0)
    with pytest.raises(fxremat.BudgetError) as again:
        _explain(inner="eager", budget=1)
    assert counted["solve"] == 0
    assert again.value.least_peak == first.value.least_peak


def test_the_least_plan_from_the_cache_still_warns_that_the_budget_is_out_of_reach(cache):
    with pytest.warns(UserWarning, match="below the least reachable peak"):
        first = _explain(inner="eager", budget=1, on_infeasible="min")
    with pytest.warns(UserWarning, match="below the least reachable peak"):
        again = _explain(inner="eager", budget=1, on_infeasible="min")
    _same(first, again)


def test_an_unreadable_or_foreign_entry_is_a_miss_and_is_written_again(cache, counted):
    first = _explain(inner="eager", time_slack=0)
    (entry,) = cache.glob("*.json")
    for bad in ("{not json", '{"format": 0, "kept": []}', '{"format": 1, "kept": ["no_such_node"]}'):
        entry.write_text(bad)
        counted.update(solve=0)
        _same(first, _explain(inner="eager", time_slack=0))
        assert counted["solve"] > 0, bad
        assert plan_cache.load(entry.stem)["kept"] != ["no_such_node"]


def test_off_by_environment(cache, counted, monkeypatch):
    monkeypatch.setenv("FXREMAT_PLAN_CACHE", "0")
    _explain(inner="eager", time_slack=0)
    counted.update(solve=0)
    _explain(inner="eager", time_slack=0)
    assert counted["solve"] > 0
    assert not cache.exists()


def test_a_cache_that_cannot_be_written_does_not_stop_planning(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FXREMAT_PLAN_CACHE", "1")
    monkeypatch.setattr(plan_cache, "folder", lambda: blocker / "plans")  # under a file: cannot be made
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fxremat")  # nor warns: the cache is an optimisation
        plan = _explain(inner="eager", time_slack=0)
    assert plan.kept
