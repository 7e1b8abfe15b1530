"""With no budget: the least-peak plan within ``time_slack`` of the fastest plan's estimated time."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxremat

from checks import compare


class _MLP(nn.Module):
    """Linear + GELU + LayerNorm blocks; the loss inside, so the compiled graph is the whole step."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        blocks = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
        self.body = nn.Sequential(*blocks)

    def forward(self, x):
        return self.body(x).square().mean()


def _mlp(layers: int = 6, width: int = 256) -> nn.Module:
    return _MLP(layers, width)


def _step(model, x):
    return model(x)


def _compiled(model, **options):
    torch._dynamo.reset()
    fxremat.clear_plans()
    return torch.compile(model, backend=fxremat.backend(inner="eager", **options))


def test_no_budget_recomputes_cheap_values_within_the_slack_and_peaks_lower():
    torch.manual_seed(0)
    base, x = _mlp(), torch.randn(512, 256)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = _step(ref, x)
    ref_loss.backward()
    compiled = _compiled(model)
    loss = _step(compiled, x)
    loss.backward()
    compare(ref, ref_loss, model, loss)
    plan = fxremat.plans()[-1]
    assert plan.budget is None and plan.problem is not None
    step_seconds = sum(plan.problem.seconds)
    assert 0 < plan.recompute_seconds <= 0.02 * step_seconds * 1.001
    # GELU and LayerNorm outputs are cheap to recompute from the Linear outputs kept anyway.
    assert plan.predicted_peak <= 0.9 * plan.fastest_peak, plan
    assert "within 2% of the fastest plan" in plan.note
    measured = fxremat.measure(lambda: _step(compiled, x).backward(), reps=1).peak_bytes
    assert measured <= plan.predicted_peak + 64  # the eager programs' prediction is exact
    eager = fxremat.measure(lambda: _step(ref, x).backward(), reps=1).peak_bytes
    assert measured < eager


def test_zero_slack_is_the_fastest_plan():
    torch.manual_seed(0)
    model, x = _mlp(layers=3), torch.randn(256, 256)
    compiled = _compiled(model, time_slack=0)
    _step(compiled, x).backward()
    plan = fxremat.plans()[-1]
    assert plan.recompute_seconds == 0.0
    assert plan.predicted_peak == plan.fastest_peak


def test_the_slack_is_part_of_the_plan_key_and_ignored_under_a_budget():
    torch.manual_seed(0)
    model, x = _mlp(layers=3), torch.randn(256, 256)
    assert fxremat.Options(time_slack=0.0).key() != fxremat.Options(time_slack=0.02).key()
    budget = fxremat.explain(model, x, inner="eager", time_slack=0).predicted_peak
    plans = [fxremat.explain(model, x, inner="eager", budget=budget, time_slack=s) for s in (0.0, 0.5)]
    assert plans[0].kept == plans[1].kept


@pytest.mark.parametrize("value", [-0.01, 1.5, "2%", True, None])
def test_a_bad_slack_names_the_option_and_the_valid_range(value):
    with pytest.raises(ValueError, match=r"time_slack=.* between 0 and 1"):
        fxremat.Options.from_mapping({"time_slack": value})
