"""The plan registry: unique names, a bounded history."""

from __future__ import annotations

import fxremat
from fxremat import recorder
from fxremat.options import Options
from fxremat.plan import Plan


def _plan(name: str) -> Plan:
    return Plan(name, None, 0, 0, 0, 0.0, "save_all", 0.0, (), ())


def test_names_are_never_reused_across_clear_plans():
    first = recorder.new_graph_name()
    fxremat.clear_plans()
    second = recorder.new_graph_name()
    assert first != second and int(second.split()[1]) > int(first.split()[1])


def test_history_is_bounded_and_keeps_the_newest(monkeypatch):
    fxremat.clear_plans()
    options = Options.from_mapping({})
    names = [recorder.new_graph_name() for _ in range(recorder.MAX_PLANS + 5)]
    for name in names:
        recorder.record(_plan(name), options)
    kept = [p.graph for p in fxremat.plans()]
    assert kept == names[-recorder.MAX_PLANS :]
    fxremat.clear_plans()
    assert fxremat.plans() == []
