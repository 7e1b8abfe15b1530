"""Fuzzing: random small models under random budgets, each step checked against eager.

A hypothesis strategy builds a model from random blocks (chains, skip
connections, branches, reductions, views, in-place ops, dropout under a fixed
seed) and draws a budget between the least reachable peak and the fastest
plan's peak (both from ``fxremat.explain``). Each example checks that the
compiled step's loss, gradients and buffers equal eager's, that every plan fits
the budget (or compiling raised ``BudgetError``), and that the measured peak
stays within 2% of the budget.

``FXREMAT_FUZZ_EXAMPLES`` sets the number of examples (default 15, which keeps the suite under 15 minutes; run 500
before a release). ``derandomize=True`` makes CI runs reproducible.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fxremat

ATOL = 1e-5
RTOL = 1e-4
EXAMPLES = int(os.environ.get("FXREMAT_FUZZ_EXAMPLES", "15"))
MEASURE_SLACK = 1.02  # the measured peak may exceed the budget by 2% (allocator rounding)

BLOCKS = ("linear", "skip", "branch", "reduce", "view", "inplace", "dropout", "norm")
ACTIVATIONS = ("tanh", "relu", "gelu", "sigmoid", "silu")


def _act(name: str, x):
    return getattr(F, name)(x) if name in ("relu", "gelu", "silu") else getattr(torch, name)(x)


class FuzzNet(nn.Module):
    """A stack of blocks over a (batch, width) activation; ``spec`` is a list of (block, activation, p)."""

    def __init__(self, spec, width: int) -> None:
        super().__init__()
        self.spec = list(spec)
        self.width = width
        self.lins = nn.ModuleList()
        self.norms = nn.ModuleList()
        for block, _, _ in self.spec:
            n = {"linear": 1, "skip": 1, "branch": 2, "view": 1, "inplace": 1}.get(block, 0)
            self.lins.append(nn.ModuleList(nn.Linear(width, width) for _ in range(n)))
            self.norms.append(nn.BatchNorm1d(width) if block == "norm" else nn.Identity())
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = x
        for (block, act, p), lins, norm in zip(self.spec, self.lins, self.norms):
            if block == "linear":  # chain
                h = _act(act, lins[0](h))
            elif block == "skip":  # skip connection
                h = h + _act(act, lins[0](h))
            elif block == "branch":  # two branches joined
                h = _act(act, lins[0](h)) * torch.sigmoid(lins[1](h)) + h.mean()
            elif block == "reduce":  # reductions broadcast back
                h = (h - h.mean(dim=-1, keepdim=True)) * torch.softmax(h, dim=-1) + h.amax(dim=0)
            elif block == "view":  # views, transposes and a strided slice
                b = h.shape[0]
                v = lins[0](h).view(b, 4, self.width // 4).transpose(1, 2).reshape(b, self.width)
                h = _act(act, v) + h.t().contiguous().t()[:, torch.arange(self.width - 1, -1, -1)]
            elif block == "inplace":  # in-place ops on a fresh activation
                g = lins[0](h)
                g.mul_(0.5)
                g.add_(h)
                g[:, :2].zero_()
                h = _act(act, g) if act != "relu" else g.relu_()
            elif block == "dropout":
                h = F.dropout(h, p=p, training=self.training)
            elif block == "norm":  # batchnorm: running stats are buffers mutated by the step
                h = _act(act, norm(h))
        return self.head(h).square().mean()


@st.composite
def models(draw):
    width = draw(st.sampled_from((8, 16, 32)))
    batch = draw(st.sampled_from((4, 8, 16)))
    spec = draw(
        st.lists(
            st.tuples(st.sampled_from(BLOCKS), st.sampled_from(ACTIVATIONS), st.sampled_from((0.1, 0.5))),
            min_size=1,
            max_size=6,
        )
    )
    seed = draw(st.integers(0, 2**16))
    frac = draw(st.floats(0.0, 1.0))  # where the budget falls between the least and the fastest peak
    return spec, width, batch, seed, frac


def _step(model, x, seed):
    torch.manual_seed(seed)  # the same dropout masks in eager and compiled
    loss = model(x)
    loss.backward()
    return loss.detach()


def _compare(ref, ref_loss, model, loss):
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=RTOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=ATOL, rtol=RTOL, msg=f"gradient of {name}")
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], atol=ATOL, rtol=RTOL, msg=f"buffer {name}")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(models())
def test_random_models_under_random_budgets(case):
    spec, width, batch, seed, frac = case
    torch.manual_seed(seed)
    base = FuzzNet(spec, width).train()
    x = torch.randn(batch, width)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # budget=1 warns that it uses the least-memory plan
        plan = fxremat.explain(copy.deepcopy(base), x, budget=1, on_infeasible="min", inner="eager")
    least, fastest = sorted((plan.predicted_peak, plan.fastest_peak))
    budget = max(1, int(least + frac * (fastest - least)))

    ref = copy.deepcopy(base)
    ref_loss = _step(ref, x, seed)
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend=fxremat.backend(budget=budget, inner="eager"))
    try:
        loss = _step(compiled, x, seed)
    except fxremat.BudgetError as exc:
        assert exc.least_peak > budget, str(exc)
        event("BudgetError")
        return
    _compare(ref, ref_loss, model, loss)
    plans = fxremat.plans()
    assert plans, f"no plan recorded for {spec}"
    event("recomputes" if any(p.recomputed for p in plans) else "recomputes nothing")
    for p in plans:
        assert p.feasible and p.budget == budget and p.predicted_peak <= budget, p.summary()

    model.zero_grad(set_to_none=False)
    # Two warm-up steps: the first with .grad allocated shows that the backward adds into them, the
    # second plans such steps on their own and compiles (the compiler's transient memory, two
    # copies of the RNG state, is not the step's); the measured step runs that plan.
    measured = fxremat.measure(lambda: compiled(x).backward(), reps=1, warmup=2)
    assert measured.peak_bytes <= budget * MEASURE_SLACK, (
        f"{spec} width {width} batch {batch}: measured {measured.peak_bytes} > budget {budget}; "
        f"{[p.summary() for p in plans]}"
    )


@pytest.mark.parametrize("block", BLOCKS)
def test_each_block_alone_at_least_budget(block):
    """Each block kind once, at the least budget: a failing block shows up by name, not only inside a fuzz case."""
    torch.manual_seed(0)
    base = FuzzNet([(block, "tanh", 0.5), ("linear", "gelu", 0.5)], 16).train()
    x = torch.randn(8, 16)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = _step(ref, x, 0)
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend=fxremat.backend(budget=1, on_infeasible="min", inner="eager"))
    with pytest.warns(UserWarning, match="least-memory plan"):
        loss = _step(compiled, x, 0)
    _compare(ref, ref_loss, model, loss)
