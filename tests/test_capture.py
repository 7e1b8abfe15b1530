"""explain and pareto: plans without a training step, equal to torch.compile's."""

from __future__ import annotations

import copy

import pytest
import torch

import fxremat
from zoo import ZOO, Transformer


def _compiled_plan(base, inputs, **options):
    torch._dynamo.reset()
    fxremat.clear_plans()
    model = copy.deepcopy(base)
    torch.compile(model, backend=fxremat.backend(**options))(*inputs).backward()
    return max(fxremat.plans(), key=lambda p: p.predicted_peak)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_explain_matches_compile_kept_set(inner):
    base, inputs = ZOO["transformer"]()
    fastest = fxremat.explain(base, *inputs, inner=inner, time_slack=0)
    budget = int(fastest.predicted_peak * 0.75)
    plan = fxremat.explain(base, *inputs, inner=inner, budget=budget)
    compiled = _compiled_plan(base, inputs, inner=inner, budget=budget)
    assert [k.name for k in plan.kept] == [k.name for k in compiled.kept]
    assert plan.predicted_peak == compiled.predicted_peak <= budget
    assert all(p.grad is None for p in base.parameters()), "explain must not leave gradients behind"


def test_a_model_explained_after_another_plans_as_if_alone():
    """Each explain compiles an entry whose code object is unequal to the earlier ones': Dynamo's record
    of the input sizes a frame saw is keyed by code objects, which compare by value, and a shared record
    made the second model's graph dynamic in its sizes (an extra size node, another kept set)."""
    torch.manual_seed(0)
    other, other_ids = (
        torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 1)),
        torch.randint(0, 512, (4, 64)),
    )
    base, inputs = ZOO["transformer"]()
    torch._dynamo.reset()
    alone = fxremat.explain(base, *inputs, inner="eager", time_slack=0)
    torch._dynamo.reset()
    fxremat.explain(lambda ids: other(ids).mean(), other_ids, inner="eager", time_slack=0)
    after = fxremat.explain(base, *inputs, inner="eager", time_slack=0)
    assert after.problem.names == alone.problem.names
    assert [k.name for k in after.kept] == [k.name for k in alone.kept]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_explain_leaves_the_users_compiled_model_compiled(inner):
    """explain compiles its own code object instead of resetting Dynamo: a model the user
    compiled before (same class, same forward) does not recompile afterwards."""
    base, inputs = ZOO["mlp"]()
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(copy.deepcopy(base), backend=fxremat.backend(inner=inner))
    compiled(*inputs).backward()
    assert len(fxremat.plans()) == 1
    plan = fxremat.explain(base, *inputs, inner=inner)
    assert len(fxremat.plans()) == 2 and plan is fxremat.plans()[-1]
    compiled(*inputs).backward()
    assert len(fxremat.plans()) == 2, "the user's compiled model was recompiled"
    # ...and a second explain plans again (its entry is never reused).
    fxremat.explain(base, *inputs, inner=inner)
    assert len(fxremat.plans()) == 3


def test_explain_runs_no_step_and_keeps_user_grads():
    base, inputs = ZOO["mlp"]()
    base(*inputs).backward()
    grads = [p.grad.clone() for p in base.parameters()]
    plan = fxremat.explain(base, *inputs, inner="eager")
    assert plan.predicted_peak > 0 and plan.kept
    for p, g in zip(base.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_explain_on_fake_weights_allocates_nothing():
    from fxremat._torch_compat import FakeTensorMode

    with FakeTensorMode():
        model = Transformer(dim=512, layers=2)
        x = torch.randn(2, 256, 512)
    plan = fxremat.explain(model, x, inner="eager", solver="save_all")
    # Korthikanti et al. 2022: ~34*s*b*h bytes per layer in 16-bit with efficient attention; fp32 doubles it.
    per_layer = plan.saved_bytes / 2
    expected = 34 * 256 * 2 * 512 * 2
    assert 0.8 * expected < per_layer < 1.25 * expected, (per_layer, expected)


def test_explain_on_meta_device():
    with torch.device("meta"):
        model = Transformer(dim=64, layers=2)
    plan = fxremat.explain(model, torch.randn(2, 32, 64, device="meta"), inner="eager")
    assert plan.predicted_peak > 0 and plan.kept


class _Broken(torch.nn.Module):
    """Two layers with a graph break between them: Dynamo compiles two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return torch.tanh(self.b(h)).sum()


def test_explain_graph_breaks_warn_and_return_largest():
    base, inputs = _Broken(), (torch.randn(16, 32),)
    with pytest.warns(UserWarning, match="graph breaks"):
        plan = fxremat.explain(base, *inputs, inner="eager")
    assert plan.predicted_peak == max(p.predicted_peak for p in fxremat.plans()[-2:])


def test_explain_budget_errors():
    base, inputs = ZOO["mlp"]()
    with pytest.raises(fxremat.BudgetError) as info:
        fxremat.explain(base, *inputs, inner="eager", budget="10kB")
    assert info.value.least_peak > 10_000


def test_pareto_front_is_monotone():
    base, inputs = ZOO["transformer"]()
    front = fxremat.pareto(base, *inputs, points=5, inner="eager")
    assert len(front) >= 2
    peaks = [p.predicted_peak for p in front]
    times = [p.recompute_seconds for p in front]
    assert peaks == sorted(peaks, reverse=True)
    assert times == sorted(times)
    assert all(p.predicted_peak <= p.budget for p in front)
