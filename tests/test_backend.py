"""End to end: compiled training steps equal eager ones and fit their budgets."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import fxremat
from fxremat import measure

from checks import compare
from zoo import ZOO


def _step(model, inputs, seed=0):
    torch.manual_seed(seed)
    loss = model(*inputs)
    loss.backward()
    return loss.detach()


def _compile(model, **options):
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend=fxremat.backend(inner="eager", **options))
    return compiled


def _plan_peak(base, inputs, **options):
    model = copy.deepcopy(base)
    _step(_compile(model, **options), inputs)
    plans = fxremat.plans()
    assert plans, "the backend recorded no plan"
    return max(p.predicted_peak for p in plans)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_matches_eager_under_budgets(name):
    base, inputs = ZOO[name]()
    base.train()
    ref = copy.deepcopy(base)
    ref_loss = _step(ref, inputs)

    model = copy.deepcopy(base)
    loss = _step(_compile(model), inputs)  # no budget: the fastest plan
    compare(ref, ref_loss, model, loss)
    fastest = max(p.predicted_peak for p in fxremat.plans())
    with pytest.warns(UserWarning, match="least-memory plan"):
        least = _plan_peak(base, inputs, budget=1, on_infeasible="min")
    assert least <= fastest
    for budget in [(least + fastest) // 2, least]:
        model = copy.deepcopy(base)
        compiled = _compile(model, budget=budget)
        loss = _step(compiled, inputs)
        compare(ref, ref_loss, model, loss)
        plans = fxremat.plans()
        assert all(p.predicted_peak <= budget for p in plans), [p.summary() for p in plans]
        model.zero_grad(set_to_none=False)
        measured = measure(lambda: compiled(*inputs).backward(), reps=1, warmup=1)
        assert measured.peak_bytes <= budget * 1.02, (
            f"{name}: measured {measured.peak_bytes} > budget {budget}; plan {plans[-1].summary()}"
        )


def test_budget_below_least_peak_raises_with_least_peak():
    base, inputs = ZOO["mlp"]()
    model = copy.deepcopy(base)
    with pytest.raises(fxremat.BudgetError) as info:
        _step(_compile(model, budget=1000), inputs)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.budget == 1000 and err.least_peak > 1000
    assert str(err.least_peak) in str(err) and fxremat.format_bytes(err.least_peak) in str(err)
    # The least peak it names is reachable: that budget compiles and fits.
    torch._dynamo.reset()
    _step(_compile(copy.deepcopy(base), budget=err.least_peak), inputs)
    assert fxremat.plans()[-1].predicted_peak <= err.least_peak


def test_options_string_backend_and_env_budget(monkeypatch):
    base, inputs = ZOO["mlp"]()
    monkeypatch.setenv("FXREMAT_BUDGET", "700KiB")
    torch._dynamo.reset()
    fxremat.clear_plans()
    model = copy.deepcopy(base)
    compiled = torch.compile(model, backend="fxremat", options={"inner": "eager", "on_infeasible": "min"})
    with pytest.warns(UserWarning):
        _step(compiled, inputs)
    assert fxremat.plans()[-1].budget == 700 * 1024


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), True, 0.5, "lots", "12 parsecs", [1]])
def test_bad_budgets_rejected(bad):
    with pytest.raises((ValueError, TypeError), match="budget"):
        fxremat.backend(budget=bad)
    with pytest.raises((ValueError, TypeError), match="budget"):
        fxremat.Options.from_mapping({"budget": bad})


def test_unknown_option_rejected():
    with pytest.raises(ValueError, match="valid options"):
        fxremat.backend(budgt="1GiB")
    with pytest.raises(ValueError, match="choose one of"):
        fxremat.backend(solver="magic")


def test_entry_point_without_import(tmp_path):
    script = tmp_path / "use.py"
    script.write_text(
        "import sys, torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))\n"
        "x = torch.randn(4, 8)\n"
        "ref = torch.autograd.grad(m(x).sum(), list(m.parameters()))\n"
        "c = torch.compile(m, backend='fxremat', options={'budget': '1MiB', 'inner': 'eager'})\n"
        "got = torch.autograd.grad(c(x).sum(), list(m.parameters()))\n"
        "assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ref, got))\n"
        "print('imported before compile:', 'fxremat' in sys.modules and 'ok')\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""}
    )
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def test_inductor_end_to_end_matches_eager():
    base, inputs = ZOO["transformer"]()
    ref = copy.deepcopy(base)
    ref_loss = _step(ref, inputs)
    fastest = _plan_peak(base, inputs)
    budget = int(fastest * 0.7)
    torch._dynamo.reset()
    fxremat.clear_plans()
    model = copy.deepcopy(base)
    compiled = torch.compile(model, backend="fxremat", options={"budget": budget, "on_infeasible": "min"})
    loss = _step(compiled, inputs)
    compare(ref, ref_loss, model, loss)
    plan = fxremat.plans()[-1]
    assert plan.predicted_peak <= budget or not plan.feasible
    model.zero_grad(set_to_none=False)
    measured = measure(lambda: compiled(*inputs).backward(), reps=1, warmup=1)
    assert measured.peak_bytes <= max(budget, plan.predicted_peak) * 1.02


def test_graph_break_the_later_graph_gets_what_the_earlier_leaves():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 32)
            self.b = torch.nn.Linear(32, 1)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h).mean()

    torch.manual_seed(0)
    base, x = Broken(), torch.randn(16, 32)
    ref = copy.deepcopy(base)
    ref_loss = _step(ref, (x,))
    model = copy.deepcopy(base)
    loss = _step(_compile(model, budget="64MiB"), (x,))
    compare(ref, ref_loss, model, loss)
    first, second = fxremat.plans()
    assert first.budget == 64 << 20
    # The first graph's saved values and its output stay alive while the second runs.
    assert second.budget == (64 << 20) - first.saved_bytes - 16 * 32 * 4, (first.summary(), second.summary())


def test_measure_can_wrap_the_compiling_call():
    # The first call compiles inside measure's profiler; fxremat's own scratch
    # profiling must not nest a second session (it skips, and says so in the log).
    torch._dynamo.reset()
    base, inputs = ZOO["mlp"]()
    compiled = torch.compile(copy.deepcopy(base), backend=fxremat.backend(budget="4MiB", inner="eager"))
    m = measure(lambda: compiled(*inputs).backward(), reps=1, warmup=0)
    assert m.peak_bytes > 0
