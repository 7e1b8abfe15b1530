"""With no budget under Inductor, candidates are judged least modelled peak first, and one that cannot peak
below a candidate already judged is not lowered (``planner._judged_unless_beaten``)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import fxremat
from fxremat import planner
from fxremat.passes import inductor_memory
from fxremat.solvers.types import Decision
from test_no_budget import _Wide
from zoo import ZOO


def _decision(k: int, modelled: int = 0) -> Decision:
    return Decision(kept=(k,), recomputed=(), peak_bytes=modelled, recompute_seconds=0.0, feasible=True, solver="t")


def _lowered(monkeypatch, peaks: dict[int, int]) -> list[int]:
    """``planner.lower`` answering ``peaks`` by kept value; the kept values asked, in order."""
    asked: list[int] = []

    def lower(analysis, d: Decision, options, known=None):
        asked.append(d.kept[0])
        return SimpleNamespace(peak=peaks[d.kept[0]], decision=d)

    monkeypatch.setattr(planner, "lower", lower)
    return asked


def test_candidates_are_judged_least_modelled_peak_first_and_the_beaten_are_not_lowered(monkeypatch):
    modelled = {0: 70, 1: 30, 2: 40, 3: 20}  # the solver's model of each plan's peak, by kept value
    worthy = [(_decision(k, modelled[k]), f"candidate {k}") for k in range(4)]
    bounds = {0: 50, 1: 10, 2: 30, 3: 20}
    peaks = {0: 60, 1: 25, 2: 35, 3: 24}
    monkeypatch.setattr(planner, "_returned_bound", lambda analysis, d, options: bounds[d.kept[0]])
    monkeypatch.setattr(planner, "_lower_ahead", lambda *a, **k: [])
    monkeypatch.setattr(planner, "_lower_handed", lambda *a: ["fingerprint"])
    asked = _lowered(monkeypatch, peaks)
    analysis = SimpleNamespace(fusion=True)
    judge = planner._Judge(analysis, fxremat.Options())
    judged, likely, handed = planner._judged_unless_beaten(analysis, worthy, fxremat.Options(), judge)
    # 3 (modelled 20) peaks at 24; 1 (bound 10) can still win and peaks at 25; 2 (30) and 0 (50) cannot.
    assert asked == [3, 1]
    assert [why for _, why in judged] == ["candidate 1", "candidate 3"]  # in the candidates' order
    assert likely is worthy[3][0] and handed == ["fingerprint"]


def test_a_bound_equal_to_the_least_peak_is_judged(monkeypatch):
    """A candidate whose bound equals the least peak judged may tie it with less recompute: judged.
    Equal modelled peaks are judged in their order."""
    worthy = [(_decision(k), str(k)) for k in range(2)]
    monkeypatch.setattr(planner, "_returned_bound", lambda analysis, d, options: 10)
    monkeypatch.setattr(planner, "_lower_ahead", lambda *a, **k: [])
    monkeypatch.setattr(planner, "_lower_handed", lambda *a: [])
    _lowered(monkeypatch, {0: 10, 1: 10})
    analysis = SimpleNamespace(fusion=True)
    judged, _, _ = planner._judged_unless_beaten(
        analysis, worthy, fxremat.Options(), planner._Judge(analysis, fxremat.Options())
    )
    assert len(judged) == 2


def test_without_fusion_every_candidate_is_judged_in_order(monkeypatch):
    monkeypatch.setattr(planner, "_returned_bound", lambda *a: pytest.fail("no bound needed: judging is a simulation"))
    worthy = [(_decision(k), str(k)) for k in (2, 0, 1)]
    asked = _lowered(monkeypatch, {0: 0, 1: 0, 2: 0})
    analysis = SimpleNamespace(fusion=False)
    judged, likely, handed = planner._judged_unless_beaten(
        analysis, worthy, fxremat.Options(), planner._Judge(analysis, fxremat.Options())
    )
    assert asked == [2, 0, 1] and len(judged) == 3 and likely is None and handed == []


def _wide():
    torch.manual_seed(0)
    return _Wide(), (torch.randn(512, 128),)


# _Wide: three candidates, PyTorch's partition returning twice the least one's peak; gpt2: one.
BUILDS = {"wide": _wide, "gpt2": ZOO["gpt2"]}


def _explain(name: str) -> fxremat.Plan:
    torch._dynamo.reset()
    inductor_memory.forget_programs()
    model, inputs = BUILDS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxremat.explain(model, *inputs)


@pytest.mark.parametrize("name", list(BUILDS))
def test_the_bound_is_never_above_the_programs_peak_and_skipping_keeps_the_plan(monkeypatch, name):
    """Every candidate judged peaks at or above its bound (what its forward returns, alive together),
    so a candidate skipped for its bound could not have been chosen: the plan is the one judging every
    candidate gives."""
    bounds: dict[tuple, int] = {}
    real_bound = planner._returned_bound

    def bound(analysis, decision, options):
        bounds[decision.kept] = real_bound(analysis, decision, options)
        return bounds[decision.kept]

    peaks: dict[tuple, int] = {}
    real_lower = planner.lower

    def lower(analysis, decision, options, known=None):
        lowered = real_lower(analysis, decision, options, known)
        peaks[decision.kept] = lowered.peak
        return lowered

    monkeypatch.setattr(planner, "_returned_bound", bound)
    monkeypatch.setattr(planner, "lower", lower)
    plan = _explain(name)
    assert bounds, "candidates were ranked by their bounds"
    judged = [kept for kept in bounds if kept in peaks]
    assert name != "wide" or len(judged) < len(bounds), "one candidate was not lowered"
    assert judged and all(bounds[kept] <= peaks[kept] for kept in judged), [(bounds[k], peaks[k]) for k in judged]
    monkeypatch.setattr(planner, "_returned_bound", lambda *a: 0)  # nothing skipped
    every = _explain(name)
    assert [r.name for r in plan.kept] == [r.name for r in every.kept]
    assert (plan.predicted_peak, plan.fastest_peak, plan.accumulating_peak) == (
        every.predicted_peak,
        every.fastest_peak,
        every.accumulating_peak,
    )


def test_programs_are_built_inside_the_lowering_time(monkeypatch):
    """Building a candidate's programs (for its bound, or to hand them to a child) is part of lowering it, as
    in ``planner.lower``: the plan's ``lower`` seconds count it, never its search seconds (docs/PLANNING_TIME.md)."""
    judges: list[planner._Judge] = []
    real_init = planner._Judge.__init__

    def init(self, analysis, options):
        real_init(self, analysis, options)
        judges.append(self)

    outside: list[int] = []
    real_build = planner._build_programs

    def build(analysis, decision, options):
        if not any(j._depth for j in judges):
            outside.append(len(decision.kept))
        return real_build(analysis, decision, options)

    monkeypatch.setattr(planner._Judge, "__init__", init)
    monkeypatch.setattr(planner, "_build_programs", build)
    plan = _explain("wide")
    assert judges and plan.pass_seconds["lower"] > 0
    assert not outside, f"{len(outside)} candidates' programs built outside the lowering time"
