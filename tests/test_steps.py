"""What the running step shows (fxremat/steps.py): outputs the caller drops, graphs that share a step."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import fxremat
from fxremat import steps

from checks import compare


class WithLogits(nn.Module):
    """Returns (loss, logits) as HF models do; the logits are the largest tensor of the step."""

    def __init__(self, width: int = 64, vocab: int = 2048) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        logits = self.head(self.body(x))
        return logits.logsumexp(-1).mean(), logits


def _compile(model, **options):
    torch._dynamo.reset()
    fxremat.clear_plans()
    return torch.compile(model, backend=fxremat.backend(inner="eager", **options))


def _budget(model, x) -> int:
    """Halfway between the least and the fastest plan, outputs counted as alive (the default)."""
    fastest = fxremat.explain(model, x, inner="eager", time_slack=0)
    least = fxremat.explain(model, x, inner="eager", budget=1, on_infeasible="min", release_outputs=False)
    return (fastest.predicted_peak + least.predicted_peak) // 2


def test_dropped_outputs_are_planned_as_released_from_the_next_call(recwarn):
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    budget = _budget(base, x)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = ref(x)[0]
    ref_loss.backward()
    compiled = _compile(model, budget=budget)
    loss = compiled(x)[0]  # the logits are dropped before backward, as `model(x).loss` does
    loss.backward()
    compare(ref, ref_loss, model, loss)
    first = fxremat.plans()[-1]
    model.zero_grad(set_to_none=False)
    compiled(x)[0].backward()
    second = fxremat.plans()[-1]
    assert second is not first, "no re-plan after the logits were dropped"
    assert steps._GRAPHS.get(second.graph) is not None  # later graphs of a step find it by its new name
    # The replaced plan is history, not what runs (the running one predicts this step: .grad exists).
    running = [p.graph for p in fxremat.running_plans()]
    assert second.graph in running and first.graph not in running
    # Planned with the logits freed when the backward starts: no more memory, fewer recomputations.
    assert second.predicted_peak <= budget and second.recompute_seconds <= first.recompute_seconds
    model.zero_grad(set_to_none=False)
    measured = fxremat.measure(lambda: compiled(x)[0].backward(), reps=1, warmup=1)
    assert measured.peak_bytes <= budget * 1.02, (measured.peak_bytes, budget)
    assert len(fxremat.plans()) == 2  # once


def test_no_budget_outputs_dropped_correct_the_prediction_without_a_recompile():
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    compiled = _compile(copy.deepcopy(base))
    compiled(x)[0].backward()  # the logits are dropped before backward
    first = fxremat.plans()[-1]
    running = fxremat.running_plans()[-1]
    assert len(fxremat.plans()) == 1  # no re-plan, no recompile
    assert running.kept == first.kept and running.released_peak == first.released_peak
    assert running.predicted_peak == first.released_peak < first.predicted_peak
    assert "drops the outputs" in running.note
    measured = fxremat.measure(lambda: compiled(x)[0].backward(), reps=1)
    assert abs(measured.peak_bytes - running.predicted_peak) <= 64, (measured.peak_bytes, running.predicted_peak)


def test_outputs_held_through_backward_keep_the_first_plan():
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    compiled = _compile(copy.deepcopy(base), budget=_budget(base, x))
    for _ in range(2):
        loss, logits = compiled(x)
        loss.backward()
        del logits
    assert len(fxremat.plans()) == 1


def test_release_outputs_set_by_the_user_is_never_second_guessed():
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    compiled = _compile(copy.deepcopy(base), budget=_budget(base, x), release_outputs=False)
    for _ in range(2):
        compiled(x)[0].backward()
    assert len(fxremat.plans()) == 1


def test_nothing_is_held_after_backward_or_without_grad():
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(64, 64)
    compiled = _compile(copy.deepcopy(base), budget="64MiB")
    loss, logits = compiled(x)
    assert sum(c.held() for c in steps.held()) > 0  # saved activations and the logits
    loss.backward()
    assert steps.held() == []
    with torch.no_grad():
        compiled(x)
    assert steps.held() == []


def test_explain_plans_a_graph_after_a_break_under_what_the_first_leaves():
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 1)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h).square().mean()

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="graph breaks"):
        fxremat.explain(Broken(), torch.randn(16, 32), inner="eager", budget="1MiB")
    first, second = fxremat.plans()[-2:]
    assert first.budget == 1 << 20 and second.budget < first.budget


def _between_least_plans(model, x) -> int:
    """A budget only a plan with the outputs dropped before backward reaches."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        held = fxremat.explain(model, x, inner="eager", budget=1, on_infeasible="min", release_outputs=False)
        dropped = fxremat.explain(model, x, inner="eager", budget=1, on_infeasible="min", release_outputs=True)
    assert dropped.predicted_peak < held.predicted_peak
    return (dropped.predicted_peak + held.predicted_peak) // 2


def test_a_budget_only_dropped_outputs_reach_is_planned_for_them_not_refused():
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    budget = _between_least_plans(base, x)
    compiled = _compile(copy.deepcopy(base), budget=budget)
    compiled(x)[0].backward()  # no BudgetError: the `.loss` idiom fits
    measured = fxremat.measure(lambda: compiled(x)[0].backward(), reps=1, warmup=1)
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)
    assert len(fxremat.plans()) == 1


def test_outputs_kept_against_that_assumption_warn_and_replan():
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    budget = _between_least_plans(base, x)
    compiled = _compile(copy.deepcopy(base), budget=budget)
    loss, logits = compiled(x)
    with pytest.warns(UserWarning, match="keeps .* of outputs alive through the backward"):
        loss.backward()
    del logits
    with pytest.warns(UserWarning, match="need more than the budget"):
        loss, logits = compiled(x)  # planned again with the outputs alive: the least plan, loudly
    loss.backward()
    assert len(fxremat.plans()) == 2


def test_a_budget_out_of_reach_either_way_is_refused_after_planning_once(monkeypatch):
    """Dropping the outputs frees at most their bytes: no second plan when that cannot reach the budget,
    and no third to raise the error the first already raised."""
    from fxremat import planner

    calls = []
    choose = planner.choose
    monkeypatch.setattr(planner, "choose", lambda *a, **k: calls.append(1) or choose(*a, **k))
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    least = fxremat.explain(base, x, inner="eager", budget=1, on_infeasible="min", release_outputs=True)
    calls.clear()
    logits_bytes = 256 * 2048 * 4
    budget = least.predicted_peak - logits_bytes - (1 << 16)
    compiled = _compile(copy.deepcopy(base), budget=budget, chunk_loss="off")
    with pytest.raises(fxremat.BudgetError) as info:
        compiled(x)
    assert info.value.budget == budget
    assert len(calls) == 1
    # The error says what a caller that drops the logits needs, not only the least with them alive.
    released = fxremat.format_bytes(info.value.least_peak - logits_bytes - 4)  # the logits and the loss
    assert "drops them before the backward" in str(info.value) and f"needs at least {released}" in str(info.value)
    assert "{'grads_allocated': True} plans for them alone" in str(info.value)  # and what steps with .grad need


def _mlp(layers: int = 16, width: int = 128) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def test_a_loss_outside_the_graph_has_room_from_the_first_step(recwarn):
    # The caller's square().mean() and its backward allocate 3x the output while the graph's saved
    # activations are alive: planned without room for them, the step peaked 1.10x the budget. A graph
    # with no scalar output leaves that room in its first plan, and the first backward keeps it.
    torch.manual_seed(0)
    base, x = _mlp(), torch.randn(512, 128)
    budget = fxremat.explain(base, x, inner="eager", time_slack=0).predicted_peak  # the fastest plan's
    gc.collect()
    before = {p.graph for p in fxremat.running_plans()}  # graphs other tests still hold
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    compiled = _compile(model, budget=budget, grads_allocated=False)
    first = fxremat.measure(lambda: compiled(x).square().mean().backward(), reps=1, warmup=0)
    [plan] = [p for p in fxremat.running_plans() if p.graph not in before]
    assert plan.reserved_bytes == steps.CALLER_RESERVE * x.shape[0] * 128 * 4
    assert first.peak_bytes <= budget, (first.peak_bytes, budget)
    model.zero_grad(set_to_none=True)
    loss = compiled(x).square().mean()
    loss.backward()
    compare(ref, ref_loss, model, loss)
    # Not planned again: the same graph and plan (its note follows whether the step found .grad).
    again = [(p.graph, p.kept, p.predicted_peak) for p in fxremat.running_plans() if p.graph not in before]
    assert again == [(plan.graph, plan.kept, plan.predicted_peak)]
    assert not [str(w.message) for w in recwarn if "outside the compiled model" in str(w.message)]


def test_room_for_a_caller_that_allocates_nothing_is_given_back():
    # .sum() hands the backward a broadcast gradient: the room left in the first plan is planned away.
    torch.manual_seed(0)
    base, x = _mlp(), torch.randn(512, 128)
    budget = _budget(base, x)
    gc.collect()
    before = {p.graph for p in fxremat.running_plans()}
    compiled = _compile(copy.deepcopy(base), budget=budget, grads_allocated=False)
    compiled(x).sum().backward()
    [first] = [p for p in fxremat.running_plans() if p.graph not in before]
    compiled(x).sum().backward()
    [running] = [p for p in fxremat.running_plans() if p.graph not in before]
    assert first.reserved_bytes == steps.CALLER_RESERVE * x.shape[0] * 128 * 4 and running.reserved_bytes == 0
    assert running.predicted_peak > first.predicted_peak  # the room went to keeping more
    measured = fxremat.measure(lambda: compiled(x).sum().backward(), reps=1, warmup=0)
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)


def test_a_graph_feeding_a_later_graph_is_not_taken_for_a_loss_outside(recwarn):
    # A graph break: the first graph's outputs go into the second, whose backward hands it their
    # gradient; that is not a loss computed outside, and the old check took it for one.
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = _mlp(4, 128), _mlp(4, 128)

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h).square().mean()

    torch.manual_seed(0)
    compiled = _compile(Broken(), budget="16MiB")  # its outputs (256 KiB) are over 1% of it
    for _ in range(2):
        compiled(torch.randn(512, 128)).backward()
    assert not [str(w.message) for w in recwarn if "outside the compiled model" in str(w.message)]


def test_a_reserve_of_the_users_is_not_second_guessed(recwarn):
    torch.manual_seed(0)
    base, x = _mlp(), torch.randn(512, 128)
    compiled = _compile(copy.deepcopy(base), budget=_budget(base, x), reserve="64KiB")
    for _ in range(2):
        compiled(x).square().mean().backward()
    assert not [str(w.message) for w in recwarn if "outside the compiled model" in str(w.message)]
    assert {p.reserved_bytes for p in fxremat.plans()} == {64 * 1024}


def test_calls_are_not_logged_forever_without_a_budget():
    # Nothing reads the call log without a budget: it once grew by one call per step.
    torch.manual_seed(0)
    compiled, x = _compile(WithLogits(width=16, vocab=32)), torch.randn(8, 16)
    steps.held()  # what earlier tests left is pruned, and the pruning length starts over
    for _ in range(200):
        compiled(x)[0].backward()
    assert len(steps._CALLS) <= 64, len(steps._CALLS)


def _choose_calls(monkeypatch) -> list[int]:
    from fxremat import planner

    calls: list[int] = []
    choose = planner.choose
    monkeypatch.setattr(planner, "choose", lambda *a, **k: calls.append(1) or choose(*a, **k))
    return calls


def test_a_least_plan_is_planned_once_for_a_caller_that_drops_the_logits(monkeypatch):
    """budget=1: no plan can fit (the graph returns 2 MiB of logits), so the least plan is planned at
    once, without the refusal first, and for the `.loss` idiom: not planned and compiled again at the
    second step once it shows the logits dropped."""
    torch.manual_seed(0)
    base, x = WithLogits(), torch.randn(256, 64)
    with pytest.warns(UserWarning):
        dropped = fxremat.explain(base, x, inner="eager", budget=1, on_infeasible="min", release_outputs=True)
        held = fxremat.explain(base, x, inner="eager", budget=1, on_infeasible="min", release_outputs=False)
    assert dropped.predicted_peak < held.predicted_peak
    calls = _choose_calls(monkeypatch)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = ref(x)[0]
    ref_loss.backward()
    compiled = _compile(model, budget=1, on_infeasible="min")
    with pytest.warns(UserWarning, match="least-memory plan"):
        loss = compiled(x)[0]
    loss.backward()
    compare(ref, ref_loss, model, loss)
    assert len(calls) == 1  # planned once: the refusal was not planned first
    [plan] = fxremat.plans()
    assert plan.predicted_peak == dropped.predicted_peak

    def step() -> None:
        model.zero_grad(set_to_none=True)  # as the optimizer leaves them: .grad made again
        compiled(x)[0].backward()

    measured = fxremat.measure(step, reps=1, warmup=1)
    assert fxremat.plans() == [plan] and len(calls) == 1  # the later steps ran the same plan
    assert measured.peak_bytes <= dropped.predicted_peak + 64, (measured.peak_bytes, dropped.predicted_peak)


def test_a_least_plan_whose_caller_keeps_the_logits_is_planned_again_with_them_alive():
    torch.manual_seed(0)
    compiled = _compile(WithLogits(), budget=1, on_infeasible="min")
    x = torch.randn(256, 64)
    with pytest.warns(UserWarning, match="least-memory plan"):
        loss, logits = compiled(x)
    with pytest.warns(UserWarning, match="keeps .* of outputs alive through the backward.* above its prediction"):
        loss.backward()
    del logits
    with pytest.warns(UserWarning, match="least-memory plan"):
        loss, logits = compiled(x)  # planned again with the outputs alive
    loss.backward()
    first, second = fxremat.plans()
    assert second.predicted_peak > first.predicted_peak
    assert len(fxremat.plans()) == 2


def test_a_least_plan_of_a_graph_whose_loss_the_caller_computes_keeps_its_outputs_alive(monkeypatch):
    """`.square().mean()` holds the graph's output through the backward: its least plan counts it alive
    from the first step, as before (no warning that the plan took it as dropped). Planned once: neither
    the room for the caller's loss nor the refusal is planned first, and the caller's loss, seen at the
    first backward, does not have it planned again with room reserved (the least plan is the same)."""
    torch.manual_seed(0)
    base, x = _mlp(), torch.randn(512, 128)
    model = copy.deepcopy(base)
    calls = _choose_calls(monkeypatch)
    compiled = _compile(model, budget=1, on_infeasible="min")
    import warnings

    for step in range(2):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled(x).square().mean().backward()
        assert not [w for w in seen if "took as dropped" in str(w.message) or "exceed" in str(w.message)]
        if step == 0:
            assert len(calls) == 1
    # Not planned again with room for the caller's loss either: the least plan would not change. (It is
    # planned again once, with the output released: `.square()`'s backward, the first to run, frees it.)
    plans = fxremat.plans()
    assert all(p.reserved_bytes == 0 and not p.feasible for p in plans) and "drop" not in plans[0].note


def test_the_least_any_plan_holds_is_the_largest_storage_the_graph_allocates_and_returns():
    """A view of a value the graph makes counts (BERT's logits are one), an input or a view of one does not."""
    captured: list = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    weight = nn.Parameter(torch.randn(64, 32))

    def fn(x):
        logits = (x @ weight).view(8, 4, 32)  # 4 KiB made here, returned as a view
        return logits.logsumexp(-1).mean(), logits, x, weight.t()

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend)(torch.randn(32, 64))
    finally:
        torch._dynamo.reset()
    [gm] = captured
    assert steps._allocated_output_bytes(gm) == 32 * 32 * 4
    assert steps._returns_loss(gm)
