"""A graph that runs several times in one step (``Options.repeats``, ``RematProblem.copies``).

Identical layers separated by graph breaks (FSDP2 wrapping each layer, a block
compiled on its own) share one compiled graph: each call runs while the earlier
calls hold their saved activations. The solvers count them, and the first step
shows fxremat how many calls there are.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fxremat
from fxremat.solvers import schedule
from fxremat.solvers.ilp import solve_ilp

from checks import compare
from test_solvers import (
    EXAMPLES,
    OPTIONS,
    assert_exact,
    assert_valid,
    brute_force,
    budgets,
    chain,
    problems,
    valid_rules,
)


def test_copies_add_the_kept_bytes_to_every_step():
    p = chain(6, nbytes=8)
    kept = (1, 3)
    base = schedule.evaluate(p, kept)
    more = schedule.evaluate(replace(p, copies=3), kept)
    closed = base[0]
    forward, backward = schedule.programs(p, closed, base[1])
    held = schedule.liveness(p, forward, backward, closed).kept_bytes
    assert held > 0
    assert more[2] == base[2] + 3 * held
    with pytest.raises(ValueError, match="copies"):
        replace(p, copies=-1)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(1, 3), st.data())
def test_ilp_with_copies_equals_brute_force(p, copies, data):
    p = replace(p, copies=copies)
    assume(valid_rules(p))
    truth = brute_force(p)
    budget = data.draw(budgets(truth))
    d = solve_ilp(p, budget, OPTIONS)
    assert_valid(p, d)
    assert_exact(d, truth, budget)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(128, 256), nn.Linear(256, 128)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)).square())


class Layers(nn.Module):
    """Identical blocks with a graph break after each: blocks 1..n-1 reuse one compiled graph."""

    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return x


def test_a_graph_reused_for_every_layer_is_planned_for_all_its_calls():
    torch.manual_seed(0)
    base, x = Layers(), torch.randn(256, 128)
    eager = fxremat.measure(lambda: copy.deepcopy(base)(x).square().mean().backward(), reps=1)
    budget = eager.peak_bytes * 2 // 3
    torch._dynamo.reset()
    fxremat.clear_plans()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    compiled = torch.compile(model, backend=fxremat.backend(budget=budget, inner="eager"))
    with pytest.warns(UserWarning, match="ran 4 times in this step"):
        loss = compiled(x).square().mean()
        loss.backward()
    compare(ref, ref_loss, model, loss)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxremat")  # planned for its calls: no further warning
        measured = fxremat.measure(lambda: compiled(x).square().mean().backward(), reps=1, warmup=1)
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)
    running = fxremat.running_plans()
    assert any("runs 4 times in a step" in p.note for p in running), [p.note for p in running]
    # Gradients of the re-planned graph still equal eager's.
    ref.zero_grad()
    model.zero_grad()
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    loss = compiled(x).square().mean()
    loss.backward()
    compare(ref, ref_loss, model, loss)


def test_repeats_is_validated_and_part_of_the_plan_key():
    assert fxremat.Options.from_mapping({"repeats": 4}).key() != fxremat.Options.from_mapping({}).key()
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="repeats"):
            fxremat.Options.from_mapping({"repeats": bad})
