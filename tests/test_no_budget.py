"""With no budget: the least-peak plan within ``time_slack`` of the fastest plan's estimated time."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxremat
from fxremat.backend import _compile_reference
from fxremat.solvers.types import FORWARD

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
    assert plan.recompute_seconds > 0 and plan.note.startswith("no budget: ")
    if "only pointwise ops" in plan.note:  # as much pointwise work as PyTorch's own partition recomputes
        assert {r.op for r in plan.recomputed} <= {"aten.mul", "aten.add", "aten.erf", "aten.sub", "aten.rsqrt"}
    elif "PyTorch's own partition" not in plan.note:
        assert plan.recompute_seconds <= 0.02 * step_seconds * 1.001
    # GELU and LayerNorm outputs are cheap to recompute from the Linear outputs kept anyway.
    assert plan.predicted_peak <= 0.9 * plan.fastest_peak, plan
    measured = fxremat.measure(lambda: _step(compiled, x).backward(), reps=1).peak_bytes
    assert measured <= plan.predicted_peak + 64  # the eager programs' prediction is exact
    eager = fxremat.measure(lambda: _step(ref, x).backward(), reps=1).peak_bytes
    assert measured < eager


def _pytorch_partition(gm, example_inputs):
    """Plain torch.compile's partition, with the same eager programs fxremat's inner="eager" runs."""
    return _compile_reference(gm, example_inputs, fxremat.Options(inner="eager"))


class _Wide(nn.Module):
    """Pointwise-heavy blocks (tanh-GELU, SiLU gates): PyTorch's min-cut recomputes much of them."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(4))
        self.b = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        for a, b in zip(self.a, self.b):
            u, v = a(x).chunk(2, dim=-1)
            x = x + b(torch.nn.functional.gelu(u, approximate="tanh") * torch.nn.functional.silu(v))
        return x.square().mean()


@pytest.mark.parametrize(
    "build, rows",
    [(_mlp, 512), (_Wide, 512), (_Wide, 64)],
    ids=["mlp", "wide", "wide-small"],  # small: a peak under NO_BUDGET_MIN_GAIN_BYTES, kilobytes between plans
)
def test_no_budget_peaks_no_higher_than_pytorchs_own_partition(build, rows):
    torch.manual_seed(0)
    base, x = build(), torch.randn(rows, 128 if build is _Wide else 256)
    peaks = []
    for backend in (fxremat.backend(inner="eager"), _pytorch_partition):
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(base), backend=backend)
        compiled(x).backward()
        peaks.append(fxremat.measure(lambda: compiled(x).backward(), reps=1).peak_bytes)
    ours, theirs = peaks
    assert ours <= theirs, (ours, theirs)


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


class _Conv1D(nn.Module):
    """HF GPT-2's linear layer: ``addmm(bias, x, weight)`` with the weight stored (in, out). Its weight
    gradient is ``x.t() @ grad``: PyTorch's partitioner saves that transpose, a node only the backward uses."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class _GPT2MLP(nn.Module):
    def __init__(self, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.fc = nn.ModuleList(_Conv1D(width, 4 * width) for _ in range(layers))
        self.proj = nn.ModuleList(_Conv1D(4 * width, width) for _ in range(layers))

    def forward(self, x):
        for fc, proj in zip(self.fc, self.proj):
            x = x + proj(torch.nn.functional.gelu(fc(x), approximate="tanh"))
        return x.square().mean()


def test_pytorchs_own_partition_is_judged_as_pytorch_runs_it(monkeypatch):
    """The saved values PyTorch computes in the forward but the planner's problem places in the backward
    (the transposed input of a weight gradient) are kept through the forward values they come from.
    Dropped, the plan judged as PyTorch's recomputed both layers' ``addmm`` in the backward (a tiny HF
    GPT-2 with that plan: 19 backward kernels against plain torch.compile's 12)."""
    from fxremat import planner
    from fxremat.passes.reference import as_decision

    seen = {}
    real = planner.choose

    def spy(analysis, options, name, reference=None, check=None):
        seen["analysis"], seen["reference"] = analysis, reference
        return real(analysis, options, name, reference, check)

    monkeypatch.setattr(planner, "choose", spy)
    torch.manual_seed(0)
    model = _GPT2MLP()
    compiled = _compiled(model)
    compiled(torch.randn(4, 32, 64)).backward()
    analysis, reference = seen["analysis"], seen["reference"]
    names = reference.saved()
    graph = analysis.graph
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    outside = [n for n in names if n in index and graph.problem.phase[index[n]] != FORWARD]
    transposes = {torch.ops.aten.t.default, torch.ops.aten.permute.default}
    assert any(graph.nodes[index[n]].target in transposes for n in outside), outside
    theirs = as_decision(graph, names)
    recomputed = {graph.nodes[i].target for i in theirs.recomputed}
    assert not recomputed & {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}, recomputed


def test_with_no_budget_later_calls_are_not_watched_and_the_note_still_follows_grad(monkeypatch):
    from fxremat import steps

    watched = []
    watch = steps._watch
    monkeypatch.setattr(steps, "_watch", lambda out, args, graph: (watched.append(1), watch(out, args, graph)))
    torch.manual_seed(0)
    model, x = _mlp(layers=3, width=64), torch.randn(64, 64)
    compiled = _compiled(model)
    for _ in range(steps.SETTLED_AFTER + 3):  # zero_grad(set_to_none=True) each step: no .grad at backward
        model.zero_grad(set_to_none=True)
        _step(compiled, x).backward()
    # Each watched call costs a multi-grad hook and weak references: only the first steps pay it.
    assert len(watched) == steps.SETTLED_AFTER
    name = fxremat.plans()[-1].graph

    def running():  # other tests' graphs may still be alive in this process
        return next(p for p in fxremat.running_plans() if p.graph == name)

    assert steps.GRADS_EXIST_NOTE not in running().note
    for _ in range(2):  # gradient accumulation: .grad exist at each call
        _step(compiled, x).backward()
    assert steps.GRADS_EXIST_NOTE in running().note
    assert running().predicted_peak == running().accumulating_peak
    model.zero_grad(set_to_none=True)
    _step(compiled, x).backward()
    assert steps.GRADS_EXIST_NOTE not in running().note
    assert len(watched) == steps.SETTLED_AFTER
