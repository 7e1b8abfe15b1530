"""What only the running step shows: which graphs hold memory while another runs, and
whether the caller keeps a graph's outputs through its backward.

Every compiled graph is wrapped (``track``). Each call that builds an autograd graph
leaves an entry: the plan's saved bytes and weak references to the call's outputs.
While some output is alive and the graph's backward has not started, the entry holds
its saved activations and outputs; a graph compiled meanwhile (the graph after a
graph break, compiled while the earlier one's forward has run) is planned under the
budget less what the entries hold. A backward hook sees which outputs the caller
still holds when the backward starts: a plan that assumed them alive (the default,
an upper bound) is planned again with them released (``loss = model(x).loss``
drops the logits), once, on the graph's next call.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ._torch_compat import FakeTensor, StorageWeakRef, copy_dynamo_graph, dynamo_context_now, fsdp_groups
from .budget import BudgetError, format_bytes
from .grads import on_hand_over
from .options import Options
from .passes.chunk_loss import find_loss_sites, is_head_gradient
from .plan import Plan
from .compile_scope import remembering, vetoing

__all__ = [
    "track",
    "held",
    "running_plans",
    "TrackedGraph",
    "REPLAN_MIN_SHARE",
    "ACCUMULATING_MIN_UNUSED",
    "CALLER_RESERVE",
    "FSDP_RESHARDED_COPIES",
]

log = logging.getLogger("fxremat")

# Re-plan a graph when the outputs its plan counted as alive through the backward
# (but the caller had dropped) are at least this share of the budget: below it the
# plan would barely change and a recompile is not worth its time.
REPLAN_MIN_SHARE = 0.01

# A least plan (``on_infeasible="min"``, the budget out of reach) of a graph that returns its loss is
# planned for callers that drop its other outputs before the backward (`model(**batch).loss`,
# transformers.Trainer), checked at the first backward, where one of them is at least this large
# (the logits): planned with them alive, the second step planned and compiled it again once it saw
# them dropped (the benchmark GPT-2: 49.6 s of its least plan's 136.5 s to the plan that stays).
# Graphs whose loss the caller computes from the outputs (which it may hold through the backward,
# as `.square().mean()` does) and small outputs are planned with them alive, as other plans are.
LEAST_DROPPED_MIN_BYTES = 64 << 10


def _replan_bytes(budget: int | None, plan: Plan) -> int:
    """Outputs worth planning a graph again for (or, with no budget, reporting it again): ``REPLAN_MIN_SHARE``
    of its budget, or of its predicted peak when that is above the budget (a least plan: with ``budget=1``
    the loss scalar alone, alive through its own backward, counted as kept outputs and planned the graph
    again)."""
    return math.ceil(REPLAN_MIN_SHARE * max(budget or 1, plan.predicted_peak))


# Under a budget, plan a graph again for steps that add their gradients into existing ``.grad``
# when its plan for steps that make new ``.grad`` leaves more than this share of the budget
# unused on them (the planner's own aim: CLOSE_ENOUGH).
ACCUMULATING_MIN_UNUSED = 0.03

# Bytes reserved for a caller that computes a loss on a graph's outputs, per byte of the gradient
# it hands the graph's backward: the largest measured over the idioms (the caller's own peak
# between forward and backward, less the gradient the plan counts): square().mean() 3, mse_loss
# 2, cross_entropy 1 (fxremat/steps.py, _note_caller).
CALLER_RESERVE = 3
# With no budget, the backwards watched before a graph's calls stop being watched (``_watch``): by then
# the first steps have shown whether the caller drops the outputs. Each watched call cost about 0.1 ms
# (a multi-grad hook, weak references, every argument's storage): 6-7% of a tiny HF GPT-2's or
# Llama's 1.5-1.8 ms step.
SETTLED_AFTER = 3

# Compiles a graph under options: (gm, example_inputs, options) -> (callable, plan or None).
Compile = Callable[[torch.fx.GraphModule, list, Options], tuple[Callable, "Plan | None"]]


@dataclass
class _Call:
    """One call of a compiled graph whose autograd graph may still be alive."""

    graph: str
    saved_bytes: int
    outputs: list[weakref.ref]
    leaves: frozenset[int]
    """Storages of the leaf inputs (parameters) the call takes gradients of."""
    owner: int = 0
    """``id`` of the TrackedGraph that made the call (its plan's name changes when it is planned again)."""
    storages: tuple[tuple[StorageWeakRef, int, int], ...] = ()
    """The outputs' storages, their bytes and data pointers: alive as long as any view of them is (FSDP2 hands the
    caller views of a layer's outputs, made by its own autograd function, and drops the originals)."""
    node: weakref.ref | None = None
    """The call's backward node: while it is alive, so are the activations saved for it."""
    backward_started: bool = False
    fed: bool = False
    """A later compiled call took one of its outputs as an input (a graph break, the next layer's
    graph): the gradient its backward is handed comes from that graph, not from the caller."""

    def outputs_alive(self) -> int:
        """Bytes of the distinct storages of this call's outputs the caller still holds."""
        return _bytes([t for t in (r() for r in self.outputs) if t is not None])

    def held(self) -> int:
        """Bytes this call keeps alive: its saved activations and its live outputs."""
        if self.backward_started:
            return 0
        outputs = sum(nbytes for ref, nbytes, _ in self.storages if not ref.expired())
        if not outputs and (self.node is None or self.node() is None):
            return 0  # nothing references its autograd graph: the saved tensors are gone too
        return self.saved_bytes + outputs


_LOCK = threading.Lock()
_CALLS: list[_Call] = []


def _real(t) -> bool:
    """A tensor with real memory: not fake (DDP's graph splitter runs compiled pieces on fake
    tensors), not meta, strided."""
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.layout == torch.strided and not t.is_meta


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (real ones)."""
    storages = {}
    for t in tensors:
        if _real(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(storages.values())


def held() -> list[_Call]:
    """The calls whose backward has not run yet and that still hold memory."""
    with _LOCK:
        _prune()
        return list(_CALLS)


# Calls are pruned as they are logged once the log reaches this length, which then doubles what is
# left: without a budget nothing else reads the log, and it grew by one call per step (a leak).
_PRUNE_AT = [64]


def _prune() -> None:
    """Drop the logged calls that hold nothing any more (under ``_LOCK``)."""
    _CALLS[:] = [c for c in _CALLS if c.held()]
    _PRUNE_AT[0] = max(64, 2 * len(_CALLS))


def _append(call: _Call) -> None:
    """Log ``call`` (under ``_LOCK``), dropping the calls that hold nothing any more now and then."""
    if len(_CALLS) >= _PRUNE_AT[0]:
        _prune()
    _CALLS.append(call)


class _Parameters:
    """A set of tensors by identity, held weakly (``weakref.WeakSet`` would compare tensors with ``==``,
    elementwise, where two hash alike)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t

    def __iter__(self):
        return iter([t for t in (r() for r in list(self._refs.values())) if t is not None])

    def update(self, tensors) -> None:
        self._refs = {k: r for k, r in self._refs.items() if r() is not None}
        self._refs.update((id(t), weakref.ref(t)) for t in tensors)

    def discard(self, tensors) -> None:
        for t in tensors:
            if t in self:
                del self._refs[id(t)]


# Parameters of graphs whose caller was seen dropping the outputs before the backward (the `.loss` idiom):
# another graph of the same model (a new sequence length under a budget) is planned for that from its
# first compile, checked at its first backward. Weak: a model's parameters leave with it.
_DROPPED_BY_CALLER = _Parameters()


def _params(args) -> list[torch.Tensor]:
    """The leaf tensors among ``args`` that require grad (the parameters)."""
    return [a for a in args if _real(a) and a.requires_grad and a.is_leaf]


def _grads_exist(args) -> bool:
    """Whether every parameter among ``args`` has its ``.grad``."""
    params = _params(args)
    return bool(params) and all(p.grad is not None for p in params)


def _leaves(args) -> dict[int, int]:
    """Storage -> bytes of the parameters among ``args``."""
    return {a.untyped_storage().data_ptr(): a.untyped_storage().nbytes() for a in _params(args)}


class TrackedGraph:
    """One compiled graph: its current program and plan, and a re-plan asked for its next call."""

    def __init__(self, gm: torch.fx.GraphModule, options: Options, compile_graph: Compile, replannable: bool) -> None:
        self.options = options
        self.compile_graph = compile_graph
        self.source = copy_dynamo_graph(gm) if replannable else None
        self.dynamo_context = dynamo_context_now() if replannable else None
        self.compiled: Callable | None = None
        self.plan: Plan | None = None
        self.pending: Options | None = None
        self.released = False  # re-planned once with the outputs released
        self.assumed_released = False  # planned with the outputs released before any step showed it
        self.returned_peak: int | None = None
        """The plan's own prediction (gradients returned at the end), while the running plan shows the
        one of a step whose parameters' ``.grad`` exist (``_note_grads``)."""
        self.for_grads: bool | None = options.grads_allocated is True
        """Whether the running program was planned for steps whose parameters' ``.grad`` exist
        (None: nothing compiled since the last re-plan)."""
        self.variants: dict[bool, tuple[Callable, Plan | None]] = {}
        """The program and plan for the other kind of step, while the running one is for this kind."""
        self.warned_no_grads = False
        self.caller_checked = False
        self.caller_reserved = 0
        """Bytes of ``options.reserve`` set aside for a loss the caller computes on the outputs
        (``_caller_room``), until the first backward shows what it needs."""
        self.user_reserve = options.reserve
        """The user's ``reserve`` (a graph sized nothing for its caller when it is set)."""
        self.accumulates = False
        """A backward of this graph added its gradients into existing ``.grad``, and its plan left
        part of the budget unused on such steps: they get a plan of their own."""
        self.accumulating_refused = False
        """Planning such steps on their own found no plan under the budget: not tried again."""
        self.reserved: dict[frozenset, int] = {}
        self.user_budget = options.budget
        self.repeats: list[tuple[int, int]] = []
        """(calls of this graph holding memory, counting this one; bytes others hold) at each repeated
        call of the running step: a graph reused for every layer of a model (graph breaks between
        layers, FSDP2 wrapping each one) runs while its own earlier calls hold their activations."""
        self.watched = 0
        """Backwards watched with no budget (``_watch``)."""
        self.parameters = _Parameters()
        """The parameters among its inputs (``_DROPPED_BY_CALLER``)."""
        self.params_at: tuple[int, ...] | None = None
        """With no budget, once what a backward can show is settled (``SETTLED_AFTER``): the positions of
        the parameters among the arguments, whose ``.grad`` each call then checks instead of watching."""

    def ask(self, why: str, **changes) -> None:
        """Plan this graph again on its next call, with ``changes`` to its options (they add up)."""
        if self.source is None or self.plan is None:
            return
        self.pending = dataclasses.replace(self.pending or self.options, **changes)
        log.warning("fxremat %s: %s; planning it again on its next call", self.plan.graph, why)

    def reserve(self, key: frozenset, nbytes: int, user_budget: int, why: str) -> None:
        """Keep ``nbytes`` of ``user_budget`` free for a later graph of the step (``key`` names it).

        What one later graph needs while this graph's memory is alive bounds this
        graph's whole plan, so the largest reservation counts, not their sum.
        """
        if self.reserved.get(key, 0) >= nbytes:
            return
        self.reserved[key] = nbytes
        # Its calls so far in this step (a graph reused per layer) all hold memory while that graph runs.
        calls = max([self.options.repeats] + [n for n, _ in self.repeats])
        self.ask(why, budget=max(1, user_budget - max(self.reserved.values())), repeats=calls)

    def check_repeats(self) -> None:
        """At the step's backward: did this graph's repeated calls fit the budget? If not, plan it for them.

        A plan for ``n`` calls is judged at its peak plus ``n - 1`` times its saved
        bytes (``Options.repeats``), under the budget less what other graphs and
        the earlier calls' outputs held.
        """
        contexts, self.repeats = self.repeats, []
        plan, budget = self.plan, self.user_budget
        if not contexts or plan is None or budget is None:
            return
        user_budget = budget
        budget -= self.options.reserve  # the rest of the step's memory is not this graph's
        planned = self.options.repeats
        # The plan's own prediction (gradients kept to the end), not a step's with .grad allocated.
        planned_peak = plan.predicted_peak if self.returned_peak is None else self.returned_peak
        single = planned_peak - (planned - 1) * plan.saved_bytes
        calls = max(n for n, _ in contexts)
        others = max(extra for _, extra in contexts)
        worst = max(single + (n - 1) * plan.saved_bytes + extra for n, extra in contexts)
        if worst <= budget and calls <= planned:
            return
        if worst > budget:
            if calls > planned:
                why = (
                    f"the graph ran {calls} times in this step, each earlier call holding its "
                    f"{format_bytes(plan.saved_bytes)} of saved activations (a graph reused for every layer, e.g. "
                    "graph breaks between layers or FSDP2 wrapping each one)"
                )
            else:
                why = (
                    f"its {calls} calls in this step ran while other graphs and the earlier calls' outputs held "
                    f"up to {format_bytes(others)}"
                )
            warnings.warn(
                f"fxremat {plan.graph}: {why}: this step could peak {format_bytes(worst - budget)} above the "
                f"budget {format_bytes(budget)} (after what is reserved outside the graph)",
                stacklevel=3,
            )
            reserved = max(self.reserved.values(), default=0)
            self.ask(
                f"it runs {calls} times in a step, while other graphs hold memory; planning it for that",
                repeats=max(calls, planned),
                budget=max(1, user_budget - reserved - others),
            )

    def note_handed_over(self) -> None:
        """A backward of this graph added its gradients into existing ``.grad``: when its plan leaves
        part of the budget unused on such steps, plan them on their own from the next call on."""
        plan, options = self.plan, self.options
        if self.accumulates or self.for_grads or self.source is None or plan is None or options.budget is None:
            return
        if self.accumulating_refused:
            return  # planned for such steps once and no plan fitted: the first plan runs for both
        if options.grads_allocated is not None or plan.recompute_seconds <= 0:
            return  # fixed by the user, or nothing recomputed: nothing to gain
        budget = max(1, options.budget - options.reserve)
        # Out of reach (on_infeasible="min"), such steps may have a least plan of their own.
        if plan.feasible and plan.accumulating_peak > (1 - ACCUMULATING_MIN_UNUSED) * budget:
            return
        self.accumulates = True
        log.warning(
            "fxremat %s: its backward adds the gradients into existing .grad (gradient accumulation, "
            "zero_grad(set_to_none=False)), where its plan peaks at %s of %s; planning such steps on their own "
            "on the next call that finds .grad allocated",
            plan.graph,
            format_bytes(plan.accumulating_peak),
            format_bytes(budget),
        )

    def note_returned(self, param_bytes: int) -> None:
        """A backward of this graph returns its gradients at its end: a plan made for steps that add
        them into ``.grad`` (``Options.grads_allocated``) can then peak above its prediction, once
        warned."""
        plan = self.plan
        if not self.for_grads or plan is None or self.warned_no_grads:
            return
        self.warned_no_grads = True
        warnings.warn(
            f"fxremat {plan.graph}: planned for steps whose parameters' .grad exist, and this backward returns "
            "its gradients at its end instead of adding them in (no .grad, a hook on a parameter, retain_graph, "
            f"torch.autograd.grad or torch.distributed): the step can peak up to {format_bytes(param_bytes)} "
            "above the plan's prediction",
            stacklevel=2,
        )

    def _grads_first(self, args) -> bool:
        """Whether a re-plan at this call is for steps adding into ``.grad`` first (``__call__``)."""
        options = self.options
        return (
            options.budget is not None
            and options.grads_allocated is None
            and options.hand_over_grads
            and not self.accumulating_refused
            and _grads_exist(args)
        )

    def _compile(self, args, options: Options) -> None:
        """Plan and compile the graph again under ``options`` (the running step's state decided them)."""
        assert self.source is not None
        if options.chunk_loss == "auto" and self.plan is not None and self.plan.chunked:
            # The running plan chose to chunk the loss. With more room (the logits dropped, .grad
            # allocated) chunked still fits, at most the head's matmul slower; with less, chunking
            # matters more. Planning it whole again to compare would cost a plan and a compile.
            log.info("fxremat %s: the loss stays chunked, as its first plan chose", self.plan.graph)
            options = dataclasses.replace(options, chunk_loss="on")
        source = copy_dynamo_graph(self.source)
        context = self.dynamo_context
        examples = None if context is None else _dynamo_examples(source, args)
        if context is None or examples is None:
            self.compiled, self.plan = self.compile_graph(source, list(args), options)
        else:
            with context():
                self.compiled, self.plan = self.compile_graph(source, examples, options)
        self.returned_peak = None  # the new plan's prediction is its own
        if self.plan is not None:
            _GRAPHS[self.plan.graph] = self  # later graphs find it by its new plan's name

    def _compile_for_grads(self, args, first: Plan | None = None) -> None:
        """Plan and compile the program of steps whose parameters' ``.grad`` exist; ``BudgetError`` when
        none fits the budget, or, with the budget out of reach (``on_infeasible="min"``), when their least
        plan peaks no lower on them than ``first`` (default: the plan for steps making new ``.grad``) does."""
        options = dataclasses.replace(self.options, grads_allocated=True, on_infeasible="error")
        first = first or self.variants.get(False, (None, None))[1]
        if first is None or first.feasible or self.options.on_infeasible != "min":
            self._compile(args, options)
            return
        # Out of reach: the least plan of steps making new .grad need not be theirs. Those peak late
        # in the backward, where the new gradients pile up; these where the saved activations do.
        theirs = first.released_accumulating_peak if self.released else first.accumulating_peak

        def no_lower(plan: Plan) -> bool:
            return plan.predicted_peak >= theirs

        with vetoing(no_lower) as set_aside:
            self._compile(args, dataclasses.replace(options, on_infeasible="min"))
            return
        assert set_aside.plan is not None
        raise BudgetError(options.budget or 1, set_aside.plan.predicted_peak, why="no lower than the first plan")

    def _run_for(self, grads: bool, args, first: Plan | None = None) -> None:
        """Make the running program the one planned for steps with (``grads``) or without ``.grad``
        (``first``: see ``_compile_for_grads``)."""
        if grads == self.for_grads:
            return
        if self.for_grads is not None and self.compiled is not None:
            own = self.plan
            if own is not None and self.returned_peak is not None:
                own = dataclasses.replace(own, predicted_peak=self.returned_peak, note=_without_grads_note(own.note))
            self.variants[self.for_grads] = (self.compiled, own)
        self.for_grads = grads
        if grads in self.variants:
            self.compiled, self.plan = self.variants.pop(grads)
            self.returned_peak = None
            if self.plan is not None:
                _GRAPHS[self.plan.graph] = self
            return
        if grads and self.options.grads_allocated is None:
            try:
                self._compile_for_grads(args, first)
            except BudgetError as exc:
                # The plan for steps making new .grad fits these steps too: it runs for both.
                self.accumulates = False
                self.accumulating_refused = True
                self.for_grads = None
                log.warning("fxremat: no plan of its own for steps with .grad allocated (%s); keeping the first", exc)
                self._run_for(False, args)
            return
        options = self.options
        try:
            self._compile(args, options)
        except BudgetError as exc:
            # The step as a whole does not fit: keep training at this graph's least plan, loudly.
            options = dataclasses.replace(options, on_infeasible="min")
            warnings.warn(f"fxremat: the graphs of this step together need more than the budget: {exc}", stacklevel=3)
            self._compile(args, options)
        self.options = options

    def __call__(self, *args):
        replaced = None
        if self.pending is not None and self.source is not None:
            replaced = self.plan
            self.options, self.pending = self.pending, None
            self.variants.clear()
            self.for_grads = None
        if self.source is not None:
            with remembering():  # a refused plan then the least one: searched once
                if replaced is not None and self._grads_first(args):
                    # Planned again at a call that finds .grad allocated (the first step made them and the
                    # loop keeps them): plan for such steps first; one that makes new .grad later gets its
                    # own plan then. Before, the plan for steps making .grad came first and these steps got
                    # theirs a call later: one more plan and compile (HF Llama: 40 s).
                    self.accumulates = True
                    self._run_for(True, args, replaced)
                elif self.accumulates:
                    self._run_for(_grads_exist(args), args)
                elif self.for_grads is None:
                    self._run_for(self.options.grads_allocated is True, args)
        assert self.compiled is not None
        out = self.compiled(*args)
        if self.plan is not None and torch.is_grad_enabled():
            if self.params_at is None:
                _watch(out, args, self)
            elif self.options.hand_over_grads and self.params_at and _real(args[self.params_at[0]]):
                _note_grads(self, all(args[i].grad is not None for i in self.params_at))
        return out


def _dynamo_examples(gm: torch.fx.GraphModule, args) -> list | None:
    """Dynamo's example values for ``gm``'s inputs (fake tensors, and ints or SymInts for the arguments that
    are not tensors), or None when one is missing: then the real arguments stand for them."""
    examples = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    if len(examples) != len(args):
        return None
    for e, a in zip(examples, args):
        if not (isinstance(e, FakeTensor) or (isinstance(e, (int, torch.SymInt)) and not isinstance(a, torch.Tensor))):
            return None
    return examples


_GRAPHS: "weakref.WeakValueDictionary[str, TrackedGraph]" = weakref.WeakValueDictionary()


def running_plans() -> list[Plan]:
    """The plan each compiled graph still alive runs now: a re-planned graph's newest plan, not the first.

    ``fxremat.plans()`` keeps every plan made, including those a re-plan replaced
    (after the first step showed the outputs dropped, or a later graph's needs);
    this is what the next step will run, in the order the graphs were first planned.
    Graphs that are gone (their compiled model deleted and collected) drop out;
    ``fxremat.explain``'s dry graphs count until they are collected.

    Example:
        >>> loss = compiled(x); loss.backward(); compiled(x).loss.backward()
        >>> [p.graph for p in fxremat.running_plans()]
        ['graph 1']
    """
    seen: dict[int, TrackedGraph] = {}
    for graph in list(_GRAPHS.values()):
        if graph.plan is not None:
            seen.setdefault(id(graph), graph)
    return [g.plan for g in seen.values() if g.plan is not None]


def track(
    gm: torch.fx.GraphModule, example_inputs: list, options: Options, compile_graph: Compile, caller_room: bool = True
) -> TrackedGraph:
    """Compile ``gm`` under the budget the running step leaves it, and watch its calls.

    Under a budget, what earlier graphs of the running step hold (their saved
    activations and live outputs) is taken off the budget this graph is planned
    under. When that leaves too little, this graph takes its least-memory plan
    and the graphs holding the memory are planned again, from their next call,
    under the budget less what this graph needs: this first step may exceed the
    budget (a warning says by how much), later steps fit.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: the user's options.
        compile_graph: the compile pipeline (``backend.build_compiler``'s).
        caller_room: whether a graph whose outputs hold no scalar loss leaves room in its first plan
            for a loss its caller computes on them (``_caller_room``); False where the caller is
            known to allocate nothing there (``explain`` sums the outputs).

    Returns:
        The callable Dynamo runs in place of the graph.
    """
    calls = held() if options.budget is not None else []
    options = _with_fsdp(options, example_inputs, first=not calls)
    graph = TrackedGraph(gm, options, compile_graph, replannable=options.budget is not None)
    graph.parameters.update(_params(example_inputs))
    holding, holders = sum(c.held() for c in calls), sorted({c.graph for c in calls})
    planned = options
    if not holding:
        planned = _compile_alone(graph, gm, example_inputs, options, caller_room)
    else:
        assert options.budget is not None and graph.source is not None
        budget = options.budget
        planned = dataclasses.replace(options, budget=max(1, budget - holding))
        mine = _leaves(example_inputs)
        key = frozenset(mine)
        try:
            graph.compiled, graph.plan = compile_graph(gm, example_inputs, planned)
        except BudgetError as exc:
            need = exc.least_peak - planned.reserve  # the graph's own least peak
            if need + planned.reserve > budget:
                raise BudgetError(
                    budget, need + planned.reserve, where=f"a graph run while {', '.join(holders)} hold memory"
                ) from None
            planned = dataclasses.replace(planned, on_infeasible="min")
            graph.compiled, graph.plan = compile_graph(copy_dynamo_graph(graph.source), example_inputs, planned)
            _reserve(
                holders,
                key,
                need,
                budget,
                f"it holds memory while a later graph of the step needs {format_bytes(need)}",
            )
            warnings.warn(
                f"fxremat: a graph compiled after {', '.join(holders)} in one step (a graph break) needs "
                f"{format_bytes(need)} while they hold {format_bytes(holding)}"
                + (f" and {format_bytes(planned.reserve)} is reserved outside the graphs" if planned.reserve else "")
                + f": this first step can peak {format_bytes(holding + need + planned.reserve - budget)} above the "
                f"budget {format_bytes(budget)}; "
                "the graphs holding the memory are planned again for the next steps.",
                stacklevel=3,
            )
        # Gradients this graph computes for parameters an earlier graph also uses wait for that
        # graph's backward before autograd adds them into .grad: they are alive through it.
        for call in calls:
            shared = sum(nbytes for ptr, nbytes in mine.items() if ptr in call.leaves)
            if shared:
                _reserve(
                    [call.graph],
                    key,
                    shared,
                    budget,
                    f"a later graph of the step computes {format_bytes(shared)} of gradients of parameters it "
                    "also uses, alive through its backward",
                )
        if graph.plan is not None:
            log.info(
                "fxremat %s: planned under %s: %s held by %s in this step",
                graph.plan.graph,
                format_bytes(planned.budget or 0),
                format_bytes(holding),
                ", ".join(holders),
            )
    graph.options = planned
    if graph.plan is not None:
        _GRAPHS[graph.plan.graph] = graph
    return graph


# FSDP2's buffers outside the compiled graphs. Groups not resharded after the forward (the
# root, by default) hold their unsharded parameters through the whole step, and at its end a
# copy of their gradients for the reduce-scatter and its result. While a resharded group's graph runs its
# backward: its own unsharded parameters, the next group's, all-gathered ahead (implicit
# prefetch), and the reduce-scatter copy of its gradients.
FSDP_RESHARDED_COPIES = 3


def _fsdp_room(groups) -> int:
    """Bytes FSDP2's hooks hold outside fxremat's graphs at a step's peak, from the model's groups
    (0 without FSDP2): the unsharded parameters of the groups not resharded after the forward,
    plus the larger of ``FSDP_RESHARDED_COPIES`` times the largest resharded group's (a layer's
    backward), or twice those kept groups' bytes (the step's end: the reduce-scatter's copy of
    their gradients and its result; measured on a one-group model, 89.7 KB for 27.4 KB of graph
    and 25.3 KB of parameters)."""
    kept = sum(g.nbytes for g in groups if not g.resharded)
    largest = max((g.nbytes for g in groups if g.resharded), default=0)
    return kept + max(FSDP_RESHARDED_COPIES * largest, 2 * kept)


def _fsdp_layers(groups) -> int:
    """How many times a graph whose parameters are one resharded group runs in a step: once per
    group of the same shapes (FSDP2 on each identical layer; Dynamo reuses the layer's graph)."""
    mine = [g for g in groups if g.in_graph]
    if len(mine) != 1 or not mine[0].resharded:
        return 1
    return sum(1 for g in groups if g.resharded and g.shapes == mine[0].shapes)


def _with_fsdp(options: Options, inputs, first: bool) -> Options:
    """Under a budget and FSDP2: the options with FSDP's buffers reserved outside the graph and,
    for a layer's graph compiled while nothing of the step holds memory (``first``), planned
    for every layer of its shapes from its first call (the first plan is an upper bound)."""
    if options.budget is None:
        return options
    groups = fsdp_groups(inputs)
    extra = _fsdp_room(groups)
    if not extra:
        return options
    log.info("fxremat: reserving %s of the budget for FSDP2's unsharded parameters and buffers", format_bytes(extra))
    layers = _fsdp_layers(groups) if first else 1
    return dataclasses.replace(options, reserve=options.reserve + extra, repeats=max(options.repeats, layers))


def _compile_alone(
    graph: TrackedGraph, gm: torch.fx.GraphModule, example_inputs: list, options: Options, caller_room: bool
) -> Options:
    """Compile a graph that runs while nothing else of the step holds memory; returns the options it was planned with.

    A graph whose differentiable outputs include no scalar (no loss inside it)
    leaves its caller room for one in the first plan (``_caller_room``): the first
    step is then within the budget too, and the first backward, which shows what
    the caller needed, gives the room back when it needed less. When the budget
    leaves no room for it, the graph is planned without it, as it would be with a
    loss inside, and the first backward decides.
    """
    room = _caller_room(gm, options) if caller_room and graph.source is not None and not graph.user_reserve else 0
    floor = _allocated_output_bytes(gm) if options.budget is not None else 0
    if room and _out_of_reach_at_once(options, floor):
        room = 0  # no plan fits, with the room or without: planned for the least plan at once (_plan_alone)
    if room:
        roomy = dataclasses.replace(options, reserve=options.reserve + room, on_infeasible="error")
        try:
            planned = _plan_alone(graph, gm, example_inputs, roomy, floor)
        except BudgetError as exc:
            log.warning(
                "fxremat: the budget %s leaves no room for the %s a loss computed on the graph's outputs may "
                "allocate (least peak with it %s): planned without it; the first backward shows what the caller "
                "needs",
                format_bytes(options.budget or 0),
                format_bytes(room),
                format_bytes(exc.least_peak),
            )
            assert graph.source is not None
            gm = copy_dynamo_graph(graph.source)
        else:
            graph.caller_reserved = room
            if graph.plan is not None:
                log.info(
                    "fxremat %s: %s of the budget left for a loss computed on its outputs outside the graph "
                    "(%sx their gradient); the first backward shows what the caller needs",
                    graph.plan.graph,
                    format_bytes(room),
                    CALLER_RESERVE,
                )
            return dataclasses.replace(planned, on_infeasible=options.on_infeasible)
    return _plan_alone(graph, gm, example_inputs, options, floor)


def _caller_room(gm: torch.fx.GraphModule, options: Options) -> int:
    """Bytes to leave, under a budget, for a loss the caller computes on this graph's outputs:
    ``CALLER_RESERVE`` times the gradients of its differentiable outputs, when none of them is a
    scalar (a graph that returns its loss needs none) and that is at least ``REPLAN_MIN_SHARE`` of
    the budget; else 0."""
    if options.budget is None:
        return 0
    grads = [v for v in _output_values(gm) if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point()]
    if not grads or _returns_loss(gm):
        return 0
    if not all(isinstance(v.numel(), int) for v in grads):
        return 0  # dynamic sizes: the first backward sizes the room from the gradient it is handed
    room = CALLER_RESERVE * sum(v.numel() * v.element_size() for v in grads)
    return room if room >= REPLAN_MIN_SHARE * options.budget else 0


def _plan_alone(
    graph: TrackedGraph, gm: torch.fx.GraphModule, example_inputs: list, options: Options, floor: int
) -> Options:
    """``_compile_alone`` for one ``reserve``: the outputs alive through the backward, or dropped before it.

    Whether the caller keeps the outputs alive through the backward is unknown
    until the first backward; the plan assumes it does (an upper bound). When a
    budget is out of reach that way but within reach with the outputs dropped
    before the backward (the ``model(x).loss`` idiom, ``transformers.Trainer``),
    the graph is planned for that, and the first backward checks it. Out of reach
    both ways, with ``on_infeasible="min"``: the least plan (``_least``), planned
    at once where an output alone is over the budget (``floor``: the largest output
    the graph allocates, ``_allocated_output_bytes``).
    """
    if options.release_outputs is not None or graph.source is None:
        graph.compiled, graph.plan = graph.compile_graph(gm, example_inputs, options)
        return options
    if any(p in _DROPPED_BY_CALLER for p in graph.parameters):
        # Another graph of this model (another input size) showed its caller drops the outputs before the
        # backward: planned for that at once (one compile instead of two), checked at the first backward.
        dropped = dataclasses.replace(options, release_outputs=True)
        graph.compiled, graph.plan = graph.compile_graph(gm, example_inputs, dropped)
        return _planned_released(graph, options, "the caller of another graph of this model drops its outputs")
    if _out_of_reach_at_once(options, floor):
        # No plan peaks below an output the forward allocates: the least plan at once, without first
        # planning the refusal that a plan under the budget would need (GPT-2 with budget=1: 11.5 s).
        why = f"its outputs ({format_bytes(floor)} the largest) are over the budget alone: the least-memory plan"
        return _least(graph, gm, example_inputs, options, floor, why)
    try:
        first = dataclasses.replace(options, on_infeasible="error")
        graph.compiled, graph.plan = graph.compile_graph(gm, example_inputs, first)
        return options
    except BudgetError as exc:
        # Without its traceback: a kept traceback holds this frame (a reference cycle), and with it
        # every frame of the failed compile, until the garbage collector runs.
        held_error = exc.with_traceback(None)
        if held_error.__suppress_context__:
            held_error.__context__ = None  # hidden by `raise ... from None`, and it holds its own traceback
    # Dropping the outputs frees at most their bytes: when even that cannot reach the budget,
    # planning the graph that way again is wasted time (a scalar loss's graph, for one). Not with a
    # loss that can be chunked: its least plans with the outputs alive and dropped differed by more
    # than the outputs (the quickstart's GPT-2: 2.79 and 1.47 MiB, 1.16 MiB of outputs).
    outputs = _output_bytes(graph.source)
    released_least = None
    chunkable = options.chunk_loss != "off" and bool(find_loss_sites(graph.source))
    if held_error.least_peak - outputs <= held_error.budget or chunkable:
        dropped = dataclasses.replace(options, release_outputs=True, on_infeasible="error")
        try:
            graph.compiled, graph.plan = graph.compile_graph(copy_dynamo_graph(graph.source), example_inputs, dropped)
        except BudgetError as exc:
            released_least = exc.least_peak
        else:
            why = (
                f"with its outputs alive through the backward the least peak is {format_bytes(held_error.least_peak)}, "
                "over the budget"
            )
            return _planned_released(graph, options, why, logging.WARNING)
    if options.on_infeasible == "error":
        # What planning with the user's options raises, saying what other callers would need.
        error = _with_released(held_error, outputs, released_least)
        raise _with_grads(error, sum(_leaves(example_inputs).values()), options)
    # Out of reach either way: the user's choice, its least plan.
    why = (
        f"the budget is out of reach with its outputs alive or dropped (least peak {format_bytes(held_error.least_peak)} "
        "alive): the least-memory plan"
    )
    return _least(graph, copy_dynamo_graph(graph.source), example_inputs, options, floor, why)


def _least(
    graph: TrackedGraph, gm: torch.fx.GraphModule, example_inputs: list, options: Options, floor: int, why: str
) -> Options:
    """Compile the least plan of a graph whose budget is out of reach (``on_infeasible="min"``): for
    callers that drop the outputs before the backward when it returns its loss and an output of
    ``LEAST_DROPPED_MIN_BYTES`` (``floor``: its largest), checked at the first backward; else with them
    alive (an upper bound)."""
    if floor < LEAST_DROPPED_MIN_BYTES or not _returns_loss(gm):
        graph.compiled, graph.plan = graph.compile_graph(gm, example_inputs, options)
        return options
    dropped = dataclasses.replace(options, release_outputs=True)
    graph.compiled, graph.plan = graph.compile_graph(gm, example_inputs, dropped)
    return _planned_released(graph, options, why)


def _out_of_reach_at_once(options: Options, floor: int) -> bool:
    """Whether the least plan is planned at once: ``on_infeasible="min"`` and a budget (less the reserve)
    below ``floor``, an output the graph allocates, which no plan can fit under."""
    return options.on_infeasible == "min" and options.budget is not None and options.budget - options.reserve < floor


def _returns_loss(gm: torch.fx.GraphModule) -> bool:
    """Whether one of the graph's outputs is a differentiable scalar (its loss), from Dynamo's example values."""
    return any(
        isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point() and _numel(v) == 1
        for v in _output_values(gm)
    )


def _allocated_output_bytes(gm: torch.fx.GraphModule) -> int:
    """The largest storage the graph allocates and returns (an output, or the tensor an output views, but
    no input's), from Dynamo's example values: every plan's forward holds it when it returns, so none
    peaks below it. 0 where sizes are symbolic."""
    inputs = {
        StorageWeakRef(v.untyped_storage())
        for v in (n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder"))
        if isinstance(v, torch.Tensor)
    }
    sizes = [
        v.untyped_storage().nbytes()
        for v in _output_values(gm)
        if isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) not in inputs
    ]
    return max((n for n in sizes if isinstance(n, int)), default=0)


def _numel(v: torch.Tensor) -> int:
    """Elements of ``v``; 0 where its size is symbolic (no guard on it)."""
    n = v.numel()
    return n if isinstance(n, int) else 0


def _with_released(error: BudgetError, outputs: int, released_least: int | None) -> BudgetError:
    """``error`` (planned with the outputs alive through the backward), saying what a caller that drops
    them needs: ``released_least`` when that was planned, else at least ``outputs`` less."""
    if outputs < REPLAN_MIN_SHARE * error.least_peak:
        return error
    need = (
        f"{format_bytes(released_least)}"
        if released_least is not None
        else (f"at least {format_bytes(max(1, error.least_peak - outputs))}")
    )
    why = (
        f"That is with the graph's outputs ({format_bytes(outputs)}) alive through the backward, as fxremat plans "
        f"until a step shows otherwise; a caller that drops them before the backward (`model(**batch).loss` drops "
        f"the logits, as transformers.Trainer does) needs {need}: a budget there is planned for that, and checked "
        "at the first backward."
    )
    return error.explained(why)


def _with_grads(error: BudgetError, grad_bytes: int, options: Options) -> BudgetError:
    """``error`` (planned for a step that makes the parameters' ``.grad``), saying that steps finding
    them allocated can need up to ``grad_bytes`` less, and how to plan for those alone."""
    if options.grads_allocated is not None or not options.hand_over_grads:
        return error
    if grad_bytes < REPLAN_MIN_SHARE * error.least_peak:
        return error
    why = (
        f"That is for a step that makes the parameters' .grad (the first, or any after zero_grad()): their "
        f"{format_bytes(grad_bytes)} of gradients are new memory of that step. Steps that find .grad allocated "
        "(zero_grad(set_to_none=False), gradient accumulation) add each gradient in as it is made and can need up "
        "to that much less: options={'grads_allocated': True} plans for them alone (a step that makes .grad can "
        "then exceed the budget by up to that much)."
    )
    return error.explained(why)


def _output_values(gm: torch.fx.GraphModule) -> list:
    """Dynamo's example values of the graph's outputs."""
    nodes: list[torch.fx.Node] = []
    for out in gm.graph.find_nodes(op="output"):
        torch.fx.node.map_arg(out.args, nodes.append)
    return [n.meta.get("example_value") for n in nodes]


def _output_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of the graph's outputs, from Dynamo's example values (an upper bound: aliases counted apiece)."""
    return sum(v.untyped_storage().nbytes() for v in _output_values(gm) if isinstance(v, torch.Tensor))


def _planned_released(graph: TrackedGraph, options: Options, why: str, level: int = logging.INFO) -> Options:
    """Mark ``graph`` as planned for callers that drop its outputs before the backward (checked there),
    saying ``why`` at ``level``."""
    graph.assumed_released = graph.released = True
    if graph.plan is not None:
        log.log(
            level,
            "fxremat %s: %s; planned for callers that drop them before backward (as `model(x).loss` does), "
            "checked at the first backward",
            graph.plan.graph,
            why,
        )
    return dataclasses.replace(options, release_outputs=True)


def _reserve(names, key: frozenset, nbytes: int, user_budget: int, why: str) -> None:
    for name in names:
        holder = _GRAPHS.get(name)
        if holder is not None:
            holder.reserve(key, nbytes, user_budget, why)


def _watch(out, args, graph: TrackedGraph) -> None:
    """Log this call and hook the start of its backward."""
    plan, options = graph.plan, graph.options
    assert plan is not None
    outputs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
    differentiable = tuple(o for o in outputs if o.requires_grad)
    if not differentiable or not all(_real(o) for o in outputs):
        return  # a run on fake tensors (DDP's graph splitter propagating shapes) holds no memory
    # One pass over the arguments (each call of every graph runs this: 45 arguments of a tiny GPT-2).
    inputs: set[int] = set()
    params: list[torch.Tensor] = []
    params_at: list[int] = []
    for i, a in enumerate(args):
        if _real(a):
            inputs.add(a.untyped_storage().data_ptr())
            if a.requires_grad and a.is_leaf:
                params.append(a)
                params_at.append(i)
    inputs.discard(0)
    # Outputs that alias an input (a parameter's view) hold nothing new.
    own = [o for o in outputs if o.untyped_storage().data_ptr() not in inputs]
    storages = {o.untyped_storage().data_ptr(): o for o in own}
    call = _Call(
        plan.graph,
        plan.saved_bytes,
        [weakref.ref(o) for o in own],
        frozenset(p.untyped_storage().data_ptr() for p in params),
        id(graph),
        tuple((StorageWeakRef(o.untyped_storage()), o.untyped_storage().nbytes(), p) for p, o in storages.items()),
        _node(differentiable),
    )
    if options.budget is not None:
        with _LOCK:  # earlier calls whose outputs this one takes: not a caller's loss (_note_caller)
            for earlier in _CALLS:
                if not earlier.fed and any(p in inputs and not ref.expired() for ref, _, p in earlier.storages):
                    earlier.fed = True
        calls = held()
        mine = [c for c in calls if c.owner == id(graph)]
        if mine:
            # What the others hold, and the earlier calls' outputs: their saved bytes depend on the plan.
            extra = sum(c.held() for c in calls) - sum(c.saved_bytes for c in mine)
            graph.repeats.append((len(mine) + 1, extra))
    param_refs = [weakref.ref(a) for a in params]
    with _LOCK:
        _append(call)
        # Whether its backward hands the gradients over matters to a plan made for steps that do
        # (it warns when one does not), and to the first plan under a budget (those steps may get
        # a plan of their own).
        if (
            call.node is not None
            and options.budget is not None
            and options.hand_over_grads
            and (graph.for_grads or (options.grads_allocated is None and not graph.accumulates))
        ):
            _AWAITING[:] = [a for a in _AWAITING if a[0]() is not None and a[1]() is not None]
            _AWAITING.append((call.node, weakref.ref(graph), _bytes(params)))

    def backward_started(grad) -> None:
        call.backward_started = True
        graph.check_repeats()
        _note_caller(graph, grad, call)
        if options.hand_over_grads:
            leaves = [p for p in (r() for r in param_refs) if p is not None]
            _note_grads(graph, len(leaves) == len(param_refs) and all(p.grad is not None for p in leaves))
        if graph.assumed_released and options.budget is not None:
            alive = call.outputs_alive()
            if alive >= _replan_bytes(options.budget, plan):
                # Outputs held only by garbage reference cycles are not the caller's: collected, they are
                # freed before the backward runs (the test suite's order once kept the logits so).
                gc.collect()
                alive = call.outputs_alive()
            if alive >= _replan_bytes(options.budget, plan):
                graph.assumed_released = False
                _DROPPED_BY_CALLER.discard(graph.parameters)
                # A least plan (the budget out of reach) is over the budget anyway: its own prediction is what
                # the kept outputs go above.
                above = f"the budget {format_bytes(options.budget)}" if plan.feasible else "its prediction"
                warnings.warn(
                    f"fxremat {plan.graph}: the caller keeps {format_bytes(alive)} of outputs alive through the "
                    f"backward, which this plan took as dropped: this step can peak up to {format_bytes(alive)} "
                    f"above {above}; planning it again on its next call",
                    stacklevel=2,
                )
                graph.ask("its outputs stay alive through the backward", release_outputs=False)
            return
        if options.budget is None:
            # With no budget a backward changes the running plan's report, never the plan; once
            # whether the caller drops the outputs is settled, later calls only check their .grad.
            graph.watched += 1
            if not graph.released and options.release_outputs is None:
                _note_released(graph, plan, call)
            if graph.released or options.release_outputs is not None or graph.watched >= SETTLED_AFTER:
                graph.params_at = tuple(params_at)
            return
        if graph.released or options.release_outputs is not None:
            return
        alive = call.outputs_alive()
        released = plan.output_bytes - alive
        if released >= _replan_bytes(options.budget, plan):
            graph.released = True
            _DROPPED_BY_CALLER.update(graph.parameters)
            graph.ask(
                f"the caller dropped {format_bytes(released)} of its outputs before backward (as `model(x).loss` does)",
                release_outputs=True,
            )

    torch.autograd.graph.register_multi_grad_hook(
        differentiable, functools.partial(_outside_dynamo, backward_started), mode="any"
    )


@torch.compiler.disable
def _outside_dynamo(hook: Callable, grad) -> None:
    """Run a backward hook of fxremat's as Python. Compiled autograd hands hooks to Dynamo, which cannot
    trace this bookkeeping whole (formatting a size in a log line failed inside Dynamo once the step found
    .grad allocated). Wrapped once here: wrapping each call's hook cost 0.4 ms a call."""
    hook(grad)


def _note_caller(graph: TrackedGraph, grad, call: _Call) -> None:
    """What the caller computed on the graph's outputs before the backward, from the gradient it handed
    the backward: a dense one, not from a later compiled graph (``_Call.fed``), means a loss computed
    outside the compiled model, which allocates memory the plan does not count while the graph's saved
    activations are alive (a 16-layer MLP with ``model(x).square().mean()`` peaked 1.11x a budget
    planned without it). Under a budget and no ``reserve`` of the user's, once:

    - a first plan that left room for it (``_caller_room``) keeps ``CALLER_RESERVE`` times that
      gradient and gives the rest back (planned again when that is a real share of the budget and
      the plan recomputes: more room makes it faster);
    - one that did not warns, and the graph is planned again with that room.

    fxremat cannot watch the caller from inside the compiled call (a dispatch mode pushed there is
    switched off when Dynamo's frame returns), so the room is sized from the gradient handed back.
    """
    plan, options = graph.plan, graph.options
    if graph.caller_checked or plan is None or options.budget is None or graph.user_reserve:
        return
    handed = 0
    if isinstance(grad, torch.Tensor) and _real(grad) and grad.numel() > 1 and not call.fed:
        handed = grad.untyped_storage().nbytes()
        if handed < grad.numel() * grad.element_size() or handed < REPLAN_MIN_SHARE * options.budget:
            handed = 0  # a broadcast one (the outputs' sum or mean: nothing allocated), or a small one
    if graph.caller_reserved:
        graph.caller_checked = True
        need = CALLER_RESERVE * handed
        spare = graph.caller_reserved - need
        recomputes = plan.recompute_flops > 0 or plan.recompute_seconds > 0 or bool(plan.chunked)
        if spare < 0 or (spare >= REPLAN_MIN_SHARE * options.budget and recomputes):
            graph.caller_reserved = need
            graph.ask(
                f"its caller needs {format_bytes(need)} of the {format_bytes(need + spare)} left for a loss computed "
                "on its outputs",
                reserve=(graph.pending or options).reserve - spare,
            )
        return
    if call.fed:
        graph.caller_checked = True  # its outputs feed a later compiled graph, which counts what it does
        return
    if not handed:
        return
    graph.caller_checked = True
    reserve = CALLER_RESERVE * handed
    if not plan.feasible:
        # The least plan runs (the budget out of reach): with room reserved it would be the same plan,
        # compiled again (timm's resnet18 with budget=1: a second plan and compile at its second step).
        log.info(
            "fxremat %s: the caller computed on its outputs before the backward (%s of gradients handed back); "
            "the least-memory plan already runs, so no room is reserved for it",
            plan.graph,
            format_bytes(handed),
        )
        return
    warnings.warn(
        f"fxremat {plan.graph}: the caller computed on its outputs before the backward (it handed back "
        f"{format_bytes(handed)} of gradients: a loss computed outside the compiled model); what it allocates there "
        f"is not in this plan, so this step can exceed the budget. Planning it again with {format_bytes(reserve)} "
        f"({CALLER_RESERVE}x that gradient) reserved for the caller; set options={{'reserve': ...}} to size it "
        "yourself, or compile the function that computes the loss too",
        stacklevel=2,
    )
    graph.ask(
        f"reserving {format_bytes(reserve)} for what its caller allocates around it (a loss outside the graph)",
        reserve=(graph.pending or options).reserve + reserve,
    )


# (backward node of a call, its graph, its parameters' bytes) for calls whose backward may add
# the gradients into ``.grad``.
_AWAITING: list[tuple[weakref.ref, weakref.ref, int]] = []


def _handed_over(node, handed: bool) -> None:
    """``fxremat/grads.py``: the backward running ``node`` adds its gradients into ``.grad`` as it makes
    them (``handed``), or returns them at its end."""
    if node is None:
        return
    with _LOCK:
        if not _AWAITING:
            return
        hits = [(g, nbytes) for n, g, nbytes in _AWAITING if n() is node]
        if not hits:
            return
        _AWAITING[:] = [a for a in _AWAITING if a[0]() is not node and a[0]() is not None]
    for ref, nbytes in hits:
        graph = ref()
        if graph is not None:
            graph.note_handed_over() if handed else graph.note_returned(nbytes)


on_hand_over(_handed_over)


def _node(outputs) -> weakref.ref | None:
    """A weak reference to the backward node of the call that made ``outputs``, when it can have one.

    Logits given their gradient path outside the graph (``chunk_loss.reattach_head_grads``) have
    their own node, alive only as long as they are: another output's node stands for the call.
    """
    for o in sorted(outputs, key=lambda o: is_head_gradient(o.grad_fn)):
        try:
            return weakref.ref(o.grad_fn)
        except TypeError:  # a node type without weak references: liveness from the outputs alone
            return None
    return None


# The running plan's note while its backward finds the parameters' .grad allocated: taken out again when
# one does not (a loop that sets .grad to None every few micro-batches appended it at each switch).
GRADS_EXIST_NOTE = "the parameters' .grad exist before the backward"


def _without_grads_note(note: str) -> str:
    return "; ".join(part for part in note.split("; ") if not part.startswith(GRADS_EXIST_NOTE))


def _note_grads(graph: TrackedGraph, exist: bool) -> None:
    """The running plan's prediction follows whether this backward finds the parameters' ``.grad``
    allocated (its gradients are then added in as they are made, ``fxremat/grads.py``) or not (they
    stay alive to the end as new ``.grad``): the same plan and programs, no recompile. Under a budget
    the plan was chosen for the second case, the higher peak, so it fits both; a plan chosen for the
    first (``Options.grads_allocated``) keeps its prediction (``TrackedGraph.note_returned`` warns
    when such a backward returns its gradients)."""
    plan = graph.plan
    if plan is None or graph.for_grads or exist == (graph.returned_peak is not None):
        return
    if exist:
        graph.returned_peak = plan.predicted_peak
        peak = plan.released_accumulating_peak if graph.released else plan.accumulating_peak
        note = GRADS_EXIST_NOTE
        if peak != plan.predicted_peak:
            note += ": predicted with the gradients added in as made"
        graph.plan = dataclasses.replace(plan, predicted_peak=peak, note="; ".join(filter(None, [plan.note, note])))
    else:
        assert graph.returned_peak is not None
        peak, graph.returned_peak = graph.returned_peak, None
        graph.plan = dataclasses.replace(plan, predicted_peak=peak, note=_without_grads_note(plan.note))
    log.info(
        "fxremat %s: the parameters' .grad %s before the backward; predicted peak %s -> %s (same plan)",
        plan.graph,
        "exist" if exist else "do not exist",
        format_bytes(plan.predicted_peak),
        format_bytes(peak),
    )


def _note_released(graph: TrackedGraph, plan: Plan, call: _Call) -> None:
    """No budget: outputs dropped before the backward change the prediction, not the plan (no recompile).

    The running plan's ``predicted_peak`` becomes its ``released_peak`` (the same
    programs replayed with the outputs freed when the backward starts).
    """
    alive = call.outputs_alive()
    if plan.output_bytes - alive < _replan_bytes(None, plan):
        return
    graph.released = True
    _DROPPED_BY_CALLER.update(graph.parameters)
    peak = plan.released_peak
    if graph.returned_peak is not None:  # this backward also adds the gradients into existing .grad
        graph.returned_peak, peak = plan.released_peak, plan.released_accumulating_peak
    graph.plan = dataclasses.replace(
        plan,
        predicted_peak=peak,
        note="; ".join(
            filter(None, [plan.note, "the caller drops the outputs before the backward: predicted with them freed"])
        ),
    )
    log.info(
        "fxremat %s: the caller dropped its outputs before the backward; predicted peak %s -> %s (same plan)",
        plan.graph,
        format_bytes(plan.predicted_peak),
        format_bytes(peak),
    )
