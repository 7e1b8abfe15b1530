"""Input sizes that change between steps (sequence lengths): one plan with no budget, one per size under one.

Dynamo compiles a function for the sizes it first sees, and for a second size again
with symbolic sizes (``automatic_dynamic_shapes``), a graph that then runs every later
size. With no budget fxremat plans that graph once, at its first dynamic sizes, and
must not fix them (a guard on a size would compile every new length again, until
Dynamo's ``recompile_limit`` runs the model uncompiled). Under a budget the dynamic graph is
planned at its sizes and capped at them where every tensor grows with them
(``passes/sizes.py``): a shorter length runs that plan, a longer one compiles again; where
some tensor does not grow, each size is planned on its own.
"""

from __future__ import annotations

import copy
import logging
import warnings

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


def test_under_a_budget_a_length_runs_the_plan_of_the_longest_so_far_within_it():
    """The static first length, then one capped plan per new longest length; every length within the budget."""
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

    longest_dynamic = 0
    for i, length in enumerate((*LENGTHS, 12)):
        ids = _ids(length)
        ref = copy.deepcopy(base)
        ref_loss = ref(ids)
        ref_loss.backward()
        before = len(fxremat.plans())
        compare(ref, ref_loss, model, step(ids))
        # 16 static, 24 and 32 each a new longest length; 20 and 12 run the plan made at 32.
        new = i == 0 or length > longest_dynamic
        longest_dynamic = longest_dynamic if i == 0 else max(longest_dynamic, length)
        assert len(fxremat.plans()) == before + new, (length, [p.graph for p in fxremat.plans()])
        measured = fxremat.measure(lambda: step(ids), reps=1, warmup=1)
        assert measured.peak_bytes <= budget, (length, measured.peak_bytes, budget)
        assert len(fxremat.plans()) == before + new
    assert len(fxremat.plans()) == 3
    assert all(p.predicted_peak <= budget for p in fxremat.plans())


class Shrinking(TinyLM):
    """TinyLM and a tensor that shrinks as the length grows: its sizes cannot be capped, only fixed."""

    def forward(self, ids):
        loss = super().forward(ids)
        spare = self.head.weight.new_ones(64 - ids.shape[1], 8)
        return loss + 0.0 * spare.sum()


def test_under_a_budget_a_graph_with_a_tensor_that_shrinks_plans_each_length_on_its_own():
    torch.manual_seed(0)
    base = Shrinking(with_logits=False)
    model = copy.deepcopy(base)
    compiled = _compile(model, inner="eager", budget="64MiB")
    for length in (16, 24, 20):
        ids = _ids(length)
        ref = copy.deepcopy(base)
        ref_loss = ref(ids)
        ref_loss.backward()
        before = len(fxremat.plans())
        model.zero_grad(set_to_none=True)
        loss = compiled(ids)
        loss.backward()
        compare(ref, ref_loss, model, loss)
        assert len(fxremat.plans()) == before + 1, length  # 20 does not run the plan made at 24


def test_the_last_compile_dynamo_allows_under_a_budget_warns():
    torch.manual_seed(0)
    compiled = _compile(TinyLM(with_logits=False), inner="eager", budget="64MiB")
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled(_ids(16)).backward()
        with pytest.warns(UserWarning, match="larger than any compiled so far will run uncompiled, outside the budget"):
            compiled(_ids(24)).backward()


def test_sizes_marked_dynamic_under_a_budget_are_capped_at_the_first():
    compiled = _compile(TinyLM(with_logits=False), inner="eager", budget="64MiB")
    for length, plans in ((24, 1), (16, 1), (32, 2)):
        ids = _ids(length)
        torch._dynamo.mark_dynamic(ids, 1)
        compiled(ids).backward()
        assert len(fxremat.plans()) == plans, length


def test_sizes_marked_dynamic_that_cannot_be_capped_are_refused_with_what_to_do():
    compiled = _compile(Shrinking(with_logits=False), inner="eager", budget="64MiB")
    ids = _ids(16)
    torch._dynamo.mark_dynamic(ids, 1)
    with pytest.raises(Exception, match="maybe_mark_dynamic, or drop the budget"):
        compiled(ids)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_dynamic_graph_is_chunked_at_every_length_by_one_plan(inner):
    """chunk_loss=4 with no budget: the chunks' rows follow the length (9 tokens a row: 18 rows in
    chunks of 5, 5, 5 and 3), one plan for every length after the first."""
    torch.manual_seed(0)
    base = TinyLM()
    model = copy.deepcopy(base)
    compiled = _compile(model, inner=inner, chunk_loss=4)
    for length in (16, 24, 32, 20, 9):
        ids = _ids(length)
        ref = copy.deepcopy(base)
        ref_loss, ref_logits = ref(ids)
        ref_loss.backward()
        model.zero_grad(set_to_none=True)
        loss, logits = compiled(ids)
        loss.backward()
        compare(ref, ref_loss, model, loss)
        torch.testing.assert_close(logits, ref_logits)
        assert "4 chunks" in fxremat.plans()[-1].chunked[0]
    assert len(fxremat.plans()) == 2


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
    # The first length planned with the logits alive; the others once, dropped. The first length's
    # next call runs the plan capped at 32 (Dynamo tries its newest graph first), so it is not
    # planned again.
    assert len(plans) == 3, [(p.graph, p.note) for p in plans]
    assert [p.predicted_peak == p.released_peak for p in plans] == [False, True, True]


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


def test_under_a_budget_a_chunked_loss_is_capped_with_its_graph():
    """Chunks cut at the longest length so far run every shorter one (their rows padded to the largest
    chunk's: every tensor grows with the length), within the budget."""
    torch.manual_seed(0)
    base = TinyLM(with_logits=False)
    longest = _ids(32)
    least = fxremat.explain(base, longest, inner="eager", budget=1, on_infeasible="min", chunk_loss=4).predicted_peak
    fastest = fxremat.explain(base, longest, inner="eager", time_slack=0, chunk_loss=4).predicted_peak
    budget = (least + fastest) // 2
    model = copy.deepcopy(base)
    compiled = _compile(model, inner="eager", budget=budget, chunk_loss=4)

    def step(ids):
        model.zero_grad(set_to_none=True)
        loss = compiled(ids)
        loss.backward()
        return loss

    for length in (16, 32, 24, 12):
        ids = _ids(length)
        ref = copy.deepcopy(base)
        ref_loss = ref(ids)
        ref_loss.backward()
        compare(ref, ref_loss, model, step(ids))
        assert fxremat.plans()[-1].chunked
        measured = fxremat.measure(lambda: step(ids), reps=1, warmup=1)
        assert measured.peak_bytes <= budget, (length, measured.peak_bytes, budget)
    assert len(fxremat.plans()) == 2, [p.graph for p in fxremat.plans()]


def test_a_budget_no_capped_plan_meets_is_met_by_a_plan_for_the_sizes_alone(monkeypatch, caplog):
    """A capped plan refused (here made to be: Inductor's program for symbolic sizes can hold more at
    once than for fixed ones) is not the answer: the sizes are fixed and the graph planned again."""
    import fxremat.planner as planner
    from fxremat.budget import BudgetError
    from fxremat.passes.sizes import CAPPED, bound_sizes, symbolic_sizes

    def refusing_capped(joint):
        if symbolic_sizes(joint) and bound_sizes(joint) == CAPPED:
            raise BudgetError(1, 2, where="a capped graph (refused by this test)")
        return None

    monkeypatch.setattr(planner, "bound_sizes", refusing_capped)
    torch.manual_seed(0)
    base = TinyLM(with_logits=False)
    model = copy.deepcopy(base)
    compiled = _compile(model, inner="eager", budget="64MiB")
    for length, plans in ((16, 1), (24, 2), (20, 3)):
        ids = _ids(length)
        ref = copy.deepcopy(base)
        ref_loss = ref(ids)
        ref_loss.backward()
        model.zero_grad(set_to_none=True)
        with caplog.at_level(logging.INFO, logger="fxremat"):
            caplog.clear()
            loss = compiled(ids)
        loss.backward()
        compare(ref, ref_loss, model, loss)
        fell_back = any("planning these sizes alone" in r.getMessage() for r in caplog.records)
        assert fell_back == (length != 16), length
        assert len(fxremat.plans()) == plans, length  # 20 is not run by the plan fixed at 24


def test_a_dynamic_loss_on_logits_given_to_the_graph_is_chunked_at_every_length():
    """No head in the graph (the logits are an input): the forward's chunks of rows padded, the backward
    walking the vocabulary; one plan for every length after the first."""

    def loss_of(logits, labels):
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=0)

    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(loss_of, backend=fxremat.backend(inner="eager", chunk_loss=4))
    for length in (16, 24, 32, 9):
        ids = _ids(length)
        logits = torch.randn(2, length, VOCAB, generator=torch.Generator().manual_seed(length), requires_grad=True)
        ref = logits.detach().clone().requires_grad_()
        expected = loss_of(ref, ids)
        expected.backward()
        loss = compiled(logits, ids)
        loss.backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(logits.grad, ref.grad)
        assert "4 chunks" in fxremat.plans()[-1].chunked[0]
    assert len(fxremat.plans()) == 2


def test_a_dynamic_chunked_loss_holds_one_chunk_at_a_time_under_inductor():
    """Inductor fuses the chunks' kernels of a graph with symbolic sizes unless asked at the hints
    (``_torch_compat.fusion_memory_at_hints``): the least plan capped at 32 tokens measured 130,696 B
    without it, against 32,392 B for the same length compiled for fixed sizes."""

    def least_at_32(dynamic: bool) -> int:
        torch.manual_seed(0)
        model = TinyLM(with_logits=False)
        torch._dynamo.reset()
        options = dict(inner="inductor", budget=1, on_infeasible="min", chunk_loss=2)
        compiled = torch.compile(model, backend=fxremat.backend(**options), dynamic=dynamic)
        ids = _ids(32)

        def step():
            model.zero_grad(set_to_none=True)
            compiled(ids).backward()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the least plan's "below the least reachable peak"
            if not dynamic:
                step()
            else:
                compiled(_ids(16)).backward()  # the first length static, then 32 dynamic
                step()
            return fxremat.measure(step, reps=1, warmup=1).peak_bytes

    fixed, capped = least_at_32(False), least_at_32(True)
    assert capped <= fixed, (capped, fixed)


def test_a_least_plan_for_a_new_length_planned_for_dropped_logits_is_not_planned_again():
    """``budget=1, on_infeasible="min"``: the loss scalar, alive through its own backward, is not the
    caller keeping outputs (it once planned every new length again, with the logits alive)."""
    torch.manual_seed(0)
    model = TinyLM()
    compiled = _compile(model, inner="eager", budget=1, on_infeasible="min")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # below the least reachable peak: the least plan
        for length in (16, 16, 24, 24, 20):
            model.zero_grad(set_to_none=True)
            compiled(_ids(length))[0].backward()  # the logits dropped
    plans = fxremat.plans()
    # 16 with the logits alive, then dropped; 24 dropped at once, and 20 runs it (capped).
    assert len(plans) == 3, [(p.graph, p.note) for p in plans]
    assert plans[-1].predicted_peak == plans[-1].released_peak
