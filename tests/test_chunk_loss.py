"""The LM head and its cross-entropy computed a chunk of tokens at a time (``Options.chunk_loss``).

``passes/chunk_loss.py`` rewrites the loss; ``fxremat/chunking.py`` decides, with the planner's
numbers, whether it runs. Loss and gradients equal eager's in every case.
"""

from __future__ import annotations

import copy
import json
import operator
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxremat
from fxremat.passes.chunk_loss import chunk_losses, chunked_cross_entropy, find_loss_sites

from checks import compare

H, V, T = 32, 4096, 256


class LM(nn.Module):
    """A loss-only language model: the logits exist only for the loss."""

    def __init__(self, hidden: int = H, vocab: int = V, bias: bool = False, smoothing: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, vocab, bias=bias)
        self.smoothing = smoothing

    def forward(self, x, y):
        logits = self.head(self.body(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), label_smoothing=self.smoothing)


def _data(tokens: int = T, vocab: int = V, batch: int = 1):
    torch.manual_seed(0)
    x = torch.randn(batch, tokens, H)
    y = torch.randint(0, vocab, (batch, tokens))
    y[0, :7] = -100
    return x, y


# ---------------------------------------------------------------- the function alone


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("return_logits", [False, True])
def test_function_equals_linear_then_cross_entropy(bias, smoothing, reduction, return_logits):
    torch.manual_seed(0)
    rows, vocab = 37, 50  # 5 chunks of 8, 8, 8, 8, 5 rows
    hidden = torch.randn(rows, 8, requires_grad=True)
    weight = torch.randn(vocab, 8, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, (rows,))
    target[:4] = -100
    ref_logits = F.linear(hidden, weight, b)
    ref = F.cross_entropy(ref_logits, target, reduction=reduction, label_smoothing=smoothing)
    ref_out = ref + (ref_logits.square().mean() if return_logits else 0)
    inputs = [hidden, weight] + ([b] if bias else [])
    ref_grads = torch.autograd.grad(ref_out, inputs)
    out = chunked_cross_entropy(
        hidden, weight, b, target, chunks=5, reduction=reduction, label_smoothing=smoothing, return_logits=return_logits
    )
    loss, logits = out if return_logits else (out, None)
    torch.testing.assert_close(loss, ref)
    total = loss + (logits.square().mean() if return_logits else 0)  # a gradient through the logits too
    for got, want in zip(torch.autograd.grad(total, inputs), ref_grads):
        torch.testing.assert_close(got, want)


def test_function_without_a_head_chunks_the_logits_input():
    torch.manual_seed(0)
    logits = torch.randn(40, 30, requires_grad=True)
    target = torch.randint(0, 30, (40,))
    ref = torch.autograd.grad(F.cross_entropy(logits, target), logits)[0]
    got = torch.autograd.grad(chunked_cross_entropy(logits, None, None, target, chunks=3), logits)[0]
    torch.testing.assert_close(got, ref)


def test_function_in_bfloat16_matches_eager_within_bfloat16():
    torch.manual_seed(0)
    hidden = torch.randn(64, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(100, 16, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 100, (64,))
    ref = F.cross_entropy(F.linear(hidden, weight).float(), target)
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    loss = chunked_cross_entropy(hidden, weight, None, target, chunks=4, dtype=torch.float32)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref)
    for got, want in zip(torch.autograd.grad(loss, [hidden, weight]), ref_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- finding the loss


def _dynamo_graph(model, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(*args)
    return graphs


def test_finds_the_head_and_whether_its_logits_escape():
    (gm,) = _dynamo_graph(LM(), *_data())
    (site,) = find_loss_sites(gm)
    assert site.head is not None and (site.tokens, site.vocab) == (T, V)
    assert site.logits_escape is False

    class Both(LM):
        def forward(self, x, y):
            logits = self.head(self.body(x))
            return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits

    (gm,) = _dynamo_graph(Both(), *_data())
    (site,) = find_loss_sites(gm)
    assert site.logits_escape is True


def test_leaves_losses_it_cannot_chunk():
    class Shifted(LM):  # the logits sliced along the tokens: rows no longer match the head's input
        def forward(self, x, y):
            logits = self.head(self.body(x))[:, :-1, :]
            return F.cross_entropy(logits.reshape(-1, V), y[:, 1:].reshape(-1))

    class Weighted(LM):  # class weights change the normaliser
        def forward(self, x, y):
            return F.cross_entropy(self.head(self.body(x)).view(-1, V), y.view(-1), weight=torch.ones(V))

    class WeightedByPosition(LM):
        def forward(self, x, y):
            return F.cross_entropy(self.head(self.body(x)).view(-1, V), y.view(-1), torch.ones(V))

    for model in (Shifted(), Weighted(), WeightedByPosition()):
        (gm,) = _dynamo_graph(model, *_data())
        assert find_loss_sites(gm) == []


class ByModule(LM):
    """The loss as an ``nn.CrossEntropyLoss`` made in ``forward``, as HF's BERT does: Dynamo's graph
    then calls ``F.cross_entropy`` with every argument by position."""

    def __init__(self) -> None:
        super().__init__(bias=True)

    def forward(self, x, y):
        return nn.CrossEntropyLoss(label_smoothing=0.1)(self.head(self.body(x)).view(-1, V), y.view(-1))


def test_finds_a_loss_whose_arguments_are_all_positional():
    (gm,) = _dynamo_graph(ByModule(), *_data())
    (site,) = find_loss_sites(gm)
    assert site.head is not None and site.bias is not None and (site.tokens, site.vocab) == (T, V)


def test_a_positional_loss_chunked_equals_eager():
    x, y = _data(batch=2)
    ref_model = ByModule()
    model, ref = _twin(ref_model, x, y)
    _, loss = _step(model, x, y, chunk_loss=4)
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()
    assert plan.chunked and "4 chunks" in plan.chunked[0]


# ---------------------------------------------------------------- compiled, planned


def _step(model, x, y, **options):
    compiled = torch.compile(model, backend="fxremat", options={"inner": "eager", **options})
    loss = compiled(x, y)
    loss.backward()
    return compiled, loss


def _twin(ref_model, x, y):
    """(a copy of ``ref_model`` to compile, the reference loss after its backward); Dynamo and the plans reset."""
    model = copy.deepcopy(ref_model)
    ref = ref_model(x, y)
    ref.backward()
    torch._dynamo.reset()
    fxremat.clear_plans()
    return model, ref


@pytest.mark.parametrize("options", [{"chunk_loss": 4}, {"chunk_loss": 3, "release_outputs": True}])
def test_compiled_chunked_loss_equals_eager(options, tmp_path):
    x, y = _data(batch=2)
    ref_model = LM(bias=True, smoothing=0.05)
    model, ref = _twin(ref_model, x, y)
    _, loss = _step(model, x, y, **options)
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()
    (line,) = plan.chunked
    assert f"{options['chunk_loss']} chunks" in line and f"x {V} classes" in line
    assert "chunked loss" in str(plan) and list(plan.to_json()["chunked"]) == [line]
    plan.save(tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text())["chunked"] == [line]


class WithLogits(LM):
    """Returns the logits too, as HF models do."""

    def forward(self, x, y):
        logits = self.head(self.body(x))
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits


class ContiguousLogits(LM):
    """OPT's head: ``logits = lm_head(h).contiguous()``, returned and read by the loss."""

    def forward(self, x, y):
        logits = self.head(self.body(x)).contiguous()
        labels = F.pad(y, (0, 1), value=-100)[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, V).float(), labels.view(-1)), logits


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_logits_read_by_the_loss_and_returned_through_a_copy_are_chunked(inner):
    # The copy of the head's output stays (the graph returns it) and came before the function, which
    # sits where the loss was: "used before it has been defined" on HF OPT until it moved after it.
    x, y = _data()
    ref_model = ContiguousLogits()
    model = copy.deepcopy(ref_model)
    ref, ref_logits = ref_model(x, y)
    ref.backward()
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend="fxremat", options={"inner": inner, "chunk_loss": 2})
    loss, logits = compiled(x, y)
    torch.testing.assert_close(logits, ref_logits)
    loss.backward()
    compare(ref_model, ref, model, loss)
    assert fxremat.plans()[-1].chunked


class SlicedHead(LM):
    """HF's head: ``lm_head(hidden[:, slice(-keep, None), :])``, the logits returned too; ``keep=0`` is every token."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep

    def forward(self, x, y):
        h = self.body(x)
        logits = self.head(h[:, slice(-self.keep, None), :])
        return F.cross_entropy(logits.float().reshape(-1, V), y[:, -logits.shape[1] :].reshape(-1)), logits


@pytest.mark.parametrize("keep", [0, T // 2])
def test_a_sliced_head_input_leaves_the_graph_as_its_base_only_when_the_slice_is_whole(keep):
    """The head's input is a graph output (its logits get their gradient path outside): a view there is
    made again by AOTAutograd at every call, so a slice keeping every token is returned as its base."""
    x, y = _data()
    (gm,) = _dynamo_graph(SlicedHead(keep), x, y)
    chunk_losses(gm, {})
    extra = next(iter(gm.graph.find_nodes(op="output"))).args[0][-1]
    if keep:
        assert extra.target is operator.getitem  # the tokens kept: a view it has to return
    else:
        assert extra.op == "call_function" and extra.target is not operator.getitem  # the base: no view

    ref_model = SlicedHead(keep)
    model = copy.deepcopy(ref_model)
    ref_loss, ref_logits = ref_model(x, y)
    ref = ref_loss + ref_logits.square().mean()
    ref.backward()
    torch._dynamo.reset()
    fxremat.clear_plans()
    loss, logits = torch.compile(model, backend="fxremat", options={"inner": "eager"})(x, y)
    torch.testing.assert_close(logits, ref_logits)
    total = loss + logits.square().mean()
    total.backward()
    compare(ref_model, ref, model, total)


@pytest.mark.parametrize("through_logits", [False, True])
@pytest.mark.parametrize("chunk_loss", [4, "auto"])
def test_returned_logits_keep_their_gradient_path(through_logits, chunk_loss):
    """The logits leave the graph without a gradient path (no zero gradient for them in its
    backward) and get the head's own backward outside: a loss through them is still exact."""
    x, y = _data()
    out, plan = _step_returning_logits(WithLogits(bias=True), x, y, through_logits, {"chunk_loss": chunk_loss})
    assert plan.tangent_bytes < T * V * 4  # no logits-sized gradient input, chunked or not
    assert bool(plan.chunked) == (chunk_loss == 4)


def _step_returning_logits(ref_model, x, y, through_logits: bool, options: dict):
    """One step of ``ref_model`` (returning the loss and the logits) compiled under ``inner="eager"``
    and ``options``, its loss through the logits or not, compared with eager: (outputs, its plan)."""
    model = copy.deepcopy(ref_model)

    def total(out):
        loss, logits = out
        return loss + (logits.square().mean() if through_logits else 0)

    ref = total(ref_model(x, y))
    ref.backward()
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend="fxremat", options={"inner": "eager", **options})
    out = compiled(x, y)
    torch.testing.assert_close(out[1], ref_model(x, y)[1])
    loss = total(out)
    loss.backward()
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()
    return out, plan


class Classifier(LM):
    """Few classes, logits returned with the loss (HF's classification heads)."""

    def forward(self, x, y):
        logits = self.head(self.body(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)), logits


@pytest.mark.parametrize("through_logits", [False, True])
def test_small_returned_logits_keep_their_gradient_path_through_the_graph(through_logits):
    """Logits under DETACH_MIN_BYTES stay differentiable through the compiled graph (no autograd
    Function outside it, whose per-step cost is more than their zero gradient's); gradients exact."""
    from fxremat.passes.chunk_loss import DETACH_MIN_BYTES, is_head_gradient

    classes = 10
    x, y = _data(vocab=classes)
    assert T * classes * 4 < DETACH_MIN_BYTES
    out, plan = _step_returning_logits(Classifier(vocab=classes), x, y, through_logits, {})
    assert not is_head_gradient(out[1].grad_fn)
    assert plan.tangent_bytes >= T * classes * 4  # the logits' (small) gradient input is the graph's


def test_auto_chunks_when_no_plan_fits_whole_and_the_step_stays_under_the_budget():
    x, y = _data()
    budget = 8 << 20  # unchunked least 12.0 MiB; chunked in 4: 2.6 MiB
    ref_model = LM()
    model = copy.deepcopy(ref_model)
    ref = ref_model(x, y)
    ref.backward()
    torch._dynamo.reset()
    with pytest.raises(fxremat.BudgetError, match="chunk_loss='auto'") as info:
        _step(copy.deepcopy(model), x, y, budget=budget, chunk_loss="off")
    assert "4096 classes" in str(info.value)
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled, loss = _step(model, x, y, budget=budget)
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()  # the whole-loss attempt raised: nothing of it is recorded
    assert plan.chunked and "vs unchunked" in plan.chunked[0]
    model.zero_grad(set_to_none=True)
    measured = fxremat.measure(lambda: compiled(x, y).backward())
    assert measured.peak_bytes <= budget


def test_the_chunk_count_is_the_fewest_the_budget_asks():
    from fxremat.passes.chunk_loss import AUTO_CHUNKS, LossSite, chunk_count

    site = LossSite(None, None, None, None, None, tokens=512, vocab=131072, logits_escape=False)  # type: ignore[arg-type]
    mib = 1 << 20  # the fp32 logits: 256 MiB
    assert chunk_count(site) == AUTO_CHUNKS == 16  # no budget: the most, 32 tokens each
    assert chunk_count(site, budget=4096 * mib) == 2  # one chunk of 128 MiB is 1/32 of it
    assert chunk_count(site, budget=1024 * mib) == 4
    assert chunk_count(site, budget=300 * mib) == 16
    assert chunk_count(site, budget=1) == 16
    assert chunk_count(site, chunks=5, budget=1) == 5  # a number given is kept
    short = LossSite(None, None, None, None, None, tokens=96, vocab=131072, logits_escape=False)  # type: ignore[arg-type]
    assert chunk_count(short, budget=1) == 3  # never under 32 tokens a chunk


@pytest.mark.parametrize("budget_mib, chunks", [(8, 2), (4, 8)])
def test_a_loose_budget_gets_few_chunks_and_more_when_they_do_not_fit(monkeypatch, budget_mib, chunks):
    from fxremat.passes import chunk_loss

    # Least peaks of this LM: 12.0 MiB whole, 6.3 MiB in 2 chunks, 3.4 in 4, 2.0 in 8 (the most).
    monkeypatch.setattr(chunk_loss, "CHUNK_SHARE", 1.0)  # 4 MiB of logits: 2 chunks under a 4 or 8 MiB budget
    x, y = _data()
    ref_model = LM()
    model, ref = _twin(ref_model, x, y)
    budget = budget_mib << 20
    compiled, loss = _step(model, x, y, budget=budget)
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()  # a plan in 2 chunks that did not fit is set aside: not recorded
    assert plan.chunked and f"{chunks} chunks of" in plan.chunked[0]
    model.zero_grad(set_to_none=True)
    assert fxremat.measure(lambda: compiled(x, y).backward()).peak_bytes <= budget


def test_a_graph_auto_chunked_is_planned_again_chunked_without_planning_the_loss_whole(monkeypatch):
    from fxremat import planner

    x, y = _data()
    ref_model = WithLogits()
    model = copy.deepcopy(ref_model)
    ref = ref_model(x, y)[0]
    ref.backward()
    torch._dynamo.reset()
    fxremat.clear_plans()
    compiled = torch.compile(model, backend="fxremat", options={"inner": "eager", "budget": 8 << 20})
    compiled(x, y)[0].backward()  # the logits dropped: planned again for that on the next call
    [first] = fxremat.plans()
    assert first.chunked
    calls = []
    choose = planner.choose
    monkeypatch.setattr(planner, "choose", lambda *a, **k: calls.append(1) or choose(*a, **k))
    model.zero_grad(set_to_none=True)
    loss = compiled(x, y)[0]
    loss.backward()
    compare(ref_model, ref, model, loss)
    assert len(calls) == 1  # the chunked graph only
    assert fxremat.plans()[-1].chunked and fxremat.plans()[-1] is not first


def test_chunk_loss_on_chunks_as_auto_would_without_a_budget():
    x, y = _data()
    torch._dynamo.reset()
    fxremat.clear_plans()
    _step(LM(), x, y, chunk_loss="on")
    (plan,) = fxremat.plans()
    assert plan.chunked and f"{chunk_count_of(T)} chunks" in plan.chunked[0]


def chunk_count_of(tokens: int) -> int:
    from fxremat.passes.chunk_loss import AUTO_CHUNKS, MIN_ROWS_PER_CHUNK

    return max(1, min(AUTO_CHUNKS, tokens // MIN_ROWS_PER_CHUNK))


@pytest.mark.parametrize("whole, chunked", [(50, 100), (100, 50)])
def test_a_refused_budget_names_the_lower_least_of_the_loss_whole_and_chunked(whole, chunked):
    from fxremat.chunking import compile_choosing_chunks

    (gm,) = _dynamo_graph(LM(), *_data())

    def compile_one(gm, example_inputs, options, notes):
        raise fxremat.BudgetError(options.budget, chunked if notes else whole)

    with pytest.raises(fxremat.BudgetError) as info:
        compile_choosing_chunks(gm, [], fxremat.Options.from_mapping({"budget": 10}), compile_one)
    assert info.value.least_peak == 50
    assert ("with the loss whole" if whole < chunked else "with the loss chunked") in str(info.value)


def test_auto_does_not_chunk_without_a_budget_or_when_the_whole_loss_fits():
    x, y = _data()
    for options in ({}, {"budget": 64 << 20}):
        torch._dynamo.reset()
        fxremat.clear_plans()
        _step(LM(), x, y, **options)
        (plan,) = fxremat.plans()
        assert plan.chunked == ()


def test_auto_never_leaves_two_plans_for_one_graph_under_on_infeasible_min():
    x, y = _data()
    torch._dynamo.reset()
    fxremat.clear_plans()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(LM(), x, y, budget=1 << 20, on_infeasible="min")
    (plan,) = fxremat.plans()
    assert plan.chunked and not plan.feasible


@pytest.mark.parametrize("value", [1, 0, "yes", 2.0, True])
def test_chunk_loss_option_is_validated(value):
    with pytest.raises(ValueError, match="chunk_loss"):
        fxremat.Options.from_mapping({"chunk_loss": value})


class WideLM(LM):
    """A body wide enough that fitting the loss whole recomputes work in it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(H, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, H))


def _counting_forwards(monkeypatch) -> list[int]:
    """Node counts of the forward programs the eager inner compiler is handed (its code generation)."""
    import importlib

    backend = importlib.import_module("fxremat.backend")  # the module, not fxremat.backend the function
    compiled, compile_program = [], backend.eager_compiler

    def counting(gm, example_inputs, **kwargs):
        compiled.append(len(gm.graph.nodes))
        return compile_program(gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend, "eager_compiler", counting)
    return compiled


@pytest.mark.parametrize("chunked_better", [True, False])
def test_only_the_plan_that_runs_is_compiled_when_auto_weighs_the_loss_whole_and_chunked(monkeypatch, chunked_better):
    # At 13.5 MiB the whole loss fits by recomputing 0.27 ms of the body; chunking made free, auto
    # plans the chunked loss too. Before, the whole graph was compiled first, then the chunked one.
    from fxremat import chunking

    monkeypatch.setattr(chunking, "_extra_seconds", lambda sites, options: 0.0)
    if not chunked_better:
        monkeypatch.setattr(chunking, "_better", lambda *args: False)
    x, y = _data()
    torch.manual_seed(0)
    ref_model = WideLM()
    model, ref = _twin(ref_model, x, y)
    compiled_forwards = _counting_forwards(monkeypatch)
    compiled, loss = _step(model, x, y, budget=int(13.5 * 2**20))
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()
    assert bool(plan.chunked) == chunked_better
    assert len(compiled_forwards) == 2  # one forward, one backward: nothing compiled and dropped
    if not chunked_better:
        # The whole loss's plan, made before the chunked one was weighed, is not searched again.
        assert plan.note.endswith("planned earlier in this compile") and plan.recompute_seconds > 0


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_refused_budget_then_the_least_plan_is_one_search(monkeypatch, inner):
    from fxremat import planner

    searches = []
    solve = planner.solve
    monkeypatch.setattr(planner, "solve", lambda p, b, name, *a: searches.append(name) or solve(p, b, name, *a))
    torch._dynamo.reset()
    fxremat.clear_plans()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Under Inductor the partitioner's settings must not tell the two plans apart either.
        _step(LM(), *_data(), budget=1 << 20, on_infeasible="min", chunk_loss="off", inner=inner)
    (plan,) = fxremat.plans()
    assert not plan.feasible and "planned earlier in this compile" in plan.note
    # The least-peak search (budget 1) and per-layer checkpointing's plan, once each: the plan for
    # on_infeasible="min" reuses what refusing the budget found.
    assert searches.count("per_layer") == 1


def test_a_plan_set_aside_is_not_judged_for_its_report(monkeypatch):
    # Budget out of reach, chunk_loss="auto": the whole loss's least plan (remembered from the refusal)
    # is set aside for the chunked one. What only a report needs (the fastest plan's peak, the step
    # with .grad allocated) is judged for the plan that runs alone.
    from fxremat import planner

    judged = []
    real = planner.accumulating_peaks
    monkeypatch.setattr(
        planner, "accumulating_peaks", lambda a, lowered, o: judged.append(lowered) or real(a, lowered, o)
    )
    x, y = _data()
    torch.manual_seed(0)
    ref_model = WideLM()
    model, ref = _twin(ref_model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, loss = _step(model, x, y, budget=1, on_infeasible="min")
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()
    assert plan.chunked and not plan.feasible
    assert [lowered.peak for lowered in judged] == [plan.predicted_peak]
    assert plan.fastest_peak >= plan.predicted_peak > 0


def test_the_least_plan_runs_the_loss_whole_when_chunking_it_peaks_higher():
    # A small vocabulary: chunking the loss adds more than the logits it saves (vocabulary 32: least plans
    # 104 KiB whole, 139 KiB chunked). budget=1 is below every output, yet the loss whole is still planned and
    # compared: the lower least plan runs.
    x, y = _data(vocab=32)
    torch.manual_seed(0)
    ref_model = LM(vocab=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chunked = fxremat.explain(
            ref_model, x, y, inner="eager", budget=1, on_infeasible="min", chunk_loss="on"
        ).predicted_peak
        model, ref = _twin(ref_model, x, y)
        _, loss = _step(model, x, y, budget=1, on_infeasible="min")
    compare(ref_model, ref, model, loss)
    (plan,) = fxremat.plans()
    assert not plan.chunked and not plan.feasible
    assert plan.predicted_peak < chunked
