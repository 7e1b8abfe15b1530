"""Input sizes that change between steps (sequence lengths): one plan with no budget, one per size under one.

Dynamo compiles a function for the sizes it first sees, and for a second size again
with symbolic sizes (``automatic_dynamic_shapes``), a graph that then runs every later
size. With no budget fxremat plans that graph once, at its first dynamic sizes, and
must not fix them (a guard on a size would compile every new length again, until
Dynamo's ``recompile_limit`` runs the model uncompiled). Under a budget each size is
planned on its own (``backend.fixing_sizes``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxremat

from checks import compare

VOCAB = 1024
LENGTHS = (16, 24, 32, 20)


class TinyLM(nn.Module):
    """Embedding, one tanh MLP, an LM head and its cross-entropy; returns (loss, logits) as HF models do
    (the logits, 2 x 16 x 1024 fp32 = 128 KiB, leave the graph without a gradient path: chunk_loss.py)."""

    def __init__(self, width: int = 32, with_logits: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.body = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width), nn.Tanh())
        self.head = nn.Linear(width, VOCAB)
        self.with_logits = with_logits

    def forward(self, ids):
        logits = self.head(self.body(self.embed(ids)))
        loss = F.cross_entropy(logits.view(-1, VOCAB), ids.view(-1))
        return (loss, logits) if self.with_logits else loss


def _ids(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))


def _compile(model, **options):
    torch._dynamo.reset()
    fxremat.clear_plans()
    return torch.compile(model, backend=fxremat.backend(**options))


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_no_budget_plans_once_for_every_length_and_trains_like_eager(inner):
    torch.manual_seed(0)
    base = TinyLM()
    model = copy.deepcopy(base)
    compiled = _compile(model, inner=inner)
    for length in LENGTHS:
        ref = copy.deepcopy(base)
        ref_loss = _loss(ref(_ids(length)))
        ref_loss.backward()
        model.zero_grad(set_to_none=True)
        loss = _loss(compiled(_ids(length)))
        loss.backward()
        compare(ref, ref_loss, model, loss)
    # The first length's static graph, then one dynamic graph for every other length (as plain
    # torch.compile): a size guarded while planning would have compiled each length on its own.
    assert len(fxremat.plans()) == 2, [p.graph for p in fxremat.plans()]


def test_under_a_budget_each_length_gets_its_own_plan_within_it():
    torch.manual_seed(0)
    base = TinyLM(with_logits=False)
    longest = _ids(max(LENGTHS))
    least = fxremat.explain(base, longest, inner="eager", budget=1, on_infeasible="min", time_slack=0).predicted_peak
    fastest = fxremat.explain(base, longest, inner="eager", time_slack=0).predicted_peak
    budget = (least + fastest) // 2
    model = copy.deepcopy(base)
    compiled = _compile(model, inner="eager", budget=budget)

    def step(ids):
        model.zero_grad(set_to_none=True)
        loss = compiled(ids)
        loss.backward()
        return loss

    for length in LENGTHS:
        ids = _ids(length)
        ref = copy.deepcopy(base)
        ref_loss = ref(ids)
        ref_loss.backward()
        before = len(fxremat.plans())
        compare(ref, ref_loss, model, step(ids))
        assert len(fxremat.plans()) == before + 1, "a new length ran a plan made for another"
        measured = fxremat.measure(lambda: step(ids), reps=1, warmup=1)
        assert measured.peak_bytes <= budget, (length, measured.peak_bytes, budget)
        assert len(fxremat.plans()) == before + 1
    assert all(p.predicted_peak <= budget for p in fxremat.plans())


def test_the_last_compile_dynamo_allows_under_a_budget_warns():
    torch.manual_seed(0)
    compiled = _compile(TinyLM(with_logits=False), inner="eager", budget="64MiB")
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled(_ids(16)).backward()
        with pytest.warns(UserWarning, match="inputs of a size not seen yet will run uncompiled, outside the budget"):
            compiled(_ids(24)).backward()


def test_sizes_marked_dynamic_under_a_budget_are_refused_with_what_to_do():
    compiled = _compile(TinyLM(with_logits=False), inner="eager", budget="64MiB")
    ids = _ids(16)
    torch._dynamo.mark_dynamic(ids, 1)
    with pytest.raises(Exception, match="maybe_mark_dynamic, or drop the budget"):
        compiled(ids)


def test_chunking_asked_for_a_dynamic_graph_without_a_budget_warns_and_keeps_the_loss_whole():
    torch.manual_seed(0)
    base = TinyLM()
    model = copy.deepcopy(base)
    compiled = _compile(model, inner="eager", chunk_loss=4)
    _loss(compiled(_ids(16))).backward()  # static: chunked
    assert fxremat.plans()[-1].chunked
    ids = _ids(24)
    ref = copy.deepcopy(base)
    ref_loss = _loss(ref(ids))
    ref_loss.backward()
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="its loss is computed whole"):
        loss = _loss(compiled(ids))
    loss.backward()
    compare(ref, ref_loss, model, loss)
    assert not fxremat.plans()[-1].chunked


def _budget_between(base) -> int:
    """Halfway between the least and the fastest plan at the longest length, the logits alive."""
    longest = _ids(max(LENGTHS))
    least = fxremat.explain(base, longest, inner="eager", budget=1, on_infeasible="min").predicted_peak
    fastest = fxremat.explain(base, longest, inner="eager", time_slack=0).predicted_peak
    return (least + fastest) // 2


def test_a_new_length_of_a_model_whose_caller_drops_the_logits_is_planned_so_at_once():
    """Under a budget each length is planned on its own; once one length's step showed the caller drops
    the logits (`.loss`), a new length is planned for that from its first compile, not planned with
    them alive and again at its next call."""
    torch.manual_seed(0)
    base = TinyLM()
    budget = _budget_between(base)
    model = copy.deepcopy(base)
    compiled = _compile(model, inner="eager", budget=budget)
    for rep in range(2):
        for length in LENGTHS[:3]:
            ids = _ids(length)
            model.zero_grad(set_to_none=True)
            loss = compiled(ids)[0]  # the logits dropped before the backward
            loss.backward()
            if rep == 1:

                def step():
                    model.zero_grad(set_to_none=True)
                    compiled(ids)[0].backward()

                measured = fxremat.measure(step, reps=1, warmup=1)
                assert measured.peak_bytes <= budget, (length, measured.peak_bytes, budget)
    plans = fxremat.plans()
    # The first length planned with the logits alive, then again once dropped; the others once, dropped.
    assert len(plans) == 4, [(p.graph, p.note) for p in plans]
    assert [p.predicted_peak == p.released_peak for p in plans] == [False, True, True, True]


def test_a_caller_that_keeps_them_at_a_new_length_is_warned_and_planned_again():
    torch.manual_seed(0)
    base = TinyLM()
    budget = _budget_between(base)
    compiled = _compile(copy.deepcopy(base), inner="eager", budget=budget)
    compiled(_ids(16))[0].backward()  # dropped: seen
    loss, logits = compiled(_ids(24))  # a new length, planned as dropped; this caller keeps them
    with pytest.warns(UserWarning, match="keeps .* of outputs alive through the backward"):
        loss.backward()
    del logits
    before = len(fxremat.plans())
    loss, logits = compiled(_ids(24))
    loss.backward()
    assert len(fxremat.plans()) == before + 1  # planned again with them alive
    assert fxremat.plans()[-1].predicted_peak != fxremat.plans()[-1].released_peak
