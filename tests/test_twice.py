"""Nested checkpoints: values recomputed a second time after the backward's peak (solvers/twice.py,
passes/twice.py), checked on the plain problem and on a model compiled whole."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxremat
from fxremat import planner
from fxremat.solvers import schedule, twice
from fxremat.solvers.rules import admit, rules
from test_solvers import chain, problems, valid_rules  # noqa: E402  (tests/ is on sys.path under pytest)


def _replay(problem, offset, kept):
    return schedule.liveness(problem, tuple(range(offset)), tuple(range(offset, problem.size)), kept)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_the_programs_as_one_problem_replay_like_the_plan(p, data):
    if not valid_rules(p):
        return
    rule = rules(p)
    kept = admit(rule, data.draw(st.sets(st.sampled_from(sorted(rule.relevant)))) if rule.relevant else set())
    kept, recomputed = schedule.close(p, kept)
    forward, backward = schedule.programs(p, kept, recomputed)
    program, offset, program_kept, _ = twice.program_of(p, kept, recomputed)
    assert offset == len(forward) and program.size == len(forward) + len(backward)
    want = schedule.liveness(p, forward, backward, kept)
    got = _replay(program, offset, program_kept)
    if set(forward) & set(backward):
        # A value run in both programs shares one id in the joint replay, which holds the forward's
        # storage into the backward when the backward's run uses it: an upper bound on the programs'.
        assert got.peak <= want.peak
    else:
        assert [s[2] for s in got.steps] == [s[2] for s in want.steps]


def _origins(problem, splits):
    """Each id's original id after ``splits`` (a copy's is its value's), and which ids are copies."""
    origin, copy = list(range(problem.size)), [False] * problem.size
    for split in splits:
        origin = origin[: split.at] + [origin[c] for c in split.copies] + origin[split.at :]
        copy = copy[: split.at] + [True] * len(split.copies) + copy[split.at :]
    return origin, copy


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_splits_compute_the_same_values_and_never_raise_the_peak(p, data):
    if not valid_rules(p):
        return
    rule = rules(p)
    kept = admit(rule, data.draw(st.sets(st.sampled_from(sorted(rule.relevant)))) if rule.relevant else set())
    kept, recomputed = schedule.close(p, kept)
    program, offset, program_kept, again = twice.program_of(p, kept, recomputed)
    out, splits, timeline = twice.split_lifetimes(program, offset, program_kept, again)
    assert timeline.peak <= _replay(program, offset, program_kept).peak
    origin, copy = _origins(program, splits)
    assert len(origin) == out.size
    for v in range(out.size):
        # Every node reads the same values as before, and a node reading a copy runs after it.
        assert sorted(origin[u] for u in out.inputs[v]) == sorted(program.inputs[origin[v]])
        assert origin[out.storage[v]] == program.storage[origin[v]]
    # Only values that may run again are copied.
    assert {origin[v] for v in range(out.size) if copy[v]} <= set(again)
    # ``with_split`` builds its problems unchecked (``RematProblem.derived``): they pass the checks.
    dataclasses.replace(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_reads_through_virtual_values_are_their_transitive_reads(p, data):
    virtual_ids = frozenset(
        data.draw(st.sets(st.sampled_from(range(p.size)))) & {v for v in range(p.size) if p.storage[v] == v}
    )
    got = schedule.reads(p, virtual_ids)
    want: list[set[int]] = []
    for v in range(p.size):
        here: set[int] = set()
        for u in p.inputs[v]:
            here |= want[u] if p.storage[u] in virtual_ids else {u}
        want.append(here)
    assert [set(r) for r in got] == want


def test_a_derived_problem_changes_only_what_it_is_given():
    p = chain(4)
    q = p.derived(names=tuple(f"renamed{i}" for i in range(p.size)))
    assert q.names[0] == "renamed0" and p.names[0] != "renamed0" and q.inputs is p.inputs
    with pytest.raises(TypeError, match="no field 'nodes'"):
        p.derived(nodes=())


def test_nested_checkpoints_lower_the_least_peak_of_a_chain():
    # A chain whose gradients read their inputs: keeping every 4th value leaves segments of 3 the
    # backward recomputes and holds at once; recomputed twice, fewer values need be kept.
    p = chain(32, nbytes=4)
    start = [v for v in range(0, 32, 6)]
    plain = schedule.decision(p, start, None, "test")
    kept, peak, splits = twice.nested_least(p, plain.kept)
    assert splits > 0
    assert peak < plain.peak_bytes
    assert len(kept) < len(plain.kept)
    # The search is deterministic: counts, never the clock.
    assert twice.nested_least(p, plain.kept) == (kept, peak, splits)


def test_split_copies_are_held_to_one_forward_of_flops(monkeypatch):
    p = chain(32, nbytes=4)
    plain = schedule.decision(p, [0, 16], None, "test")
    _, _, free = twice.nested_least(p, plain.kept)
    monkeypatch.setattr(twice, "TWICE_MAX_FLOPS", 0.0)
    kept, peak, none = twice.nested_least(p, plain.kept)
    assert free > 0 and none == 0


class Chain(torch.nn.Module):
    """Linear + tanh layers: a long chain whose least plan keeps segment boundaries."""

    def __init__(self, layers: int = 32, width: int = 64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _least(monkeypatch, nested: bool, inner: str = "eager"):
    if not nested:
        monkeypatch.setattr(planner, "nested_least", lambda problem, start: (tuple(start), 0, 0))
    torch._dynamo.reset()  # a second model of the same class would reuse the first's compiled graph
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(2048, 64)
    compiled = torch.compile(model, backend="fxremat", options={"budget": 1, "on_infeasible": "min", "inner": inner})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(x).backward()
    monkeypatch.undo()
    return model, x, compiled, fxremat.plans()[-1]


def test_a_chain_compiled_whole_recomputes_segments_twice_and_peaks_lower(monkeypatch):
    *_, plain = _least(monkeypatch, nested=False)
    model, x, compiled, plan = _least(monkeypatch, nested=True)
    assert not plain.again
    assert plan.again, plan.note
    assert "nested checkpoints" in plan.note
    assert "recomputed twice" in str(plan)
    assert plan.predicted_peak <= 0.8 * plain.predicted_peak
    # The step that runs: measured within the prediction, gradients equal eager's.
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = fxremat.measure(lambda: compiled(x).backward(), reps=1, warmup=0)
    assert measured.peak_bytes <= plan.predicted_peak
    _equal_to_eager(model, x, compiled)


def _equal_to_eager(model, x, compiled):
    model.zero_grad(set_to_none=True)
    loss = compiled(x)
    loss.backward()
    reference = Chain()
    reference.load_state_dict(model.state_dict())
    want = reference(x)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-6)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_under_inductor_the_nested_plan_is_inductors_program_and_trains_like_eager(monkeypatch):
    model, x, compiled, plan = _least(monkeypatch, nested=True, inner="inductor")
    assert plan.again, plan.note
    assert "_again" in plan.backward_code
    _equal_to_eager(model, x, compiled)


def test_the_plan_cache_gives_the_same_nested_plan_without_searching(tmp_path, monkeypatch):
    from fxremat import plan_cache

    monkeypatch.setenv("FXREMAT_PLAN_CACHE", "1")
    monkeypatch.setattr(plan_cache, "folder", lambda: tmp_path / "plans")
    first = _least(monkeypatch, nested=True)[-1]
    monkeypatch.setenv("FXREMAT_PLAN_CACHE", "1")  # _least undid the patches
    monkeypatch.setattr(plan_cache, "folder", lambda: tmp_path / "plans")

    def no_search(*args, **kwargs):
        raise AssertionError("the cached plan was searched again")

    monkeypatch.setattr(planner, "nested_least", no_search)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(2048, 64)
    compiled = torch.compile(model, backend="fxremat", options={"budget": 1, "on_infeasible": "min", "inner": "eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(x).backward()
    again = fxremat.plans()[-1]
    assert "plan cache" in again.note
    assert (again.fingerprint(), again.again, again.predicted_peak) == (
        first.fingerprint(),
        first.again,
        first.predicted_peak,
    )


def _programs_by_walking(p, kept, recomputed):
    """``schedule.programs`` as first written: every walk from scratch, nothing remembered per problem."""
    fw_nodes = p.forward_ids()
    forward = sorted(schedule.ancestors(p, list(p.fw_outputs) + list(kept), fw_nodes))
    tangents = list(p.tangents)
    within = {v for v in range(p.size) if v not in fw_nodes}.union(recomputed)
    needed = schedule.ancestors(p, p.bw_outputs + p.handed, within) - set(tangents)
    readers = [v for v in sorted(needed) if any(u in set(tangents) for u in p.inputs[v])]
    done, backward = set(tangents), list(tangents)
    if not readers:
        return tuple(forward), tuple(backward) + tuple(sorted(needed))

    def run(v):
        for u in sorted(schedule.ancestors(p, [v], needed - done)):
            done.add(u)
            backward.append(u)

    for v in sorted(needed):
        if v >= readers[0] and v not in done:
            run(v)
    for v in sorted(needed - done):
        run(v)
    return tuple(forward), tuple(backward)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_programs_remembering_the_backward_walk_as_walking_it_each_time(p, data):
    # ``schedule.programs`` keeps what the gradients reach through the backward alone per problem and
    # walks only from the recomputed values on: the same programs for every plan of the problem.
    for _ in range(3):
        kept = data.draw(st.sets(st.sampled_from(sorted(p.forward_ids())))) if p.forward_ids() else set()
        kept, recomputed = schedule.close(p, kept)
        assert schedule.programs(p, kept, recomputed) == _programs_by_walking(p, kept, recomputed)
